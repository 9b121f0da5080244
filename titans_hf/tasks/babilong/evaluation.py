"""BABILong evaluation: greedy answers with the memory on and off on the same weights, scored per task and length.

The ablation is the point of the exercise: besides the accuracy with and without memory, every cell reports what
the recency guess (the last location named) scores and the accuracy where that guess is wrong; the task's own
scoring lives in `titans_hf.tasks.babilong.scoring`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from titans_hf.data.tokenizers import plain_backend_tokenizer, resolve_pad_token_id
from titans_hf.files import atomic_write, atomic_write_json, atomic_write_text
from titans_hf.outputs import prepare_output_dir, record_outputs
from titans_hf.tasks.babilong import (
    LABELS_FROM_TARGETS,
    REQUIRED_FIELDS,
    build_example,
    find_babilong_sources,
    last_location_baseline,
    last_mentioned_label,
    length_tokens,
    read_babilong_file,
    read_babilong_files,
    score_exact_match,
    score_predictions,
    supporting_fact_spans,
    task_labels,
)
from titans_hf.tasks.babilong.examples import PROMPT_TEMPLATE

RESULTS_NAME = "results.json"
HEATMAP_NAME = "heatmap.png"
PREDICTIONS_NAME = "predictions.jsonl"
DISTANCE_PLOT_NAME = "accuracy_by_distance.png"
OUTPUT_NAMES = (RESULTS_NAME, HEATMAP_NAME, PREDICTIONS_NAME, DISTANCE_PLOT_NAME)
# No truncation at evaluation: the whole story is the test. build_example wants a budget; this one never binds.
_UNBOUNDED_LENGTH = 1 << 62

PathLike = str | os.PathLike
BabilongData = Mapping[tuple[str, int | str], Sequence[Mapping[str, str]] | PathLike | Sequence[PathLike]]


# ----------------------------------------------------------------------------------------------
# Data


def babilong_files_by_task_length(
    paths: Sequence[PathLike], tasks: Sequence[str] | None = None, lengths: Sequence[str | int] | None = None
) -> dict[tuple[str, str], tuple[Path, ...]]:
    """Key BABILong files by (task, length label) as the published layouts name them, for `evaluate_babilong`.

    `paths` are files or folders (e.g. a snapshot of `RMT-team/babilong`: `32k/qa1-00000-of-00001.parquet` is task
    "qa1" at length "32k"; `qa1/32k.json` too); the shards of one set come together, in order. `tasks` / `lengths`
    keep only those sets and label a file whose path does not say (see `find_babilong_sources`). Two sets with the
    same labels are an error naming both.
    """
    keyed: dict[tuple[str, str], tuple[Path, ...]] = {}
    for source in find_babilong_sources(paths, tasks, lengths, require_labels=True):
        key = (source.task, source.length)
        if key in keyed:
            raise ValueError(f"BABILong files {[str(p) for p in keyed[key]]} and {[str(p) for p in source.paths]} "
                             f"are both task {source.task} length {source.length}")
        keyed[key] = source.paths
    return keyed


def _resolve_rows(task: str, length: int | str, source) -> list[Mapping[str, str]]:
    """The rows of one cell: read from a file or the files of one set, or checked when given as rows."""
    if isinstance(source, (str, os.PathLike)):
        return read_babilong_file(source)
    items = list(source)
    if items and all(isinstance(item, (str, os.PathLike)) for item in items):
        return read_babilong_files(items)
    if not items:
        raise ValueError(f"evaluate_babilong: no rows for task {task!r} length {length!r}")
    for index, row in enumerate(items):
        missing = [field for field in REQUIRED_FIELDS if field not in row]
        if missing:
            raise ValueError(f"evaluate_babilong: task {task!r} length {length!r} row {index} lacks {missing}")
    return items


def _describe(source) -> str:
    """A cell's source for messages: its file(s), or that the rows were given."""
    if isinstance(source, (str, os.PathLike)):
        return f"BABILong file {source}"
    items = list(source)
    if items and all(isinstance(item, (str, os.PathLike)) for item in items):
        return f"BABILong files {', '.join(map(str, items))}"
    return "the rows given"


