"""Token stores: per-key lists of 1-D segments (documents), read lazily from `.h5` or `.bin` + `meta.json`.

A store can be far larger than RAM, so nothing here loads a key whole: the `.bin` backend maps the
files read-only and copies out only the slice asked for; the `.h5` backend reads one slice of one
segment dataset at a time. Every problem found at open is a `ValueError` (or `FileNotFoundError`)
that names the file and what is wrong, and nothing is ever written back while reading.

Layouts (both hold the same information):

- `.bin`: a directory with `meta.json` = `{format_version, train_type, keys: {key: {dtype, length,
  offsets}}, tokenizer, vocab_size, eos_token_id, pad_token_id}` and one flat `<key>.bin` per key.
  `offsets` are the cumulative segment boundaries, `[0, ..., length]`.
- `.h5`: one group per key holding datasets `"0"`, `"1"`, ... (one per segment); the metadata
  fields other than `keys` are file attributes.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import h5py
import numpy as np

FORMAT_VERSION = 1
META_FILE = "meta.json"
H5_SUFFIXES = (".h5", ".hdf5")
# Keys holding real numbers; every other key holds token ids or 0/1 masks and must be integral.
FLOAT_KEYS = frozenset({"rewards"})
METADATA_FIELDS = ("train_type", "tokenizer", "vocab_size", "eos_token_id", "pad_token_id")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every id: halves the store for vocabularies up to 65536."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _checked_dtype(dtype: Any, key: str, where: Path) -> np.dtype:
    try:
        parsed = np.dtype(dtype)
    except TypeError as error:
        raise ValueError(f"{where}: key {key!r} has unknown dtype {dtype!r}") from error
    if key in FLOAT_KEYS:
        if parsed.kind not in "iuf":
            raise ValueError(f"{where}: key {key!r} has dtype {parsed}; it needs a numeric dtype")
    elif parsed.kind not in "iu":
        raise ValueError(f"{where}: key {key!r} has dtype {parsed}; token and mask keys need an integer dtype")
    return parsed


def _checked_offsets(offsets: Any, length: int, key: str, where: Path) -> np.ndarray:
    array = np.asarray(offsets)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise ValueError(f"{where}: offsets of key {key!r} must be a non-empty list of integers")
    array = array.astype(np.int64)
    if array[0] != 0 or array[-1] != length or np.any(np.diff(array) < 0):
        raise ValueError(
            f"{where}: offsets of key {key!r} must rise (never fall) from 0 to the key's length {length}, "
            f"got {array[0]} ... {array[-1]}"
        )
    return array


def detect_format(path: str | Path) -> str:
    """Say which backend reads `path` ("h5" or "bin"), judging by content, never by a silent choice.

    A `meta.json` file, a `.bin` file beside one, or a directory holding `meta.json` is a bin store;
    an HDF5 file is an h5 store; a directory holding both kinds is ambiguous and an error.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such token store")
    if path.is_dir():
        entries = sorted(path.iterdir())
        has_meta = (path / META_FILE).is_file()
        h5_files = [entry.name for entry in entries if entry.is_file() and h5py.is_hdf5(entry)]
        if has_meta and h5_files:
            raise ValueError(
                f"{path}: directory holds both a bin store ({META_FILE}) and HDF5 files {h5_files}; "
                "point at one of them"
            )
        if has_meta:
            return "bin"
        if h5_files:
            raise ValueError(f"{path}: directory holds HDF5 stores {h5_files}; pass the file itself")
        raise FileNotFoundError(f"{path}: directory holds no {META_FILE} (bin store) and no HDF5 file")
    if path.name == META_FILE or path.suffix == ".bin":
        return "bin"
    if h5py.is_hdf5(path):
        return "h5"
    raise ValueError(f"{path}: not an HDF5 file and not part of a bin store ({META_FILE} + <key>.bin)")


