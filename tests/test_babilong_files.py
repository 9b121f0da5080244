"""Published BABILong as published: the Hub sets' parquet layout, snapshot folders, JSON / JSON Lines, their labels.

Every file here is built locally in the layout of `RMT-team/babilong` (`<length>/<task>-0000i-of-0000n.parquet`,
columns input / question / target plus whatever else); nothing downloads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import load_dataset
from transformers import AutoTokenizer

import titans_hf  # noqa: F401  (registers titans_babilong)
from titans_hf.commands import main as cli_main
from titans_hf.modeling.modeling_titans_qwen import TitansQwenForCausalLM
from titans_hf.tasks.babilong import (
    LABELS_FROM_BABILONG,
    LABELS_FROM_TARGETS,
    babilong_path_labels,
    build_example,
    find_babilong_sources,
    generate_babilong,
    length_tokens,
    read_babilong_file,
    train_eval_split,
)
from titans_hf.tasks.babilong.evaluation import babilong_files_by_task_length, evaluate_babilong


def story(actor: str, place: str, other: str = "John", elsewhere: str = "office") -> dict[str, str]:
    return {"input": f"{actor} went to the {place}. {other} moved to the {elsewhere}.",
            "question": f"Where is {actor}? ", "target": place}


QA1 = [story("Mary", "garden"), story("Sandra", "kitchen"), story("Daniel", "hallway", "Mary", "bedroom")]
# a task BABILong publishes no label set for (qa11: basic coreference, answers are locations too)
QA11 = [{"input": "Mary went to the bathroom. Then she went to the garden.", "question": "Where is Mary? ",
         "target": "garden"},
        {"input": "Daniel moved to the office. Afterwards he went to the kitchen.", "question": "Where is Daniel? ",
         "target": "kitchen"}]


def write_parquet(path: Path, rows: list[dict[str, str]], extra: bool = True) -> Path:
    """A parquet file like the Hub's: the three columns and (with `extra`) one the readers must ignore."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {field: [row[field] for row in rows] for field in ("input", "question", "target")}
    if extra:
        columns["extra_public_field"] = list(range(len(rows)))
    pq.write_table(pa.table(columns), path)
    return path


def snapshot(root: Path) -> Path:
    """A folder shaped like a downloaded snapshot of the Hub set: lengths, task shards, a card, a hidden cache."""
    write_parquet(root / "0k" / "qa1-00000-of-00001.parquet", QA1)
    write_parquet(root / "0k" / "qa11-00000-of-00001.parquet", QA11)
    write_parquet(root / "1k" / "qa1-00000-of-00002.parquet", QA1[:2])
    write_parquet(root / "1k" / "qa1-00001-of-00002.parquet", QA1[2:])
    (root / "README.md").write_text("---\nconfigs: []\n---\n# BABILong\n")
    (root / ".cache" / "huggingface").mkdir(parents=True)
    (root / ".cache" / "huggingface" / "0k").mkdir()
    write_parquet(root / ".cache" / "huggingface" / "0k" / "qa9-00000-of-00001.parquet", QA1)  # never read
    return root


def checksums(root: Path) -> dict[str, str]:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(root.rglob("*"))
            if path.is_file()}


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


# ----------------------------------------------------------------------------------------------
# Labels and discovery


def test_length_labels_follow_one_rule():
    assert [length_tokens(label) for label in ("0k", "1k", "32k", "128k", "1M", "72", 72)] == [
        0, 1024, 32768, 131072, 1048576, 72, 72]
    assert length_tokens("train_96") is None and length_tokens("32 k") is None and length_tokens(-1) is None


@pytest.mark.parametrize("path,labels", [
    ("babilong/32k/qa1-00000-of-00001.parquet", ("qa1", "32k")),
    ("babilong-1k-samples/128k/qa20-00003-of-00004.parquet", ("qa20", "128k")),
    ("data/qa2/0k.json", ("qa2", "0k")),
    ("data/qa3/4k.jsonl", ("qa3", "4k")),
    ("data/stories/32k.json", (None, "32k")),
    ("data/qa1/train_96.json", ("qa1", None)),
    ("rows.parquet", (None, None)),
    ("shards/my_task-00000-of-00001.parquet", ("my_task", None)),
])
def test_labels_come_from_the_published_layouts(path, labels):
    assert babilong_path_labels(path) == labels