def _check_targets(task: str, length: int | str, rows: Sequence[Mapping[str, str]], source) -> None:
    """Refuse rows whose targets lie outside the published label set of the task they are scored as (qa1 rows in
    a file labelled qa6 would all be scored wrong against {yes, no}), naming the source."""
    labels, labels_from = task_labels(task, rows)
    if labels_from == LABELS_FROM_TARGETS:
        return
    outside = sorted({row["target"].strip().lower() for row in rows} - {label.lower() for label in labels})
    if outside:
        raise ValueError(f"{_describe(source)}: scored as task {task!r} (length {length!r}), but its targets "
                         f"{outside[:5]} are not among {task}'s labels {labels}: the rows are of another task; label "
                         "them with their own task (--tasks, or the file's place in the layout)")


def _warn_about_length(task: str, length: int | str, prompts: Sequence[list[int]], source) -> None:
    """Warn when the measured prompt lengths are far from the length label the cell is reported under (a `1k`
    folder of 600-token rows), giving both."""
    tokens = length_tokens(length)
    if not tokens:
        return
    lengths = [len(prompt) for prompt in prompts]
    mean = sum(lengths) / len(lengths)
    if not 0.75 * tokens <= mean <= 1.5 * tokens:
        warnings.warn(f"{_describe(source)}: reported as task {task!r} length {length!r} ({tokens} tokens), but its "
                      f"prompts measure {min(lengths)}-{max(lengths)} tokens (mean {mean:.0f}) with this tokenizer; "
                      "the length label does not describe these rows", stacklevel=3)


def prompt_ids(row: Mapping[str, str], tokenizer) -> list[int]:
    """The prompt exactly as training assembles it (same template, same special tokens), untruncated."""
    example = build_example(dict(row), tokenizer, _UNBOUNDED_LENGTH, answer_reserve_tokens=1, pad_to_max_length=False)
    return example["input_ids"][: example["prompt_length"]]


def _fact_chunks(row: Mapping[str, str], task: str, tokenizer, chunk_size: int | None) -> tuple[int, int] | None:
    """(chunk holding the first token of the earliest supporting fact, chunk holding the prompt's last token), counted
    from the row's first token as the model cuts it; None without a chunk size or when the task's supporting facts
    cannot be found (see `supporting_fact_spans`)."""
    spans = supporting_fact_spans(row, task) if chunk_size else None
    if spans is None:
        return None
    prompt = PROMPT_TEMPLATE.format(input=row["input"], question=row["question"])
    encoding = plain_backend_tokenizer(tokenizer).encode(prompt, add_special_tokens=True)
    first = next(token for char in range(spans[0][0], spans[0][1]) if (token := encoding.char_to_token(char)) is not None)
    return first // chunk_size, (len(encoding.ids) - 1) // chunk_size