class TokenStore:
    """What both backends share: segment offsets per key and reads of flat token ranges.

    Subclasses fill `path`, `dtypes`, `_offsets` and `metadata` at open and implement `_read`.
    """

    format: str
    path: Path
    dtypes: dict[str, np.dtype]
    metadata: dict[str, Any]
    _offsets: dict[str, np.ndarray]

    @property
    def keys(self) -> list[str]:
        return list(self.dtypes)

    def offsets(self, key: str) -> np.ndarray:
        """Cumulative segment boundaries of `key`: segment i is the flat range `[o[i], o[i+1])`."""
        return self._offsets[self._known(key)]

    def segment_lengths(self, key: str) -> np.ndarray:
        return np.diff(self.offsets(key))

    def num_segments(self, key: str) -> int:
        return len(self.offsets(key)) - 1

    def total_length(self, key: str) -> int:
        return int(self.offsets(key)[-1])

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        """A copy of the flat range `[start, stop)` of `key`, crossing segment boundaries if asked."""
        length = self.total_length(key)
        if not 0 <= start <= stop <= length:
            raise IndexError(f"{self.path}: range [{start}, {stop}) outside key {key!r} of length {length}")
        return self._read(key, start, stop)

    def segment(self, key: str, index: int) -> np.ndarray:
        count = self.num_segments(key)
        if not -count <= index < count:
            raise IndexError(f"{self.path}: segment {index} outside key {key!r} with {count} segments")
        offsets = self.offsets(key)
        index %= count
        return self._read(key, int(offsets[index]), int(offsets[index + 1]))

    def close(self) -> None:
        """Release file handles; a closed store reopens them on the next read."""

    def __enter__(self) -> "TokenStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        sizes = {key: self.total_length(key) for key in self.keys}
        return f"{type(self).__name__}({str(self.path)!r}, lengths={sizes})"

    def _known(self, key: str) -> str:
        if key not in self.dtypes:
            raise KeyError(f"{self.path}: no key {key!r} (keys: {self.keys})")
        return key

    def _check_not_empty(self) -> None:
        if not self.dtypes or all(self.total_length(key) == 0 for key in self.dtypes):
            raise ValueError(f"{self.path}: empty store, it holds no tokens")

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError


class MmapStore(TokenStore):
    """A `.bin` store: flat `<key>.bin` files mapped read-only with `np.memmap(mode="r")`."""

    format = "bin"
    # Pages a mapping has touched count toward this process's RSS until unmapped, so a long pass
    # over a large store would look like (and, under a cgroup limit, be charged as) loading it
    # whole. Dropping the maps after this many bytes keeps RSS flat; the page cache keeps the data.
    release_after_bytes = 16 << 20

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path.parent if path.is_file() else path
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.path}: missing {META_FILE}; a bin store needs it beside its .bin files")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{meta_path}: not valid JSON ({error})") from error
        if not isinstance(meta, dict):
            raise ValueError(f"{meta_path}: must hold a JSON object, got {type(meta).__name__}")
        for field in ("format_version", "keys"):
            if field not in meta:
                raise ValueError(f"{meta_path}: missing field {field!r}")
        if meta["format_version"] != FORMAT_VERSION:
            raise ValueError(
                f"{meta_path}: format_version {meta['format_version']!r} is not supported (expected {FORMAT_VERSION})"
            )
        if not isinstance(meta["keys"], dict):
            raise ValueError(f"{meta_path}: field 'keys' must map key names to {{dtype, length, offsets}}")
        self.metadata = {field: meta.get(field) for field in METADATA_FIELDS}
        self.dtypes, self._offsets, self._files = {}, {}, {}
        for key, entry in meta["keys"].items():
            missing = [field for field in ("dtype", "length", "offsets") if not isinstance(entry, dict) or field not in entry]
            if missing:
                raise ValueError(f"{meta_path}: key {key!r} is missing field(s) {missing}")
            length = entry["length"]
            if not isinstance(length, int) or length < 0:
                raise ValueError(f"{meta_path}: key {key!r} has length {length!r}; it must be a non-negative integer")
            dtype = _checked_dtype(entry["dtype"], key, meta_path)
            offsets = _checked_offsets(entry["offsets"], length, key, meta_path)
            file = self.path / f"{key}.bin"
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing; {META_FILE} lists key {key!r}")
            size, expected = file.stat().st_size, length * dtype.itemsize
            if size != expected:
                raise ValueError(
                    f"{file}: is {size} bytes but {META_FILE} promises {expected} "
                    f"({length} x {dtype}); the file is {'shorter' if size < expected else 'longer'} than meta says"
                )
            self.dtypes[key], self._offsets[key], self._files[key] = dtype, offsets, file
        self._check_not_empty()
        self._maps: dict[str, np.memmap] = {}
        self._bytes_since_release = 0

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        if stop == start:
            return np.empty(0, self.dtypes[key])
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = np.memmap(self._files[key], dtype=self.dtypes[key], mode="r", shape=(self.total_length(key),))
            self._maps[key] = mapped
        values = np.array(mapped[start:stop])
        self._bytes_since_release += values.nbytes
        if self._bytes_since_release >= self.release_after_bytes:
            self.close()
        return values

    def close(self) -> None:
        self._maps.clear()
        self._bytes_since_release = 0

    def __getstate__(self) -> dict:
        # Pickling a memmap copies its data: workers get the paths and map the files themselves.
        return {**self.__dict__, "_maps": {}, "_bytes_since_release": 0}


