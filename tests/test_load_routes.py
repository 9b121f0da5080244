"""Every route by which the Hugging Face stack loads a model folder loads a titans_hf folder whole (base, memory, and
the LoRA where there is one: the logits of `TitansQwenForCausalLM.from_pretrained`) or refuses it with an error:
`AutoConfig`, `AutoModelForCausalLM`, `pipeline("text-generation")`, PEFT's `AutoPeftModelForCausalLM` and
`PeftModel.from_pretrained`, on each kind of folder the package writes (a memory folder, a full model, a LoRA +
memory folder saved by `save_pretrained`, by a plain `transformers.Trainer` or by `TitansTrainer`). The folders are checksummed before
and after: no route changes them."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel
from test_peft import make_rows, perturb
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, pipeline

from titans_hf.data.collator import TitansDataCollator
from titans_hf.lora import add_lora, has_lora
from titans_hf.modeling import TitansQwenConfig, TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import ADAPTER_CONFIG_NAME
from titans_hf.training import TitansTrainer, TitansTrainingArguments

KINDS = ["memory", "full", "lora", "lora_trainer", "lora_titans_trainer"]
ADAPTER_KINDS = ("lora", "lora_trainer", "lora_titans_trainer")


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def titans(model_dir: Path, lora: bool) -> TitansQwenForCausalLM:
    """A memory (and LoRA) moved off its zero init, so that each part shows in the logits."""
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(model_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            checkpoint_chunks=False)
    if lora:
        add_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    perturb(model)
    return model


def write_folder(kind: str, model_dir: Path, folder: Path) -> TitansQwenForCausalLM:
    """A folder of `kind` as the package writes it, its tokenizer beside it; returns the model saved."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = titans(model_dir, lora=kind in ADAPTER_KINDS)
    if kind == "lora_titans_trainer":
        args = TitansTrainingArguments(output_dir=str(folder.parent / "run"), per_device_train_batch_size=2,
                                       gradient_accumulation_steps=1, max_steps=1, learning_rate=1e-2,
                                       report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")
        trainer = TitansTrainer(model=model, args=args, train_dataset=make_rows(model.config.text_config.vocab_size, 2),
                                processing_class=tokenizer)
        trainer.train()
        trainer.save_model(str(folder))
    elif kind == "lora_trainer":
        args = TrainingArguments(output_dir=str(folder.parent / "run"), per_device_train_batch_size=2, max_steps=1,
                                 learning_rate=1e-2, report_to="none", use_cpu=True, disable_tqdm=True,
                                 save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=make_rows(model.config.text_config.vocab_size, 2),
                          processing_class=tokenizer,
                          data_collator=TitansDataCollator(pad_token_id=tokenizer.pad_token_id, chunk_size=16))
        trainer.train()
        trainer.save_model(str(folder))
    else:
        model.save_pretrained(folder, save_full_model=kind == "full")
        tokenizer.save_pretrained(folder)
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("kind", KINDS)
def test_every_hugging_face_route_loads_the_whole_model_or_refuses(kind, tiny_qwen3_dir, tmp_path):
    folder = tmp_path / kind
    saved = write_folder(kind, tiny_qwen3_dir, folder)
    before = checksums(folder)
    ids = torch.randint(1, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = logits(saved, ids)
    direct = TitansQwenForCausalLM.from_pretrained(folder)
    assert torch.equal(logits(direct, ids), expected) and has_lora(direct) == (kind in ADAPTER_KINDS)

    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, TitansQwenConfig) and config.memory_config == direct.config.memory_config
    auto = AutoModelForCausalLM.from_pretrained(folder)
    assert type(auto) is TitansQwenForCausalLM and torch.equal(logits(auto, ids), expected)
    generator = pipeline("text-generation", model=str(folder))
    assert type(generator.model) is TitansQwenForCausalLM and torch.equal(logits(generator.model, ids), expected)

    if kind in ADAPTER_KINDS:
        # PEFT loads the model adapter_config.json names (this folder: base, memory, LoRA), then the adapter into
        # the same LoRA layers: the LoRA counts once
        with warnings.catch_warnings():  # PEFT says it finds a peft_config on the model it loaded
            warnings.filterwarnings("ignore", message=".*multiple adapters")
            peft_auto = AutoPeftModelForCausalLM.from_pretrained(folder)
            peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), folder)
        assert type(peft_auto.base_model.model) is TitansQwenForCausalLM
        assert torch.equal(logits(peft_auto, ids), expected)
        assert torch.equal(logits(peft_model, ids), expected)
    else:  # no adapter: PEFT's loaders refuse, naming the file
        with pytest.raises(ValueError, match=f"Can't find '{ADAPTER_CONFIG_NAME}'"):
            AutoPeftModelForCausalLM.from_pretrained(folder)
        with pytest.raises(ValueError, match=f"Can't find '{ADAPTER_CONFIG_NAME}'"):
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), folder)
    assert checksums(folder) == before


def test_a_lora_folder_names_itself_as_the_model_its_adapter_goes_on(tiny_qwen3_dir, tmp_path):
    """adapter_config.json names the folder (absolute) as PEFT's base: the base plus this memory. A folder moved
    away from where it was saved names a place that no longer holds it, and PEFT's loader refuses it there."""
    folder = tmp_path / "lora"
    write_folder("lora", tiny_qwen3_dir, folder)
    adapter = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (str(folder.resolve()), None)
    memory = json.loads((folder / "memory_config.json").read_text())
    assert memory["base_model_name_or_path"] == str(tiny_qwen3_dir.resolve())  # the memory names the base

    moved = tmp_path / "moved"
    shutil.move(folder, moved)
    before = checksums(moved)
    with pytest.raises(OSError, match=str(folder)):
        AutoPeftModelForCausalLM.from_pretrained(moved)
    assert checksums(moved) == before
    TitansQwenForCausalLM.from_pretrained(moved)  # the model class reads the memory's base, wherever the folder is
