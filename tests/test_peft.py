"""LoRA (PEFT) on the base trained together with the memory: training, gradients, saving, loading, resuming, the Hub,
hostile adapter folders. Real PEFT classes (LoraConfig, its LoRA layers, PeftModel) on the tiny local Qwen3."""

from __future__ import annotations

import json
import os

import datasets
import pytest
import safetensors.torch
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from test_hub import BASE_REPO_ID, REPO_ID, hub, hub_token  # noqa: F401  (the loopback Hub and its token)
from test_trainer import StopAtStep, make_args
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from titans_hf.data.collator import TitansDataCollator
from titans_hf.lora import add_lora, has_lora
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MEMORY_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    MODEL_CONFIG_NAME,
    TRAINABLE_BASE_WEIGHTS_NAME,
    file_key,
    is_memory_name,
)
from titans_hf.training import TitansTrainer

FOLDER_FILES = {MEMORY_CONFIG_NAME, MEMORY_WEIGHTS_NAME, MODEL_CONFIG_NAME, ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME}
TARGETS = ["q_proj", "v_proj"]
STEPS = 4  # 8 rows, batch 1, gradient accumulation 2, 1 epoch


def lora_model(model_dir, checkpoint_chunks: bool = False, **lora) -> TitansQwenForCausalLM:
    """A TitansQwen (chunks of 16 tokens) with LoRA of rank 4 on q_proj and v_proj; same init every call."""
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(model_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            checkpoint_chunks=checkpoint_chunks)
    return add_lora(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **lora}))


def parts(model) -> dict[str, dict[str, torch.Tensor]]:
    """The model's weights by part: base, memory, lora."""
    groups = {"base": {}, "memory": {}, "lora": {}}
    for name, param in model.named_parameters():
        part = "lora" if ".lora_" in name else "memory" if is_memory_name(name) else "base"
        groups[part][name] = param.detach().clone()
    return groups


def perturb(model, scale: float = 0.1) -> None:
    """Move every trainable weight off its init (W_O and lora_B start at zero), as training would."""
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(scale * torch.randn_like(param))


def make_rows(vocab_size: int, count: int = 8, length: int = 40) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (count, length), generator=generator).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length] * count, "labels": ids})


def make_trainer(model_dir, output_dir, rows, callbacks=None, model=None, **overrides) -> TitansTrainer:
    return TitansTrainer(model=model if model is not None else lora_model(model_dir),
                         args=make_args(output_dir, **{"num_train_epochs": 1, **overrides}), train_dataset=rows,
                         processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=callbacks)


@pytest.fixture(scope="module")
def rows(tiny_qwen3_dir):
    return make_rows(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).config.vocab_size)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# ---- the route ----


def test_add_lora_puts_peft_layers_on_the_base_and_keeps_the_memory_trainable(tiny_qwen3_dir):
    model = lora_model(tiny_qwen3_dir)
    adapted = sorted(name for name, module in model.named_modules() if isinstance(module, LoraLayer))
    assert adapted == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in TARGETS]
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    groups = parts(model)
    assert trainable == set(groups["memory"]) | set(groups["lora"])
    assert len(groups["lora"]) == 2 * len(adapted) and groups["memory"]
    # the config records the adapted modules by their full names, and the base the memory names
    config = model.peft_config["default"]
    assert config.target_modules == set(adapted)
    assert config.base_model_name_or_path == model.config.memory_config.base_model_name_or_path == str(
        tiny_qwen3_dir.resolve())
    # an untrained LoRA (lora_B = 0) and memory (W_O = 0) leave the base's logits as they are, chunk by chunk
    ids = torch.randint(1, 200, (1, 16))
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    torch.testing.assert_close(logits(model, ids), logits(base, ids), rtol=0, atol=1e-5)


