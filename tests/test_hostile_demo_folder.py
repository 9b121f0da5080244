"""`titans-hf demo --output-dir D` writes its outputs into D in place (`outputs.writing_folder`): a file a user puts
into D while the demo runs stays the user's. A failed run removes only what it wrote (and puts an earlier run's
outputs back); a successful one records only its own files, so a later `--overwrite` keeps the user's file too. The
folders the demo writes into D (data/, memory/) are the demo's whole: a file put inside one while it runs cannot be
told from the demo's own, so it goes with the folder on failure and is recorded as the demo's on success.

The demo runs for real on the tiny local Qwen3 (`--model`, so no toy base is pretrained), with its base's in-context
accuracy (a stage that only reports) replaced by a fixed answer; a failure is a training stage that raises."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from titans_hf.commands import demo_job
from titans_hf.outputs import MANIFEST_NAME

USER_BYTES = b"my notes on this run\n"


def checksums(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def manifest_files(folder: Path) -> set[str]:
    return set(json.loads((folder / MANIFEST_NAME).read_text())["files"])


def base_accuracy_dropping(user_file: Path | None):
    """The base-accuracy stage, answered at once; the user's file appears in the output folder meanwhile."""
    def stage(*args, **kwargs) -> dict:
        if user_file is not None:
            user_file.write_bytes(USER_BYTES)
        return {"rows": 0, "fits_one_chunk": True, "max_prompt_tokens": 0, "exact_match": 0.0,
                "last_location_baseline": 0.0, "chance": 1 / 6}
    return stage


def failing_training(model_args, memory_args, data_args, training_args):
    """Training that stops at once, the BABILong files it was given written into the output folder."""
    assert data_args.data_files and all(Path(file).is_file() for file in data_args.data_files)
    raise RuntimeError("training stopped")


def training_after_a_file_put_into_data(train):
    """`train`, after a user's file appears in the folder of the training files (data/) the demo is writing."""
    def stage(model_args, memory_args, data_args, training_args):
        (Path(data_args.data_files[0]).parent / "notes.txt").write_bytes(USER_BYTES)
        return train(model_args, memory_args, data_args, training_args)
    return stage


def small_demo(output: Path, model_dir: Path, overwrite: bool = False) -> dict:
    settings = demo_job.DemoSettings(base=str(model_dir), train_chunks=(0, 3), eval_chunks=(3,), num_train_samples=8,
                                     num_eval_samples=2, batch_size=4, max_steps=1)
    return demo_job.run_demo(output, settings, overwrite=overwrite, show_progress=False)


def test_a_failed_demo_removes_what_it_wrote_and_keeps_a_file_put_there_meanwhile(tmp_path, tiny_qwen3_dir,
                                                                                  monkeypatch):
    output = tmp_path / "demo"
    notes = output / "notes.txt"
    model_before = checksums(tiny_qwen3_dir)
    monkeypatch.setattr(demo_job, "base_accuracy", base_accuracy_dropping(notes))
    monkeypatch.setattr(demo_job, "train_memory", training_after_a_file_put_into_data(failing_training))
    with pytest.raises(RuntimeError, match="training stopped"):
        small_demo(output, tiny_qwen3_dir)
    # the BABILong files it wrote before training are gone, with the file put among them (data/ is the demo's
    # whole); the user's file beside the outputs is there, as it was put
    assert sorted(path.name for path in output.iterdir()) == ["notes.txt"]
    assert notes.read_bytes() == USER_BYTES
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo"]
    assert checksums(tiny_qwen3_dir) == model_before


def test_a_file_put_into_the_folder_during_a_demo_stays_the_users_through_later_runs(tmp_path, tiny_qwen3_dir,
                                                                                    monkeypatch):
    output = tmp_path / "demo"
    notes = output / "notes.txt"
    monkeypatch.setattr(demo_job, "base_accuracy", base_accuracy_dropping(notes))
    with monkeypatch.context() as patch:
        patch.setattr(demo_job, "train_memory", training_after_a_file_put_into_data(demo_job.train_memory))
        small_demo(output, tiny_qwen3_dir)
    assert notes.read_bytes() == USER_BYTES
    recorded = manifest_files(output)
    # the manifest lists every file the demo wrote and not the user's beside them; one put into data/ while the
    # demo wrote it is the demo's
    assert "notes.txt" not in recorded and {"run.json", "results.json", "memory/memory_model.safetensors"} <= recorded
    assert "data/qa1/notes.txt" in recorded
    assert recorded == set(checksums(output)) - {"notes.txt", MANIFEST_NAME}
    first = checksums(output)

    # an --overwrite run that fails puts the earlier outputs (and their manifest) back and keeps the user's file
    monkeypatch.setattr(demo_job, "base_accuracy", base_accuracy_dropping(None))
    with monkeypatch.context() as patch:
        patch.setattr(demo_job, "train_memory", failing_training)
        with pytest.raises(RuntimeError, match="training stopped"):
            small_demo(output, tiny_qwen3_dir, overwrite=True)
    assert checksums(output) == first
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo"]

    # an --overwrite run that succeeds replaces the demo's outputs and nothing else
    (output / "run.json").write_text("{}")  # an output changed since: refused, even with --overwrite
    with pytest.raises(FileExistsError, match=r"files changed since titans_hf wrote them: \['run.json'\]"):
        small_demo(output, tiny_qwen3_dir, overwrite=True)
    (output / "run.json").unlink()
    small_demo(output, tiny_qwen3_dir, overwrite=True)
    assert notes.read_bytes() == USER_BYTES and "notes.txt" not in manifest_files(output)
    assert json.loads((output / "run.json").read_text())["task"] == "qa1"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo"]
