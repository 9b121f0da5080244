"""Hostile input to the data layer: no code runs, no data is destroyed, no partial output looks complete,
no wrong result passes silently, and every error names the file (and key, line or field) and the problem.

Each test checksums what it hands in and checks it is unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import datasets
import h5py
import numpy as np
import pytest
from datasets import load_dataset

import titans_hf  # noqa: F401  (registers the builders)
from titans_hf.data.prepare import prepare
from titans_hf.data.stores import STORE_WRITERS, H5Store, MmapStore, open_store
from titans_hf.data.windows import TokenExamples

METADATA = {"train_type": "seq", "tokenizer": "tiny", "vocab_size": 512, "eos_token_id": 0, "pad_token_id": 1}
TOKENS = [list(range(10, 30)), list(range(40, 50))]  # 30 tokens in 2 documents


def checksums(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (files or folders), links included by their targets' bytes."""
    files = [file for root in roots for file in ([root] if not root.is_dir() else sorted(root.rglob("*")))]
    return {str(file): hashlib.sha256(file.read_bytes()).hexdigest() for file in files if file.is_file()}


def make_store(path: Path, segments: dict[str, list], metadata=METADATA, dtypes=None) -> Path:
    dtypes = dtypes or {key: "float32" if key == "rewards" else "uint8" if "mask" in key else "uint16" for key in segments}
    writer = STORE_WRITERS["h5" if path.suffix == ".h5" else "bin"](path, dtypes, metadata)
    for key, values in segments.items():
        for segment in values:
            writer.add_segment(key, np.asarray(segment))
    os.replace(writer.finish(), path)
    return path


def edit_meta(store: Path, change) -> Path:
    meta = json.loads((store / "meta.json").read_text())
    change(meta)
    (store / "meta.json").write_text(json.dumps(meta))
    return store


def strip_recorded(meta: dict) -> None:
    """Make a store look written before ranges and checksums were recorded."""
    for entry in meta["keys"].values():
        for field in ("min", "max", "sha256"):
            entry.pop(field, None)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# 1. prepare --overwrite replaces only a store prepare wrote, never an input ------------------------------------


@pytest.fixture()
def story(tmp_path) -> Path:
    path = tmp_path / "story.txt"
    path.write_text("Mary went to the kitchen.\n")
    return path


def test_overwrite_refuses_a_folder_of_user_files(tmp_path, story, tiny_tokenizer_dir):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("months of work")
    before = checksums(folder, story)
    with pytest.raises(ValueError, match=r"results: will not replace it, even with overwrite: .*not a token store prepare wrote"):
        prepare(story, folder, tiny_tokenizer_dir, overwrite=True)
    assert checksums(folder, story) == before


def test_overwrite_refuses_a_bin_store_holding_other_files(tmp_path, story, tiny_tokenizer_dir):
    store = make_store(tmp_path / "corpus_bin", {"sequence": TOKENS})
    (store / "notes.txt").write_text("mine")
    before = checksums(store, story)
    with pytest.raises(ValueError, match=r"corpus_bin: will not replace it.*holds files its meta.json does not list \['notes.txt'\]"):
        prepare(story, store, tiny_tokenizer_dir, overwrite=True)
    assert checksums(store, story) == before


def test_overwrite_refuses_an_hdf5_file_that_is_not_a_store(tmp_path, story, tiny_tokenizer_dir):
    other = tmp_path / "measurements.h5"
    with h5py.File(other, "w") as file:
        file.create_dataset("temperature", data=np.arange(5.0))
    before = checksums(other, story)
    with pytest.raises(ValueError, match=r"measurements.h5: will not replace it.*without the store attribute format_version"):
        prepare(story, other, tiny_tokenizer_dir, overwrite=True)
    assert checksums(other, story) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_that_is_an_input_is_refused(tmp_path, tiny_tokenizer_dir, overwrite):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "Mary went to the kitchen."}])
    before = checksums(source)
    with pytest.raises(ValueError, match=r"docs.jsonl: the output is an input of this call"):
        prepare(source, source, tiny_tokenizer_dir, overwrite=overwrite)
    # The same file reached through a symbolic link is the same input.
    link = tmp_path / "link.jsonl"
    link.symlink_to(source)
    with pytest.raises(ValueError, match=r"link.jsonl: the output is an input of this call"):
        prepare(source, link, tiny_tokenizer_dir, overwrite=overwrite)
    assert checksums(source) == before


