"""Hostile input to every command's outputs: an output is replaced only with --overwrite, and then only what
titans_hf wrote there (its outputs manifest, never a file name such as config.json); a command that fails leaves
none of its outputs; files get the permissions the umask gives; no JSON output holds a bare NaN.

Each test checksums what it hands in and checks it is unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path

import pytest

from titans_hf.commands import main as cli_main
from titans_hf.files import atomic_write_json, atomic_write_text
from titans_hf.outputs import MANIFEST_NAME, check_folder_output, record_folder, writing_folder


def checksums(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def user_project(folder: Path) -> Path:
    """A user's folder that happens to hold a config.json (a model folder's name proves nothing)."""
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "main.py").write_text("print('mine')\n")
    (folder / "config.json").write_text('{"model_type": "qwen3"}\n')
    return folder


def test_toy_base_overwrite_never_deletes_a_folder_it_did_not_write(tmp_path):
    folder = user_project(tmp_path / "project")
    before = checksums(folder)
    with pytest.raises(FileExistsError, match=r"project exists; pass --overwrite"):
        cli_main(["recall", "toy-base", "--output-dir", str(folder), "--steps", "1"])
    with pytest.raises(FileExistsError, match=rf"project: will not replace it, even with --overwrite: it holds no "
                       rf"{MANIFEST_NAME.replace('.', '[.]')}"):
        cli_main(["recall", "toy-base", "--output-dir", str(folder), "--steps", "1", "--overwrite"])
    assert checksums(folder) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["project"]  # no scratch folder left


def test_a_folder_the_tool_wrote_is_replaceable_until_someone_adds_or_edits_a_file(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    record_folder(folder, "titans-hf recall toy-base")
    check_folder_output(folder, overwrite=True)  # exactly what it wrote: may be replaced
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        check_folder_output(folder, overwrite=False)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds files titans_hf did not write: \['notes.txt'\]"):
        check_folder_output(folder, overwrite=True)
    (folder / "notes.txt").unlink()
    (folder / "config.json").write_text('{"edited": true}')
    with pytest.raises(FileExistsError, match=r"files changed since titans_hf wrote them: \['config.json'\]"):
        check_folder_output(folder, overwrite=True)


def test_a_folder_written_in_place_replaces_only_its_own_kind_and_a_failure_puts_the_old_one_back(tmp_path):
    outputs = ["memory", "half.txt", "second.txt"]
    folder = tmp_path / "demo"
    with writing_folder(folder, overwrite=False, command="titans-hf demo", outputs=outputs) as output:
        (output / "memory").mkdir()
        (output / "memory" / "weights.bin").write_bytes(b"first")
    first = checksums(folder)
    assert json.loads((folder / MANIFEST_NAME).read_text())["whole"] == {"command": "titans-hf demo"}
    with pytest.raises(FileExistsError, match=r"demo exists; pass --overwrite"):
        with writing_folder(folder, overwrite=False, command="titans-hf demo", outputs=outputs):
            raise AssertionError("refused before the block runs")

    with pytest.raises(RuntimeError, match="cut short"):
        with writing_folder(folder, overwrite=True, command="titans-hf demo", outputs=outputs) as output:
            assert not (output / "memory").exists()  # the old folder is set aside, the new one starts empty
            (output / "half.txt").write_text("half")
            raise RuntimeError("cut short")
    assert checksums(folder) == first  # the failed run left the earlier folder as it was
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo"]

    with writing_folder(folder, overwrite=True, command="titans-hf demo", outputs=outputs) as output:
        (output / "second.txt").write_text("second")
    assert sorted(checksums(folder)) == [MANIFEST_NAME, "second.txt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError):
        with writing_folder(empty, overwrite=False, command="titans-hf demo", outputs=outputs) as output:
            (output / "half.txt").write_text("half")
            raise RuntimeError("cut short")
    assert empty.is_dir() and not any(empty.iterdir())


def test_a_subfolder_written_in_place_is_the_commands_whole_a_file_beside_it_the_users(tmp_path):
    """A file put inside an output subfolder while the command writes it cannot be told from the command's own: a
    success records it as the command's (a later overwrite replaces it), a failure removes the subfolder whole; the
    user's file put beside the outputs is kept, bytes unchanged, and never recorded."""
    folder, outputs = tmp_path / "demo", ["memory", "run.json"]
    beside = folder / "notes.txt"

    def write_memory(output: Path) -> None:
        (output / "memory").mkdir()
        (output / "memory" / "weights.bin").write_bytes(b"weights")
        (output / "memory" / "notes.txt").write_bytes(b"mine, inside\n")  # a user's, while the command runs

    with writing_folder(folder, overwrite=False, command="titans-hf demo", outputs=outputs) as output:
        write_memory(output)
        beside.write_bytes(b"mine, beside\n")
    mine = checksums(folder)["notes.txt"]
    assert sorted(json.loads((folder / MANIFEST_NAME).read_text())["files"]) == ["memory/notes.txt",
                                                                                  "memory/weights.bin"]
    first = checksums(folder)

    with pytest.raises(RuntimeError, match="cut short"):
        with writing_folder(folder, overwrite=True, command="titans-hf demo", outputs=outputs) as output:
            write_memory(output)
            (output / "memory" / "notes.txt").write_bytes(b"mine, inside, again\n")
            raise RuntimeError("cut short")
    assert checksums(folder) == first  # the failed run's subfolder went whole, the earlier one came back
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo"]

    with writing_folder(folder, overwrite=True, command="titans-hf demo", outputs=outputs) as output:
        (output / "run.json").write_text("{}")
    assert sorted(checksums(folder)) == [MANIFEST_NAME, "notes.txt", "run.json"]
    assert checksums(folder)["notes.txt"] == mine


