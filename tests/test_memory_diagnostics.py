"""The memory diagnostic against known answers: gates fixed by hand, and a fact that fades exactly as forgetting says."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.tasks.babilong.diagnostics import diagnose_memory, plot_diagnostics

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_fact_fades_by_the_forget_gate_and_the_gates_read_as_set(tiny_qwen3_dir, tmp_path):
    from conftest import PROSE

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=32, memory_chunk_size=8, memory_head_dim=16,
                                            attend_previous_chunk=False, max_lr=1e-6).double()  # no rounding noise
    memory = model.memory["1"].neural_memory
    theta, momentum, forget = 1e-6 * 0.5, 1 / (1 + math.exp(30)), 0.01
    with torch.no_grad():
        memory.to_gates.weight.zero_()  # constant gates: write strength, momentum and forgetting as set here
        memory.to_gates.bias.view(3, -1)[0].fill_(0.0)
        memory.to_gates.bias.view(3, -1)[1].fill_(-30.0)
        memory.to_gates.bias.view(3, -1)[2].fill_(math.log(forget / (1 - forget)))
    filler = " ".join(PROSE * 3)
    rows = [{"input": f"Mary went to the kitchen. {filler} {filler}", "question": "Where is Mary? ", "target": "kitchen"},
            {"input": f"{filler} John moved to the garden. {filler}", "question": "Where is John? ", "target": "garden"},
            {"input": filler, "question": "Where is the apple? ", "target": "garden"}]  # no fact: skipped
    diagnostics = diagnose_memory(model, tokenizer, rows, show_progress=False)
    assert diagnostics["num_rows"] == 2 and diagnostics["skipped_rows"] == 1 and diagnostics["chunk_size"] == 32
    summary = diagnostics["layers"]["1"]
    for kind in ("fact", "haystack"):
        assert summary["theta"][kind] == pytest.approx(theta, rel=1e-6)
        assert summary["forget"][kind] == pytest.approx(forget, rel=1e-6)
        assert summary["momentum"][kind] == pytest.approx(momentum, rel=1e-3)
    # steps of 5e-7 barely depend on the weights: once written (the chunk after the fact's, chunk-local attention),
    # what the fact wrote decays by (1 - alpha) per memory update of 8 tokens (4 per full chunk)
    for row, measured in zip(rows, summary["per_row"]):
        tokens = len(tokenizer(f"{row['input']}\n\nQuestion: {row['question']}\nAnswer:")["input_ids"])
        updates = lambda chunk: min((chunk + 1) * 32, tokens) // 8  # noqa: E731
        written = measured["fact_chunk"] + 1
        assert min(int(d) for d in measured["fact_signal"]) == 1
        for distance, value in measured["fact_signal"].items():
            expected = (1 - forget) ** (updates(measured["fact_chunk"] + int(distance)) - updates(written))
            assert value == pytest.approx(expected, rel=1e-4), distance
    assert max(int(d) for d in summary["fact_signal"]) > 10
    (first, second) = summary["per_row"]
    assert first["fact_chunk"] == 0 and second["fact_chunk"] > 0
    assert first["distance_chunks"] > second["distance_chunks"] > 0
    assert [d for d, _ in summary["question_read_signal"]] == sorted([first["distance_chunks"],
                                                                    second["distance_chunks"]])
    assert all(value > 0 for _, value in summary["question_read_signal"])
    chunks = math.ceil(len(tokenizer(rows[0]["input"] + "\n\nQuestion: Where is Mary? \nAnswer:")["input_ids"]) / 32)
    assert len(first["weight_norm"]) == len(first["weight_change"]) == chunks
    json.dumps(diagnostics)  # JSON-ready
    assert plot_diagnostics(diagnostics, tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