def test_gradients_reach_every_memory_and_lora_weight_and_no_base_weight(tiny_qwen3_dir):
    """With per-chunk activation checkpointing (the default): a memory or LoRA weight without a gradient fails."""
    model = lora_model(tiny_qwen3_dir, checkpoint_chunks=True)
    perturb(model)
    ids = torch.randint(1, 200, (2, 40))
    model.train()(input_ids=ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and bool(param.grad.abs().sum() > 0), name
        else:
            assert param.grad is None, name


@pytest.mark.parametrize("targets, message", [
    (["to_qkv"], "not the base's"),
    (["nothing_here"], "match no module of the base"),
])
def test_add_lora_refuses_targets_outside_the_base(tiny_qwen3_dir, targets, message):
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16)
    with pytest.raises(ValueError, match=message):
        add_lora(model, LoraConfig(r=4, target_modules=targets))
    assert not has_lora(model)


@pytest.mark.parametrize("settings, message", [
    ({"use_dora": True}, "use_dora=True"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all'"),
    ({"init_lora_weights": "pissa"}, "rewrites the base's weights"),
])
def test_add_lora_refuses_what_the_folder_cannot_hold_or_what_changes_the_base(tiny_qwen3_dir, settings, message):
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16)
    with pytest.raises(ValueError, match=message):
        add_lora(model, LoraConfig(r=4, target_modules=TARGETS, **settings))
    assert not has_lora(model)


def test_all_linear_adapts_the_decoder_only(tiny_qwen3_dir):
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16)
    add_lora(model, LoraConfig(r=2, target_modules="all-linear"))
    adapted = {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert len(adapted) == 2 * 7 and all(name.startswith("model.layers.") for name in adapted)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "model.layers.0.self_attn.q_proj",
                                     ["model.layers.1.mlp.down_proj", "k_proj"], r".*\.mlp\.(up|gate)_proj"])
