"""Per-chunk language-model evaluation against losses computed by hand from the model's full logits."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from titans_hf.lm_evaluation import LM_PLOT_NAME, LM_RESULTS_NAME, evaluate_lm, format_lm_table
from titans_hf.modeling import TitansQwenForCausalLM


def by_hand(model, windows, chunk_size, boundary_tokens=3):
    """Mean cross-entropy and count of the labelled tokens per chunk of the token's position, and the mean over the
    first `boundary_tokens` positions of the chunks after the first."""
    sums, counts, starts = {}, {}, []
    for row in windows:
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0]
        for t in range(1, len(row["input_ids"])):
            if row["labels"][t] == -100:
                continue
            loss = F.cross_entropy(logits[t - 1].double(), torch.tensor(row["labels"][t])).item()
            chunk = t // chunk_size
            sums[chunk] = sums.get(chunk, 0.0) + loss
            counts[chunk] = counts.get(chunk, 0) + 1
            if chunk and t % chunk_size < boundary_tokens:
                starts.append(loss)
    return ([sums[c] / counts[c] for c in sorted(sums)], [counts[c] for c in sorted(counts)],
            sum(starts) / len(starts))


def test_loss_per_chunk_equals_the_hand_computed_loss_with_and_without_memory(tiny_qwen3_dir, tmp_path):
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=8, memory_chunk_size=4, memory_head_dim=16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.memory."):
                param.add_(0.2 * torch.randn_like(param))
    generator = torch.Generator().manual_seed(1)
    windows = []
    for length in (24, 24, 19):  # the last row is shorter: right-padded in its batch
        ids = torch.randint(1, 200, (length,), generator=generator).tolist()
        labels = list(ids)
        labels[5] = labels[17] = -100  # a loss mask, as an sft store gives
        windows.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * length})

    results = evaluate_lm(model.eval(), windows, batch_size=2, output_dir=tmp_path, boundary_tokens=3,
                          show_progress=False)
    expected, counts, starts = by_hand(model, windows, 8)
    assert results["memory"]["tokens"] == counts == [7 * 3 - 3, 8 * 3, 7 + 7 + 2]
    for got, want in zip(results["memory"]["loss"], expected):
        assert math.isclose(got, want, rel_tol=1e-5)
    assert math.isclose(results["memory"]["loss_chunk_starts"], starts, rel_tol=1e-5)
    with model.memory_disabled():
        expected_off, _, starts_off = by_hand(model, windows, 8)
    assert math.isclose(results["no_memory"]["loss_chunk_starts"], starts_off, rel_tol=1e-5)
    assert results["ratio"]["chunk_starts"] == (results["memory"]["loss_chunk_starts"]
                                                / results["no_memory"]["loss_chunk_starts"])
    for got, want in zip(results["no_memory"]["loss"], expected_off):
        assert math.isclose(got, want, rel_tol=1e-5)
    assert results["ratio"]["per_chunk"] == [a / b for a, b in zip(results["memory"]["loss"],
                                                                      results["no_memory"]["loss"])]
    assert results["memory"]["perplexity"][1] == math.exp(results["memory"]["loss"][1])
    written = json.loads((tmp_path / LM_RESULTS_NAME).read_text())
    assert written == json.loads(json.dumps(results))
    assert (tmp_path / LM_PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_lm_table(results)
    assert table.splitlines()[0].split() == ["chunk", "tokens", "memory", "no", "memory", "ratio"]
    assert len(table.splitlines()) == 5
    assert table.splitlines()[-1] == (f"first 3 tokens of every later chunk: memory "
                                      f"{results['memory']['loss_chunk_starts']:.3f}, no memory {starts_off:.3f}")
