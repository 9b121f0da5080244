"""The main job in miniature: generate -> build -> train a few steps -> save -> reload -> evaluate -> files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from titans_hf.data.babilong import ACTORS, LOCATIONS, MOVE_VERBS, generate_babilong
from titans_hf.demo import build_demo_tokenizer, main, run_demo
from titans_hf.modeling import TitansQwenForCausalLM

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a valid PNG has right after its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    output = tmp_path_factory.mktemp("demo")
    return run_demo(
        output_dir=output,
        train_chunks=(0, 3),
        eval_chunks=(3, 4),
        num_train_samples=6,
        num_eval_samples=5,
        batch_size=4,
        max_steps=3,
        seed=0,
        show_progress=False,
    )


def test_demo_tokenizer_makes_every_task_word_one_token(tmp_path):
    tokenizer = build_demo_tokenizer(tmp_path)
    words = ACTORS + LOCATIONS + [word for verb in MOVE_VERBS for word in verb.split()] + ["Where", "is", "the"]
    for word in words:
        assert len(tokenizer(" " + word)["input_ids"]) == 1, word
    # the question's actor is 5 tokens before the answer position: within the 6-token convolution
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("\n\nQuestion: Where is Mary? \nAnswer:")["input_ids"])
    assert tokens[-6:] == ["ĠMary", "?", "Ġ", "Ċ", "Answer", ":"]


def test_demo_writes_results_for_every_length_and_mode(demo):
    paths = demo["paths"]
    results = json.loads(paths["results"].read_text())
    assert results == demo["results"]
    assert results["metric"] == "exact_match"
    assert list(results["accuracy"]) == ["qa1"]
    assert list(results["accuracy"]["qa1"]) == ["96", "128"]
    for length, cell in results["details"]["qa1"].items():
        assert cell["num_samples"] == 5
        assert cell["chance"] == pytest.approx(1 / 6)
        # the question follows the whole input, so every prompt is longer than the input length
        assert cell["prompt_tokens"]["min"] > int(length) - 32
        assert cell["prompt_tokens"]["max"] > int(length)
        for mode in ("memory", "no_memory"):
            accuracy = results["accuracy"]["qa1"][length][mode]
            assert accuracy == cell[mode]["exact_match"]
            assert round(accuracy * 5) == pytest.approx(accuracy * 5)  # a count of 5 rows
            assert 0 <= accuracy <= 1
    predictions = paths["predictions"].read_text().splitlines()
    assert len(predictions) == 2 * 5
    assert {json.loads(line)["length"] for line in predictions} == {"96", "128"}


def test_demo_evaluates_held_out_rows(demo):
    tokenizer = demo["tokenizer"]
    lines = [json.loads(line) for line in demo["paths"]["predictions"].read_text().splitlines()]
    # evaluation rows are the generator's rows for the evaluation seed (seed 500 for length 96, 501 for 128)
    expected = generate_babilong("qa1", 5, 96, tokenizer, seed=500) + generate_babilong("qa1", 5, 128, tokenizer,
                                                                                         seed=501)
    assert [line["target"] for line in lines] == [row["target"] for row in expected]
    training = generate_babilong("qa1", 6, 96, tokenizer, seed=101)
    assert not {row["input"] for row in training} & {row["input"] for row in expected}


def test_demo_plots_are_valid_pngs(demo):
    for name in ("heatmap", "loss_curve"):
        width, height = png_size(demo["paths"][name])
        assert width > 100 and height > 100


def test_demo_run_info_records_the_training(demo):
    info = json.loads(demo["paths"]["run_info"].read_text())
    assert info == json.loads(json.dumps(demo["run_info"]))
    assert info["steps"] == 3
    assert info["train_lengths"] == [0, 96] and info["eval_lengths"] == [96, 128]
    assert info["num_train_rows"] == 12
    assert info["curriculum_chunks"][0] < info["curriculum_chunks"][-1]  # bare stories first
    assert info["memory_settings"]["freeze_base"] is False


def test_demo_checkpoint_reloads_to_identical_logits(demo):
    paths, trained = demo["paths"], demo["model"]
    config = json.loads((paths["memory"] / "memory_config.json").read_text())
    assert config["base_model_name_or_path"] == str(paths["base"])
    saved = load_file(str(paths["memory"] / "memory_model.safetensors"))
    assert saved and not any(name.startswith(("model.", "lm_head.")) for name in saved)
    reloaded = TitansQwenForCausalLM.from_base_and_memory(paths["base"], paths["memory"])
    input_ids = torch.randint(1, len(demo["tokenizer"]), (2, 70), generator=torch.Generator().manual_seed(0))
    trained.eval()
    with torch.no_grad():
        expected = trained(input_ids=input_ids).logits
        actual = reloaded(input_ids=input_ids).logits
        assert torch.equal(actual, expected)
        # the base was trained jointly: the memory path matters, and switching it off changes the answer logits
        with reloaded.memory_disabled():
            ablated = reloaded(input_ids=input_ids).logits
    assert not torch.equal(ablated[:, 40:], actual[:, 40:])


def test_demo_main_rejects_bad_lengths(tmp_path):
    with pytest.raises(ValueError, match="eval_chunks"):
        main(["--output-dir", str(tmp_path), "--eval-chunks", "0"])


def test_demo_with_a_given_model_trains_only_the_memory(tiny_qwen3_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    demo = run_demo(output_dir=tmp_path, model=str(tiny_qwen3_dir), train_chunks=(0, 3), eval_chunks=(3,),
                    num_train_samples=4, num_eval_samples=3, batch_size=4, max_steps=2, show_progress=False)
    assert demo["paths"]["base"] is None and not (tmp_path / "base").exists()
    config = json.loads((demo["paths"]["memory"] / "memory_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_qwen3_dir)
    assert config["memory_settings"]["freeze_base"] is True
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).state_dict()
    trained = demo["model"].state_dict()
    for name, tensor in base.items():
        assert torch.equal(trained[name], tensor), name
    assert demo["results"]["details"]["qa1"]["96"]["num_samples"] == 3


def test_goal_report_applies_each_bar_to_its_lengths():
    from titans_hf.demo import goal_report

    def cell(memory, no_memory):
        return {"chance": 1 / 6, "memory": {"exact_match": memory}, "no_memory": {"exact_match": no_memory}}

    results = {"details": {"qa1": {"96": cell(0.1, 0.9), "128": cell(0.9, 0.3), "256": cell(0.8, 0.2),
                                   "512": cell(0.95, 0.4)}}}
    lines = goal_report(results, longest_trained=128, chunk_size=32)
    # 96 tokens is under 4 chunks: not part of the goal
    assert [line.split()[0] for line in lines] == ["128", "256", "512"]
    assert lines[0].endswith(": met") and "goal >= 90%" in lines[0]  # 0.30 is 13.3 points above chance
    assert lines[1].endswith(": met") and "goal >= 80%" in lines[1]
    assert lines[2].endswith("NOT met")  # 0.40 without memory is 23.3 points above chance
