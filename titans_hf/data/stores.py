"""Token stores: per-key lists of 1-D segments (documents), read lazily from `.h5` or `.bin` + `meta.json`.

A store can be far larger than RAM, so nothing here loads a key whole: the `.bin` backend maps the
files read-only and copies out only the slice asked for; the `.h5` backend reads one slice of one
segment dataset at a time. Every problem found is a `ValueError` (or `FileNotFoundError`) that names
the file and what is wrong, and nothing is ever written back while reading.

Layouts (both hold the same information):

- `.bin`: a directory with `meta.json` = `{format_version, train_type, keys: {key: {dtype, length,
  offsets, min, max, sha256}}, tokenizer, vocab_size, eos_token_id, pad_token_id}` and one flat
  `<key>.bin` per key. `offsets` are the cumulative segment boundaries, `[0, ..., length]`.
- `.h5`: one group per key holding datasets `"0"`, `"1"`, ... (one per segment), with `min`, `max`
  and `sha256` as the group's attributes; the metadata fields other than `keys` are file attributes.

What each key records (a store whose keys record none of these fields, written by hand or by another tool, still
opens):
- `min`, `max`: the range of its values (null for an empty key), checked at open against what the
  key may hold (`ValueRule`): token ids in `[0, vocab_size - 1]` and below 2**31 (Arrow and torch
  hold ids as int32, where a larger uint32 id would wrap negative), masks 0 or 1, rewards finite and within
  `MAX_ABS_REWARD`.
- `sha256`: `key_checksum` of its values and offsets, computed while writing; the `titans_tokens`
  cache key holds it, so a store rewritten with the same sizes and mtimes is still a new input.

Float keys (rewards: one value per response, a small part of any store) are also scanned whole at open, so a
reward that a store written by hand or by another tool holds beyond its rule is named, with its record, before
any row is built (inside the datasets builder, an error at a row's read would reach the user wrapped).

Beyond the recorded range, every read checks the values it returns against it (or, for a store
that records none, against the key's `ValueRule`): a store whose data contradicts its metadata,
or one that records no range and holds ids its vocabulary does not have, fails at the first read
that touches them instead of training on wrong ids. The check (a min and max of the window) costs
about what copying the window out does, so it is on every read; `value_range` scans a key that
records no range once, through `np.memmap`.

A store stays inside itself: key names are plain names (`KEY_NAME`), `.bin` files and `meta.json`
that are links to files outside the store directory are refused, and so are HDF5 soft and external
links, virtual datasets and datasets with external storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from titans_hf.files import claim_output, hidden_sibling

FORMAT_VERSION = 1
META_FILE = "meta.json"
H5_SUFFIXES = (".h5", ".hdf5")
# Keys holding real numbers; every other key holds token ids or 0/1 masks and must be integral.
FLOAT_KEYS = frozenset({"rewards"})
METADATA_FIELDS = ("train_type", "tokenizer", "vocab_size", "eos_token_id", "pad_token_id", "tokenizer_fingerprint")
# gzip / deflate, the strongest filter HDF5 ships, expands at most ~1032x: an h5 segment that declares more
# bytes than this many times what it stores declares data it does not hold.
MAX_H5_EXPANSION = 1032
# Arrow columns and torch tensors hold ids as int32: a larger id would wrap negative.
MAX_TOKEN_ID = 2**31 - 1
# The largest |reward| a store may hold. GRPO's advantages (`titans_hf.training.preference.group_advantages`) subtract a
# group's mean and divide by its standard deviation, in float32 like the log-probabilities (largest value 3.4e38):
# two rewards of 3e38 already sum to inf and make the whole group NaN. Within +-1e9 every deviation from the mean is
# below 2e9, its square below 4e18, and a sum of such squares stays below 3.4e38 for groups of up to 8e19 responses,
# more than any store holds; the group sums behind the mean are smaller still. Rewards are scores: 1e9 takes any scale.
MAX_ABS_REWARD = 1e9
# A key names a file (`<key>.bin`) or an HDF5 group: a plain name, never a path.
KEY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Values per block when a whole key is scanned or hashed.
_SCAN_VALUES = 1 << 22


def key_kind(key: str) -> str:
    """What a key holds: "float" (rewards), "mask" (0/1 per token: names ending in mask/masks) or "token" (ids)."""
    if key in FLOAT_KEYS:
        return "float"
    return "mask" if key.endswith(("mask", "masks")) else "token"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every id: halves the store for vocabularies up to 65536."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return is_int(value) or isinstance(value, (float, np.floating))


def _is_format_version(value: Any) -> bool:
    return is_int(value) and int(value) == FORMAT_VERSION


def _checked_key_name(key: Any, where: Any) -> str:
    if not isinstance(key, str) or not KEY_NAME.fullmatch(key):
        raise ValueError(
            f"{where}: key {key!r} is not a plain name (letters, digits, '_' and '-', not starting with '-'); "
            "a key names a file or group inside the store, never a path"
        )
    return key


def _checked_dtype(dtype: Any, key: str, where: Any) -> np.dtype:
    try:
        parsed = np.dtype(dtype)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: key {key!r} has unknown dtype {dtype!r}") from error
    if key_kind(key) == "float":
        if parsed.kind not in "iuf":
            raise ValueError(f"{where}: key {key!r} has dtype {parsed}; it needs a numeric dtype")
    elif parsed.kind not in "iu":
        raise ValueError(f"{where}: key {key!r} has dtype {parsed}; token and mask keys need an integer dtype")
    if not parsed.isnative:
        order = "big" if parsed.byteorder == ">" else "little"
        raise ValueError(
            f"{where}: key {key!r} has dtype {parsed.str} ({order}-endian); stores hold values in this machine's "
            "native byte order only"
        )
    return parsed


@dataclass(frozen=True)
class ValueRule:
    """The values one key may hold: within the finite bounds `[low, high]`; `why` says so in messages."""

    low: float
    high: float
    why: str

    def allows(self, low: Any, high: Any) -> bool:
        """Whether values whose minimum is `low` and maximum `high` all follow the rule (NaN never does: it compares
        false; a Python int of any size compares exactly)."""
        return bool(self.low <= low and high <= self.high)

    def first_violation(self, values: np.ndarray) -> int:
        """Index of the first value breaking the rule (call only when some value does)."""
        return int(np.flatnonzero(~((values >= self.low) & (values <= self.high)))[0])

    def within(self, low: Any, high: Any, where: Any) -> "ValueRule":
        """The narrower rule a recorded range `[low, high]` sets: reads outside it contradict the metadata."""
        return ValueRule(low, high, f"outside [{low}, {high}], the range {where} records for it")


def value_rule(key: str, dtype: np.dtype, vocab_size: int | None, where: Any) -> ValueRule:
    """What `key` of `dtype` may hold in a store of `vocab_size` ids; a dtype too narrow for the vocabulary is an error."""
    kind = key_kind(key)
    if kind == "float":
        return ValueRule(-MAX_ABS_REWARD, MAX_ABS_REWARD,
                         f"not a finite number in [{-MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}] (MAX_ABS_REWARD: larger "
                         "rewards overflow GRPO's advantages in float32)")
    if kind == "mask":
        return ValueRule(0, 1, "outside [0, 1]: a mask holds 0 or 1")
    type_max = int(np.iinfo(dtype).max)
    if vocab_size is None:
        high = min(type_max, MAX_TOKEN_ID)
        reason = "ids Arrow and torch can hold as int32" if high == MAX_TOKEN_ID else f"ids {dtype} holds"
        return ValueRule(0, high, f"outside [0, {high}], the {reason}")
    if type_max < vocab_size - 1:
        raise ValueError(
            f"{where}: key {key!r} has dtype {dtype}, which holds ids up to {type_max} only, "
            f"but vocab_size is {vocab_size}; ids above {type_max} cannot have been stored intact"
        )
    high = min(vocab_size - 1, MAX_TOKEN_ID)
    return ValueRule(0, high, f"outside [0, {high}], the ids vocab_size {vocab_size} allows")


def _checked_metadata(metadata: dict[str, Any], where: Any) -> dict[str, Any]:
    """The metadata fields, with types and id ranges checked; absent fields are None."""
    checked = {field: metadata.get(field) for field in METADATA_FIELDS}
    for field in ("train_type", "tokenizer", "tokenizer_fingerprint"):
        if checked[field] is not None and not isinstance(checked[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {checked[field]!r}")
    vocab_size = checked["vocab_size"]
    if vocab_size is not None and (not is_int(vocab_size) or not 0 < vocab_size <= MAX_TOKEN_ID + 1):
        raise ValueError(f"{where}: vocab_size must be a positive integer up to {MAX_TOKEN_ID + 1} (ids up to "
                         f"{MAX_TOKEN_ID}), got {vocab_size!r}")
    for field in ("eos_token_id", "pad_token_id"):
        value = checked[field]
        if value is None:
            continue
        if not is_int(value) or not 0 <= value <= MAX_TOKEN_ID:
            raise ValueError(f"{where}: {field} must be a token id (an integer in [0, {MAX_TOKEN_ID}]), got {value!r}")
        if vocab_size is not None and value >= vocab_size:
            raise ValueError(f"{where}: {field} {value} is not below vocab_size {vocab_size}")
    return {field: int(value) if is_int(value) else value for field, value in checked.items()}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what makes a tokenizer's ids mean what they mean: its vocabulary (every token and its id, added
    tokens included) and its special tokens. Recorded by `prepare` in a store's metadata, compared with the
    model's tokenizer before training or evaluating on the store (two tokenizers of one vocab size still differ
    here)."""
    payload = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
               "special": sorted(str(token) for token in tokenizer.all_special_tokens)}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8")).hexdigest()