def test_a_link_put_inside_an_output_subfolder_is_left_unrecorded_and_the_finished_outputs_kept(tmp_path, caplog):
    """A link (or FIFO) under an output subfolder is nothing the command writes: it is not recorded, a warning names
    it, the finished outputs stay (not removed as a failure), the file it points to is untouched, and a later
    overwrite refuses the folder until the link is removed."""
    target = tmp_path / "mine.txt"
    target.write_bytes(b"mine\n")
    before = checksums(tmp_path)
    folder = tmp_path / "demo"
    with caplog.at_level("WARNING", logger="titans_hf.outputs"):
        with writing_folder(folder, overwrite=False, command="titans-hf demo", outputs=["memory"]) as output:
            (output / "memory").mkdir()
            (output / "memory" / "weights.bin").write_bytes(b"weights")
            (output / "memory" / "link").symlink_to(target)
            os.mkfifo(output / "memory" / "fifo")
    assert (folder / "memory" / "weights.bin").read_bytes() == b"weights" and (folder / "memory" / "link").is_symlink()
    assert sorted(json.loads((folder / MANIFEST_NAME).read_text())["files"]) == ["memory/weights.bin"]
    warned = sorted(record.getMessage() for record in caplog.records)
    assert len(warned) == 2 and all("not a plain file or folder, so not an output of titans-hf demo" in message
                                    for message in warned)
    assert warned[0].startswith(f"{folder / 'memory' / 'fifo'}: ")
    assert warned[1].startswith(f"{folder / 'memory' / 'link'}: ")
    with pytest.raises(FileExistsError, match=r"will not replace it, even with --overwrite: .*memory/(fifo|link) is "
                       "not a plain file or folder"):
        with writing_folder(folder, overwrite=True, command="titans-hf demo", outputs=["memory"]):
            raise AssertionError("refused before the block runs")
    assert checksums(tmp_path)["mine.txt"] == before["mine.txt"]


def test_the_demo_refuses_a_users_folder_before_any_work(tmp_path):
    folder = user_project(tmp_path / "project")
    before = checksums(folder)
    for flags in ([], ["--overwrite"]):
        with pytest.raises(FileExistsError, match=r"project(: will not replace it, even with --overwrite| exists)"):
            cli_main(["demo", "--output-dir", str(folder), "--pretrain-steps", "1", *flags])
    assert checksums(folder) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["project"]


def test_eval_keeps_earlier_outputs_without_overwrite_and_a_users_files_even_with_it(tmp_path, tiny_qwen3_dir):
    output = tmp_path / "eval"
    output.mkdir()
    (output / "results.json").write_text('{"mine": 1}\n')
    (output / "predictions.jsonl").write_text('{"mine": 1}\n')
    before = checksums(output)
    argv = ["eval", "--model", str(tiny_qwen3_dir), "--generate", "--lengths", "0", "--output", str(output)]
    with pytest.raises(FileExistsError, match=r"eval/results\.json exists; pass --overwrite"):
        cli_main(argv)
    with pytest.raises(FileExistsError, match=r"results\.json: will not replace it, even with --overwrite: titans_hf "
                       "did not write it"):
        cli_main([*argv, "--overwrite"])
    assert checksums(output) == before
    lm = ["eval", "--lm", "--model", str(tiny_qwen3_dir), "--data", str(tmp_path), "--window-size", "8"]
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "lm_results.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"lm_results\.json exists; pass --overwrite"):
        cli_main([*lm, "--output", str(tmp_path / "lm")])


