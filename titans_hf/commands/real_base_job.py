"""The real-base job (`scripts/real_base.sh`): the user's recipe on a real pretrained model, with a prompt that model
can answer.

The CPU demo's toy base learned BABILong's bare prompt ("...\\n\\nQuestion: Where is Mary? \\nAnswer:")
in its pretraining; a pretrained instruct model answers it with " The kitchen.", " Mary" or nothing, which the
exact-match scorer (the first word) cannot credit. The rows this job writes keep BABILong's fields and the
project's prompt template, and put the instructions into the fields themselves (`formatted_row` in `CHOSEN_FORMAT`):
the input opens with the model's own chat template up to the user's message, and the question lists the six places
and closes the user's turn, so that "Answer:" comes right after the assistant's header. Measured on the converted
SmolLM2-135M-Instruct (`formats`, docs/real_base.md), this is the format whose answers are one of the six places.

Stages, each a subcommand of ``python -m titans_hf.commands.real_base_job``:

- ``formats``: the frozen base with full attention on bare stories, under each of `PROMPT_FORMATS`: the share of
  answers that name a place and the exact match.
- ``prepare``: the rows (training: bare stories and inputs of `train_chunks`; evaluation: inputs of `eval_chunks`,
  other seeds) as BABILong JSON files under ``data/``, and ``train_args.json``, the flags of ``titans-hf train``
  (the memory's layer at `MEMORY_DEPTH_FRACTION` of the base's depth, the curriculum's stages from the rows' chunk
  counts).
- ``report``: the frozen base with full attention on the evaluation rows (every one fits its context: its ceiling),
  joined with ``titans-hf eval``'s memory on / off on the same rows into ``results.json`` and ``accuracy.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from titans_hf.commands.demo_job import row_chunks
from titans_hf.files import atomic_write, atomic_write_json
from titans_hf.outputs import check_outputs, record_outputs
from titans_hf.tasks.babilong import (
    LOCATIONS,
    generate_babilong,
    score_exact_match,
    write_babilong_json,
)
from titans_hf.tasks.babilong.evaluation import evaluate_babilong, greedy_generation_config, prompt_ids

TASK = "qa1"
CHOICES = "Choose one: " + ", ".join(LOCATIONS) + "."
# The memory's layer, as a share of the base's decoder layers: late enough that the answer position already holds
# the question's subject and that training backpropagates through few frozen layers (docs/real_base.md).
MEMORY_DEPTH_FRACTION = 0.8
MEMORY_SETTINGS = dict(
    conv_kernel=8,  # spans " Mary journeyed to the kitchen." in SmolLM2's tokens
    memory_chunk_size=8,
    # the write gate open from the start and no write cost: inputs of at most 16 chunks ask the memory to learn to
    # write, not to keep writes small over thousands of chunks (docs/real_base.md, "The memory")
    theta_bias_init=-2.0,
    write_cost=0.0,
    checkpoint_chunks=False,  # rows of about a thousand tokens: recomputation would only cost time
)
TRAIN_ARGS_NAME = "train_args.json"
DATA_DIR_NAME = "data"
MEMORY_DIR_NAME = "memory"
EVAL_DIR_NAME = "eval"
CEILING_DIR_NAME = "ceiling"
RESULTS_NAME = "results.json"
PLOT_NAME = "accuracy.png"


def chat_wrapping(tokenizer) -> tuple[str, str]:
    """(text before, text after) a user's message in the tokenizer's chat template, with the assistant's header
    after it; ("", "") for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
    before, _, after = rendered.partition(marker)
    return before, after


# name -> (chat wrapping?, question's suffix); the measured formats of `formats`
PROMPT_FORMATS: dict[str, tuple[bool, str]] = {
    "babilong": (False, ""),
    "one_word": (False, " Answer with one word."),
    "choices": (False, " " + CHOICES),
    "chat_one_word": (True, " Answer with one word."),
    "chat_choices": (True, " " + CHOICES),
}
CHOSEN_FORMAT = "chat_choices"


def formatted_row(row: Mapping[str, str], name: str, wrapping: tuple[str, str]) -> dict[str, str]:
    """`row` in prompt format `name` of `PROMPT_FORMATS`, under the project's template: with the chat `wrapping`
    the input opens the user's turn and the question closes it; the question still starts "Where is Mary?", as
    the scorers read it, and the target stays the place."""
    chat, suffix = PROMPT_FORMATS[name]
    before, after = wrapping if chat else ("", "")
    return {"input": before + row["input"], "question": f"{row['question'].strip()}{suffix}{after}",
            "target": row["target"]}


