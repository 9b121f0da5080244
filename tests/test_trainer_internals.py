"""TitansTrainer and transformers' Trainer: the sampler callback follows the Trainer's own epoch count, and every
private member of the Trainer relied on is checked, failing loudly, naming it, when a transformers release moves it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_trainer import StopAtStep, make_trainer, rows  # noqa: F401  (rows is a fixture)
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers import trainer as hf_trainer

import titans_hf.training
from titans_hf.training.trainer import TRAINER_ATTRIBUTES, TRAINER_INTERNALS, check_trainer_internals


@pytest.fixture
def epochs_run(monkeypatch) -> list[tuple[int, int]]:
    """(the epoch the Trainer runs, the epoch the training sampler is at) at the start of every epoch it runs."""
    seen = []
    run_epoch = Trainer._run_epoch

    def recording(self, *args, **kwargs):
        seen.append((kwargs["epoch"], self._sampler_state.sampler.epoch))
        return run_epoch(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_run_epoch", recording)
    return seen


def test_the_sampler_is_at_each_epoch_the_trainer_runs(tiny_qwen3_dir, rows, tmp_path, epochs_run):  # noqa: F811
    make_trainer(tiny_qwen3_dir, tmp_path, rows, save_strategy="no").train()
    assert epochs_run == [(0, 0), (1, 1)]


@pytest.mark.parametrize(("stop_step", "accumulation", "resumed_epochs"), [
    (2, 2, [(0, 0), (1, 1)]),
    (4, 2, [(1, 1)]),
    (2, 3, [(1, 1)]),  # 2 steps of 2 micro-batches, resumed with 3 a step: the Trainer counts one epoch trained
], ids=["in-epoch-0", "in-epoch-1", "other-accumulation"])
def test_a_resumed_sampler_is_at_the_epoch_the_trainer_resumes(tiny_qwen3_dir, rows, tmp_path, epochs_run,  # noqa: F811
                                                              stop_step, accumulation, resumed_epochs):
    make_trainer(tiny_qwen3_dir, tmp_path, rows, callbacks=[StopAtStep(stop_step)]).train()
    epochs_run.clear()
    make_trainer(tiny_qwen3_dir, tmp_path, rows, save_strategy="no",
                 gradient_accumulation_steps=accumulation).train(resume_from_checkpoint=True)
    assert epochs_run == resumed_epochs


# ---- the private members of the Trainer relied on ----


def test_the_installed_transformers_has_every_trainer_internal_relied_on():
    check_trainer_internals()


@pytest.mark.parametrize(("move", "named"), [
    (lambda patch: patch.delattr(Trainer, "_load_rng_state"), "transformers.Trainer._load_rng_state is gone"),
    (lambda patch: patch.setattr(Trainer, "_save_checkpoint", lambda self, model: None),
     r"transformers.Trainer._save_checkpoint takes \(model\), not \(model, trial\)"),
    (lambda patch: patch.setattr(Trainer, "save_model", lambda self, output_dir=None: None),
     r"transformers.Trainer.save_model takes \(output_dir\), not \(output_dir, _internal_call\)"),
    (lambda patch: patch.setattr(Trainer, "_set_signature_columns_if_needed", lambda self: None),
     "transformers.Trainer._set_signature_columns_if_needed no longer sets self._signature_columns"),
    (lambda patch: patch.delattr(hf_trainer, "OPTIMIZER_NAME"), "transformers.trainer.OPTIMIZER_NAME is gone"),
], ids=["hook-gone", "hook-parameters", "internal-call", "attribute", "constant"])
def test_a_moved_trainer_internal_fails_loudly_naming_it(tiny_qwen3_dir, rows, tmp_path,  # noqa: F811
                                                         monkeypatch, move, named):
    move(monkeypatch)
    message = rf"^titans_hf's TitansTrainer relies on private members of transformers.Trainer that .* moved: {named}$"
    with pytest.raises(RuntimeError, match=message):
        check_trainer_internals()
    with pytest.raises(RuntimeError, match=message):
        make_trainer(tiny_qwen3_dir, tmp_path, rows)


def private_members_used(path: Path) -> set[str]:
    """The private names a module defines as methods, or reads as `self._name` / `super()._name`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            found.update(item.name for item in node.body if isinstance(item, ast.FunctionDef))
        elif isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "self")
                or (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")):
            found.add(node.attr)
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def test_every_private_trainer_member_the_training_code_uses_is_checked(tiny_qwen3_dir, tmp_path):
    """Each private method or attribute of a Trainer that a module of titans_hf.training overrides or reads is one
    that `check_trainer_internals` checks; the package's own private names are none of the Trainer's."""
    plain = Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir),
                    args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True))
    trainer_members = set(dir(Trainer)) | set(vars(plain))
    modules = sorted(Path(titans_hf.training.__file__).parent.glob("*.py"))
    used = set().union(*(private_members_used(path) for path in modules)) & trainer_members
    assert used == set(TRAINER_INTERNALS) - {"save_model"} | set(TRAINER_ATTRIBUTES)
