"""TitansTrainer: memory-only checkpoints, exact resume, curriculum, logging, atomic checkpoint writes."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile

import datasets
import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import titans_hf.modeling.memory_folder
from titans_hf.data.collator import TitansDataCollator
from titans_hf.data.sampler import ChunkCurriculumSampler, count_chunks
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import (
    MEMORY_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    MODEL_CONFIG_NAME,
    TRAINABLE_BASE_WEIGHTS_NAME,
    file_key,
)
from titans_hf.training import TitansTrainer, TitansTrainingArguments
from titans_hf.training.trainer import answer_exact_match

STEPS_PER_EPOCH = 3  # 6 rows, batch 1, gradient accumulation 2
ANSWER_TOKENS = 4
PASSED_STATES = "passed_memory_states.safetensors"


def memory_model(model_dir) -> TitansQwenForCausalLM:
    """A TitansQwen on the tiny base (chunks of 16 tokens, memory updated every 8), same memory init every call."""
    torch.manual_seed(0)
    return TitansQwenForCausalLM.from_base(
        model_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16, checkpoint_chunks=False
    )


def frozen_base_model(model_dir) -> torch.nn.Module:
    """A plain Qwen frozen except its last MLP: the trainer needs nothing of TitansQwen but requires_grad."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    model.model.layers[-1].mlp.requires_grad_(True)
    return model


def trainable_weights(model) -> dict[str, torch.Tensor]:
    """The trainable weights under the keys a checkpoint's files hold them by (a TitansQwen's memory without the
    decoder's `model.` in front: `file_key`)."""
    return {file_key(name): p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def make_rows(lengths, vocab_size: int, seed: int = 0) -> datasets.Dataset:
    """Unpadded rows whose last ANSWER_TOKENS tokens carry the loss, like BABILong answers."""
    generator = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for length in lengths:
        ids = torch.randint(1, vocab_size, (length,), generator=generator).tolist()
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * length)
        rows["labels"].append([-100] * (length - ANSWER_TOKENS) + ids[-ANSWER_TOKENS:])
    return datasets.Dataset.from_dict(rows)


def make_args(output_dir, **overrides) -> TitansTrainingArguments:
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=1,
        log_every_batches=None,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return TitansTrainingArguments(**settings)


