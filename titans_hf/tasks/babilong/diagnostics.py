"""What a memory does over a long BABILong row: how strongly it writes and forgets on the supporting fact and on the
haystack, how its fast weights grow, and how well the fact can still be read back as chunks pass.

For each row the model streams the prompt once (memory on); a forward hook on every memory layer's `NeuralMemory`
records each call's input and the state it returns. From those, per memory layer:

* ``theta``: the write strength per token, mean over heads, on the supporting fact's tokens and on the others;
* ``momentum`` (eta) and ``forget`` (alpha) per update chunk, on update chunks holding a fact token and on the rest;
* ``weight_norm``: ``||W_c||`` (Frobenius, over heads and layers of the memory MLP) after each attention chunk c,
  and ``weight_change``: ``||W_c - W_init||``;
* ``fact_signal``: what of the fact the weights still hold, by distance in chunks. The row is streamed beside a copy
  whose supporting fact names another place (the same number of tokens, everything else equal), so the two weights
  differ only by what that fact wrote: ``||W_c - W'_c|| / ||W_w - W'_w||`` for each chunk c from the chunk w on
  where the fact has finished writing (the chunk after the last one whose attention saw it: the convolution carries
  its keys over), by distance from the fact's chunk (1 at w: all of it; 0: forgotten or overwritten);
* ``question_read_signal``: the same difference where it counts, in what the prompt's last 8 tokens (the question
  and "Answer:") read, ``||read - read'|| / ||read||``, with the row's distance in chunks from fact to question.

`diagnose_memory` returns these as a dict (JSON-ready) and `plot_diagnostics` draws them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from titans_hf.data.tokenizers import plain_backend_tokenizer
from titans_hf.files import atomic_write
from titans_hf.tasks.babilong import PROMPT_TEMPLATE, supporting_fact_spans, task_labels
from titans_hf.tasks.babilong.evaluation import prompt_ids

QUESTION_TOKENS = 8  # the prompt's last tokens ("Where is Mary?\nAnswer:"), whose reads decide the answer


def _fact_token_mask(row: Mapping[str, str], spans: Sequence[tuple[int, int]], tokenizer, length: int) -> torch.Tensor:
    """[length] bool: the prompt tokens that overlap the character `spans` of `row["input"]`."""
    prompt = PROMPT_TEMPLATE.format(input=row["input"], question=row["question"])
    encoding = plain_backend_tokenizer(tokenizer).encode(prompt, add_special_tokens=True)
    mask = torch.zeros(length, dtype=torch.bool)
    for start, end in spans:
        tokens = {encoding.char_to_token(char) for char in range(start, end)} - {None}
        mask[sorted(tokens)] = True
    return mask


def _counterfactual(row: Mapping[str, str], task: str, tokenizer, labels: Sequence[str]
                    ) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
    """(prompt ids, the same prompt with the earliest supporting fact's answer word replaced by another label of as
    many tokens, the fact spans), or None when no such label exists or the task's facts cannot be found."""
    spans = supporting_fact_spans(row, task)
    if spans is None:
        return None
    ids = prompt_ids(row, tokenizer)
    start, end = spans[0]
    fact = row["input"][start:end]
    for label in labels:
        for word in [w for w in labels if w != label and f" {w}" in fact]:
            at = start + fact.rindex(f" {word}") + 1
            other = dict(row, input=row["input"][:at] + label + row["input"][at + len(word):])
            other_ids = prompt_ids(other, tokenizer)
            if len(other_ids) == len(ids) and other_ids != ids:
                return ids, other_ids, spans
    return None


def _record_calls(model) -> tuple[dict[int, list[tuple[torch.Tensor, Any]]], list]:
    """Per memory layer, the (input hidden, reads, returned state) of every NeuralMemory call; the hook handles."""
    calls: dict[int, list] = {}
    handles = []
    for layer, block in model.memory.items():
        calls[int(layer)] = []

        def hook(module, args, output, store=calls[int(layer)]):
            store.append((args[0].detach(), output[0].detach(), output[1]))

        handles.append(block.neural_memory.register_forward_hook(hook))
    return calls, handles


def _norm(weights: Sequence[torch.Tensor]) -> float:
    """Frobenius norm over a list of tensors."""
    return float(torch.sqrt(sum(w.double().square().sum() for w in weights)))


