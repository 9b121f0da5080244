"""Hostile LoRA + memory folders through PEFT's `AutoPeftModelForCausalLM`, which loads whatever model the folder's
adapter_config.json names and puts the folder's adapter on it: PEFT's contract (`PeftModel.from_pretrained(<the model
named>, folder)`). A folder naming itself loads whole, as `TitansQwenForCausalLM.from_pretrained` loads it; a copied
folder, a moved one and an edited config run the folder named under the given folder's adapter, while titans_hf's own
loader reads the memory and adapter that lie together; broken adapter weights are refused naming the file and the
tensor wherever titans_hf's loader reads them. Every folder handed in is checksummed before and after.

Two routes run no titans_hf code at all, and the tests pin what PEFT and transformers do there: a config edited to
name the bare base (PEFT loads that plain model and puts the LoRA on it: no memory), and a moved folder whose old
place is empty (transformers fails on the old path)."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from test_peft import lora_model
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MEMORY_WEIGHTS_NAME,
    is_memory_name,
)

IDS = torch.randint(1, 200, (2, 40), generator=torch.Generator().manual_seed(0))


def checksums(*folders: Path) -> dict[str, str]:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()
            for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


def save(model_dir: Path, folder: Path, seed: int) -> Path:
    """A LoRA + memory folder whose memory and LoRA (moved off their zero init by `seed`) show in the logits."""
    model = lora_model(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return folder


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def auto_peft(folder: Path):
    with warnings.catch_warnings():  # PEFT says it finds a peft_config on the model it loaded
        warnings.filterwarnings("ignore", message=".*multiple adapters")
        return AutoPeftModelForCausalLM.from_pretrained(folder)


def peft_runs_the_named_folder(given: Path, named: Path) -> torch.Tensor:
    """PEFT's contract: `AutoPeftModelForCausalLM.from_pretrained(given)` is the model `named` (what `given`'s
    adapter_config.json names) with `given`'s adapter put on it by `PeftModel.from_pretrained`. Returns its logits."""
    loaded = logits(auto_peft(given))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multiple adapters")
        expected = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(named), given))
    assert torch.equal(loaded, expected)
    return loaded


def test_a_folder_naming_itself_loads_whole_through_auto_peft(tiny_qwen3_dir, tmp_path):
    """The folder where it was saved: PEFT loads exactly what TitansQwenForCausalLM.from_pretrained loads."""
    folder = save(tiny_qwen3_dir, tmp_path / "saved", seed=1)
    before = checksums(folder)
    assert torch.equal(logits(auto_peft(folder)), logits(TitansQwenForCausalLM.from_pretrained(folder)))
    assert checksums(folder) == before


def test_a_copied_folder_whose_memory_was_retrained_runs_the_original_s_memory_through_peft(tiny_qwen3_dir,
                                                                                            tmp_path):
    """A copy's adapter_config.json still names the original: PEFT runs the original's memory with the copy's
    adapter, as its contract says; the copy itself loads with its own memory."""
    original = save(tiny_qwen3_dir, tmp_path / "original", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    retrained = save(tiny_qwen3_dir, tmp_path / "retrained", seed=2)
    shutil.copyfile(retrained / MEMORY_WEIGHTS_NAME, copy / MEMORY_WEIGHTS_NAME)  # the copy's memory trained on
    before = checksums(original, copy)
    own = logits(TitansQwenForCausalLM.from_pretrained(copy))
    assert not torch.equal(own, logits(TitansQwenForCausalLM.from_pretrained(original)))
    assert not torch.equal(peft_runs_the_named_folder(copy, original), own)
    assert checksums(original, copy) == before
    assert torch.equal(logits(TitansQwenForCausalLM.from_pretrained(copy)), own)


def test_a_moved_folder_runs_its_old_place_through_peft_or_fails_naming_it(tiny_qwen3_dir, tmp_path):
    """Moved away, the folder's adapter_config.json names its old place: PEFT runs another folder saved there since
    under the moved folder's adapter; an empty place is transformers' error naming it (its config is looked up there
    before any model class, titans_hf's included, is chosen)."""
    old_place = save(tiny_qwen3_dir, tmp_path / "run", seed=1)
    moved = tmp_path / "moved"
    shutil.move(old_place, moved)
    expected = logits(TitansQwenForCausalLM.from_pretrained(moved))
    before = checksums(moved)
    with pytest.raises(OSError, match=str(old_place)):
        auto_peft(moved)
    save(tiny_qwen3_dir, old_place, seed=2)  # a later run saved into the old place
    before.update(checksums(old_place))
    assert not torch.equal(peft_runs_the_named_folder(moved, old_place), expected)
    assert checksums(moved, old_place) == before
    assert torch.equal(logits(TitansQwenForCausalLM.from_pretrained(moved)), expected)


def test_an_adapter_config_edited_to_name_another_folder_runs_that_folder_through_peft(tiny_qwen3_dir, tmp_path):
    """An adapter_config.json edited to name another titans_hf folder (a path on the machine it is loaded on): PEFT
    runs that folder's memory under this adapter; the folder's own loader ignores the field and loads its own memory
    and adapter."""
    other = save(tiny_qwen3_dir, tmp_path / "other", seed=2)
    folder = save(tiny_qwen3_dir, tmp_path / "edited", seed=1)
    values = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps({**values, "base_model_name_or_path": str(other)}))
    before = checksums(folder, other)
    through_peft = peft_runs_the_named_folder(folder, other)
    assert checksums(folder, other) == before
    loaded = TitansQwenForCausalLM.from_pretrained(folder)
    assert not torch.equal(logits(loaded), logits(TitansQwenForCausalLM.from_pretrained(other)))
    assert not torch.equal(logits(loaded), through_peft)