def test_a_snapshot_folder_yields_every_set_with_its_shards_in_order(tmp_path):
    root = snapshot(tmp_path / "snapshot")
    sources = find_babilong_sources([root])
    assert [(s.task, s.length, [p.relative_to(root).as_posix() for p in s.paths]) for s in sources] == [
        ("qa1", "0k", ["0k/qa1-00000-of-00001.parquet"]),
        ("qa11", "0k", ["0k/qa11-00000-of-00001.parquet"]),
        ("qa1", "1k", ["1k/qa1-00000-of-00002.parquet", "1k/qa1-00001-of-00002.parquet"]),
    ]
    # filters by task and length; a length matches as written or by tokens
    assert [(s.task, s.length) for s in find_babilong_sources([root], tasks=["qa1"], lengths=["1024"])] == [
        ("qa1", "1k")]
    with pytest.raises(ValueError, match=r"matches tasks=\['qa5'\].*found: task qa1 length 0k"):
        find_babilong_sources([root], tasks=["qa5"])
    assert read_babilong_file(sources[2].paths[0]) + read_babilong_file(sources[2].paths[1]) == QA1


def test_an_incomplete_snapshot_is_an_error_naming_the_missing_shard(tmp_path):
    root = snapshot(tmp_path / "snapshot")
    (root / "1k" / "qa1-00001-of-00002.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"1k/qa1-\*-of-00002\.parquet is incomplete: 1 of 2 shards, "
                                                r"missing \['qa1-00001-of-00002\.parquet'\]"):
        find_babilong_sources([root])
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    (empty / "notes" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"empty holds no file laid out as"):
        find_babilong_sources([empty])
    with pytest.raises(ValueError, match=r"rows\.csv: expected one of"):
        (tmp_path / "rows.csv").write_text("input,question,target\n")
        find_babilong_sources([tmp_path / "rows.csv"])


def test_files_without_labels_take_a_single_explicit_one(tmp_path):
    rows = write_parquet(tmp_path / "rows.parquet", QA1)
    assert [(s.task, s.length) for s in find_babilong_sources([rows])] == [(None, None)]
    assert [(s.task, s.length) for s in find_babilong_sources([rows], ["qa7"], ["2k"])] == [("qa7", "2k")]
    with pytest.raises(ValueError, match=r"rows\.parquet: its path does not say its task and length"):
        find_babilong_sources([rows], require_labels=True)
    with pytest.raises(ValueError, match=r"rows\.parquet: its path does not say its task"):
        find_babilong_sources([rows], tasks=["qa1", "qa2"])


# ----------------------------------------------------------------------------------------------
# Reading


def test_parquet_rows_read_as_json_rows_do(tmp_path):
    parquet = write_parquet(tmp_path / "0k" / "qa1-00000-of-00001.parquet", QA1)
    json_file = tmp_path / "qa1" / "0k.json"
    json_file.parent.mkdir()
    json_file.write_text(json.dumps([{**row, "extra": 1} for row in QA1]))
    jsonl = tmp_path / "qa1" / "0k.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in QA1) + "\n")
    assert read_babilong_file(parquet) == read_babilong_file(json_file) == read_babilong_file(jsonl) == QA1
    large = tmp_path / "large.parquet"  # large_string columns, as other writers produce
    pq.write_table(pa.table({name: pa.array([row[name] for row in QA1], pa.large_string())
                             for name in ("input", "question", "target")}), large)
    assert read_babilong_file(large) == QA1


@pytest.mark.parametrize("table,message", [
    (pa.table({"input": ["a"], "question": ["q"]}), r"missing column\(s\) \['target'\]"),
    (pa.table({"input": ["a"], "question": ["q"], "target": [3]}), r"column 'target' must hold strings, got int64"),
    (pa.table({"input": ["a", None], "question": ["q", "q"], "target": ["x", "y"]}),
     r"row 1 \(0-based\), column 'input': null"),
    (pa.table({"input": ["a"], "question": ["q"], "target": [" "]}), r"row 0 \(0-based\): empty target"),
    (pa.table({"input": pa.array([], pa.string()), "question": pa.array([], pa.string()),
               "target": pa.array([], pa.string())}), "holds no rows"),
])
def test_malformed_parquet_is_an_error_naming_file_and_row(tmp_path, table, message):
    path = tmp_path / "0k" / "qa1-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(table, path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=message) as error:
        read_babilong_file(path)
    assert str(path) in str(error.value)
    assert path.read_bytes() == before


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "qa1-00000-of-00001.parquet"
    path.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(ValueError, match=r"qa1-00000-of-00001\.parquet is not a readable parquet file"):
        read_babilong_file(path)