def test_target_modules_written_for_a_plain_qwen_adapt_what_they_adapt_on_the_plain_qwen(tiny_qwen3_dir, targets):
    """Inside a TitansQwen the base keeps a plain Qwen's module names (`model.layers.N.self_attn.q_proj`, ...), so
    target_modules written for a plain Qwen (suffixes, full names, a regex) adapt exactly the modules PEFT adapts on
    the plain base, and never a memory's (memories after both layers here, whose linear layers are named
    `model.memory.<layer>.neural_memory.to_qkv`, ...)."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=targets), plain)
    expected = sorted(name for name, module in plain.named_modules() if isinstance(module, LoraLayer))
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            memory_layers=[0, 1])
    add_lora(model, LoraConfig(r=4, target_modules=targets))
    adapted = sorted(name for name, module in model.named_modules() if isinstance(module, LoraLayer))
    assert adapted and adapted == expected
    assert model.peft_config["default"].target_modules == set(expected)
    assert any(is_memory_name(name) and isinstance(module, torch.nn.Linear) for name, module in model.named_modules())


def test_the_routes_that_freeze_or_drop_an_adapter_are_refused(tiny_qwen3_dir, rows, tmp_path):
    titans = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16)
    wrapped = get_peft_model(titans, LoraConfig(r=4, target_modules=TARGETS))
    with pytest.raises(ValueError, match="PEFT froze its memory"):
        TitansTrainer(model=wrapped, args=make_args(tmp_path), train_dataset=rows)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="from_base: the base is a PeftModel"):
        TitansQwenForCausalLM.from_base(get_peft_model(base, LoraConfig(r=4, target_modules=TARGETS)))
    with pytest.raises(ValueError, match="holds a LoRA adapter .*rename the base's weights"):
        lora_model(tiny_qwen3_dir).save_pretrained(tmp_path / "full", save_full_model=True)


def test_a_plain_trainer_step_through_get_peft_model_says_the_memory_is_frozen(tiny_qwen3_dir, rows, caplog):
    """What TitansTrainer refuses, a plain Trainer runs: the first training forward of the wrapped model says, once,
    that every memory weight is frozen and names add_lora; a model whose memory trains says nothing."""
    titans = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16)
    wrapped = get_peft_model(titans, LoraConfig(r=4, target_modules=TARGETS)).train()
    ids = torch.tensor(rows["input_ids"][:1])
    with caplog.at_level("WARNING", logger="titans_hf.modeling.modeling_titans_qwen"):
        wrapped(input_ids=ids, labels=ids).loss.backward()
        wrapped(input_ids=ids, labels=ids)
        lora_model(tiny_qwen3_dir).train()(input_ids=ids, labels=ids)
        with torch.no_grad():
            get_peft_model(TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16), LoraConfig(
                r=4, target_modules=TARGETS)).train()(input_ids=ids)  # no gradient: not a training step
    frozen = [record for record in caplog.records if "every memory weight frozen" in record.getMessage()]
    assert len(frozen) == 1 and "titans_hf.lora.add_lora" in frozen[0].getMessage()


# ---- saving and loading ----


def test_a_saved_folder_holds_the_memory_and_peft_adapter_and_reloads_to_equal_logits(tiny_qwen3_dir, tmp_path):
    model = lora_model(tiny_qwen3_dir)
    perturb(model)
    ids = torch.randint(1, 200, (2, 40))
    expected = logits(model, ids)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    assert {path.name for path in folder.iterdir()} == FOLDER_FILES
    memory = safetensors.torch.load_file(folder / MEMORY_WEIGHTS_NAME)
    # the memory file: the memory alone, as without LoRA, under its file keys
    assert memory.keys() == {file_key(name) for name in parts(model)["memory"]}
    adapter = safetensors.torch.load_file(folder / ADAPTER_WEIGHTS_NAME)
    assert sorted(adapter) == sorted(f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight"
                                     for i in range(2) for p in TARGETS for ab in "AB")  # PEFT's keys
    for key, tensor in adapter.items():
        name = key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(tensor, dict(model.named_parameters())[name])
    adapter_config = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    memory_config = json.loads((folder / MEMORY_CONFIG_NAME).read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4
    # the memory names the base; the adapter names this folder, the base plus the memory (see test_load_routes)
    assert memory_config["base_model_name_or_path"] == str(tiny_qwen3_dir.resolve())
    assert adapter_config["base_model_name_or_path"] == str(folder.resolve())

    generated = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False)
    for loaded in (TitansQwenForCausalLM.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder),
                   TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, folder)):
        assert type(loaded) is TitansQwenForCausalLM
        assert torch.equal(logits(loaded, ids), expected)
        assert torch.equal(loaded.generate(ids[:, :20], max_new_tokens=6, do_sample=False), generated)
        # loaded as saved: memory and LoRA trainable, the base frozen, so training can go on
        assert {n for n, p in loaded.named_parameters() if p.requires_grad} == set(parts(model)["memory"]) | set(
            parts(model)["lora"])
    # without the adapter the memory alone loads: the LoRA is part of the logits
    (folder / ADAPTER_CONFIG_NAME).unlink()
    (folder / ADAPTER_WEIGHTS_NAME).unlink()
    assert not torch.equal(logits(TitansQwenForCausalLM.from_pretrained(folder), ids), expected)


def test_the_adapter_loads_on_the_plain_base_with_peft(tiny_qwen3_dir, tmp_path):
    """PEFT's own loader puts the same LoRA on the bare base: within one chunk that is the model with its memory
    switched off."""
    model = lora_model(tiny_qwen3_dir)
    perturb(model)
    model.save_pretrained(tmp_path / "saved")
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), tmp_path / "saved")
    ids = torch.randint(1, 200, (2, 16))
    with model.memory_disabled():
        memory_off = logits(model, ids)
    torch.testing.assert_close(logits(on_base, ids), memory_off, rtol=0, atol=1e-5)
    assert not torch.allclose(logits(model, ids), memory_off, atol=1e-3)  # the memory changes them


def test_saving_without_an_adapter_removes_an_earlier_one(tiny_qwen3_dir, tmp_path):
    lora_model(tiny_qwen3_dir).save_pretrained(tmp_path)
    TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8,
                                    memory_head_dim=16).save_pretrained(tmp_path)
    assert {path.name for path in tmp_path.iterdir()} == FOLDER_FILES - {ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME}


# ---- training ----


def test_titans_trainer_trains_memory_and_lora_only_and_checkpoints_both(tiny_qwen3_dir, rows, tmp_path):
    trainer = make_trainer(tiny_qwen3_dir, tmp_path, rows)
    before = parts(trainer.model)
    trainer.train()
    assert trainer.state.global_step == STEPS
    after = parts(trainer.model)
    assert all(torch.equal(after["base"][name], weight) for name, weight in before["base"].items())
    for part in ("memory", "lora"):
        changed = [name for name, weight in before[part].items() if not torch.equal(after[part][name], weight)]
        assert changed, part
    assert all(not torch.equal(after["lora"][n], w) for n, w in before["lora"].items() if ".lora_B." in n)
    checkpoint = tmp_path / f"checkpoint-{STEPS}"
    files = {path.name for path in checkpoint.iterdir()}
    assert FOLDER_FILES <= files and TRAINABLE_BASE_WEIGHTS_NAME not in files
    loaded = TitansQwenForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor(rows[0]["input_ids"])[None]
    assert torch.equal(logits(loaded, ids), logits(trainer.model, ids))


def test_resume_restores_memory_lora_and_optimizer_bitwise(tiny_qwen3_dir, rows, tmp_path):
    full = make_trainer(tiny_qwen3_dir, tmp_path / "full", rows, save_strategy="no")
    full.train()
    expected = parts(full.model)
    first = make_trainer(tiny_qwen3_dir, tmp_path / "run", rows, callbacks=[StopAtStep(2)])
    first.train()
    assert first.state.global_step == 2
    assert not torch.equal(*(next(w for n, w in p["lora"].items() if ".lora_B." in n)
                             for p in (parts(first.model), expected)))
    resumed = make_trainer(tiny_qwen3_dir, tmp_path / "run", rows)
    resumed.train(resume_from_checkpoint=True)
    final = parts(resumed.model)
    for part in ("memory", "lora", "base"):
        for name, weight in expected[part].items():
            assert torch.equal(final[part][name], weight), name


def test_resume_refuses_another_lora(tiny_qwen3_dir, rows, tmp_path):
    make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1).train()
    other = make_trainer(tiny_qwen3_dir, tmp_path, rows, model=lora_model(tiny_qwen3_dir, lora_alpha=16), max_steps=2)
    with pytest.raises(ValueError, match="LoRA differs from the checkpoint's .*lora_alpha 8 -> 16"):
        other.train(resume_from_checkpoint=True)
    plain = make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=2, model=TitansQwenForCausalLM.from_base(
        tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16, checkpoint_chunks=False))
    with pytest.raises(ValueError, match="holds a LoRA adapter .*this model none"):
        plain._load_from_checkpoint(str(tmp_path / "checkpoint-1"))


def test_a_plain_transformers_trainer_trains_and_saves_both(tiny_qwen3_dir, rows, tmp_path):
    model = lora_model(tiny_qwen3_dir)
    before = parts(model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-2, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      data_collator=TitansDataCollator(pad_token_id=tokenizer.pad_token_id, chunk_size=16))
    trainer.train()
    after = parts(model)
    assert all(torch.equal(after["base"][name], weight) for name, weight in before["base"].items())
    assert any(not torch.equal(after["memory"][n], w) for n, w in before["memory"].items())
    assert any(not torch.equal(after["lora"][n], w) for n, w in before["lora"].items())
    trainer.save_model(str(tmp_path / "final"))
    assert FOLDER_FILES <= {path.name for path in (tmp_path / "final").iterdir()}
    ids = torch.tensor(rows[0]["input_ids"])[None]
    assert torch.equal(logits(TitansQwenForCausalLM.from_pretrained(tmp_path / "final"), ids), logits(model, ids))


# ---- the Hub ----


def test_push_to_hub_uploads_memory_and_adapter_and_the_auto_class_loads_both(
        hub, hub_token, tiny_qwen3_dir):  # noqa: F811
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=hub_token)
    api.create_repo(BASE_REPO_ID)
    api.upload_folder(folder_path=str(tiny_qwen3_dir), repo_id=BASE_REPO_ID)
    model = lora_model(tiny_qwen3_dir)
    perturb(model)
    ids = torch.randint(1, 200, (1, 40))
    expected = logits(model, ids)
    model.push_to_hub(REPO_ID, token=hub_token, base_model=BASE_REPO_ID)
    assert set(hub.files[REPO_ID]) == FOLDER_FILES | {"README.md"}
    pushed = json.loads(hub.files[REPO_ID][ADAPTER_CONFIG_NAME])
    # the adapter goes on this repository's model (base + memory): what AutoModelForCausalLM then loads
    assert pushed["base_model_name_or_path"] == REPO_ID
    assert json.loads(hub.files[REPO_ID][MEMORY_CONFIG_NAME])["base_model_name_or_path"] == BASE_REPO_ID
    assert str(tiny_qwen3_dir) not in hub.files[REPO_ID][ADAPTER_CONFIG_NAME].decode()
    card = hub.files[REPO_ID]["README.md"].decode()
    assert "lora" in card and "LoRA adapter of the base" in card
    for loaded in (AutoModelForCausalLM.from_pretrained(REPO_ID), TitansQwenForCausalLM.from_pretrained(REPO_ID)):
        assert type(loaded) is TitansQwenForCausalLM and has_lora(loaded)
        assert torch.equal(logits(loaded, ids), expected)



def test_peft_auto_class_on_a_folder_naming_itself_counts_the_lora_once(tiny_qwen3_dir, tmp_path):
    """A pushed adapter_config.json names its own repository as the model (above), a saved one its own folder;
    PEFT's AutoPeftModelForCausalLM then loads that model (base, memory, LoRA) and its adapter into the same LoRA
    layers, under the same name: the LoRA counts once, the logits are the model's (PEFT warns of a second
    peft_config). PEFT's loader reaches the real Hub for a repository id, so a folder stands in for it here."""
    model = lora_model(tiny_qwen3_dir)
    perturb(model)
    ids = torch.randint(1, 200, (1, 40))
    model.save_pretrained(tmp_path / "saved")
    with pytest.warns(UserWarning, match="multiple adapters"):
        loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(loaded.base_model.model) is TitansQwenForCausalLM and list(loaded.peft_config) == ["default"]
    assert torch.equal(logits(loaded, ids), logits(model, ids))


