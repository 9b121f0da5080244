"""BABILong evaluation: greedy answers with the memory on and off on the same weights, scored per task and length.

The ablation is the point of the exercise: besides the accuracy with and without memory, every cell reports what
the recency guess (the last location named) scores and the accuracy where that guess is wrong; the task's own
scoring lives in `titans_hf.tasks.babilong.scoring`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from titans_hf.tasks.babilong import (
    TASK_LABELS,
    build_example,
    last_location_baseline,
    last_mentioned_label,
    read_babilong_json,
    score_predictions,
)
from titans_hf.utils import atomic_write, atomic_write_text, resolve_pad_token_id

RESULTS_NAME = "results.json"
HEATMAP_NAME = "heatmap.png"
PREDICTIONS_NAME = "predictions.jsonl"
# No truncation at evaluation: the whole story is the test. build_example wants a budget; this one never binds.
_UNBOUNDED_LENGTH = 1 << 62

BabilongData = Mapping[tuple[str, int | str], Sequence[Mapping[str, str]] | str | os.PathLike]


# ----------------------------------------------------------------------------------------------
# Data


def babilong_files_by_task_length(paths: Sequence[str | os.PathLike]) -> dict[tuple[str, str], Path]:
    """Key BABILong JSON files by (task, length) read from their path, as the public set lays them out:
    `.../qa1/32k.json` is task "qa1" at length "32k"."""
    keyed: dict[tuple[str, str], Path] = {}
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise FileNotFoundError(f"BABILong file {path} does not exist")
        task, length = path.parent.name, path.stem
        if task not in TASK_LABELS:
            raise ValueError(
                f"BABILong file {path}: its folder names the task and must be one of {sorted(TASK_LABELS)} "
                f"(e.g. qa1/32k.json), got {task!r}"
            )
        if (task, length) in keyed:
            raise ValueError(f"BABILong files {keyed[(task, length)]} and {path} are both task {task} length {length}")
        keyed[(task, length)] = path
    return keyed


def _resolve_rows(task: str, length: int | str, source) -> list[Mapping[str, str]]:
    if task not in TASK_LABELS:
        raise ValueError(f"evaluate_babilong: task {task!r} (length {length}) is not one of {sorted(TASK_LABELS)}")
    if isinstance(source, (str, os.PathLike)):
        return read_babilong_json(source)
    rows = list(source)
    if not rows:
        raise ValueError(f"evaluate_babilong: no rows for task {task!r} length {length!r}")
    for index, row in enumerate(rows):
        missing = [field for field in ("input", "question", "target") if field not in row]
        if missing:
            raise ValueError(f"evaluate_babilong: task {task!r} length {length!r} row {index} lacks {missing}")
    return rows


def _prompt_ids(row: Mapping[str, str], tokenizer) -> list[int]:
    """The prompt exactly as training assembles it (same template, same special tokens), untruncated."""
    example = build_example(dict(row), tokenizer, _UNBOUNDED_LENGTH, answer_reserve_tokens=1, pad_to_max_length=False)
    return example["input_ids"][: example["prompt_length"]]


def _equal_length_batches(prompts: Sequence[list[int]], batch_size: int) -> list[list[int]]:
    """Row indices in batches of prompts of identical length.

    Padding is not neutral for this model: the stream is cut into chunks at absolute positions, so left
    padding would move every chunk boundary of a shorter row and change what it computes. Only rows of the
    same length share a batch, which keeps every answer independent of its batch companions.
    """
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    return [
        indices[start : start + batch_size]
        for _, indices in sorted(by_length.items())
        for start in range(0, len(indices), batch_size)
    ]


# ----------------------------------------------------------------------------------------------
# Generation


def _generation_config(model, tokenizer, max_new_tokens: int) -> GenerationConfig:
    """Greedy decoding whatever the model's own generation config samples with; the model's EOS ids are kept
    (instruct models stop on <|im_end|>, not only on the tokenizer's EOS)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=resolve_pad_token_id(tokenizer),
    )


def _generate_answers(model, tokenizer, prompts, batches, generation_config, progress) -> list[str]:
    answers: list[str] = [""] * len(prompts)
    for batch in batches:
        input_ids = torch.tensor([prompts[i] for i in batch], dtype=torch.long, device=model.device)
        output = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
        )
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        for index, text in zip(batch, texts):
            answers[index] = text
        progress.update(len(batch))
    return answers


