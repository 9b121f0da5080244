"""The recall recipe end to end: the README's `scripts/recall.sh` block as written (toy base, generate, prepare,
train on the store, eval --lm twice, report; then a second memory on the same base and data) on tiny sizes, and
the refusals of `titans-hf recall`."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from titans_hf.commands import main as cli_main
from titans_hf.data.stores import open_store

REPO = Path(__file__).resolve().parent.parent
TINY = {"BASE_STEPS": "20", "NUM_TRAIN": "32", "NUM_EVAL": "6", "MAX_STEPS": "3"}


def readme_recall_block() -> str:
    [block] = [code for code in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
               if "scripts/recall.sh" in code]
    return block


def test_readme_recall_block_trains_evaluates_reports_and_reuses_base_and_data(tmp_path):
    out = tmp_path / "recall"
    lines = [line for line in readme_recall_block().splitlines() if line.strip()]
    assert len(lines) == 2 and lines[1].startswith("RUN=local scripts/recall.sh --attend_previous_chunk false")
    completed = subprocess.run(["bash", "-euo", "pipefail", "-c", lines[0]], cwd=REPO, capture_output=True,
                               text=True, env={**os.environ, **TINY, "OUT": str(out)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    base, data, memory = out / "base", out / "data", out / "memory"
    assert (base / "pretraining.json").is_file() and (base / "config.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no partial folder left behind
    assert len((data / "train.jsonl").read_text().splitlines()) == 32
    held_out = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    # the dependent store holds the held-out documents' tokens, its mask one token per recalled value
    with open_store(data / "eval_dependent") as dependent, open_store(data / "eval_seq") as every:
        assert dependent.num_segments("sequence") == every.num_segments("sequence") == 6
        for index, document in enumerate(held_out):
            assert dependent.segment("sequence", index).tolist() == every.segment("sequence", index).tolist()
            assert int(dependent.segment("loss_mask", index).sum()) == len(document["references"])
    recalled = json.loads((memory / "lm_recalled_values" / "lm_results.json").read_text())
    assert recalled["memory"]["tokens"][0] == 0  # no value is recalled in the chunk of its statement
    assert sum(recalled["memory"]["tokens"]) == sum(len(d["references"]) for d in held_out)
    summary = json.loads((out / "recall_summary.json").read_text())
    assert [row["run"] for row in summary] == ["memory"]
    assert summary[0]["recalled_ratio"] == recalled["ratio"]["after_first_chunk"]
    assert (out / "recall.png").read_bytes()[:4] == b"\x89PNG"

    assert json.loads((memory / "memory_config.json").read_text())["attend_previous_chunk"] is True  # the default

    stamp = (base / "pretraining.json").stat().st_mtime_ns, (data / "train_seq" / "meta.json").stat().st_mtime_ns
    completed = subprocess.run(["bash", "-euo", "pipefail", "-c", lines[1]], cwd=REPO, capture_output=True,
                               text=True, env={**os.environ, **TINY, "OUT": str(out)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert ((base / "pretraining.json").stat().st_mtime_ns, (data / "train_seq" / "meta.json").stat().st_mtime_ns) == stamp
    assert json.loads((out / "local" / "memory_config.json").read_text())["attend_previous_chunk"] is False
    assert [row["run"] for row in json.loads((out / "recall_summary.json").read_text())] == ["local", "memory"]
    report = completed.stdout.splitlines()
    header = next(index for index, line in enumerate(report) if line.startswith("run "))
    assert [line.split()[0] for line in report[header + 1:header + 3]] == ["local", "memory"]  # the report's table


def test_recall_commands_refuse_to_replace_what_they_did_not_write(tmp_path, tiny_tokenizer_dir):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="mine exists"):
        cli_main(["recall", "toy-base", "--output-dir", str(folder), "--steps", "1"])
    (folder / "config.json").write_text("{}")  # a model folder's name proves nothing: only the tool's manifest does
    with pytest.raises(FileExistsError, match="will not replace it, even with --overwrite: it holds no "
                       r"\.titans_hf_outputs\.json"):
        cli_main(["recall", "toy-base", "--output-dir", str(folder), "--steps", "1", "--overwrite"])
    (folder / "config.json").unlink()
    (folder / "eval_dependent").mkdir()
    (folder / "eval_dependent" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="eval_dependent: will not replace it"):
        cli_main(["recall", "generate", "--output-dir", str(folder), "--tokenizer", str(tiny_tokenizer_dir),
                  "--overwrite"])
    assert sorted(p.name for p in folder.rglob("*")) == ["eval_dependent", "notes.txt", "notes.txt"]