class StopAtStep(TrainerCallback):
    """Simulates a job killed right after the checkpoint of step `step` was written."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(
    model_dir, output_dir, dataset, collator=None, callbacks=None, model=None, eval_dataset=None, **overrides
) -> TitansTrainer:
    """A TitansTrainer whose collator (pad id from the tokenizer, chunk size from the config) it builds itself."""
    return TitansTrainer(
        model=model if model is not None else memory_model(model_dir),
        args=make_args(output_dir, **overrides),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def rows(tiny_qwen3_dir):
    vocab_size = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).config.vocab_size
    return make_rows([16, 32, 16, 48, 32, 16], vocab_size)


@pytest.fixture(scope="module")
def uninterrupted(tiny_qwen3_dir, rows, tmp_path_factory):
    """Final weights of one run of 2 epochs without a stop, per curriculum setting."""
    results = {}
    for curriculum in (None, [1, 3]):
        trainer = make_trainer(
            tiny_qwen3_dir, tmp_path_factory.mktemp("full"), rows, save_strategy="no", curriculum_chunks=curriculum
        )
        trainer.train()
        assert trainer.state.global_step == 2 * STEPS_PER_EPOCH
        results[str(curriculum)] = trainable_weights(trainer.model)
    return results


# ---- arguments ----


@pytest.mark.parametrize(
    "log_every_batches, accumulation, expected", [(80, 8, 10), (80, 3, 27), (5, 8, 1), (1, 1, 1), (81, 8, 11)]
)
def test_log_every_batches_sets_logging_steps(tmp_path, log_every_batches, accumulation, expected):
    args = TitansTrainingArguments(
        output_dir=str(tmp_path), log_every_batches=log_every_batches, gradient_accumulation_steps=accumulation
    )
    assert args.logging_steps == expected == math.ceil(log_every_batches / accumulation)
    assert args.logging_strategy == "steps"


def test_seed_recipe_defaults_and_explicit_logging_steps(tmp_path):
    args = TitansTrainingArguments(output_dir=str(tmp_path))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.log_every_batches) == (1, 8, 80)
    assert args.logging_steps == 10
    # an explicit logging_steps wins over log_every_batches, whatever that says
    assert TitansTrainingArguments(output_dir=str(tmp_path), logging_steps=7).logging_steps == 7
    assert TitansTrainingArguments(output_dir=str(tmp_path), log_every_batches=16, logging_steps=3).logging_steps == 3
    assert TitansTrainingArguments(output_dir=str(tmp_path), log_every_batches=None).logging_steps == 500


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"log_every_batches": 0}, "log_every_batches"),
        ({"curriculum_chunks": [2, 2]}, "curriculum_chunks"),
        ({"curriculum_chunks": [0, 1]}, "curriculum_chunks"),
        ({"curriculum_epochs_per_stage": 0}, "curriculum_epochs_per_stage"),
    ],
)
def test_bad_arguments_raise(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        TitansTrainingArguments(output_dir=str(tmp_path), **overrides)


# ---- curriculum ----


def test_curriculum_sampler_stages_and_determinism():
    counts = [1, 2, 1, 3, 2, 1]
    sampler = ChunkCurriculumSampler(counts, stages=[1, 2, 3], epochs_per_stage=2, seed=5)
    orders = {}
    for epoch in range(7):
        sampler.set_epoch(epoch)
        orders[epoch] = list(sampler)
        assert len(orders[epoch]) == len(sampler) == 6
    # epochs 0-1: only the 1-chunk rows {0, 2, 5}, each exactly twice (two reshuffled rounds)
    for epoch in (0, 1):
        assert sorted(orders[epoch]) == [0, 0, 2, 2, 5, 5]
        assert sorted(orders[epoch][:3]) == [0, 2, 5]
    # epochs 2-3: rows of <= 2 chunks {0, 1, 2, 4, 5}: one full round then one more row
    for epoch in (2, 3):
        assert sorted(orders[epoch][:5]) == [0, 1, 2, 4, 5] and orders[epoch][5] in (0, 1, 2, 4, 5)
    # epochs >= 4: the last stage stays: every row once
    for epoch in (4, 5, 6):
        assert sorted(orders[epoch]) == list(range(6))
    assert orders[4] != orders[5]
    # same (seed, epoch), same order, also through state_dict
    restored = ChunkCurriculumSampler(counts, stages=[1, 2, 3], epochs_per_stage=2, seed=0)
    sampler.set_epoch(3)
    restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert list(restored) == orders[3]


def test_curriculum_sampler_rejects_bad_input():
    with pytest.raises(ValueError, match="<= 1 chunks has no training row"):
        ChunkCurriculumSampler([2, 3], stages=[1, 3])
    sampler = ChunkCurriculumSampler([1, 2], stages=[1, 2])
    with pytest.raises(ValueError, match="differs"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "stages": [1, 4], "epochs_per_stage": 1, "num_rows": 2})


def test_curriculum_sampler_groups_rows_by_chunk_count():
    # three rows of 1 chunk and three of 2, groups of 3: each group is one length
    counts = [1, 2, 1, 2, 1, 2]
    sampler = ChunkCurriculumSampler(counts, stages=[2], seed=1, group_size=3)
    orders = set()
    for epoch in range(6):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert {frozenset(order[:3]), frozenset(order[3:])} == {frozenset({0, 2, 4}), frozenset({1, 3, 5})}
        orders.add(tuple(order))
    assert len(orders) > 1  # groups and the rows within them are reshuffled each epoch
    # 4 / 4 / 2 rows of 1 / 2 / 3 chunks in groups of 3: sorted, [1 1 1] [1 2 2] [2 2 3], then the partial [3] last
    counts = [1, 2, 1, 3, 2, 1, 2, 3, 1, 2]
    sampler = ChunkCurriculumSampler(counts, stages=[3], seed=2, group_size=3)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(10))
        groups = sorted(tuple(sorted(counts[i] for i in order[start:start + 3])) for start in (0, 3, 6))
        assert groups == [(1, 1, 1), (1, 2, 2), (2, 2, 3)] and counts[order[9]] == 3
    restored = ChunkCurriculumSampler(counts, stages=[3], seed=0, group_size=3)
    restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert list(restored) == order
    with pytest.raises(ValueError, match="group size"):
        ChunkCurriculumSampler(counts, stages=[3], group_size=5).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="group_size=0"):
        ChunkCurriculumSampler(counts, stages=[3], group_size=0)


def test_count_chunks_uses_real_tokens_only():
    dataset = datasets.Dataset.from_dict(
        {"attention_mask": [[1] * 16, [1] * 17, [1] * 5 + [0] * 27, [1] * 48 + [0] * 16]}
    )
    assert count_chunks(dataset, 16) == [1, 2, 1, 3]
    assert count_chunks(list(dataset), 16) == [1, 2, 1, 3]


class RecordingCollator(TitansDataCollator):
    """Chunks of 16 tokens; records each batch's width in tokens."""

    def __init__(self, widths: list[int]):
        super().__init__(pad_token_id=0, chunk_size=16)
        self.widths = widths

    def __call__(self, features):
        batch = super().__call__(features)
        self.widths.append(batch["input_ids"].shape[1])
        return batch


