"""Hostile things where the commands write: a link, a hard link or a folder where the training lock goes, a manifest
that came with a copied folder or names what titans_hf did not write, output names the manifest cannot hold or too
long for a temporary name, a folder that cannot be written.

The rules they check: every file titans_hf writes is opened without following a link, under a fresh name created
exclusively, inside the folder it belongs to; a manifest vouches only for what this tool wrote in the very folder it
lies in; each refusal is one line naming the file. Each test checksums what it hands in and checks it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_trainer import make_trainer, rows  # noqa: F401  (rows is a fixture)

from titans_hf.commands import cli
from titans_hf.commands import main as cli_main
from titans_hf.files import atomic_write_json, claim_output
from titans_hf.outputs import (
    MANIFEST_NAME,
    check_folder_output,
    check_outputs,
    read_manifest,
    record_folder,
    record_outputs,
    replace_outputs,
    unrecorded_reason,
    writing_folder,
)
from titans_hf.training.training_lock import LOCK_NAME


def checksums(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and not path.is_symlink()}


def babilong(tokenizer: Path, output: Path | str, *flags: str) -> int:
    return cli_main(["babilong", "generate", "--task", "qa1", "--length", "0", "--num-samples", "2", "--tokenizer",
                     str(tokenizer), "--output", str(output), *flags])


@pytest.mark.parametrize("kind", ["symbolic link", "hard link", "folder"])
def test_a_training_lock_that_is_a_link_or_a_folder_is_refused_and_what_it_reaches_is_kept(
        tiny_qwen3_dir, rows, tmp_path, kind):  # noqa: F811
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work\n")
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_NAME
    if kind == "symbolic link":
        lock.symlink_to(mine / "thesis.txt")
        problem = "a symbolic link"
    elif kind == "hard link":
        os.link(mine / "thesis.txt", lock)
        problem = r"a file with other names \(hard links\)"
    else:
        lock.mkdir()
        problem = "a folder"
    before = checksums(mine)
    with pytest.raises(FileExistsError, match=rf"run/{LOCK_NAME}: the training lock is {problem}, which titans_hf "
                       "will not write into; remove it or choose another output_dir"):
        make_trainer(tiny_qwen3_dir, run, rows, max_steps=1, save_strategy="no").train()
    assert checksums(mine) == before
    assert lock.is_symlink() or lock.exists()  # left where it was, for its owner to look at
    assert sorted(path.name for path in run.iterdir()) == [LOCK_NAME]


def test_a_lock_replaced_during_the_run_is_not_removed_at_its_end(tiny_qwen3_dir, rows, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    from transformers import Trainer

    (tmp_path / "mine.txt").write_text("mine\n")
    lock = tmp_path / "run" / LOCK_NAME

    def replacing_train(self, *args, **kwargs):
        lock.unlink()
        lock.symlink_to(tmp_path / "mine.txt")  # someone else's file at the lock's path while the run runs

    monkeypatch.setattr(Trainer, "train", replacing_train)
    make_trainer(tiny_qwen3_dir, tmp_path / "run", rows, max_steps=1, save_strategy="no").train()
    assert lock.is_symlink() and (tmp_path / "mine.txt").read_text() == "mine\n"


def test_overwriting_a_whole_folder_keeps_a_users_file_named_like_the_manifest_in_a_subfolder(tmp_path):
    folder = tmp_path / "demo"
    with writing_folder(folder, overwrite=False, command="titans-hf demo", outputs=["memory"]) as output:
        (output / "memory").mkdir()
        (output / "memory" / "weights.bin").write_bytes(b"weights")
    (folder / "memory" / MANIFEST_NAME).write_text("my notes, whatever their name\n")
    before = checksums(folder)
    message = rf"will not replace it, even with --overwrite: it holds files titans_hf did not write: \['memory/" \
              rf"{MANIFEST_NAME.replace('.', '[.]')}'\]"
    with pytest.raises(FileExistsError, match=message):
        with writing_folder(folder, overwrite=True, command="titans-hf demo", outputs=["memory"]):
            raise AssertionError("refused before the block runs")
    assert checksums(folder) == before


def test_an_output_named_like_the_manifest_is_refused_before_anything_is_written(tmp_path, tiny_tokenizer_dir):
    output = tmp_path / "data"
    output.mkdir()
    with pytest.raises(ValueError, match=rf"output .*data/{MANIFEST_NAME.replace('.', '[.]')}: "
                       rf"{MANIFEST_NAME.replace('.', '[.]')} is the name of titans_hf's record of the outputs it "
                       "wrote; choose another name"):
        babilong(tiny_tokenizer_dir, output / MANIFEST_NAME)
    assert list(output.iterdir()) == []

    (tmp_path / "mine.json").write_text("{}\n")
    (output / MANIFEST_NAME).symlink_to(tmp_path / "mine.json")  # where the record goes: a user's link
    with pytest.raises(FileExistsError, match=rf"output .*data/0k\.json: .*data/{MANIFEST_NAME.replace('.', '[.]')}, "
                       "where titans_hf records the outputs it wrote, is not a plain file; remove it or choose another "
                       "folder"):
        babilong(tiny_tokenizer_dir, output / "0k.json")
    assert (output / MANIFEST_NAME).is_symlink() and os.listdir(output) == [MANIFEST_NAME]
    assert (tmp_path / "mine.json").read_text() == "{}\n"


def test_a_manifest_that_came_with_a_copied_folder_vouches_for_nothing(tmp_path, tiny_tokenizer_dir):
    original = tmp_path / "original"
    assert babilong(tiny_tokenizer_dir, original / "0k.json") == 0
    assert babilong(tiny_tokenizer_dir, original / "0k.json", "--overwrite") == 0  # its own output: replaceable
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)  # a colleague's folder, manifest included: its files are the user's now
    before = checksums(copy)
    with pytest.raises(FileExistsError, match=r"copy/0k\.json: will not replace it, even with --overwrite: "
                       rf"titans_hf did not write it \(this folder's {MANIFEST_NAME.replace('.', '[.]')} holds no "
                       "record of it\\)"):
        babilong(tiny_tokenizer_dir, copy / "0k.json", "--overwrite")
    assert checksums(copy) == before

    whole = tmp_path / "base"
    whole.mkdir()
    (whole / "config.json").write_text("{}")
    record_folder(whole, "titans-hf recall toy-base")
    check_folder_output(whole, overwrite=True)  # the folder it wrote whole may be replaced
    shutil.copytree(whole, tmp_path / "base_copy")
    with pytest.raises(FileExistsError, match=rf"base_copy: will not replace it, even with --overwrite: it holds no "
                       rf"{MANIFEST_NAME.replace('.', '[.]')} saying titans_hf wrote the whole folder"):
        check_folder_output(tmp_path / "base_copy", overwrite=True)


def test_a_manifest_vouches_only_for_plain_files_of_its_own_folder_with_their_inode(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    atomic_write_json(folder / "results.json", {"score": 1})
    record_outputs(folder, ["results.json"], "titans-hf eval")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    entry = manifest["files"]["results.json"]
    (tmp_path / "victim.txt").write_text("mine\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_text("mine\n")
    for name in ("../victim.txt", str(tmp_path / "victim.txt"), "sub/notes.txt", "./results.json", "a//b", ""):
        manifest["files"][name] = entry
    manifest["files"]["plain.txt"] = "titans-hf eval"  # an entry that is a string
    manifest["files"]["other.txt"] = {"command": "titans-hf eval", "sha256": entry["sha256"]}  # no inode
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert list(read_manifest(folder)["files"]) == ["results.json"]
    assert unrecorded_reason(folder / "results.json") is None

    (folder / "plain.txt").write_text("mine\n")
    assert unrecorded_reason(folder / "plain.txt").startswith("titans_hf did not write it")
    same_bytes = folder / "copied.json"  # the user's file with the very bytes the manifest records, another inode
    shutil.copyfile(folder / "results.json", same_bytes)
    os.replace(same_bytes, folder / "results.json")
    assert unrecorded_reason(folder / "results.json") == "it changed since titans-hf eval wrote it"


def test_a_whole_folder_manifest_entry_that_is_not_an_entry_is_one_line(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    record_folder(folder, "titans-hf recall toy-base")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["files"]["config.json"] = "titans-hf recall toy-base"
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    before = checksums(folder)
    monkeypatch.setattr(sys, "argv", ["titans-hf", "recall", "toy-base", "--output-dir", str(folder), "--overwrite"])
    with pytest.raises(SystemExit) as exit_:
        cli()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"titans-hf: error: output {folder}: will not replace it, even with "
                                       "--overwrite: it holds files titans_hf did not write: ['config.json']; remove "
                                       "it yourself or choose another output\n")
    assert checksums(folder) == before


def test_an_output_name_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, tiny_tokenizer_dir):
    output = tmp_path / "data"
    output.mkdir()
    name = os.fsdecode(b"qa1-\xff.json")
    with pytest.raises(ValueError, match=r"output '.*data/qa1-\\udcff\.json': its name is not valid UTF-8; choose a "
                       "name that is"):
        babilong(tiny_tokenizer_dir, output / name)
    assert list(output.iterdir()) == []
    with pytest.raises(ValueError, match="its name is not valid UTF-8"):
        check_outputs([output / name], overwrite=True)


def test_names_of_up_to_255_bytes_are_written_and_replaced(tmp_path, tiny_tokenizer_dir):
    long_json = "q" * 250 + ".json"  # 255 bytes, the most a file name may have
    assert babilong(tiny_tokenizer_dir, tmp_path / "data" / long_json) == 0
    assert babilong(tiny_tokenizer_dir, tmp_path / "data" / long_json, "--overwrite") == 0
    assert sorted(path.name for path in (tmp_path / "data").iterdir()) == sorted([MANIFEST_NAME, long_json])

    target, temporary = tmp_path / ("a" + "é" * 127), tmp_path / "new"  # 255 bytes: the kept 200 cut an é in two
    target.write_text("old")
    temporary.write_text("new")
    claim_output(target)  # what a command's output check does before its work
    replace_outputs([temporary], [target])
    assert target.read_text() == "new"

    folder = tmp_path / ("d" * 255)
    for overwrite in (False, True):
        with writing_folder(folder, overwrite=overwrite, command="titans-hf demo", outputs=["run.json"]) as output:
            (output / "run.json").write_text(str(overwrite))
    assert (folder / "run.json").read_text() == "True"

    from titans_hf.data.prepare import prepare

    (tmp_path / "docs.txt").write_text("John went to the garden.\n" * 20)
    store = tmp_path / ("s" * 252 + ".h5")
    for overwrite in (False, True):
        assert prepare(tmp_path / "docs.txt", store, tiny_tokenizer_dir, overwrite=overwrite) == [store]
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


def test_a_store_is_written_under_a_fresh_name_created_exclusively(tmp_path, tiny_tokenizer_dir, monkeypatch):
    from titans_hf.data.prepare import prepare

    (tmp_path / "docs.txt").write_text("John went to the garden.\n" * 20)
    (tmp_path / "mine.txt").write_text("mine\n")
    fixed = uuid.UUID(int=0)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    planted = tmp_path / f".corpus.h5.tmp-{os.getpid()}-{fixed.hex[:8]}"
    planted.symlink_to(tmp_path / "mine.txt")  # at the temporary name the store would be written under
    with pytest.raises(FileExistsError):
        prepare(tmp_path / "docs.txt", tmp_path / "corpus.h5", tiny_tokenizer_dir)
    assert (tmp_path / "mine.txt").read_text() == "mine\n"
    assert not (tmp_path / "corpus.h5").exists()


def test_a_folder_that_cannot_be_written_is_named_in_one_line(tmp_path, tiny_tokenizer_dir):
    """Run as a process that file permissions apply to (as root, without the capability to override them)."""
    (tmp_path / "docs.txt").write_text("John went to the garden.\n" * 20)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    empty = read_only / "empty"
    empty.mkdir()
    read_only.chmod(0o555)
    empty.chmod(0o555)
    unprivileged = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                    "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    commands = {
        "prepare": ["prepare", str(tmp_path / "docs.txt"), "-o", str(read_only / "corpus.h5"), "--tokenizer",
                    str(tiny_tokenizer_dir)],
        "babilong": ["babilong", "generate", "--task", "qa1", "--length", "0", "--num-samples", "1", "--tokenizer",
                     str(tiny_tokenizer_dir), "--output", str(read_only / "0k.json")],
        "demo": ["demo", "--output-dir", str(empty), "--pretrain-steps", "1"],
    }
    try:
        for name, argv in commands.items():
            result = subprocess.run([*unprivileged, sys.executable, "-m", "titans_hf.commands", *argv],
                                    capture_output=True, text=True, timeout=300)
            target = empty / MANIFEST_NAME if name == "demo" else Path(argv[argv.index("-o" if name == "prepare"
                                                                                     else "--output") + 1])
            folder = empty if name == "demo" else read_only
            assert (result.returncode, result.stderr.splitlines()[-1:]) == (
                2, [f"titans-hf: error: output {target}: folder {folder} is not writable"]), (name, result.stderr)
            assert "Traceback" not in result.stderr
        assert sorted(path.name for path in read_only.iterdir()) == ["empty"] and not any(empty.iterdir())
    finally:
        read_only.chmod(0o755)
        empty.chmod(0o755)
