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


def test_sft_refuses_a_chat_template_that_does_not_render_in_a_second(tmp_path, tiny_tokenizer_dir):
    import shutil
    import time

    from transformers import AutoTokenizer

    looping = tmp_path / "looping_tokenizer"
    shutil.copytree(tiny_tokenizer_dir, looping)
    tokenizer = AutoTokenizer.from_pretrained(looping)
    tokenizer.chat_template = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    tokenizer.save_pretrained(looping)
    rows = tmp_path / "chat.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yes."}]}\n')
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"tokenizer '{looping}': its chat template \(tokenizer\.chat_template\): it "
                                         r"does not render a one-message chat within 1 s"):
        prepare(rows, tmp_path / "store", looping, train_type="sft")
    assert time.monotonic() - started < 30  # the render is killed, not waited for
    assert not (tmp_path / "store").exists()
