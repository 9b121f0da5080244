"""Hostile BABILong input: outputs that must not be clobbered, answers that do not fit, stale caches, text that is not
UTF-8. Every error names the file (and row); input files are checksummed before and after."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import AutoTokenizer

import titans_hf  # noqa: F401  (registers titans_babilong)
from titans_hf.commands import main as cli_main
from titans_hf.modeling.modeling_titans_qwen import TitansQwenForCausalLM
from titans_hf.tasks.babilong import build_example, generate_babilong, read_babilong_file
from titans_hf.tasks.babilong.builder import build_babilong
from titans_hf.tasks.babilong.evaluation import evaluate_babilong
from titans_hf.testing_utils import build_tokenizer

ROWS = [
    {"input": "Mary went to the garden. John moved to the office.", "question": "Where is Mary? ", "target": "garden"},
    {"input": "Sandra went to the kitchen. The tide turned.", "question": "Where is Sandra? ", "target": "kitchen"},
    {"input": "Daniel moved to the hallway. Mary went to the bedroom.", "question": "Where is Daniel? ",
     "target": "hallway"},
]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


# ----------------------------------------------------------------------------------------------
# Outputs are checked before the long work, and never clobbered


def test_generate_refuses_to_overwrite_the_data_file_and_the_card(tmp_path, tiny_tokenizer_dir, tokenizer):
    output = tmp_path / "qa1" / "0k.json"

    def argv(seed: int, path: Path = output) -> list[str]:
        return ["babilong", "generate", "--task", "qa1", "--length", "0", "--num-samples", "3", "--seed", str(seed),
                "--tokenizer", str(tiny_tokenizer_dir), "--output", str(path)]

    assert cli_main(argv(1)) == 0
    first = digest(output)
    with pytest.raises(FileExistsError, match=r"qa1/0k\.json exists; pass --overwrite"):
        cli_main(argv(2))
    assert digest(output) == first

    # the card: an existing README.md (someone's own card) is kept, and so is the data file beside it
    card = output.parent / "README.md"
    card.write_text("# my own card\n")
    with pytest.raises(FileExistsError, match=r"qa1/0k\.json exists"):
        cli_main([*argv(2), "--card"])
    other = tmp_path / "qa1" / "1k.json"
    with pytest.raises(FileExistsError, match=r"qa1/README\.md exists; pass --overwrite"):
        cli_main([*argv(2, other), "--card"])
    assert not other.exists() and card.read_text() == "# my own card\n" and digest(output) == first

    # even with --overwrite: the README.md is not one titans_hf wrote (its outputs manifest does not list it)
    with pytest.raises(FileExistsError, match=r"README\.md: will not replace it, even with --overwrite"):
        cli_main([*argv(2), "--card", "--overwrite"])
    assert card.read_text() == "# my own card\n" and digest(output) == first
    card.unlink()
    assert cli_main([*argv(2), "--card", "--overwrite"]) == 0
    assert json.loads(output.read_text()) == generate_babilong("qa1", 3, 0, tokenizer, seed=2)
    assert "--seed 2" in card.read_text()


def test_generate_refuses_an_output_that_is_a_folder_or_under_a_file(tmp_path, tiny_tokenizer_dir):
    common = ["babilong", "generate", "--task", "qa1", "--length", "0", "--num-samples", "1",
              "--tokenizer", str(tiny_tokenizer_dir), "--output"]
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(IsADirectoryError, match=r"folder\.json is a folder"):
        cli_main([*common, str(tmp_path / "folder.json"), "--overwrite"])
    (tmp_path / "plain").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"plain is a file, not a folder"):
        cli_main([*common, str(tmp_path / "plain" / "qa1" / "0k.json")])


def test_eval_output_that_is_a_file_fails_before_any_work(tiny_qwen3_dir, tmp_path, monkeypatch):
    data_file = tmp_path / "qa1" / "0k.json"
    data_file.parent.mkdir()
    data_file.write_text(json.dumps(ROWS))
    output = tmp_path / "results_here"
    output.write_text("not a folder")
    before = digest(output), digest(data_file)

    import titans_hf.commands.evaluate as evaluate_command

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(evaluate_command, "load_model_for_eval", no_model)
    with pytest.raises(NotADirectoryError, match=r"output .*results_here is an existing file"):
        cli_main(["eval", "--model", str(tiny_qwen3_dir), "--data", str(data_file), "--output", str(output)])
    with pytest.raises(NotADirectoryError, match=r"results_here is an existing file"):
        cli_main(["eval", "--model", str(tiny_qwen3_dir), "--generate", "--lengths", "0", "--output", str(output)])

    # the library function: no answer is generated before the check
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=64, memory_head_dim=16, memory_chunk_size=8)
    model.generate = no_model
    with pytest.raises(NotADirectoryError, match="results_here"):
        evaluate_babilong(model, tokenizer, {("qa1", "0k"): ROWS}, output_dir=output, show_progress=False)
    assert (digest(output), digest(data_file)) == before


def test_a_new_evaluation_never_leaves_an_old_results_json_beside_new_files(tiny_qwen3_dir, tmp_path, monkeypatch):
    import titans_hf.tasks.babilong.evaluation as evaluation

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=64, memory_head_dim=16, memory_chunk_size=8)
    evaluate_babilong(model, tokenizer, {("qa1", "0k"): ROWS}, max_new_tokens=1, output_dir=tmp_path,
                      show_progress=False)
    assert (tmp_path / "results.json").exists()

    def failing_plot(*args, **kwargs):
        raise RuntimeError("the disk filled up")

    monkeypatch.setattr(evaluation, "plot_heatmap", failing_plot)
    with pytest.raises(RuntimeError, match="disk filled up"):
        evaluate_babilong(model, tokenizer, {("qa1", "0k"): ROWS[:2]}, max_new_tokens=1, output_dir=tmp_path,
                          show_progress=False)
    # the old results do not vouch for new files, and no half of the new outputs stays behind
    assert not any((tmp_path / name).exists() for name in ("results.json", "predictions.jsonl", "heatmap.png"))


# ----------------------------------------------------------------------------------------------
# Answers longer than the room kept for them


def test_an_answer_that_does_not_fit_is_an_error_with_its_token_count(tokenizer):
    row = {"input": "The old sailor repaired a torn sail. " * 10, "question": "Where is Mary? ",
           "target": "kitchen garden office hallway bedroom bathroom"}
    answer_tokens = len(tokenizer(" " + row["target"], add_special_tokens=False)["input_ids"])
    assert answer_tokens == 6
    with pytest.raises(ValueError, match=r"answer 'kitchen garden office hallway bedroom bathroom' is 6 tokens but "
                                         r"only 2 fit after the prompt \(max_length=40, answer_reserve_tokens=2\)"):
        build_example(row, tokenizer, max_length=40, answer_reserve_tokens=2)
    cut = build_example(row, tokenizer, max_length=40, answer_reserve_tokens=2, truncate_answers=True)
    assert cut["answer_tokens_cut"] == 4 and len(cut["input_ids"]) == 40
    assert tokenizer.decode([t for t in cut["labels"] if t != -100]) == " kitchen garden"
    fits = build_example(row, tokenizer, max_length=40, answer_reserve_tokens=6)
    assert fits["answer_tokens_cut"] == 0
    assert tokenizer.decode([t for t in fits["labels"] if t != -100]) == " " + row["target"]


def test_the_builder_names_the_row_whose_answer_does_not_fit_or_counts_the_cuts(tmp_path, tiny_tokenizer_dir,
                                                                                 caplog):
    long_answer = {**ROWS[1], "target": "kitchen garden office hallway bedroom bathroom"}
    path = tmp_path / "qa1" / "0k.json"
    path.parent.mkdir()
    path.write_text(json.dumps([ROWS[0], long_answer, ROWS[2]]))
    before = digest(path)
    common = dict(data_files=str(path), tokenizer=str(tiny_tokenizer_dir), max_length=24, answer_reserve_tokens=2,
                  train_ratio=None)
    # datasets wraps what a builder raises while generating: the cause is ours
    with pytest.raises(DatasetGenerationError) as error:
        build_babilong(cache_dir=str(tmp_path / "cache"), **common)
    assert isinstance(error.value.__cause__, ValueError)
    assert re.search(r"qa1/0k\.json, row 1 \(0-based\): answer 'kitchen garden office hallway bedroom bathroom' is 6 "
                     r"tokens but only \d fit", str(error.value.__cause__))
    with caplog.at_level(logging.WARNING, logger="titans_hf.tasks.babilong.builder"):
        dataset = build_babilong(cache_dir=str(tmp_path / "cache"), truncate_answers=True, **common)["train"]
    assert dataset.num_rows == 3
    assert any("cut the answers of 1 of 3 rows" in record.getMessage() for record in caplog.records)
    assert digest(path) == before
    # a generated row is named too
    with pytest.raises(DatasetGenerationError) as error:
        build_babilong(cache_dir=str(tmp_path / "cache"), task="qa1", length=0, num_samples=4,
                       tokenizer=str(tiny_tokenizer_dir), max_length=12, answer_reserve_tokens=2)
    assert re.match(r"generated qa1 \(length 0, seed 0\) row \d+: question .* needs", str(error.value.__cause__))


# ----------------------------------------------------------------------------------------------
# The Arrow cache follows what rows depend on


def _train_ids(tmp_path, **config):
    return list(load_dataset("titans_babilong", cache_dir=str(tmp_path / "cache"), train_ratio=None, max_length=96,
                             answer_reserve_tokens=16, **config)["train"]["input_ids"])


def test_the_cache_rebuilds_when_the_tokenizer_changes_under_the_same_path(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    build_tokenizer([row["input"] + " " + row["question"] for row in ROWS] * 20, tokenizer_dir, vocab_size=300)
    data = tmp_path / "qa1" / "0k.json"
    data.parent.mkdir()
    data.write_text(json.dumps(ROWS))
    first = _train_ids(tmp_path, data_files=str(data), tokenizer=str(tokenizer_dir))
    assert _train_ids(tmp_path, data_files=str(data), tokenizer=str(tokenizer_dir)) == first
    build_tokenizer(["completely different text about ships and harbours"] * 20, tokenizer_dir, vocab_size=280)
    fresh = AutoTokenizer.from_pretrained(tokenizer_dir)
    again = _train_ids(tmp_path, data_files=str(data), tokenizer=str(tokenizer_dir))
    assert again != first
    assert again[0][: len(fresh(ROWS[0]["input"])["input_ids"])] == fresh(ROWS[0]["input"])["input_ids"]


def test_the_cache_rebuilds_when_a_data_file_changes_with_its_mtime_kept(tmp_path, tiny_tokenizer_dir):
    data = tmp_path / "qa1" / "0k.json"
    data.parent.mkdir()
    data.write_text(json.dumps(ROWS))
    stat = data.stat()
    first = _train_ids(tmp_path, data_files=str(data), tokenizer=str(tiny_tokenizer_dir))
    data.write_text(json.dumps([{**row, "target": "office"} for row in ROWS]))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p / rsync -t / an archive would leave it
    assert data.stat().st_mtime_ns == stat.st_mtime_ns
    targets = load_dataset("titans_babilong", data_files=str(data), tokenizer=str(tiny_tokenizer_dir),
                           cache_dir=str(tmp_path / "cache"), train_ratio=None, max_length=96,
                           answer_reserve_tokens=16)["train"]["target"]
    assert list(targets) == ["office"] * 3
    assert _train_ids(tmp_path, data_files=str(data), tokenizer=str(tiny_tokenizer_dir)) != first


def test_the_cache_rebuilds_when_the_haystack_text_changes_under_the_same_path(tmp_path, tiny_tokenizer_dir):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"The ferryman waited by the river on day {i}." for i in range(60)))
    config = dict(task="qa1", length=150, num_samples=4, seed=0, tokenizer=str(tiny_tokenizer_dir),
                  haystack_files=[str(book)], max_length=224, answer_reserve_tokens=8, train_ratio=None)
    first = build_babilong(cache_dir=str(tmp_path / "cache"), **config)["train"]["input_ids"]
    assert build_babilong(cache_dir=str(tmp_path / "cache"), **config)["train"]["input_ids"] == first
    book.write_text(" ".join(f"A quiet wind moved across the fields in week {i}." for i in range(60)))
    again = build_babilong(cache_dir=str(tmp_path / "cache"), **config)["train"]["input_ids"]
    assert again != first
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    expected = generate_babilong("qa1", 4, 150, tokenizer, seed=0, haystack_files=[book])
    assert [build_example(row, tokenizer, 224, 8)["input_ids"] for row in expected] == list(again)


# ----------------------------------------------------------------------------------------------
# Text that is not UTF-8


def test_json_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "qa1" / "0k.jsonl"
    path.parent.mkdir()
    lines = [json.dumps(row).encode() for row in ROWS]
    lines[1] = lines[1].replace(b"kitchen", b"kitch\xe9n")  # Latin-1, as an old export would write it
    path.write_bytes(b"\n".join(lines) + b"\n")
    before = digest(path)
    with pytest.raises(ValueError, match=r"qa1/0k\.jsonl is not UTF-8 text: .*byte 0xe9 at offset \d+, line 2\)"):
        read_babilong_file(path)
    assert digest(path) == before


def test_a_lone_surrogate_escape_names_the_row_and_field(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[{"input": "Mary went to the garden.", "question": "Where is Mary? ", "target": "garden"},'
                    ' {"input": "broken \\ud800 text", "question": "Where is John? ", "target": "office"}]')
    with pytest.raises(ValueError, match=r"rows\.json, row 1 \(0-based\): field 'input' is not UTF-8 text"):
        read_babilong_file(path)


def test_parquet_strings_that_are_not_utf8_name_the_file_row_and_column(tmp_path):
    import numpy as np

    offsets = pa.py_buffer(np.array([0, 5, 10, 15], dtype=np.int32).tobytes())
    bad_strings = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"okay!fine.bad\xff.")])
    path = tmp_path / "0k" / "qa1-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"input": bad_strings, "question": ["q"] * 3, "target": ["x", "y", "z"]}), path)
    binary = tmp_path / "1k" / "qa1-00000-of-00001.parquet"
    binary.parent.mkdir()
    pq.write_table(pa.table({"input": pa.array([b"fine", b"caf\xe9"], pa.binary()), "question": ["q", "q"],
                             "target": ["x", "y"]}), binary)
    before = digest(path), digest(binary)
    with pytest.raises(ValueError, match=r"0k/qa1-00000-of-00001\.parquet, row 2 \(0-based\), column 'input': not "
                                         r"UTF-8 text: .*byte 0xff at offset 3"):
        read_babilong_file(path)
    with pytest.raises(ValueError, match=r"1k/qa1-00000-of-00001\.parquet, row 1 \(0-based\), column 'input': not "
                                         r"UTF-8"):
        read_babilong_file(binary)
    assert (digest(path), digest(binary)) == before


def test_a_haystack_file_that_is_not_utf8_is_named(tmp_path, tokenizer, tiny_tokenizer_dir):
    book = tmp_path / "book.txt"
    book.write_bytes(b"The ferryman waited.\nThe caf\xe9 was closed. " * 30)
    before = digest(book)
    with pytest.raises(ValueError, match=r"haystack file .*book\.txt is not UTF-8 text: .*byte 0xe9 at offset 28, "
                                         r"line 2\)"):
        generate_babilong("qa1", 2, 150, tokenizer, haystack_files=[book])
    with pytest.raises(ValueError, match=r"book\.txt is not UTF-8 text"):  # before any worker starts
        build_babilong(cache_dir=str(tmp_path / "cache"), task="qa1", length=150, num_samples=2,
                       tokenizer=str(tiny_tokenizer_dir), haystack_files=[str(book)], max_length=224)
    assert digest(book) == before