def test_curriculum_trains_short_rows_first(tiny_qwen3_dir, rows, tmp_path):
    widths = []
    trainer = make_trainer(
        tiny_qwen3_dir, tmp_path, rows, collator=RecordingCollator(widths), save_strategy="no", curriculum_chunks=[1, 3]
    )
    trainer.train()
    per_epoch = 2 * STEPS_PER_EPOCH
    assert widths[:per_epoch] == [16] * per_epoch  # epoch 0: the three 1-chunk rows, twice
    assert sorted(widths[per_epoch:]) == [16, 16, 16, 32, 32, 48]  # epoch 1: every row once


@pytest.mark.parametrize("curriculum, epochs", [(None, [[16, 48], [16, 48]]), ([1, 3], [[16, 16], [16, 48]])])
def test_group_by_length_batches_rows_of_one_chunk_count(tiny_qwen3_dir, rows, tmp_path, curriculum, epochs):
    # rows of 1, 2, 1, 3, 2, 1 chunks in batches of 3: [1 1 1] and [2 2 3] each epoch; with the curriculum's first
    # stage (1-chunk rows only) epoch 0 is two batches of 1-chunk rows
    widths = []
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows, collator=RecordingCollator(widths), save_strategy="no",
                           curriculum_chunks=curriculum, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                           train_sampling_strategy="group_by_length")
    before = trainable_weights(trainer.model)
    trainer.train()
    assert [sorted(widths[:2]), sorted(widths[2:])] == epochs
    after = trainable_weights(trainer.model)
    assert all(torch.isfinite(value).all() for value in after.values())
    assert any(not torch.equal(after[name], before[name]) for name in after), "no memory weight moved"


def test_group_by_length_needs_a_chunk_size(tiny_qwen3_dir, rows, tmp_path):
    with pytest.raises(ValueError, match="group_by_length needs a chunk size"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows, collator=TitansDataCollator(pad_token_id=0),
                     model=frozen_base_model(tiny_qwen3_dir), train_sampling_strategy="group_by_length")


# ---- checkpoints ----


CHECKPOINT_FILES = [
    "optimizer.pt",
    "rng_state.pth",
    "sampler_state.json",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.json",
]


def tokenizer_files(model_dir) -> list[str]:
    """What saving the tiny tokenizer writes: a checkpoint and the final memory hold it too."""
    with tempfile.TemporaryDirectory() as folder:
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
        return sorted(os.listdir(folder))


def test_checkpoint_holds_only_the_memory(tiny_qwen3_dir, rows, tmp_path):
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=2)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert sorted(os.listdir(checkpoint)) == sorted(
        CHECKPOINT_FILES + [MEMORY_CONFIG_NAME, MODEL_CONFIG_NAME, MEMORY_WEIGHTS_NAME]
        + tokenizer_files(tiny_qwen3_dir))
    saved = safetensors.torch.load_file(checkpoint / MEMORY_WEIGHTS_NAME)
    memory = trainer.model.memory_state_dict()
    assert sorted(saved) == sorted(memory) == sorted(trainable_weights(trainer.model))
    assert not [name for name in saved if name.startswith(("model.", "lm_head."))]
    assert all(torch.equal(saved[name], memory[name]) for name in memory)
    assert json.loads((checkpoint / "sampler_state.json").read_text())["epoch"] == 0
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2"]  # the lock went with the run
    # a checkpoint is a save_memory folder: it loads back onto the base
    reloaded = TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, checkpoint)
    assert all(torch.equal(reloaded.memory_state_dict()[n], w) for n, w in memory.items())


def test_checkpoint_of_any_frozen_base_model_holds_its_trainable_weights(tiny_qwen3_dir, rows, tmp_path):
    model = frozen_base_model(tiny_qwen3_dir)
    collator = TitansDataCollator(pad_token_id=0, chunk_size=16)
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows, collator=collator, model=model, max_steps=1)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    assert sorted(os.listdir(checkpoint)) == sorted(
        CHECKPOINT_FILES + [MEMORY_WEIGHTS_NAME] + tokenizer_files(tiny_qwen3_dir))
    saved = safetensors.torch.load_file(checkpoint / MEMORY_WEIGHTS_NAME)
    assert sorted(saved) == [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    ]
    assert all(torch.equal(saved[n], w) for n, w in trainable_weights(model).items())


