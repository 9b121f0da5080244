"""Window arithmetic and per-train-type examples, checked against hand-computed windows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from titans_hf.data.stores import STORE_WRITERS, open_store
from titans_hf.data.windows import TokenExamples, WindowIndex, windows_per_document

PAD = 1


def make_store(path: Path, segments: dict[str, list], dtypes: dict[str, str] | None = None, pad_token_id=PAD):
    dtypes = dtypes or {key: ("float32" if key == "rewards" else "uint16") for key in segments}
    metadata = {"train_type": "seq", "vocab_size": 2000, "eos_token_id": 0, "pad_token_id": pad_token_id}
    writer = STORE_WRITERS["h5" if path.suffix == ".h5" else "bin"](path, dtypes, metadata)
    for key, values in segments.items():
        for segment in values:
            writer.add_segment(key, np.asarray(segment))
    os.replace(writer.finish(), path)
    return open_store(path)


# Stream: document 0 = 10..19 (10 tokens), document 1 = 30..34 (5 tokens); 15 tokens in all.
DOC0, DOC1 = list(range(10, 20)), list(range(30, 35))
STREAM = DOC0 + DOC1


@pytest.fixture(params=["s.h5", "s_bin"])
def seq_store(request, tmp_path):
    return make_store(tmp_path / request.param, {"sequence": [DOC0, DOC1]})


def spans(index: WindowIndex) -> list[tuple[int, int]]:
    return [index[i] for i in range(len(index))]


def test_stride_smaller_equal_and_larger_than_the_window():
    offsets = np.array([0, 15])
    # W=4, S=2: starts 0, 2, 4, ..., 10 (10 + 4 = 14 <= 15); token 14 is the dropped tail.
    assert spans(WindowIndex(offsets, 4, 2)) == [(0, 4), (2, 6), (4, 8), (6, 10), (8, 12), (10, 14)]
    # W=S=4: 0, 4, 8; tokens 12..14 are the dropped tail.
    assert spans(WindowIndex(offsets, 4)) == [(0, 4), (4, 8), (8, 12)]
    # W=3, S=5: 0, 5, 10; tokens 3-4 and 8-9 fall in the stride's gaps, 13-14 after the last window.
    assert spans(WindowIndex(offsets, 3, 5)) == [(0, 3), (5, 8), (10, 13)]


def test_padded_tail():
    offsets = np.array([0, 15])
    assert spans(WindowIndex(offsets, 4, 2, pad_tail=True))[-2:] == [(10, 14), (12, 15)]
    assert spans(WindowIndex(offsets, 4, pad_tail=True)) == [(0, 4), (4, 8), (8, 12), (12, 15)]
    # W=3, S=5 covers 10..12; the next start (15) is past the end: nothing to pad.
    assert spans(WindowIndex(offsets, 3, 5, pad_tail=True)) == [(0, 3), (5, 8), (10, 13)]
    # W=3, S=6: 0, 6 (ends 9); next start 12 < 15 so a padded window [12, 15) is added.
    assert spans(WindowIndex(offsets, 3, 6, pad_tail=True)) == [(0, 3), (6, 9), (12, 15)]
    # Exactly filled: no padded window.
    assert spans(WindowIndex(np.array([0, 12]), 4, pad_tail=True)) == [(0, 4), (4, 8), (8, 12)]


def test_document_boundaries():
    offsets = np.array([0, 10, 10, 15])  # documents of 10, 0 and 5 tokens
    # Inside documents, W=4, S=3: doc 0 -> 0, 3, 6; the empty doc -> none; doc 1 -> 10.
    assert spans(WindowIndex(offsets, 4, 3, respect_document_boundaries=True)) == [(0, 4), (3, 7), (6, 10), (10, 14)]
    # Padded: doc 1 also gets [13, 15); doc 0 is exactly covered by its last window.
    assert spans(WindowIndex(offsets, 4, 3, pad_tail=True, respect_document_boundaries=True)) == [
        (0, 4), (3, 7), (6, 10), (10, 14), (13, 15)
    ]
    # Across documents the same settings run over the whole stream of 15.
    assert spans(WindowIndex(offsets, 4, 3)) == [(0, 4), (3, 7), (6, 10), (9, 13)]
    assert windows_per_document(np.array([10, 0, 5, 3]), 4, 3, pad_tail=True).tolist() == [3, 0, 2, 1]


@pytest.mark.parametrize(("window_size", "stride"), [(0, None), (-2, None), (4, 0), (4, -1), (2.5, None), (True, None)])
def test_window_and_stride_must_be_positive_integers(window_size, stride):
    with pytest.raises(ValueError, match="must be a positive integer"):
        WindowIndex(np.array([0, 15]), window_size, stride)


def test_index_past_the_end_raises():
    index = WindowIndex(np.array([0, 15]), 4)
    assert index[-1] == (8, 12)
    with pytest.raises(IndexError, match="window index 3 out of range for 3 windows"):
        index[3]
    with pytest.raises(IndexError):
        index[-4]


def test_seq_windows_from_the_store(seq_store):
    examples = TokenExamples(seq_store, "seq", window_size=4, stride=3, pad_tail=True)
    # Stream of 15: full windows at 0, 3, 6, 9; padded window at 12 holds 32, 33, 34 + one pad.
    assert len(examples) == 5
    assert examples[0]["input_ids"].tolist() == [10, 11, 12, 13]
    assert examples[3]["input_ids"].tolist() == [19, 30, 31, 32]  # crosses into document 1
    assert examples[3]["labels"].tolist() == [19, 30, 31, 32]
    last = examples[4]
    assert last["input_ids"].tolist() == [32, 33, 34, PAD]
    assert last["attention_mask"].tolist() == [1, 1, 1, 0]
    assert last["labels"].tolist() == [32, 33, 34, -100]
    assert examples[-1]["input_ids"].tolist() == [32, 33, 34, PAD]
    with pytest.raises(IndexError, match="example index 5 out of range for 5 examples"):
        examples[5]
    batch = examples.batch(1, 4)
    assert batch["input_ids"].tolist() == [STREAM[3:7], STREAM[6:10], STREAM[9:13]]
    assert batch["input_ids"].dtype == np.int32 and batch["attention_mask"].dtype == np.int8


def test_seq_windows_inside_documents_and_default_stride(seq_store):
    examples = TokenExamples(seq_store, "seq", window_size=4, respect_document_boundaries=True, pad_tail=True)
    rows = [examples[i]["input_ids"].tolist() for i in range(len(examples))]
    assert rows == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, PAD, PAD], [30, 31, 32, 33], [34, PAD, PAD, PAD]]
    dropped = TokenExamples(seq_store, "seq", window_size=4, respect_document_boundaries=True)
    assert [dropped[i]["input_ids"].tolist() for i in range(len(dropped))] == [
        [10, 11, 12, 13], [14, 15, 16, 17], [30, 31, 32, 33]
    ]


def test_sparse_stride_reads_rows_one_by_one_with_the_same_result(tmp_path):
    store = make_store(tmp_path / "long_bin", {"sequence": [list(range(100, 400))]})
    examples = TokenExamples(store, "seq", window_size=2, stride=50)
    assert examples.batch(0, 6)["input_ids"].tolist() == [[100 + 50 * i, 101 + 50 * i] for i in range(6)]


def test_window_larger_than_every_document(seq_store):
    with pytest.raises(ValueError, match=r"window_size 11 is larger than the longest document \(10 tokens\)"):
        TokenExamples(seq_store, "seq", window_size=11, respect_document_boundaries=True)
    with pytest.raises(ValueError, match=r"window_size 16 is larger than the whole token stream \(15 tokens\)"):
        TokenExamples(seq_store, "seq", window_size=16)
    assert len(TokenExamples(seq_store, "seq", window_size=11, respect_document_boundaries=True, pad_tail=True)) == 2


def test_pad_id_falls_back_to_eos_and_is_required_for_padding(tmp_path):
    no_pad = make_store(tmp_path / "nopad_bin", {"sequence": [[5, 6, 7]]}, pad_token_id=None)
    assert TokenExamples(no_pad, "seq", window_size=2, pad_tail=True)[1]["input_ids"].tolist() == [7, 0]  # eos = 0
    assert TokenExamples(no_pad, "seq", window_size=2, pad_tail=True, pad_token_id=9)[1]["input_ids"].tolist() == [7, 9]
    no_pad.metadata["eos_token_id"] = None
    with pytest.raises(ValueError, match="pad_tail=True needs pad_token_id"):
        TokenExamples(no_pad, "seq", window_size=2, pad_tail=True)


def test_sft_labels_are_minus_100_exactly_where_the_mask_is_zero(tmp_path):
    sequence = [[10, 11, 12, 13, 14], [20, 21, 22]]
    mask = [[0, 0, 1, 1, 1], [0, 1, 1]]
    store = make_store(tmp_path / "sft.h5", {"sequence": sequence, "loss_mask": mask}, {"sequence": "uint16", "loss_mask": "uint8"})
    examples = TokenExamples(store, "sft", window_size=3, stride=2, pad_tail=True)
    # Stream 10 11 12 13 14 20 21 22 with mask 0 0 1 1 1 0 1 1; windows at 0, 2, 4 and padded 6.
    assert [examples[i]["input_ids"].tolist() for i in range(4)] == [[10, 11, 12], [12, 13, 14], [14, 20, 21], [21, 22, PAD]]
    assert [examples[i]["labels"].tolist() for i in range(4)] == [
        [-100, -100, 12], [12, 13, 14], [14, -100, 21], [21, 22, -100]
    ]


def test_dpo_whole_records(tmp_path):
    """TRL 1.16's tokenized columns: the shared prompt (the tokens before the answer) once, then each answer."""
    segments = {
        "chosen": [[5, 6, 7, 0], [8, 9, 0], [4, 4, 1], [3, 1, 2]],
        "chosen_mask": [[0, 1, 1, 1], [0, 1, 1], [0, 1, 0], [0, 0, 1]],
        "rejected": [[5, 16, 0], [8, 19, 19, 19, 0], [4, 2], [3, 2]],
        "rejected_mask": [[0, 1, 1], [0, 1, 1, 1, 1], [0, 1], [0, 1]],
    }
    store = make_store(tmp_path / "dpo_bin", segments, {k: ("uint8" if k.endswith("mask") else "uint16") for k in segments})
    examples = TokenExamples(store, "dpo")
    assert len(examples) == 4
    second = examples[1]
    assert sorted(second) == ["chosen_ids", "prompt_ids", "rejected_ids"]
    assert second["prompt_ids"].tolist() == [8]
    assert second["chosen_ids"].tolist() == [9, 0]
    assert second["rejected_ids"].tolist() == [19, 19, 19, 0]
    with pytest.raises(ValueError, match="record 2: 'chosen_mask' turns off again inside the answer"):
        examples[2]
    with pytest.raises(ValueError, match="record 3: the tokens before the answer differ"):
        examples[3]
    with pytest.raises(ValueError, match="yields whole records: window_size"):
        TokenExamples(store, "dpo", window_size=4)