def test_recall_generate_checks_its_arguments_before_writing_anything(tmp_path, tiny_tokenizer_dir, capsys):
    output = tmp_path / "corpus"
    base = ["recall", "generate", "--output-dir", str(output), "--tokenizer", str(tiny_tokenizer_dir)]
    for flags, named in ((["--num-eval", "0"], "--num-eval 0"), (["--num-train", "-1"], "--num-train -1"),
                         (["--window-size", "1"], "--window-size 1"), (["--reference-rate", "2"], "--reference-rate 2")):
        with pytest.raises(ValueError, match=named):
            cli_main([*base, *flags])
        assert not output.exists()
    with pytest.raises(SystemExit):  # the parser names a missing local path, before anything is written
        cli_main(["recall", "generate", "--output-dir", str(output), "--tokenizer", str(tmp_path / "missing_tokenizer")])
    assert "missing_tokenizer: no such file or folder" in capsys.readouterr().err
    assert not output.exists()
    with pytest.raises(ValueError, match="--steps 0: must be at least 1"):
        cli_main(["recall", "toy-base", "--output-dir", str(tmp_path / "base"), "--steps", "0"])
    assert not (tmp_path / "base").exists()


def test_recall_generate_that_fails_late_leaves_none_of_its_outputs(tmp_path, tiny_tokenizer_dir, monkeypatch):
    import titans_hf.commands.recall as recall_command

    def failing_store(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recall_command, "write_recall_eval_store", failing_store)
    output = tmp_path / "corpus"
    with pytest.raises(OSError, match="No space left"):
        cli_main(["recall", "generate", "--output-dir", str(output), "--tokenizer", str(tiny_tokenizer_dir),
                  "--num-train", "2", "--num-eval", "2", "--window-size", "256", "--min-distance", "8"])
    assert list(output.iterdir()) == []  # neither train.jsonl nor eval.jsonl, nor a temporary


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_atomic_outputs_get_the_permissions_of_the_umask(tmp_path, mask):
    previous = os.umask(mask)
    try:
        path = atomic_write_text(tmp_path / "out.txt", "x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_json_outputs_hold_null_where_a_number_is_not_finite(tmp_path):
    path = atomic_write_json(tmp_path / "lm_results.json", {"loss": [1.5, math.nan], "ratio": math.inf})
    assert json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"bare {name}")) == {
        "loss": [1.5, None], "ratio": None}


def test_a_full_disk_during_a_bin_prepare_says_so_and_leaves_no_partial_store(tmp_path, tiny_tokenizer_dir,
                                                                               monkeypatch):
    from titans_hf.data import stores
    from titans_hf.data.prepare import prepare

    source = tmp_path / "docs.txt"
    source.write_text("John went to the garden.\n" * 50)
    before = checksums(tmp_path)

    def full_disk(self, key, values):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stores.MmapStoreWriter, "_write", full_disk)
    with pytest.raises(OSError, match=r"prepare .*corpus_bin: the disk is full \(or over quota\)"):
        prepare(source, tmp_path / "corpus_bin", tiny_tokenizer_dir)
    assert checksums(tmp_path) == before and sorted(path.name for path in tmp_path.iterdir()) == ["docs.txt"]
    with pytest.raises(FileNotFoundError, match=r"tokenizer \(--tokenizer\) .*missing: no such file or folder"):
        prepare(source, tmp_path / "corpus_bin", tmp_path / "missing")


def test_rows_of_another_task_are_refused_and_a_wrong_length_label_warns(tmp_path, tiny_qwen3_dir):
    from transformers import AutoTokenizer

    from titans_hf.modeling import TitansQwenForCausalLM
    from titans_hf.tasks.babilong import generate_babilong, write_babilong_json
    from titans_hf.tasks.babilong.evaluation import evaluate_babilong

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=64, memory_head_dim=16, memory_chunk_size=8)
    qa1_rows = generate_babilong("qa1", 2, 0, tokenizer, seed=1)
    labelled_qa6 = write_babilong_json(qa1_rows, tmp_path / "qa6" / "0k.json")  # qa1 rows in a file labelled qa6
    before = checksums(tmp_path)
    with pytest.raises(ValueError, match=r"qa6/0k\.json: scored as task 'qa6' .*are not among qa6's labels "
                       r"\['no', 'yes'\]"):
        evaluate_babilong(model, tokenizer, {("qa6", "0k"): labelled_qa6}, max_new_tokens=1, ablation=False,
                          show_progress=False)
    labelled_1k = write_babilong_json(qa1_rows, tmp_path / "qa1" / "1k.json")  # far shorter than 1k tokens
    with pytest.warns(UserWarning, match=r"qa1/1k\.json: reported as task 'qa1' length '1k' \(1024 tokens\), but its "
                      r"prompts measure \d+-\d+ tokens"):
        evaluate_babilong(model, tokenizer, {("qa1", "1k"): labelled_1k}, max_new_tokens=1, ablation=False,
                          show_progress=False)
    assert {name: digest for name, digest in checksums(tmp_path).items() if name in before} == before