def check_store_tokenizer(store: "TokenStore", tokenizer: Any, what: str = "the model's tokenizer") -> None:
    """Refuse a store prepared with another tokenizer than `tokenizer`, naming the store: by the vocabulary size
    and the fingerprint it records. A store that records no fingerprint is refused too (as one that records
    another is): nothing in it shows which tokenizer its ids belong to, and ids in range of another vocabulary of
    the same size would train on the wrong tokens without a word. `titans-hf prepare` records both."""
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    recorded_size, recorded = store.metadata.get("vocab_size"), store.metadata.get("tokenizer_fingerprint")
    if recorded_size is not None and recorded_size != len(tokenizer):
        raise ValueError(f"{store.path}: prepared with tokenizer {store.metadata.get('tokenizer')!r} of "
                         f"{recorded_size} tokens, but {what} ({name}) has {len(tokenizer)}: the ids would mean other "
                         "tokens; prepare the store again with this tokenizer")
    if recorded is None:
        raise ValueError(f"{store.path}: records no tokenizer_fingerprint, so nothing shows that its ids were made by "
                         f"{what} ({name}); prepare the store again with this tokenizer (titans-hf prepare records "
                         "its fingerprint)")
    if recorded != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"{store.path}: prepared with tokenizer {store.metadata.get('tokenizer')!r}, whose "
                         f"vocabulary differs from {what} ({name}) though both have {len(tokenizer)} tokens "
                         "(tokenizer_fingerprint differs): the ids would mean other tokens; prepare the store again "
                         "with this tokenizer")


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


