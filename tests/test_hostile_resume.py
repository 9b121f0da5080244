"""Hostile resumes: the memory states State Passing saved (missing, not finite, another memory's), a sampler state with
fields of the wrong type or range, and a copy of a finished run's output_dir; each refused before training, naming the
file and what to do, with the checkpoint left as it was."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import make_trainer, rows  # noqa: F401  (rows is a fixture)

PASSED_STATES = "passed_memory_states.safetensors"


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def state_passing_run(tiny_qwen3_dir, rows, tmp_path_factory):  # noqa: F811
    """A run of 2 steps under State Passing (every row passes its state on), with a checkpoint at each."""
    folder = tmp_path_factory.mktemp("state_passing_run")
    make_trainer(tiny_qwen3_dir, folder, rows, max_steps=2, state_passing=1.0).train()
    return folder


@pytest.fixture
def run_copy(state_passing_run, tmp_path) -> Path:
    """A copy of the State Passing run, for one test to damage."""
    return Path(shutil.copytree(state_passing_run, tmp_path / "run"))


def other_rows(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    key = next(key for key in flat if ".weights." in key)
    return {**flat, key: torch.cat([flat[key], flat[key]])}


def other_heads(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    key = next(key for key in flat if ".momentum." in key)
    return {**flat, key: flat[key][:, :2].contiguous()}


def other_layers(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    layer = next(iter(flat)).split(".", 1)[0]
    return {**flat, **{f"{int(layer) + 1}.{key.split('.', 1)[1]}": tensor.clone() for key, tensor in flat.items()}}


def other_dtype(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: tensor.double() if tensor.is_floating_point() else tensor for key, tensor in flat.items()}


def not_finite(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    key = next(key for key in flat if ".batch_start_weights." in key)
    broken = flat[key].clone()
    broken.view(-1)[0] = float("inf")
    return {**flat, key: broken}


@pytest.mark.parametrize(("damage", "message"), [
    (None, "is missing, so the rows that State Passing starts from the memory states"),
    (b"not safetensors", "not a readable safetensors file"),
    (not_finite, r"layer \d+'s batch_start_weights.0 holds NaN or infinite values"),
    (other_dtype, r"layer \d+'s \S+ is torch.float64 of shape .*, this memory's is torch.float32"),
    (other_heads, r"layer \d+'s momentum.0 is torch.float32 of shape \(1, 2, 16, 16\), this memory's is "
                  r"torch.float32 of shape \(rows, 4, 16, 16\)"),
    (other_layers, r"it holds the states of memory layers \['\d+', '\d+'\], this model's memory layers are \[\d+\]"),
    (other_rows, r"its tensors hold \[1, 2\] rows"),
], ids=["missing", "garbage", "not_finite", "float64", "other_heads", "other_layers", "other_rows"])
def test_passed_memory_states_that_are_not_this_runs_are_refused_naming_the_file(
        tiny_qwen3_dir, rows, run_copy, damage, message):  # noqa: F811
    """State Passing resumed without the states the checkpoint saved would silently be another run: a missing file,
    one that is not safetensors, not finite, or of another memory (dtype, heads, layers, rows) is refused before
    training, naming the file; the checkpoint is left as it was."""
    states = run_copy / "checkpoint-2" / PASSED_STATES
    if damage is None:
        states.unlink()
    elif isinstance(damage, bytes):
        states.write_bytes(damage)
    else:
        save_file(damage(load_file(states)), str(states))
    before = checksums(run_copy)
    trainer = make_trainer(tiny_qwen3_dir, run_copy, rows, max_steps=4, state_passing=1.0)
    with pytest.raises(ValueError, match=message) as raised:
        trainer.train(resume_from_checkpoint=True)
    assert f"cannot resume from {run_copy / 'checkpoint-2'}: {states}" in str(raised.value)
    assert trainer.state.global_step == 0  # refused before any step
    assert checksums(run_copy) == before


def test_a_resume_without_state_passing_names_the_change(tiny_qwen3_dir, rows, run_copy, caplog):  # noqa: F811
    """Resuming a State Passing checkpoint with state_passing 0 drops the states it saved: a changed setting, named."""
    trainer = make_trainer(tiny_qwen3_dir, run_copy, rows, max_steps=2, save_strategy="no", state_passing=0.0)
    with caplog.at_level(logging.WARNING, logger="titans_hf.training.checkpointing"):
        trainer.train(resume_from_checkpoint=True)
    (warning,) = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert "state_passing 1.0 -> 0.0" in warning


@pytest.fixture(scope="module")
def sampler_run(tiny_qwen3_dir, rows, tmp_path_factory):  # noqa: F811
    """Two runs of 2 steps with a checkpoint at each: rows in a seeded order, and in a length curriculum."""
    folders = {}
    for curriculum in (None, [1, 3]):
        folders[str(curriculum)] = tmp_path_factory.mktemp("sampler_run")
        make_trainer(tiny_qwen3_dir, folders[str(curriculum)], rows, max_steps=2, curriculum_chunks=curriculum).train()
    return folders


@pytest.mark.parametrize(("curriculum", "change", "message"), [
    (None, {"seed": 1e30}, "field 'seed' is 1e+30, not an integer from 0 to 18446744073709551615"),
    (None, {"seed": 2**64}, "field 'seed' is 18446744073709551616, not an integer from 0"),
    (None, {"epoch": -1}, "field 'epoch' is -1, not an integer from 0"),
    (None, {"epoch": 2**64 - 1, "seed": 1}, "fields 'seed' and 'epoch' sum to 18446744073709551616, beyond the "
                                            "largest seed"),
    (None, {"shuffle": "yes"}, "field 'shuffle' is 'yes', not true or false"),
    (None, {"num_samples": 6.0}, "field 'num_samples' is 6.0, not a number of rows"),
    (None, {"seed": None}, "field 'seed' is None"),
    ([1, 3], {"seed": "0"}, "field 'seed' is '0', not an integer"),
    ([1, 3], {"epoch": 1.5}, "field 'epoch' is 1.5, not an integer"),
    ([1, 3], {"stages": "1 3"}, "field 'stages' is '1 3', not a list of chunk counts >= 1"),
    ([1, 3], {"group_size": 0}, "field 'group_size' is 0, not an integer >= 1 or null"),
])
def test_a_sampler_state_with_a_wrong_field_is_refused_naming_file_and_field(
        tiny_qwen3_dir, rows, sampler_run, tmp_path, curriculum, change, message):  # noqa: F811
    """sampler_state.json's seed, epoch and other fields are checked when the resume reads it, before training: a
    ValueError naming the file and the field, where they used to fail inside the training loop without either."""
    run = Path(shutil.copytree(sampler_run[str(curriculum)], tmp_path / "run"))
    path = run / "checkpoint-2" / "sampler_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    before = checksums(run)
    trainer = make_trainer(tiny_qwen3_dir, run, rows, max_steps=4, curriculum_chunks=curriculum)
    with pytest.raises(ValueError) as raised:
        trainer.train(resume_from_checkpoint=True)
    assert str(raised.value).startswith(f"{path}: not the state of this run's sampler (")
    assert message in str(raised.value)
    assert trainer.state.global_step == 0  # refused before any step
    assert checksums(run) == before


def test_a_sampler_state_that_is_not_an_object_or_lacks_a_field_is_named(
        tiny_qwen3_dir, rows, sampler_run, tmp_path):  # noqa: F811
    run = Path(shutil.copytree(sampler_run["None"], tmp_path / "run"))
    path = run / "checkpoint-2" / "sampler_state.json"
    for content, message in (("[0, 1]", "the state is a list, not a JSON object"),
                             ('{"seed": 0, "epoch": 1}', "the state lacks the field(s) ['shuffle', 'num_samples']")):
        path.write_text(content)
        with pytest.raises(ValueError) as raised:
            make_trainer(tiny_qwen3_dir, run, rows, max_steps=4).train(resume_from_checkpoint=True)
        assert str(path) in str(raised.value) and message in str(raised.value)
        assert path.read_text() == content


def test_a_copy_of_a_finished_run_says_why_it_is_refused_and_what_to_do(tiny_qwen3_dir, rows, tmp_path):  # noqa: F811
    """`cp -r` of a finished run's output_dir, then resumed in place: the copied record of what titans_hf wrote binds
    to the original folder's inode, so the final save would replace files titans_hf cannot tell from the user's. One
    line says so, names the record and the way out, which works: resume into a new output_dir."""
    finished = make_trainer(tiny_qwen3_dir, tmp_path / "run", rows, max_steps=2)
    finished.train()
    finished.save_model()
    copy = Path(shutil.copytree(tmp_path / "run", tmp_path / "copy"))
    before = checksums(copy)
    with pytest.raises(FileExistsError) as raised:
        make_trainer(tiny_qwen3_dir, copy, rows, max_steps=2).train(resume_from_checkpoint=True)
    message = str(raised.value)
    assert "\n" not in message
    assert f"output_dir {copy}: the memory saved at the end of training would replace " in message
    assert "memory_model.safetensors" in message and "training_args.json" in message
    assert (f"{copy / '.titans_hf_outputs.json'}, the record of what titans_hf wrote there, vouches for none of them: "
            "it holds the inode of the folder it was written in, and this folder is another (a copy of a run's "
            "output_dir, e.g. by cp -r)") in message
    assert "resume into a new output_dir (--output_dir, with --resume_from_checkpoint naming the checkpoint)" in message
    assert checksums(copy) == before

    elsewhere = make_trainer(tiny_qwen3_dir, tmp_path / "new", rows, max_steps=2)
    elsewhere.train(resume_from_checkpoint=str(copy / "checkpoint-1"))
    assert elsewhere.state.global_step == 2
    assert checksums(copy) == before
