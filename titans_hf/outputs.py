"""The outputs of the commands: what this tool wrote, and when an existing output may be replaced.

The rule for outputs, everywhere: an existing output is replaced only with `overwrite` (`--overwrite`), and even
then only when this tool wrote it. What it wrote is recorded in a manifest, `.titans_hf_outputs.json`, in the
output's folder (`MANIFEST_FORMAT`): the inode of the folder it was written in, {name: {"command", "sha256",
"inode"}} per file, and {"whole": {"command"}} for a folder this tool wrote (whole, as a toy base, or its
outputs in place, as the demo's, where a user's file may lie beside them; a subfolder among those outputs is the
command's whole, see `writing_folder`). A manifest vouches only for its own
folder and what this tool created there: one that came with a copied folder (another folder inode), an entry naming
a path outside the folder or (unless this tool wrote the folder) in a subfolder, and a file that is a link, another
file (another inode) or other bytes (another sha256) vouch for nothing. Inodes
and not device numbers: a copy always gets new inodes, while a device number may change when a file system is
mounted again (overlay, LVM, NFS). A file not vouched for belongs to the user and is never replaced; file names (a
`config.json`, a `results.json`) prove nothing. Token stores are recognised by their exact layout instead
(`titans_hf.data.stores.replaceable_store_problem`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from titans_hf.files import (
    atomic_write_json,
    claim_output,
    hidden_sibling,
    put_back,
    reclaim,
    remove_path,
    rename_no_replace,
    set_aside_claimed,
)

logger = logging.getLogger(__name__)

MANIFEST_NAME = ".titans_hf_outputs.json"
MANIFEST_FORMAT = 2
# The most bytes of a manifest that is read: far more than the few hundred files this tool writes into one folder.
MAX_MANIFEST_BYTES = 1 << 24


def _open_plain_file(path: Path) -> BinaryIO | None:
    """`path` opened for reading when it is a plain file, without following a link (None when it is not one)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        return None
    return os.fdopen(descriptor, "rb")


def _entry_name_allowed(name: str, whole: bool) -> bool:
    """Whether a manifest may vouch for `name`: a path relative to its folder without `.`, `..` or empty parts,
    naming a file in the folder itself, or in a subfolder when this tool wrote the folder whole."""
    parts = name.split("/")
    return all(part not in ("", ".", "..") for part in parts) and name != MANIFEST_NAME and (whole or len(parts) == 1)


def _entry_allowed(entry: Any) -> bool:
    """Whether a manifest entry has the fields `record_outputs` writes, with their types."""
    return (isinstance(entry, dict) and isinstance(entry.get("command"), str)
            and isinstance(entry.get("sha256"), str) and type(entry.get("inode")) is int)


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """What `folder`'s manifest vouches for: {"whole": {"command"} or None, "files": {name: entry}}.

    Nothing (no whole folder, no files) when there is no manifest, when it is a link, not a plain file, not JSON of
    `MANIFEST_FORMAT`, or was written in another folder (its folder inode is not this one's: it came with a copy).
    Entries that lack a field or name a path the manifest may not vouch for (`_entry_name_allowed`) are left out.
    """
    folder = Path(folder)
    nothing: dict[str, Any] = {"whole": None, "files": {}}
    handle = _open_plain_file(folder / MANIFEST_NAME)
    if handle is None:
        return nothing
    try:
        with handle:
            content = handle.read(MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(content) if len(content) <= MAX_MANIFEST_BYTES else None
        folder_inode = os.stat(folder).st_ino
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return nothing
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or manifest.get("folder_inode") != folder_inode or not isinstance(manifest.get("files"), dict)):
        return nothing
    whole = manifest.get("whole")
    whole = whole if isinstance(whole, dict) and isinstance(whole.get("command"), str) else None
    files = {name: entry for name, entry in manifest["files"].items()
             if _entry_name_allowed(name, whole is not None) and _entry_allowed(entry)}
    return {"whole": whole, "files": files}


def _write_manifest(folder: Path, whole: dict[str, str] | None, files: dict[str, Any]) -> None:
    """Write `folder`'s manifest, bound to the folder by its inode."""
    manifest = {"format": MANIFEST_FORMAT, "folder_inode": os.stat(folder).st_ino, "files": files}
    if whole is not None:
        manifest["whole"] = whole
    atomic_write_json(folder / MANIFEST_NAME, manifest)


def _plain_file_record(path: Path) -> dict[str, Any] | None:
    """{"sha256", "inode"} of `path` when it is a plain file, opened without following a link; else None."""
    handle = _open_plain_file(path)
    if handle is None:
        return None
    digest = hashlib.sha256()
    with handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
        return {"sha256": digest.hexdigest(), "inode": os.fstat(handle.fileno()).st_ino}


