"""BABILong rows on disk: the published parquet sets, JSON / JSON Lines files, and the dataset card of a generated set.

Layouts the task and length labels are read from (the published names are kept: "32k", not 32768):

- the Hub sets (``RMT-team/babilong``, ``RMT-team/babilong-1k-samples``): ``<length>/<task>-0000i-of-0000n.parquet``,
  e.g. ``32k/qa1-00000-of-00001.parquet``;
- single files: ``<task>/<length>.json`` (or ``.jsonl`` / ``.parquet``), e.g. ``qa1/32k.json``, the layout
  ``titans-hf babilong generate`` writes.

A folder (a downloaded snapshot) stands for every file inside it that follows one of them. A length label is a
number of tokens with an optional ``k`` (x 1024) or ``M`` (x 1024 x 1024) suffix; ``length_tokens`` is the one rule
that turns it into the builder's integer ``length`` column.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from titans_hf.files import MAX_TEXT_CHARACTERS_VARIABLE, atomic_write_text, max_text_characters

REQUIRED_FIELDS = ("input", "question", "target")
ROW_SUFFIXES = (".json", ".jsonl", ".parquet")

_LENGTH_LABEL = re.compile(r"(\d+)([kKM]?)")
_SHARD_NAME = re.compile(r"(?P<task>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})")
_TASK_FOLDER = re.compile(r"qa\d+")
_LENGTH_UNITS = {"": 1, "k": 1024, "K": 1024, "M": 1024 * 1024}


# ----------------------------------------------------------------------------------------------
# Labels from the layout


def length_tokens(label: str | int) -> int | None:
    """Tokens a length label stands for: ``"32k"`` -> 32768, ``"1M"`` -> 1048576, ``"72"`` / ``72`` -> 72; None
    for a label that is not a length (e.g. ``"train_96"``)."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label if label >= 0 else None
    match = _LENGTH_LABEL.fullmatch(str(label))
    return int(match.group(1)) * _LENGTH_UNITS[match.group(2)] if match else None


def same_length(label: str | int, other: str | int) -> bool:
    """Two length labels name the same length: equal as written, or the same number of tokens ("32k" == 32768)."""
    if str(label) == str(other):
        return True
    tokens = length_tokens(label)
    return tokens is not None and tokens == length_tokens(other)


def babilong_path_labels(path: str | Path) -> tuple[str | None, str | None]:
    """(task, length label) read from a file's place in a published layout, None for what the path does not say.

    ``32k/qa1-00000-of-00001.parquet`` -> ("qa1", "32k"); ``qa2/0k.json`` -> ("qa2", "0k"); ``rows.json`` ->
    (None, None). A folder names the task only when it looks like one (``qa`` and a number).
    """
    path = Path(path)
    stem, parent = path.stem, path.parent.name
    shard = _SHARD_NAME.fullmatch(stem)
    if shard:
        return shard.group("task"), parent if length_tokens(parent) is not None else None
    return (parent if _TASK_FOLDER.fullmatch(parent) else None,
            stem if length_tokens(stem) is not None else None)


@dataclass(frozen=True)
class BabilongSource:
    """The files of one BABILong set (several parquet shards, or one file) and the labels it is scored under."""

    task: str | None
    length: str | None
    paths: tuple[Path, ...]

    def describe(self) -> str:
        names = ", ".join(str(path) for path in self.paths)
        return f"task {self.task or '?'} length {self.length or '?'} ({names})"


def _files_in_folder(folder: Path) -> list[Path]:
    """The files of a folder that follow a layout with both labels; hidden folders (e.g. .cache) are skipped."""
    found = []
    for path in sorted(folder.rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(folder).parts) or not path.is_file():
            continue
        if path.suffix in ROW_SUFFIXES and None not in babilong_path_labels(path):
            found.append(path)
    if not found:
        raise FileNotFoundError(
            f"BABILong folder {folder} holds no file laid out as <length>/<task>-0000i-of-0000n.parquet "
            "(the Hub sets) or <task>/<length>.json"
        )
    return found