def test_broken_adapter_weights_are_refused_through_auto_peft_naming_the_file_and_tensor(tiny_qwen3_dir, tmp_path):
    """Through PEFT's loader the adapter is titans_hf's loader's to check (the folder naming itself), from
    safetensors only; a copy naming the broken folder is refused by the same check, on the folder it names."""
    folder = save(tiny_qwen3_dir, tmp_path / "saved", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    weights = safetensors.torch.load_file(folder / ADAPTER_WEIGHTS_NAME)
    key = sorted(weights)[0]
    broken = {**weights, key: torch.full_like(weights[key], float("nan"))}
    for target in (folder, copy):
        safetensors.torch.save_file(broken, target / ADAPTER_WEIGHTS_NAME)
    before = checksums(folder, copy)
    with pytest.raises(ValueError, match=rf"^{folder / ADAPTER_WEIGHTS_NAME}: {key} holds NaN or infinite values"):
        auto_peft(folder)
    with pytest.raises(ValueError, match=rf"^{folder / ADAPTER_WEIGHTS_NAME}: {key} holds NaN or infinite values"):
        auto_peft(copy)
    assert checksums(folder, copy) == before

    # PEFT would fall back to adapter_model.bin (a pickle); titans_hf reads safetensors only
    torch.save(weights, folder / "adapter_model.bin")
    (folder / ADAPTER_WEIGHTS_NAME).unlink()
    before = checksums(folder)
    with pytest.raises(FileNotFoundError, match=ADAPTER_WEIGHTS_NAME):
        auto_peft(folder)
    assert checksums(folder) == before


def test_nan_adapter_weights_in_a_copy_naming_a_clean_folder_are_peft_s_to_load(tiny_qwen3_dir, tmp_path):
    """A copy whose adapter weights hold NaN, its adapter_config.json naming the clean folder it was copied from:
    PEFT loads the clean folder (checked whole by titans_hf's loader) and puts the copy's weights on it unchecked,
    its own route; the copy's own loader refuses the NaN naming the file; the clean folder still loads whole."""
    clean = save(tiny_qwen3_dir, tmp_path / "clean", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(clean, copy)
    weights = safetensors.torch.load_file(copy / ADAPTER_WEIGHTS_NAME)
    key = sorted(weights)[-1]
    safetensors.torch.save_file({**weights, key: torch.full_like(weights[key], float("nan"))},
                                copy / ADAPTER_WEIGHTS_NAME)
    before = checksums(clean, copy)
    assert bool(logits(auto_peft(copy)).isnan().any())
    with pytest.raises(ValueError, match=rf"^{copy / ADAPTER_WEIGHTS_NAME}: {key} holds NaN or infinite values"):
        TitansQwenForCausalLM.from_pretrained(copy)
    assert checksums(clean, copy) == before
    assert torch.equal(logits(auto_peft(clean)), logits(TitansQwenForCausalLM.from_pretrained(clean)))


def test_an_adapter_config_edited_to_name_the_bare_base_is_peft_s_plain_route_without_the_memory(tiny_qwen3_dir,
                                                                                                 tmp_path):
    """An adapter_config.json edited to name the bare base: PEFT loads that plain Qwen (transformers' own class, no
    titans_hf code) and puts the LoRA on it, exactly as `PeftModel.from_pretrained(<the plain base>, folder)` does:
    no memory, and the adapter's weights go unchecked. The base's modules keep a plain Qwen's names inside a
    TitansQwen, so nothing in the adapter's files can make it refuse; titans_hf's own loader ignores the field and
    loads the folder's memory and adapter."""
    folder = save(tiny_qwen3_dir, tmp_path / "edited", seed=1)
    values = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps({**values, "base_model_name_or_path": str(tiny_qwen3_dir)}))
    before = checksums(folder, tiny_qwen3_dir)
    loaded = auto_peft(folder)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), folder)
    assert type(loaded.base_model.model) is type(plain.base_model.model) is Qwen3ForCausalLM
    assert not any(is_memory_name(name) for name, _ in loaded.named_parameters())
    assert torch.equal(logits(loaded), logits(plain))
    whole = TitansQwenForCausalLM.from_pretrained(folder)
    assert not torch.allclose(logits(whole), logits(loaded), atol=1e-3)
    assert checksums(folder, tiny_qwen3_dir) == before


def test_an_adapter_config_naming_a_memory_folder_without_a_lora_runs_that_memory_through_peft(tiny_qwen3_dir,
                                                                                              tmp_path):
    """A LoRA + memory folder whose adapter_config.json names a memory-only folder (another memory, no adapter of its
    own): PEFT puts this folder's LoRA on that folder's memory, both folders unchanged."""
    memory_only = tmp_path / "memory_only"
    TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=8, memory_head_dim=16).save_pretrained(memory_only)
    folder = save(tiny_qwen3_dir, tmp_path / "edited", seed=1)
    values = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps({**values, "base_model_name_or_path": str(memory_only)}))
    before = checksums(folder, memory_only)
    peft_runs_the_named_folder(folder, memory_only)
    assert checksums(folder, memory_only) == before
    TitansQwenForCausalLM.from_pretrained(memory_only)  # outside PEFT's loader, the memory-only folder loads