def test_output_folder_holding_an_input_is_refused(tmp_path, tiny_tokenizer_dir):
    store = make_store(tmp_path / "corpus_bin", {"sequence": TOKENS})
    source = write_jsonl(tmp_path / "corpus_bin" / "more.jsonl", [{"text": "Mary"}])
    before = checksums(store)
    with pytest.raises(ValueError, match=r"corpus_bin: the output is a folder holding the input .*more.jsonl of this call"):
        prepare(source, store, tiny_tokenizer_dir, overwrite=True)
    assert checksums(store) == before


def test_output_folder_holding_a_datasets_input_is_refused(tmp_path, tiny_tokenizer_dir):
    datasets.Dataset.from_dict({"text": ["Mary went to the kitchen."]}).save_to_disk(tmp_path / "saved")
    rows = datasets.load_from_disk(str(tmp_path / "saved"))
    before = checksums(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"saved: the output is a folder holding the input .*\.arrow of this call"):
        prepare(rows, tmp_path / "saved", tiny_tokenizer_dir, overwrite=True)
    assert checksums(tmp_path / "saved") == before


def test_symlinked_output_and_shard_lookalikes_are_refused_and_other_names_untouched(tmp_path, story, tiny_tokenizer_dir):
    store = make_store(tmp_path / "real.h5", {"sequence": TOKENS})
    (tmp_path / "corpus.h5").symlink_to(store)
    before = checksums(store, story)
    with pytest.raises(ValueError, match=r"corpus.h5: will not replace it.*it is a symbolic link"):
        prepare(story, tmp_path / "corpus.h5", tiny_tokenizer_dir, overwrite=True)
    (tmp_path / "corpus.h5").unlink()
    # A user file named like a shard of the output is checked like the output itself...
    (tmp_path / "corpus-00001-of-00002.h5").write_text("not a store")
    with pytest.raises(ValueError, match=r"corpus-00001-of-00002.h5: will not replace it"):
        prepare(story, tmp_path / "corpus.h5", tiny_tokenizer_dir, overwrite=True)
    (tmp_path / "corpus-00001-of-00002.h5").unlink()
    # ...while names that only look alike, and an old set-aside name, are never touched.
    (tmp_path / "corpus-final-of-2024.h5").write_text("keep me")
    (tmp_path / ".corpus.h5.replaced").write_text("keep me too")
    kept = checksums(tmp_path / "corpus-final-of-2024.h5", tmp_path / ".corpus.h5.replaced")
    prepare(story, tmp_path / "corpus.h5", tiny_tokenizer_dir)
    prepare(story, tmp_path / "corpus.h5", tiny_tokenizer_dir, overwrite=True)  # a store prepare wrote: replaced
    assert checksums(tmp_path / "corpus-final-of-2024.h5", tmp_path / ".corpus.h5.replaced") == kept
    assert checksums(store, story) == before


def test_outputs_are_checked_before_the_tokenizer_is_loaded(tmp_path, story):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    # The tokenizer does not exist: the output problem must be found first.
    with pytest.raises(ValueError, match=r"results: will not replace it"):
        prepare(story, folder, tmp_path / "no_such_tokenizer", overwrite=True)
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl: input file not found"):
        prepare([story, tmp_path / "missing.jsonl"], tmp_path / "out.h5", tmp_path / "no_such_tokenizer")


# 2. load_dataset("titans_tokens") without data_files --------------------------------------------------------------


def test_data_files_inferred_from_the_working_directory_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    store = make_store(work / "corpus.h5", {"sequence": TOKENS})
    monkeypatch.chdir(work)
    before = checksums(store)
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError, match=rf"titans_tokens needs data_files.*working directory {work}"):
        load_dataset("titans_tokens", window_size=10, split="train", cache_dir=cache)
    with pytest.raises(ValueError, match=rf"titans_tokens needs data_files.*working directory {work}"):
        datasets.load_dataset_builder("titans_tokens", window_size=10, cache_dir=cache)
    # Named files, a named folder, or files outside the working directory load.
    assert len(load_dataset("titans_tokens", data_files="corpus.h5", window_size=10, split="train", cache_dir=cache)) == 3
    assert len(load_dataset("titans_tokens", data_dir=".", window_size=10, split="train", cache_dir=cache)) == 3
    datasets.load_dataset_builder("titans_tokens", data_files="corpus.h5", window_size=10, cache_dir=cache)
    monkeypatch.chdir(tmp_path)
    datasets.load_dataset_builder("titans_tokens", data_files=str(store), window_size=10, cache_dir=cache)
    assert checksums(store) == before


