"""Language-model evaluation on held-out windows: loss and perplexity per chunk index, memory on vs off.

A window of W tokens is read in chunks of `chunk_size`; every labelled token is charged to the chunk it lies in
(its prediction comes from the token before it, across a chunk boundary too). Run with the memory on and, on the
same weights, inside `memory_disabled()`: where the memory carries something from earlier chunks, the later chunks'
loss falls with it on, while the first chunk (whose memory has read nothing yet) should stay as it was. Windows
from a `seq` store count every token; an `sft` store's loss mask restricts the count to the tokens it marks (e.g.
the recalled values of `titans_hf.tasks.recall`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from titans_hf.files import atomic_write, atomic_write_json
from titans_hf.outputs import prepare_output_dir, record_outputs

LM_RESULTS_NAME = "lm_results.json"
LM_PLOT_NAME = "loss_per_chunk.png"
LM_OUTPUT_NAMES = (LM_RESULTS_NAME, LM_PLOT_NAME)


def _per_chunk(model, windows: Sequence[dict[str, Any]], batch_size: int, boundary_tokens: int,
               progress) -> tuple[list[float], list[int], list[float]]:
    """Summed loss and token count per chunk index over `windows`, and the summed loss and count of the tokens
    within `boundary_tokens` of the start of a chunk after the first."""
    chunk_size = model.config.memory_config.chunk_size
    sums: list[float] = []
    counts: list[int] = []
    starts = [0.0, 0]
    for start in range(0, len(windows), batch_size):
        rows = [windows[i] for i in range(start, min(start + batch_size, len(windows)))]
        width = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for index, row in enumerate(rows):  # right padding: a row's tokens start where its chunks start
            length = len(row["input_ids"])
            input_ids[index, :length] = torch.as_tensor(row["input_ids"])
            labels[index, :length] = torch.as_tensor(row["labels"])
            attention[index, :length] = torch.as_tensor(row.get("attention_mask", [1] * length))
        device = model.device
        with torch.no_grad():
            losses = model(input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device),
                           return_token_losses=True).token_losses.cpu()
        labelled = (labels != -100)
        labelled[:, 0] = False  # nothing predicts the first token
        chunks = math.ceil(width / chunk_size)
        while len(sums) < chunks:
            sums.append(0.0)
            counts.append(0)
        for chunk in range(chunks):
            span = slice(chunk * chunk_size, (chunk + 1) * chunk_size)
            sums[chunk] += float(losses[:, span][labelled[:, span]].double().sum())
            counts[chunk] += int(labelled[:, span].sum())
            if chunk:
                head = slice(chunk * chunk_size, chunk * chunk_size + boundary_tokens)
                starts[0] += float(losses[:, head][labelled[:, head]].double().sum())
                starts[1] += int(labelled[:, head].sum())
        progress.update(len(rows))
    return sums, counts, starts


def evaluate_lm(
    model,
    windows: Sequence[dict[str, Any]],
    batch_size: int = 8,
    output_dir: str | os.PathLike | None = None,
    ablation: bool = True,
    boundary_tokens: int = 8,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Loss and perplexity per chunk index of `windows` (rows with `input_ids`, `labels`, optionally
    `attention_mask`, as `load_dataset("titans_tokens")` gives them), with the memory on and, with `ablation`,
    off on the same weights. Returns (and with `output_dir` writes as lm_results.json beside a plot of loss against
    chunk position, loss_per_chunk.png)::

        {"chunk_size": C, "num_windows": N,
         "memory":    {"loss": [per chunk], "perplexity": [...], "tokens": [...], "loss_after_first_chunk": x,
                       "loss_first_chunk": y, "loss_chunk_starts": z},
         "no_memory": {... the same ...},
         "ratio": {"per_chunk": [memory / no memory], "after_first_chunk": ..., "first_chunk": ...,
                   "chunk_starts": ...}}

    `loss_chunk_starts` is the loss of the first `boundary_tokens` tokens of every chunk after the first, where a
    chunk's attention has seen the least (what `attend_previous_chunk` is for). A chunk with no labelled token has
    loss None.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if not 1 <= boundary_tokens <= model.config.memory_config.chunk_size:
        raise ValueError(f"boundary_tokens={boundary_tokens} must lie in [1, chunk_size="
                         f"{model.config.memory_config.chunk_size}]")
    if not len(windows):
        raise ValueError("evaluate_lm: no windows to evaluate")
    if ablation and not hasattr(model, "memory_disabled"):
        raise ValueError(f"ablation=True needs a TitansQwenForCausalLM, got {type(model).__name__}")
    modes = ["memory", "no_memory"] if ablation else ["memory"]
    was_training = model.training
    model.eval()
    results: dict[str, Any] = {"chunk_size": model.config.memory_config.chunk_size, "num_windows": len(windows),
                               "boundary_tokens": boundary_tokens}
    try:
        with tqdm(total=len(windows) * len(modes), desc="LM eval", unit="window", disable=not show_progress) as bar:
            for mode in modes:
                bar.set_description(f"LM eval, {mode.replace('_', ' ')}")
                if mode == "memory":
                    sums, counts, starts = _per_chunk(model, windows, batch_size, boundary_tokens, bar)
                else:
                    with model.memory_disabled():
                        sums, counts, starts = _per_chunk(model, windows, batch_size, boundary_tokens, bar)
                results[mode] = _summary(sums, counts, starts)
    finally:
        model.train(was_training)
    if ablation:
        results["ratio"] = _ratios(results["memory"], results["no_memory"])
    if output_dir is not None:
        _write_outputs(results, output_dir)
    return results


def _summary(sums: list[float], counts: list[int], starts: list[float]) -> dict[str, Any]:
    """One mode's figures from `_per_chunk`'s sums and counts: the loss, perplexity and tokens per chunk index, and
    the loss of the first chunk, of every later one and of the chunks' starts (None where no token counts)."""
    losses = [s / c if c else None for s, c in zip(sums, counts)]
    later = sum(counts[1:])
    return {
        "loss": losses,
        "perplexity": [None if loss is None else math.exp(loss) for loss in losses],
        "tokens": counts,
        "loss_first_chunk": losses[0],
        "loss_after_first_chunk": sum(sums[1:]) / later if later else None,
        "loss_chunk_starts": starts[0] / starts[1] if starts[1] else None,
    }


