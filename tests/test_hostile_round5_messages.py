"""Messages of the fifth round: each names the file or argument and what is wrong, without a traceback."""

from __future__ import annotations

import os

import pytest

from titans_hf.data.prepare import prepare


def test_a_fifo_input_is_named_as_what_it_is(tmp_path, tiny_tokenizer_dir):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"{fifo}: not a regular file \(a FIFO, socket or device\)"):
        prepare(fifo, tmp_path / "store", tiny_tokenizer_dir, train_type="sft")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rows.jsonl"]


def test_deeply_nested_json_is_refused_with_a_message(tmp_path, tiny_tokenizer_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=rf"{rows}:2: JSON nested too deeply to read"):
        prepare(rows, tmp_path / "store", tiny_tokenizer_dir)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rows.jsonl"]
