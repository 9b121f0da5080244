"""Every writer takes its output path once: what appears there while it runs is never removed, and of two writers
of one output, one wins and the other fails naming it.

`WRITERS` lists each command that writes a user-named output, with the kind of output it writes; a new writer is
covered by adding one line. The output is made to appear at the last moment, just before the final rename
(`titans_hf.files.rename_no_replace` is wrapped), the hardest case for a writer that checked at its start.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_gguf_base import GGUF_NAME, tiny_llama, write_llama_gguf
from transformers import AutoTokenizer

import titans_hf.files as files
import titans_hf.outputs as outputs
from titans_hf.commands import main as cli_main
from titans_hf.data.prepare import prepare
from titans_hf.files import atomic_write_json
from titans_hf.gguf_base import CONVERSION_RECORD_NAME, llama_gguf_to_qwen2
from titans_hf.outputs import check_folder_output, prepare_output_dir, record_folder, replace_outputs
from titans_hf.tasks.recall import build_recall_eval_store, generate_recall


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Any]:
    """What the writers read: a tiny Llama GGUF, a text file, recall documents, the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("inputs")
    write_llama_gguf(folder / GGUF_NAME, tiny_llama(len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))),
                     Path(tiny_tokenizer_dir))
    (folder / "text.txt").write_text("Mary went to the kitchen. John went to the garden.\n" * 4)
    return {"folder": folder, "tokenizer": str(tiny_tokenizer_dir), "documents": list(generate_recall(2, seed=0))}


def _eval_outputs(inputs: dict[str, Any], output: Path) -> None:
    """What `titans-hf eval`, `lm-eval` and the real-base job do with their output folder's files."""
    folder = prepare_output_dir(output.parent, (output.name,), overwrite=False)
    atomic_write_json(folder / output.name, {"accuracy": 1.0})


def _toy_folder(inputs: dict[str, Any], output: Path) -> None:
    """What `titans-hf recall toy-base` does: a folder made whole under a temporary name, then renamed in."""
    check_folder_output(output, overwrite=False)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    (scratch / "config.json").write_text("{}")
    record_folder(scratch, "test")
    try:
        replace_outputs([scratch], [output])
    except BaseException:
        files.remove_path(scratch)
        raise


# (writer, output name, whether the output is a folder)
WRITERS: dict[str, tuple[Callable[[dict[str, Any], Path], Any], str, bool]] = {
    "gguf conversion": (lambda inputs, output: llama_gguf_to_qwen2(inputs["folder"], GGUF_NAME, output), "base",
                        True),
    "babilong generate --output": (lambda inputs, output: cli_main([
        "babilong", "generate", "--task", "qa1", "--length", "0", "--num-samples", "1", "--tokenizer",
        inputs["tokenizer"], "--output", str(output)]), "rows.json", False),
    "babilong generate --card": (lambda inputs, output: cli_main([
        "babilong", "generate", "--task", "qa1", "--length", "0", "--num-samples", "1", "--tokenizer",
        inputs["tokenizer"], "--output", str(output.with_name("rows.json")), "--card"]), "README.md", False),
    "prepare .h5": (lambda inputs, output: prepare(inputs["folder"] / "text.txt", output, inputs["tokenizer"]),
                    "store.h5", False),
    "prepare bin": (lambda inputs, output: prepare(inputs["folder"] / "text.txt", output, inputs["tokenizer"]),
                    "store", True),
    "recall eval store": (lambda inputs, output: build_recall_eval_store(inputs["documents"], output,
                                                                         inputs["tokenizer"]), "eval.h5", False),
    "eval output file": (_eval_outputs, "results.json", False),
    "toy base folder": (_toy_folder, "toy", True),
}


def _put_users(output: Path, is_folder: bool) -> Path:
    """The user's file, at `output` itself or inside a folder `output`; returns it."""
    if is_folder:
        output.mkdir()
        (output / "notes.txt").write_text("mine")
        return output / "notes.txt"
    output.write_text("mine")
    return output