def _group_shards(paths: Iterable[Path], complete: bool) -> list[tuple[Path, ...]]:
    """One tuple per set: the shards of one ``-of-N`` set in index order, other files alone. With ``complete``
    (a folder's listing) every one of the N shards must be there: a partial download is an error, not a subset."""
    sets: dict[tuple, dict[int, Path]] = {}
    groups: list[tuple[Path, ...]] = []
    for path in paths:
        shard = _SHARD_NAME.fullmatch(path.stem)
        if shard is None:
            groups.append((path,))
            continue
        key = (path.parent, shard.group("task"), shard.group("count"), path.suffix)
        sets.setdefault(key, {})[int(shard.group("index"))] = path
    for (parent, task, count_text, suffix), shards in sets.items():
        count = int(count_text)
        name = parent / f"{task}-*-of-{count_text}{suffix}"
        missing = [f"{task}-{index:05d}-of-{count_text}{suffix}" for index in range(count) if index not in shards]
        if complete and missing:
            raise FileNotFoundError(f"BABILong set {name} is incomplete: {len(shards)} of {count} shards, missing "
                                    f"{missing} (an interrupted download?)")
        beyond = sorted(str(path) for index, path in shards.items() if index >= count)
        if beyond:
            raise ValueError(f"BABILong set {name}: shard(s) {beyond} lie beyond its {count} shards")
        groups.append(tuple(shards[index] for index in sorted(shards)))
    return groups


def find_babilong_sources(
    paths: Sequence[str | Path],
    tasks: Sequence[str] | None = None,
    lengths: Sequence[str | int] | None = None,
    require_labels: bool = False,
) -> list[BabilongSource]:
    """The BABILong sets behind files and folders (snapshots), labelled and filtered.

    Labels come from the layout (see the module docstring); the shards of one set are one source. ``tasks`` /
    ``lengths`` keep only the sets they name (lengths match as written or by tokens: "32k" == "32768"); a file whose
    path does not say its task takes the one task of ``tasks`` when exactly one is given, and is an error when
    several are (likewise for ``lengths``). With ``require_labels`` every set needs both labels. Every failure
    names the path.
    """
    sources: list[BabilongSource] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files, complete = _files_in_folder(path), True
        elif path.is_file():
            if path.suffix not in ROW_SUFFIXES:
                raise ValueError(f"BABILong file {path}: expected one of {list(ROW_SUFFIXES)}, got {path.suffix!r}")
            files, complete = [path], False
        else:
            raise FileNotFoundError(f"BABILong file or folder {path} does not exist")
        for group in _group_shards(files, complete):
            task, length = babilong_path_labels(group[0])
            if task is None and tasks is not None and len(tasks) == 1:
                task = tasks[0]
            if length is None and lengths is not None and len(lengths) == 1:
                length = str(lengths[0])
            unknown = [name for name, value, wanted in (("task", task, tasks), ("length", length, lengths))
                       if value is None and (require_labels or wanted is not None)]
            if unknown:
                what = " and ".join(unknown)
                raise ValueError(
                    f"BABILong file {group[0]}: its path does not say its {what} (the layouts are "
                    "<length>/<task>-0000i-of-0000n.parquet and <task>/<length>.json, e.g. qa1/32k.json); "
                    "name it with a single task / length argument (e.g. --tasks qa1 --lengths 32k)"
                )
            sources.append(BabilongSource(task, length, group))
    kept = [
        source for source in sources
        if (tasks is None or source.task in tasks)
        and (lengths is None or any(same_length(source.length, length) for length in lengths))
    ]
    if not kept:
        found = "; ".join(source.describe() for source in sources)
        raise ValueError(f"no BABILong set of {[str(p) for p in paths]} matches tasks={list(tasks or [])} "
                         f"lengths={list(lengths or [])}; found: {found}")
    return kept


# ----------------------------------------------------------------------------------------------
# Reading rows