def test_a_data_files_glob_that_matches_nothing_is_named(tmp_path, monkeypatch):
    """datasets drops a glob matching nothing without a word: alone it left an empty split ("Instruction 'train'
    corresponds to no data"), beside a store it loaded fewer stores than named."""
    work = tmp_path / "work"
    work.mkdir()
    store = make_store(work / "corpus.h5", {"sequence": TOKENS})
    monkeypatch.chdir(work)
    before = checksums(store)
    cache = str(tmp_path / "cache")
    nothing = rf"titans_tokens: data_files pattern 'nope/\*.bin' \(split 'train'\) matches no file under {work}"
    with pytest.raises(ValueError, match=nothing):
        load_dataset("titans_tokens", data_files="nope/*.bin", window_size=10, split="train", cache_dir=cache)
    with pytest.raises(ValueError, match=nothing):
        load_dataset("titans_tokens", data_files=["corpus.h5", "nope/*.bin"], window_size=10, cache_dir=cache)
    with pytest.raises(ValueError, match=rf"pattern 'missing\*.h5' \(split 'test'\) matches no file under {work}"):
        datasets.load_dataset_builder("titans_tokens", data_files={"train": "corpus.h5", "test": "missing*.h5"},
                                      window_size=10, cache_dir=cache)
    # a glob that matches loads what it matches
    assert len(load_dataset("titans_tokens", data_files="*.h5", window_size=10, split="train", cache_dir=cache)) == 3
    assert checksums(store) == before


# 3. token ids, dtypes, rewards and groups --------------------------------------------------------------------


def test_ids_the_meta_does_not_record_fail_at_the_read_that_touches_them(tmp_path):
    store = make_store(tmp_path / "lying_bin", {"sequence": TOKENS})  # records max 49
    tokens = np.fromfile(store / "sequence.bin", np.uint16)
    tokens[25] = 300  # below vocab_size 512, above the recorded max; same size, meta untouched
    tokens.tofile(store / "sequence.bin")
    before = checksums(store)
    opened = open_store(store)
    assert opened.read("sequence", 0, 25).tolist() == TOKENS[0] + TOKENS[1][:5]
    with pytest.raises(ValueError, match=r"sequence.bin: key 'sequence' holds 300 at position 25, outside \[10, 49\], the range .*meta.json records"):
        opened.read("sequence", 20, 30)
    with pytest.raises(ValueError, match=r"sequence.bin: key 'sequence' holds 300 at position 25"):
        opened.segment("sequence", 1)
    assert checksums(store) == before


