"""What every task's evaluation shares: rows of a (task, length) cell read from files or given, greedy answers in
batches that answer as each row alone, with the memory on, off (`memory_disabled()`, the same weights) and, for a
task that asks for it, read with another row's memory (the needle's `memory_and_swapped_answers`); accuracy by distance in chunks; and the
outputs, results.json beside the heatmap, the accuracy-by-distance plot and predictions.jsonl, written so that a
results.json only ever stands beside the files of its own run.

A task's own evaluation (`titans_hf.tasks.babilong.evaluation`, `titans_hf.tasks.needle.evaluation`) adds what is
its own: which rows, how an answer is scored, where a row's fact lies.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from titans_hf.data.tokenizers import resolve_pad_token_id
from titans_hf.files import atomic_write, atomic_write_json, atomic_write_text
from titans_hf.outputs import record_outputs
from titans_hf.tasks.babilong.files import REQUIRED_FIELDS, read_babilong_file, read_babilong_files

RESULTS_NAME = "results.json"
HEATMAP_NAME = "heatmap.png"
PREDICTIONS_NAME = "predictions.jsonl"
DISTANCE_PLOT_NAME = "accuracy_by_distance.png"
OUTPUT_NAMES = (RESULTS_NAME, HEATMAP_NAME, PREDICTIONS_NAME, DISTANCE_PLOT_NAME)
# The ways a row is read, as results name them, and as figures title them.
MODE_TITLES = {"memory": "with memory", "no_memory": "memory off (same weights)",
               "memory_swap": "another row's memory"}

PathLike = str | os.PathLike


def resolve_rows(task: str, length: int | str, source) -> list[Mapping[str, str]]:
    """The rows of one cell: read from a file or the files of one set, or checked when given as rows."""
    if isinstance(source, (str, os.PathLike)):
        return read_babilong_file(source)
    items = list(source)
    if items and all(isinstance(item, (str, os.PathLike)) for item in items):
        return read_babilong_files(items)
    if not items:
        raise ValueError(f"evaluate: no rows for task {task!r} length {length!r}")
    for index, row in enumerate(items):
        missing = [field for field in REQUIRED_FIELDS if field not in row]
        if missing:
            raise ValueError(f"evaluate: task {task!r} length {length!r} row {index} lacks {missing}")
    return items


def describe_source(source) -> str:
    """A cell's source for messages: its file(s), or that the rows were given."""
    if isinstance(source, (str, os.PathLike)):
        return f"BABILong file {source}"
    items = list(source)
    if items and all(isinstance(item, (str, os.PathLike)) for item in items):
        return f"BABILong files {', '.join(map(str, items))}"
    return "the rows given"