def compare_formats(base: str, num_rows: int = 50, seed: int = 900) -> dict[str, dict[str, Any]]:
    """The frozen base (full attention) on `num_rows` bare QA1 stories in every prompt format: the share of answers
    whose first word is a place, the exact match, and the most frequent first words."""
    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=False).eval()
    config = greedy_generation_config(model, tokenizer, max_new_tokens=3)
    rows, wrapping = generate_babilong(TASK, num_rows, 0, tokenizer, seed=seed), chat_wrapping(tokenizer)
    measured = {}
    for name in PROMPT_FORMATS:
        first_words: dict[str, int] = {}
        exact = places = 0
        for row in (formatted_row(row, name, wrapping) for row in rows):
            ids = prompt_ids(row, tokenizer)
            with torch.no_grad():
                output = model.generate(input_ids=torch.tensor([ids]), generation_config=config)
            answer = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
            first = (answer.split() or [""])[0].strip(".,;:!?\"'()").lower()
            first_words[first] = first_words.get(first, 0) + 1
            exact += score_exact_match(answer, row["target"])
            places += first in LOCATIONS
        common = sorted(first_words.items(), key=lambda item: -item[1])[:4]
        measured[name] = {"place_answers": places / num_rows, "exact_match": exact / num_rows,
                          "first_words": dict(common)}
    return measured