# ---- hostile adapter folders ----


@pytest.fixture
def saved(tiny_qwen3_dir, tmp_path):
    model = lora_model(tiny_qwen3_dir)
    perturb(model)
    model.save_pretrained(tmp_path / "saved")
    return tmp_path / "saved"


def _edit_config(folder, **changes) -> None:
    values = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    values.update(changes)
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps(values))


@pytest.mark.parametrize("changes, message", [
    ({"megatron_core": "os"}, "megatron_core='os'.*must stay at PEFT's default"),
    ({"megatron_config": {"x": 1}}, "megatron_config"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"auto_mapping": {"base_model_class": "X", "parent_library": "os"}}, "auto_mapping"),
    ({"init_lora_weights": "pissa"}, "rewrites the base's weights"),
    ({"peft_type": "IA3"}, "LoRA adapters only"),
    ({"surprise": 1}, "unknown adapter setting 'surprise'"),
    ({"target_modules": "(q|v)_proj"}, "target_modules must be a non-empty list of module names"),
    ({"target_modules": ["memory.1.neural_memory.to_qkv"]}, "not the base's"),
    ({"r": 2 ** 20}, "adapter_model.safetensors: .*config makes"),
    ({"r": 0}, "r=0 must be an integer >= 1"),
    ({"lora_dropout": 1.5}, "lora_dropout=1.5"),
])
def test_a_hostile_adapter_config_is_refused_naming_the_file(saved, changes, message):
    _edit_config(saved, **changes)
    with pytest.raises(ValueError, match=message) as error:
        TitansQwenForCausalLM.from_pretrained(saved)
    assert str(saved) in str(error.value)


