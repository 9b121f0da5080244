"""Your own documents: titans-hf prepare -> titans-hf train --dataset titans_tokens -> titans-hf eval --lm, on a
tiny store in seconds, with memory-only checkpoints that resume exactly."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from titans_hf.commands import main as cli_main
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import MEMORY_CONFIG_NAME, MEMORY_WEIGHTS_NAME

PROSE = ("The old clock on the tower struck noon while the river carried leaves past the mill. "
         "Ships waited in the harbour for the tide, their sails folded against the grey sky. ")


@pytest.fixture
def stores(tmp_path, tiny_tokenizer_dir):
    """Train and held-out seq stores prepared from text files, as a user would."""
    for name, repeat in (("train", 12), ("held_out", 4)):
        folder = tmp_path / name
        folder.mkdir()
        for index in range(3):
            (folder / f"doc{index}.txt").write_text(PROSE * (repeat + index))
        assert cli_main(["prepare", *map(str, sorted(folder.glob("*.txt"))), "-o", str(tmp_path / f"{name}.h5"),
                         "--tokenizer", str(tiny_tokenizer_dir)]) == 0
    return tmp_path / "train.h5", tmp_path / "held_out.h5"


def flags(model_dir, train_store, eval_store, output_dir, *extra):
    return [
        "train", "--dataset", "titans_tokens", "--data_files", str(train_store), "--eval_data_files", str(eval_store),
        "--window_size", "64", "--model_name_or_path", str(model_dir), "--chunk_size", "16",
        "--memory_chunk_size", "8", "--memory_head_dim", "16", "--output_dir", str(output_dir),
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2",
        "--lr_scheduler_type", "constant",  # the same schedule whether the run stops at step 2 or 4
        "--write_cost_growth", "1",  # the write cost's schedule, too, follows max_steps
        "--max_steps", "4", "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
        *extra,
    ]  # fmt: skip


def test_train_on_a_store_resume_and_evaluate_per_chunk(tiny_qwen3_dir, stores, tmp_path):
    train_store, eval_store = stores
    assert cli_main(flags(tiny_qwen3_dir, train_store, eval_store, tmp_path / "full", "--save_strategy", "no")) == 0
    full = load_file(tmp_path / "full" / MEMORY_WEIGHTS_NAME)
    assert not [name for name in full if name.startswith(("model.", "lm_head."))]

    # interrupted after the checkpoint of step 2, resumed: the same memory, bit for bit
    assert cli_main(flags(tiny_qwen3_dir, train_store, eval_store, tmp_path / "resumed", "--max_steps", "2")) == 0
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    assert {MEMORY_WEIGHTS_NAME, MEMORY_CONFIG_NAME, "optimizer.pt"} <= set(os.listdir(checkpoint))
    assert not [f for f in os.listdir(checkpoint) if f.startswith(("model.", "pytorch_model"))]
    assert cli_main(flags(tiny_qwen3_dir, train_store, eval_store, tmp_path / "resumed", "--resume_from_checkpoint",
                          "last")) == 0
    resumed = load_file(tmp_path / "resumed" / MEMORY_WEIGHTS_NAME)
    assert all(torch.equal(resumed[name], tensor) for name, tensor in full.items())

    # held-out windows, loss per chunk with the memory on and off
    assert cli_main(["eval", "--lm", "--model", str(tmp_path / "full"), "--data", str(eval_store),
                     "--window-size", "64", "--batch-size", "2", "--output", str(tmp_path / "lm")]) == 0
    results = json.loads((tmp_path / "lm" / "lm_results.json").read_text())
    assert len(results["memory"]["loss"]) == 4 == len(results["no_memory"]["loss"])  # 64 tokens = 4 chunks of 16
    assert results["memory"]["tokens"] == results["no_memory"]["tokens"]
    assert results["memory"]["tokens"][0] == 15 * results["num_windows"]
    assert (tmp_path / "lm" / "loss_per_chunk.png").is_file()
    model = TitansQwenForCausalLM.from_pretrained(tmp_path / "full")
    assert model.config.memory_config.chunk_size == 16


def test_store_training_refuses_what_it_cannot_use(tiny_qwen3_dir, stores, tmp_path):
    train_store, eval_store = stores
    with pytest.raises(ValueError, match="needs --window_size"):
        cli_main([f for f in flags(tiny_qwen3_dir, train_store, eval_store, tmp_path / "x") if f not in ("64",)
                  and f != "--window_size"])
    with pytest.raises(ValueError, match="--dataset 'titans_words' must be one of"):
        cli_main(flags(tiny_qwen3_dir, train_store, eval_store, tmp_path / "x", "--dataset", "titans_words"))


def test_a_store_too_small_to_set_evaluation_rows_apart_is_named_in_one_line(tiny_qwen3_dir, tiny_tokenizer_dir,
                                                                            tmp_path):
    """A grpo store of one record and no --eval_data_files: no share of it can be set apart for evaluation. One line
    names the store and why, before the model loads; named as the evaluation rows too, the record trains."""
    source = tmp_path / "group.jsonl"
    source.write_text(json.dumps({"prompt": "Mary went to the kitchen. Where is Mary?", "responses": [" kitchen",
                                  " garden"], "rewards": [1.0, 0.0]}) + "\n")
    store = tmp_path / "group.h5"
    assert cli_main(["prepare", str(source), "-o", str(store), "--tokenizer", str(tiny_tokenizer_dir),
                     "--train-type", "grpo"]) == 0
    stored = store.read_bytes()
    argv = ["train", "--dataset", "titans_tokens", "--train_type", "grpo", "--data_files", str(store),
            "--model_name_or_path", str(tiny_qwen3_dir), "--chunk_size", "16", "--memory_chunk_size", "8",
            "--memory_head_dim", "16", "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
            "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true"]
    with pytest.raises(ValueError, match=rf"^--data_files {re.escape(str(store))}: 1 grpo record, too few to set a "
                       r"--train_ratio 0\.9 share of them apart for evaluation \(0 would train, 1 evaluate\); give "
                       "more, or the evaluation rows with --eval_data_files$"):
        cli_main(argv)
    assert not (tmp_path / "out" / MEMORY_WEIGHTS_NAME).exists()
    assert cli_main([*argv, "--eval_data_files", str(store)]) == 0
    assert (tmp_path / "out" / MEMORY_WEIGHTS_NAME).is_file() and store.read_bytes() == stored