def _before_the_final_rename(monkeypatch, action: Callable[[Path], None]) -> None:
    """Run `action(target)` just before each writer's final rename of its output."""
    rename = files.rename_no_replace

    def wrapped(source: Path, target: Path) -> None:
        action(target)
        rename(source, target)

    monkeypatch.setattr(files, "rename_no_replace", wrapped)
    monkeypatch.setattr(outputs, "rename_no_replace", wrapped)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_an_output_that_appears_while_a_writer_runs_is_kept_and_named(name, inputs, tmp_path, monkeypatch,
                                                                      one_thread):
    write, output_name, is_folder = WRITERS[name]
    output = tmp_path / "out" / output_name
    output.parent.mkdir()
    users: list[Path] = []
    _before_the_final_rename(monkeypatch, lambda target: (
        users.append(_put_users(output, is_folder)) if target == output and not users else None))
    with pytest.raises((FileExistsError, ValueError), match=str(output)):
        write(inputs, output)
    assert users and users[0].read_text() == "mine"
    # nothing else is left under the output: no half-written output, no temporary under a hidden name
    assert sorted(path.name for path in output.parent.rglob("*")) == sorted(
        {"notes.txt", output_name} if is_folder else {output_name})


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_of_two_writers_of_one_output_one_wins_and_the_other_fails_naming_it(name, inputs, tmp_path, monkeypatch,
                                                                            one_thread):
    # two processes, as two runs of a command are; both have checked and written before either renames
    write, output_name, _ = WRITERS[name]
    output = tmp_path / "out" / output_name
    output.parent.mkdir()
    context = multiprocessing.get_context("fork")
    both_written, results = context.Barrier(2, timeout=120), context.Queue()
    waited: list[bool] = []

    def wait_for_the_other(target: Path) -> None:
        if not waited:
            waited.append(True)
            both_written.wait()

    _before_the_final_rename(monkeypatch, wait_for_the_other)

    def run() -> None:
        try:
            write(inputs, output)
            results.put(None)
        except BaseException as error:  # noqa: BLE001 (reported to the test)
            results.put(f"{type(error).__name__}: {error}")

    processes = [context.Process(target=run) for _ in range(2)]
    for process in processes:
        process.start()
    outcomes = sorted([results.get(timeout=300) for _ in processes], key=lambda outcome: outcome is not None)
    for process in processes:
        process.join()
    assert outcomes[0] is None and outcomes[1] is not None, outcomes
    # named: the output, or the writer's first output (the rows, of a card written beside them)
    assert outcomes[1].startswith(f"FileExistsError: output {output.parent}/")
    assert "while this command ran" in outcomes[1]
    assert output.exists()
    if name == "gguf conversion":
        assert json.loads((output / CONVERSION_RECORD_NAME).read_text())["gguf_file"] == GGUF_NAME


def test_an_output_folder_changed_while_an_overwrite_runs_is_kept(inputs, tmp_path, monkeypatch, one_thread):
    # with --overwrite, the folder this tool wrote is replaced only while it is still what the start checked
    output = tmp_path / "base"
    llama_gguf_to_qwen2(inputs["folder"], GGUF_NAME, output)
    _before_the_final_rename(monkeypatch, lambda target: None)
    check = outputs.set_aside_claimed

    def user_adds_a_file(path: Path) -> Path | None:
        if path == output:
            (output / "notes.txt").write_text("mine")
        return check(path)

    monkeypatch.setattr(outputs, "set_aside_claimed", user_adds_a_file)
    with pytest.raises(FileExistsError, match=rf"output {output}: it changed while this command ran"):
        llama_gguf_to_qwen2(inputs["folder"], GGUF_NAME, output, overwrite=True)
    assert (output / "notes.txt").read_text() == "mine" and (output / CONVERSION_RECORD_NAME).is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["base"]


def test_no_replace_rename_falls_back_to_links_and_empty_folders(tmp_path, monkeypatch):
    # where renameat2 is missing: a file is linked in, a folder renamed onto an empty folder made first
    monkeypatch.setattr(files, "RENAMEAT2", None)
    (tmp_path / "new.txt").write_text("new")
    (tmp_path / "taken.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=str(tmp_path / "taken.txt")):
        files.rename_no_replace(tmp_path / "new.txt", tmp_path / "taken.txt")
    assert (tmp_path / "taken.txt").read_text() == "mine"
    files.rename_no_replace(tmp_path / "new.txt", tmp_path / "free.txt")
    assert (tmp_path / "free.txt").read_text() == "new" and not (tmp_path / "new.txt").exists()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "a").write_text("a")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match=str(tmp_path / "taken")):
        files.rename_no_replace(tmp_path / "new", tmp_path / "taken")
    (tmp_path / "taken" / "b").write_text("b")
    with pytest.raises(FileExistsError, match=str(tmp_path / "taken")):
        files.rename_no_replace(tmp_path / "new", tmp_path / "taken")
    assert sorted(path.name for path in (tmp_path / "taken").iterdir()) == ["b"]
    files.rename_no_replace(tmp_path / "new", tmp_path / "free")
    assert (tmp_path / "free" / "a").read_text() == "a"
