"""`titans_tokens`: token stores served as Arrow-backed windowed examples through `datasets`.

    load_dataset("titans_tokens", data_files="corpus.h5", train_type="seq", window_size=4096, stride=2048)
    load_dataset("titans_tokens", data_files={"train": "train_bin/*", "test": "test_bin/meta.json"}, ...)

`data_files` name `.h5` stores or any file of a bin store (`meta.json`, `<key>.bin`); each store is
read lazily and its examples (see `TokenExamples`) are written to the Arrow cache in window
ranges, which are the shards `num_proc` and streaming split the work over. The cache key holds
every config value, beyond the data files' own mtimes the size, mtime, ctime and inode of every file
of each store (touching a `.bin` beside a listed `meta.json` rebuilds too), and each store's metadata
and per-key content checksums (`store_contents`), so a store replaced by one of the same sizes and
mtimes rebuilds as well. A file edited in place with its size and mtime set back still gets a new
ctime, which no user can set: the cache key changes, and the build, which reads every token anyway,
first hashes each store and compares the sha256 recorded at prepare (`verify_checksums`), so edited
data is refused, naming the file. That is the cheapest correct option: a cache hit costs a stat per
file, never a full read. `vocab_size` (the model's) refuses stores holding larger ids up front.

`data_files` (or `data_dir`) must be given: `datasets` would otherwise hand the builder whatever files lie
in the working directory; `titans_hf.data` refuses such a call before it resolves any file.
"""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import datasets
import numpy as np
import pyarrow as pa
from datasets.builder import Key

from titans_hf.data.stores import META_FILE, check_store_tokenizer, detect_format, open_store
from titans_hf.data.windows import TRAIN_TYPE_KEYS, TokenExamples

# Each store is cut into this many window ranges: enough shards for any sensible num_proc.
RANGES_PER_STORE = 64
# Arrow tables of about this many tokens: large enough to amortise per-table work, small enough
# that a window of a million tokens does not make a table of gigabytes.
TOKENS_PER_TABLE = 1 << 21
RECORDS_PER_TABLE = 256

_IDS = datasets.List(datasets.Value("int32"))
_MASK = datasets.List(datasets.Value("int8"))
FEATURES: dict[str, datasets.Features] = {
    "seq": datasets.Features({"input_ids": _IDS, "attention_mask": _MASK, "labels": _IDS}),
    "sft": datasets.Features({"input_ids": _IDS, "attention_mask": _MASK, "labels": _IDS}),
    "dpo": datasets.Features({"prompt_ids": _IDS, "chosen_ids": _IDS, "rejected_ids": _IDS}),
    "grpo": datasets.Features(
        {
            "prompt_ids": _IDS,
            "completion_ids": datasets.List(_IDS),
            "completion_mask": datasets.List(_MASK),
            "rewards": datasets.List(datasets.Value("float32")),
        }
    ),
}


def store_data_files(paths: Iterable[str | Path], flag: str = "data_files") -> list[str]:
    """`data_files` for the builder from what users name: a bin store folder stands for its `meta.json` (datasets
    resolves files and patterns, not folders); a glob pattern stands for the files it matches, in sorted order.
    A path that does not exist, or a pattern that matches nothing, is an error naming `flag` and the path."""
    files: list[str] = []
    for path in map(Path, paths):
        if path.is_dir() and (path / META_FILE).is_file():
            files.append(str(path / META_FILE))
        elif path.exists():
            files.append(str(path))
        elif glob.has_magic(str(path)):
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise FileNotFoundError(f"{flag} {path}: the pattern matches no file")
            files += matches
        else:
            raise FileNotFoundError(f"{flag} {path}: no such store (an .h5 file, a bin store folder or one of its "
                                    "files)")
    if not files:
        raise ValueError(f"{flag}: no token store named")
    return files


def check_stores_tokenizer(files: Iterable[str | Path], tokenizer: Any, what: str) -> None:
    """Refuse any store among `files` that was prepared with another tokenizer than `tokenizer` (see
    `check_store_tokenizer`), before any row is built; `what` names the tokenizer in the message."""
    for root in store_roots(files):
        with open_store(root) as store:
            check_store_tokenizer(store, tokenizer, what)


def store_roots(files: Iterable[str | Path]) -> list[Path]:
    """The distinct stores that data files name, in order: `.h5` files, and bin stores by directory."""
    roots: list[Path] = []
    for file in files:
        path = Path(file)
        if detect_format(path) == "bin":
            path = path.parent
            detect_format(path)  # a bin store directory that also holds HDF5 files is ambiguous
        if path not in roots:
            roots.append(path)
    return roots


def store_fingerprint(roots: Iterable[Path]) -> list[tuple[str, int, int, int, int]]:
    """Size, mtime, ctime and inode of every file of each store: a change to any of them must rebuild the cache
    (an in-place edit that sets the mtime back still moves the ctime)."""
    files: list[Path] = []
    for root in roots:
        files += sorted(entry for entry in root.iterdir() if entry.is_file()) if root.is_dir() else [root]
    stats = [(file, file.stat()) for file in files]
    return [(str(file), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino) for file, stat in stats]


def store_contents(roots: Iterable[Path]) -> list[tuple[str, dict[str, Any], dict[str, tuple[str, str]]]]:
    """Per store: its metadata and, per key, dtype and `key_checksum` (values and offsets).

    The checksums are those recorded at prepare (cheap: the store is opened, not read); a store
    written before they were recorded is hashed whole, every time, which is slower but still right.
    """
    contents = []
    for root in roots:
        with open_store(root) as store:
            keys = {key: (store.dtypes[key].str, store.checksum(key)) for key in store.keys}
            contents.append((str(root), store.metadata, keys))
    return contents