def test_adapter_weights_are_read_from_safetensors_only_and_checked(saved):
    weights = safetensors.torch.load_file(saved / ADAPTER_WEIGHTS_NAME)
    os.replace(saved / ADAPTER_WEIGHTS_NAME, saved / "adapter_model.bin")  # what PEFT would fall back to
    with pytest.raises(FileNotFoundError, match=ADAPTER_WEIGHTS_NAME):
        TitansQwenForCausalLM.from_pretrained(saved)
    name = next(iter(weights))
    for broken, message in (({**weights, name: torch.full_like(weights[name], float("nan"))}, "NaN"),
                            ({k: v for k, v in weights.items() if k != name}, "missing"),
                            ({**weights, name: weights[name].double()}, "torch.float64")):
        safetensors.torch.save_file(broken, saved / ADAPTER_WEIGHTS_NAME)
        with pytest.raises(ValueError, match=message):
            TitansQwenForCausalLM.from_pretrained(saved)
    (saved / ADAPTER_WEIGHTS_NAME).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TitansQwenForCausalLM.from_pretrained(saved)


# ---- titans-hf train --lora_r ----


def lora_flags(model_dir, tokenizer_dir, tmp_path) -> list[str]:
    """`titans-hf train` on a seq store of 4 windows of 32 tokens (chunks of 16), LoRA of rank 4 on q_proj, v_proj."""
    from titans_hf.data.prepare import prepare

    documents = tmp_path / "doc.txt"
    documents.write_text("Ships waited in the harbour for the tide, their sails folded against the grey sky. " * 12)
    [store] = prepare(documents, tmp_path / "corpus.h5", str(tokenizer_dir))
    return [
        "--dataset", "titans_tokens", "--data_files", str(store), "--window_size", "32", "--max_train_samples", "4",
        "--model_name_or_path", str(model_dir), "--chunk_size", "16", "--memory_chunk_size", "8",
        "--memory_head_dim", "16", "--lora_r", "4", "--lora_alpha", "16", "--lora_target_modules", *TARGETS,
        "--gradient_accumulation_steps", "1", "--optim", "sgd", "--learning_rate", "0.5", "--max_steps", "2",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
    ]  # fmt: skip