def distance_bucket(distance: int) -> str:
    """The distance bin (in chunks) a row is reported in: 0, 1, then powers of two (2-3, 4-7, 8-15, ...)."""
    if distance < 2:
        return str(distance)
    low = 1 << (distance.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def _accuracy_by_distance(distances: Sequence[int | None], hits: Mapping[str, Sequence[bool]]) -> dict[str, Any]:
    """Exact match per distance bin, per mode, over the rows whose distance is known, in order of distance."""
    by_bin: dict[str, list[int]] = {}
    for index, distance in sorted(enumerate(distances), key=lambda pair: -1 if pair[1] is None else pair[1]):
        if distance is not None:
            by_bin.setdefault(distance_bucket(distance), []).append(index)
    return {label: {"num_samples": len(indices),
                    **{mode: sum(flags[i] for i in indices) / len(indices) for mode, flags in hits.items()}}
            for label, indices in by_bin.items()}


def _batches(prompts: Sequence[list[int]], batch_size: int, padding_multiple: int | None) -> list[list[int]]:
    """Row indices in batches whose answers equal those of each row alone.

    A TitansQwen cuts the stream into chunks at absolute positions, so left padding moves a row's chunk
    boundaries unless it is a whole multiple of the model's `padding_multiple` (then the padded chunks leave the
    memory untouched). Rows are therefore grouped by `len % padding_multiple`, sorted by length inside a group (a
    batch is padded to its longest row, so neighbours in length waste little), and cut into batches. Without a
    `padding_multiple` (a plain model, whose outputs padding changes in the last bits) only prompts of identical
    length share a batch.
    """
    groups: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        key = len(prompt) % padding_multiple if padding_multiple else len(prompt)
        groups.setdefault(key, []).append(index)
    batches = []
    for _, indices in sorted(groups.items()):
        indices.sort(key=lambda index: len(prompts[index]))
        batches += [indices[start : start + batch_size] for start in range(0, len(indices), batch_size)]
    return batches


def _padding_multiple(model, mixed_length_batches: bool | None) -> int | None:
    """The left-padding unit batches may use (None: equal lengths only), from the model's `padding_multiple`."""
    multiple = getattr(model, "padding_multiple", None)
    if mixed_length_batches and multiple is None:
        raise ValueError(f"mixed_length_batches=True needs a model with padding_multiple (a TitansQwenForCausalLM), "
                         f"got {type(model).__name__}")
    return multiple if mixed_length_batches in (None, True) else None


# ----------------------------------------------------------------------------------------------
# Generation


def greedy_generation_config(model, tokenizer, max_new_tokens: int) -> GenerationConfig:
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


def _left_padded(prompts: Sequence[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of prompts left-padded with `pad_id` to the longest; the mask is 0 on padding."""
    longest = max(map(len, prompts))
    input_ids = [[pad_id] * (longest - len(prompt)) + list(prompt) for prompt in prompts]
    mask = [[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts]
    return (torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(mask, dtype=torch.long, device=device))


def _generate_answers(model, tokenizer, prompts, batches, generation_config, progress) -> list[str]:
    """Greedy answers of `prompts`, one `generate` call per batch of row indices, in the rows' order."""
    answers: list[str] = [""] * len(prompts)
    for batch in batches:
        input_ids, attention_mask = _left_padded([prompts[i] for i in batch], generation_config.pad_token_id,
                                                 model.device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        for index, text in zip(batch, texts):
            answers[index] = text
        progress.update(len(batch))
    return answers


# ----------------------------------------------------------------------------------------------
# Outputs


def _length_label(length: str, chunk_size: int | None) -> str:
    """A length as the README's tables write it: "1024 (32)" = 1024 tokens, 32 chunks; a published label as is."""
    if chunk_size and length.isdigit() and int(length) > 0:
        return f"{length} ({math.ceil(int(length) / chunk_size)})"
    return length


def _plot_note(results: Mapping[str, Any]) -> str:
    """Chance and the trained length, for a figure's title."""
    chances = sorted({round(100 * cell["chance"], 1) for per_length in results["details"].values()
                      for cell in per_length.values()})
    note = f"chance {' / '.join(f'{c:g}' for c in chances)} %"
    trained, chunk_size = results.get("trained_length"), results.get("chunk_size")
    if trained:
        note += f"; trained on inputs of up to {_length_label(str(trained), chunk_size)} tokens (chunks)"
    return note


def plot_heatmap(results: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """BABILong's figure: tasks down, lengths across (tokens, and chunks in parentheses), accuracy (%) in each cell
    as the table gives it (one decimal) with its number of rows; one panel with the memory, one without, on the same
    colour scale so the two read side by side; chance and the trained length in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy, details = results["accuracy"], results["details"]
    tasks = list(accuracy)
    lengths = list(dict.fromkeys(length for per_length in accuracy.values() for length in per_length))
    modes = [mode for mode in ("memory", "no_memory") if any(mode in cell for t in tasks for cell in accuracy[t].values())]
    titles = {"memory": "with memory", "no_memory": "memory off (same weights)"}
    figure, axes = plt.subplots(
        1, len(modes), figsize=(1.6 + 1.3 * len(lengths) * len(modes), 1.8 + 0.7 * len(tasks)), squeeze=False
    )
    for axis, mode in zip(axes[0], modes):
        grid = [[accuracy[t].get(length, {}).get(mode) for length in lengths] for t in tasks]
        values = [[float("nan") if v is None else 100 * v for v in row] for row in grid]
        image = axis.imshow(values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                if value == value:  # not NaN: a cell that was evaluated
                    rows = details[tasks[i]][lengths[j]]["num_samples"]
                    axis.text(j, i - 0.1, f"{value:.1f}", ha="center", va="center", fontsize=10)
                    axis.text(j, i + 0.25, f"n={rows}", ha="center", va="center", fontsize=7, color="dimgrey")
        axis.set_xticks(range(len(lengths)), [_length_label(length, results.get("chunk_size")) for length in lengths],
                        fontsize=8)
        axis.set_yticks(range(len(tasks)), tasks)
        axis.set_xlabel("input tokens (chunks)" if results.get("chunk_size") else "input length (tokens)")
        axis.set_title(titles[mode])
    figure.colorbar(image, ax=list(axes[0]), label="exact match (%)")
    figure.suptitle(_plot_note(results), fontsize=9, y=1.02)
    path = Path(path)
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))
    plt.close(figure)
    return path


def plot_accuracy_by_distance(results: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Exact match against the distance in chunks between the supporting fact and the question, one line per task and
    length, solid with the memory and dashed with it off; distance bins on the x axis in order, chance dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(task, length, cell) for task, per_length in results["details"].items()
             for length, cell in per_length.items() if "by_distance" in cell]
    if not cells:
        raise ValueError("plot_accuracy_by_distance: no cell has accuracy by distance (a TitansQwen on qa1 or qa2)")
    bins = sorted({label for _, _, cell in cells for label in cell["by_distance"]},
                  key=lambda label: int(label.split("-")[0]))
    figure, axis = plt.subplots(figsize=(1.5 + 0.6 * len(bins), 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (task, length, cell) in enumerate(cells):
        colour = colours[index % len(colours)]
        for mode, style in (("memory", "-"), ("no_memory", "--")):
            points = [(bins.index(label), 100 * entry[mode]) for label, entry in cell["by_distance"].items()
                      if mode in entry]
            if points:
                label = f"{task} {_length_label(length, results.get('chunk_size'))}"
                axis.plot(*zip(*points), style, marker="o", markersize=3, color=colour,
                          label=f"{label}, {'with memory' if mode == 'memory' else 'memory off'}")
    chance = 100 * cells[0][2]["chance"]
    axis.axhline(chance, color="grey", linestyle=":", linewidth=1, label=f"chance {chance:.1f} %")
    axis.set_xticks(range(len(bins)), bins)
    axis.set_ylim(0, 102)
    axis.set_xlabel("chunks between the supporting fact and the question")
    axis.set_ylabel("exact match (%)")
    axis.set_title(_plot_note(results), fontsize=9)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
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
    mixed_length_batches: bool | None = None,
    trained_length: int | None = None,
) -> dict[str, Any]:
    """Answer BABILong rows greedily and score them per (task, length), with the memory on and, when
    `ablation`, again on the same weights inside `model.memory_disabled()`.

    `data` maps (task, length) to rows ({"input", "question", "target"} dicts, e.g. from `generate_babilong`), to
    a BABILong file (parquet, JSON, JSON Lines) or to the files of one set (its shards; see
    `babilong_files_by_task_length`); its order is the order of the results and of the heatmap. Any task name is
    scored: against BABILong's label set of the task where it publishes one, else against the distinct targets of
    the cell's rows ("labels_from" says which). Returns (and, with `output_dir`, writes as results.json beside
    heatmap.png and the per-row predictions.jsonl):

        {"metric": "exact_match", "chunk_size": the model's chunk size (None for a plain model),
         "trained_length": `trained_length`,
         "accuracy": {task: {length: {"memory": acc, "no_memory": acc}}},      # the model card's table
         "details": {task: {length: {"num_samples", "prompt_tokens": {"min", "max", "mean"}, "labels",
                                     "labels_from", "chance", "last_location_baseline", "num_not_last_location",
                                     "memory": {"exact_match", "label_substring", "exact_match_not_last_location"},
                                     "no_memory": {...same...},
                                     "distance_chunks": {"min", "max", "mean", "num_samples"},
                                     "by_distance": {bin: {"num_samples", "memory": acc, "no_memory": acc}}}}}}

    Lengths are JSON keys, hence strings (a published label such as "32k" stays as it is). "no_memory" entries
    exist only with `ablation`. The distance of a row is the number of chunks between the chunk holding the first
    token of its earliest supporting fact and the chunk holding the prompt's last token (where the answer starts);
    "distance_chunks" and "by_distance" (bins 0, 1, 2-3, 4-7, ...) exist for a TitansQwen on tasks whose supporting
    facts can be found (`supporting_fact_spans`: qa1, qa2), and predictions.jsonl then gives each row's
    "fact_chunk", "question_chunk" and "distance_chunks". `trained_length` (tokens, optional) is drawn on the plots.

    Batches of up to `batch_size` rows answer exactly as each row alone: with a model that has `padding_multiple`
    (a TitansQwen) rows of mixed lengths are left-padded by whole multiples of it (`mixed_length_batches=None` or
    True; False keeps to prompts of equal length), otherwise only prompts of equal length share a batch.
    `output_dir` is checked (and created) before any answer is generated.
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
    padding_multiple = _padding_multiple(model, mixed_length_batches)
    folder = None if output_dir is None else prepare_output_dir(output_dir, OUTPUT_NAMES)
    cells = [(task, length, _resolve_rows(task, length, source), source) for (task, length), source in data.items()]
    for task, length, rows, source in cells:
        _check_targets(task, length, rows, source)
    generation_config = greedy_generation_config(model, tokenizer, max_new_tokens)
    modes = ["memory", "no_memory"] if ablation else ["memory"]
    memory_config = getattr(getattr(model, "config", None), "memory_config", None)
    chunk_size = getattr(memory_config, "chunk_size", None)
    results: dict[str, Any] = {"metric": "exact_match", "chunk_size": chunk_size, "trained_length": trained_length,
                               "accuracy": {}, "details": {}}
    prediction_lines: list[str] = []
    was_training = model.training
    model.eval()
    total = sum(len(rows) for _, _, rows, _ in cells) * len(modes)
    try:
        with tqdm(total=total, desc="BABILong eval", unit="answer", disable=not show_progress) as progress:
            for task, length, rows, source in cells:
                labels, labels_from = task_labels(task, rows)
                prompts = [prompt_ids(row, tokenizer) for row in rows]
                _warn_about_length(task, length, prompts, source)
                batches = _batches(prompts, batch_size, padding_multiple)
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
                fact_chunks = [_fact_chunks(row, task, tokenizer, chunk_size) for row in rows]
                distances = [None if chunks is None else chunks[1] - chunks[0] for chunks in fact_chunks]
                detail: dict[str, Any] = {
                    "num_samples": len(rows),
                    "prompt_tokens": {
                        "min": min(map(len, prompts)),
                        "max": max(map(len, prompts)),
                        "mean": sum(map(len, prompts)) / len(prompts),
                    },
                    "labels": labels,
                    "labels_from": labels_from,
                    "chance": 1 / len(labels),
                    "last_location_baseline": baseline["accuracy"],
                    "num_not_last_location": baseline["num_not_last_location"],
                }
                for mode in modes:
                    detail[mode] = score_predictions(rows, answers[mode], labels)
                known = [distance for distance in distances if distance is not None]
                if known:
                    hits = {mode: [score_exact_match(answer, row["target"]) for answer, row in zip(answers[mode], rows)]
                            for mode in modes}
                    detail["distance_chunks"] = {"min": min(known), "max": max(known), "mean": sum(known) / len(known),
                                                 "num_samples": len(known)}
                    detail["by_distance"] = _accuracy_by_distance(distances, hits)
                results["details"].setdefault(task, {})[key] = detail
                results["accuracy"].setdefault(task, {})[key] = {mode: detail[mode]["exact_match"] for mode in modes}
                for index, row in enumerate(rows):
                    line = {"task": task, "length": key, "index": index, "target": row["target"],
                            "last_location": last_mentioned_label(row["input"], labels)}
                    if fact_chunks[index] is not None:
                        line.update(fact_chunk=fact_chunks[index][0], question_chunk=fact_chunks[index][1],
                                    distance_chunks=distances[index])
                    line.update({mode: answers[mode][index] for mode in modes})
                    prediction_lines.append(json.dumps(line, ensure_ascii=False))
    finally:
        model.train(was_training)

    if folder is not None:
        # an older results.json would vouch for the new files until the new one lands: it goes first
        (folder / RESULTS_NAME).unlink(missing_ok=True)
        written = [PREDICTIONS_NAME, HEATMAP_NAME, RESULTS_NAME]
        try:
            atomic_write_text(folder / PREDICTIONS_NAME, "\n".join(prediction_lines) + "\n")
            plot_heatmap(results, folder / HEATMAP_NAME)
            if any("by_distance" in cell for per_length in results["details"].values() for cell in per_length.values()):
                plot_accuracy_by_distance(results, folder / DISTANCE_PLOT_NAME)
                written.append(DISTANCE_PLOT_NAME)
            else:  # an earlier evaluation's plot would not belong to these results
                (folder / DISTANCE_PLOT_NAME).unlink(missing_ok=True)
            # last: results.json present means the whole evaluation finished
            atomic_write_json(folder / RESULTS_NAME, results)
        except BaseException:  # no half of the outputs stays behind
            for name in OUTPUT_NAMES:
                (folder / name).unlink(missing_ok=True)
            raise
        record_outputs(folder, written, "titans-hf eval")
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
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
    derived = [f"{task} {length}" for task, per_length in results["details"].items()
               for length, cell in per_length.items() if cell.get("labels_from") == LABELS_FROM_TARGETS]
    if derived:
        table += f"\nlabels of {', '.join(derived)}: {LABELS_FROM_TARGETS}"
    return table


def format_evaluation(results: Mapping[str, Any]) -> str:
    """What `titans-hf eval` prints of BABILong results: the table of every cell, then accuracy by distance."""
    text = format_results_table(results)
    by_distance = format_distance_table(results)
    if by_distance:
        text += f"\n\nby distance from the supporting fact to the question:\n{by_distance}"
    return text


def format_distance_table(results: Mapping[str, Any]) -> str:
    """A plain-text table of accuracy by distance (chunks from the supporting fact to the question), memory on and
    off, for every cell that has one; empty when none has."""
    def percent(value) -> str:
        return "-" if value is None else f"{100 * value:.1f}"

    lines = [["task", "length", "distance (chunks)", "n", "memory", "no memory"]]
    for task, per_length in results["details"].items():
        for length, cell in per_length.items():
            for label, entry in cell.get("by_distance", {}).items():
                lines.append([task, length, label, str(entry["num_samples"]), percent(entry.get("memory")),
                              percent(entry.get("no_memory"))])
    if len(lines) == 1:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
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

    from titans_hf.modeling import TitansQwenForCausalLM
    from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig
    from titans_hf.modeling.memory_folder import is_memory

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
    return loaded, AutoTokenizer.from_pretrained(tokenizer, revision=revision, trust_remote_code=False)


__all__ = [
    "evaluate_babilong",
    "load_model_for_eval",
    "babilong_files_by_task_length",
    "plot_heatmap",
    "plot_accuracy_by_distance",
    "format_results_table",
    "format_distance_table",
    "format_evaluation",
]