@pytest.mark.parametrize("name", ["legacy_bin", "legacy.h5"])
def test_store_without_recorded_range_is_checked_lazily_and_by_vocab_size(tmp_path, name):
    path = tmp_path / name
    make_store(path, {"sequence": [[5, 6, 7], [8, 600, 9]]}, metadata={**METADATA, "vocab_size": None})
    if path.is_dir():
        edit_meta(path, lambda meta: (strip_recorded(meta), meta.update(vocab_size=512)))
    else:
        with h5py.File(path, "r+") as file:
            file.attrs["vocab_size"] = 512
            for field in ("min", "max", "sha256"):
                del file["sequence"].attrs[field]
    before = checksums(path)
    store = open_store(path)  # nothing recorded: open does not scan
    assert store.read("sequence", 0, 4).tolist() == [5, 6, 7, 8]
    where = "sequence.bin" if path.is_dir() else r"legacy.h5:/sequence"
    with pytest.raises(ValueError, match=rf"{where}: key 'sequence' holds 600 at position 4, outside \[0, 511\], the ids vocab_size 512 allows"):
        store.read("sequence", 3, 6)
    with pytest.raises(ValueError, match=rf"{where}: key 'sequence' holds 600 at position 4"):
        TokenExamples(store, "seq", window_size=2, vocab_size=1000)  # the scan for the vocabulary check finds it
    assert checksums(path) == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["keys"]["sequence"].update(max=512), r"meta.json: key 'sequence' records values \[10, 512\], outside \[0, 511\], the ids vocab_size 512 allows"),
        (lambda m: m["keys"]["sequence"].update(min=-1), r"meta.json: key 'sequence' records values \[-1, 49\], outside \[0, 511\]"),
        (lambda m: m["keys"]["sequence"].update(max=None), r"meta.json: key 'sequence' records only one of 'min' and 'max'"),
        (lambda m: m["keys"]["sequence"].update(max="49"), r"meta.json: key 'sequence' records the range \[10, '49'\]"),
        (lambda m: m["keys"]["sequence"].update(sha256="abc"), r"meta.json: key 'sequence' records sha256 'abc', which is not 64 hex digits"),
        (lambda m: m["keys"]["sequence"].update(dtype=">u2"), r"meta.json: key 'sequence' has dtype >u2 \(big-endian\); stores hold values in this machine's native byte order only"),
        (lambda m: m.update(vocab_size=70_000), r"meta.json: key 'sequence' has dtype uint16, which holds ids up to 65535 only, but vocab_size is 70000"),
        (lambda m: m.update(vocab_size=-3), r"meta.json: vocab_size must be a positive integer up to .*, got -3"),
        (lambda m: m.update(vocab_size=2**31 + 1), r"meta.json: vocab_size must be a positive integer up to 2147483648 "
                                                   r"\(ids up to 2147483647\), got 2147483649"),
        (lambda m: m.update(pad_token_id=512), r"meta.json: pad_token_id 512 is not below vocab_size 512"),
        (lambda m: m.update(eos_token_id="0"), r"meta.json: eos_token_id must be a token id"),
        (lambda m: m.update(format_version=True), r"meta.json: format_version True is not supported"),
        (lambda m: m["keys"]["sequence"].update(length=True), r"meta.json: key 'sequence' has length True"),
    ],
)
def test_recorded_ranges_dtypes_and_metadata_are_checked_at_open(tmp_path, change, message):
    store = edit_meta(make_store(tmp_path / "bad_bin", {"sequence": TOKENS}), change)
    before = checksums(store)
    with pytest.raises(ValueError, match=message):
        open_store(store)
    assert checksums(store) == before


def test_ids_beyond_int32_and_negative_ids_in_signed_dtypes(tmp_path):
    wide = make_store(tmp_path / "wide_bin", {"sequence": [[1, 2, 3]]}, metadata={**METADATA, "vocab_size": None},
                      dtypes={"sequence": "uint32"})
    tokens = np.array([1, 2**31, 3], np.uint32)  # would be -2147483648 as int32 in Arrow or torch
    tokens.tofile(wide / "sequence.bin")
    edit_meta(wide, strip_recorded)
    with pytest.raises(ValueError, match=r"sequence.bin: key 'sequence' holds 2147483648 at position 1, outside \[0, 2147483647\], the ids Arrow and torch can hold as int32"):
        open_store(wide).read("sequence", 0, 3)
    signed = make_store(tmp_path / "signed_bin", {"sequence": [[1, 2, 3]]}, dtypes={"sequence": "int16"})
    np.array([1, -5, 3], np.int16).tofile(signed / "sequence.bin")
    edit_meta(signed, strip_recorded)
    with pytest.raises(ValueError, match=r"sequence.bin: key 'sequence' holds -5 at position 1, outside \[0, 511\]"):
        open_store(signed).segment("sequence", 0)


def test_big_endian_h5_dataset_is_refused(tmp_path):
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as file:
        file.attrs["format_version"] = 1
        file.create_dataset("sequence/0", data=np.arange(4, dtype=">u2"))
    before = checksums(path)
    with pytest.raises(ValueError, match=r"big.h5: key 'sequence' has dtype >u2 \(big-endian\)"):
        open_store(path)
    assert checksums(path) == before


