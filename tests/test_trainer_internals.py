"""TitansTrainer and transformers' Trainer: the sampler callback follows the Trainer's own epoch count."""

from __future__ import annotations

import pytest
from test_trainer import StopAtStep, make_trainer, rows  # noqa: F401  (rows is a fixture)
from transformers import Trainer


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
