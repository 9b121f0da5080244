"""File writing shared by every part of the package: one atomic write (a fresh hidden name created exclusively
beside the output, then renamed into place, so a link lying at the output is replaced, never written through),
the claims that make a command take its output path once, JSON without NaN, one file hash, and the limit on the
characters one text may hold.

Claims. A command checks its outputs before any work (`titans_hf.outputs.check_outputs`, `check_folder_output`),
and those checks claim each output path for the thread that made them (`claim_output`): what lay there (its inode,
size and modification time) or that nothing did. The final rename (`install_output`, used by `atomic_write` and
`titans_hf.outputs.replace_outputs`) then replaces only that very thing: what it finds there is first renamed
aside to a fresh hidden name and compared with the claim; anything else (a file or folder that appeared while the
command ran, another run's output, a changed file) is put back and the command refuses, naming the path, its own
result removed. The new output is renamed in with no-replace semantics (`rename_no_replace`), so of two commands
writing one output at once, one wins and the other fails naming it. A path no check claimed is replaced as a plain
`os.replace` would (the manifests and checkpoints this tool rewrites in its own folders).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

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
    gives. The temporary name is fresh and created exclusively (`mkstemp`), and the rename (`install_output`)
    replaces what lies at `path` (a link included) without writing through it, and, when a check claimed `path`,
    only what the check saw there. Returns `path`.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{short_name(path.name)}.", suffix=".tmp")
    os.close(handle)
    try:
        write(temporary)
        give_umask_permissions(temporary)
        install_output(Path(temporary), path)
    except BaseException as error:
        if os.path.exists(temporary):
            os.unlink(temporary)
        message = disk_full_message(error, str(path)) if isinstance(error, OSError) else None
        if message:
            raise OSError(error.errno, message) from error
        raise
    return path


class Identity(NamedTuple):
    """What lies at a path, as far as a rename keeps it: which file (device, inode), its type, size and
    modification time (a file rewritten in place, a folder given or losing an entry, changes it)."""

    device: int
    inode: int
    mode: int
    size: int
    modified_ns: int


# {absolute output path: (what lay there when a check claimed it, or None for nothing; a further check of what is
# set aside, or None)} per thread: a command checks and writes its outputs in one thread, and two threads writing
# one output are two writers.
_claims = threading.local()


def identity_of(path: Path) -> Identity | None:
    """The `Identity` of what lies at `path`, not following a link (None when nothing does)."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    return Identity(status.st_dev, status.st_ino, stat.S_IFMT(status.st_mode), status.st_size, status.st_mtime_ns)


def _claim_table() -> dict[str, tuple[Identity | None, Callable[[Path], str | None] | None]]:
    if not hasattr(_claims, "table"):
        _claims.table = {}
    return _claims.table


def claim_output(path: str | os.PathLike, verify: Callable[[Path], str | None] | None = None) -> None:
    """Claim the output `path` for this thread as it is now (see the module's docstring): its final rename will
    replace only what lies there now, or nothing. `verify(set_aside_path)`, when given, is asked again of what is
    set aside at the end (a problem string refuses it): for a folder, whose files may change below its top level."""
    path = Path(path)
    _claim_table()[os.path.abspath(path)] = (identity_of(path), verify)


def _refusal(target: Path, what: str) -> FileExistsError:
    return FileExistsError(f"output {target}: {what} while this command ran; it is left as it is and "
                           "this command's result was not put in its place (nothing else was written)")


def _renameat2() -> Callable[..., int] | None:
    """Linux's renameat2 from the C library (glibc 2.28 or later), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


RENAMEAT2 = _renameat2()
AT_FDCWD = -100
RENAME_NOREPLACE = 1


def rename_no_replace(source: Path, target: Path) -> None:
    """Rename the file or folder `source` to `target`, which must not exist: FileExistsError naming `target` when
    something lies there, even something that appears at the same instant.

    On Linux, renameat2 with RENAME_NOREPLACE (one atomic step). Where that is missing or the file system does not
    support it: a file is hard-linked to `target` (a link fails when the name exists) and its old name removed; a
    folder gets `target` made as an empty folder first (mkdir fails when the name exists) and is then renamed onto
    it, which replaces an empty folder only: whatever is put into it meanwhile makes the rename fail."""
    if RENAMEAT2 is not None:
        if RENAMEAT2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target), RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise _refusal(target, "something was put there")
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
            raise OSError(code, f"cannot rename {source} to {target}: {os.strerror(code)}")
    try:
        if source.is_dir() and not source.is_symlink():
            os.mkdir(target)
            try:
                os.rename(source, target)
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(target)  # only when it is still the empty folder made above
                raise
        else:
            os.link(source, target, follow_symlinks=False)
            os.unlink(source)
    except (FileExistsError, IsADirectoryError, NotADirectoryError) as error:
        raise _refusal(target, "something was put there") from error
    except OSError as error:
        if error.errno == errno.ENOTEMPTY:
            raise _refusal(target, "something was put there") from error
        raise


def set_aside_claimed(path: Path) -> Path | None:
    """Rename what lies at the output `path` to a fresh hidden name beside it and return that name (None when
    nothing lies there), once it is shown to be what this thread's claim saw (and passes the claim's check).
    Anything else is put back and refused (FileExistsError naming `path`): something that appeared although the claim
    saw nothing (or there is no claim), or a changed file or folder."""
    expected, verify = _claim_table().get(os.path.abspath(path), (None, None))
    aside = hidden_sibling(path, "replaced")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    problem = "something was put there" if expected is None else None
    if problem is None and identity_of(aside) != expected:
        problem = "it changed"
    if problem is None and verify is not None:
        why = verify(aside)
        problem = None if why is None else f"it changed ({why})"
    if problem is not None:
        put_back(aside, path)
        raise _refusal(path, problem)
    return aside


def put_back(aside: Path, path: Path) -> None:
    """Rename the set-aside `aside` back to `path`; when something now lies at `path`, `aside` is kept and the
    error names both."""
    try:
        rename_no_replace(aside, path)
    except FileExistsError:
        raise FileExistsError(f"output {path}: something was put there while this command ran, and "
                              f"what lay there before is kept as {aside}") from None


def install_output(temporary: Path, target: Path) -> None:
    """Rename the finished `temporary` to the output `target`. When a check claimed `target`, in place of what it
    saw there only (`set_aside_claimed`), and the claim then holds the new output, so a second write by the same
    command replaces its own output only; an unclaimed `target` is replaced whatever it is, as `os.replace` does."""
    if os.path.abspath(target) not in _claim_table():
        os.replace(temporary, target)
        return
    aside = set_aside_claimed(target)
    try:
        rename_no_replace(temporary, target)
    except BaseException:
        if aside is not None:
            put_back(aside, target)
        raise
    if aside is not None:
        remove_path(aside)
    reclaim(target)


def reclaim(path: Path) -> None:
    """After installing `path`: the claim on it, if any, now holds what was installed."""
    key = os.path.abspath(path)
    table = _claim_table()
    if key in table:
        table[key] = (identity_of(path), table[key][1])


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
