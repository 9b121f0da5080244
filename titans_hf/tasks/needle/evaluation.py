"""Needle evaluation: exact match of the key, greedy, by distance, with the memory on, off (the same weights), and
read with another row's memory (the memory-swap ablation), which must fall to the floor if the memory carries this
row's key and not a knack for the task.

The swap: row i's prompt streams as it does with the memory on up to the question (once: a copy of that stream
answers with the memory on); there its memory's fast weights and momentum become those row `swap_partners(n)[i]`
(the row before it) holds at its own question (`MemoryState.with_rows_from`: the convolution's last inputs, the
unfinished update chunk and the position stay row i's), and the question and the answer are read from there. Attention sees row i's own tokens throughout, so a key
still in attention's view (0 or 1 chunks back with `attend_previous_chunk`) is answered without the memory; the
cells report the rows beyond attention's view apart (`beyond_attention`).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from titans_hf.outputs import prepare_output_dir
from titans_hf.tasks.babilong.evaluation import prompt_ids
from titans_hf.tasks.evaluation import (
    MODE_TITLES,
    OUTPUT_NAMES,
    accuracy_by_distance,
    answer_batches,
    generate_answers,
    greedy_generation_config,
    padding_multiple_for,
    plot_accuracy_by_distance,
    plot_heatmap,
    resolve_rows,
    write_outputs,
)

from .generate import PROMPT_TEMPLATE
from .scoring import NeedlePlace, needle_token, score_key

KEY_CHANCE = 1 / 90000  # a five-digit key guessed at random


def swap_partners(count: int) -> list[int]:
    """The row whose memory row i is read with in the swap ablation: the row before it (row 0 takes the last), never
    itself; a single row has no partner."""
    if count < 2:
        raise ValueError(f"the memory swap needs at least 2 rows, got {count}")
    return [(index - 1) % count for index in range(count)]


@torch.no_grad()
def _prefill(model, ids: Sequence[int]):
    """The cache after streaming `ids` (one row) with the memory on."""
    inputs = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    return model(input_ids=inputs, use_cache=True, logits_to_keep=1).cache


@torch.no_grad()
def _decode(model, tokenizer, cache, question: Sequence[int], max_new_tokens: int, stop: set[int]) -> str:
    """Greedy answer after `question`, continuing the stream in `cache`."""
    step = torch.tensor([list(question)], dtype=torch.long, device=model.device)
    answer: list[int] = []
    for _ in range(max_new_tokens):
        output = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
        cache, token = output.cache, int(output.logits[0, -1].argmax())
        if token in stop:
            break
        answer.append(token)
        step = torch.tensor([[token]], dtype=torch.long, device=model.device)
    return tokenizer.decode(answer, skip_special_tokens=True)


def memory_and_swapped_answers(model, tokenizer, prompts: Sequence[list[int]], questions: Sequence[int],
                               partners: Sequence[int], max_new_tokens: int, progress=None
                               ) -> tuple[list[str], list[str]]:
    """Greedy answers of `prompts` with the memory on, and read with another row's memory: row i streams up to
    `questions[i]` (the question's first token) once; from a copy of that stream its question is answered with its
    own memory, and from the stream itself with the fast weights and momentum row `partners[i]` holds at its own
    question. Rows go in order; a stream waits only while its partner's is still to come (the first row, whose
    partner is the last)."""
    eos = greedy_generation_config(model, tokenizer, max_new_tokens).eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) - {None}
    every_row = torch.ones(1, dtype=torch.bool, device=model.device)
    at_question: dict[int, dict] = {}
    waiting: dict[int, Any] = {}
    own, swapped = [""] * len(prompts), [""] * len(prompts)

    def answer_swapped(index: int, cache) -> None:
        cache.memory_states = {layer: state.with_rows_from(at_question[partners[index]][layer], every_row)
                               for layer, state in cache.memory_states.items()}
        swapped[index] = _decode(model, tokenizer, cache, prompts[index][questions[index]:], max_new_tokens, stop)
        if progress is not None:
            progress.update(1)

    for index, prompt in enumerate(prompts):
        cache = _prefill(model, prompt[: questions[index]])
        at_question[index] = {layer: state.detach() for layer, state in cache.memory_states.items()}
        own[index] = _decode(model, tokenizer, copy.deepcopy(cache), prompt[questions[index]:], max_new_tokens, stop)
        if progress is not None:
            progress.update(1)
        waiting[index] = cache
        for ready in [row for row in waiting if partners[row] in at_question]:
            answer_swapped(ready, waiting.pop(ready))
    return own, swapped


def _cell_rows(prompts: Sequence[list[int]], places: Sequence[NeedlePlace], chunk_size: int | None, view: int
               ) -> list[dict[str, Any]]:
    """Per row: where its key lies, in tokens and in chunks from the question (the chunk of the prompt's last token,
    where the answer starts), and whether that is beyond attention's view (`view` chunks back)."""
    rows = []
    for prompt, place in zip(prompts, places):
        entry: dict[str, Any] = {"needle_token": place.needle, "question_token": place.question}
        if place.needle is not None:
            entry["distance_tokens"] = place.question - place.needle
            if chunk_size:
                entry["distance_chunks"] = (len(prompt) - 1) // chunk_size - place.needle // chunk_size
                entry["beyond_attention"] = entry["distance_chunks"] > view
        rows.append(entry)
    return rows