def test_vocab_size_of_the_model_is_checked_before_training(tmp_path):
    bin_store = make_store(tmp_path / "c_bin", {"sequence": TOKENS})
    legacy = edit_meta(make_store(tmp_path / "old_bin", {"sequence": TOKENS}), strip_recorded)
    before = checksums(bin_store, legacy)
    for path in (bin_store, legacy):
        with pytest.raises(ValueError, match=rf"{path.name}: key 'sequence' holds token id 49, but the vocabulary has 40 ids \(0..39\)"):
            TokenExamples(open_store(path), "seq", window_size=4, vocab_size=40)
        assert len(TokenExamples(open_store(path), "seq", window_size=4, vocab_size=50)) == 7
    with pytest.raises(ValueError, match=r"c_bin: key 'sequence' holds token id 49, but the vocabulary has 40 ids"):
        load_dataset("titans_tokens", data_files=str(bin_store / "*"), window_size=4, vocab_size=40, split="train",
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"c_bin: pad_token_id must be a token id in \[0, 49\], got 50"):
        TokenExamples(open_store(bin_store), "seq", window_size=4, pad_tail=True, pad_token_id=50, vocab_size=50)
    assert checksums(bin_store, legacy) == before


@pytest.mark.parametrize("reward", ["NaN", "Infinity", "-Infinity", "1e39", "3e38", "-3e38", "1000000001", str(10**400)])
def test_non_finite_or_overflowing_rewards_are_refused_at_prepare(tmp_path, tiny_tokenizer_dir, reward):
    """Rewards float32 holds but GRPO's group mean and standard deviation would overflow (3e38: the sum of two is
    inf) are refused like NaN, naming the line; the bound is MAX_ABS_REWARD = 1e9."""
    source = tmp_path / "grpo.jsonl"
    source.write_text('{"prompt": "p", "responses": ["a"], "rewards": [1.0]}\n'
                      f'{{"prompt": "p", "responses": ["a", "b"], "rewards": [0.5, {reward}]}}\n')
    before = checksums(source)
    with pytest.raises(ValueError, match=r"^\S*grpo.jsonl:2: field 'rewards' holds .*; rewards must be finite numbers in "
                                         r"\[-1e\+09, 1e\+09\]"):
        prepare(source, tmp_path / "out_bin", tiny_tokenizer_dir, train_type="grpo")
    assert checksums(source) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["grpo.jsonl"]


def test_rewards_at_the_bound_are_prepared(tmp_path, tiny_tokenizer_dir):
    source = write_jsonl(tmp_path / "grpo.jsonl", [{"prompt": "p", "responses": ["a", "b"], "rewards": [-1e9, 1e9]}])
    [store] = prepare(source, tmp_path / "out_bin", tiny_tokenizer_dir, train_type="grpo")
    assert open_store(store).segment("rewards", 0).tolist() == [-1e9, 1e9]


