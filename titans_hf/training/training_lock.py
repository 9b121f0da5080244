"""The training lock: one run at a time trains into an output_dir.

A run holds `output_dir/.titans_hf_train.lock` (an flock, released when its process ends however it ends; the file
is removed when the run ends) from before the Trainer's `train` to its end: a second run into the same output_dir is
refused, naming the lock and its holder, instead of both overwriting each other's checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".titans_hf_train.lock"


@contextlib.contextmanager
def training_lock(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold `output_dir/.titans_hf_train.lock` for the `with` block (creating output_dir); a RuntimeError naming the
    lock and its holder when another run holds it. The lock is only ever a plain file of its own (`_open_lock`): what
    lies there is never written through."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    while True:
        handle = _open_lock(path)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = " ".join(handle.read(100).split()) or "another process"
            handle.close()
            raise RuntimeError(f"{path}: held by {holder}: another run is training into output_dir {folder}; two "
                               "runs there would overwrite each other's checkpoints (give this one another "
                               "output_dir)") from None
        if _is_at(handle, path):
            break
        handle.close()  # the run that held it removed it as we opened it: take the new one
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()}\n")
    handle.flush()
    try:
        yield
    finally:
        _release_lock(handle)


def _lock_problem(status: os.stat_result) -> str | None:
    """What a training lock with this `lstat` / `fstat` is, when it is not a plain file with no other name."""
    if stat.S_ISLNK(status.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(status.st_mode):
        return "a folder"
    if not stat.S_ISREG(status.st_mode):
        return "not a plain file"
    return None if status.st_nlink == 1 else "a file with other names (hard links)"


def _open_lock(path: Path) -> Any:
    """The training lock at `path`, opened (created when absent) for reading and writing. Anything there but a plain
    file with no other name is refused, naming it: a link or a hard link could be a user's file, which the holder's
    line would replace. It is opened without following a link, so that none put there meanwhile is written through.
    """
    try:
        problem = _lock_problem(os.lstat(path))
    except FileNotFoundError:
        problem = None
    if problem is None:
        try:
            handle = open(path, "r+", encoding="utf-8", opener=lambda name, flags: os.open(
                name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NOCTTY, 0o666))
        except OSError as error:
            raise OSError(error.errno, f"{path}: cannot open the training lock ({error.strerror}); output_dir must "
                                       "be a folder this run can write") from None
        problem = _lock_problem(os.fstat(handle.fileno()))
        if problem is not None:
            handle.close()
    if problem is not None:
        raise FileExistsError(f"{path}: the training lock is {problem}, which titans_hf will not write into; remove "
                              "it or choose another output_dir")
    return handle


def _is_at(handle: Any, path: Path) -> bool:
    """Whether the open `handle` is the file at `path` (not one removed or replaced since it was opened)."""
    try:
        at_path = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(handle.fileno())
    return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)


def _release_lock(handle: Any) -> None:
    """Remove the run's lock file while still holding it, then release it (`training_lock` checks that the file it
    locked is still the one at the path, so a run starting meanwhile cannot hold a removed one). Whatever has
    taken its place at the path is left alone."""
    if _is_at(handle, Path(handle.name)):
        os.unlink(handle.name)
    handle.close()
