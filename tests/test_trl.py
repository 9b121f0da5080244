"""TRL 1.16's SFT, DPO and GRPO trainers (and a plain Trainer) on a TitansQwen: exactly the memory trains.

TRL computes its losses through `model(..., fused_lm_head=True)`, which calls `model.base_model` and then the LM head
tile by tile; these tests run the real trainers on a tiny local base and check what they change, that the memory
runs during training and that its gradient is not zero. Gradient checkpointing is checked for every attention
setting against the same model without it.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from test_completions import open_memory
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import MEMORY_CONFIG_NAME, MEMORY_WEIGHTS_NAME, is_memory_name

trl = pytest.importorskip("trl")  # the `trl` extra; the `test` extra installs it

CHUNK = 8


def memory_model(model_dir, **settings) -> TitansQwenForCausalLM:
    """A MAG memory after layer 1 of the tiny base, chunks of 8 tokens, the same init on every call."""
    torch.manual_seed(0)
    settings = {"chunk_size": CHUNK, "memory_layers": [1], "memory_chunk_size": 4, "memory_head_dim": 16,
                "checkpoint_chunks": False, **settings}
    return TitansQwenForCausalLM.from_base(model_dir, **settings)


def base_weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if not is_memory_name(name)}


def memory_weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.memory_state_dict().items()}


class MemoryCalls:
    """Counts calls of the model's memory blocks, in training mode and with gradients on (what a trainer's loss
    runs) and otherwise (generation, references)."""

    def __init__(self, model: TitansQwenForCausalLM):
        self.training = self.other = 0
        self.handles = [block.register_forward_hook(self.hook) for block in model.memory.values()]

    def hook(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled():
            self.training += 1
        else:
            self.other += 1


def assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer) -> None:
    """The base bitwise as loaded; every memory tensor finite, some changed; the memory ran in the trainer's loss;
    the logged gradient norm is positive (a memory outside the loss would leave it 0)."""
    for name, tensor in model.state_dict().items():
        if name in base_before:
            assert torch.equal(tensor, base_before[name]), f"{name} changed: the base must stay as loaded"
    after = model.memory_state_dict()
    assert all(torch.isfinite(value).all() for value in after.values())
    assert any(not torch.equal(after[name], memory_before[name]) for name in after), "no memory weight moved"
    assert calls.training > 0, "the memory never ran in the trainer's loss"
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert norms and all(norm > 0 for norm in norms), f"grad norms {norms}: no gradient reached the memory"


def trl_args(config_class, output_dir, **overrides):
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0)
    return config_class(**{**values, **overrides})


def texts(count: int, seed: int = 0) -> list[str]:
    """Short stories of 20-40 tokens of the tiny tokenizer: several chunks each."""
    generator = torch.Generator().manual_seed(seed)
    actors, places = ["Mary", "John", "Sandra", "Daniel"], ["kitchen", "garden", "office", "bedroom", "hallway"]
    rows = []
    for _ in range(count):
        pick = lambda options: options[int(torch.randint(len(options), (1,), generator=generator))]  # noqa: E731
        sentences = [f"{pick(actors)} went to the {pick(places)}." for _ in range(2 + int(torch.randint(3, (1,))))]
        rows.append(" ".join(sentences))
    return rows


# ---- what TRL reaches for ----


def test_fused_lm_head_runs_the_memory(tiny_qwen3_dir):
    """`add_fused_lm_head` (how every TRL trainer scores tokens) gives the memory's log-probabilities, to 1e-5 of
    the model's own logits; the memory-off reference gives the base's chunk by chunk; neither is the bare Qwen."""
    model = memory_model(tiny_qwen3_dir)
    open_memory(model)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, model.config.text_config.vocab_size, (2, 3 * CHUNK + 3), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0  # a left-padded row
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    def reference_log_probs(logits):
        log_probs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
        return log_probs.masked_fill(labels[:, 1:] == -100, 0)

    with torch.no_grad():
        with_memory = reference_log_probs(model(input_ids=input_ids, attention_mask=attention_mask).logits)
        with model.memory_disabled():
            memory_off = reference_log_probs(model(input_ids=input_ids, attention_mask=attention_mask).logits)
        bare_base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
        bare = reference_log_probs(bare_base(input_ids=input_ids, attention_mask=attention_mask).logits)
    reference = model.memory_off_reference()
    trl.trainer.utils.add_fused_lm_head(model)
    trl.trainer.utils.add_fused_lm_head(reference)
    with torch.no_grad():
        fused = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        fused_off = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(fused.log_probs, with_memory, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_off.log_probs, memory_off, atol=1e-5, rtol=1e-5)
    assert (with_memory - memory_off).abs().max() > 1e-3, "the opened memory must change the log-probabilities"
    assert (memory_off - bare).abs().max() > 1e-3, "attention across 3 chunks differs from the bare base's"
    assert model.get_decoder()(input_ids=input_ids).last_hidden_state.shape == (2, input_ids.shape[1], 64)


def test_packed_batches_are_refused(tiny_qwen3_dir):
    model = memory_model(tiny_qwen3_dir)
    input_ids = torch.randint(1, 100, (1, 12))
    position_ids = torch.tensor([list(range(6)) * 2])  # two documents in one row
    with pytest.raises(ValueError, match="padding-free"):
        model.base_model(input_ids=input_ids, position_ids=position_ids)
    model.base_model(input_ids=input_ids, position_ids=torch.arange(12)[None])  # one document: fine


# ---- gradient checkpointing ----


@pytest.mark.parametrize("attend_previous_chunk", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_qwen3_dir, attend_previous_chunk):
    """`gradient_checkpointing_enable()` (what Trainer / TRL call) recomputes chunks: same loss and gradients."""
    input_ids = torch.randint(1, 200, (2, 3 * CHUNK + 5), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0

    def gradients(checkpointing: bool):
        model = memory_model(tiny_qwen3_dir, attend_previous_chunk=attend_previous_chunk)
        open_memory(model)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert model.is_gradient_checkpointing
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    loss, plain = gradients(False)
    checkpointed_loss, checkpointed = gradients(True)
    torch.testing.assert_close(checkpointed_loss, loss, atol=0, rtol=0)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(grad.abs().sum() > 0 for grad in plain.values())


def test_plain_trainer_with_gradient_checkpointing(tiny_qwen3_dir, tmp_path):
    """A plain `transformers.Trainer` with gradient_checkpointing=True trains the memory across chunks."""
    model = memory_model(tiny_qwen3_dir)
    ids = torch.randint(1, 200, (4, 3 * CHUNK), generator=torch.Generator().manual_seed(0)).tolist()
    rows = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)


# ---- SFT ----


def test_sft_trainer_trains_the_memory_and_saves_it(tiny_qwen3_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = memory_model(tiny_qwen3_dir)
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    rows = datasets.Dataset.from_dict({"text": texts(4)})
    args = trl_args(trl.SFTConfig, tmp_path / "sft", gradient_checkpointing=True, max_length=64)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)
    trainer.save_model(str(tmp_path / "saved"))
    saved = sorted(path.name for path in (tmp_path / "saved").iterdir())
    assert MEMORY_WEIGHTS_NAME in saved and MEMORY_CONFIG_NAME in saved and "model.safetensors" not in saved
    reloaded = TitansQwenForCausalLM.from_pretrained(tmp_path / "saved")
    for name, value in model.memory_state_dict().items():
        assert torch.equal(reloaded.memory_state_dict()[name], value)


# ---- DPO ----


def preference_rows(count: int) -> datasets.Dataset:
    stories = texts(count, seed=1)
    return datasets.Dataset.from_dict({
        "prompt": [f"{story} Where is Mary? Answer:" for story in stories],
        "chosen": [" kitchen" for _ in stories],
        "rejected": [" garden" for _ in stories],
    })


def test_dpo_trainer_with_the_memory_off_reference(tiny_qwen3_dir, tmp_path):
    """DPO against `memory_off_reference()` (the base chunk by chunk, on the policy's own weights): the memory
    trains, the reference is called without gradients, no second model is loaded."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = memory_model(tiny_qwen3_dir)
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    args = trl_args(trl.DPOConfig, tmp_path / "dpo", gradient_checkpointing=True, max_length=64, beta=0.5)
    trainer = trl.DPOTrainer(model=model, ref_model=model.memory_off_reference(), args=args,
                             train_dataset=preference_rows(4), processing_class=tokenizer)
    assert not any(True for _ in trainer.ref_model.parameters()), "the reference must hold no weights of its own"
    # what TRL hashes to key cached reference scores (precompute_ref_log_probs): the base it computes with
    assert trl.trainer.utils.hash_module(trainer.ref_model) == trl.trainer.utils.hash_module(
        AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir))
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)
    assert calls.other == 0, "the memory-off reference ran the memory"
    assert any("rewards/margins" in entry for entry in trainer.state.log_history)


