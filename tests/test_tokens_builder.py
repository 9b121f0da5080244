"""`load_dataset("titans_tokens", ...)`: identical examples from both formats, num_proc, streaming, caching."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
from datasets import load_dataset
from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

import titans_hf  # noqa: F401  (registers the builder)
from titans_hf.data.stores import STORE_WRITERS
from titans_hf.data.tokens_builder import TitansTokens, store_data_files

# 40 documents of 3..42 tokens: 900 tokens, enough windows for several ranges.
DOCUMENTS = [np.arange(100 * index, 100 * index + 3 + index) for index in range(40)]
STREAM = np.concatenate(DOCUMENTS)
METADATA = {"train_type": "seq", "tokenizer": "tiny", "vocab_size": 5000, "eos_token_id": 0, "pad_token_id": 1}


def make_store(path: Path, segments: dict[str, list]) -> Path:
    dtypes = {key: ("float32" if key == "rewards" else "uint8" if "mask" in key else "uint16") for key in segments}
    writer = STORE_WRITERS["h5" if path.suffix == ".h5" else "bin"](path, dtypes, METADATA)
    for key, values in segments.items():
        for segment in values:
            writer.add_segment(key, np.asarray(segment))
    os.replace(writer.finish(), path)
    return path


def checksums(paths) -> dict[str, str]:
    files = [file for path in paths for file in ([path] if path.is_file() else sorted(path.iterdir()))]
    return {str(file): hashlib.sha256(file.read_bytes()).hexdigest() for file in files}


@pytest.fixture()
def stores(tmp_path):
    return make_store(tmp_path / "corpus.h5", {"sequence": DOCUMENTS}), make_store(tmp_path / "corpus_bin", {"sequence": DOCUMENTS})


def load(data_files, cache_dir, **kwargs):
    return load_dataset("titans_tokens", data_files=data_files, split="train", cache_dir=str(cache_dir), **kwargs)


def test_registered_on_import():
    assert _PACKAGED_DATASETS_MODULES["titans_tokens"][0] == "titans_hf.data.tokens_builder"


def test_h5_and_bin_give_identical_examples_matching_the_window_arithmetic(stores, tmp_path):
    h5, binary = stores
    before = checksums([h5, binary])
    from_h5 = load(str(h5), tmp_path / "cache", window_size=16, stride=12, pad_tail=True)
    from_bin = load(str(binary / "*"), tmp_path / "cache", window_size=16, stride=12, pad_tail=True)
    assert isinstance(from_h5, datasets.Dataset)
    # 900 tokens: full windows start at 0, 12, ..., 876 (74 of them, the last ends at 892);
    # the padded one starts at 888 and holds 12 tokens.
    assert len(from_h5) == 74 + 1
    assert from_h5[:] == from_bin[:]
    assert from_h5[5]["input_ids"] == STREAM[60:76].tolist()
    assert from_h5[74]["input_ids"] == STREAM[888:900].tolist() + [1] * 4
    assert from_h5[74]["labels"] == STREAM[888:900].tolist() + [-100] * 4
    assert from_h5[74]["attention_mask"] == [1] * 12 + [0] * 4
    assert from_h5.features["input_ids"].feature.dtype == "int32"
    assert checksums([h5, binary]) == before


def test_num_proc_2_equals_num_proc_1(stores, tmp_path):
    h5, _ = stores
    one = load(str(h5), tmp_path / "one", window_size=8, respect_document_boundaries=True)
    two = load(str(h5), tmp_path / "two", window_size=8, respect_document_boundaries=True, num_proc=2)
    assert len(two.cache_files) == 2  # one Arrow file per process
    # Inside documents of 3 + i tokens, W=8: document i holds (3 + i - 8) // 8 + 1 windows when 3 + i >= 8.
    assert len(one) == sum((3 + i - 8) // 8 + 1 for i in range(5, 40))
    assert one[:] == two[:]


def test_streaming_yields_the_same_rows(stores, tmp_path):
    h5, _ = stores
    built = load(str(h5), tmp_path / "cache", window_size=32)
    streamed = load(str(h5), tmp_path / "cache", window_size=32, streaming=True)
    assert isinstance(streamed, datasets.IterableDataset)
    assert list(streamed) == list(built)


def test_cache_is_reused_and_rebuilt_when_a_kwarg_or_a_store_file_changes(stores, tmp_path):
    _, binary = stores
    cache = tmp_path / "cache"
    meta_only = str(binary / "meta.json")
    first = load(meta_only, cache, window_size=16)
    arrow_file = Path(first.cache_files[0]["filename"])
    built_at = arrow_file.stat().st_mtime_ns
    again = load(meta_only, cache, window_size=16)
    assert again.cache_files[0]["filename"] == str(arrow_file)
    assert arrow_file.stat().st_mtime_ns == built_at  # reused, not rewritten
    other_stride = load(meta_only, cache, window_size=16, stride=8)
    assert other_stride.cache_files[0]["filename"] != str(arrow_file)
    assert len(other_stride) == (900 - 16) // 8 + 1
    # Touch the token file only (data_files names meta.json): the cache must still be rebuilt.
    token_file = binary / "sequence.bin"
    stat = token_file.stat()
    os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = load(meta_only, cache, window_size=16)
    assert touched.cache_files[0]["filename"] != str(arrow_file)
    assert touched[:] == first[:]


def test_builder_class_route(stores, tmp_path):
    h5, _ = stores
    builder = TitansTokens(cache_dir=str(tmp_path / "cache"), data_files=str(h5), window_size=100, stride=50)
    builder.download_and_prepare()
    dataset = builder.as_dataset(split="train")
    assert len(dataset) == (900 - 100) // 50 + 1
    assert dataset[3]["input_ids"] == STREAM[150:250].tolist()
    assert dataset[:] == load(str(h5), tmp_path / "other", window_size=100, stride=50)[:]


def test_dpo_and_grpo_records_with_trl_columns(tmp_path):
    dpo = make_store(
        tmp_path / "dpo.h5",
        {
            "chosen": [[5, 6, 0], [7, 8, 9, 0]],
            "chosen_mask": [[0, 1, 1], [0, 0, 1, 1]],
            "rejected": [[5, 16, 16, 0], [7, 8, 18, 0]],
            "rejected_mask": [[0, 1, 1, 1], [0, 0, 1, 1]],
        },
    )
    rows = load(str(dpo), tmp_path / "cache", train_type="dpo")
    assert rows[1] == {"prompt_ids": [7, 8], "chosen_ids": [9, 0], "rejected_ids": [18, 0]}
    grpo = make_store(
        tmp_path / "grpo_bin",
        {"prompts": [[1, 2], [3]], "responses": [[4, 0], [5, 0], [6, 6, 0]], "masks": [[1, 1], [1, 1], [1, 1, 1]],
         "rewards": [[0.5, -0.25], [2.0]]},
    )
    groups = load(str(grpo / "*"), tmp_path / "cache", train_type="grpo")
    assert groups.features["rewards"].feature.dtype == "float32"
    assert groups[0] == {"prompt_ids": [1, 2], "completion_ids": [[4, 0], [5, 0]], "completion_mask": [[1, 1], [1, 1]],
                         "rewards": [0.5, -0.25]}
    assert groups[1]["completion_ids"] == [[6, 6, 0]]


def test_bad_arguments_and_inputs_name_the_problem(stores, tmp_path):
    h5, binary = stores
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="window_size must be a positive integer, got 0"):
        load(str(h5), cache, window_size=0)
    with pytest.raises(ValueError, match="stride must be a positive integer, got -4"):
        load(str(h5), cache, window_size=4, stride=-4)
    with pytest.raises(ValueError, match="train_type must be one of"):
        load(str(h5), cache, train_type="rlhf", window_size=4)
    with pytest.raises(ValueError, match=r"corpus.h5: window_size 43 is larger than the longest document \(42 tokens\)"):
        load(str(h5), cache, window_size=43, respect_document_boundaries=True)
    make_store(binary / "stray.h5", {"sequence": DOCUMENTS[:2]})
    with pytest.raises(ValueError, match=r"corpus_bin: directory holds both a bin store"):
        load(str(binary / "meta.json"), cache, window_size=4)
    not_a_store = tmp_path / "notes.txt"
    not_a_store.write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt: not an HDF5 file and not part of a bin store"):
        load(str(not_a_store), cache, window_size=4)


def test_a_bin_store_folder_stands_for_its_meta_json(stores, tmp_path):
    h5, bin_dir = stores
    pattern = str(h5.parent / "*.h5")
    assert store_data_files([bin_dir, h5, pattern]) == [str(bin_dir / "meta.json"), str(h5),
                                                        *sorted(map(str, h5.parent.glob("*.h5")))]
    with pytest.raises(FileNotFoundError, match=r"--data .*nothing\*\.h5: the pattern matches no file"):
        store_data_files([str(tmp_path / "nothing*.h5")], "--data")
    with pytest.raises(FileNotFoundError, match=r"--data .*absent\.h5: no such store"):
        store_data_files([str(tmp_path / "absent.h5")], "--data")
    by_folder = load(store_data_files([bin_dir]), tmp_path / "a", window_size=16)
    assert by_folder["input_ids"] == load(str(bin_dir / "meta.json"), tmp_path / "b", window_size=16)["input_ids"]
    # with pad_tail the last, shorter window of each document is kept, padded: every document gives one or more
    padded = load(str(h5), tmp_path / "c", window_size=16, respect_document_boundaries=True, pad_tail=True)
    assert len(padded) == sum(-(-len(document) // 16) for document in DOCUMENTS)
