"""TitansDataCollator: fixed-length stacking, chunk padding, and chunk counts agreed across ranks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titans_hf.data.collator import TitansDataCollator


def test_fixed_length_rows_are_stacked_unchanged():
    features = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 0], "labels": [-100, 6, -100]},
        {"input_ids": torch.tensor([8, 9, 10]), "attention_mask": torch.tensor([1, 1, 1]), "labels": [-100, -100, 10]},
    ]
    batch = TitansDataCollator(pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, -100], [-100, -100, 10]]
    assert all(tensor.dtype == torch.long for tensor in batch.values())


def test_rows_of_different_lengths_need_chunk_size():
    features = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1], "labels": [1]}]
    with pytest.raises(ValueError, match=r"one length, got lengths \[1, 2\]"):
        TitansDataCollator(pad_token_id=0)(features)


def test_pads_to_a_multiple_of_chunk_size():
    features = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, -100, 4, 5]},
        {"input_ids": [6, 7, 8], "attention_mask": [1, 1, 1], "labels": [-100, 7, 8]},
    ]
    batch = TitansDataCollator(pad_token_id=99, chunk_size=4)(features)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 99, 99, 99], [6, 7, 8, 99, 99, 99, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [
        [-100, -100, -100, 4, 5, -100, -100, -100],
        [-100, 7, 8, -100, -100, -100, -100, -100],
    ]


def test_exact_multiple_gets_no_extra_chunk():
    batch = TitansDataCollator(pad_token_id=0, chunk_size=4)([{"input_ids": [1] * 8, "labels": [1] * 8}])
    assert batch["input_ids"].shape == (1, 8)


def test_bad_rows_are_errors():
    collator = TitansDataCollator(pad_token_id=0, chunk_size=4)
    with pytest.raises(ValueError, match=r"row 1 of the batch lacks \['labels'\]"):
        collator([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])
    with pytest.raises(ValueError, match="row 0 has 2 input_ids but 1 labels"):
        collator([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="chunk_size=0"):
        TitansDataCollator(pad_token_id=0, chunk_size=0)


def collate_on_rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    length = [5, 13][rank]  # rank 0 alone would need 2 chunks of 4, rank 1 needs 4
    batch = TitansDataCollator(pad_token_id=0, chunk_size=4)([{"input_ids": [7] * length, "labels": [7] * length}])
    with open(f"{out}.{rank}", "w") as file:
        json.dump({"shape": list(batch["input_ids"].shape), "mask": batch["attention_mask"][0].tolist()}, file)
    dist.destroy_process_group()


def test_chunk_count_is_agreed_across_two_gloo_processes(tmp_path):
    # fork: the children inherit this process's imports, so the test takes a second, not a minute.
    mp.start_processes(
        collate_on_rank, args=(str(tmp_path / "store"), str(tmp_path / "result")), nprocs=2, start_method="fork"
    )
    results = [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in range(2)]
    assert results[0]["shape"] == results[1]["shape"] == [1, 16]
    assert results[0]["mask"] == [1] * 5 + [0] * 11
    assert results[1]["mask"] == [1] * 13 + [0] * 3