def test_dpo_trainer_without_ref_model_loads_the_named_base(tiny_qwen3_dir, tmp_path):
    """`ref_model=None`: TRL loads the model `config.name_or_path` names, which `from_base` sets to the base."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = memory_model(tiny_qwen3_dir)
    assert model.config.name_or_path == str(tiny_qwen3_dir)
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    args = trl_args(trl.DPOConfig, tmp_path / "dpo", max_length=64)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=preference_rows(4), processing_class=tokenizer)
    assert type(trainer.ref_model).__name__ == "Qwen3ForCausalLM"
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)


# ---- GRPO ----


def test_grpo_trainer_generates_and_scores_through_the_memory(tiny_qwen3_dir, tmp_path):
    """GRPO on prompts of mixed lengths (left padding): generation runs the memory (without gradients), the loss
    runs it with gradients, and exactly the memory trains."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = memory_model(tiny_qwen3_dir)
    open_memory(model)  # rewards must differ within a group for a non-zero advantage: sample from a moved model
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    prompts = [story + " Where is Mary? Answer:" for story in texts(4, seed=2)]
    assert len({len(tokenizer(prompt).input_ids) for prompt in prompts}) > 1, "prompts of one length"

    def reward(completion_ids, **kwargs) -> list[float]:  # any reward that differs between sampled completions
        return [float(sum(token % 5 for token in ids)) for ids in completion_ids]

    args = trl_args(trl.GRPOConfig, tmp_path / "grpo", num_generations=2, max_completion_length=4,
                    gradient_checkpointing=True, temperature=1.5)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                              processing_class=tokenizer)
    trainer.train()
    assert calls.other > 0, "generation never ran the memory"
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)