# ----------------------------------------------------------------------------------------------
# The builder: load_dataset and titans-hf train's loader


def test_load_dataset_reads_the_parquet_layout_with_its_labels(tmp_path, tiny_tokenizer_dir, tokenizer):
    root = snapshot(tmp_path / "snapshot")
    before = checksums(root)
    files = [str(root / "0k" / "qa1-00000-of-00001.parquet"), str(root / "1k" / "qa1-00000-of-00002.parquet"),
             str(root / "1k" / "qa1-00001-of-00002.parquet")]
    dataset = load_dataset("titans_babilong", data_files=files, tokenizer=str(tiny_tokenizer_dir), max_length=48,
                           answer_reserve_tokens=4, train_ratio=None, cache_dir=str(tmp_path / "cache"))["train"]
    assert dataset["task"] == ["qa1"] * 6
    assert dataset["length"] == [0] * 3 + [1024] * 3  # "1k" -> 1024 tokens, the one rule (length_tokens)
    for got, row in zip(dataset, QA1 + QA1):
        expected = build_example(row, tokenizer, 48, 4)
        expected.pop("answer_tokens_cut")
        assert {key: got[key] for key in expected} == expected
    assert checksums(root) == before


def test_load_dataset_reads_a_snapshot_folder_filtered_by_task_and_length(tmp_path, tiny_tokenizer_dir):
    root = snapshot(tmp_path / "snapshot")
    common = dict(tokenizer=str(tiny_tokenizer_dir), max_length=48, answer_reserve_tokens=4, train_ratio=None,
                  cache_dir=str(tmp_path / "cache"))
    qa1_1k = load_dataset("titans_babilong", data_dir=str(root), task="qa1", length="1k", **common)["train"]
    assert qa1_1k["target"] == [row["target"] for row in QA1]
    assert set(qa1_1k["task"]) == {"qa1"} and set(qa1_1k["length"]) == {1024}
    everything = load_dataset("titans_babilong", data_dir=str(root), **common)["train"]
    assert sorted(zip(everything["task"], everything["length"])) == sorted(
        [("qa1", 0)] * 3 + [("qa11", 0)] * 2 + [("qa1", 1024)] * 3)
    with pytest.raises(ValueError, match=r"no file of split 'train' is task='qa5'"):
        load_dataset("titans_babilong", data_dir=str(root), task="qa5", **common)


def test_train_loader_expands_folders_and_filters(tmp_path, tiny_tokenizer_dir):
    from titans_hf.tasks.babilong.training import load_babilong_splits
    from titans_hf.training.recipe import DataArguments

    root = snapshot(tmp_path / "snapshot")
    json_file = tmp_path / "extra" / "rows.jsonl"
    json_file.parent.mkdir()
    json_file.write_text("\n".join(json.dumps(row) for row in QA1 * 4) + "\n")
    before = checksums(tmp_path)
    args = DataArguments(data_files=[str(root)], data_tasks=["qa1"], max_length=48, answer_reserve_tokens=4,
                         train_ratio=0.5, generation_seed=3)
    train, evaluation = load_babilong_splits(args, str(tiny_tokenizer_dir), pad_to_max_length=True)
    assert sorted(list(train["length"]) + list(evaluation["length"])) == [0] * 3 + [1024] * 3
    assert set(train["task"]) == set(evaluation["task"]) == {"qa1"}
    first, _ = train_eval_split(6, 0.5, seed=3)
    assert list(train["target"]) == [[row["target"] for row in QA1 + QA1][i] for i in first]
    # a JSON Lines file without labels takes the one task / length named
    args = DataArguments(data_files=[str(json_file)], data_tasks=["qa4"], data_lengths=["2k"], max_length=48,
                         answer_reserve_tokens=4)
    train, evaluation = load_babilong_splits(args, str(tiny_tokenizer_dir), pad_to_max_length=True)
    assert set(train["task"]) == {"qa4"} and set(train["length"]) == {2048} and len(train) + len(evaluation) == 12
    assert checksums(tmp_path).items() >= before.items()  # inputs untouched (the cache may add files)


