"""`titans-hf eval`: a task's accuracy per task and length with the memory on and off (BABILong, or any task of
`titans_hf.tasks.TASKS`), as JSON and a heatmap; with `--lm`, loss per chunk index on held-out windows of token
stores, as JSON and a plot."""

from __future__ import annotations

import argparse
from pathlib import Path

import datasets
import torch

from titans_hf.data.tokenizers import check_tokenizer_argument
from titans_hf.data.tokens_builder import check_stores_tokenizer, store_data_files
from titans_hf.lm_evaluation import LM_OUTPUT_NAMES, LM_PLOT_NAME, LM_RESULTS_NAME, evaluate_lm, format_lm_table
from titans_hf.outputs import prepare_output_dir
from titans_hf.tasks import Task, eval_task_names, task, task_for_eval
from titans_hf.tasks.babilong import length_tokens
from titans_hf.tasks.babilong.evaluation import babilong_files_by_task_length, load_model_for_eval
from titans_hf.tasks.babilong.generate import read_haystack_sentences

from .arguments import add_model_arguments, length
from .babilong import add_haystack_arguments, haystack_from_arguments


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "eval",
        help="score a memory with and without it: BABILong accuracy, or with --lm loss per chunk on your documents",
        description="What the memory buys, measured on the same weights with the memory on and off. BABILong: the "
        "model's greedy answers to questions about facts hidden in long inputs, scored per task and length (exact "
        "match and BABILong's label substring), beside the 'last place mentioned' guess; writes results.json, "
        "heatmap.png and predictions.jsonl to --output. With --lm: loss and perplexity per chunk index on windows "
        "of your token stores (from titans-hf prepare); writes lm_results.json and loss_per_chunk.png.",
    )
    add_model_arguments(parser, "cuda" if torch.cuda.is_available() else None,
                        "e.g. cuda or cpu (default: cuda when there is one)")
    data = parser.add_argument_group("the data (BABILong rows; with --lm, token stores)")
    source = data.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+",
                        help="BABILong files or folders: the Hub sets' LENGTH/TASK-0000i-of-0000n.parquet (a "
                        "downloaded snapshot folder finds them all), or TASK/LENGTH.json / .jsonl, e.g. qa1/32k.json; "
                        "with --lm, token stores (.h5, .bin store files or folders)")
    source.add_argument("--generate", action="store_true", help="generate rows offline (--tasks, --lengths)")
    data.add_argument("--tasks", nargs="+", default=None,
                      help="--data: only these tasks (one task also names files whose path does not; a task of "
                      "another package than BABILong, e.g. passkey, scores the files as that task); --generate: "
                      f"tasks to generate, of {eval_task_names()} (default qa1); one task package a run")
    data.add_argument("--lengths", nargs="+", default=None,
                      help="--data: only these length labels (e.g. 4k 32k; one also names files whose path does "
                      "not); --generate: input lengths in tokens (e.g. 3500 or 4k = 4096), required")
    data.add_argument("--num-samples", type=int, default=100, help="rows per task and length (--generate)")
    data.add_argument("--seed", type=int, default=1, help="generation seed; use one the training data did not")
    add_haystack_arguments(data, " (--generate)")
    data.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per answer")
    lm = parser.add_argument_group("--lm: loss per chunk on token stores")
    lm.add_argument("--lm", action="store_true",
                    help="language-model evaluation: --data names token stores (.h5, .bin store files or folders)")
    lm.add_argument("--window-size", type=length, default=None, help="tokens per window, e.g. 4096 or 4k (required)")
    lm.add_argument("--stride", type=length, default=None, help="tokens between windows (default: the window)")
    lm.add_argument("--train-type", default="seq", choices=["seq", "sft"],
                    help="seq counts every token, sft only those its loss mask marks")
    lm.add_argument("--respect-document-boundaries", action="store_true", help="keep every window inside one document")
    lm.add_argument("--pad-tail", action="store_true",
                    help="also keep the last, shorter window (of each document), right-padded")
    lm.add_argument("--boundary-tokens", type=int, default=8,
                    help="the loss of this many tokens at the start of every later chunk is reported too")
    lm.add_argument("--max-windows", type=int, default=None, help="evaluate the first N windows only")
    run = parser.add_argument_group("the run")
    run.add_argument("--batch-size", type=int, default=1,
                     help="rows per batch; rows of mixed lengths share batches and answer as each row alone")
    run.add_argument("--no-ablation", action="store_true", help="skip the pass with the memory switched off")
    run.add_argument("--output", required=True,
                     help="folder for results.json, heatmap.png, predictions.jsonl (--lm: lm_results.json, "
                     "loss_per_chunk.png)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the outputs of an earlier titans-hf eval in --output (never files it did not "
                     "write); without it existing outputs are kept and the command stops before any work")
    parser.set_defaults(func=eval_command)


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse, before any model loads, a device this machine does not have, naming `flag`."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{flag} {device}: not a device ({error})") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {device}: CUDA is not available on this machine (torch.cuda.is_available() "
                             "is False); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {device}: MPS is not available on this machine; use --device cpu")


