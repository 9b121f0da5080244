"""The prepared device run of scripts/bench_model.py (`--gpu`), on a CPU at a tiny shape: a device is lent for minutes
and one call, so its code path must already have run here. The analytic FLOP count is checked by hand."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_model  # noqa: E402

SHAPE = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=10)


def test_model_flops_by_hand():
    # head_dim 4; per layer 8*4*(2*2 + 2*1) + 3*8*16 = 576; weights 2*576 + 8*10 = 1232: 6 N = 7392 a token
    # full attention over 12 tokens: 6 keys a query on average, 3 * 4 * 8 * 2 layers * 12 * 6 = 13824
    assert bench_model.model_flops(SHAPE, 12, None) == 7392 * 12 + 13824
    # chunks of 4 attending to the previous one: the first chunk 4*4/2 keys in all, the other 8 queries 1.5*4 each,
    # (8 + 48) / 12 a query: 3 * 4 * 8 * 2 * 12 * 56 / 12 = 10752
    assert bench_model.model_flops(SHAPE, 12, 4) == pytest.approx(7392 * 12 + 10752, rel=1e-12)


def test_device_run_reports_every_row_with_its_share_of_peak():
    rows = bench_model.bench_device("tiny", SHAPE, 12, 4, torch.device("cpu"), torch.float32, peak_tflops=2.0,
                                    compile_backend="eager", repeats=1)
    by_model = {row["model"]: row for row in rows}
    assert set(by_model) == {"titans mag (1 memory layer)", "same chunking, no memory", "plain qwen, full attention",
                             "titans mag, frozen base (recipe)", bench_model.COMPILED}
    assert "compile_error" not in by_model[bench_model.COMPILED]
    for label, row in by_model.items():
        chunk = None if label == "plain qwen, full attention" else 4
        expected = bench_model.model_flops(SHAPE, 12, chunk) / row["seconds"] / 1e12
        assert row["model_tflops_per_s"] == pytest.approx(expected, rel=1e-12)
        assert row["percent_of_bf16_peak"] == pytest.approx(100 * expected / 2.0, rel=1e-12)
    summary = bench_model.summarise(rows, "seconds")["tiny"]
    assert summary["compiled_step_time_vs_eager"] == pytest.approx(
        by_model[bench_model.COMPILED]["seconds"] / by_model["titans mag (1 memory layer)"]["seconds"], rel=1e-12)


def test_frozen_trunk_rows_and_their_ratio():
    rows = bench_model.bench_frozen_trunk(None, rows=2, tokens=64, chunk_size=16, repeats=1)
    assert [row["model"] for row in rows] == list(bench_model.TRUNK_MODELS)
    assert all(row["config"] == "tiny, memory on layer 2" and row["tokens"] == 64 for row in rows)
    summary = bench_model.summarise(rows, "cpu_seconds")["frozen_trunk (tiny, memory on layer 2)"]
    assert summary["step_time_from_trunk_vs_every_layer"] == pytest.approx(
        rows[1]["cpu_seconds"] / rows[0]["cpu_seconds"], rel=1e-12)
