"""Hostile checkpoints and misuse at resume: every broken file is named, a cut-short checkpoint is passed over,
changed settings are named, and nothing in the checkpoint is modified by trying."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from test_commands import run_cli  # noqa: F401  (a fixture)
from test_trainer import make_trainer, rows  # noqa: F401  (rows is a fixture)
from transformers import AutoTokenizer, TrainerCallback

from titans_hf.data.prepare import prepare
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.training import TitansTrainer, TitansTrainingArguments
from titans_hf.training.checkpointing import checkpoint_problem


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
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.checkpointing"):
        trainer.train(resume_from_checkpoint=True)  # checkpoint-1 is complete: 1 more step from there
    assert trainer.state.global_step == 2
    assert any(f"skipping the incomplete checkpoint {checkpoints / 'checkpoint-2'}" in r.getMessage()
               for r in caplog.records)
    assert checksums(checkpoints) == before


def test_resuming_with_changed_settings_names_each_of_them(tiny_qwen3_dir, rows, checkpoints, caplog):  # noqa: F811
    same = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2, save_strategy="no", logging_steps=2)
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.checkpointing"):
        same.train(resume_from_checkpoint=True)
    assert not [r for r in caplog.records if "changed settings" in r.getMessage()]  # logging does not count

    changed = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2, save_strategy="no", learning_rate=5e-3,
                           gradient_accumulation_steps=3)
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.checkpointing"):
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


# ---- grpo rewards and non-finite steps ----

STORY = "Mary went to the kitchen. " + "The old clock on the tower struck noon. " * 3 + "Where is Mary?"
GROUPS = [{"prompt": STORY, "responses": [" kitchen", " garden"], "rewards": [1.0, 0.0]},
          {"prompt": STORY.replace("Mary", "John"), "responses": [" office", " garden"], "rewards": [0.5, -1.0]}]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def grpo_train_argv(model_dir: Path, store: Path, output: Path, *flags: str) -> list[str]:
    return ["train", "--dataset", "titans_tokens", "--train_type", "grpo", "--data_files", str(store),
            "--model_name_or_path", str(model_dir), "--chunk_size", "8", "--memory_layers", "1",
            "--memory_chunk_size", "4", "--memory_head_dim", "16", "--output_dir", str(output),
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--report_to", "none",
            "--disable_tqdm", "true", "--use_cpu", "true", *flags]


def test_grpo_rewards_that_overflow_are_refused_at_prepare_and_at_load(run_cli, tiny_qwen3_dir,  # noqa: F811
                                                                        tiny_tokenizer_dir, tmp_path):
    """Rewards of +-3e38 (float32 holds them, but two sum to inf and GRPO's advantages become NaN): `titans-hf
    prepare` refuses them in one line naming the line; a store written by an older version that holds them is
    refused by `train --train_type grpo` as its rows are read, naming the file and record, before any step."""
    source = write_jsonl(tmp_path / "groups.jsonl", [GROUPS[0], {**GROUPS[1], "rewards": [3e38, -3e38]}])
    before = checksums(tmp_path)
    result = run_cli("prepare", str(source), "--output", str(tmp_path / "groups_bin"), "--tokenizer",
                     str(tiny_tokenizer_dir), "--train-type", "grpo")
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, (  # after the progress bar's lines
        f"titans-hf: error: {source}:2: field 'rewards' holds [3e+38, -3e+38]; rewards must be finite numbers in "
        "[-1e+09, 1e+09] (larger ones overflow GRPO's advantages in float32)"))
    assert checksums(tmp_path) == before

    [store] = prepare(write_jsonl(tmp_path / "ok.jsonl", GROUPS), tmp_path / "groups_bin", tiny_tokenizer_dir,
                      train_type="grpo")
    np.array([1.0, 0.0, 3e38, -3e38], np.float32).tofile(store / "rewards.bin")
    meta = json.loads((store / "meta.json").read_text())
    for entry in meta["keys"].values():  # as written before ranges and checksums were recorded
        for field in ("min", "max", "sha256"):
            del entry[field]
    (store / "meta.json").write_text(json.dumps(meta))
    stored = checksums(store)
    result = run_cli(*grpo_train_argv(tiny_qwen3_dir, store, tmp_path / "out", "--max_steps", "1"))
    error = result.stderr.splitlines()[-1]
    assert result.returncode == 2
    assert error.startswith(f"titans-hf: error: {store / 'rewards.bin'}: key 'rewards' holds 3")
    assert error.endswith(" at position 2, not a finite number in [-1e+09, 1e+09] (MAX_ABS_REWARD: larger rewards "
                          "overflow GRPO's advantages in float32) (record 1)")
    assert not (tmp_path / "out" / "memory_model.safetensors").exists()
    assert checksums(store) == stored


def test_a_non_finite_loss_stops_the_run_before_anything_is_saved(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    """GRPO rows whose rewards overflow (3e38 twice: the group's sum is inf, as rows built in Python or an Arrow cache
    of an older version may hold them) give an infinite loss: the run stops at step 1 with one error naming the step
    and the loss, and writes neither a checkpoint nor the final memory (it used to save a memory full of NaN)."""
    [store] = prepare(write_jsonl(tmp_path / "groups.jsonl", GROUPS), tmp_path / "groups_bin", tiny_tokenizer_dir,
                      train_type="grpo")
    rows = datasets.load_dataset("titans_tokens", data_files=f"{store}/*", train_type="grpo", split="train",
                                 cache_dir=str(tmp_path / "cache"))
    rows = rows.map(lambda row: {"rewards": [3e38, 3e38]})
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=8, memory_layers=[1], memory_chunk_size=4,
                                            memory_head_dim=16)
    output = tmp_path / "out"
    args = TitansTrainingArguments(output_dir=str(output), per_device_train_batch_size=2, max_steps=2, save_steps=1,
                                   report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = TitansTrainer(model=model, args=args, train_dataset=rows,
                            processing_class=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    with pytest.raises(ValueError, match=r"^step 1: the loss is -inf, not a finite number"):
        trainer.train()
    assert list(output.iterdir()) == []


class PoisonGradient(TrainerCallback):
    """From optimizer step `step` on, the gradient of the memory's first output projection is NaN (what a diverging
    run gives while its loss still looks finite)."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.name, param = next((name, param) for name, param in model.named_parameters()
                                if name.endswith("output_weight"))
        self.step, self.active = step, False
        param.register_hook(lambda grad: torch.full_like(grad, math.nan) if self.active else grad)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 >= self.step


def assert_stopped_at_step_2(folder: Path) -> None:
    """checkpoint-1, written before the bad step, is complete and finite; nothing was written after it."""
    from safetensors.torch import load_file

    assert sorted(path.name for path in folder.glob("checkpoint-*")) == ["checkpoint-1"]
    assert checkpoint_problem(folder / "checkpoint-1") is None
    weights = load_file(folder / "checkpoint-1" / "memory_model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert not (folder / "memory_model.safetensors").exists()


def test_non_finite_gradients_stop_the_run_before_the_optimizer_step(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    """A finite loss with NaN gradients (step 2 of 3, gradient accumulation 2): stopped before the optimizer applies
    them, naming the step and the parameter; the checkpoint of step 1 stays."""
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=3)
    poison = PoisonGradient(trainer.model, step=2)
    trainer.add_callback(poison)
    with pytest.raises(ValueError, match=rf"^step 2: the gradient of {poison.name} holds nan or infinite values"):
        trainer.train()
    assert_stopped_at_step_2(tmp_path)