def _check_arguments(args: argparse.Namespace) -> None:
    """Every flag that can be wrong is checked before the (slow) model load, naming the flag."""
    for name, low in (("batch_size", 1), ("max_new_tokens", 1), ("num_samples", 1), ("boundary_tokens", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {low}")
    for name in ("window_size", "stride", "max_windows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    check_device(args.device)
    for flag, value in (("--model", args.model), ("--memory", args.memory), ("--tokenizer", args.tokenizer)):
        if value is not None:
            check_tokenizer_argument(value, flag)


def _task_of(names: list[str] | None, generate: bool) -> Task:
    """The one task package that scores `--tasks` (BABILong when none is named), checked before any model loads."""
    if not names:
        return task("babilong")
    if generate:
        unknown = [name for name in names if name not in eval_task_names()]
        if unknown:
            raise ValueError(f"titans-hf eval --generate writes {eval_task_names()}, not --tasks {unknown}")
    owners = {name: task_for_eval(name) if name in eval_task_names() else task("babilong") for name in names}
    packages = sorted({owner.name for owner in owners.values()})
    if len(packages) > 1:
        raise ValueError(f"titans-hf eval --tasks {names}: tasks of {packages} in one run; run each package alone "
                         "(their results differ in kind)")
    return next(iter(owners.values()))


def eval_command(args: argparse.Namespace) -> int:
    _check_arguments(args)
    if args.lm:
        return lm_eval_command(args)
    # Everything that can be checked is checked before the (slow) model load and generation.
    owner = _task_of(args.tasks, args.generate)
    if args.generate:
        if not args.lengths:
            raise ValueError("titans-hf eval --generate needs --lengths (input lengths in tokens)")
        tasks = args.tasks or ["qa1"]
        lengths = {label: length_tokens(label) for label in args.lengths}
        bad = [label for label, tokens in lengths.items() if tokens is None]
        if bad:
            raise ValueError(f"titans-hf eval --generate: --lengths {bad} are not lengths (tokens, e.g. 3500 or 4k)")
        haystack = haystack_from_arguments(args)
        if haystack["haystack_files"] or haystack["haystack_dataset"] is not None:
            read_haystack_sentences(**haystack)  # missing or unreadable text fails before the model loads
    else:
        data = babilong_files_by_task_length(args.data, args.tasks, args.lengths)
    prepare_output_dir(args.output, owner.output_names, overwrite=args.overwrite)
    model, tokenizer = load_model_for_eval(args.model, args.memory, args.tokenizer, args.dtype, args.device)
    if args.generate:
        data = {
            (name, label): owner.generate_rows(name, args.num_samples, tokens, tokenizer, args.seed, **haystack)
            for name in tasks
            for label, tokens in lengths.items()
        }
    results = owner.evaluate(
        model, tokenizer, data, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        output_dir=args.output, ablation=not args.no_ablation,
    )
    print(owner.format_results(results))
    written = [name for name in owner.output_names if (Path(args.output) / name).exists()]
    print(f"wrote {', '.join(str(Path(args.output) / name) for name in written)}")
    return 0


def lm_eval_command(args: argparse.Namespace) -> int:
    if not args.data:
        raise ValueError("titans-hf eval --lm needs --data naming token stores")
    if args.window_size is None:
        raise ValueError("titans-hf eval --lm needs --window-size (tokens per window)")
    files = store_data_files(args.data, "--data")
    prepare_output_dir(args.output, LM_OUTPUT_NAMES, overwrite=args.overwrite)
    model, tokenizer = load_model_for_eval(args.model, args.memory, args.tokenizer, args.dtype, args.device)
    check_stores_tokenizer(files, tokenizer, "the model's tokenizer (--tokenizer, else the base's)")
    windows = datasets.load_dataset(
        "titans_tokens", data_files=files, train_type=args.train_type, window_size=args.window_size,
        stride=args.stride, respect_document_boundaries=args.respect_document_boundaries, pad_tail=args.pad_tail,
        vocab_size=model.config.text_config.vocab_size, split="train",
    )
    if args.max_windows is not None:
        windows = windows.select(range(min(args.max_windows, len(windows))))
    results = evaluate_lm(model, windows, batch_size=args.batch_size, output_dir=args.output,
                          ablation=not args.no_ablation, boundary_tokens=args.boundary_tokens)
    print(format_lm_table(results))
    print(f"wrote {Path(args.output) / LM_RESULTS_NAME}, {Path(args.output) / LM_PLOT_NAME}")
    return 0