def test_rewards_beyond_the_bound_in_a_store_are_refused_at_open(tmp_path):
    """A store written by hand or by an older version, holding rewards float32 holds but GRPO cannot use: refused at
    open, naming the file, and the position and record (its rewards are scanned whole: they are few), or the range
    its meta records."""
    grpo = {"prompts": [[1], [2]], "responses": [[3, 0], [4, 0], [5, 0]], "masks": [[1, 1]] * 3,
            "rewards": [[0.5], [1.5, -2.0]]}
    legacy = edit_meta(make_store(tmp_path / "old_bin", grpo), strip_recorded)
    np.array([0.5, 1.5, -3e38], np.float32).tofile(legacy / "rewards.bin")
    contradicted = make_store(tmp_path / "lie_bin", grpo)  # records [-2.0, 1.5], holds 1e9
    np.array([0.5, 1.5, 1e9], np.float32).tofile(contradicted / "rewards.bin")
    recorded = edit_meta(make_store(tmp_path / "new_bin", grpo), lambda m: m["keys"]["rewards"].update(min=-3e38))
    huge = edit_meta(make_store(tmp_path / "huge_bin", grpo), lambda m: m["keys"]["rewards"].update(max=10**400))
    hand = tmp_path / "hand.h5"
    shutil.copy(make_store(tmp_path / "model.h5", grpo), hand)
    with h5py.File(hand, "a") as file:
        for field in ("min", "max", "sha256"):
            del file["rewards"].attrs[field]
        for name, values in (("0", [0.5]), ("1", [1.5, 2e9])):  # float64, as a hand-written store may hold
            del file["rewards"][name]
            file["rewards"].create_dataset(name, data=np.array(values, np.float64))
    before = checksums(legacy, contradicted, recorded, huge, hand)
    with pytest.raises(ValueError, match=r"^\S*old_bin/rewards.bin: key 'rewards' holds -3[.0-9]*e\+38 at position 2, "
                                         r"not a finite number in \[-1e\+09, 1e\+09\].* \(record 1\)$"):
        open_store(legacy)
    with pytest.raises(ValueError, match=r"^\S*lie_bin/rewards.bin: key 'rewards' holds 1000000000.0 at position 2, "
                                         r"outside \[-2.0, 1.5\], the range \S*meta.json records for it \(record 1\)$"):
        open_store(contradicted)
    with pytest.raises(ValueError, match=r"^\S*new_bin/meta.json: key 'rewards' records values \[-3e\+38, 1.5\], not "
                                         r"a finite number in \[-1e\+09, 1e\+09\]"):
        open_store(recorded)
    with pytest.raises(ValueError, match=r"^\S*huge_bin/meta.json: key 'rewards' records values \[-2.0, 1000"):
        open_store(huge)
    with pytest.raises(ValueError, match=r"^\S*hand.h5:/rewards: key 'rewards' holds 2000000000.0 at position 2, .*"
                                         r"\(record 1\)$"):
        open_store(hand)
    assert checksums(legacy, contradicted, recorded, huge, hand) == before


def test_grpo_group_without_responses_is_refused_at_prepare(tmp_path, tiny_tokenizer_dir):
    source = write_jsonl(tmp_path / "grpo.jsonl", [{"prompt": "p", "responses": [], "rewards": []}])
    with pytest.raises(ValueError, match=r"grpo.jsonl:1: field 'responses' is empty; a grpo group needs at least one response"):
        prepare(source, tmp_path / "out.h5", tiny_tokenizer_dir, train_type="grpo")
    assert not (tmp_path / "out.h5").exists()


def test_non_finite_rewards_empty_groups_and_bad_masks_are_refused_at_open(tmp_path):
    grpo = {"prompts": [[1], [2]], "responses": [[3, 0], [4, 0]], "masks": [[1, 1], [1, 1]], "rewards": [[0.5], [1.5]]}
    nan_store = make_store(tmp_path / "nan_bin", grpo)
    np.array([0.5, math.nan], np.float32).tofile(nan_store / "rewards.bin")
    edit_meta(nan_store, strip_recorded)
    with pytest.raises(ValueError, match=r"rewards.bin: key 'rewards' holds nan at position 1, not a finite number.* \(record 1\)"):
        TokenExamples(open_store(nan_store), "grpo")[1]
    recorded_nan = edit_meta(make_store(tmp_path / "nan2_bin", grpo), lambda m: m["keys"]["rewards"].update(max=math.nan))
    with pytest.raises(ValueError, match=r"meta.json: key 'rewards' records values \[0.5, nan\], not a finite number"):
        open_store(recorded_nan)
    empty = make_store(tmp_path / "empty_group.h5",
                       {"prompts": [[1], [2]], "responses": [[3, 0]], "masks": [[1, 1]], "rewards": [[0.5], []]})
    with pytest.raises(ValueError, match=r"empty_group.h5: grpo record 1 has no responses"):
        TokenExamples(open_store(empty), "grpo")
    masks = make_store(tmp_path / "mask_bin", {"sequence": [[5, 6, 7]], "loss_mask": [[0, 1, 1]]})
    np.array([0, 2, 1], np.uint8).tofile(masks / "loss_mask.bin")
    edit_meta(masks, strip_recorded)
    with pytest.raises(ValueError, match=r"loss_mask.bin: key 'loss_mask' holds 2 at position 1, outside \[0, 1\]: a mask holds 0 or 1"):
        TokenExamples(open_store(masks), "sft", window_size=3)[0]