@pytest.mark.parametrize(
    "stop_step, curriculum",
    [(2, None), (4, None), (5, [1, 3])],
    ids=["epoch0", "epoch1", "epoch1-curriculum"],
)
def test_resume_is_bitwise_exact(tiny_qwen3_dir, rows, uninterrupted, tmp_path, stop_step, curriculum):
    first = make_trainer(
        tiny_qwen3_dir, tmp_path, rows, callbacks=[StopAtStep(stop_step)], curriculum_chunks=curriculum
    )
    first.train()
    assert first.state.global_step == stop_step
    interrupted = trainable_weights(first.model)
    assert not all(torch.equal(interrupted[n], w) for n, w in uninterrupted[str(curriculum)].items())

    resumed = make_trainer(tiny_qwen3_dir, tmp_path, rows, curriculum_chunks=curriculum)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 * STEPS_PER_EPOCH
    final = trainable_weights(resumed.model)
    for name, weight in uninterrupted[str(curriculum)].items():
        assert torch.equal(final[name], weight), name


def test_resume_loads_memory_weights_and_optimizer(tiny_qwen3_dir, rows, tmp_path):
    first = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=2)
    first.train()
    fresh = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=2)
    assert not all(torch.equal(trainable_weights(fresh.model)[n], w) for n, w in trainable_weights(first.model).items())
    fresh._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    for name, weight in trainable_weights(first.model).items():
        assert torch.equal(trainable_weights(fresh.model)[name], weight)


def test_loading_a_folder_without_memory_weights_fails_clearly(tiny_qwen3_dir, rows, tmp_path):
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows)
    (tmp_path / "checkpoint-9").mkdir()
    with pytest.raises(FileNotFoundError, match="checkpoint-9.*memory_model.safetensors"):
        trainer._load_from_checkpoint(str(tmp_path / "checkpoint-9"))
    safetensors.torch.save_file({"lm_head.weight": torch.zeros(2)}, tmp_path / "checkpoint-9" / MEMORY_WEIGHTS_NAME)
    with pytest.raises(ValueError, match="missing.*unexpected.*lm_head.weight"):
        trainer._load_from_checkpoint(str(tmp_path / "checkpoint-9"))


def test_an_interrupted_checkpoint_is_never_resumed_from(tiny_qwen3_dir, rows, uninterrupted, tmp_path, caplog):
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows)
    save_rng_state = trainer._save_rng_state

    def killed_during_step_2(output_dir):
        if trainer.state.global_step == 2:
            raise KeyboardInterrupt("killed while writing checkpoint-2")
        save_rng_state(output_dir)

    trainer._save_rng_state = killed_during_step_2
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2"]  # the lock went with the run
    assert not (tmp_path / "checkpoint-2" / "trainer_state.json").exists()
    with pytest.raises(ValueError, match="checkpoint-2.*trainer_state.json is missing"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))

    # resuming takes the last complete checkpoint, says it passed over checkpoint-2, rewrites it, ends exact
    resumed = make_trainer(tiny_qwen3_dir, tmp_path, rows, save_total_limit=2)
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.checkpointing"):
        resumed.train(resume_from_checkpoint=True)
    assert any("skipping the incomplete checkpoint" in r.getMessage() and "checkpoint-2" in r.getMessage()
               for r in caplog.records)
    final = trainable_weights(resumed.model)
    assert all(torch.equal(final[n], w) for n, w in uninterrupted["None"].items())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5", "checkpoint-6"]


