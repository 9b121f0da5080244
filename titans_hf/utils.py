"""Helpers every part of the package shares: one atomic write, one way of replacing outputs, one record of what
this tool wrote (the outputs manifest), one pad-id fallback, one check of output files, one file hash, JSON without
NaN.

The rule for outputs, everywhere: an existing output is replaced only with `overwrite` (`--overwrite`), and even
then only when this tool wrote it. What it wrote is recorded in a manifest, `.titans_hf_outputs.json`, in the
output's folder: {name: {"command", "sha256"}} per file, and a folder-wide entry ({"folder": true}) for a folder
this tool wrote whole (a stand-in base). A file that is not listed, or whose bytes changed since (its sha256
differs), belongs to the user and is never replaced; file names (a `config.json`, a `results.json`) prove nothing.
Token stores are recognised by their exact layout instead (`titans_hf.data.stores.replaceable_store_problem`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

MANIFEST_NAME = ".titans_hf_outputs.json"
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


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """Write `path` through `write(temporary_path)` in the same folder, then rename it into place.

    An interrupted or failed write leaves `path` as it was (absent or the previous version), never half-written,
    and removes its temporary file; a full disk is an OSError saying so. The file gets the permissions the umask
    gives. Returns `path`.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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


def check_tokenizer_argument(name: str | os.PathLike, flag: str) -> None:
    """Refuse, before anything loads, a tokenizer (or model) argument that is neither an existing path nor a Hub
    id, naming `flag`: a missing local path otherwise surfaces as the Hub client's "Repo id must be in the
    form..." error."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(name).exists():
        return
    try:
        validate_repo_id(str(name))
    except HFValidationError:
        raise FileNotFoundError(f"{flag} {name}: no such file or folder (and not a Hub repository id)") from None
    if str(name).startswith((".", "~", os.sep)):
        raise FileNotFoundError(f"{flag} {name}: no such file or folder")


# ---- what this tool wrote: the outputs manifest ----

def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of `folder` ({} when there is none, or it is not one this tool wrote)."""
    path = Path(folder) / MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def record_outputs(folder: str | os.PathLike, names: Sequence[str], command: str) -> None:
    """Record in `folder`'s manifest that `command` wrote the files `names` there, as they are now."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    manifest.update({name: {"command": command, "sha256": file_sha256(folder / name)} for name in names})
    atomic_write_json(folder / MANIFEST_NAME, manifest)


def record_folder(folder: str | os.PathLike, command: str) -> None:
    """Record that `command` wrote the whole of `folder`: every file in it, by relative path, and a folder entry
    (what `replaceable_folder_problem` checks before `--overwrite` replaces the folder)."""
    folder = Path(folder)
    names = sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                   if path.is_file() and path.name != MANIFEST_NAME)
    atomic_write_json(folder / MANIFEST_NAME, {
        "folder": {"command": command},
        **{name: {"command": command, "sha256": file_sha256(folder / name)} for name in names}})


def unrecorded_reason(path: Path) -> str | None:
    """Why the file `path` is not one this tool wrote (None when its folder's manifest vouches for its bytes)."""
    entry = read_manifest(path.parent).get(path.name)
    if path.is_symlink() or not path.is_file():
        return "it is not a plain file"
    if not isinstance(entry, dict):
        return f"titans_hf did not write it (it is not listed in {path.parent / MANIFEST_NAME})"
    if entry.get("sha256") != file_sha256(path):
        return f"it changed since {entry.get('command', 'titans_hf')} wrote it"
    return None


def replaceable_folder_problem(folder: str | os.PathLike) -> str | None:
    """None when `folder` is exactly what this tool wrote there as a whole (`record_folder`): every file listed in
    its manifest with its recorded bytes, nothing else in it. Else why not."""
    folder = Path(folder)
    if folder.is_symlink():
        return "it is a symbolic link"
    if not folder.is_dir():
        return "it is not a folder"
    manifest = read_manifest(folder)
    if "folder" not in manifest:
        return f"it holds no {MANIFEST_NAME} saying titans_hf wrote the whole folder"
    listed = {name for name in manifest if name != "folder"}
    present = set()
    for path in folder.rglob("*"):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            return f"{path} is not a plain file or folder"
        if path.is_file() and path.name != MANIFEST_NAME:
            present.add(str(path.relative_to(folder)))
    if present - listed:
        return f"it holds files titans_hf did not write: {sorted(present - listed)[:5]}"
    changed = [name for name in sorted(present) if manifest[name].get("sha256") != file_sha256(folder / name)]
    if changed:
        return f"files changed since titans_hf wrote them: {changed[:5]}"
    return None


def _check_can_create(path: Path) -> None:
    """Refuse an output whose nearest existing folder above it is a file or cannot be written."""
    existing = next(folder for folder in path.parents if folder.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"output {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"output {path}: folder {existing} is not writable")


def check_outputs(paths: list[Path], overwrite: bool) -> None:
    """Refuse, before any work, output files that exist (unless `overwrite`, and then only files this tool wrote,
    per their folder's manifest), that are folders, or whose folder cannot be made or written."""
    for path in paths:
        if path.is_dir():
            raise IsADirectoryError(f"output {path} is a folder; give a file name inside it")
        if path.exists() or path.is_symlink():
            _check_replaceable(path, overwrite, unrecorded_reason)
        _check_can_create(path)


def check_folder_output(folder: Path, overwrite: bool) -> None:
    """Refuse, before any work, an existing output folder without `overwrite`, and with it any folder this tool
    did not write whole (`replaceable_folder_problem`): a user's folder is never replaced."""
    if not (folder.exists() or folder.is_symlink()):
        _check_can_create(folder)
        return
    _check_replaceable(folder, overwrite, replaceable_folder_problem)


def _check_replaceable(path: Path, overwrite: bool, problem_of: Callable[[Path], str | None]) -> None:
    """Refuse an existing output without `overwrite`, and with it one that `problem_of` says this tool may not
    replace."""
    if not overwrite:
        raise FileExistsError(f"output {path} exists; pass --overwrite to replace it")
    problem = problem_of(path)
    if problem is not None:
        raise FileExistsError(f"output {path}: will not replace it, even with --overwrite: {problem}; remove it "
                              "yourself or choose another output")


@contextlib.contextmanager
def writing_folder(folder: str | os.PathLike, overwrite: bool, command: str) -> Iterator[Path]:
    """The folder `command` writes whole, written in place (for outputs that record their own absolute paths, which
    a rename from a temporary name would break).

    An absent or empty folder is used as it is. An existing one needs `overwrite` and must be one this tool wrote
    whole (`check_folder_output`); it is set aside under a hidden name until the new one is complete. When the block
    ends the folder is recorded whole (`record_folder`) and the old one deleted; when it raises, what it wrote is
    deleted and the old folder put back: the command leaves all of its outputs or none.
    """
    folder = Path(folder)
    was_empty = folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())
    aside = None
    if not was_empty:
        check_folder_output(folder, overwrite)
        if folder.exists():
            aside = folder.with_name(f".{folder.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.replace(folder, aside)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        record_folder(folder, command)
    except BaseException:
        remove_path(folder)
        if aside is not None:
            os.replace(aside, folder)
        elif was_empty:
            folder.mkdir()
        raise
    if aside is not None:
        remove_path(aside)


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree (nothing when absent)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_outputs(finished: Sequence[Path], targets: Sequence[Path], replaced: Sequence[Path] = ()) -> None:
    """Rename the finished temporaries (files or folders) to their targets, in place of what lies there and of
    the older outputs `replaced` (e.g. shards a new run no longer writes).

    What is replaced is set aside first (a folder cannot be renamed over) and deleted only once every new output
    is in place; if a rename fails the new outputs go and the old ones come back, so a command either installs
    all of its outputs or none. The caller has checked that all of it may be replaced.
    """
    existing = list(dict.fromkeys([*replaced, *(target for target in targets
                                                 if target.exists() or target.is_symlink())]))
    set_aside = [path.with_name(f".{path.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}") for path in existing]
    for path, aside in zip(existing, set_aside):
        os.replace(path, aside)
    try:
        for temporary, target in zip(finished, targets):
            os.replace(temporary, target)
    except BaseException:
        for target in targets:
            remove_path(target)
        for path, aside in zip(existing, set_aside):
            os.replace(aside, path)
        raise
    for aside in set_aside:
        remove_path(aside)


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_output_dir(path: str | os.PathLike, names: tuple[str, ...], overwrite: bool = True) -> Path:
    """The output folder for the files `names`, created if needed and checked before any long work: an existing
    file there, a folder that cannot be written, or a folder in place of one of `names` is an error naming it now
    rather than after the work; so is an existing output of `names` without `overwrite`, or one this tool did not
    write (see `check_outputs`)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"output {folder} is an existing file, not a folder for {', '.join(names)}")
    check_outputs([folder / name for name in names], overwrite)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"output folder {folder} cannot be created: {error}") from error
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"output folder {folder} is not writable")
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