def test_grpo_whole_groups_with_float_rewards(tmp_path):
    segments = {
        "prompts": [[1, 2], [3]],
        "responses": [[4, 0], [5, 5, 0], [6, 0]],  # record 0 has two responses, record 1 one
        "masks": [[1, 1], [1, 1, 1], [1, 0]],
        "rewards": [[0.25, -1.5], [3.0]],
    }
    store = make_store(tmp_path / "grpo.h5", segments, {"prompts": "uint16", "responses": "uint16", "masks": "uint8", "rewards": "float32"})
    examples = TokenExamples(store, "grpo")
    first, second = examples[0], examples[1]
    assert first["prompt_ids"].tolist() == [1, 2]
    assert [completion.tolist() for completion in first["completion_ids"]] == [[4, 0], [5, 5, 0]]
    assert first["rewards"].dtype == np.float32 and first["rewards"].tolist() == [0.25, -1.5]
    assert [mask.tolist() for mask in second["completion_mask"]] == [[1, 0]]
    assert second["rewards"].tolist() == [3.0]


def test_missing_key_for_the_train_type(seq_store):
    with pytest.raises(ValueError, match=r"train_type 'sft' needs key\(s\) \['loss_mask'\], the store holds \['sequence'\]"):
        TokenExamples(seq_store, "sft", window_size=4)
    with pytest.raises(ValueError, match="train_type must be one of"):
        TokenExamples(seq_store, "pretrain", window_size=4)
    with pytest.raises(ValueError, match="train_type 'seq' needs window_size"):
        TokenExamples(seq_store, "seq")


def test_keys_of_one_record_with_different_lengths(tmp_path):
    store = make_store(
        tmp_path / "misaligned_bin",
        {"sequence": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1, 1]]},
        {"sequence": "uint16", "loss_mask": "uint8"},
    )
    with pytest.raises(ValueError, match=r"misaligned_bin: record 1 has 2 'sequence' values but 3 'loss_mask' values"):
        TokenExamples(store, "sft", window_size=2)
    grpo = make_store(
        tmp_path / "grpo_bin",
        {"prompts": [[1]], "responses": [[2], [3]], "masks": [[1], [1]], "rewards": [[1.0]]},
    )
    with pytest.raises(ValueError, match=r"grpo_bin: 1 rewards but 2 responses"):
        TokenExamples(grpo, "grpo")
    dpo = make_store(
        tmp_path / "dpo_bin",
        {"chosen": [[1], [2]], "chosen_mask": [[1], [1]], "rejected": [[3]], "rejected_mask": [[1]]},
    )
    with pytest.raises(ValueError, match=r"dpo_bin: 2 'chosen' records but 1 'rejected' records"):
        TokenExamples(dpo, "dpo")