class H5Store(TokenStore):
    """An `.h5` store: group per key, dataset per segment, read one slice at a time.

    Segments are ordered by their numeric names (h5py lists members by name, where "10" sorts
    before "2"). `share_memory=True` copies each key into one shared-memory torch tensor so
    DataLoader workers read it without each holding a copy or an HDF5 handle (one tensor per key,
    not per segment, so a million documents do not become a million shared-memory files).
    """

    format = "h5"

    def __init__(self, path: str | Path, share_memory: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such HDF5 store")
        if not h5py.is_hdf5(self.path):
            raise ValueError(f"{self.path}: not an HDF5 file")
        self.dtypes, self._offsets, self._segment_names = {}, {}, {}
        with h5py.File(self.path, "r") as file:
            version = file.attrs.get("format_version")
            if version is None:
                raise ValueError(f"{self.path}: missing attribute 'format_version'")
            if int(version) != FORMAT_VERSION:
                raise ValueError(f"{self.path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
            self.metadata = {field: _plain(file.attrs.get(field)) for field in METADATA_FIELDS}
            for key, group in file.items():
                self._index_group(key, group)
        self._check_not_empty()
        self._file: h5py.File | None = None
        self._file_pid = -1
        self._shared: dict[str, Any] = {}
        if share_memory:
            self._share_memory()

    def _index_group(self, key: str, group: Any) -> None:
        where = f"{self.path}:/{key}"
        if not isinstance(group, h5py.Group):
            raise ValueError(f"{where}: expected a group of segment datasets, found a {type(group).__name__}")
        names = list(group.keys())
        if not all(name.isdigit() for name in names):
            raise ValueError(f"{where}: segment names must be integers 0..N-1, got {sorted(names)[:5]}...")
        names.sort(key=int)
        if [int(name) for name in names] != list(range(len(names))):
            raise ValueError(f"{where}: segment names must be exactly 0..{len(names) - 1} with no gaps")
        lengths, dtype = [], None
        for name in names:
            dataset = group[name]
            if not isinstance(dataset, h5py.Dataset) or dataset.ndim != 1:
                raise ValueError(f"{where}/{name}: segments must be 1-D datasets")
            if dtype is not None and dataset.dtype != dtype:
                raise ValueError(f"{where}/{name}: dtype {dataset.dtype} differs from earlier segments' {dtype}")
            dtype = dataset.dtype
            lengths.append(dataset.shape[0])
        self.dtypes[key] = _checked_dtype(dtype if dtype is not None else np.uint32, key, self.path)
        self._offsets[key] = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        self._segment_names[key] = names

    def _handle(self) -> h5py.File:
        # An HDF5 handle inherited through fork is not safe to use: each process opens its own.
        if self._file is None or self._file_pid != os.getpid():
            self._file = h5py.File(self.path, "r")
            self._file_pid = os.getpid()
        return self._file

    def _share_memory(self) -> None:
        import torch

        for key in self.keys:
            flat = np.empty(self.total_length(key), self.dtypes[key])
            offsets = self.offsets(key)
            group = self._handle()[key]
            for index, name in enumerate(self._segment_names[key]):
                group[name].read_direct(flat, dest_sel=np.s_[offsets[index] : offsets[index + 1]])
            self._shared[key] = torch.from_numpy(flat).share_memory_()
        self.close()

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        if key in self._shared:
            return self._shared[key][start:stop].numpy().copy()
        offsets = self.offsets(key)
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        group = self._handle()[key]
        pieces, index = [], max(first, 0)
        while index < len(offsets) - 1 and offsets[index] < stop:
            begin, end = max(start, offsets[index]), min(stop, offsets[index + 1])
            if end > begin:
                pieces.append(group[self._segment_names[key][index]][begin - offsets[index] : end - offsets[index]])
            index += 1
        if not pieces:
            return np.empty(0, self.dtypes[key])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def close(self) -> None:
        if self._file is not None and self._file_pid == os.getpid():
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict:
        # Pickled into worker processes: the handle stays behind, each worker opens its own.
        return {**self.__dict__, "_file": None, "_file_pid": -1}


def _plain(value: Any) -> Any:
    """HDF5 attributes come back as numpy scalars or bytes; meta.json holds plain JSON values."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


STORE_CLASSES: dict[str, type[TokenStore]] = {"h5": H5Store, "bin": MmapStore}


def open_store(path: str | Path, **kwargs: Any) -> TokenStore:
    """Open the store at `path` (an `.h5` file, a bin store directory, or its `meta.json`/`.bin` file)."""
    return STORE_CLASSES[detect_format(path)](path, **kwargs)


class StoreWriter:
    """Writes a store under a temporary name; `finish` completes it, `abort` removes it.

    Segments are streamed: `append` extends the open segment of a key, `end_segment` closes it,
    so a document longer than RAM never has to exist whole. The caller renames the finished
    temporary path, so a store that is cut short never looks complete.
    """

    format: str

    def __init__(self, final_path: str | Path, dtypes: dict[str, Any], metadata: dict[str, Any]):
        self.final_path = Path(final_path)
        self.temp_path = self.final_path.with_name(f".{self.final_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.dtypes = {key: _checked_dtype(dtype, key, self.final_path) for key, dtype in dtypes.items()}
        self.metadata = {field: metadata.get(field) for field in METADATA_FIELDS}
        self.lengths = dict.fromkeys(self.dtypes, 0)
        self.offsets: dict[str, list[int]] = {key: [0] for key in self.dtypes}

    @property
    def num_tokens(self) -> int:
        return max(self.lengths.values(), default=0)

    def append(self, key: str, values: np.ndarray) -> None:
        dtype = self.dtypes[key]
        values = np.asarray(values)
        if values.size and dtype.kind in "iu":
            info = np.iinfo(dtype)
            low, high = values.min(), values.max()
            if low < info.min or high > info.max:
                raise ValueError(f"{self.final_path}: key {key!r} value range [{low}, {high}] does not fit {dtype}")
        values = values.astype(dtype, copy=False)
        self._write(key, values)
        self.lengths[key] += values.size

    def end_segment(self, key: str) -> None:
        self.offsets[key].append(self.lengths[key])

    def add_segment(self, key: str, values: np.ndarray) -> None:
        self.append(key, values)
        self.end_segment(key)

    def finish(self) -> Path:
        """Complete the store under its temporary name and return that name."""
        for key, offsets in self.offsets.items():
            if offsets[-1] != self.lengths[key]:
                raise ValueError(f"{self.final_path}: key {key!r} has an unfinished segment")
        self._finish()
        return self.temp_path

    def abort(self) -> None:
        self._close()
        if self.temp_path.is_dir():
            shutil.rmtree(self.temp_path)
        elif self.temp_path.exists():
            self.temp_path.unlink()

    def _write(self, key: str, values: np.ndarray) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class MmapStoreWriter(StoreWriter):
    format = "bin"

    def __init__(self, final_path: str | Path, dtypes: dict[str, Any], metadata: dict[str, Any]):
        super().__init__(final_path, dtypes, metadata)
        self.temp_path.mkdir(parents=True)
        self._handles = {key: open(self.temp_path / f"{key}.bin", "wb") for key in self.dtypes}

    def _write(self, key: str, values: np.ndarray) -> None:
        values.tofile(self._handles[key])

    def _finish(self) -> None:
        self._close()
        keys = {
            key: {"dtype": self.dtypes[key].name, "length": self.lengths[key], "offsets": self.offsets[key]}
            for key in self.dtypes
        }
        meta = {"format_version": FORMAT_VERSION, **self.metadata, "keys": keys}
        (self.temp_path / META_FILE).write_text(json.dumps(meta))

    def _close(self) -> None:
        for handle in self._handles.values():
            handle.close()


class H5StoreWriter(StoreWriter):
    format = "h5"

    def __init__(self, final_path: str | Path, dtypes: dict[str, Any], metadata: dict[str, Any]):
        super().__init__(final_path, dtypes, metadata)
        self._file = h5py.File(self.temp_path, "w")
        self._groups = {key: self._file.create_group(key) for key in self.dtypes}
        self._pending: dict[str, list[np.ndarray]] = {key: [] for key in self.dtypes}

    def _write(self, key: str, values: np.ndarray) -> None:
        # A segment is one contiguous dataset (chunked, resizable ones waste a chunk per small
        # document), so the open segment is held until it ends.
        self._pending[key].append(values)

    def end_segment(self, key: str) -> None:
        pieces = self._pending[key]
        values = np.concatenate(pieces) if pieces else np.empty(0, self.dtypes[key])
        self._groups[key].create_dataset(str(len(self.offsets[key]) - 1), data=values)
        self._pending[key] = []
        super().end_segment(key)

    def _finish(self) -> None:
        self._file.attrs["format_version"] = FORMAT_VERSION
        for field, value in self.metadata.items():
            if value is not None:
                self._file.attrs[field] = value
        self._close()

    def _close(self) -> None:
        if self._file.id.valid:
            self._file.close()


STORE_WRITERS: dict[str, type[StoreWriter]] = {"h5": H5StoreWriter, "bin": MmapStoreWriter}


def output_format(path: str | Path) -> str:
    """The format a new store at `path` gets: `.h5`/`.hdf5` files are HDF5, anything else a bin directory."""
    return "h5" if Path(path).suffix in H5_SUFFIXES else "bin"