# ----------------------------------------------------------------------------------------------
# Outputs


def plot_heatmap(results: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """BABILong's figure: tasks down, lengths across, accuracy (%) in each cell; one panel with the memory, one
    without, on the same colour scale so the two read side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = results["accuracy"]
    tasks = list(accuracy)
    lengths = list(dict.fromkeys(length for per_length in accuracy.values() for length in per_length))
    modes = [mode for mode in ("memory", "no_memory") if any(mode in cell for t in tasks for cell in accuracy[t].values())]
    titles = {"memory": "with memory", "no_memory": "memory off (same weights)"}
    figure, axes = plt.subplots(
        1, len(modes), figsize=(1.2 + 1.1 * len(lengths) * len(modes), 1.4 + 0.6 * len(tasks)), squeeze=False
    )
    for axis, mode in zip(axes[0], modes):
        grid = [[accuracy[t].get(length, {}).get(mode) for length in lengths] for t in tasks]
        values = [[float("nan") if v is None else 100 * v for v in row] for row in grid]
        image = axis.imshow(values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                if value == value:  # not NaN: a cell that was evaluated
                    axis.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=10)
        axis.set_xticks(range(len(lengths)), [str(length) for length in lengths])
        axis.set_yticks(range(len(tasks)), tasks)
        axis.set_xlabel("length (tokens)")
        axis.set_title(titles[mode])
    figure.colorbar(image, ax=list(axes[0]), label="exact match (%)")
    path = Path(path)
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------------------------
# Entry point


def evaluate_babilong(
    model,
    tokenizer,
    data: BabilongData,
    max_new_tokens: int = 8,
    batch_size: int = 1,
    output_dir: str | os.PathLike | None = None,
    ablation: bool = True,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Answer BABILong rows greedily and score them per (task, length), with the memory on and, when
    `ablation`, again on the same weights inside `model.memory_disabled()`.

    `data` maps (task, length) to rows ({"input", "question", "target"} dicts, e.g. from `generate_babilong`) or
    to a BABILong JSON file (see `babilong_files_by_task_length`); its order is the order of the results and of
    the heatmap. Returns (and, with `output_dir`, writes as results.json beside heatmap.png and the per-row
    predictions.jsonl):

        {"metric": "exact_match",
         "accuracy": {task: {length: {"memory": acc, "no_memory": acc}}},      # the model card's table
         "details": {task: {length: {"num_samples", "prompt_tokens": {"min", "max", "mean"}, "chance",
                                     "last_location_baseline", "num_not_last_location",
                                     "memory": {"exact_match", "label_substring", "exact_match_not_last_location"},
                                     "no_memory": {...same...}}}}}

    Lengths are JSON keys, hence strings. "no_memory" entries exist only with `ablation`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if ablation and not hasattr(model, "memory_disabled"):
        raise ValueError(f"ablation=True needs a model with memory_disabled() (a TitansQwenForCausalLM), "
                         f"got {type(model).__name__}")
    if not data:
        raise ValueError("evaluate_babilong: data is empty; give rows or files per (task, length)")
    cells = [(task, length, _resolve_rows(task, length, source)) for (task, length), source in data.items()]
    generation_config = _generation_config(model, tokenizer, max_new_tokens)
    modes = ["memory", "no_memory"] if ablation else ["memory"]
    results: dict[str, Any] = {"metric": "exact_match", "accuracy": {}, "details": {}}
    prediction_lines: list[str] = []
    was_training = model.training
    model.eval()
    total = sum(len(rows) for _, _, rows in cells) * len(modes)
    try:
        with tqdm(total=total, desc="BABILong eval", unit="answer", disable=not show_progress) as progress:
            for task, length, rows in cells:
                labels = TASK_LABELS[task]
                prompts = [_prompt_ids(row, tokenizer) for row in rows]
                batches = _equal_length_batches(prompts, batch_size)
                answers: dict[str, list[str]] = {}
                for mode in modes:
                    progress.set_description(f"{task} {length} {mode.replace('_', ' ')}")
                    if mode == "memory":
                        answers[mode] = _generate_answers(model, tokenizer, prompts, batches, generation_config, progress)
                    else:
                        with model.memory_disabled():
                            answers[mode] = _generate_answers(
                                model, tokenizer, prompts, batches, generation_config, progress
                            )
                baseline = last_location_baseline(rows, labels)
                key = str(length)
                detail: dict[str, Any] = {
                    "num_samples": len(rows),
                    "prompt_tokens": {
                        "min": min(map(len, prompts)),
                        "max": max(map(len, prompts)),
                        "mean": sum(map(len, prompts)) / len(prompts),
                    },
                    "chance": 1 / len(labels),
                    "last_location_baseline": baseline["accuracy"],
                    "num_not_last_location": baseline["num_not_last_location"],
                }
                for mode in modes:
                    detail[mode] = score_predictions(rows, answers[mode], labels)
                results["details"].setdefault(task, {})[key] = detail
                results["accuracy"].setdefault(task, {})[key] = {mode: detail[mode]["exact_match"] for mode in modes}
                for index, row in enumerate(rows):
                    line = {"task": task, "length": key, "index": index, "target": row["target"],
                            "last_location": last_mentioned_label(row["input"], labels)}
                    line.update({mode: answers[mode][index] for mode in modes})
                    prediction_lines.append(json.dumps(line, ensure_ascii=False))
    finally:
        model.train(was_training)

    if output_dir is not None:
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / PREDICTIONS_NAME, "\n".join(prediction_lines) + "\n")
        plot_heatmap(results, folder / HEATMAP_NAME)
        # last: results.json present means the whole evaluation finished
        atomic_write_text(folder / RESULTS_NAME, json.dumps(results, indent=2) + "\n")
    return results


def format_results_table(results: Mapping[str, Any]) -> str:
    """A plain-text table of every cell: accuracy with/without memory beside the recency baseline."""
    header = ["task", "length", "n", "memory", "no memory", "last-loc", "memory (not last)", "no mem (not last)"]
    lines = [header]

    def percent(value) -> str:
        return "-" if value is None else f"{100 * value:.1f}"

    for task, per_length in results["details"].items():
        for length, cell in per_length.items():
            memory, no_memory = cell.get("memory", {}), cell.get("no_memory", {})
            lines.append([
                task, length, str(cell["num_samples"]), percent(memory.get("exact_match")),
                percent(no_memory.get("exact_match")), percent(cell["last_location_baseline"]),
                f"{percent(memory.get('exact_match_not_last_location'))} (n={cell['num_not_last_location']})",
                percent(no_memory.get("exact_match_not_last_location")),
            ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


# ----------------------------------------------------------------------------------------------
# Loading what training produced


def load_model_for_eval(
    model: str | os.PathLike,
    memory: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    dtype: str | None = None,
    device: str | None = None,
):
    """(model, tokenizer) from what a user has after training, whichever of the three forms it is:

    - `model` = a base Qwen (Hub id or folder) and `memory` = a memory folder or Hub id;
    - `model` = a memory folder or Hub id alone (its memory_config.json names the base);
    - `model` = a full saved TitansQwen folder (`save_pretrained(..., save_full_model=True)`).
    The tokenizer defaults to the base model's (or the full model folder's).
    """
    from transformers import AutoConfig, AutoTokenizer

    from titans_hf.hub import TitansMemoryConfig, is_memory
    from titans_hf.modeling import TitansQwenForCausalLM

    load_kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    if memory is None and is_memory(model):
        memory, model = model, None
    if memory is not None:
        loaded = TitansQwenForCausalLM.from_base_and_memory(model, memory, **load_kwargs)
        if tokenizer is None and model is None:
            config = TitansMemoryConfig.from_pretrained(memory)
            tokenizer, revision = config.base_model_name_or_path, config.revision
        else:
            tokenizer, revision = tokenizer or model, None
    else:
        model_type = AutoConfig.from_pretrained(model, trust_remote_code=False).model_type
        if model_type != "titans_qwen":
            raise ValueError(
                f"--model {model} is a {model_type!r} model without a memory: pass the trained memory with "
                "--memory DIR, or a memory folder / Hub id, or a full TitansQwen folder"
            )
        loaded = TitansQwenForCausalLM.from_pretrained(model, **load_kwargs)
        tokenizer, revision = tokenizer or model, None
    if device is not None:
        loaded.to(device)
    return loaded, AutoTokenizer.from_pretrained(tokenizer, revision=revision)


__all__ = [
    "evaluate_babilong",
    "load_model_for_eval",
    "babilong_files_by_task_length",
    "plot_heatmap",
    "format_results_table",
]