def _ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Memory on over memory off, per chunk index and for each summary loss (None where either has no loss)."""
    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    return {
        "per_chunk": [ratio(a, b) for a, b in zip(on["loss"], off["loss"])],
        "first_chunk": ratio(on["loss_first_chunk"], off["loss_first_chunk"]),
        "after_first_chunk": ratio(on["loss_after_first_chunk"], off["loss_after_first_chunk"]),
        "chunk_starts": ratio(on["loss_chunk_starts"], off["loss_chunk_starts"]),
    }


def _write_outputs(results: dict[str, Any], output_dir: str | os.PathLike) -> None:
    """lm_results.json and the plot into `output_dir`; the results last, so that their presence means the evaluation
    finished."""
    folder = prepare_output_dir(output_dir, LM_OUTPUT_NAMES)
    (folder / LM_RESULTS_NAME).unlink(missing_ok=True)  # an older one would vouch for the new plot
    try:
        plot_loss_per_chunk(results, folder / LM_PLOT_NAME)
        # a loss that is not finite is written as null
        atomic_write_json(folder / LM_RESULTS_NAME, results)
    except BaseException:
        (folder / LM_PLOT_NAME).unlink(missing_ok=True)
        raise
    record_outputs(folder, LM_OUTPUT_NAMES, "titans-hf eval --lm")


def plot_loss_per_chunk(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Loss against chunk position (numbered from 1, whole-number ticks), one line with the memory and one without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(6, 3.5))
    labels = {"memory": "with memory", "no_memory": "memory off (same weights)"}
    for mode in ("memory", "no_memory"):
        if mode in results:
            losses = results[mode]["loss"]
            points = [(index + 1, loss) for index, loss in enumerate(losses) if loss is not None]
            axis.plot([i for i, _ in points], [loss for _, loss in points], marker="o", label=labels[mode])
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel(f"chunk (1 = the first; chunks of {results['chunk_size']} tokens)")
    axis.set_ylabel("loss per token (cross-entropy)")
    axis.set_title("Loss per chunk position")
    axis.legend()
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))
    plt.close(figure)
    return Path(path)


def format_lm_table(results: dict[str, Any]) -> str:
    """Loss per chunk with and without the memory, and their ratio, as plain text."""
    def number(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [["chunk", "tokens", "memory", "no memory", "ratio"]]
    for index, loss in enumerate(results["memory"]["loss"]):
        off = results.get("no_memory", {}).get("loss", [None] * (index + 1))[index]
        ratio = results.get("ratio", {}).get("per_chunk", [None] * (index + 1))[index]
        lines.append([str(index), str(results["memory"]["tokens"][index]), number(loss), number(off), number(ratio)])
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
    starts = results["memory"].get("loss_chunk_starts")
    if starts is None:
        return table
    off = results.get("no_memory", {}).get("loss_chunk_starts")
    return (f"{table}\nfirst {results['boundary_tokens']} tokens of every later chunk: memory {number(starts)}, "
            f"no memory {number(off)}")
