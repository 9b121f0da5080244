"""`titans-hf demo`: the CPU demo (`scripts/demo.sh`), the user's recipe run offline on a toy Qwen3 base; prints what
it measured: accuracy with and without the memory at each length."""

from __future__ import annotations

import argparse
import logging

from titans_hf.commands.demo_job import DemoSettings, run_demo
from titans_hf.modeling.configuration_titans_qwen import VARIANTS
from titans_hf.modeling.update_rules import UPDATE_RULES
from titans_hf.tasks.babilong import GENERATED_TASKS
from titans_hf.tasks.babilong.evaluation import format_distance_table, format_results_table

from .arguments import length, local_or_hub


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="the whole recipe offline, in minutes: a toy Qwen3 base learns to use a memory on BABILong",
        description="Pretrain a toy Qwen3 base (or take --model), freeze it, train a Titans memory on BABILong with "
        "the titans-hf train code, and score it with and without the memory.",
    )
    parser.add_argument("--model", default=None, type=local_or_hub,
                        help="a pretrained Qwen2/Qwen3 (local folder or Hub id) used as the frozen base; skips stage a")
    parser.add_argument("--output-dir", default="outputs/demo",
                        help="the folder the demo writes its outputs into (base, data, memory, results, plots)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the outputs an earlier demo wrote there (files of yours beside them stay; a "
                             "folder titans_hf did not write is never written into)")
    parser.add_argument("--task", default="qa1", choices=GENERATED_TASKS)
    parser.add_argument("--chunk-size", type=length, default=32, help="attention segment in tokens")
    parser.add_argument("--train-chunks", type=int, nargs="+", default=[0, 4, 8, 16, 32],
                        help="input lengths trained on, in chunks (0 = bare stories)")
    parser.add_argument("--eval-chunks", type=int, nargs="+", default=[4, 256, 1024],
                        help="input lengths evaluated, in chunks")
    parser.add_argument("--pretrain-steps", type=int, default=800, help="stage a: pretraining steps of the toy base")
    parser.add_argument("--entity-share", type=float, default=0.5,
                        help="stage a: share of the pretraining sentences about the story's people and places")
    parser.add_argument("--num-train-samples", type=int, default=1000, help="rows per training length")
    parser.add_argument("--num-eval-samples", type=int, default=200, help="rows per evaluation length")
    parser.add_argument("--epochs", type=int, default=11,
                        help="the first on one-chunk rows, then one trained length more each epoch")
    parser.add_argument("--curriculum", default="staged", choices=["staged", "two-stage"],
                        help="staged: each epoch after the first admits the rows of the next trained length; "
                             "two-stage: the second epoch admits them all")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop stage b after this many steps (-1: the epochs)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--variant", default=None, choices=VARIANTS, help="default: the config's")
    parser.add_argument("--memory-layers", type=int, nargs="+", default=None, help="default: the config's")
    parser.add_argument("--memory-depth", type=int, default=None, help="default: the config's")
    parser.add_argument("--update-rule", default=None, choices=sorted(UPDATE_RULES),
                        help="default: the config's (delta; a memory deeper than 1 needs gradient)")
    parser.add_argument("--state-passing", type=float, default=0.5,
                        help="share of training rows whose memory starts where another row's ended (0 to 1)")
    parser.add_argument("--haystack", nargs="+", default=[],
                        help="text files or folders of prose that training rows take their haystack from, beside the "
                             "built-in prose (each an equal share); scripts/fetch_haystacks.py gathers some")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 measured fastest for this small model; more only adds overhead)")
    parser.set_defaults(func=demo_command)


def demo_command(args: argparse.Namespace) -> int:
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO, datefmt="%H:%M:%S")
    logging.getLogger("transformers").setLevel(logging.WARNING)
    overrides = {"variant": args.variant, "memory_layers": args.memory_layers, "memory_depth": args.memory_depth,
                 "update_rule": args.update_rule}
    if args.variant == "mac":
        overrides["num_memory_tokens"] = 4
    settings = DemoSettings(
        base=args.model,
        task=args.task,
        chunk_size=args.chunk_size,
        train_chunks=tuple(args.train_chunks),
        eval_chunks=tuple(args.eval_chunks),
        pretrain_steps=args.pretrain_steps,
        entity_share=args.entity_share,
        num_train_samples=args.num_train_samples,
        num_eval_samples=args.num_eval_samples,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        staged_curriculum=args.curriculum == "staged",
        state_passing=args.state_passing,
        haystacks=tuple(args.haystack),
        memory_settings={key: value for key, value in overrides.items() if value is not None},
        seed=args.seed,
    )
    demo = run_demo(args.output_dir, settings, overwrite=args.overwrite, threads=args.threads)
    info = demo["run_info"]
    timings = info["timings"]
    print()
    if "stage_a_s" in timings:
        pretraining = info["pretraining"]
        similarity = pretraining["embedding_similarity"]
        print(f"stage a (toy Qwen3 base, {pretraining['steps']} steps): {timings['stage_a_s']:.0f}s; mean cosine of "
              f"its embeddings: actors {similarity['actors']:.2f}, locations {similarity['locations']:.2f}")
    accuracy = info["base_accuracy"]
    which = "that fit one chunk" if accuracy["fits_one_chunk"] else f"of up to {accuracy['max_prompt_tokens']} tokens"
    print(f"base alone, full attention, {accuracy['rows']} stories {which}: "
          f"{100 * accuracy['exact_match']:.1f}% (last place mentioned "
          f"{100 * accuracy['last_location_baseline']:.1f}%, chance {100 * accuracy['chance']:.1f}%)")
    params = info["trainable_parameters"]
    print(f"stage b: trainable (memory) parameters {params['memory']:,} of {params['total']:,} "
          f"({100 * params['share']:.1f}%), {info['steps']} steps in {timings['stage_b_train_s']:.0f}s, "
          f"evaluation {timings['eval_s']:.0f}s")
    if "base_unchanged" in info:
        print(f"base weights bitwise unchanged by stage b: {'yes' if info['base_unchanged'] else 'NO'}")
    print(f"\nBABILong {info['task']}, input lengths in tokens (chunks of {info['chunk_size']}; trained up to "
          f"{max(info['train_lengths'])} tokens), accuracy in %:")
    print(format_results_table(demo["results"]))
    settings = info["memory_settings"]
    for length in info["eval_lengths"]:
        updates = length // settings["memory_chunk_size"]
        written = (f"up to {length:,} writes over a fact (the {settings['update_rule']} rule writes every token)"
                   if UPDATE_RULES[settings["update_rule"]].writes_every_token
                   else f"up to {updates:,} writes over a fact")
        print(f"  {length:,} tokens: {written}; {length // info['chunk_size']:,} chunks, {updates:,} memory updates "
              f"of {settings['memory_chunk_size']} tokens")
    print(f"\nby distance from the supporting fact to the question:\n{format_distance_table(demo['results'])}")
    print(f"\ntotal {timings['total_s']:.0f}s")
    paths = demo["paths"]
    print(f"results:     {paths['results']}\nheatmap:     {paths['heatmap']}\nby distance: {paths['distance_plot']}\n"
          f"loss curve:  {paths['loss_curve']}\n"
          f"memory:      {paths['memory']}  (titans-hf push {paths['memory']} YOUR_NAME/REPO)")
    if paths["base"] is not None:
        print(f"base model:  {paths['base']}  (the toy Qwen3 base pretrained here, with its tokenizer)")
    return 0
