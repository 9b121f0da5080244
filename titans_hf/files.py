"""File writing shared by every part of the package: one atomic write (a fresh hidden name created exclusively
beside the output, then renamed into place, so a link lying at the output is replaced, never written through),
JSON without NaN, one file hash, and the limit on the characters one text may hold."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The most bytes of an output's name that the hidden names beside it (temporaries, set-aside copies) repeat: with the
# dot, a tag and a random part they stay within the 255 bytes a file name may have, however long the output's name.
KEPT_NAME_BYTES = 200
# The most characters one text (a BABILong row's field, a .jsonl line, a stretch of text without a safe cut) may
# hold, about 4M tokens: tokenizing takes about 130 bytes of memory per character (measured: 7.9 GB for 60M
# characters with a byte-level BPE), so a tiny compressed file holding one huge text could otherwise exhaust the
# machine (seen: exit 134). The environment variable raises or lowers it.
MAX_TEXT_CHARACTERS_VARIABLE = "TITANS_HF_MAX_TEXT_CHARACTERS"
DEFAULT_MAX_TEXT_CHARACTERS = 1 << 24


def umask() -> int:
    """The process's umask: from /proc/self/status on Linux (reading it there changes nothing), else by setting
    it and putting it back (the only portable way; another thread creating a file in that instant would get 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_umask_permissions(path: str | os.PathLike) -> None:
    """Give `path` the permissions a plain `open` / `mkdir` would have under the user's umask (0666 or 0777 minus
    it): `mkstemp` and `mkdtemp` create 0600 / 0700, private whatever the umask says."""
    mode = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, mode & ~umask())


def disk_full_message(error: OSError, what: str) -> str | None:
    """A plain message for a full disk or quota (`what` names the output), None for any other OSError."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{what}: the disk is full (or over quota) ({error.strerror}); nothing was left behind, free space " \
               "and run again"
    return None


def max_text_characters() -> int:
    """The most characters one text may hold: $TITANS_HF_MAX_TEXT_CHARACTERS, else 2^24 (16,777,216)."""
    value = os.environ.get(MAX_TEXT_CHARACTERS_VARIABLE)
    if value is None:
        return DEFAULT_MAX_TEXT_CHARACTERS
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(f"${MAX_TEXT_CHARACTERS_VARIABLE}={value!r}: must be a positive whole number of characters")
    return limit


def short_name(name: str) -> str:
    """`name` cut to its first `KEPT_NAME_BYTES` bytes, for the hidden names made from it."""
    encoded = os.fsencode(name)
    return name if len(encoded) <= KEPT_NAME_BYTES else os.fsdecode(encoded[:KEPT_NAME_BYTES])


def hidden_sibling(path: Path, tag: str) -> Path:
    """A fresh hidden name beside `path` for its temporary or set-aside copy: `.NAME.TAG-PID-RANDOM`."""
    return path.with_name(f".{short_name(path.name)}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """Write `path` through `write(temporary_path)` in the same folder, then rename it into place.

    An interrupted or failed write leaves `path` as it was (absent or the previous version), never half-written,
    and removes its temporary file; a full disk is an OSError saying so. The file gets the permissions the umask
    gives. The temporary name is fresh and created exclusively (`mkstemp`), and the rename replaces whatever lies at
    `path` (a link included) without writing through it. Returns `path`.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{short_name(path.name)}.", suffix=".tmp")
    os.close(handle)
    try:
        write(temporary)
        give_umask_permissions(temporary)
        os.replace(temporary, path)
    except BaseException as error:
        if os.path.exists(temporary):
            os.unlink(temporary)
        message = disk_full_message(error, str(path)) if isinstance(error, OSError) else None
        if message:
            raise OSError(error.errno, message) from error
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda temporary: Path(temporary).write_text(text, encoding="utf-8"))


def json_safe(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, inf) replaced by None: JSON has no NaN, and a file
    holding a bare NaN is not JSON to most readers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def atomic_write_json(path: str | os.PathLike, value: Any) -> Path:
    """`atomic_write` of `value` as indented JSON with a final newline; NaN and inf are written as null."""
    return atomic_write_text(path, json.dumps(json_safe(value), indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree (nothing when absent)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
