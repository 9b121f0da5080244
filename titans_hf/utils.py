"""Helpers every part of the package shares: one atomic write, one pad-id fallback, one check of output files,
one file hash."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """Write `path` through `write(temporary_path)` in the same folder, then rename it into place.

    An interrupted or failed write leaves `path` as it was (absent or the previous version), never half-written,
    and removes its temporary file. Returns `path`.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda temporary: Path(temporary).write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, value: Any) -> Path:
    """`atomic_write` of `value` as indented JSON with a final newline."""
    return atomic_write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def resolve_pad_token_id(tokenizer: Any = None, config: Any = None) -> int:
    """The id to pad with: the tokenizer's pad token, else its EOS (Qwen base tokenizers have no pad token), else
    the model config's pad, else its EOS. Raises ValueError naming what was looked at when none is an int."""
    candidates = [getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)]
    for candidate in candidates:
        if isinstance(candidate, list) and candidate:  # generation configs may list several EOS ids
            candidate = candidate[0]
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            return candidate
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    raise ValueError(f"no pad token id: tokenizer {name!r} has neither a pad nor an EOS token, and the model config "
                     "names none either; set tokenizer.pad_token")


def check_outputs(paths: list[Path], overwrite: bool) -> None:
    """Refuse, before any work, output files that exist (unless `overwrite`), that are folders, or whose folder
    cannot be made or written."""
    for path in paths:
        if path.is_dir():
            raise IsADirectoryError(f"output {path} is a folder; give a file name inside it")
        if path.exists() and not overwrite:
            raise FileExistsError(f"output {path} exists; pass --overwrite to replace it")
        existing = next(folder for folder in (path.parent, *path.parent.parents) if folder.exists())
        if not existing.is_dir():
            raise NotADirectoryError(f"output {path}: {existing} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"output {path}: folder {existing} is not writable")


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_output_dir(path: str | os.PathLike, names: tuple[str, ...]) -> Path:
    """The output folder for the files `names`, created if needed and checked writable before any long work: an
    existing file there, a folder that cannot be written, or a folder in place of one of `names` is an error
    naming it now rather than after the work."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"output {folder} is an existing file, not a folder for {', '.join(names)}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"output folder {folder} cannot be created: {error}") from error
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"output folder {folder} is not writable")
    for name in names:
        if (folder / name).is_dir():
            raise IsADirectoryError(f"output {folder / name} is a folder; it would be written as a file")
    return folder



def plain_backend_tokenizer(tokenizer: Any):
    """The fast tokenizer's Rust backend without truncation or padding, whatever state earlier calls left in it.

    A call like ``tokenizer(texts, truncation=True, max_length=n)`` leaves the backend truncating (and
    ``save_pretrained`` records it in tokenizer.json); code that encodes through the backend directly would then see
    cut encodings. A backend in that state is copied once per state and the copy's truncation and padding are
    switched off; the caller's tokenizer is never changed.
    """
    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        return backend
    key = (id(backend), json.dumps([backend.truncation, backend.padding], sort_keys=True, default=str))
    plain = _PLAIN_BACKENDS.get(tokenizer)
    if plain is None or plain[0] != key:
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
        plain = _PLAIN_BACKENDS[tokenizer] = (key, copy)
    return plain[1]


_PLAIN_BACKENDS: "weakref.WeakKeyDictionary[Any, tuple[tuple[int, str], Any]]" = weakref.WeakKeyDictionary()
