"""Hostile checkpoints and misuse at resume: every broken file is named, a cut-short checkpoint is passed over,
changed settings are named, and nothing in the checkpoint is modified by trying."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest
from test_trainer import make_trainer, rows  # noqa: F401  (rows is a fixture)


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def checkpoints(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    """A run of 2 steps with a checkpoint at each: checkpoint-1 and checkpoint-2."""
    make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=2).train()
    return tmp_path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("sampler_state.json", b"{not json", "sampler_state.json: not the state of this run's sampler"),
        ("sampler_state.json", b'{"epoch": 0}', "sampler_state.json: not the state of this run's sampler"),
        ("optimizer.pt", b"garbage" * 10, "optimizer.pt: cannot be loaded into this run's optimizer"),
        ("scheduler.pt", b"\x00" * 64, "scheduler.pt: cannot be loaded into this run's optimizer"),
        ("rng_state.pth", b"not a pickle", "rng_state.pth: not a random number generator state"),
    ],
)
def test_a_garbage_checkpoint_file_is_named(tiny_qwen3_dir, rows, checkpoints, name, content, message):  # noqa: F811
    broken = checkpoints / "checkpoint-2" / name
    broken.write_bytes(content)
    before = checksums(checkpoints)
    trainer = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=4)
    with pytest.raises(ValueError) as raised:
        trainer.train(resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    assert str(broken) in str(raised.value) and message.split(": ", 1)[1] in str(raised.value)
    assert checksums(checkpoints) == before


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_broken_memory_file_is_passed_over_on_resume_and_named_when_asked_for(
    tiny_qwen3_dir, rows, checkpoints, caplog, damage  # noqa: F811
):
    weights = checkpoints / "checkpoint-2" / "memory_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x08\x00\x00\x00\x00\x00\x00\x00{bad")
    before = checksums(checkpoints)
    with pytest.raises(ValueError, match=f"cannot resume from .*checkpoint-2: {weights}.*not a readable safetensors"):
        make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2).train(
            resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    trainer = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.trainer"):
        trainer.train(resume_from_checkpoint=True)  # checkpoint-1 is complete: 1 more step from there
    assert trainer.state.global_step == 2
    assert any(f"skipping the incomplete checkpoint {checkpoints / 'checkpoint-2'}" in r.getMessage()
               for r in caplog.records)
    assert checksums(checkpoints) == before


def test_resuming_with_changed_settings_names_each_of_them(tiny_qwen3_dir, rows, checkpoints, caplog):  # noqa: F811
    same = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2, save_strategy="no", logging_steps=2)
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.trainer"):
        same.train(resume_from_checkpoint=True)
    assert not [r for r in caplog.records if "changed settings" in r.getMessage()]  # logging does not count

    changed = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2, save_strategy="no", learning_rate=5e-3,
                           gradient_accumulation_steps=3)
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.trainer"):
        changed.train(resume_from_checkpoint=True)
    (message,) = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert "checkpoint-2" in message
    assert "learning_rate 0.01 -> 0.005" in message and "gradient_accumulation_steps 2 -> 3" in message
    assert "seed" not in message


def test_the_final_save_never_replaces_a_users_file_in_output_dir(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    """A user's tokenizer.json where the final save would write its own: refused before any step, kept as it was."""
    (tmp_path / "tokenizer.json").write_text("my own tokenizer\n")
    with pytest.raises(FileExistsError, match=r"would replace .*tokenizer\.json, and titans_hf did not write it"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no").train()
    assert (tmp_path / "tokenizer.json").read_text() == "my own tokenizer\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokenizer.json"]  # no step, no lock left


def test_a_fresh_run_replaces_an_earlier_memory_only_with_overwrite_output_dir(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    first = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no")
    first.train()
    first.save_model()
    saved = checksums(tmp_path)
    assert {"memory_model.safetensors", "memory_config.json", "config.json", "tokenizer.json",
            "training_args.json", ".titans_hf_outputs.json"} <= set(saved)
    with pytest.raises(FileExistsError, match=r"holds the memory an earlier run saved .*--overwrite_output_dir"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no").train()
    assert checksums(tmp_path) == saved

    second = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no", overwrite_output_dir=True,
                          learning_rate=0.5)
    second.train()
    second.save_model()
    assert checksums(tmp_path)["memory_model.safetensors"] != saved["memory_model.safetensors"]

    config = tmp_path / "memory_config.json"
    config.write_text(config.read_text().replace('"chunk_size"', '"chunk_size" ', 1))  # a user's edit
    with pytest.raises(FileExistsError, match=r"memory_config\.json, and it changed since titans-hf train wrote it"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no",
                     overwrite_output_dir=True).train()


def test_the_lock_file_goes_when_the_run_ends_and_a_stale_one_blocks_nothing(tiny_qwen3_dir, rows, tmp_path,  # noqa: F811
                                                                             monkeypatch):
    from transformers import Trainer

    lock = tmp_path / ".titans_hf_train.lock"
    lock.write_text("process 999999\n")  # left by a run killed with -9: no process holds it
    make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no").train()
    assert not lock.exists()

    def failing_train(self, *args, **kwargs):
        assert lock.read_text() == f"process {os.getpid()}\n"  # held while the run runs
        raise RuntimeError("the run fails")

    monkeypatch.setattr(Trainer, "train", failing_train)
    with pytest.raises(RuntimeError, match="the run fails"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no").train()
    assert not lock.exists()