def test_titans_hf_train_lora_flags_train_and_save_lora_with_the_memory(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    """--lora_r puts LoRA on the base (add_lora): the output folder holds the memory and PEFT's adapter, which load
    back together; the base is as loaded, lora_B (zero at init) and W_O (zero at init) trained."""
    from titans_hf.commands import main as cli_main

    flags = lora_flags(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path)
    assert cli_main(["train", *flags, "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"]) == 0
    assert FOLDER_FILES <= set(os.listdir(tmp_path / "out"))
    adapter = json.loads((tmp_path / "out" / ADAPTER_CONFIG_NAME).read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 16)
    assert sorted({name.rsplit(".", 1)[-1] for name in adapter["target_modules"]}) == TARGETS
    trained = TitansQwenForCausalLM.from_pretrained(tmp_path / "out")
    groups, base = parts(trained), AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).state_dict()
    assert groups["base"] and all(torch.equal(tensor, base[name.replace(".base_layer", "")])
                                  for name, tensor in groups["base"].items())
    assert all(tensor.any() for name, tensor in groups["lora"].items() if ".lora_B." in name)
    assert all(tensor.any() for name, tensor in groups["memory"].items() if name.endswith("output_weight"))
    assert {name for name, p in trained.named_parameters() if p.requires_grad} == {*groups["lora"], *groups["memory"]}


def test_titans_hf_train_refuses_a_lora_rank_below_one(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    from titans_hf.commands import main as cli_main

    flags = lora_flags(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path)
    flags[flags.index("--lora_r") + 1] = "0"
    with pytest.raises(ValueError, match="--lora_r must be a rank >= 1, got 0"):
        cli_main(["train", *flags, "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"])
    assert not (tmp_path / "out" / MEMORY_WEIGHTS_NAME).exists()


def test_two_process_ddp_trains_lora_and_memory_as_one_process(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    """`accelerate launch` (two DDP ranks of one window each) with --lora_r takes one process's SGD steps on both
    windows: memory and LoRA weights equal."""
    from gloo_workers import ddp_and_one_process

    ddp_dir, one_dir = ddp_and_one_process(lora_flags(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path), tmp_path)
    for name in (MEMORY_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME):
        ddp, one = (safetensors.torch.load_file(folder / name) for folder in (ddp_dir, one_dir))
        assert ddp.keys() == one.keys() and one
        for key, tensor in one.items():
            torch.testing.assert_close(ddp[key], tensor, atol=1e-6, rtol=1e-4, msg=key)
    lora_b = [tensor for key, tensor in one.items() if ".lora_B." in key]
    assert lora_b and all(tensor.any() for tensor in lora_b)