def key_checksum(values_digest: "hashlib._Hash", offsets: Any) -> str:
    """sha256 of a key's values as stored (its dtype, native byte order), then its offsets as little-endian int64.

    `values_digest` has seen the values; a copy of it is finished, so the caller's hash is left as it was.
    """
    digest = values_digest.copy()
    digest.update(np.asarray(offsets, dtype="<i8").tobytes())
    return digest.hexdigest()


def _inside(file: Path, root: Path) -> None:
    """Refuse a file (a link, typically) that resolves to somewhere outside the store directory `root`."""
    resolved = file.resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"{file}: is a link to {resolved}, outside the store {root}; a store's files must lie inside it")


@contextlib.contextmanager
def _hdf5_errors(where: Any) -> Iterator[None]:
    """h5py reports a truncated or damaged file as a bare OSError (or RuntimeError/KeyError): name the file."""
    try:
        yield
    except (OSError, RuntimeError, KeyError) as error:
        raise ValueError(f"{where}: cannot read the HDF5 data ({error}); the file may be truncated or damaged") from error


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
    """What both backends share: segment offsets per key, checked reads of flat token ranges, ranges, checksums.

    Subclasses call `_add_key` for every key at open (after `metadata` is set) and implement `_read`
    (a range of one key), `_blocks` (a whole key in order, for scans) and `_where` (a key's file).
    """

    format: str
    path: Path
    metadata: dict[str, Any]

    def _start_keys(self) -> None:
        self.dtypes: dict[str, np.dtype] = {}
        self._offsets: dict[str, np.ndarray] = {}
        self._rules: dict[str, ValueRule] = {}
        self._ranges: dict[str, tuple[Any, Any] | None] = {}
        self._checksums: dict[str, str] = {}

    def _add_key(self, key: str, dtype: np.dtype, offsets: np.ndarray, recorded: dict[str, Any], where: Any) -> None:
        """Register a key: check its recorded range against what it may hold and keep the rule reads follow."""
        rule = value_rule(key, dtype, self.metadata["vocab_size"], where)
        low, high = recorded.get("min"), recorded.get("max")
        if (low is None) != (high is None):
            raise ValueError(f"{where}: key {key!r} records only one of 'min' and 'max'")
        if low is not None:
            number = _is_number if key_kind(key) == "float" else is_int
            if not (number(low) and number(high)) or low > high:
                raise ValueError(f"{where}: key {key!r} records the range [{low!r}, {high!r}], which is not a range of its values")
            if not rule.allows(low, high):
                raise ValueError(f"{where}: key {key!r} records values [{low}, {high}], {rule.why}")
            self._ranges[key] = (low, high)
            rule = rule.within(low, high, where)
        elif offsets[-1] == 0:
            self._ranges[key] = None
        checksum = recorded.get("sha256")
        if checksum is not None:
            if not (isinstance(checksum, str) and _SHA256.fullmatch(checksum)):
                raise ValueError(f"{where}: key {key!r} records sha256 {checksum!r}, which is not 64 hex digits")
            self._checksums[key] = checksum
        self.dtypes[key], self._offsets[key], self._rules[key] = dtype, offsets, rule

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
        """A copy of the flat range `[start, stop)` of `key`, crossing segment boundaries if asked, values checked."""
        length = self.total_length(key)
        if not 0 <= start <= stop <= length:
            raise IndexError(f"{self.path}: range [{start}, {stop}) outside key {key!r} of length {length}")
        return self._checked(key, self._read(key, start, stop), start)

    def segment(self, key: str, index: int) -> np.ndarray:
        count = self.num_segments(key)
        if not -count <= index < count:
            raise IndexError(f"{self.path}: segment {index} outside key {key!r} with {count} segments")
        offsets = self.offsets(key)
        index %= count
        start = int(offsets[index])
        return self._checked(key, self._read(key, start, int(offsets[index + 1])), start)

    def value_range(self, key: str) -> tuple[Any, Any] | None:
        """`(min, max)` of `key`'s values, None when it holds none: as recorded, else found by one scan (then kept)."""
        key = self._known(key)
        if key not in self._ranges:
            low = high = None
            for start, block in self._blocks(key):
                if block.size:
                    block_low, block_high = block.min(), block.max()
                    if not self._rules[key].allows(block_low, block_high):
                        self._checked(key, block, start)  # raises, naming the first bad value
                    low = block_low if low is None else min(low, block_low)
                    high = block_high if high is None else max(high, block_high)
            self._ranges[key] = None if low is None else (low.item(), high.item())
        return self._ranges[key]

    def checksum(self, key: str) -> str:
        """`key_checksum` of `key`: as recorded at prepare, else computed from the data (then kept)."""
        key = self._known(key)
        if key not in self._checksums:
            self._checksums[key] = self._computed_checksum(key)
        return self._checksums[key]

    def _computed_checksum(self, key: str) -> str:
        digest = hashlib.sha256()
        for _, block in self._blocks(key):
            digest.update(np.ascontiguousarray(block).data)
        return key_checksum(digest, self.offsets(key))

    def verify_checksums(self) -> None:
        """Hash every key's data and compare it with the sha256 recorded at prepare: a store whose files were
        edited after prepare (sizes and mtimes kept or not) is a ValueError naming the file. One full read."""
        for key in self.keys:
            recorded = self._checksums.get(key)
            if recorded is not None and self._computed_checksum(key) != recorded:
                raise ValueError(f"{self._where(key)}: its data does not match the sha256 recorded for key {key!r} at "
                                 "prepare: the store was changed after it was written; prepare it again")

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

    def _check_float_keys(self) -> None:
        """Check every value of the float keys against their rules (see the module docstring); call at open."""
        for key in self.keys:
            if key_kind(key) == "float":
                for start, block in self._blocks(key):
                    self._checked(key, block, start)
        self.close()

    def _check_not_empty(self) -> None:
        if not self.dtypes or all(self.total_length(key) == 0 for key in self.dtypes):
            raise ValueError(f"{self.path}: empty store, it holds no tokens")

    def _checked(self, key: str, values: np.ndarray, start: int) -> np.ndarray:
        """`values` (flat positions `start`, ...) if all follow the key's rule; else a ValueError at the first one,
        naming its position and record (segment: a grpo group's rewards are one record, one training row)."""
        if values.size == 0:
            return values
        rule = self._rules[key]
        if rule.allows(values.min(), values.max()):
            return values
        position = start + rule.first_violation(values)
        record = int(np.searchsorted(self.offsets(key), position, side="right")) - 1
        raise ValueError(f"{self._where(key)}: key {key!r} holds {values[position - start]} at position {position}, "
                         f"{rule.why} (record {record})")

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    def _blocks(self, key: str) -> Iterator[tuple[int, np.ndarray]]:
        raise NotImplementedError

    def _where(self, key: str) -> str:
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
        root = self.path.resolve()
        _inside(meta_path, root)
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{meta_path}: not valid JSON ({error})") from error
        if not isinstance(meta, dict):
            raise ValueError(f"{meta_path}: must hold a JSON object, got {type(meta).__name__}")
        for field in ("format_version", "keys"):
            if field not in meta:
                raise ValueError(f"{meta_path}: missing field {field!r}")
        if not _is_format_version(meta["format_version"]):
            raise ValueError(
                f"{meta_path}: format_version {meta['format_version']!r} is not supported (expected {FORMAT_VERSION})"
            )
        if not isinstance(meta["keys"], dict):
            raise ValueError(f"{meta_path}: field 'keys' must map key names to {{dtype, length, offsets}}")
        self.metadata = _checked_metadata(meta, meta_path)
        self._start_keys()
        self._files: dict[str, Path] = {}
        for key, entry in meta["keys"].items():
            _checked_key_name(key, meta_path)
            missing = [field for field in ("dtype", "length", "offsets") if not isinstance(entry, dict) or field not in entry]
            if missing:
                raise ValueError(f"{meta_path}: key {key!r} is missing field(s) {missing}")
            length = entry["length"]
            if not is_int(length) or length < 0:
                raise ValueError(f"{meta_path}: key {key!r} has length {length!r}; it must be a non-negative integer")
            dtype = _checked_dtype(entry["dtype"], key, meta_path)
            offsets = _checked_offsets(entry["offsets"], length, key, meta_path)
            file = self.path / f"{key}.bin"
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing; {META_FILE} lists key {key!r}")
            _inside(file, root)
            size, expected = file.stat().st_size, length * dtype.itemsize
            if size != expected:
                raise ValueError(
                    f"{file}: is {size} bytes but {META_FILE} promises {expected} "
                    f"({length} x {dtype}); the file is {'shorter' if size < expected else 'longer'} than meta says"
                )
            self._files[key] = file
            self._add_key(key, dtype, offsets, entry, meta_path)
        self._check_not_empty()
        self._maps: dict[str, np.memmap] = {}
        self._bytes_since_release = 0
        self._check_float_keys()

    def _map(self, key: str) -> np.memmap:
        return np.memmap(self._files[key], dtype=self.dtypes[key], mode="r", shape=(self.total_length(key),))

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        if stop == start:
            return np.empty(0, self.dtypes[key])
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = self._maps[key] = self._map(key)
        values = np.array(mapped[start:stop])
        self._bytes_since_release += values.nbytes
        if self._bytes_since_release >= self.release_after_bytes:
            self.close()
        return values

    def _blocks(self, key: str) -> Iterator[tuple[int, np.ndarray]]:
        length = self.total_length(key)
        if length == 0:
            return
        mapped = self._map(key)  # a map of its own, dropped when the scan ends
        for start in range(0, length, _SCAN_VALUES):
            yield start, mapped[start : start + _SCAN_VALUES]

    def _where(self, key: str) -> str:
        return str(self._files[key])

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
        self._start_keys()
        self._segment_names: dict[str, list[str]] = {}
        with _hdf5_errors(self.path), h5py.File(self.path, "r") as file:
            link = file.visititems_links(self._foreign_link)
            if link is not None:
                raise ValueError(link)
            version = _plain(file.attrs.get("format_version"))
            if version is None:
                raise ValueError(f"{self.path}: missing attribute 'format_version'")
            if not _is_format_version(version):
                raise ValueError(f"{self.path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
            self.metadata = _checked_metadata({field: _plain(file.attrs.get(field)) for field in METADATA_FIELDS}, self.path)
            for key, group in file.items():
                self._index_group(key, group)
        self._check_not_empty()
        self._file: h5py.File | None = None
        self._file_pid = -1
        self._shared: dict[str, Any] = {}
        self._check_float_keys()
        if share_memory:
            self._share_memory()

    def _foreign_link(self, name: str, link: Any) -> str | None:
        """A message for a soft or external link (they may point anywhere), None for an ordinary member."""
        if isinstance(link, h5py.HardLink):
            return None
        target = f"{link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink) else getattr(link, "path", "?")
        return f"{self.path}:/{name}: is a {type(link).__name__} to {target}; a store holds its own data and links are refused"

    def _index_group(self, key: str, group: Any) -> None:
        where = f"{self.path}:/{key}"
        _checked_key_name(key, self.path)
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
            layout = dataset.id.get_create_plist()
            if layout.get_layout() == h5py.h5d.VIRTUAL or layout.get_external_count():
                kind = "a virtual dataset" if layout.get_layout() == h5py.h5d.VIRTUAL else "stored in external files"
                raise ValueError(f"{where}/{name}: is {kind}; a store holds its own data")
            declared, stored = dataset.shape[0] * dataset.dtype.itemsize, dataset.id.get_storage_size()
            if declared and (stored == 0 or (declared > stored and not layout.get_nfilters())
                             or declared > stored * MAX_H5_EXPANSION):
                raise ValueError(f"{where}/{name}: declares {dataset.shape[0]} values ({declared} bytes) but stores "
                                 f"{stored} bytes; a store holds the data it declares")
            if dtype is not None and dataset.dtype != dtype:
                raise ValueError(f"{where}/{name}: dtype {dataset.dtype} differs from earlier segments' {dtype}")
            dtype = dataset.dtype
            lengths.append(dataset.shape[0])
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        recorded = {field: _plain(group.attrs.get(field)) for field in ("min", "max", "sha256")}
        dtype = _checked_dtype(dtype if dtype is not None else np.uint32, key, self.path)
        self._add_key(key, dtype, offsets, recorded, where)
        self._segment_names[key] = names

    def _handle(self) -> h5py.File:
        # An HDF5 handle inherited through fork is not safe to use: each process opens its own.
        if self._file is None or self._file_pid != os.getpid():
            with _hdf5_errors(self.path):
                self._file = h5py.File(self.path, "r")
            self._file_pid = os.getpid()
        return self._file

    def _share_memory(self) -> None:
        import torch

        for key in self.keys:
            flat = np.empty(self.total_length(key), self.dtypes[key])
            offsets = self.offsets(key)
            group = self._handle()[key]
            with _hdf5_errors(self._where(key)):
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
        with _hdf5_errors(self._where(key)):
            while index < len(offsets) - 1 and offsets[index] < stop:
                begin, end = max(start, offsets[index]), min(stop, offsets[index + 1])
                if end > begin:
                    pieces.append(group[self._segment_names[key][index]][begin - offsets[index] : end - offsets[index]])
                index += 1
        if not pieces:
            return np.empty(0, self.dtypes[key])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _blocks(self, key: str) -> Iterator[tuple[int, np.ndarray]]:
        offsets = self.offsets(key)
        if key in self._shared:
            for start in range(0, self.total_length(key), _SCAN_VALUES):
                yield start, self._shared[key][start : start + _SCAN_VALUES].numpy()
            return
        group = self._handle()[key]
        for index, name in enumerate(self._segment_names[key]):
            with _hdf5_errors(self._where(key)):
                values = group[name][()]
            yield int(offsets[index]), values

    def _where(self, key: str) -> str:
        return f"{self.path}:/{key}"

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
        return value.decode(errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


STORE_CLASSES: dict[str, type[TokenStore]] = {"h5": H5Store, "bin": MmapStore}


def open_store(path: str | Path, **kwargs: Any) -> TokenStore:
    """Open the store at `path` (an `.h5` file, a bin store directory, or its `meta.json`/`.bin` file)."""
    return STORE_CLASSES[detect_format(path)](path, **kwargs)


def replaceable_store_problem(path: str | Path) -> str | None:
    """None when `path` is a store a `StoreWriter` wrote (what `prepare(overwrite=True)` may replace), else why not
    (`store_layout_problem`). A store found replaceable is claimed as it is for this thread's final rename
    (`titans_hf.files.claim_output`): that rename replaces this very store, or refuses."""
    problem = store_layout_problem(path)
    if problem is None:
        claim_output(path, verify=store_layout_problem)
    return problem


def store_layout_problem(path: str | Path) -> str | None:
    """None when `path` has the exact layout of a store a `StoreWriter` wrote, else why not.

    Judged by the exact layout, never by the name: a bin store is a directory (not a link) holding
    exactly `meta.json`, with this `format_version` and plain key names, and the `<key>.bin` files
    it lists, all plain files; an h5 store is an HDF5 file (not a link) with this `format_version`
    attribute whose members are groups with plain key names. Anything else holds someone's files.
    """
    path = Path(path)
    if path.is_symlink():
        return "it is a symbolic link"
    if path.is_dir():
        names = sorted(entry.name for entry in path.iterdir())
        meta_path = path / META_FILE
        if META_FILE not in names or meta_path.is_symlink() or not meta_path.is_file():
            return f"it is a directory without a {META_FILE} of its own"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return f"its {META_FILE} is not valid JSON"
        if not (isinstance(meta, dict) and _is_format_version(meta.get("format_version")) and isinstance(meta.get("keys"), dict)):
            return f"its {META_FILE} is not a token store's (format_version {FORMAT_VERSION} and keys)"
        keys = list(meta["keys"])
        if not all(isinstance(key, str) and KEY_NAME.fullmatch(key) for key in keys):
            return f"its {META_FILE} lists keys that are not plain names"
        expected = sorted([META_FILE, *(f"{key}.bin" for key in keys)])
        if names != expected:
            extra, missing = sorted(set(names) - set(expected)), sorted(set(expected) - set(names))
            return f"it holds files its {META_FILE} does not list {extra[:5]}" if extra else f"it lacks {missing[:5]}"
        odd = [name for name in names if (path / name).is_symlink() or not (path / name).is_file()]
        return f"{odd[:5]} are not plain files" if odd else None
    if not path.is_file():
        return "it is neither a regular file nor a directory"
    try:
        if not h5py.is_hdf5(path):
            return "it is neither a bin store directory nor an HDF5 store"
        with h5py.File(path, "r") as file:
            if not _is_format_version(_plain(file.attrs.get("format_version"))):
                return f"it is an HDF5 file without the store attribute format_version = {FORMAT_VERSION}"
            for name in file:
                if not (KEY_NAME.fullmatch(name) and isinstance(file.get(name, getlink=True), h5py.HardLink)
                        and isinstance(file[name], h5py.Group)):
                    return f"its member {name!r} is not a key group"
    except (OSError, RuntimeError, KeyError) as error:
        return f"it cannot be read as HDF5 ({error})"
    return None


class StoreWriter:
    """Writes a store under a temporary name; `finish` completes it, `abort` removes it.

    Segments are streamed: `append` extends the open segment of a key, `end_segment` closes it,
    so a document longer than RAM never has to exist whole. Values are checked as they come
    (`value_rule`: what a reader would refuse is never written) and each key's range and
    `key_checksum` are recorded. The caller renames the finished temporary path, so a store that
    is cut short never looks complete.
    """

    format: str

    def __init__(self, final_path: str | Path, dtypes: dict[str, Any], metadata: dict[str, Any]):
        self.final_path = Path(final_path)
        self.temp_path = hidden_sibling(self.final_path, "tmp")
        self.metadata = _checked_metadata(metadata, self.final_path)
        self.dtypes = {
            _checked_key_name(key, self.final_path): _checked_dtype(dtype, key, self.final_path) for key, dtype in dtypes.items()
        }
        self._rules = {key: value_rule(key, dtype, self.metadata["vocab_size"], self.final_path) for key, dtype in self.dtypes.items()}
        self._ranges: dict[str, list[Any] | None] = dict.fromkeys(self.dtypes)
        self._digests = {key: hashlib.sha256() for key in self.dtypes}
        self.lengths = dict.fromkeys(self.dtypes, 0)
        self.offsets: dict[str, list[int]] = {key: [0] for key in self.dtypes}

    @property
    def num_tokens(self) -> int:
        return max(self.lengths.values(), default=0)

    def append(self, key: str, values: np.ndarray) -> None:
        dtype = self.dtypes[key]
        values = np.asarray(values)
        bounds = None  # integer keys: the range, measured once (the cast below is then exact)
        if values.size and dtype.kind in "iu":
            if values.dtype.kind not in "iub":
                raise ValueError(f"{self.final_path}: key {key!r} holds integers, got values of dtype {values.dtype}")
            info = np.iinfo(dtype)
            bounds = int(values.min()), int(values.max())
            if bounds[0] < info.min or bounds[1] > info.max:
                raise ValueError(f"{self.final_path}: key {key!r} value range [{bounds[0]}, {bounds[1]}] does not "
                                 f"fit {dtype}")
        values = values.astype(dtype, copy=False)
        if values.size:
            low, high = bounds if bounds is not None else (values.min().item(), values.max().item())
            rule = self._rules[key]
            if not rule.allows(low, high):
                raise ValueError(f"{self.final_path}: key {key!r} value {values[rule.first_violation(values)]} is {rule.why}")
            seen = self._ranges[key]
            self._ranges[key] = [low, high] if seen is None else [min(seen[0], low), max(seen[1], high)]
        self._digests[key].update(np.ascontiguousarray(values).data)
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

    def _recorded(self, key: str) -> dict[str, Any]:
        """What the store records for `key` beyond its values: range (None when empty) and checksum."""
        low, high = self._ranges[key] or (None, None)
        return {"min": low, "max": high, "sha256": key_checksum(self._digests[key], self.offsets[key])}

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
            key: {"dtype": self.dtypes[key].name, "length": self.lengths[key], "offsets": self.offsets[key], **self._recorded(key)}
            for key in self.dtypes
        }
        meta = {"format_version": FORMAT_VERSION, **self.metadata, "keys": keys}
        (self.temp_path / META_FILE).write_text(json.dumps(meta), encoding="utf-8")

    def _close(self) -> None:
        for handle in self._handles.values():
            handle.close()


class H5StoreWriter(StoreWriter):
    format = "h5"

    def __init__(self, final_path: str | Path, dtypes: dict[str, Any], metadata: dict[str, Any]):
        super().__init__(final_path, dtypes, metadata)
        self._file = h5py.File(self.temp_path, "w-")  # created exclusively: never through what lies there
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
        for key, group in self._groups.items():
            for field, value in self._recorded(key).items():
                if value is not None:
                    group.attrs[field] = value
        self._close()

    def _close(self) -> None:
        if self._file.id.valid:
            self._file.close()


STORE_WRITERS: dict[str, type[StoreWriter]] = {"h5": H5StoreWriter, "bin": MmapStoreWriter}


def output_format(path: str | Path) -> str:
    """The format a new store at `path` gets: `.h5`/`.hdf5` files are HDF5, anything else a bin directory."""
    return "h5" if Path(path).suffix in H5_SUFFIXES else "bin"