# ----------------------------------------------------------------------------------------------
# Evaluation: titans-hf eval --data on a snapshot


def _memory_model(base_dir) -> TitansQwenForCausalLM:
    model = TitansQwenForCausalLM.from_base(base_dir, chunk_size=64, memory_head_dim=16, memory_chunk_size=8).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.copy_(torch.randn(block.output_weight.shape, generator=generator))
    return model


def test_eval_scores_a_snapshot_with_published_labels_and_any_task(tiny_qwen3_dir, tmp_path):
    root = snapshot(tmp_path / "snapshot")
    before = checksums(root)
    model = _memory_model(tiny_qwen3_dir)
    memory_dir = model.save_memory(tmp_path / "memory")
    out = tmp_path / "eval"
    assert cli_main(["eval", "--model", str(memory_dir), "--data", str(root), "--tasks", "qa1", "qa11",
                     "--lengths", "0k", "--max-new-tokens", "2", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert {task: list(cells) for task, cells in results["accuracy"].items()} == {"qa1": ["0k"], "qa11": ["0k"]}
    qa1, qa11 = results["details"]["qa1"]["0k"], results["details"]["qa11"]["0k"]
    assert (qa1["labels_from"], qa1["num_samples"], qa1["chance"]) == (LABELS_FROM_BABILONG, 3, pytest.approx(1 / 6))
    assert (qa11["labels"], qa11["labels_from"], qa11["chance"]) == (["garden", "kitchen"], LABELS_FROM_TARGETS, 0.5)
    # the same answers as evaluate_babilong on the rows themselves
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    direct = evaluate_babilong(model, tokenizer, {("qa1", "0k"): QA1, ("qa11", "0k"): QA11}, max_new_tokens=2,
                               show_progress=False)
    assert direct == results
    assert checksums(root) == before

    # every set of the snapshot, keyed as published; the shards of 1k read as one cell
    keyed = babilong_files_by_task_length([root])
    assert list(keyed) == [("qa1", "0k"), ("qa11", "0k"), ("qa1", "1k")] and len(keyed[("qa1", "1k")]) == 2
    all_cells = evaluate_babilong(model, tokenizer, keyed, max_new_tokens=2, ablation=False, show_progress=False)
    assert all_cells["details"]["qa1"]["1k"]["num_samples"] == 3
    assert list(all_cells["accuracy"]["qa1"]) == ["0k", "1k"]


def test_eval_generate_takes_length_labels(tiny_qwen3_dir, tmp_path):
    model = _memory_model(tiny_qwen3_dir)
    memory_dir = model.save_memory(tmp_path / "memory")
    out = tmp_path / "eval"
    with pytest.raises(ValueError,
                       match=r"--generate writes \['qa1', 'qa2', 'qa3', 'passkey', 'mk'\], not --tasks \['qa11'\]"):
        cli_main(["eval", "--model", str(memory_dir), "--generate", "--tasks", "qa11", "--lengths", "72",
                  "--output", str(out)])
    with pytest.raises(ValueError, match=r"--lengths \['long'\] are not lengths"):
        cli_main(["eval", "--model", str(memory_dir), "--generate", "--lengths", "long", "--output", str(out)])
    assert cli_main(["eval", "--model", str(memory_dir), "--generate", "--lengths", "0k", "--num-samples", "2",
                     "--max-new-tokens", "1", "--no-ablation", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    assert list(results["accuracy"]["qa1"]) == ["0k"]
    assert results["details"]["qa1"]["0k"]["num_samples"] == 2
    rows = generate_babilong("qa1", 2, 0, tokenizer, seed=1)
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [line["target"] for line in lines] == [row["target"] for row in rows]


def test_a_parquet_file_is_known_by_its_content_too(tmp_path):
    """A download cache names files by hash: parquet is recognised by its magic bytes, not only its suffix."""
    cached = tmp_path / "downloads" / "3f2a9c"
    write_parquet(cached, QA1)
    assert read_babilong_file(cached) == QA1