# ---- titans_hf.training.trl_trainers: resume, references without a second model ----


def test_titans_sft_trainer_resumes_exactly(tiny_qwen3_dir, tmp_path):
    """4 steps in one run == 2 steps, a memory-only checkpoint, and 2 more resumed from it (bitwise)."""
    from titans_hf.training.trl_trainers import TitansSFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    rows = datasets.Dataset.from_dict({"text": texts(8)})

    def run(output_dir, max_steps, resume=None):
        model = memory_model(tiny_qwen3_dir)
        args = trl_args(trl.SFTConfig, output_dir, max_steps=4, save_strategy="steps", save_steps=2,
                        max_length=64, gradient_checkpointing=True)
        trainer = TitansSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
        if max_steps < 4:  # stop after the checkpoint, as an interrupted run does
            trainer.add_callback(StopAt(max_steps))
        trainer.train(resume_from_checkpoint=resume)
        return model

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "cut", 2)
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    assert (checkpoint / MEMORY_WEIGHTS_NAME).is_file() and not (checkpoint / "model.safetensors").exists()
    resumed = run(tmp_path / "cut", 4, resume=str(checkpoint))
    for name, value in whole.memory_state_dict().items():
        assert torch.equal(resumed.memory_state_dict()[name], value), name
    assert any(not torch.equal(value, memory_model(tiny_qwen3_dir).memory_state_dict()[name])
               for name, value in whole.memory_state_dict().items())


def test_titans_sft_trainer_torch_compile_compiles_the_chunk_step(tiny_qwen3_dir, tmp_path, one_thread):
    """SFTConfig(torch_compile=True): the chunk step is compiled (compile_chunks, aot_eager here), accelerate
    compiles nothing, and the memory takes the SGD steps it takes eagerly (with Adam, float noise in gradients near
    zero flips the sign of a first step; fp32: SFTConfig autocasts to bf16 even on a CPU)."""
    from accelerate.utils import DynamoBackend

    from titans_hf.training.trl_trainers import TitansSFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    rows = datasets.Dataset.from_dict({"text": texts(4)})
    trained = {}
    for compiled in (False, True):
        torch.compiler.reset()
        model = memory_model(tiny_qwen3_dir)
        open_memory(model)
        args = trl_args(trl.SFTConfig, tmp_path / str(compiled), max_steps=2, max_length=64, optim="sgd", bf16=False,
                        torch_compile=compiled, torch_compile_backend="aot_eager" if compiled else None)
        trainer = TitansSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
        trainer.train()
        trained[compiled] = model.memory_state_dict()
    torch.compiler.reset()
    assert model.model._compiled_chunk_step is not None
    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    for name, value in trained[False].items():
        torch.testing.assert_close(trained[True][name], value, rtol=1e-5, atol=1e-6, msg=name)


