"""Hostile input, second round, the model side: nothing picks another model silently (a local base resolves to
the same folder from anywhere, or loading refuses naming it), resume refuses or warns naming the file or setting,
broken or oversized memory files are refused before anything is allocated, a full model with a NaN or infinite
tensor is refused naming it, a vocabulary resize that could not be saved is refused when asked, and forward names bad
ids and the attentions it cannot give.

Each test checksums what it hands in and checks it is unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import make_trainer, rows  # noqa: F401  (rows is a fixture)

from titans_hf.commands import main as cli_main
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.testing_utils import build_qwen


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def memory_on(base: Path, folder: Path) -> Path:
    model = TitansQwenForCausalLM.from_base(base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    return model.save_memory(folder)


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "memory_config.json").read_text())
    config.update(changes)
    (folder / "memory_config.json").write_text(json.dumps(config))


@pytest.fixture
def local_base(tiny_qwen3_dir, tmp_path) -> Path:
    base = tmp_path / "base"
    shutil.copytree(tiny_qwen3_dir, base)
    return base


def test_a_local_base_is_recorded_absolute_and_another_model_there_is_refused(local_base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    memory = memory_on(Path("base"), tmp_path / "memory")  # given relative, as --model_name_or_path base
    config = json.loads((memory / "memory_config.json").read_text())
    assert config["base_model_name_or_path"] == str(local_base.resolve()) and len(config["base_fingerprint"]) == 64
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    TitansQwenForCausalLM.from_pretrained(memory)  # the same folder from anywhere
    # another model of the same shape in that folder: refused, naming it
    build_qwen(tmp_path / "other", vocab_size=config["base_shape"]["vocab_size"], seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", local_base / "model.safetensors")
    before = checksums(memory)
    with pytest.raises(ValueError, match=rf"names the local base {local_base}, but the model there now is not the one"):
        TitansQwenForCausalLM.from_pretrained(memory)
    assert checksums(memory) == before


def test_a_base_fine_tuned_in_one_layer_is_told_apart(local_base, tmp_path):
    memory = memory_on(local_base, tmp_path / "memory")
    weights = load_file(local_base / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tuned = dict(weights, **{name: weights[name] + 1e-3})  # one tensor of one layer, every value moved a little
    save_file(tuned, local_base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"but the model there now is not the one the memory was trained on"):
        TitansQwenForCausalLM.from_pretrained(memory)

    save_file(weights, local_base / "model.safetensors", metadata={"format": "pt"})
    TitansQwenForCausalLM.from_pretrained(memory)  # the same weights again: the same model


def test_a_relative_base_recorded_by_an_older_save_is_refused_where_it_would_resolve(local_base, tmp_path,
                                                                                       monkeypatch):
    memory = memory_on(local_base, tmp_path / "memory")
    edit_config(memory, base_model_name_or_path="base", base_fingerprint=None)
    (tmp_path / "elsewhere" / "base").mkdir(parents=True)
    shutil.copytree(local_base, tmp_path / "elsewhere" / "base", dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"names the base 'base', a relative path that here resolves to .*elsewhere/base"):
        TitansQwenForCausalLM.from_pretrained(memory)


@pytest.mark.parametrize(("damage", "message"), [
    ("nan", r"holds NaN or infinite values"),
    ("inf", r"holds NaN or infinite values"),
    ("fp16", r"is torch\.float16 .*the memory config makes it torch\.float32"),
    ("bf16", r"is torch\.bfloat16 .*the memory config makes it torch\.float32"),
])
def test_broken_or_cast_memory_weights_are_refused_naming_the_file(local_base, tmp_path, damage, message):
    memory = memory_on(local_base, tmp_path / "memory")
    weights = load_file(memory / "memory_model.safetensors")
    name = sorted(weights)[0]
    if damage in ("nan", "inf"):
        weights[name].view(-1)[0] = float(damage)
    else:
        weights = {key: value.to(torch.float16 if damage == "fp16" else torch.bfloat16) for key, value in weights.items()}
    save_file(weights, memory / "memory_model.safetensors")
    before = checksums(memory)
    with pytest.raises(ValueError, match=rf"memory_model\.safetensors: .*{message}"):
        TitansQwenForCausalLM.from_pretrained(memory)
    assert checksums(memory) == before


def test_a_config_declaring_a_huge_memory_is_refused_before_allocating(local_base, tmp_path):
    memory = memory_on(local_base, tmp_path / "memory")
    edit_config(memory, memory_head_dim=2**20, memory_num_heads=None)
    before = checksums(memory)
    with pytest.raises(ValueError, match=r"memory_model\.safetensors: .*the memory config makes it"):
        TitansQwenForCausalLM.from_pretrained(memory)
    edit_config(memory, memory_head_dim=16, revision="../../etc/passwd")
    with pytest.raises(ValueError, match=r"memory_config\.json: revision='\.\./\.\./etc/passwd' is not a git revision"):
        TitansQwenForCausalLM.from_pretrained(memory)
    assert set(checksums(memory)) == set(before)


def test_a_full_model_whose_config_declares_a_huge_memory_is_refused_naming_it(local_base, tmp_path):
    model = TitansQwenForCausalLM.from_base(local_base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    model.save_pretrained(tmp_path / "full", save_full_model=True)
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config["memory_config"]["memory_head_dim"] = 2**20
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    before = checksums(tmp_path / "full")
    with pytest.raises(ValueError, match=r"full: memory\..* the memory config makes it torch\.float32"):
        TitansQwenForCausalLM.from_pretrained(tmp_path / "full")
    assert checksums(tmp_path / "full") == before


@pytest.mark.parametrize("damage", ["nan", "inf"])
@pytest.mark.parametrize("part", ["memory", "base"])
def test_broken_weights_of_a_full_model_folder_are_refused_naming_the_file_and_tensor(local_base, tmp_path, damage,
                                                                                         part):
    """A full model (save_full_model=True) is checked as a memory folder is: a NaN or infinite value in any tensor,
    the memory's or the base's, is refused naming the file and the tensor, by the model class and the Auto class."""
    from transformers import AutoModelForCausalLM

    model = TitansQwenForCausalLM.from_base(local_base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    folder = tmp_path / "full"
    model.save_pretrained(folder, save_full_model=True)
    weights = load_file(folder / "model.safetensors")
    name = sorted(key for key in weights if key.startswith("memory." if part == "memory" else "model.layers."))[0]
    weights[name].view(-1)[3] = float(damage)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    before = checksums(folder)
    for load in (TitansQwenForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=rf"full/model\.safetensors: {re.escape(name)} holds NaN or infinite"):
            load(folder)
    assert checksums(folder) == before


def test_resizing_the_vocabulary_of_a_frozen_base_is_refused_when_asked(local_base, tmp_path):
    """A frozen base stays as loaded and its memory folder holds the memory alone: new token rows could neither
    train nor be saved, so resize_token_embeddings refuses to change the size (not save_pretrained, later, writing a
    folder that lost them), and leaves the model as it was. A call that keeps the size is what it always is."""
    from transformers import AutoTokenizer

    before = checksums(local_base)
    model = TitansQwenForCausalLM.from_base(local_base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    tokenizer = AutoTokenizer.from_pretrained(local_base)
    rows = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|fact|>"]})
    embeddings = model.get_input_embeddings()
    for new_num_tokens, pad_to_multiple_of, target in ((len(tokenizer), None, rows + 1), (rows - 2, None, rows - 2),
                                                       (None, 3, (rows + 2) // 3 * 3)):  # rows padded
        with pytest.raises(ValueError, match=rf"resize_token_embeddings: {rows} -> {target} tokens, but the base is "
                                             r"frozen \(freeze_base=True\).* could neither train nor be saved"):
            model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of=pad_to_multiple_of)
    assert model.get_input_embeddings() is embeddings and embeddings.weight.shape[0] == rows
    assert model.config.text_config.vocab_size == model.config.memory_config.base_shape["vocab_size"] == rows
    assert model.resize_token_embeddings(rows, pad_to_multiple_of=64) is embeddings  # 512: a multiple of 64
    assert model.resize_token_embeddings() is embeddings
    model.save_pretrained(tmp_path / "memory")
    assert TitansQwenForCausalLM.from_pretrained(tmp_path / "memory").config.text_config.vocab_size == rows
    assert checksums(local_base) == before


def test_resizing_the_vocabulary_of_a_trainable_base_trains_saves_and_loads_the_new_rows(local_base, tmp_path):
    """With freeze_base=False the whole model trains and saves: the new token's rows get gradients, and the saved
    model loads back (model class and Auto class) with them, its memory config recording the new vocabulary."""
    from transformers import AutoModelForCausalLM

    model = TitansQwenForCausalLM.from_base(local_base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8,
                                            freeze_base=False)
    rows = model.config.text_config.vocab_size
    model.resize_token_embeddings(rows + 1)
    assert model.config.text_config.vocab_size == model.config.memory_config.base_shape["vocab_size"] == rows + 1
    ids = torch.tensor([[1, 2, rows, 3, rows, 4] * 4])
    model.train()(input_ids=ids, labels=ids).loss.backward()
    for weights in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        assert weights.requires_grad and bool(weights.grad[rows].abs().sum() > 0)
    model.save_pretrained(tmp_path / "full")
    before = checksums(tmp_path / "full")
    with torch.no_grad():
        expected = model.eval()(ids).logits
        for load in (TitansQwenForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
            loaded = load(tmp_path / "full").eval()
            assert loaded.get_input_embeddings().weight.shape[0] == rows + 1
            assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
            assert torch.equal(loaded(ids).logits, expected)
    assert checksums(tmp_path / "full") == before


def test_a_pickle_only_model_folder_is_refused_naming_it(local_base, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(local_base / "config.json", folder / "config.json")
    torch.save({"weight": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"the base .*pickled: holds weights only as pickle files \['pytorch_model\.bin'\]"):
        TitansQwenForCausalLM.from_base(folder, chunk_size=16, memory_head_dim=16)
    with pytest.raises(ValueError, match=r"the model folder .*pickled: holds weights only as pickle files"):
        TitansQwenForCausalLM.from_pretrained(folder)


def test_forward_names_ids_outside_the_vocabulary_and_float_ids(local_base):
    model = TitansQwenForCausalLM.from_base(local_base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    vocab = model.config.text_config.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids hold the id {vocab}, outside the vocabulary of {vocab} tokens"):
        model(torch.tensor([[1, 2, vocab]]))
    with pytest.raises(ValueError, match=r"input_ids hold the id -1"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match=r"must hold integer token ids, got a torch\.float32 tensor"):
        model(torch.tensor([[1.0, 2.0]]))


def test_output_attentions_is_refused_naming_why(local_base):
    """The chunked run has no attention map over the input (each chunk attends over itself and the previous chunk,
    the memory carries the rest): asking for one, by argument, through base_model, generate or the config, is
    refused, never answered with attentions=None."""
    model = TitansQwenForCausalLM.from_base(local_base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8,
                                            attn_implementation="eager")
    ids = torch.tensor([[1, 2, 3, 4] * 10])
    why = r"output_attentions=True: .* attends chunk by chunk .* no attention map over the input"
    for call in (lambda: model(ids, output_attentions=True), lambda: model.base_model(ids, output_attentions=True),
                 lambda: model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)):
        with pytest.raises(ValueError, match=why):
            call()
    expected = model(ids, output_attentions=False).logits
    model.config.output_attentions = True
    with pytest.raises(ValueError, match=why):
        model(ids)
    assert torch.equal(model(ids, output_attentions=False).logits, expected)  # the argument decides over the config


def test_eval_checks_device_and_counts_before_loading_anything(tmp_path, capsys):
    argv = ["eval", "--model", str(tmp_path / "no_model"), "--generate", "--lengths", "0", "--output", str(tmp_path)]
    with pytest.raises(SystemExit):  # the parser names a missing local path
        cli_main(argv)
    assert re.search(r"--model: .*no_model: no such file or folder", capsys.readouterr().err)
    argv[2] = str(tmp_path)  # a folder that exists: the checks below come before it is read
    with pytest.raises(ValueError, match=r"--max-windows -1: must be at least 1"):
        cli_main([*argv, "--max-windows", "-1"])
    with pytest.raises(ValueError, match=r"--batch-size 0: must be at least 1"):
        cli_main([*argv, "--batch-size", "0"])
    with pytest.raises(SystemExit):
        cli_main([*argv, "--tokenizer", str(tmp_path / "missing")])
    assert re.search(r"--tokenizer: .*missing: no such file or folder", capsys.readouterr().err)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--device cuda: CUDA is not available on this machine"):
            cli_main([*argv, "--device", "cuda"])


# ---- resume ----

@pytest.fixture
def checkpoints(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    """A run of 2 steps with a checkpoint at each: checkpoint-1 and checkpoint-2."""
    make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=2).train()
    return tmp_path


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_resume_without_optimizer_or_scheduler_state_is_refused(tiny_qwen3_dir, rows, checkpoints, name):  # noqa: F811
    (checkpoints / "checkpoint-2" / name).unlink()
    before = checksums(checkpoints)
    with pytest.raises(ValueError, match=rf"checkpoint-2/{name} is missing, so the optimizer"):
        make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=4).train(
            resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    assert checksums(checkpoints) == before


def test_resume_without_rng_state_warns_naming_it(tiny_qwen3_dir, rows, checkpoints, caplog):  # noqa: F811
    (checkpoints / "checkpoint-2" / "rng_state.pth").unlink()
    trainer = make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=2, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.trainer"):
        trainer.train(resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    assert any("rng_state.pth is missing" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(("settings", "named"), [
    ({"chunk_size": 32}, "chunk_size 16 -> 32"),
    ({"max_lr": 0.25}, "max_lr 0.5 -> 0.25"),
    ({"memory_head_dim": 32}, "memory_head_dim 16 -> 32"),
])
def test_resume_into_other_memory_settings_is_refused_naming_them(tiny_qwen3_dir, rows, checkpoints, settings,  # noqa: F811
                                                                 named):
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **{"chunk_size": 16, "memory_chunk_size": 8,
                                                                "memory_head_dim": 16, "checkpoint_chunks": False,
                                                                **settings})
    before = checksums(checkpoints)
    with pytest.raises(ValueError, match=rf"differs from the checkpoint's .*memory_config\.json: .*{named}"):
        make_trainer(tiny_qwen3_dir, checkpoints, rows, model=model, max_steps=4).train(
            resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    assert checksums(checkpoints) == before


@pytest.mark.parametrize(("step", "message"), [
    (-5, r"records global_step -5, not a step count"),
    (1_000_000, r"records global_step 1000000, but the folder is the checkpoint of step 2"),
])
def test_resume_from_a_tampered_global_step_is_refused(tiny_qwen3_dir, rows, checkpoints, step, message):  # noqa: F811
    state = checkpoints / "checkpoint-2" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "global_step": step}))
    with pytest.raises(ValueError, match=message):
        make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=4).train(
            resume_from_checkpoint=str(checkpoints / "checkpoint-2"))
    renamed = checkpoints / "checkpoint-1000000"
    (checkpoints / "checkpoint-2").rename(renamed)
    state = renamed / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "global_step": 1_000_000}))
    with pytest.raises(ValueError, match=r"global_step 1000000, beyond the 4 steps this run has"):
        make_trainer(tiny_qwen3_dir, checkpoints, rows, max_steps=4).train(resume_from_checkpoint=str(renamed))


def test_two_runs_into_one_output_dir_are_refused(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    import fcntl

    holder = open(tmp_path / ".titans_hf_train.lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run, training into the same folder
    try:
        with pytest.raises(RuntimeError, match=r"\.titans_hf_train\.lock: held by .*another run is training into"):
            make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1).train()
    finally:
        holder.close()
    assert not list(tmp_path.glob("checkpoint-*"))
    make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1, save_strategy="no").train()  # free again


def test_a_full_disk_during_a_checkpoint_leaves_no_checkpoint(tiny_qwen3_dir, rows, tmp_path, monkeypatch):  # noqa: F811
    from transformers import Trainer

    def full_disk(self, output_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", full_disk)
    with pytest.raises(OSError, match=r"checkpoint .*checkpoint-1: the disk is full"):
        make_trainer(tiny_qwen3_dir, tmp_path, rows, max_steps=1).train()
    assert not list(tmp_path.glob("checkpoint-*"))