def test_save_model_writes_memory_only_and_atomically(tiny_qwen3_dir, rows, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows)
    trainer.save_model(str(tmp_path / "final"))
    assert sorted(os.listdir(tmp_path / "final")) == sorted(
        [MEMORY_CONFIG_NAME, MODEL_CONFIG_NAME, MEMORY_WEIGHTS_NAME, "training_args.json"]
        + tokenizer_files(tiny_qwen3_dir))

    def crash(state_dict, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(titans_hf.modeling.memory_folder, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_model(str(tmp_path / "final2"))
    assert not (tmp_path / "final2" / MEMORY_WEIGHTS_NAME).exists()


def test_one_log_line_per_logging_step(tiny_qwen3_dir, rows, tmp_path, capsys):
    trainer = make_trainer(
        tiny_qwen3_dir, tmp_path, rows, save_strategy="no", max_steps=4, log_every_batches=4, logging_steps=None
    )
    assert trainer.args.logging_steps == 2
    rates = []
    trainer.model.register_forward_hook(lambda module, args, output: rates.append(float(output.write_rate.detach())))
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(printed) == 2  # steps 2 and 4, each once
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [2, 4]
    # beside each loss, the mean write rate of the batches since the log before (4 each: logging_steps x accumulation)
    per_log = len(rates) // 2
    assert per_log >= 2 and all(0 < rate < 1 for rate in rates)
    for entry, batches in zip(logged, (rates[:per_log], rates[per_log:])):
        assert entry["write_rate"] == pytest.approx(sum(batches) / len(batches), abs=2e-6)


def test_the_write_cost_grows_as_scheduled(tiny_qwen3_dir, rows, tmp_path):
    """Each training forward gets the config's write cost times `write_cost_factor(global_step / max_steps)`: 1 before
    the span, `write_cost_growth` after it, linear between; each log line shows the weight its last batch got."""
    model = memory_model(tiny_qwen3_dir)
    assert model.config.memory_config.write_cost == 1.0
    model.config.memory_config.write_cost = 0.5
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows, model=model, save_strategy="no", max_steps=8,
                           write_cost_growth=3.0, write_cost_growth_span=[0.25, 0.75])
    weights = []
    trainer.model.register_forward_pre_hook(lambda module, args, kwargs: weights.append(kwargs.get("write_cost")),
                                            with_kwargs=True)
    trainer.train()
    # steps 0..7 of 8, two micro-batches each: progress 0, 1/8, ..., 7/8
    factors = [1.0, 1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]
    assert weights == [0.5 * factor for factor in factors for _ in range(2)]
    logged = [entry["write_cost"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == [0.5 * factor for factor in factors]
    args = trainer.args
    assert [args.write_cost_factor(p) for p in (0.0, 0.2499, 0.25, 0.5, 0.7499, 0.75, 1.0)] == pytest.approx(
        [1.0, 1.0, 1.0, 2.0, 2.9996, 3.0, 3.0])
    # the defaults are the recipe's: the config's weight until 30 % of the steps, 8 times it from 60 % on
    recipe = make_args(tmp_path)
    assert (recipe.write_cost_growth, recipe.write_cost_growth_span) == (8.0, [0.3, 0.6])
    assert [recipe.write_cost_factor(p) for p in (0.29, 0.45, 0.6)] == pytest.approx([1.0, 4.5, 8.0])
    for bad in (dict(write_cost_growth=-1.0), dict(write_cost_growth=float("nan")),
                dict(write_cost_growth_span=[0.6, 0.3]), dict(write_cost_growth_span=[0.3]),
                dict(write_cost_growth_span=[0.3, 1.5])):
        with pytest.raises(ValueError, match="write_cost_growth"):
            make_args(tmp_path, **bad)


def test_model_without_trainable_parameters_is_refused(tiny_qwen3_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        TitansTrainer(model=model, args=make_args(tmp_path))


def test_load_best_model_at_end_restores_the_best_memory(tiny_qwen3_dir, rows, tmp_path):
    trainer = make_trainer(
        tiny_qwen3_dir,
        tmp_path,
        rows,
        eval_dataset=rows,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # "best" = highest eval loss: training lowers it, so the best is not the last step
    )
    trainer.train()
    losses = {entry["step"]: entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry}
    best_step = max(losses, key=losses.get)
    assert best_step != 4  # else loading the best memory would change nothing
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_step}")
    best = safetensors.torch.load_file(tmp_path / f"checkpoint-{best_step}" / MEMORY_WEIGHTS_NAME)
    assert all(torch.equal(trainable_weights(trainer.model)[n], w) for n, w in best.items())


def test_trained_base_weights_stay_out_of_the_memory_file_and_resume(tiny_qwen3_dir, rows, tmp_path):
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            checkpoint_chunks=False, freeze_base=False)
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows, model=model, max_steps=2)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    memory = safetensors.torch.load_file(checkpoint / MEMORY_WEIGHTS_NAME)
    base = safetensors.torch.load_file(checkpoint / TRAINABLE_BASE_WEIGHTS_NAME)
    assert sorted(memory) == sorted(model.memory_state_dict())
    assert base and all(name.startswith(("model.", "lm_head.")) for name in base)
    assert sorted(memory) + sorted(base) == sorted(memory | base) == sorted(trainable_weights(model))
    TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, checkpoint)  # the memory file alone loads

    torch.manual_seed(1)
    fresh = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            checkpoint_chunks=False, freeze_base=False)
    make_trainer(tiny_qwen3_dir, tmp_path, rows, model=fresh, max_steps=2)._load_from_checkpoint(str(checkpoint))
    for name, weight in trainable_weights(model).items():
        assert torch.equal(trainable_weights(fresh)[name], weight), name