def _checked_rows(records: Sequence[Any], path: Path) -> list[dict[str, str]]:
    """The three fields of every record, each checked: an object, strings, text that is UTF-8, a target."""
    rows = []
    for index, record in enumerate(records):
        where = f"BABILong file {path}, row {index} (0-based)"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected an object with {list(REQUIRED_FIELDS)}, got {type(record).__name__}")
        missing = [field for field in REQUIRED_FIELDS if field not in record]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        wrong = [field for field in REQUIRED_FIELDS if not isinstance(record[field], str)]
        if wrong:
            raise ValueError(f"{where}: field(s) {wrong} must be strings")
        for field in REQUIRED_FIELDS:
            try:
                record[field].encode("utf-8")
            except UnicodeEncodeError as error:  # a lone surrogate, e.g. a JSON "\ud800" escape
                raise ValueError(f"{where}: field {field!r} is not UTF-8 text ({error.reason} at character "
                                 f"{error.start})") from error
        if not record["target"].strip():
            raise ValueError(f"{where}: empty target")
        rows.append({field: record[field] for field in REQUIRED_FIELDS})
    if not rows:
        raise ValueError(f"BABILong file {path} holds no rows")
    _check_row_sizes(rows, path)
    return rows


def read_utf8_text(path: Path, what: str) -> str:
    """A file's text; bytes that are not UTF-8 are an error naming the file, line and byte offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{what} {path} is not UTF-8 text: {error.reason} (byte 0x{data[error.start]:02x} at "
                         f"offset {error.start}, line {line})") from error


def read_babilong_json(path: str | Path) -> list[dict[str, str]]:
    """Rows of a BABILong JSON file: a JSON list (the public files) or JSON Lines.

    Extra fields of the public files are dropped; a row missing a field, with a non-string field, text that is
    not UTF-8 or an empty target is an error naming the file and row, never silently skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"BABILong file {path} does not exist")
    text = read_utf8_text(path, "BABILong file")
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ValueError(f"BABILong file {path} is not valid JSON or JSON Lines: {error}") from error
    return _checked_rows(records, path)


def _parquet_column(table, name: str, path: Path) -> list[str]:
    """A text column as Python strings; binary columns are decoded as UTF-8. Nulls and bytes that are not UTF-8
    are errors naming the row."""
    import pyarrow as pa

    column = table.column(name)
    kind = column.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)):
        raise ValueError(f"BABILong file {path}: column {name!r} must hold strings, got {kind}")
    raw = column.cast(pa.large_binary()) if not pa.types.is_large_binary(kind) else column
    values = []
    for index, value in enumerate(raw.to_pylist()):
        where = f"BABILong file {path}, row {index} (0-based), column {name!r}"
        if value is None:
            raise ValueError(f"{where}: null (expected a string)")
        try:
            values.append(value.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{where}: not UTF-8 text: {error.reason} (byte 0x{value[error.start]:02x} at "
                             f"offset {error.start})") from error
    return values


def _check_parquet_sizes(metadata, path: Path) -> None:
    """Refuse, from the file's metadata alone, a parquet file whose rows would be larger than `max_text_characters()`
    once decompressed (a row group's uncompressed bytes over its rows bound a row's size from below), or that holds
    no rows; nothing is decompressed before this."""
    if metadata.num_rows == 0:
        raise ValueError(f"BABILong file {path} holds no rows (a parquet file of 0 rows)")
    names = metadata.schema.names
    limit = max_text_characters()
    for group_index in range(metadata.num_row_groups):
        group = metadata.row_group(group_index)
        for column_index in range(group.num_columns):
            column = group.column(column_index)
            name = column.path_in_schema
            if name not in REQUIRED_FIELDS and names[column_index] not in REQUIRED_FIELDS:
                continue
            per_row = column.total_uncompressed_size / max(group.num_rows, 1)
            if per_row > limit:
                raise ValueError(f"BABILong file {path}: column {name!r} of row group {group_index} holds "
                                 f"{column.total_uncompressed_size} bytes uncompressed for {group.num_rows} row(s), "
                                 f"over {limit} characters a row: rows that long are not read (tokenizing them would "
                                 f"take gigabytes of memory; ${MAX_TEXT_CHARACTERS_VARIABLE} sets the limit)")


def _check_row_sizes(rows: Sequence[dict[str, str]], path: Path) -> None:
    """Refuse a row whose field is longer than `max_text_characters()`, naming the file and row (after reading,
    before any tokenization)."""
    limit = max_text_characters()
    for index, row in enumerate(rows):
        for field in REQUIRED_FIELDS:
            if len(row[field]) > limit:
                raise ValueError(f"BABILong file {path}, row {index} (0-based): field {field!r} holds "
                                 f"{len(row[field])} characters, over {limit}: rows that long are not read "
                                 f"(tokenizing them would take gigabytes of memory; ${MAX_TEXT_CHARACTERS_VARIABLE} "
                                 "sets the limit)")


def read_babilong_parquet(path: str | Path) -> list[dict[str, str]]:
    """Rows of a BABILong parquet file (the Hub sets' ``<length>/<task>-0000i-of-0000n.parquet``).

    Only the ``input``, ``question`` and ``target`` columns are read; a file that is not parquet, a missing or
    non-text column, a null, text that is not UTF-8 or an empty target is an error naming the file (and row).
    """
    import pyarrow
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"BABILong file {path} does not exist")
    try:
        schema = pq.read_schema(path)
        missing = [field for field in REQUIRED_FIELDS if field not in schema.names]
        if missing:
            raise ValueError(f"BABILong file {path}: missing column(s) {missing} (it has {schema.names})")
        _check_parquet_sizes(pq.ParquetFile(path).metadata, path)
        table = pq.read_table(path, columns=list(REQUIRED_FIELDS))
    except pyarrow.ArrowException as error:
        raise ValueError(f"BABILong file {path} is not a readable parquet file: {error}") from error
    columns = {name: _parquet_column(table, name, path) for name in REQUIRED_FIELDS}
    records = [dict(zip(REQUIRED_FIELDS, values)) for values in zip(*columns.values())]
    return _checked_rows(records, path)