def _score_cell(rows: Sequence[Mapping[str, Any]], answers: Mapping[str, Sequence[str]],
                placed: Sequence[Mapping[str, Any]], prompts: Sequence[list[int]]) -> dict[str, Any]:
    """One cell's details: exact match per mode over all rows, over the rows beyond attention's view, by distance."""
    hits = {mode: [score_key(answer, row["target"]) for answer, row in zip(texts, rows)]
            for mode, texts in answers.items()}
    lengths = list(map(len, prompts))
    detail: dict[str, Any] = {"num_samples": len(rows), "chance": KEY_CHANCE,
                              "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                                                "mean": sum(lengths) / len(lengths)}}
    detail.update({mode: {"exact_match": sum(flags) / len(flags)} for mode, flags in hits.items()})
    beyond = [index for index, entry in enumerate(placed) if entry.get("beyond_attention")]
    detail["beyond_attention"] = {"num_samples": len(beyond), **{
        mode: sum(flags[i] for i in beyond) / len(beyond) if beyond else None for mode, flags in hits.items()}}
    distances = [entry.get("distance_chunks") for entry in placed]
    known = [distance for distance in distances if distance is not None]
    if known:
        detail["distance_chunks"] = {"min": min(known), "max": max(known), "mean": sum(known) / len(known),
                                     "num_samples": len(known)}
        detail["by_distance"] = accuracy_by_distance(distances, hits)
    return detail


def _answer_cell(model, tokenizer, prompts, places, modes, batch_size, padding_multiple, max_new_tokens, progress
                 ) -> dict[str, list[str]]:
    """The greedy answers of one cell's prompts in each mode."""
    config = greedy_generation_config(model, tokenizer, max_new_tokens)
    batches = answer_batches(prompts, batch_size, padding_multiple)
    answers = {}
    if "memory_swap" in modes:  # each row's stream up to its question serves its own answer and the swapped one
        answers["memory"], answers["memory_swap"] = memory_and_swapped_answers(
            model, tokenizer, prompts, [place.question for place in places], swap_partners(len(prompts)),
            max_new_tokens, progress)
    else:
        answers["memory"] = generate_answers(model, tokenizer, prompts, batches, config, progress)
    if "no_memory" in modes:
        with model.memory_disabled():
            answers["no_memory"] = generate_answers(model, tokenizer, prompts, batches, config, progress)
    return answers


def evaluate_needle(
    model,
    tokenizer,
    data: Mapping[tuple[str, int | str], Any],
    max_new_tokens: int = 8,
    batch_size: int = 1,
    output_dir: str | os.PathLike | None = None,
    ablation: bool = True,
    swap: bool = True,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Answer needle rows greedily and score exact match of the key per (task, length): with the memory on, off
    (`ablation`, inside `model.memory_disabled()`) and read with another row's memory (`swap`, cells of 2 rows or
    more; see the module's docstring).

    `data` maps (task, length) to rows (`generate_needle`'s, or another harness's `{"input", "question", "target"}`
    passkey rows: the same prompt) or to files of such rows (JSON, JSON Lines, parquet). Returns, and with
    `output_dir` writes as results.json beside heatmap.png, accuracy_by_distance.png and predictions.jsonl::

        {"metric": "exact_match", "chunk_size", "trained_length": None, "swap_partner": "the row before",
         "accuracy": {task: {length: {"memory", "no_memory", "memory_swap"}}},
         "details": {task: {length: {"num_samples", "chance", "prompt_tokens", "memory": {"exact_match"}, ...,
                                     "beyond_attention": {"num_samples", "memory", "no_memory", "memory_swap"},
                                     "distance_chunks", "by_distance": {bin: {"num_samples", mode: acc}}}}}}

    A row's distance is the number of chunks from the chunk of its key's first token to the chunk of the prompt's
    last token; predictions.jsonl gives each row's key position in tokens too.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and batch_size={batch_size} must be >= 1")
    if (ablation or swap) and not hasattr(model, "memory_disabled"):
        raise ValueError(f"the memory-off and memory-swap passes need a TitansQwenForCausalLM, got {type(model).__name__}")
    if not data:
        raise ValueError("evaluate_needle: data is empty; give rows or files per (task, length)")
    folder = None if output_dir is None else prepare_output_dir(output_dir, OUTPUT_NAMES)
    memory_config = getattr(model.config, "memory_config", None)
    chunk_size = getattr(memory_config, "chunk_size", None)
    view = int(getattr(memory_config, "attend_previous_chunk", False))
    cells = [(task, str(length), resolve_rows(task, length, source)) for (task, length), source in data.items()]
    results: dict[str, Any] = {"metric": "exact_match", "chunk_size": chunk_size, "trained_length": None,
                               "swap_partner": "the row before (the first row: the last)", "accuracy": {},
                               "details": {}}
    lines: list[str] = []
    was_training = model.training
    model.eval()
    try:
        total = sum(len(rows) * (1 + ablation + (swap and len(rows) > 1)) for _, _, rows in cells)
        with tqdm(total=total, desc="needle eval", unit="answer", disable=not show_progress) as progress:
            for task, length, rows in cells:
                modes = ["memory"] + ["no_memory"] * ablation + ["memory_swap"] * (swap and len(rows) > 1)
                prompts = [prompt_ids(row, tokenizer, PROMPT_TEMPLATE) for row in rows]
                places = [needle_token(row, tokenizer) for row in rows]
                answers = _answer_cell(model, tokenizer, prompts, places, modes, batch_size,
                                       padding_multiple_for(model, None), max_new_tokens, progress)
                placed = _cell_rows(prompts, places, chunk_size, view)
                detail = _score_cell(rows, answers, placed, prompts)
                results["details"].setdefault(task, {})[length] = detail
                results["accuracy"].setdefault(task, {})[length] = {mode: detail[mode]["exact_match"] for mode in modes}
                lines += [json.dumps({"task": task, "length": length, "index": index, "target": row["target"],
                                      **placed[index], **{mode: answers[mode][index] for mode in modes}},
                                     ensure_ascii=False) for index, row in enumerate(rows)]
    finally:
        model.train(was_training)
    if folder is not None:
        write_outputs(folder, results, lines, plot_heatmap, plot_accuracy_by_distance)
    return results


def _table(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def format_needle_results(results: Mapping[str, Any]) -> str:
    """What `titans-hf eval --tasks passkey mk` prints: exact match per cell with the memory on, off and swapped, over
    all rows and over the rows whose key lies beyond attention's view; then the same by distance in chunks."""
    modes = list(MODE_TITLES)
    lines = [["task", "length", "n", "memory", "no memory", "memory swap", "beyond view: n", "memory", "no memory",
              "memory swap"]]
    distance_lines = [["task", "length", "distance (chunks)", "n", "memory", "no memory", "memory swap"]]
    for task, per_length in results["details"].items():
        for length, cell in per_length.items():
            beyond = cell["beyond_attention"]
            lines.append([task, length, str(cell["num_samples"]),
                          *(_percent(cell.get(mode, {}).get("exact_match")) for mode in modes),
                          str(beyond["num_samples"]), *(_percent(beyond.get(mode)) for mode in modes)])
            distance_lines += [[task, length, label, str(entry["num_samples"]),
                                *(_percent(entry.get(mode)) for mode in modes)]
                               for label, entry in cell.get("by_distance", {}).items()]
    text = _table(lines)
    if len(distance_lines) > 1:
        text += f"\n\nby distance from the key to the question:\n{_table(distance_lines)}"
    return text