def test_evaluate_reports_the_exact_match_of_the_labelled_answers(tiny_qwen3_dir, tmp_path):
    """Half the rows end in the model's own greedy continuation (every answer token predicted: exact match), the
    other half in random tokens (none right): evaluate() reports 0.5, computed from label_predictions."""
    model = memory_model(tiny_qwen3_dir).eval()
    vocab = model.config.text_config.vocab_size
    generator = torch.Generator().manual_seed(3)
    columns = {"input_ids": [], "attention_mask": [], "labels": []}
    for index, length in enumerate([20, 28, 36, 44]):
        prompt = torch.randint(1, vocab, (1, length), generator=generator)
        if index % 2 == 0:
            ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=ANSWER_TOKENS,
                                 do_sample=False, pad_token_id=0)[0]
        else:
            ids = torch.cat([prompt[0], torch.randint(1, vocab, (ANSWER_TOKENS,), generator=generator)])
        columns["input_ids"].append(ids.tolist())
        columns["attention_mask"].append([1] * len(ids))
        columns["labels"].append([-100] * length + ids[length:].tolist())
    rows = datasets.Dataset.from_dict(columns)
    trainer = TitansTrainer(model=model, args=make_args(tmp_path, per_device_eval_batch_size=2), eval_dataset=rows,
                            processing_class=AutoTokenizer.from_pretrained(tiny_qwen3_dir),
                            compute_metrics=answer_exact_match)
    metrics = trainer.evaluate()
    assert metrics["eval_exact_match"] == 0.5
    # the random answers are not all wrong by accident: each misses at least one token
    for index in (1, 3):
        ids = torch.tensor([columns["input_ids"][index]])
        with torch.no_grad():
            greedy = model(ids).logits[0].argmax(-1)
        length = len(columns["input_ids"][index]) - ANSWER_TOKENS
        assert not torch.equal(greedy[length - 1:-1], ids[0, length:])


# ---- State Passing ----


def test_memory_states_continue_a_stream_exactly(tiny_qwen3_dir):
    """forward(memory_states=the end of a first part) reads the second part as the one-pass stream does (chunk-local
    attention: only the memory crosses chunks), and its output's memory_states are the one pass's end."""
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            attend_previous_chunk=False).eval()
    for block in model.memory.values():  # a memory whose reads matter (W_O starts at zero)
        torch.nn.init.normal_(block.output_weight, std=0.5)
    ids = torch.randint(1, model.config.text_config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)
        first = model(ids[:, :32], memory_states=model.init_memory_states(2))
        second = model(ids[:, 32:], memory_states=first.memory_states)
    torch.testing.assert_close(second.logits, whole.logits[:, 32:], rtol=1e-5, atol=1e-5)
    fresh = model(ids[:, 32:]).logits
    assert not torch.allclose(fresh, whole.logits[:, 32:], atol=1e-3)  # the carried memory is what made it equal
    with pytest.raises(ValueError, match="memory_states must hold 2 rows"):
        model(ids[:, :16], memory_states=model.init_memory_states(3))


def test_passed_memory_states_mix_rows_by_share():
    """share 1: every row the previous micro-batch had starts from its end (weights and momentum), a row more
    starts fresh; share 0: all fresh; convolution tail and position always fresh."""
    from titans_hf.modeling.memory import NeuralMemory
    from titans_hf.training.trainer import passed_memory_states

    memory = NeuralMemory(8, 2, 4, memory_depth=1, memory_chunk_size=4, max_lr=0.5, update_rule="delta",
                          max_memory_norm=3.0)
    _, ended = memory(torch.randn(2, 8, 8))
    ended = ended.detach()
    fresh = {3: memory.init_state(3)}
    torch.manual_seed(0)
    mixed = passed_memory_states(fresh, {3: ended}, 1.0)[3]
    assert torch.equal(mixed.weights[0][:2], ended.weights[0])
    assert torch.equal(mixed.weights[0][2], fresh[3].weights[0][2])
    assert mixed.batch_start_weights is mixed.weights
    assert torch.equal(mixed.conv_tail, fresh[3].conv_tail) and mixed.position == 0
    assert mixed.weights[0].requires_grad  # the fresh row still trains the initial weights
    assert passed_memory_states(fresh, {3: ended}, 0.0) is fresh