class StopAt(__import__("transformers").TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_titans_dpo_trainer_defaults_to_the_memory_off_reference(tiny_qwen3_dir, tmp_path):
    from titans_hf.modeling.memory_off_reference import TitansMemoryOffReference
    from titans_hf.training.trl_trainers import TitansDPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = memory_model(tiny_qwen3_dir)
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    args = trl_args(trl.DPOConfig, tmp_path / "dpo", max_length=64)
    trainer = TitansDPOTrainer(model=model, args=args, train_dataset=preference_rows(4), processing_class=tokenizer)
    assert isinstance(trainer.ref_model, TitansMemoryOffReference) and trainer.ref_model.policy is model
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)
    with pytest.raises(ValueError, match="sync_ref_model"):
        TitansDPOTrainer(model=model, args=trl_args(trl.DPOConfig, tmp_path / "sync", sync_ref_model=True),
                         train_dataset=preference_rows(2), processing_class=tokenizer)


def test_titans_grpo_trainer_kl_against_the_memory_off_reference(tiny_qwen3_dir, tmp_path):
    """beta > 0: the KL term is taken against the memory-off model; at step 1 (policy == its init, and the MAG
    memory's output starts at zero) it is exactly 0, then the memory moves the policy away from it."""
    from titans_hf.modeling.memory_off_reference import TitansMemoryOffReference
    from titans_hf.training.trl_trainers import TitansGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = memory_model(tiny_qwen3_dir)
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    prompts = [story + " Where is Mary? Answer:" for story in texts(4, seed=3)]

    def reward(completion_ids, **kwargs) -> list[float]:
        return [float(sum(token % 5 for token in ids)) for ids in completion_ids]

    args = trl_args(trl.GRPOConfig, tmp_path / "grpo", num_generations=2, max_completion_length=4, beta=0.1,
                    max_steps=3, temperature=1.5)
    trainer = TitansGRPOTrainer(model=model, reward_funcs=reward, args=args,
                                train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                processing_class=tokenizer)
    assert isinstance(trainer.ref_model, TitansMemoryOffReference)
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == 0.0 and kl[-1] > 0.0, kl


def test_titans_dpo_trainer_on_a_dpo_store(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    """The rows of a titans_tokens dpo store are TRL's tokenized columns: TitansDPOTrainer trains on them as they are
    (TRL's DPOTrainer would look for text columns: KeyError 'chosen')."""
    import json

    from titans_hf.data.prepare import prepare
    from titans_hf.training.trl_trainers import TitansDPOTrainer

    records = [{"prompt": story + " Where is Mary?", "chosen": " kitchen", "rejected": " garden"} for story in texts(4)]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    [store] = prepare(jsonl, tmp_path / "pairs.h5", tiny_tokenizer_dir, train_type="dpo")
    rows = datasets.load_dataset("titans_tokens", data_files=str(store), train_type="dpo",
                                 cache_dir=str(tmp_path / "cache"))["train"]
    assert rows.column_names == ["prompt_ids", "chosen_ids", "rejected_ids"]
    with pytest.raises(KeyError, match="chosen"):
        trl.DPOTrainer(model=memory_model(tiny_qwen3_dir), args=trl_args(trl.DPOConfig, tmp_path / "plain"),
                       train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    model = memory_model(tiny_qwen3_dir)
    base_before, memory_before, calls = base_weights(model), memory_weights(model), MemoryCalls(model)
    trainer = TitansDPOTrainer(model=model, args=trl_args(trl.DPOConfig, tmp_path / "dpo", max_length=64),
                               train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    trainer.train()
    assert_trained_exactly_the_memory(model, base_before, memory_before, calls, trainer)