def read_babilong_file(path: str | Path) -> list[dict[str, str]]:
    """Rows of one BABILong file: parquet when it is named ``.parquet`` or starts with parquet's magic bytes (a
    download cache names files by hash), else JSON / JSON Lines."""
    path = Path(path)
    if path.suffix == ".parquet":
        return read_babilong_parquet(path)
    if path.is_file():
        with open(path, "rb") as handle:
            if handle.read(4) == b"PAR1":
                return read_babilong_parquet(path)
    return read_babilong_json(path)


def read_babilong_files(paths: Iterable[str | Path]) -> list[dict[str, str]]:
    """Rows of several files (e.g. the shards of one set), in order."""
    return [row for path in paths for row in read_babilong_file(path)]


# ----------------------------------------------------------------------------------------------
# Writing


def write_babilong_json(rows: Sequence[dict[str, str]], path: str | Path) -> Path:
    """Write rows as a JSON list (the public layout) through a temporary name, so a partial file never looks done."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = [{field: row[field] for field in REQUIRED_FIELDS} for row in rows]
    return atomic_write_text(path, json.dumps(payload, ensure_ascii=False, indent=1))


DATASET_CARD_TEMPLATE = Path(__file__).resolve().parents[2] / "hub_cards" / "babilong_dataset_card.md"
DATASET_CARD_NAME = "README.md"


def dataset_card_path(json_path: str | Path) -> Path:
    """Where the card of a generated JSON file goes: README.md in its folder."""
    return Path(json_path).parent / DATASET_CARD_NAME


def render_dataset_card(settings: dict[str, Any]) -> str:
    """The dataset card of a generated set: how to regenerate it and what its rows mean.

    ``settings`` holds task, length, num_samples, seed, tokenizer, haystack_files (list) and files.
    """
    from huggingface_hub import DatasetCard, DatasetCardData

    card_data = DatasetCardData(
        language="en", license="apache-2.0", pretty_name=f"Generated BABILong {settings['task']}",
        task_categories=["question-answering"], tags=["babilong", "long-context", "titans_hf", "synthetic"],
    )
    card = DatasetCard.from_template(card_data, template_path=str(DATASET_CARD_TEMPLATE), **settings)
    return str(card)


def write_dataset_card(json_path: str | Path, settings: dict[str, Any]) -> Path:
    """Render the card as README.md in the folder of a generated JSON file (temporary name, then rename)."""
    return atomic_write_text(dataset_card_path(json_path), render_dataset_card(settings))