def test_state_passing_resumes_bitwise_from_the_states_it_saved(tiny_qwen3_dir, rows, tmp_path):
    """The states the last micro-batch ended in are saved beside each checkpoint and resumed from: a run stopped at
    step 2 and resumed ends bitwise where the uninterrupted one does. Every row passes its state on (share 1), so the
    resumed run's first micro-batch starts from the saved states: the same checkpoint with those states doubled ends
    elsewhere (with share 0.5 this seed's first draw after the resume starts the row fresh, and would hide whether
    the saved states are read at all)."""
    full = make_trainer(tiny_qwen3_dir, tmp_path / "full", rows, save_strategy="no", state_passing=1.0)
    full.train()
    first = make_trainer(tiny_qwen3_dir, tmp_path / "run", rows, callbacks=[StopAtStep(2)], state_passing=1.0)
    first.train()
    shutil.copytree(tmp_path / "run", tmp_path / "tampered")
    resumed = make_trainer(tiny_qwen3_dir, tmp_path / "run", rows, state_passing=1.0)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for name, weight in trainable_weights(full.model).items():
        assert torch.equal(trainable_weights(resumed.model)[name], weight), name

    states = tmp_path / "tampered" / "checkpoint-2" / "passed_memory_states.safetensors"
    doubled = {key: tensor * 2 if ".weights." in key or ".batch_start_weights." in key else tensor
               for key, tensor in safetensors.torch.load_file(str(states)).items()}
    safetensors.torch.save_file(doubled, str(states))
    tampered = make_trainer(tiny_qwen3_dir, tmp_path / "tampered", rows, state_passing=1.0)
    tampered.train(resume_from_checkpoint=True)
    assert not all(torch.equal(trainable_weights(tampered.model)[name], weight)
                   for name, weight in trainable_weights(full.model).items())


class SeesPassedStates(TrainerCallback):
    """Records, at each save, the step and whether its checkpoint already holds the passed states."""

    def __init__(self):
        self.seen = []

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.seen.append((state.global_step, os.path.isfile(os.path.join(folder, PASSED_STATES))))


@pytest.fixture(scope="module")
def state_passing_runs(tiny_qwen3_dir, rows, tmp_path_factory):
    """Under State Passing (share 1): the trainer of an uninterrupted run of 2 epochs, the output_dir of the same run
    stopped after the checkpoint of step 2, and what a user's callback saw of that run's checkpoints at each save."""
    full = make_trainer(tiny_qwen3_dir, tmp_path_factory.mktemp("full"), rows, save_strategy="no", state_passing=1.0)
    full.train()
    stopped, user_callback = tmp_path_factory.mktemp("stopped"), SeesPassedStates()
    make_trainer(tiny_qwen3_dir, stopped, rows, callbacks=[StopAtStep(2), user_callback], state_passing=1.0).train()
    return full, stopped, user_callback.seen


def test_state_passing_is_resumed_by_its_callback_alone(tiny_qwen3_dir, rows, state_passing_runs, tmp_path):
    """`PassedStatesCallback` is what saves and restores the passed states: the same resume as the bitwise one
    (test_state_passing_resumes_bitwise_from_the_states_it_saved) with the callback taken out of the trainer's
    callbacks starts its first micro-batch fresh, so it ends elsewhere than the uninterrupted run, and none of its
    checkpoints holds the states. With it, every other callback's on_save finds them in the checkpoint."""
    from titans_hf.training.callbacks import PassedStatesCallback

    full, stopped, seen = state_passing_runs
    assert seen == [(1, True), (2, True)]
    run = shutil.copytree(stopped, tmp_path / "run")
    resumed = make_trainer(tiny_qwen3_dir, run, rows, state_passing=1.0)
    assert [type(c) for c in resumed.callback_handler.callbacks].count(PassedStatesCallback) == 1
    resumed.remove_callback(PassedStatesCallback)
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert resumed.state.global_step == 2 * STEPS_PER_EPOCH
    assert [step for step in range(1, 7) if (run / f"checkpoint-{step}" / PASSED_STATES).is_file()] == [1, 2]
    assert not all(torch.equal(trainable_weights(resumed.model)[name], weight)
                   for name, weight in trainable_weights(full.model).items())


