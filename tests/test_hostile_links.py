"""Hostile things where the commands write: a link, a hard link or a folder where the training lock goes.

The rule they check: every file titans_hf writes is opened without following a link, inside the folder it belongs
to; each refusal is one line naming the file. Each test checksums what it hands in and checks it afterwards.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from test_trainer import make_trainer, rows  # noqa: F401  (rows is a fixture)

from titans_hf.training.trainer import LOCK_NAME


def checksums(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and not path.is_symlink()}


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
