"""Token stores: round trips, numeric segment order, lazy read-only access, and validation messages."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from titans_hf.data.stores import (
    STORE_WRITERS,
    H5Store,
    MmapStore,
    detect_format,
    open_store,
    token_dtype,
)

# 12 documents of distinct lengths: segment "10" must come after "9", not after "1".
DOCUMENTS = [np.arange(1000 * index, 1000 * index + length) for index, length in enumerate([7, 3, 12, 5, 1, 9, 4, 6, 8, 10, 11, 2])]
METADATA = {"train_type": "seq", "tokenizer": "tiny", "vocab_size": 20000, "eos_token_id": 0, "pad_token_id": 1}


def write_store(path: Path, documents=DOCUMENTS, key: str = "sequence", dtype: str = "uint16", metadata=METADATA) -> Path:
    writer = STORE_WRITERS["h5" if path.suffix == ".h5" else "bin"](path, {key: dtype}, metadata)
    for document in documents:
        writer.add_segment(key, document)
    os.replace(writer.finish(), path)
    return path


def checksums(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(root.rglob("*"))
    return {str(file): hashlib.sha256(file.read_bytes()).hexdigest() for file in files if file.is_file()}


@pytest.fixture(params=["store.h5", "store_bin"])
def store_path(request, tmp_path) -> Path:
    return write_store(tmp_path / request.param)


def test_round_trip_segments_offsets_and_flat_reads(store_path):
    before = checksums(store_path)
    with open_store(store_path) as store:
        assert store.keys == ["sequence"]
        assert store.dtypes["sequence"] == np.uint16
        assert store.metadata == {**METADATA, "tokenizer_fingerprint": None}
        assert store.num_segments("sequence") == 12
        lengths = [7, 3, 12, 5, 1, 9, 4, 6, 8, 10, 11, 2]
        assert store.segment_lengths("sequence").tolist() == lengths
        assert store.offsets("sequence").tolist() == [0, 7, 10, 22, 27, 28, 37, 41, 47, 55, 65, 76, 78]
        for index, document in enumerate(DOCUMENTS):
            np.testing.assert_array_equal(store.segment("sequence", index), document)
        np.testing.assert_array_equal(store.segment("sequence", -1), DOCUMENTS[11])
        # [5, 12) crosses segment 0 (tokens 5, 6) into segment 1 (3 tokens) and segment 2 (2 tokens).
        assert store.read("sequence", 5, 12).tolist() == [5, 6, 1000, 1001, 1002, 2000, 2001]
        assert store.read("sequence", 78, 78).tolist() == []
        with pytest.raises(IndexError, match="outside key 'sequence'"):
            store.read("sequence", 70, 79)
        with pytest.raises(IndexError):
            store.segment("sequence", 12)
    assert checksums(store_path) == before


def test_h5_segments_follow_numeric_names_not_creation_or_name_order(tmp_path):
    path = tmp_path / "shuffled.h5"
    with h5py.File(path, "w") as file:
        file.attrs["format_version"] = 1
        group = file.create_group("sequence")
        for index in [11, 2, 10, 0, 1, 9, 3, 8, 4, 7, 5, 6]:
            group.create_dataset(str(index), data=DOCUMENTS[index].astype(np.uint16))
    assert sorted(h5py.File(path, "r")["sequence"].keys())[:4] == ["0", "1", "10", "11"]
    store = H5Store(path)
    for index, document in enumerate(DOCUMENTS):
        np.testing.assert_array_equal(store.segment("sequence", index), document)
    np.testing.assert_array_equal(store.read("sequence", 0, 78), np.concatenate(DOCUMENTS))


def test_h5_and_bin_hold_identical_tokens(tmp_path):
    h5 = open_store(write_store(tmp_path / "a.h5"))
    binary = open_store(write_store(tmp_path / "a_bin"))
    np.testing.assert_array_equal(h5.offsets("sequence"), binary.offsets("sequence"))
    np.testing.assert_array_equal(h5.read("sequence", 0, 78), binary.read("sequence", 0, 78))


def test_h5_share_memory_serves_the_same_tokens_from_shared_tensors(tmp_path):
    store = H5Store(write_store(tmp_path / "shared.h5"), share_memory=True)
    assert store._shared["sequence"].is_shared()
    np.testing.assert_array_equal(store.read("sequence", 3, 40), np.concatenate(DOCUMENTS)[3:40])


def test_h5_store_reopens_its_handle_after_pickling(tmp_path):
    import pickle

    store = H5Store(write_store(tmp_path / "pickled.h5"))
    store.read("sequence", 0, 5)
    clone = pickle.loads(pickle.dumps(store))
    np.testing.assert_array_equal(clone.segment("sequence", 10), DOCUMENTS[10])


def test_mmap_store_pickles_without_its_mapped_data(tmp_path):
    import pickle

    metadata = {**METADATA, "vocab_size": 50_000}  # ids up to 49_999
    store = MmapStore(write_store(tmp_path / "pickled_bin", documents=[np.arange(50_000)], dtype="uint32", metadata=metadata))
    store.read("sequence", 0, 50_000)
    payload = pickle.dumps(store)
    assert len(payload) < 5_000  # the 200 kB of tokens stay in the file
    np.testing.assert_array_equal(pickle.loads(payload).read("sequence", 49_990, 50_000), np.arange(49_990, 50_000))


def test_memmap_is_read_only_and_reads_survive_releasing_the_maps(tmp_path):
    path = write_store(tmp_path / "ro_bin")
    before = checksums(path)
    store = MmapStore(path)
    store.release_after_bytes = 8  # drop the mapping after nearly every read
    stream = np.concatenate(DOCUMENTS)
    for start in range(0, 78, 5):
        np.testing.assert_array_equal(store.read("sequence", start, min(start + 5, 78)), stream[start : start + 5])
    store.read("sequence", 0, 3)
    mapped = np.memmap(path / "sequence.bin", dtype=np.uint16, mode="r")
    with pytest.raises(ValueError, match="read-only"):
        mapped[0] = 7
    returned = store.read("sequence", 0, 3)
    returned[0] = 99  # a copy: the file is untouched
    assert checksums(path) == before


def test_detect_format(tmp_path):
    h5 = write_store(tmp_path / "a.h5")
    binary = write_store(tmp_path / "b_bin")
    assert detect_format(h5) == "h5"
    assert detect_format(binary) == "bin"
    assert detect_format(binary / "meta.json") == "bin"
    assert detect_format(binary / "sequence.bin") == "bin"
    with pytest.raises(FileNotFoundError, match="no such token store"):
        detect_format(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        detect_format(tmp_path / "empty")


def test_directory_with_both_formats_is_an_error(tmp_path):
    binary = write_store(tmp_path / "both")
    write_store(binary / "extra.h5")
    with pytest.raises(ValueError, match=r"both.*holds both a bin store \(meta.json\) and HDF5 files \['extra.h5'\]"):
        open_store(binary)


def test_file_that_is_not_hdf5(tmp_path):
    path = tmp_path / "fake.h5"
    path.write_bytes(b"not an hdf5 file at all")
    with pytest.raises(ValueError, match=r"fake.h5: not an HDF5 file"):
        open_store(path)
    with pytest.raises(ValueError, match=r"fake.h5: not an HDF5 file"):
        H5Store(path)


def _bin_store_with_meta(tmp_path: Path, **changes) -> Path:
    path = write_store(tmp_path / "bad_bin")
    meta = json.loads((path / "meta.json").read_text())
    for field, value in changes.items():
        if field.startswith("key_"):
            meta["keys"]["sequence"][field[4:]] = value
        else:
            meta[field] = value
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_missing_meta_json(tmp_path):
    path = write_store(tmp_path / "nometa_bin")
    (path / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="nometa_bin: missing meta.json"):
        MmapStore(path)


def test_meta_json_not_json(tmp_path):
    path = write_store(tmp_path / "bad_bin")
    (path / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad_bin/meta.json: not valid JSON"):
        open_store(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"keys": None}, r"meta.json: field 'keys' must map"),
        ({"format_version": 99}, r"meta.json: format_version 99 is not supported"),
        ({"key_offsets": [0, 7, 200]}, r"meta.json: offsets of key 'sequence' must rise"),
        ({"key_offsets": [0, 9, 7, 78]}, r"meta.json: offsets of key 'sequence' must rise"),
        ({"key_dtype": "uint13"}, r"meta.json: key 'sequence' has unknown dtype 'uint13'"),
        ({"key_dtype": "float32"}, r"meta.json: key 'sequence' has dtype float32; token and mask keys need an integer"),
        ({"key_length": 80, "key_offsets": [0, 80]}, r"sequence.bin: is 156 bytes but meta.json promises 160 .*shorter than meta says"),
        ({"key_length": 70, "key_offsets": [0, 70]}, r"sequence.bin: is 156 bytes but meta.json promises 140 .*longer"),
        ({"key_length": -1}, r"key 'sequence' has length -1"),
    ],
)
def test_meta_json_problems_name_the_file_and_the_problem(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        open_store(_bin_store_with_meta(tmp_path, **change))


@pytest.mark.parametrize("field", ["format_version", "keys"])
def test_meta_json_missing_top_level_field(tmp_path, field):
    path = write_store(tmp_path / "bad_bin")
    meta = json.loads((path / "meta.json").read_text())
    del meta[field]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"meta.json: missing field '{field}'"):
        open_store(path)


def test_meta_json_key_missing_offsets(tmp_path):
    path = write_store(tmp_path / "bad_bin")
    meta = json.loads((path / "meta.json").read_text())
    del meta["keys"]["sequence"]["offsets"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"meta.json: key 'sequence' is missing field\(s\) \['offsets'\]"):
        open_store(path)


def test_missing_key_file(tmp_path):
    path = write_store(tmp_path / "nofile_bin")
    (path / "sequence.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"sequence.bin: missing; meta.json lists key 'sequence'"):
        open_store(path)


@pytest.mark.parametrize("name", ["empty.h5", "empty_bin"])
def test_empty_store(tmp_path, name):
    with pytest.raises(ValueError, match=rf"{name}: empty store, it holds no tokens"):
        open_store(write_store(tmp_path / name, documents=[np.array([], np.int64)]))


def test_h5_problems(tmp_path):
    path = tmp_path / "gaps.h5"
    with h5py.File(path, "w") as file:
        file.attrs["format_version"] = 1
        file.create_dataset("sequence/0", data=np.arange(3, dtype=np.uint16))
        file.create_dataset("sequence/2", data=np.arange(3, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"gaps.h5:/sequence: segment names must be exactly 0..1 with no gaps"):
        open_store(path)
    with h5py.File(path, "w") as file:
        file.attrs["format_version"] = 1
        file.create_dataset("sequence/first", data=np.arange(3, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"gaps.h5:/sequence: segment names must be integers"):
        open_store(path)
    with h5py.File(path, "w") as file:
        file.create_dataset("sequence/0", data=np.arange(3, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"gaps.h5: missing attribute 'format_version'"):
        open_store(path)
    with h5py.File(path, "w") as file:
        file.attrs["format_version"] = 1
        file.create_dataset("sequence/0", data=np.arange(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"gaps.h5: key 'sequence' has dtype float32"):
        open_store(path)


def test_token_dtype_follows_vocabulary_size():
    assert token_dtype(512) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32
    assert token_dtype(151_936) == np.uint32  # Qwen2.5
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        token_dtype(0)


def test_writer_rejects_values_outside_the_dtype_and_abort_leaves_nothing(tmp_path):
    for name in ["w.h5", "w_bin"]:
        writer = STORE_WRITERS["h5" if name.endswith(".h5") else "bin"](tmp_path / name, {"sequence": "uint16"}, METADATA)
        with pytest.raises(ValueError, match=r"key 'sequence' value range \[0, 70000\] does not fit uint16"):
            writer.append("sequence", np.array([0, 70000]))
        writer.abort()
    assert list(tmp_path.iterdir()) == []