@torch.no_grad()
def _row_diagnostics(memory, calls, fact_mask: torch.Tensor, question: slice, chunk_size: int,
                     attend_previous_chunk: bool) -> dict[str, Any]:
    """The measures of one memory layer from its recorded calls on a batch of two rows: the row, its
    counterfactual."""
    hidden = torch.cat([h for h, _, _ in calls], dim=1)
    T = hidden.shape[1]
    real = torch.ones(2, T, dtype=memory.state_dtype, device=hidden.device)
    tail = torch.zeros(2, memory.conv_kernel - 1, 3 * memory.memory_num_heads * memory.memory_head_dim,
                       dtype=memory.state_dtype, device=hidden.device)
    _, _, _, theta, gate_logits, _ = memory.token_inputs(hidden, tail, None, real)
    H, C = memory.memory_num_heads, memory.memory_chunk_size
    theta = theta[0].mean(0)  # [T]
    n_full = T // C
    chunk_gates = torch.sigmoid(gate_logits[0, : n_full * C].view(n_full, C, 2 * H).mean(1))  # [n, 2H]
    chunk_has_fact = fact_mask[: n_full * C].view(n_full, C).any(1)

    initial = [w.to(memory.state_dtype).unsqueeze(0) for w in memory.initial_weights]
    fact_chunk = int(fact_mask.nonzero()[0]) // chunk_size
    # what differs between the two rows reaches the memory's keys and values until the end of the chunk after the
    # last one whose attention saw the fact (the convolution carries its last tokens over); from then on it only fades
    last_fact_chunk = int(fact_mask.nonzero()[-1]) // chunk_size
    written_chunk = min(last_fact_chunk + 1 + int(attend_previous_chunk), len(calls) - 1)
    weight_norm, weight_change, signal = [], [], {}
    for chunk, (_, _, state) in enumerate(calls):
        weights = [w.to(memory.state_dtype) for w in state.weights]
        weight_norm.append(_norm([w[:1] for w in weights]))
        weight_change.append(_norm([w[:1] - w0 for w, w0 in zip(weights, initial)]))
        if chunk >= written_chunk:
            signal[chunk - fact_chunk] = _norm([w[:1] - w[1:] for w in weights])
    written = signal[written_chunk - fact_chunk]
    question_chunk = (T - 1) // chunk_size
    reads = torch.cat([read for _, read, _ in calls], dim=1)[:, question]
    def mean(values: torch.Tensor) -> float | None:
        return float(values.mean()) if values.numel() else None

    return {
        "theta": {"fact": mean(theta[fact_mask]), "haystack": mean(theta[~fact_mask])},
        "momentum": {"fact": mean(chunk_gates[chunk_has_fact, :H]), "haystack": mean(chunk_gates[~chunk_has_fact, :H])},
        "forget": {"fact": mean(chunk_gates[chunk_has_fact, H:]), "haystack": mean(chunk_gates[~chunk_has_fact, H:])},
        "weight_norm": weight_norm,
        "weight_change": weight_change,
        "fact_signal": {d: value / written if written > 0 else math.nan for d, value in signal.items()},
        "question_read_signal": float((reads[0] - reads[1]).norm() / reads[0].norm().clamp(min=1e-12)),
        "distance_chunks": question_chunk - fact_chunk,
        "fact_chunk": fact_chunk,
    }


def diagnose_memory(model, tokenizer, rows: Sequence[Mapping[str, str]], task: str = "qa1",
                    show_progress: bool = True) -> dict[str, Any]:
    """Stream each row's prompt beside its counterfactual through `model` (a TitansQwenForCausalLM, memory on) and
    measure its memories (see the module docstring); rows whose fact has no counterfactual of equal length are
    skipped and counted. Returns ``{"chunk_size", "task", "num_rows", "skipped_rows", "layers": {layer: {"theta",
    "momentum", "forget": {"fact", "haystack"}, "weight_norm", "weight_change": [per chunk], "fact_signal":
    {distance: mean}, "question_read_signal": [[distance, value] per row], "per_row": [...]}}}``, means over rows."""
    labels, _ = task_labels(task, rows)
    chunk_size = model.config.memory_config.chunk_size
    was_training = model.training
    model.eval()
    per_layer: dict[int, list[dict[str, Any]]] = {int(layer): [] for layer in model.memory}
    skipped = 0
    try:
        for row in tqdm(rows, desc="memory diagnostics", unit="row", disable=not show_progress):
            pair = _counterfactual(row, task, tokenizer, labels)
            if pair is None:
                skipped += 1
                continue
            ids, other_ids, spans = pair
            fact_mask = _fact_token_mask(row, spans, tokenizer, len(ids)).to(model.device)
            calls, handles = _record_calls(model)
            try:
                with model.chunk_by_chunk():  # one memory call, one recorded state, per chunk
                    model(input_ids=torch.tensor([ids, other_ids], device=model.device), logits_to_keep=1)
            finally:
                for handle in handles:
                    handle.remove()
            for layer, block in model.memory.items():
                per_layer[int(layer)].append(_row_diagnostics(block.neural_memory, calls[int(layer)], fact_mask,
                                                              slice(-QUESTION_TOKENS, None), chunk_size,
                                                              model.config.memory_config.attend_previous_chunk))
    finally:
        model.train(was_training)
    if not any(per_layer.values()):
        raise ValueError(f"diagnose_memory: none of the {len(rows)} rows has a supporting fact with a counterfactual")
    return {"chunk_size": chunk_size, "task": task, "num_rows": len(rows) - skipped, "skipped_rows": skipped,
            "layers": {str(layer): _summarise(rows_) for layer, rows_ in per_layer.items()}}