def prepare(base: str, output_dir: str | Path, chunk_size: int = 64, train_chunks: Sequence[int] = (0, 4, 8),
            eval_chunks: Sequence[int] = (4, 8, 16), train_rows: int = 300, eval_rows: int = 100, epochs: int = 4,
            max_steps: int = -1, batch_size: int = 8, learning_rate: float = 3e-3, device: str = "cpu",
            seed: int = 0, dtype: str | None = "bfloat16", overwrite: bool = False) -> dict[str, Any]:
    """Write the training and evaluation rows (in `CHOSEN_FORMAT`) as BABILong JSON under `output_dir`/data and the
    flags of ``titans-hf train`` as `output_dir`/train_args.json; returns those flags.

    Lengths are inputs of so many chunks (0: the bare story). Training goes one curriculum stage per epoch (the
    bare stories, then rows of up to each trained length), then all rows. The frozen base is loaded in `dtype`
    (None: its checkpoint's), the memory stays float32; on ``device`` "cuda" training also runs in bfloat16
    autocast."""
    if min(train_chunks) < 0 or min(eval_chunks) < 1 or chunk_size < 1:
        raise ValueError(f"prepare: train_chunks {list(train_chunks)} must be >= 0, eval_chunks {list(eval_chunks)} "
                         f">= 1 and chunk_size {chunk_size} >= 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"prepare: device {device!r} must be cpu or cuda")
    output = Path(output_dir)
    data = output / DATA_DIR_NAME
    train_files = {chunks: data / "train" / TASK / f"{chunks * chunk_size}.json" for chunks in train_chunks}
    eval_files = {chunks: data / EVAL_DIR_NAME / TASK / f"{chunks * chunk_size}.json" for chunks in eval_chunks}
    check_outputs([*train_files.values(), *eval_files.values(), output / TRAIN_ARGS_NAME], overwrite)

    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
    layers = AutoConfig.from_pretrained(base, trust_remote_code=False).num_hidden_layers
    wrapping = chat_wrapping(tokenizer)
    stage_chunks = set()
    for index, (chunks, path) in enumerate(train_files.items()):
        rows = [formatted_row(row, CHOSEN_FORMAT, wrapping) for row in
                generate_babilong(TASK, train_rows, chunks * chunk_size, tokenizer, seed=1000 * seed + 100 + index)]
        stage_chunks.add(max(row_chunks(rows, tokenizer, chunk_size)))
        write_babilong_json(rows, path)
    for index, (chunks, path) in enumerate(eval_files.items()):
        rows = generate_babilong(TASK, eval_rows, chunks * chunk_size, tokenizer, seed=1000 * seed + 500 + index)
        write_babilong_json([formatted_row(row, CHOSEN_FORMAT, wrapping) for row in rows], path)
    for folder in {path.parent for path in [*train_files.values(), *eval_files.values()]}:
        record_outputs(folder, [path.name for path in [*train_files.values(), *eval_files.values()]
                                if path.parent == folder], "titans_hf.commands.real_base_job prepare")
    stages = sorted(stage_chunks)
    arguments = {
        "model_name_or_path": base,
        **({"dtype": dtype} if dtype is not None else {}),
        "data_files": [str(path) for path in train_files.values()],
        "max_length": (max(stages) + 1) * chunk_size,
        "answer_reserve_tokens": 16,
        "generation_seed": seed,
        "chunk_size": chunk_size,
        "memory_layers": [int(MEMORY_DEPTH_FRACTION * layers)],
        **MEMORY_SETTINGS,
        "output_dir": str(output / MEMORY_DIR_NAME),
        "overwrite_output_dir": overwrite,
        "per_device_train_batch_size": batch_size,
        "gradient_accumulation_steps": 1,  # the recipe's 8 suit rows of 32k tokens; these rows fit a batch whole
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": 10,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "num_train_epochs": epochs,
        "max_steps": max_steps,
        "curriculum_chunks": stages,
        "curriculum_epochs_per_stage": 1,
        "state_passing": 0.5,
        # the base's layers below the memory computed once per row: each later epoch runs the layers from the memory
        # up (the same losses and gradients)
        "frozen_trunk_cache_gb": 4.0,
        "log_every_batches": 5,
        "save_strategy": "no",
        "report_to": [],
        "seed": seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        **({"use_cpu": True} if device == "cpu" else {"bf16": True}),
    }
    atomic_write_json(output / TRAIN_ARGS_NAME, arguments)
    record_outputs(output, [TRAIN_ARGS_NAME], "titans_hf.commands.real_base_job prepare")
    return arguments


def report(base: str, output_dir: str | Path, batch_size: int = 16, device: str | None = None,
           dtype: str | None = "bfloat16", stage_seconds: Mapping[str, float] | None = None,
           overwrite: bool = False) -> dict[str, Any]:
    """The frozen base with full attention on the evaluation rows (`output_dir`/ceiling), joined with
    ``titans-hf eval``'s results (`output_dir`/eval/results.json) into `output_dir`/results.json and accuracy.png.

    One entry per length: chance, the last place named, the ceiling, the memory off and on (with the memory on
    where the last place named is wrong), and the number of rows."""
    output = Path(output_dir)
    evaluated = output / EVAL_DIR_NAME / RESULTS_NAME
    if not evaluated.is_file():
        raise FileNotFoundError(f"report: {evaluated} is missing; run titans-hf eval --output {evaluated.parent} "
                                "first")
    evaluation = json.loads(evaluated.read_text(encoding="utf-8"))
    memory, chunk_size = evaluation["details"][TASK], evaluation["chunk_size"]
    check_outputs([output / RESULTS_NAME, output / PLOT_NAME], overwrite)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(  # transformers turns a dtype name into the torch dtype
        base, trust_remote_code=False, **({"dtype": dtype} if dtype is not None else {})).eval()
    if device is not None:
        model.to(device)
    files = {(TASK, length): output / DATA_DIR_NAME / EVAL_DIR_NAME / TASK / f"{length}.json" for length in memory}
    ceiling = evaluate_babilong(model, tokenizer, files, max_new_tokens=3, batch_size=batch_size,
                                output_dir=output / CEILING_DIR_NAME, ablation=False, show_progress=False)
    lengths = []
    for length, cell in sorted(memory.items(), key=lambda item: int(item[0])):
        lengths.append({
            "input_tokens": int(length), "chunks": int(length) // chunk_size, "num_samples": cell["num_samples"],
            "chance": cell["chance"], "last_location_baseline": cell["last_location_baseline"],
            "full_attention": ceiling["details"][TASK][length]["memory"]["exact_match"],
            "memory_off": cell["no_memory"]["exact_match"], "memory_on": cell["memory"]["exact_match"],
            "memory_on_not_last_location": cell["memory"]["exact_match_not_last_location"],
        })
    results = {"task": TASK, "base": base, "dtype": dtype, "chunk_size": chunk_size, "prompt_format": CHOSEN_FORMAT,
               "metric": "exact_match", "lengths": lengths,
               "timings_s": {**(stage_seconds or {}), "full_attention_eval": round(time.time() - started, 1)},
               "files": {"memory": f"{EVAL_DIR_NAME}/{RESULTS_NAME}", "full_attention": f"{CEILING_DIR_NAME}/"
                         f"{RESULTS_NAME}"}}
    plot_accuracy(results, output / PLOT_NAME)
    atomic_write_json(output / RESULTS_NAME, results)
    record_outputs(output, [PLOT_NAME, RESULTS_NAME], "titans_hf.commands.real_base_job report")
    return results


def plot_accuracy(results: Mapping[str, Any], path: Path) -> Path:
    """Exact match per input length (chunks): the base with full attention, the memory off and on, beside chance
    and the last place named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["lengths"]
    series = (("full_attention", "base, full attention (ceiling)"), ("memory_off", "memory off"),
              ("memory_on", "memory on"))
    figure, axis = plt.subplots(figsize=(1.5 + 1.4 * len(cells), 3.6))
    width = 0.8 / len(series)
    for offset, (key, label) in enumerate(series):
        axis.bar([index + (offset - 1) * width for index in range(len(cells))],
                 [100 * cell[key] for cell in cells], width, label=label)
    axis.axhline(100 * cells[0]["chance"], color="grey", linestyle=":", label="chance")
    axis.plot(range(len(cells)), [100 * cell["last_location_baseline"] for cell in cells], "k_", markersize=18,
              label="last place named")
    axis.set_xticks(range(len(cells)), [f"{cell['chunks']} chunks\n({cell['input_tokens']} tokens)"
                                        for cell in cells], fontsize=8)
    axis.set_ylim(0, 100)
    axis.set_ylabel("exact match (%)")
    axis.set_title(f"BABILong {results['task']} on {results['base']}, chunks of "
                   f"{results['chunk_size']} tokens", fontsize=9)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))
    plt.close(figure)
    return path


def _seconds(values: Sequence[str]) -> dict[str, float]:
    """`name=seconds` pairs of the command line as a dict."""
    parsed = {}
    for value in values:
        name, equals, seconds = value.partition("=")
        try:
            parsed[name] = float(seconds)
        except ValueError:
            raise ValueError(f"--seconds {value!r}: give NAME=SECONDS") from None
        if not equals or not name:
            raise ValueError(f"--seconds {value!r}: give NAME=SECONDS")
    return parsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titans_hf.commands.real_base_job", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    stages = parser.add_subparsers(dest="stage", required=True)
    formats = stages.add_parser("formats", help="the base's answers under each prompt format")
    formats.add_argument("--base", required=True)
    formats.add_argument("--rows", type=int, default=50)
    to_prepare = stages.add_parser("prepare", help="rows and train_args.json")
    to_report = stages.add_parser("report", help="the full-attention ceiling and results.json")
    for stage in (to_prepare, to_report):
        stage.add_argument("--base", required=True)
        stage.add_argument("--output-dir", required=True)
        stage.add_argument("--overwrite", action="store_true")
        stage.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                           help="the frozen base's dtype (the memory stays float32)")
    to_prepare.add_argument("--chunk-size", type=int, default=64)
    to_prepare.add_argument("--train-chunks", type=int, nargs="+", default=[0, 4, 8])
    to_prepare.add_argument("--eval-chunks", type=int, nargs="+", default=[4, 8, 16])
    to_prepare.add_argument("--train-rows", type=int, default=300, help="rows per trained length")
    to_prepare.add_argument("--eval-rows", type=int, default=100, help="rows per evaluated length")
    to_prepare.add_argument("--epochs", type=int, default=4)
    to_prepare.add_argument("--max-steps", type=int, default=-1)
    to_prepare.add_argument("--batch-size", type=int, default=8)
    to_prepare.add_argument("--learning-rate", type=float, default=3e-3)
    to_prepare.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    to_prepare.add_argument("--seed", type=int, default=0)
    to_report.add_argument("--batch-size", type=int, default=16)
    to_report.add_argument("--device", default=None)
    to_report.add_argument("--seconds", nargs="*", default=[], help="NAME=SECONDS of earlier stages, reported")
    args = parser.parse_args(argv)
    if args.stage == "formats":
        for name, measured in compare_formats(args.base, args.rows).items():
            print(f"{name:14s} answers naming a place {100 * measured['place_answers']:5.1f}%  exact match "
                  f"{100 * measured['exact_match']:5.1f}%  first words {measured['first_words']}")
    elif args.stage == "prepare":
        arguments = prepare(args.base, args.output_dir, args.chunk_size, args.train_chunks, args.eval_chunks,
                            args.train_rows, args.eval_rows, args.epochs, args.max_steps, args.batch_size,
                            args.learning_rate, args.device, args.seed, args.dtype, args.overwrite)
        print(f"wrote {Path(args.output_dir) / TRAIN_ARGS_NAME}: memory on layer {arguments['memory_layers'][0]}, "
              f"curriculum {arguments['curriculum_chunks']} chunks")
    else:
        results = report(args.base, args.output_dir, args.batch_size, args.device, args.dtype,
                         _seconds(args.seconds), args.overwrite)
        print("input (chunks)  rows  chance  last place  full attention  memory off  memory on")
        for cell in results["lengths"]:
            print(f"{cell['input_tokens']:>6} ({cell['chunks']:>2})  {cell['num_samples']:>5}  "
                  f"{100 * cell['chance']:5.1f}  {100 * cell['last_location_baseline']:9.1f}  "
                  f"{100 * cell['full_attention']:14.1f}  {100 * cell['memory_off']:10.1f}  "
                  f"{100 * cell['memory_on']:9.1f}")
        print(f"wrote {Path(args.output_dir) / RESULTS_NAME}, {Path(args.output_dir) / PLOT_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
