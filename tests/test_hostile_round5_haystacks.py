"""Haystack sources that are not what the user meant: a huge file, prose with no ASCII sentence ends, a file with
no sentence end at all, a one-sentence file, an empty path; and a cache key that must be the rows' own bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from titans_hf.commands import main as cli_main
from titans_hf.tasks.babilong import generate as generate_module
from titans_hf.tasks.babilong import build_example, generate_babilong
from titans_hf.tasks.babilong.builder import TitansBabilong
from titans_hf.tasks.babilong.generate import HAYSTACK_SOURCE_BYTES, read_haystack_sentences

PROSE = " ".join(f"The ferryman rowed across the river on morning {i}." for i in range(40))


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_a_huge_file_is_read_in_pieces_up_to_the_cap_and_hashed_as_read(tmp_path, monkeypatch):
    book = tmp_path / "huge.txt"
    with open(book, "wb") as stream:
        stream.write(PROSE.encode() + b" ")
        stream.truncate(2 * 2**30)  # 2 GiB, sparse: zeros after the prose
    reads: list[int] = []

    def counting_open(path, mode="r", *args, **kwargs):
        stream = open(path, mode, *args, **kwargs)
        read = stream.read

        def counted(size=-1):
            assert size != -1, "a haystack file is never read whole"
            data = read(size)
            reads.append(len(data))
            return data

        stream.read = counted
        return stream

    monkeypatch.setattr(generate_module, "open", counting_open, raising=False)
    sentences, digests = read_haystack_sentences(book)
    assert sum(reads) == HAYSTACK_SOURCE_BYTES == 64 * 2**20 and max(reads) == 2**20
    with open(book, "rb") as stream:
        assert digests == [[str(book), hashlib.sha256(stream.read(HAYSTACK_SOURCE_BYTES)).hexdigest()]]
    assert sentences[:40] == [f"The ferryman rowed across the river on morning {i}." for i in range(40)]


def test_pieces_cut_anywhere_give_the_sentences_of_the_whole_text(tmp_path, monkeypatch):
    text = "\n".join(f"第{i}の川は静かに流れた。「本当？」彼は\n驚いた！ Line {i} ends here. Next\none." for i in range(20))
    book = tmp_path / "book.txt"
    book.write_text(text, encoding="utf-8")
    whole, digests = read_haystack_sentences(book)
    for piece in (1, 2, 3, 5, 7):
        monkeypatch.setattr(generate_module, "_READ_PIECE_BYTES", piece)
        assert read_haystack_sentences(book) == (whole, digests)
    assert digests == [[str(book), hashlib.sha256(text.encode()).hexdigest()]]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(PROSE.encode() + b"\nThe caf\xe9 was closed.")
    with pytest.raises(ValueError, match=rf"bad\.txt is not UTF-8 text: .*byte 0xe9 at offset {len(PROSE) + 8}, line 2"):
        read_haystack_sentences(bad)


def test_sentences_end_at_the_languages_own_marks(tmp_path):
    book = tmp_path / "kawa.txt"
    book.write_text("".join(f"第{i}の川は静かに流れた。" for i in range(40)), encoding="utf-8")
    sentences, _ = read_haystack_sentences(book)
    assert sentences == [f"第{i}の川は静かに流れた。" for i in range(40)]


def test_a_file_with_no_sentence_end_is_refused_naming_it(tmp_path, tiny_tokenizer_dir):
    book = tmp_path / "one_line.txt"
    book.write_text("words without any end " * 2000)
    with pytest.raises(ValueError, match=r"haystack file .*one_line\.txt holds no sentence end"):
        read_haystack_sentences(book)
    output = tmp_path / "rows.json"
    with pytest.raises(ValueError, match=r"one_line\.txt holds no sentence end"):
        cli_main(["babilong", "generate", "--task", "qa1", "--length", "1k", "--num-samples", "2", "--tokenizer",
                  str(tiny_tokenizer_dir), "--haystack", str(book), "--output", str(output)])
    assert not output.exists()


def test_a_haystack_of_few_distinct_sentences_is_refused_naming_it(tmp_path, tokenizer):
    book = tmp_path / "one_sentence.txt"
    book.write_text("The ferryman rowed across the river. " * 300)
    with pytest.raises(ValueError, match=r"one_sentence\.txt'\] hold 1 distinct sentence\(s\) .*fewer than 32"):
        generate_babilong("qa1", 2, 1000, tokenizer, haystack_files=[book])
    book.write_text(" ".join(f"The ferryman rowed across the river on morning {i}." for i in range(32)))
    assert len(read_haystack_sentences(book)[0]) == 32


def test_an_empty_haystack_path_is_refused_and_the_working_folder_never_read(tmp_path, monkeypatch, tokenizer,
                                                                            tiny_tokenizer_dir):
    (tmp_path / "private.txt").write_text(PROSE)
    monkeypatch.chdir(tmp_path)
    for given in ("", [""], [str(tmp_path / "private.txt"), ""]):
        with pytest.raises(ValueError, match=r"haystack_files=.*: an empty path names no file or folder"):
            generate_babilong("qa1", 2, 150, tokenizer, haystack_files=given)
    with pytest.raises(ValueError, match=r"an empty path names no file or folder"):
        cli_main(["babilong", "generate", "--task", "qa1", "--length", "150", "--num-samples", "2", "--tokenizer",
                  str(tiny_tokenizer_dir), "--haystack", "", "--output", str(tmp_path / "rows.json")])
    assert not (tmp_path / "rows.json").exists()


def test_rows_are_never_cached_under_the_key_of_other_text(tmp_path, tiny_tokenizer_dir):
    book = tmp_path / "book.txt"
    book.write_text(PROSE)
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer=str(tiny_tokenizer_dir), task="qa1", length=150,
                    num_samples=2, max_length=224, answer_reserve_tokens=8, train_ratio=None,
                    haystack_files=[str(book)])
    builder = TitansBabilong(**settings)  # the cache key is taken here
    book.write_text(PROSE.replace("ferryman", "boatman"))  # written between the key and the rows
    with pytest.raises(ValueError, match=r"book\.txt'\] changed while the dataset was being built"):
        builder.download_and_prepare()
    book.write_text(PROSE)
    fresh = TitansBabilong(**settings)
    assert fresh.cache_dir == builder.cache_dir
    fresh.download_and_prepare()
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    expected = generate_babilong("qa1", 2, 150, tokenizer, haystack_files=[book])
    assert all("ferryman" in row["input"] for row in expected)
    assert fresh.as_dataset()["train"]["input_ids"] == [build_example(row, tokenizer, 224, 8)["input_ids"]
                                                        for row in expected]