@pytest.mark.parametrize(
    ("key", "values", "message"),
    [
        ("sequence", [3, 512], r"key 'sequence' value 512 is outside \[0, 511\], the ids vocab_size 512 allows"),
        ("sequence", [-1, 3], r"key 'sequence' value range \[-1, 3\] does not fit uint16"),
        ("sequence", [1.5], r"key 'sequence' holds integers, got values of dtype float64"),
        ("loss_mask", [0, 3], r"key 'loss_mask' value 3 is outside \[0, 1\]"),
        ("rewards", [1.0, math.inf], r"key 'rewards' value inf is not a finite number"),
        ("rewards", [1.0, 3e38], r"key 'rewards' value 3[.0-9]*e\+38 is not a finite number in \[-1e\+09, 1e\+09\]"),
    ],
)
def test_writer_refuses_what_a_reader_would_refuse(tmp_path, key, values, message):
    writer = STORE_WRITERS["bin"](tmp_path / "w_bin", {"sequence": "uint16", "loss_mask": "uint8", "rewards": "float32"}, METADATA)
    with pytest.raises(ValueError, match=message):
        writer.append(key, np.array(values))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


# 4. the cache key follows content, not sizes and mtimes ------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True])
def test_store_replaced_with_same_sizes_and_mtimes_rebuilds_the_cache(tmp_path, legacy):
    first = make_store(tmp_path / "corpus_bin", {"sequence": [list(range(10, 40))]})
    second = make_store(tmp_path / "other_bin", {"sequence": [list(range(60, 90))]})  # same sizes, other ids
    if legacy:
        edit_meta(first, strip_recorded)
        edit_meta(second, strip_recorded)
    stats = {name: (first / name).stat() for name in ("meta.json", "sequence.bin")}
    cache = str(tmp_path / "cache")
    built = load_dataset("titans_tokens", data_files=str(first / "*"), window_size=10, split="train", cache_dir=cache)
    assert built[0]["input_ids"] == list(range(10, 20))
    for name, stat in stats.items():
        shutil.copyfile(second / name, first / name)
        assert (first / name).stat().st_size == stat.st_size
        os.utime(first / name, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = load_dataset("titans_tokens", data_files=str(first / "*"), window_size=10, split="train", cache_dir=cache)
    assert again.cache_files[0]["filename"] != built.cache_files[0]["filename"]
    assert again[0]["input_ids"] == list(range(60, 70))


# 5. a store stays inside itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["../outside", "/etc/passwd", "a/b", "", ".hidden", "-x"])
def test_meta_keys_that_are_not_plain_names_are_refused(tmp_path, key):
    store = make_store(tmp_path / "s_bin", {"sequence": TOKENS})
    (tmp_path / "outside.bin").write_bytes(np.zeros(30, np.uint16).tobytes())
    edit_meta(store, lambda meta: meta["keys"].update({key: meta["keys"].pop("sequence")}))
    before = checksums(tmp_path)
    with pytest.raises(ValueError, match=rf"s_bin/meta.json: key {key!r} is not a plain name"):
        open_store(store)
    assert checksums(tmp_path) == before


@pytest.mark.parametrize("name", ["sequence.bin", "meta.json"])
def test_store_files_linking_outside_the_store_are_refused(tmp_path, name):
    store = make_store(tmp_path / "s_bin", {"sequence": TOKENS})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(store / name, elsewhere / name)
    (store / name).symlink_to(elsewhere / name)
    before = checksums(tmp_path)
    with pytest.raises(ValueError, match=rf"s_bin/{name}: is a link to .*elsewhere/{name}, outside the store"):
        MmapStore(store)
    assert checksums(tmp_path) == before


def test_h5_links_virtual_datasets_and_external_storage_are_refused(tmp_path):
    outside = make_store(tmp_path / "outside.h5", {"sequence": TOKENS})
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(4, dtype=np.uint16).tobytes())
    cases = {}
    with h5py.File(tmp_path / "external_link.h5", "w") as file:
        file.attrs["format_version"] = 1
        file["sequence"] = h5py.ExternalLink(str(outside), "/sequence")
    cases["external_link.h5"] = r"external_link.h5:/sequence: is a ExternalLink to .*outside.h5:/sequence"
    with h5py.File(tmp_path / "soft_link.h5", "w") as file:
        file.attrs["format_version"] = 1
        file.create_dataset("data/0", data=np.arange(3, dtype=np.uint16))
        file["sequence"] = h5py.SoftLink("/data")
    cases["soft_link.h5"] = r"soft_link.h5:/sequence: is a SoftLink to /data"
    with h5py.File(tmp_path / "virtual.h5", "w") as file:
        file.attrs["format_version"] = 1
        layout = h5py.VirtualLayout(shape=(20,), dtype=np.uint16)
        layout[:] = h5py.VirtualSource(str(outside), "sequence/0", shape=(20,))
        file.create_group("sequence").create_virtual_dataset("0", layout)
    cases["virtual.h5"] = r"virtual.h5:/sequence/0: is a virtual dataset"
    with h5py.File(tmp_path / "external_storage.h5", "w") as file:
        file.attrs["format_version"] = 1
        file.create_group("sequence").create_dataset("0", shape=(4,), dtype=np.uint16, external=[(str(raw), 0, 8)])
    cases["external_storage.h5"] = r"external_storage.h5:/sequence/0: is stored in external files"
    before = checksums(tmp_path)
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            H5Store(tmp_path / name)
    assert checksums(tmp_path) == before