def _summarise(per_row: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over rows (ignoring rows where a measure does not exist)."""
    def mean(values):
        values = [value for value in values if value is not None and not math.isnan(value)]
        return sum(values) / len(values) if values else None

    summary: dict[str, Any] = {
        name: {kind: mean([row[name][kind] for row in per_row]) for kind in ("fact", "haystack")}
        for name in ("theta", "momentum", "forget")
    }
    for name in ("weight_norm", "weight_change"):
        longest = max(len(row[name]) for row in per_row)
        summary[name] = [mean([row[name][c] for row in per_row if c < len(row[name])]) for c in range(longest)]
    distances = sorted({d for row in per_row for d in row["fact_signal"]})
    summary["fact_signal"] = {str(d): mean([row["fact_signal"].get(d) for row in per_row]) for d in distances}
    summary["question_read_signal"] = sorted([row["distance_chunks"], row["question_read_signal"]] for row in per_row)
    summary["per_row"] = [{**row, "fact_signal": {str(d): v for d, v in row["fact_signal"].items()}}
                          for row in per_row]
    return summary


def plot_diagnostics(diagnostics: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Two panels per memory layer: what is left of the fact by distance in chunks (in the weights, and in the
    question's read of each row), and the fast weights' norm by chunk; the gates' means on fact and haystack in the
    titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = diagnostics["layers"]
    figure, axes = plt.subplots(len(layers), 2, figsize=(10, 3.4 * len(layers)), squeeze=False)
    for (recall_axis, norm_axis), (layer, summary) in zip(axes, layers.items()):
        distances = [int(d) for d in summary["fact_signal"]]
        recall_axis.plot(distances, list(summary["fact_signal"].values()), marker=".", linewidth=1,
                         label="in the weights (mean over rows)")
        if summary["question_read_signal"]:
            recall_axis.scatter(*zip(*summary["question_read_signal"]), s=12, color="tab:red",
                                label="in the question's read (a row)")
        recall_axis.set_yscale("log")
        recall_axis.set_xlabel("chunks since the supporting fact's chunk")
        recall_axis.set_ylabel("what is left of the fact")
        recall_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        recall_axis.legend(fontsize=7)
        gates = ", ".join(f"{name} {summary[name]['fact']:.3g} / {summary[name]['haystack']:.3g}"
                          for name in ("theta", "forget", "momentum")
                          if summary[name]["fact"] is not None and summary[name]["haystack"] is not None)
        recall_axis.set_title(f"layer {layer}: fact / haystack {gates}", fontsize=8)
        chunks = range(1, len(summary["weight_norm"]) + 1)
        norm_axis.plot(chunks, summary["weight_norm"], label="||W||")
        norm_axis.plot(chunks, summary["weight_change"], label="||W - W_init||")
        norm_axis.set_xlabel("chunk")
        norm_axis.set_ylabel("fast weights' norm")
        norm_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        norm_axis.legend(fontsize=7)
    figure.suptitle(f"{diagnostics['task']}, {diagnostics['num_rows']} rows, chunks of {diagnostics['chunk_size']} "
                    "tokens", fontsize=9)
    figure.tight_layout()
    path = Path(path)
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight"))
    plt.close(figure)
    return path


__all__ = ["diagnose_memory", "plot_diagnostics"]