def distance_bucket(distance: int) -> str:
    """The distance bin (in chunks) a row is reported in: 0, 1, then powers of two (2-3, 4-7, 8-15, ...)."""
    if distance < 2:
        return str(distance)
    low = 1 << (distance.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def accuracy_by_distance(distances: Sequence[int | None], hits: Mapping[str, Sequence[bool]]) -> dict[str, Any]:
    """Exact match per distance bin, per mode, over the rows whose distance is known, in order of distance."""
    by_bin: dict[str, list[int]] = {}
    for index, distance in sorted(enumerate(distances), key=lambda pair: -1 if pair[1] is None else pair[1]):
        if distance is not None:
            by_bin.setdefault(distance_bucket(distance), []).append(index)
    return {label: {"num_samples": len(indices),
                    **{mode: sum(flags[i] for i in indices) / len(indices) for mode, flags in hits.items()}}
            for label, indices in by_bin.items()}


def answer_batches(prompts: Sequence[list[int]], batch_size: int, padding_multiple: int | None) -> list[list[int]]:
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


def padding_multiple_for(model, mixed_length_batches: bool | None) -> int | None:
    """The left-padding unit batches may use (None: equal lengths only), from the model's `padding_multiple`."""
    multiple = getattr(model, "padding_multiple", None)
    if mixed_length_batches and multiple is None:
        raise ValueError(f"mixed_length_batches=True needs a model with padding_multiple (a TitansQwenForCausalLM), "
                         f"got {type(model).__name__}")
    return multiple if mixed_length_batches in (None, True) else None


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


def left_padded(prompts: Sequence[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of prompts left-padded with `pad_id` to the longest; the mask is 0 on padding."""
    longest = max(map(len, prompts))
    input_ids = [[pad_id] * (longest - len(prompt)) + list(prompt) for prompt in prompts]
    mask = [[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts]
    return (torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(mask, dtype=torch.long, device=device))


def generate_answers(model, tokenizer, prompts, batches, generation_config, progress) -> list[str]:
    """Greedy answers of `prompts`, one `generate` call per batch of row indices, in the rows' order."""
    answers: list[str] = [""] * len(prompts)
    for batch in batches:
        input_ids, attention_mask = left_padded([prompts[i] for i in batch], generation_config.pad_token_id,
                                                 model.device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        for index, text in zip(batch, texts):
            answers[index] = text
        progress.update(len(batch))
    return answers


def length_label(length: str, chunk_size: int | None) -> str:
    """A length as the README's tables write it: "1024 (32)" = 1024 tokens, 32 chunks; a published label as is."""
    if chunk_size and length.isdigit() and int(length) > 0:
        return f"{length} ({math.ceil(int(length) / chunk_size)})"
    return length


def plot_note(results: Mapping[str, Any]) -> str:
    """Chance and the trained length, for a figure's title."""
    chances = sorted({round(100 * cell["chance"], 1) for per_length in results["details"].values()
                      for cell in per_length.values()})
    note = f"chance {' / '.join(f'{c:g}' for c in chances)} %"
    trained, chunk_size = results.get("trained_length"), results.get("chunk_size")
    if trained:
        note += f"; trained on inputs of up to {length_label(str(trained), chunk_size)} tokens (chunks)"
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
    modes = [mode for mode in MODE_TITLES if any(mode in cell for t in tasks for cell in accuracy[t].values())]
    titles = MODE_TITLES
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
        axis.set_xticks(range(len(lengths)), [length_label(length, results.get("chunk_size")) for length in lengths],
                        fontsize=8)
        axis.set_yticks(range(len(tasks)), tasks)
        axis.set_xlabel("input tokens (chunks)" if results.get("chunk_size") else "input length (tokens)")
        axis.set_title(titles[mode])
    figure.colorbar(image, ax=list(axes[0]), label="exact match (%)")
    figure.suptitle(plot_note(results), fontsize=9, y=1.02)
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
        for mode, style in (("memory", "-"), ("no_memory", "--"), ("memory_swap", ":")):
            points = [(bins.index(label), 100 * entry[mode]) for label, entry in cell["by_distance"].items()
                      if mode in entry]
            if points:
                label = f"{task} {length_label(length, results.get('chunk_size'))}"
                axis.plot(*zip(*points), style, marker="o", markersize=3, color=colour,
                          label=f"{label}, {MODE_TITLES[mode]}")
    chance = 100 * cells[0][2]["chance"]
    axis.axhline(chance, color="grey", linestyle=":", linewidth=1, label=f"chance {chance:.1f} %")
    axis.set_xticks(range(len(bins)), bins)
    axis.set_ylim(0, 102)
    axis.set_xlabel("chunks between the supporting fact and the question")
    axis.set_ylabel("exact match (%)")
    axis.set_title(plot_note(results), fontsize=9)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    path = Path(path)
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))
    plt.close(figure)
    return path


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


def write_outputs(folder: Path, results: Mapping[str, Any], prediction_lines: Sequence[str],
                  heatmap: Callable[[Mapping[str, Any], Path], Path],
                  by_distance: Callable[[Mapping[str, Any], Path], Path]) -> None:
    """predictions.jsonl, the heatmap, the accuracy-by-distance plot (when a cell has accuracy by distance) and
    results.json, last: results.json present means the whole evaluation finished. An older results.json goes first
    (it would vouch for the new files until the new one lands), and a failure leaves none of the outputs behind.
    `heatmap` / `by_distance` draw the figures (a task passes its module's, `plot_heatmap` and
    `plot_accuracy_by_distance` here)."""
    (folder / RESULTS_NAME).unlink(missing_ok=True)
    written = [PREDICTIONS_NAME, HEATMAP_NAME, RESULTS_NAME]
    try:
        atomic_write_text(folder / PREDICTIONS_NAME, "\n".join(prediction_lines) + "\n")
        heatmap(results, folder / HEATMAP_NAME)
        if any("by_distance" in cell for per_length in results["details"].values() for cell in per_length.values()):
            by_distance(results, folder / DISTANCE_PLOT_NAME)
            written.append(DISTANCE_PLOT_NAME)
        else:  # an earlier evaluation's plot would not belong to these results
            (folder / DISTANCE_PLOT_NAME).unlink(missing_ok=True)
        atomic_write_json(folder / RESULTS_NAME, results)
    except BaseException:  # no half of the outputs stays behind
        for name in OUTPUT_NAMES:
            (folder / name).unlink(missing_ok=True)
        raise
    record_outputs(folder, written, "titans-hf eval")
