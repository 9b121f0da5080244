"""The TRL trainers of titans_hf (`titans_hf.training.trl_trainers`) stop a run whose loss or gradients are not finite
at the step they turn so, before the optimizer applies them: one error naming the step and what was not finite, and
no checkpoint after it (the one written before stays: it is valid)."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from test_hostile_training import PoisonGradient, assert_stopped_at_step_2
from test_trl import memory_model, preference_rows, texts, trl_args
from transformers import AutoTokenizer, TrainerCallback

trl = pytest.importorskip("trl")


class PoisonWeights(TrainerCallback):
    """At the start of optimizer step `step`, the memory's first output projection becomes NaN: the loss is NaN."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.param = next(param for name, param in model.named_parameters() if name.endswith("output_weight"))
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                self.param.fill_(math.nan)


def trainer(kind: str, model_dir, output_dir):
    from titans_hf.training.trl_trainers import TitansDPOTrainer, TitansGRPOTrainer, TitansSFTTrainer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), memory_model(model_dir)
    steps = dict(max_steps=3, save_strategy="steps", save_steps=1)
    if kind == "sft":
        return TitansSFTTrainer(model=model, args=trl_args(trl.SFTConfig, output_dir, max_length=64, **steps),
                                train_dataset=datasets.Dataset.from_dict({"text": texts(6)}), processing_class=tokenizer)
    if kind == "dpo":
        return TitansDPOTrainer(model=model, args=trl_args(trl.DPOConfig, output_dir, max_length=64, **steps),
                                train_dataset=preference_rows(6), processing_class=tokenizer)
    prompts = [story + " Where is Mary? Answer:" for story in texts(6, seed=2)]
    return TitansGRPOTrainer(model=model, reward_funcs=lambda completion_ids, **kwargs: [1.0] * len(completion_ids),
                             args=trl_args(trl.GRPOConfig, output_dir, num_generations=2, max_completion_length=4,
                                           **steps),
                             train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_non_finite_gradients_stop_a_trl_run(tiny_qwen3_dir, tmp_path, kind):
    run = trainer(kind, tiny_qwen3_dir, tmp_path)
    poison = PoisonGradient(run.model, step=2)
    run.add_callback(poison)
    with pytest.raises(ValueError, match=rf"^step 2: the gradient of {poison.name} holds nan or infinite values"):
        run.train()
    assert_stopped_at_step_2(tmp_path)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_non_finite_loss_stops_a_trl_run(tiny_qwen3_dir, tmp_path, kind):
    run = trainer(kind, tiny_qwen3_dir, tmp_path)
    run.add_callback(PoisonWeights(run.model, step=2))
    with pytest.raises(ValueError, match=r"^step 2: the loss is nan, not a finite number"):
        run.train()
    assert_stopped_at_step_2(tmp_path)
