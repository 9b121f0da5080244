"""BABILong evaluation: greedy answers with the memory on and off on the same weights, scored per task and length.

The ablation is the point of the exercise: besides the accuracy with and without memory, every cell reports what
the recency guess (the last location named) scores and the accuracy where that guess is wrong; the task's own
scoring lives in `titans_hf.tasks.babilong.scoring`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from titans_hf.data.tokenizers import plain_backend_tokenizer
from titans_hf.outputs import prepare_output_dir
from titans_hf.tasks.babilong import (
    LABELS_FROM_TARGETS,
    build_example,
    find_babilong_sources,
    last_location_baseline,
    last_mentioned_label,
    length_tokens,
    score_exact_match,
    score_predictions,
    supporting_fact_spans,
    task_labels,
)
from titans_hf.tasks.babilong.examples import PROMPT_TEMPLATE
from titans_hf.tasks.evaluation import (  # noqa: F401  (the shared parts, under the names callers know)
    DISTANCE_PLOT_NAME,
    HEATMAP_NAME,
    OUTPUT_NAMES,
    PREDICTIONS_NAME,
    RESULTS_NAME,
    accuracy_by_distance,
    answer_batches,
    describe_source,
    distance_bucket,
    generate_answers,
    greedy_generation_config,
    load_model_for_eval,
    padding_multiple_for,
    plot_accuracy_by_distance,
    plot_heatmap,
    resolve_rows,
    write_outputs,
)

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


def _check_targets(task: str, length: int | str, rows: Sequence[Mapping[str, str]], source) -> None:
    """Refuse rows whose targets lie outside the published label set of the task they are scored as (qa1 rows in
    a file labelled qa6 would all be scored wrong against {yes, no}), naming the source."""
    labels, labels_from = task_labels(task, rows)
    if labels_from == LABELS_FROM_TARGETS:
        return
    outside = sorted({row["target"].strip().lower() for row in rows} - {label.lower() for label in labels})
    if outside:
        raise ValueError(f"{describe_source(source)}: scored as task {task!r} (length {length!r}), but its targets "
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
        warnings.warn(f"{describe_source(source)}: reported as task {task!r} length {length!r} ({tokens} tokens), but its "
                      f"prompts measure {min(lengths)}-{max(lengths)} tokens (mean {mean:.0f}) with this tokenizer; "
                      "the length label does not describe these rows", stacklevel=3)


def prompt_ids(row: Mapping[str, str], tokenizer, prompt_template: str = PROMPT_TEMPLATE) -> list[int]:
    """The prompt exactly as training assembles it (same template, same special tokens), untruncated."""
    example = build_example(dict(row), tokenizer, _UNBOUNDED_LENGTH, answer_reserve_tokens=1, pad_to_max_length=False,
                            prompt_template=prompt_template)
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


# ----------------------------------------------------------------------------------------------
# Entry point


def _cell_answers(model, tokenizer, task, length, prompts, source, modes, progress, batch_rows, generation_config
                  ) -> dict[str, list[str]]:
    """The greedy answers of one cell's prompts in each mode (`batch_rows`: the prompts' batches)."""
    _warn_about_length(task, length, prompts, source)
    batches = batch_rows(prompts)
    answers: dict[str, list[str]] = {}
    for mode in modes:
        progress.set_description(f"{task} {length} {mode.replace('_', ' ')}")
        if mode == "memory":
            answers[mode] = generate_answers(model, tokenizer, prompts, batches, generation_config, progress)
        else:
            with model.memory_disabled():
                answers[mode] = generate_answers(model, tokenizer, prompts, batches, generation_config, progress)
    return answers


def _score_cell(task, length, rows, prompts, answers: Mapping[str, list[str]], tokenizer, chunk_size: int | None
                ) -> tuple[dict[str, Any], list[str]]:
    """(the cell's details, its predictions.jsonl lines): the scores per mode beside the recency baseline, and by
    distance where the supporting facts can be found."""
    labels, labels_from = task_labels(task, rows)
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
    for mode in answers:
        detail[mode] = score_predictions(rows, answers[mode], labels)
    known = [distance for distance in distances if distance is not None]
    if known:
        hits = {mode: [score_exact_match(answer, row["target"]) for answer, row in zip(answers[mode], rows)]
                for mode in answers}
        detail["distance_chunks"] = {"min": min(known), "max": max(known), "mean": sum(known) / len(known),
                                     "num_samples": len(known)}
        detail["by_distance"] = accuracy_by_distance(distances, hits)
    lines = []
    for index, row in enumerate(rows):
        line = {"task": task, "length": key, "index": index, "target": row["target"],
                "last_location": last_mentioned_label(row["input"], labels)}
        if fact_chunks[index] is not None:
            line.update(fact_chunk=fact_chunks[index][0], question_chunk=fact_chunks[index][1],
                        distance_chunks=distances[index])
        line.update({mode: answers[mode][index] for mode in answers})
        lines.append(json.dumps(line, ensure_ascii=False))
    return detail, lines


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
    padding_multiple = padding_multiple_for(model, mixed_length_batches)
    folder = None if output_dir is None else prepare_output_dir(output_dir, OUTPUT_NAMES)
    cells = [(task, length, resolve_rows(task, length, source), source) for (task, length), source in data.items()]
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
                prompts = [prompt_ids(row, tokenizer) for row in rows]
                answers = _cell_answers(model, tokenizer, task, length, prompts, source, modes, progress,
                                        lambda prompts: answer_batches(prompts, batch_size, padding_multiple),
                                        generation_config)
                detail, lines = _score_cell(task, length, rows, prompts, answers, tokenizer, chunk_size)
                results["details"].setdefault(task, {})[str(length)] = detail
                results["accuracy"].setdefault(task, {})[str(length)] = {mode: detail[mode]["exact_match"]
                                                                         for mode in modes}
                prediction_lines += lines
    finally:
        model.train(was_training)

    if folder is not None:
        write_outputs(folder, results, prediction_lines, plot_heatmap, plot_accuracy_by_distance)
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
