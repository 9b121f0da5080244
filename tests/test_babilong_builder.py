"""The ``titans_babilong`` datasets builder: public JSON or generated rows, as training examples."""

from __future__ import annotations

import json

import pytest
from datasets import load_dataset
from transformers import AutoTokenizer

import titans_hf  # noqa: F401  (registers titans_babilong)
from titans_hf.data.collator import TitansDataCollator
from titans_hf.tasks.babilong import build_example, generate_babilong, train_eval_split
from titans_hf.tasks.babilong import builder as babilong_builder
from titans_hf.tasks.babilong.builder import TitansBabilong, build_babilong

ROWS = [
    {"input": "The ferryman waited. Mary went to the garden.", "question": "Where is Mary? ", "target": "garden",
     "extra_public_field": 1},
    {"input": "John moved to the office. The tide turned.", "question": "Where is John? ", "target": "office"},
    {"input": "Sandra got the milk there. Sandra went to the hallway.", "question": "Where is the milk? ",
     "target": "hallway"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def prepare(tmp_path, **config):
    return build_babilong(cache_dir=str(tmp_path / "cache"), **config)


def test_generated_rows_are_the_generator_rows_assembled_and_split(tmp_path, tiny_tokenizer_dir, tokenizer):
    dataset = prepare(tmp_path, task="qa1", length=150, num_samples=20, seed=3, tokenizer=str(tiny_tokenizer_dir),
                      max_length=224, answer_reserve_tokens=8)
    rows = generate_babilong("qa1", 20, 150, tokenizer, seed=3)
    train, evaluation = train_eval_split(20, 0.9, seed=3)
    for split, indices in (("train", train), ("validation", evaluation)):
        assert dataset[split].num_rows == len(indices)
        for got, index in zip(dataset[split], indices):
            expected = build_example(rows[index], tokenizer, 224, 8)
            assert expected.pop("answer_tokens_cut") == 0
            assert {key: got[key] for key in expected} == expected
            assert (got["question"], got["task"], got["length"]) == (rows[index]["question"], "qa1", 150)
            assert len(got["input_ids"]) == 224


def test_load_dataset_reads_babilong_json(tmp_path, tiny_tokenizer_dir, tokenizer):
    path = tmp_path / "qa1" / "0k.json"
    path.parent.mkdir()
    path.write_text(json.dumps(ROWS * 4))
    dataset = load_dataset("titans_babilong", data_files=str(path), tokenizer=str(tiny_tokenizer_dir), max_length=40,
                           answer_reserve_tokens=4, seed=1, cache_dir=str(tmp_path / "cache"))
    train, evaluation = train_eval_split(12, 0.9, seed=1)
    assert dataset["train"]["target"] == [(ROWS * 4)[i]["target"] for i in train]
    assert dataset["validation"]["target"] == [(ROWS * 4)[i]["target"] for i in evaluation]
    assert set(dataset["train"]["task"]) == {"qa1"} and set(dataset["train"]["length"]) == {0}
    assert all(len(ids) == 40 for ids in dataset["train"]["input_ids"])


def test_public_json_gives_one_split_in_file_order(tmp_path, tiny_tokenizer_dir, tokenizer):
    path = tmp_path / "qa2" / "1k.json"
    path.parent.mkdir()
    path.write_text(json.dumps(ROWS))
    before = path.read_text()
    dataset = prepare(tmp_path, data_files=str(path), tokenizer=str(tiny_tokenizer_dir), max_length=48,
                      answer_reserve_tokens=4, train_ratio=None)
    assert list(dataset) == ["train"] and dataset["train"].num_rows == 3
    pad = tokenizer.pad_token_id
    for got, row in zip(dataset["train"], ROWS):
        prompt = tokenizer(f"{row['input']}\n\nQuestion: {row['question']}\nAnswer:")["input_ids"]
        answer = tokenizer(" " + row["target"], add_special_tokens=False)["input_ids"]
        padding = 48 - len(prompt) - len(answer)
        assert got["input_ids"] == prompt + answer + [pad] * padding
        assert got["labels"] == [-100] * len(prompt) + answer + [-100] * padding
        assert got["attention_mask"] == [1] * (len(prompt) + len(answer)) + [0] * padding
        assert got["prompt_length"] == len(prompt) and got["target"] == row["target"]
        assert (got["task"], got["length"]) == ("qa2", 1024)  # from the public layout qaN/<L>k.json
    assert path.read_text() == before


def test_named_splits_are_kept(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "a.json").write_text(json.dumps(ROWS[:2]))
    (tmp_path / "b.json").write_text(json.dumps(ROWS[2:]))
    dataset = prepare(tmp_path, data_files={"train": str(tmp_path / "a.json"), "test": str(tmp_path / "b.json")},
                      tokenizer=str(tiny_tokenizer_dir), max_length=48, answer_reserve_tokens=4, task="qa1")
    assert {split: dataset[split]["target"] for split in dataset} == {"train": ["garden", "office"], "test": ["hallway"]}
    assert set(dataset["test"]["task"]) == {"qa1"} and set(dataset["test"]["length"]) == {-1}


def test_malformed_row_names_file_and_row(tmp_path, tiny_tokenizer_dir):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(ROWS[:2] + [{"input": "x", "question": "Where is Mary? ", "target": ""}]))
    with pytest.raises(ValueError, match=r"bad\.json, row 2 \(0-based\): empty target"):
        prepare(tmp_path, data_files=str(path), tokenizer=str(tiny_tokenizer_dir), max_length=48, answer_reserve_tokens=4)


def test_unpadded_rows_are_padded_to_chunks_by_the_collator(tmp_path, tiny_tokenizer_dir, tokenizer):
    dataset = prepare(tmp_path, task="qa2", length=200, num_samples=10, tokenizer=str(tiny_tokenizer_dir),
                      max_length=256, answer_reserve_tokens=8, pad_to_max_length=False, train_ratio=None)["train"]
    lengths = [len(ids) for ids in dataset["input_ids"]]
    assert lengths == [p + len(tokenizer(" " + t, add_special_tokens=False)["input_ids"])
                       for p, t in zip(dataset["prompt_length"], dataset["target"])]
    assert all(mask == [1] * n for mask, n in zip(dataset["attention_mask"], lengths))
    batch = TitansDataCollator(tokenizer.pad_token_id, chunk_size=32)(list(dataset.with_format("torch")))
    assert batch["input_ids"].shape == (10, 32 * -(-max(lengths) // 32))


def test_num_proc_splits_the_work_without_changing_rows(tmp_path, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.setattr(babilong_builder, "ROWS_PER_CHUNK", 4)  # 18 training rows -> 5 chunks
    config = dict(task="qa3", length=250, num_samples=20, seed=1, tokenizer=str(tiny_tokenizer_dir), max_length=290,
                  answer_reserve_tokens=8)
    serial = prepare(tmp_path / "serial", **config)
    parallel = build_babilong(cache_dir=str(tmp_path / "parallel"), num_proc=2, **config)
    for split in ("train", "validation"):
        assert parallel[split].to_dict() == serial[split].to_dict()


def test_bad_configurations_are_errors(tmp_path, tiny_tokenizer_dir):
    with pytest.raises(ValueError, match="needs tokenizer="):
        TitansBabilong(cache_dir=str(tmp_path), task="qa1", length=100, num_samples=4)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    with pytest.raises(ValueError, match="got data files .* and num_samples=4: pass data_files"):
        prepare(tmp_path, data_files=str(tmp_path / "rows.json"), task="qa1", length=100, num_samples=4,
                tokenizer=str(tiny_tokenizer_dir), max_length=200)
    with pytest.raises(ValueError, match=r"needs \['num_samples'\]"):
        prepare(tmp_path, task="qa1", length=100, tokenizer=str(tiny_tokenizer_dir), max_length=200)
    with pytest.raises(ValueError, match="answer_reserve_tokens=300"):
        TitansBabilong(cache_dir=str(tmp_path), tokenizer="x", max_length=200, answer_reserve_tokens=300)
    TitansBabilong(cache_dir=str(tmp_path), tokenizer=str(tiny_tokenizer_dir), task="qa7")  # a data-file label
    with pytest.raises(ValueError, match="cannot load tokenizer 'no/such-tokenizer'"):
        TitansBabilong(cache_dir=str(tmp_path), tokenizer="no/such-tokenizer", task="qa1")
    with pytest.raises(ValueError, match="length='long' is not a length"):
        TitansBabilong(cache_dir=str(tmp_path), tokenizer=str(tiny_tokenizer_dir), length="long")
    with pytest.raises(ValueError, match=r"generates \['qa1', 'qa2', 'qa3'\], not task='qa7'"):
        prepare(tmp_path, task="qa7", length=100, num_samples=4, tokenizer=str(tiny_tokenizer_dir), max_length=200)


def test_load_dataset_without_data_files_generates_from_any_working_directory(
    tmp_path, monkeypatch, tiny_tokenizer_dir
):
    config = dict(task="qa1", length=150, num_samples=12, seed=5, tokenizer=str(tiny_tokenizer_dir), max_length=224,
                  answer_reserve_tokens=8)
    expected = prepare(tmp_path / "class_route", **config)
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    monkeypatch.chdir(empty_folder)  # datasets would look for data files here and find none
    loaded = load_dataset("titans_babilong", cache_dir=str(tmp_path / "cache"), **config)
    for split in ("train", "validation"):
        assert loaded[split].to_dict() == expected[split].to_dict()
    other_seed = load_dataset("titans_babilong", cache_dir=str(tmp_path / "cache"), **{**config, "seed": 6})
    assert other_seed["train"]["input_ids"] != loaded["train"]["input_ids"]
    assert list(empty_folder.iterdir()) == []