def _vouched(path: Path, entry: dict[str, Any]) -> bool:
    """Whether `path` is still the very file `entry` records: a plain file with its inode and its bytes."""
    record = _plain_file_record(path)
    return record is not None and record["inode"] == entry["inode"] and record["sha256"] == entry["sha256"]


def _record_of(path: Path, command: str) -> dict[str, Any]:
    """The manifest entry of the output `path` that `command` has just written."""
    record = _plain_file_record(path)
    if record is None:
        raise ValueError(f"output {path}: not a plain file, so not recorded as an output of {command}")
    return {"command": command, **record}


def record_outputs(folder: str | os.PathLike, names: Sequence[str], command: str) -> None:
    """Record in `folder`'s manifest that `command` wrote the files `names` there, as they are now."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    files = {**manifest["files"], **{name: _record_of(folder / name, command) for name in names}}
    _write_manifest(folder, manifest["whole"], files)


def record_folder(folder: str | os.PathLike, command: str) -> None:
    """Record that `command` wrote the whole of `folder`: every file in it, by relative path, and the whole folder
    (what `replaceable_folder_problem` checks before `--overwrite` replaces the folder)."""
    folder = Path(folder)
    names = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                   if path.is_file() and path != folder / MANIFEST_NAME)
    _write_manifest(folder, {"command": command}, {name: _record_of(folder / name, command) for name in names})


def unrecorded_reason(path: Path) -> str | None:
    """Why the file `path` is not one this tool wrote (None when its folder's manifest vouches for it)."""
    if path.is_symlink() or not path.is_file():
        return "it is not a plain file"
    entry = read_manifest(path.parent)["files"].get(path.name)
    if entry is None:
        return f"titans_hf did not write it (this folder's {MANIFEST_NAME} holds no record of it)"
    if not _vouched(path, entry):
        return f"it changed since {entry['command']} wrote it"
    return None


def _files_written_there(folder: Path, what: str) -> tuple[dict[str, Any], str | None]:
    """({name: recorded identity} of the files this tool recorded writing into `folder`, None), or ({}, why not):
    `folder` is a link, not a folder, or its manifest does not say this tool wrote `what` there."""
    if folder.is_symlink():
        return {}, "it is a symbolic link"
    if not folder.is_dir():
        return {}, "it is not a folder"
    manifest = read_manifest(folder)
    if manifest["whole"] is None:
        return {}, f"it holds no {MANIFEST_NAME} saying titans_hf wrote {what}"
    return manifest["files"], None


def replaceable_folder_problem(folder: str | os.PathLike) -> str | None:
    """None when `folder` is exactly what this tool wrote there as a whole (`record_folder`): every file listed in
    its manifest with its recorded identity and bytes, nothing else in it. Else why not."""
    folder = Path(folder)
    listed, problem = _files_written_there(folder, "the whole folder")
    if problem is not None:
        return problem
    present = []
    for path in folder.rglob("*"):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            return f"{path} is not a plain file or folder"
        if path.is_file() and path != folder / MANIFEST_NAME:
            present.append(path.relative_to(folder).as_posix())
    unlisted = sorted(name for name in present if name not in listed)
    if unlisted:
        return f"it holds files titans_hf did not write: {unlisted[:5]}"
    changed = [name for name in sorted(present) if not _vouched(folder / name, listed[name])]
    if changed:
        return f"files changed since titans_hf wrote them: {changed[:5]}"
    return None


def check_can_create(path: Path) -> None:
    """Refuse, naming it, an output whose nearest existing folder above it is a file or cannot be written."""
    existing = next(folder for folder in path.parents if folder.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"output {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"output {path}: folder {existing} is not writable")


def check_outputs(paths: list[Path], overwrite: bool) -> None:
    """Refuse, before any work, output files that exist (unless `overwrite`, and then only files this tool wrote,
    per their folder's manifest), that are folders, or whose folder cannot be made or written; names the manifest
    cannot record (its own, and one that is not UTF-8: JSON holds text, not bytes); and a folder whose manifest is a
    link or not a file (it would be replaced, or could not be). Each path is then claimed as it is
    (`titans_hf.files.claim_output`): its final rename replaces only what lies there now, or nothing."""
    for path in paths:
        if path.name == MANIFEST_NAME:
            raise ValueError(f"output {path}: {MANIFEST_NAME} is the name of titans_hf's record of the outputs it "
                             "wrote; choose another name")
        try:
            path.name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"output {str(path)!r}: its name is not valid UTF-8; choose a name that is") from None
        manifest = path.parent / MANIFEST_NAME
        if manifest.is_symlink() or manifest.exists() and not manifest.is_file():
            raise FileExistsError(f"output {path}: {manifest}, where titans_hf records the outputs it wrote, is not "
                                  "a plain file; remove it or choose another folder")
        if path.is_dir():
            raise IsADirectoryError(f"output {path} is a folder; give a file name inside it")
        if path.exists() or path.is_symlink():
            _check_replaceable(path, overwrite, unrecorded_reason)
        check_can_create(path)
        claim_output(path)


def check_folder_output(folder: Path, overwrite: bool) -> None:
    """Refuse, before any work, an existing output folder without `overwrite`, and with it any folder this tool
    did not write whole (`replaceable_folder_problem`): a user's folder is never replaced. The folder it is made
    or replaced in must be writable. The folder is then claimed as it is (`titans_hf.files.claim_output`): its
    final rename replaces only this folder, and only while it still is what this tool wrote, or nothing."""
    if folder.exists() or folder.is_symlink():
        _check_replaceable(folder, overwrite, replaceable_folder_problem)
    check_can_create(folder)
    claim_output(folder, verify=replaceable_folder_problem)


def _check_replaceable(path: Path, overwrite: bool, problem_of: Callable[[Path], str | None]) -> None:
    """Refuse an existing output without `overwrite`, and with it one that `problem_of` says this tool may not
    replace."""
    if not overwrite:
        raise FileExistsError(f"output {path} exists; pass --overwrite to replace it")
    problem = problem_of(path)
    if problem is not None:
        raise FileExistsError(f"output {path}: will not replace it, even with --overwrite: {problem}; remove it "
                              "yourself or choose another output")


def _outputs_present(folder: Path, outputs: Sequence[str]) -> tuple[list[Path], list[Path]]:
    """(the files at or under the outputs `outputs` of `folder` (each a file, a folder or absent), what lies under an
    output folder that is neither a plain file nor a folder: a link, which is not followed, a FIFO, ...)."""
    files: list[Path] = []
    others: list[Path] = []
    for path in (folder / name for name in outputs):
        if not path.is_dir() or path.is_symlink():
            if path.is_file():
                files.append(path)
            continue
        for below in sorted(path.rglob("*")):
            if below.is_symlink() or not (below.is_file() or below.is_dir()):
                others.append(below)
            elif below.is_file():
                files.append(below)
    return files, others


def _replaceable_outputs_problem(folder: str | os.PathLike, outputs: Sequence[str]) -> str | None:
    """None when a command that writes `outputs` (names of files and subfolders) into `folder` may do so in place of
    what an earlier run of this tool wrote there: the folder's manifest says this tool wrote it, every output of the
    earlier run in it (each file or subfolder its manifest lists) is still exactly what it wrote, and none of
    `outputs` is someone else's. Files beside them (a user's) are no reason: they are left alone. Else why not."""
    folder = Path(folder)
    listed, problem = _files_written_there(folder, "the folder")
    if problem is not None:
        return problem
    earlier = {name.split("/")[0] for name in listed}
    for name in sorted(earlier | set(outputs)):
        path = folder / name
        if not (path.exists() or path.is_symlink()):
            continue
        if name not in earlier:
            return f"{path} is not an output titans_hf wrote there"
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            return f"{path} is not a plain file or folder"
        present = []
        for below in [path, *(path.rglob("*") if path.is_dir() else ())]:
            if below.is_symlink() or not (below.is_file() or below.is_dir()):
                return f"{below} is not a plain file or folder"
            if below.is_file():
                present.append(below.relative_to(folder).as_posix())
        unlisted = [relative for relative in present if relative not in listed]
        if unlisted:
            return f"it holds files titans_hf did not write: {unlisted[:5]}"
        changed = [relative for relative in present if not _vouched(folder / relative, listed[relative])]
        if changed:
            return f"files changed since titans_hf wrote them: {changed[:5]}"
    return None


@contextlib.contextmanager
def writing_folder(folder: str | os.PathLike, overwrite: bool, command: str, *,
                   outputs: Sequence[str]) -> Iterator[Path]:
    """The folder `command` writes its `outputs` into, in place (for outputs that record their own absolute paths,
    which a rename from a temporary name would break). `outputs` are the names of the files and subfolders it writes
    there, each written whole: they are the command's, and nothing else in the folder is. A subfolder among them is
    the command's as a whole, as a file is: written in place by library code (a trainer, `save_pretrained`), the
    files the command puts in it and a file a user puts there meanwhile cannot be told apart, so every plain file
    under it when the block ends is recorded as the command's, and a failure removes the subfolder whole. What lies
    under it that is no plain file or folder (a link, a FIFO), which the command never writes, is not recorded: it is
    left where it is with a warning naming it, the finished outputs are kept, and a later `overwrite` refuses the
    folder until it is removed. A user's files belong beside the outputs, not inside them.

    An absent or empty folder is used as it is. An existing one needs `overwrite` and must be one this tool wrote,
    its earlier outputs as they were written and none of `outputs` someone else's (`_replaceable_outputs_problem`);
    the earlier outputs and their manifest are set aside under hidden names until the block ends. When it ends, the
    files under `outputs` are recorded (`command` wrote the folder, and these files) and the earlier outputs deleted;
    when it raises, the outputs it wrote go and the earlier ones come back: the command leaves all of its outputs or
    none. Anything beside the outputs, such as a file a user put into the folder while the command ran, is left as it
    is and never recorded, so a later `overwrite` keeps it too.
    """
    folder = Path(folder)
    for name in outputs:
        if not name or "/" in name or name in (".", "..", MANIFEST_NAME):
            raise ValueError(f"writing_folder: output {name!r} must be the name of a file or folder in {folder}")
    created = not (folder.exists() or folder.is_symlink())
    earlier: list[str] = []
    if not created and not (folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())):
        _check_replaceable(folder, overwrite, lambda path: _replaceable_outputs_problem(path, outputs))
        earlier = sorted({name.split("/")[0] for name in read_manifest(folder)["files"]})
    check_can_create(folder / MANIFEST_NAME)
    try:
        folder.mkdir(parents=True, exist_ok=not created)
    except FileExistsError:
        raise FileExistsError(f"output {folder}: something was put there while this command started; it is left "
                              "as it is and nothing was written") from None
    set_aside: dict[Path, Path] = {}
    try:
        for path in (folder / name for name in [*earlier, MANIFEST_NAME]):
            if path.exists() or path.is_symlink():
                aside = hidden_sibling(path, "replaced")
                os.replace(path, aside)
                set_aside[path] = aside
    except BaseException:
        for path, aside in set_aside.items():
            os.replace(aside, path)
        raise
    try:
        yield folder
        written, unrecordable = _outputs_present(folder, outputs)
        for path in unrecordable:
            logger.warning("%s: not a plain file or folder, so not an output of %s: left as it is and not recorded "
                           "(a later overwrite of %s refuses until it is removed)", path, command, folder)
        _write_manifest(folder, {"command": command}, {path.relative_to(folder).as_posix(): _record_of(path, command)
                                                       for path in written})
    except BaseException:
        for name in [*outputs, MANIFEST_NAME]:
            remove_path(folder / name)
        for path, aside in set_aside.items():
            os.replace(aside, path)
        if created and not any(folder.iterdir()):
            folder.rmdir()
        raise
    for aside in set_aside.values():
        remove_path(aside)