def test_passed_states_callback_writes_the_states_into_the_checkpoint_and_reads_them_back(tmp_path, monkeypatch):
    """on_save writes the states into checkpoint-{global_step} of output_dir (no temporary file left), resume_from
    reads them back and on_train_begin hands them to the run: bitwise the states saved. A fresh run starts with none;
    a write that fails removes the checkpoint, which could not be resumed without it, and a full disk says so."""
    from transformers import TrainerControl, TrainerState

    from titans_hf.modeling.memory import NeuralMemory
    from titans_hf.training import checkpointing
    from titans_hf.training.callbacks import PassedStatesCallback

    torch.manual_seed(0)
    memory = NeuralMemory(8, 2, 4, memory_depth=1, memory_chunk_size=4, max_lr=0.5, update_rule="delta",
                          max_memory_norm=3.0)
    _, ended = memory(torch.randn(2, 8, 8))

    class Model(torch.nn.Module):  # the one method of a TitansQwen that the callback uses
        def init_memory_states(self, rows):
            return {3: memory.init_state(rows)}

    args, control = make_args(tmp_path, state_passing=1.0), TrainerControl()
    callback = PassedStatesCallback()
    callback.states = {3: ended.detach()}
    (tmp_path / "checkpoint-7").mkdir()
    callback.on_save(args, TrainerState(global_step=7), control)
    assert os.listdir(tmp_path / "checkpoint-7") == [PASSED_STATES]
    saved = safetensors.torch.load_file(str(tmp_path / "checkpoint-7" / PASSED_STATES))
    assert saved.keys() == {f"3.{key}" for key in ended.state_dict()}
    assert all(torch.equal(saved[f"3.{key}"], tensor) for key, tensor in ended.state_dict().items())

    restored = PassedStatesCallback()
    restored.resume_from(tmp_path / "checkpoint-7", args, Model())
    assert restored.states is None  # read before training, handed over when it begins
    restored.on_train_begin(args, TrainerState(), control)
    assert restored.states.keys() == {3}
    assert all(torch.equal(restored.states[3].state_dict()[key], tensor) for key, tensor in ended.state_dict().items())
    restored.resume_from(None, args, Model())
    restored.on_train_begin(args, TrainerState(), control)
    assert restored.states is None

    def full_disk(tensors, path):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing, "save_file", full_disk)
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text("{}")
    with pytest.raises(OSError, match=re.escape(f"{tmp_path / 'checkpoint-8' / PASSED_STATES}: the disk is full")):
        callback.on_save(args, TrainerState(global_step=8), control)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-7"]


def test_state_passing_is_refused_under_a_hyperparameter_search(tmp_path):
    """A hyperparameter search writes a trial's checkpoints into a folder the callbacks' events do not name, so the
    passed states could not be saved beside them: refused when training begins."""
    from transformers import TrainerControl, TrainerState

    from titans_hf.training.callbacks import PassedStatesCallback

    with pytest.raises(ValueError, match="run the search with state_passing 0"):
        PassedStatesCallback().on_train_begin(make_args(tmp_path, state_passing=0.5),
                                              TrainerState(is_hyper_param_search=True), TrainerControl())
    PassedStatesCallback().on_train_begin(make_args(tmp_path), TrainerState(is_hyper_param_search=True),
                                          TrainerControl())


def test_state_passing_resumed_from_huge_but_finite_states_ends_elsewhere(tiny_qwen3_dir, rows, state_passing_runs,
                                                                          tmp_path):
    """Passed states that are finite but that no run ends in (the saved weights x 1e30) are not refused: only states
    that are not finite or not this memory's are (tests/test_hostile_resume.py), since how large a memory's weights
    may grow depends on its update rule and its trained initial weights. The resume takes them as they are and trains
    to its end: its first micro-batch starts from them, so the first loss it logs and the trainable weights it ends
    with (finite) differ from the uninterrupted run's; it is never silently the uninterrupted run."""
    full, stopped, _ = state_passing_runs
    run = shutil.copytree(stopped, tmp_path / "run")
    states = run / "checkpoint-2" / PASSED_STATES
    huge = {key: tensor * 1e30 if ".weights." in key or ".batch_start_weights." in key else tensor
            for key, tensor in safetensors.torch.load_file(str(states)).items()}
    assert all(bool(torch.isfinite(tensor).all()) for tensor in huge.values())
    safetensors.torch.save_file(huge, str(states))
    resumed = make_trainer(tiny_qwen3_dir, run, rows, state_passing=1.0)
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert resumed.state.global_step == 2 * STEPS_PER_EPOCH
    losses = {entry["step"]: entry["loss"] for entry in full.state.log_history if "loss" in entry}
    (first,) = [entry["loss"] for entry in resumed.state.log_history if entry.get("step") == 3 and "loss" in entry]
    assert math.isfinite(first) and first != losses[3]
    weights = trainable_weights(resumed.model)
    assert all(bool(torch.isfinite(weight).all()) for weight in weights.values())
    assert not all(torch.equal(weights[name], weight) for name, weight in trainable_weights(full.model).items())
