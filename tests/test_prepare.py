"""`prepare` / `titans-hf prepare`: text in, stores whose tokens equal the tokenizer's own encoding."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

import titans_hf.files as files
import titans_hf.outputs as outputs
from titans_hf.commands import main
from titans_hf.data import prepare as prepare_module
from titans_hf.data.prepare import prepare
from titans_hf.data.stores import open_store, tokenizer_fingerprint

STORY = "Mary went to the kitchen.\nJohn moved to the office.\n\nThe old clock on the tower struck noon.\n"
OTHER = "Ships waited in the harbour for the tide."


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("output_name", ["corpus.h5", "corpus_bin"])
def test_txt_documents_end_with_eos_and_match_the_tokenizer(tmp_path, tiny_tokenizer_dir, tokenizer, output_name):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(STORY * 3)
    second.write_text(OTHER)
    before = [digest(first), digest(second)]
    [path] = prepare([first, second], tmp_path / output_name, tiny_tokenizer_dir)
    assert path == tmp_path / output_name
    eos = tokenizer.eos_token_id
    with open_store(path) as store:
        assert store.dtypes["sequence"] == np.uint16  # 512-token vocabulary
        assert store.segment("sequence", 0).tolist() == encode(tokenizer, STORY * 3) + [eos]
        assert store.segment("sequence", 1).tolist() == encode(tokenizer, OTHER) + [eos]
        assert store.metadata == {
            "train_type": "seq", "tokenizer": str(tiny_tokenizer_dir), "vocab_size": len(tokenizer),
            "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        }
    assert [digest(first), digest(second)] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.txt", "b.txt", output_name])  # no temp leftovers


def test_meta_json_records_format_keys_and_offsets(tmp_path, tiny_tokenizer_dir, tokenizer):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": STORY}, {"text": ""}, {"text": OTHER}])
    prepare(source, tmp_path / "store", tiny_tokenizer_dir)
    meta = json.loads((tmp_path / "store" / "meta.json").read_text())
    ids = encode(tokenizer, STORY) + [tokenizer.eos_token_id] + encode(tokenizer, OTHER) + [tokenizer.eos_token_id]
    first, second = len(encode(tokenizer, STORY)) + 1, len(encode(tokenizer, OTHER)) + 1
    offsets = [0, first, first + second]
    # The checksum covers the ids as stored (uint16) and then the offsets as little-endian int64.
    checksum = hashlib.sha256(np.array(ids, "<u2").tobytes() + np.array(offsets, "<i8").tobytes()).hexdigest()
    # The empty document adds nothing (not a lone EOS).
    assert meta["format_version"] == 1
    assert meta["keys"] == {"sequence": {"dtype": "uint16", "length": first + second, "offsets": offsets,
                                         "min": min(ids), "max": max(ids), "sha256": checksum}}
    assert meta["vocab_size"] == len(tokenizer) and meta["tokenizer"] == str(tiny_tokenizer_dir)
    assert (tmp_path / "store" / "sequence.bin").stat().st_size == 2 * (first + second)


def test_long_documents_are_encoded_in_pieces_with_identical_ids(tmp_path, tiny_tokenizer_dir, tokenizer, monkeypatch):
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 40)
    monkeypatch.setattr(prepare_module, "_READ_CHARS", 25)
    text = STORY * 20
    pieces = list(prepare_module._pieces([text[i : i + 25] for i in range(0, len(text), 25)], cut=True))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert all(piece.endswith("\n") for piece in pieces[:-1])
    (tmp_path / "long.txt").write_text(text)
    [path] = prepare(tmp_path / "long.txt", tmp_path / "long.h5", tiny_tokenizer_dir, batch_size=3)
    assert open_store(path).segment("sequence", 0).tolist() == encode(tokenizer, text) + [tokenizer.eos_token_id]


def test_sft_mask_covers_the_response_and_its_eos(tmp_path, tiny_tokenizer_dir, tokenizer):
    records = [{"prompt": "Question: Where is Mary?", "response": " kitchen"}, {"prompt": "Where is John?", "response": " office"}]
    [path] = prepare(write_jsonl(tmp_path / "sft.jsonl", records), tmp_path / "sft_bin", tiny_tokenizer_dir, train_type="sft")
    store = open_store(path)
    assert store.dtypes["loss_mask"] == np.uint8
    for index, record in enumerate(records):
        prompt, response = encode(tokenizer, record["prompt"]), encode(tokenizer, record["response"])
        assert store.segment("sequence", index).tolist() == prompt + response + [tokenizer.eos_token_id]
        assert store.segment("loss_mask", index).tolist() == [0] * len(prompt) + [1] * (len(response) + 1)


def test_dpo_pairs_with_and_without_prompt(tmp_path, tiny_tokenizer_dir, tokenizer):
    records = [
        {"prompt": "Where is Mary?", "chosen": " kitchen", "rejected": " garden"},
        {"chosen": "Mary went to the kitchen.", "rejected": "Mary went to the garden."},
    ]
    [path] = prepare(write_jsonl(tmp_path / "dpo.jsonl", records), tmp_path / "dpo.h5", tiny_tokenizer_dir, train_type="dpo")
    store, eos = open_store(path), tokenizer.eos_token_id
    prompt = encode(tokenizer, "Where is Mary?")
    assert store.segment("chosen", 0).tolist() == prompt + encode(tokenizer, " kitchen") + [eos]
    assert store.segment("rejected_mask", 0).tolist() == [0] * len(prompt) + [1] * (len(encode(tokenizer, " garden")) + 1)
    assert store.segment("rejected", 1).tolist() == encode(tokenizer, records[1]["rejected"]) + [eos]
    assert store.segment("chosen_mask", 1).tolist() == [1] * (len(encode(tokenizer, records[1]["chosen"])) + 1)


def test_grpo_groups_keep_float_rewards(tmp_path, tiny_tokenizer_dir, tokenizer):
    records = [
        {"prompt": "Where is Mary?", "responses": [" kitchen", " garden"], "rewards": [1, -0.5]},
        {"prompt": "Where is John?", "responses": [" office"], "rewards": [0.25]},
    ]
    [path] = prepare(write_jsonl(tmp_path / "grpo.jsonl", records), tmp_path / "grpo_bin", tiny_tokenizer_dir, train_type="grpo")
    store = open_store(path)
    assert store.dtypes["rewards"] == np.float32
    assert store.segment("rewards", 0).tolist() == [1.0, -0.5] and store.segment("rewards", 1).tolist() == [0.25]
    assert store.num_segments("responses") == 3
    assert store.segment("responses", 1).tolist() == encode(tokenizer, " garden") + [tokenizer.eos_token_id]
    assert store.segment("prompts", 1).tolist() == encode(tokenizer, "Where is John?")
    assert store.segment("masks", 2).tolist() == [1] * (len(encode(tokenizer, " office")) + 1)


def test_datasets_input_num_proc_and_shards(tmp_path, tiny_tokenizer_dir, tokenizer):
    texts = [f"{STORY} {index}" for index in range(30)]
    single = prepare(datasets.Dataset.from_dict({"text": texts}), tmp_path / "one_bin", tiny_tokenizer_dir)[0]
    parallel = prepare(
        datasets.Dataset.from_dict({"text": texts}), tmp_path / "two_bin", tiny_tokenizer_dir, num_proc=2, batch_size=4
    )[0]
    assert digest(single / "sequence.bin") == digest(parallel / "sequence.bin")
    assert json.loads((single / "meta.json").read_text()) == json.loads((parallel / "meta.json").read_text())
    # A shard closes after the document that brings it to shard_tokens tokens.
    lengths = [len(encode(tokenizer, text)) + 1 for text in texts]
    limit, expected_shards, filled = 10 * lengths[0], [[]], 0
    for length in lengths:
        if filled >= limit:
            expected_shards.append([])
            filled = 0
        expected_shards[-1].append(length)
        filled += length
    assert len(expected_shards) == 3
    shards = prepare(datasets.Dataset.from_dict({"text": texts}), tmp_path / "sharded.h5", tiny_tokenizer_dir, shard_tokens=limit)
    assert [path.name for path in shards] == [f"sharded-{index:05d}-of-00003.h5" for index in range(3)]
    assert [open_store(path).segment_lengths("sequence").tolist() for path in shards] == expected_shards
    stream = np.concatenate([open_store(path).read("sequence", 0, sum(part)) for path, part in zip(shards, expected_shards)])
    np.testing.assert_array_equal(stream, open_store(single).read("sequence", 0, sum(lengths)))


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "[UNK]": 1, **{f"w{index}": index + 2 for index in range(70_000)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>").save_pretrained(tmp_path / "big")
    (tmp_path / "words.txt").write_text("w69999 w0 w65535")
    [path] = prepare(tmp_path / "words.txt", tmp_path / "words.h5", tmp_path / "big")
    store = open_store(path)
    assert store.dtypes["sequence"] == np.uint32
    assert store.segment("sequence", 0).tolist() == [70_001, 2, 65_537, 0]


@pytest.mark.parametrize(
    ("records", "train_type", "message"),
    [
        ([{"text": "fine"}, {"body": "no text"}], "seq", r"bad.jsonl:2: missing field\(s\) \['text'\]"),
        ([{"prompt": "p"}], "sft",
         r"bad.jsonl:1: an sft record needs the fields \['messages'\] or \['prompt', 'completion'\] or \['prompt', 'response'\]; "
         r"it has \['prompt'\]"),
        ([{"prompt": "p", "response": 3}], "sft", r"bad.jsonl:1: field 'response' must be a string, got int"),
        ([{"prompt": "p", "responses": ["a", "b"], "rewards": [1.0]}], "grpo", r"bad.jsonl:1: 2 responses but 1 rewards"),
        ([{"prompt": "p", "responses": ["a"], "rewards": ["high"]}], "grpo", r"bad.jsonl:1: field 'rewards' must be a list of numbers"),
        (["just a string"], "seq", r"bad.jsonl:1: expected a JSON object, got str"),
    ],
)
def test_bad_records_name_file_line_and_problem_and_leave_no_output(tmp_path, tiny_tokenizer_dir, records, train_type, message):
    source = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(ValueError, match=message):
        prepare(source, tmp_path / "out_bin", tiny_tokenizer_dir, train_type=train_type)
    assert [path.name for path in tmp_path.iterdir()] == ["bad.jsonl"]  # the partial store was removed


def test_bad_inputs(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        prepare(tmp_path / "broken.jsonl", tmp_path / "out.h5", tiny_tokenizer_dir)
    (tmp_path / "story.txt").write_text(STORY)
    with pytest.raises(ValueError, match=r"story.txt: a .txt file is one plain document; train_type 'sft' needs .jsonl"):
        prepare(tmp_path / "story.txt", tmp_path / "out.h5", tiny_tokenizer_dir, train_type="sft")
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"table.csv: unsupported input"):
        prepare(tmp_path / "table.csv", tmp_path / "out.h5", tiny_tokenizer_dir)
    with pytest.raises(FileNotFoundError, match=r"missing.txt: input file not found"):
        prepare(tmp_path / "missing.txt", tmp_path / "out.h5", tiny_tokenizer_dir)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"no records to prepare"):
        prepare(tmp_path / "empty.txt", tmp_path / "out.h5", tiny_tokenizer_dir)
    with pytest.raises(ValueError, match="num_proc must be a positive integer"):
        prepare(tmp_path / "story.txt", tmp_path / "out.h5", tiny_tokenizer_dir, num_proc=0)
    assert not (tmp_path / "out.h5").exists()
    prepare(tmp_path / "story.txt", tmp_path / "out.h5", tiny_tokenizer_dir)
    with pytest.raises(ValueError, match=r"out.h5: output already exists; pass overwrite=True"):
        prepare(tmp_path / "story.txt", tmp_path / "out.h5", tiny_tokenizer_dir)
    (tmp_path / "other.txt").write_text(OTHER)
    prepare(tmp_path / "other.txt", tmp_path / "out.h5", tiny_tokenizer_dir, overwrite=True)
    assert open_store(tmp_path / "out.h5").num_segments("sequence") == 1


def test_failed_overwrite_keeps_the_old_store(tmp_path, tiny_tokenizer_dir, monkeypatch):
    (tmp_path / "story.txt").write_text(STORY)
    (tmp_path / "other.txt").write_text(OTHER)
    output = tmp_path / "store_bin"
    prepare(tmp_path / "story.txt", output, tiny_tokenizer_dir)
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    real_rename = files.rename_no_replace

    def rename_failing_on_the_new_store(src, dst):
        if Path(dst) == output and not Path(src).name.startswith(f".{output.name}.replaced-"):
            raise OSError("disk full")  # the new store cannot be put in place; putting the old one back works
        real_rename(src, dst)

    # what titans_hf.outputs.replace_outputs renames with, and what puts the old store back
    monkeypatch.setattr(files, "rename_no_replace", rename_failing_on_the_new_store)
    monkeypatch.setattr(outputs, "rename_no_replace", rename_failing_on_the_new_store)
    with pytest.raises(OSError, match="disk full"):
        prepare(tmp_path / "other.txt", output, tiny_tokenizer_dir, overwrite=True)
    monkeypatch.undo()
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other.txt", "store_bin", "story.txt"]


def test_console_command(tmp_path, tiny_tokenizer_dir, tokenizer, capsys):
    (tmp_path / "story.txt").write_text(STORY)
    output = tmp_path / "cli_bin"
    assert main(["prepare", str(tmp_path / "story.txt"), "--output", str(output), "--tokenizer", str(tiny_tokenizer_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(output)
    assert open_store(output).segment("sequence", 0).tolist() == encode(tokenizer, STORY) + [tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="no inputs"):
        main(["prepare", "--output", str(tmp_path / "x.h5"), "--tokenizer", str(tiny_tokenizer_dir)])
    # --dataset loads through datasets.load_dataset: here a local folder of .jsonl files.
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "train.jsonl", [{"body": OTHER}, {"body": STORY}])
    from_dataset = tmp_path / "from_dataset.h5"
    arguments = ["--dataset", str(tmp_path / "folder"), "--text-field", "body", "-o", str(from_dataset),
                 "--tokenizer", str(tiny_tokenizer_dir)]
    assert main(["prepare", *arguments]) == 0
    assert open_store(from_dataset).segment("sequence", 1).tolist() == encode(tokenizer, STORY) + [tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="pass input files or --dataset, not both"):
        main(["prepare", str(tmp_path / "story.txt"), *arguments])