def replace_outputs(finished: Sequence[Path], targets: Sequence[Path], replaced: Sequence[Path] = ()) -> None:
    """Rename the finished temporaries (files or folders) to their targets, in place of what lies there and of
    the older outputs `replaced` (e.g. shards a new run no longer writes).

    Each target and older output is replaced only when a check claimed it (`check_outputs`, `check_folder_output`,
    `titans_hf.files.claim_output`) and it is still what the check saw; anything else there (something that appeared
    while the command ran, a change) is refused naming it, and so is any target taken by another writer meanwhile:
    the temporaries are renamed in with no-replace semantics (`titans_hf.files.rename_no_replace`). What is replaced
    is set aside first (a folder cannot be renamed over) and deleted only once every new output is in place; if a
    rename fails the new outputs go and the old ones come back, so a command either installs all of its outputs or
    none, and never removes what it did not claim. The caller removes its temporaries when this raises.
    """
    set_aside: dict[Path, Path] = {}
    installed: list[Path] = []
    try:
        for path in dict.fromkeys([*replaced, *targets]):
            aside = set_aside_claimed(path)
            if aside is not None:
                set_aside[path] = aside
        for temporary, target in zip(finished, targets):
            rename_no_replace(temporary, target)
            installed.append(target)
    except BaseException:
        for target in installed:
            remove_path(target)
        for path, aside in set_aside.items():
            put_back(aside, path)
        raise
    for aside in set_aside.values():
        remove_path(aside)
    for target in targets:
        reclaim(target)


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