# 6. damaged files and undecodable text: errors that name the file ------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_damaged_h5_names_the_file(tmp_path, damage):
    path = make_store(tmp_path / "damaged.h5", {"sequence": TOKENS})
    with open(path, "r+b") as handle:
        if damage == "truncate":
            handle.truncate(path.stat().st_size // 2)
        else:
            handle.seek(100)
            handle.write(b"\xff" * 400)
    before = checksums(path)
    with pytest.raises(ValueError, match=r"damaged.h5: cannot read the HDF5 data .*truncated or damaged"):
        open_store(path)
    assert checksums(path) == before


def test_h5_attributes_of_the_wrong_type(tmp_path):
    path = tmp_path / "attrs.h5"
    with h5py.File(path, "w") as file:
        file.attrs["format_version"] = "1"
        file.create_dataset("sequence/0", data=np.arange(3, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"attrs.h5: format_version '1' is not supported"):
        open_store(path)
    with h5py.File(path, "r+") as file:
        file.attrs["format_version"] = 1
        file.attrs["vocab_size"] = np.array([512, 513])
    with pytest.raises(ValueError, match=r"attrs.h5: vocab_size must be a positive integer"):
        open_store(path)


def test_non_utf8_inputs_name_file_line_and_byte(tmp_path, tiny_tokenizer_dir):
    text = tmp_path / "latin1.txt"
    text.write_bytes("first line\ncaf\u00e9\n".encode("latin-1"))  # é is byte 0xe9 at offset 14, on line 2
    lines = tmp_path / "latin1.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')  # 0xe9 at offset 30, line 2
    before = checksums(text, lines)
    with pytest.raises(ValueError, match=r"latin1.txt:2: not valid UTF-8 \(byte 14: invalid continuation byte\)"):
        prepare(text, tmp_path / "out.h5", tiny_tokenizer_dir)
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 30: invalid continuation byte\)"):
        prepare(lines, tmp_path / "out.h5", tiny_tokenizer_dir)
    assert checksums(text, lines) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latin1.jsonl", "latin1.txt"]


def test_outputs_are_checked_again_before_they_are_replaced(tmp_path, story, tiny_tokenizer_dir, monkeypatch):
    from titans_hf.data import prepare as prepare_module

    output = tmp_path / "store_bin"
    encode = prepare_module._encode_batch

    def encode_while_someone_writes_to_the_output(*args, **kwargs):
        if not output.exists():
            output.mkdir()
            (output / "notes.txt").write_text("written meanwhile")
        return encode(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "_encode_batch", encode_while_someone_writes_to_the_output)
    with pytest.raises(ValueError, match=r"store_bin: output already exists"):
        prepare(story, output, tiny_tokenizer_dir)
    with pytest.raises(ValueError, match=r"store_bin: will not replace it"):
        prepare(story, output, tiny_tokenizer_dir, overwrite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["store_bin", "story.txt"]  # no temporaries left
    assert [path.name for path in output.iterdir()] == ["notes.txt"]
    assert (output / "notes.txt").read_text() == "written meanwhile"