@dataclass
class TitansTokensConfig(datasets.BuilderConfig):
    """Plain values only, so the Arrow cache key changes exactly when an input changes.

    `window_size`, `stride` (default: `window_size`), `pad_tail` and `respect_document_boundaries`
    apply to `seq` and `sft`; `dpo` and `grpo` yield whole records. `pad_token_id` defaults to the
    store's pad (or eos) id. `vocab_size`: the model's vocabulary; a store holding an id at or above
    it is refused before any row is built (see `TokenExamples`).
    """

    train_type: str = "seq"
    window_size: int | None = None
    stride: int | None = None
    pad_tail: bool = False
    respect_document_boundaries: bool = False
    pad_token_id: int | None = None
    vocab_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.train_type not in TRAIN_TYPE_KEYS:
            raise ValueError(f"train_type must be one of {list(TRAIN_TYPE_KEYS)}, got {self.train_type!r}")
        for name in ("window_size", "stride", "pad_token_id", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"titans_tokens: {name}={value!r} must be an integer or None (got "
                                 f"{type(value).__name__})")
        for name in ("pad_tail", "respect_document_boundaries"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"titans_tokens: {name}={getattr(self, name)!r} must be true or false")

    def create_config_id(self, config_kwargs: dict, custom_features: datasets.Features | None = None) -> str:
        if self.data_files is not None:
            files = [file for split_files in self.data_files.values() for file in split_files]
            roots = store_roots(files)
            config_kwargs = {**config_kwargs, "store_files": store_fingerprint(roots), "store_contents": store_contents(roots)}
        return super().create_config_id(config_kwargs, custom_features=custom_features)


def _list_array(rows: Any, arrow_type: pa.ListType) -> pa.Array:
    """Build a list column from a 2-D array (equal rows) or a list of arrays / of lists of arrays."""
    value_type = arrow_type.value_type
    if isinstance(rows, np.ndarray):
        count, width = rows.shape
        offsets = np.arange(0, count * width + 1, width, dtype=np.int32)
        return pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1), type=value_type))
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int32)
    if pa.types.is_list(value_type):
        values = _list_array([inner for row in rows for inner in row], value_type)
    else:
        flat = np.concatenate(rows) if rows else np.empty(0, value_type.to_pandas_dtype())
        values = pa.array(flat, type=value_type)
    return pa.ListArray.from_arrays(offsets, values)


class TitansTokens(datasets.ArrowBasedBuilder):
    BUILDER_CONFIG_CLASS = TitansTokensConfig
    config: TitansTokensConfig

    def __init__(self, *args: Any, **kwargs: Any):
        # Used as a class (download_and_prepare / as_dataset), the builder gets the same code hash
        # in its cache path that registration gives load_dataset, so a code change rebuilds both.
        if kwargs.get("hash") is None:
            from titans_hf.data import source_hash

            kwargs["hash"] = source_hash("titans_tokens")
        super().__init__(*args, **kwargs)

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(
            description="Windows (seq, sft) or whole records (dpo, grpo) from titans_hf token stores.",
            features=FEATURES[self.config.train_type],
        )

    def _examples(self, store) -> TokenExamples:
        config = self.config
        return TokenExamples(
            store,
            config.train_type,
            window_size=config.window_size,
            stride=config.stride,
            pad_tail=config.pad_tail,
            respect_document_boundaries=config.respect_document_boundaries,
            pad_token_id=config.pad_token_id,
            vocab_size=config.vocab_size,
        )

    def _split_generators(self, dl_manager) -> list[datasets.SplitGenerator]:
        if not self.config.data_files:
            raise ValueError(
                "titans_tokens needs data_files: .h5 stores and/or files of bin stores (e.g. 'corpus_bin/*')"
            )
        splits = []
        for split, files in self.config.data_files.items():
            ranges: list[tuple[str, int, int]] = []
            for root in store_roots(files):
                with open_store(root) as store:
                    store.verify_checksums()
                    count = len(self._examples(store))
                step = math.ceil(count / RANGES_PER_STORE)
                ranges += [(str(root), start, min(start + step, count)) for start in range(0, count, step)]
            splits.append(datasets.SplitGenerator(name=split, gen_kwargs={"ranges": ranges}))
        return splits

    def _generate_tables(self, ranges: list[tuple[str, int, int]]) -> Iterator[tuple[Key, pa.Table]]:
        schema = self.info.features.arrow_schema
        window_size = self.config.window_size
        rows_per_table = max(1, TOKENS_PER_TABLE // window_size) if window_size else RECORDS_PER_TABLE
        store, examples = None, None
        try:
            for range_index, (root, start, stop) in enumerate(ranges):
                if store is None or str(store.path) != root:  # ranges of one store follow each other
                    if store is not None:
                        store.close()
                    store = open_store(root)
                    examples = self._examples(store)
                for table_index, begin in enumerate(range(start, stop, rows_per_table)):
                    columns = examples.batch(begin, min(begin + rows_per_table, stop))
                    arrays = [_list_array(columns[field.name], field.type) for field in schema]
                    yield Key(range_index, table_index), pa.Table.from_arrays(arrays, schema=schema)
        finally:
            if store is not None:
                store.close()
