"""The CPU demo in miniature: stage a (pretrain and save a toy Qwen3 base) and stage b (the user's recipe: BABILong
files, the titans-hf train code on the frozen base, the titans-hf eval function on the saved memory), in seconds."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from titans_hf.commands import main as cli_main
from titans_hf.commands.demo_job import DemoSettings, build_demo_tokenizer, domain_documents, run_demo
from titans_hf.files import file_sha256
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import is_memory_name
from titans_hf.outputs import replaceable_folder_problem
from titans_hf.tasks.babilong import ACTORS, LOCATIONS, MOVE_VERBS, OBJECTS, generate_babilong

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_demo_goal  # noqa: E402
import recall_report  # noqa: E402

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
    return run_demo(output, DemoSettings(
        train_chunks=(0, 3),
        eval_chunks=(3, 4),
        pretrain_steps=4,
        num_train_samples=8,
        num_eval_samples=5,
        batch_size=4,
        max_steps=3,
        seed=0,
    ), show_progress=False)


def test_demo_tokenizer_makes_every_task_word_one_token(tmp_path):
    tokenizer = build_demo_tokenizer(tmp_path)
    words = ACTORS + LOCATIONS + OBJECTS + [word for verb in MOVE_VERBS for word in verb.split()] + ["Where", "is"]
    for word in words:
        assert len(tokenizer(" " + word)["input_ids"]) == 1, word
    # the question's actor is 5 tokens before the answer position: within the 6-token convolution
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("\n\nQuestion: Where is Mary? \nAnswer:")["input_ids"])
    assert tokens[-6:] == ["ĠMary", "?", "Ġ", "Ċ", "Answer", ":"]


def test_domain_documents_answer_every_question_from_the_facts_before_it():
    documents = domain_documents("qa1", 50, seed=3)
    fact = re.compile(rf"({'|'.join(ACTORS)}) (?:{'|'.join(MOVE_VERBS)}) the ({'|'.join(LOCATIONS)})\.")
    qa = re.compile(r"Question: Where is (\w+)\? \nAnswer: (\w+)")
    asked = 0
    for document in documents:
        where: dict[str, str] = {}
        for piece in re.split(r"(Question: Where is \w+\? \nAnswer: \w+)", document):
            match = qa.fullmatch(piece)
            if match:
                assert where[match.group(1)] == match.group(2)
                asked += 1
            for actor, location in fact.findall(piece):
                where[actor] = location
    assert asked > 20
    assert documents == domain_documents("qa1", 50, seed=3) != domain_documents("qa1", 50, seed=4)


def test_the_demo_folder_is_recorded_whole_so_a_rerun_may_replace_it(demo):
    output = demo["paths"]["results"].parent
    assert replaceable_folder_problem(output) is None
    assert not (demo["paths"]["memory"] / ".titans_hf_train.lock").exists()


def test_stage_a_saves_a_plain_qwen_folder(demo):
    base = demo["paths"]["base"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {path.name for path in base.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(base)
    assert model.config.model_type == "qwen3" and type(model).__name__ == "Qwen3ForCausalLM"
    assert not any("memory" in name for name in model.state_dict())
    assert len(AutoTokenizer.from_pretrained(base)) == model.config.vocab_size
    info = demo["run_info"]
    assert info["pretraining"]["steps"] == 4
    accuracy = info["base_accuracy"]
    assert accuracy["rows"] > 0 and 0 <= accuracy["exact_match"] <= 1 and accuracy["chance"] == pytest.approx(1 / 6)
    assert accuracy["fits_one_chunk"] and accuracy["max_prompt_tokens"] <= 32


def test_stage_b_trains_only_the_memory_of_the_saved_base(demo):
    trained, paths, info = demo["model"], demo["paths"], demo["run_info"]
    # the base file, bit for bit, is the trained model's backbone
    saved = load_file(str(paths["base"] / "model.safetensors"))
    state = trained.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert info["base_unchanged"] is True
    memory = {name for name, param in trained.named_parameters() if param.requires_grad}
    assert memory and all(is_memory_name(name) for name in memory)
    assert info["trainable_parameters"]["memory"] == sum(p.numel() for p in trained.parameters() if p.requires_grad)
    assert info["memory_settings"]["freeze_base"] is True
    # the training data went through BABILong files
    for path in paths["data"]:
        rows = json.loads(path.read_text())
        assert len(rows) == 8 and set(rows[0]) == {"input", "question", "target"}
    # the titans-hf train code wrote the memory folder (with its training arguments)
    assert (paths["memory"] / "training_args.json").is_file()


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
    predictions = paths["predictions"].read_text().splitlines()
    assert len(predictions) == 2 * 5
    assert {json.loads(line)["length"] for line in predictions} == {"96", "128"}


def test_demo_evaluates_held_out_rows(demo):
    tokenizer = demo["tokenizer"]
    lines = [json.loads(line) for line in demo["paths"]["predictions"].read_text().splitlines()]
    # evaluation rows are the generator's rows for the evaluation seeds (500 for length 96, 501 for 128)
    expected = generate_babilong("qa1", 5, 96, tokenizer, seed=500) + generate_babilong("qa1", 5, 128, tokenizer,
                                                                                         seed=501)
    assert [line["target"] for line in lines] == [row["target"] for row in expected]
    training = json.loads(demo["paths"]["data"][1].read_text())
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
    # 90% of 8 rows per length, the split of the titans_babilong builder
    assert info["num_train_rows"] == 2 * 7
    # one-chunk bare stories first, then up to the longest bare story, then every row: the longest, an input of 3
    # chunks + question + answer
    tokenizer = demo["tokenizer"]
    chunks = {path.name: [-(-len(tokenizer(f"{row['input']}\n\nQuestion: {row['question']}\nAnswer: {row['target']}")
                                 ["input_ids"]) // 32) for row in json.loads(path.read_text())]
              for path in demo["paths"]["data"]}
    assert min(chunks["train_0.json"]) == 1 and max(chunks["train_96.json"]) == 4
    assert info["curriculum_chunks"] == sorted({1, max(chunks["train_0.json"]), 4})
    assert set(info["timings"]) == {"stage_a_s", "stage_b_train_s", "eval_s", "total_s"}


def test_demo_memory_folder_reloads_to_identical_logits(demo):
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
        with reloaded.memory_disabled():
            ablated = reloaded(input_ids=input_ids).logits
        plain = AutoModelForCausalLM.from_pretrained(paths["base"]).eval()
        chunkwise = torch.cat([plain(input_ids[:, s : s + 32]).logits for s in range(0, 70, 32)], dim=1)
    # memory off is the frozen base run chunk by chunk; the trained memory changes the answers
    assert torch.equal(ablated, chunkwise)
    assert not torch.equal(ablated[:, 40:], actual[:, 40:])


def test_demo_main_rejects_bad_lengths(tmp_path):
    with pytest.raises(ValueError, match="eval_chunks"):
        cli_main(["demo", "--output-dir", str(tmp_path), "--eval-chunks", "0"])


def test_demo_with_a_given_model_skips_stage_a(tiny_qwen3_dir, tmp_path):
    demo = run_demo(tmp_path, DemoSettings(base=str(tiny_qwen3_dir), train_chunks=(0, 3), eval_chunks=(3,),
                                           num_train_samples=4, num_eval_samples=3, batch_size=4, max_steps=2),
                    show_progress=False)
    assert demo["paths"]["base"] is None and not (tmp_path / "base").exists()
    assert "stage_a_s" not in demo["run_info"]["timings"]
    config = json.loads((demo["paths"]["memory"] / "memory_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_qwen3_dir)
    assert demo["run_info"]["base_unchanged"] is True
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).state_dict()
    trained = demo["model"].state_dict()
    for name, tensor in base.items():
        assert torch.equal(trained[name], tensor), name
    assert demo["results"]["details"]["qa1"]["96"]["num_samples"] == 3


def goal_cell(memory, no_memory, not_last=None):
    """A results.json cell with what the length goal reads: chance 1/6, accuracy with and without the memory."""
    not_last = memory if not_last is None else not_last
    return {"chance": 1 / 6, "no_memory": {"exact_match": no_memory},
            "memory": {"exact_match": memory, "exact_match_not_last_location": not_last}}


def test_goal_report_applies_each_bar_to_its_lengths():
    results = {"details": {"qa1": {"96": goal_cell(0.1, 0.9), "1024": goal_cell(0.95, 0.25),
                                   "8192": goal_cell(0.949, 0.2), "8224": goal_cell(0.90, 0.1, not_last=0.86),
                                   "32768": goal_cell(0.90, 0.1), "32800": goal_cell(0.80, 0.1),
                                   "131072": goal_cell(0.95, 0.3), "262144": goal_cell(0.9, 0.1, not_last=0.84)}}}
    lines = check_demo_goal.goal_report(results, chunk_size=32)
    # 96 tokens is under 4 chunks: not part of the goal
    assert [line.split()[1] for line in lines] == ["1024", "8192", "8224", "32768", "32800", "131072", "262144"]
    assert lines[0].endswith(": met") and "goal >= 95%" in lines[0]  # 0.25 is 8.3 points above chance
    assert lines[1].endswith("NOT met") and "(256 chunks)" in lines[1]  # up to 256 chunks: 95%
    assert lines[2].endswith(": met") and "goal >= 90%" in lines[2]  # 257 chunks: 90%, not-last 4 points below
    assert lines[3].endswith(": met") and "goal >= 90%" in lines[3]  # 1024 chunks: 90%
    assert lines[4].endswith(": met") and "goal >= 80%" in lines[4]  # 1025 chunks: 80%
    assert lines[5].endswith("NOT met")  # 0.30 without memory is 13.3 points above chance
    assert lines[6].endswith("NOT met")  # where the last place is wrong: 6 points below all rows


def test_the_goal_check_reads_a_demo_folder_or_results_file_and_leaves_it_unchanged(tmp_path, capsys):
    met = {"chunk_size": 32, "details": {"qa1": {"96": goal_cell(0.1, 0.9), "128": goal_cell(1.0, 0.2)}}}
    missed = {"chunk_size": 32, "details": {"qa1": {"128": goal_cell(1.0, 0.2), "8224": goal_cell(0.85, 0.1)}}}
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "results.json").write_text(json.dumps(met))
    (tmp_path / "missed.json").write_text(json.dumps(missed))
    before = {path: file_sha256(path) for path in tmp_path.rglob("*.json")}
    assert check_demo_goal.main([str(tmp_path / "demo")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "qa1    128 tokens (4 chunks): memory 100.0% (goal >= 95%), where the last place is wrong 100.0% (goal within "
        "5 points), no memory 20.0% (goal within 10 points of 16.7%): met"]
    assert check_demo_goal.main([str(tmp_path / "missed.json")]) == 1
    assert [line.rsplit(": ", 1)[1] for line in capsys.readouterr().out.splitlines()] == ["met", "NOT met"]
    assert {path: file_sha256(path) for path in tmp_path.rglob("*.json")} == before


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{", "not a JSON results file"),
    (json.dumps({"chunk_size": None, "details": {}}), "chunk_size None is not a number of tokens"),
    (json.dumps({"chunk_size": 32, "details": {"qa1": {"128": {"chance": 0.2, "memory": {
        "exact_match": 1.0, "exact_match_not_last_location": None}}}}}),
     "details.qa1.128: no no_memory.exact_match (the goal needs the memory-off ablation)"),
    (json.dumps({"chunk_size": 32, "details": {"qa1": {"128": goal_cell(1.5, 0.2)}}}),
     "details.qa1.128: memory.exact_match 1.5 is not an accuracy"),
    (json.dumps({"chunk_size": 32, "details": {"qa1": {"96": goal_cell(1.0, 0.2)}}}),
     "no evaluated length of 4 chunks or more"),
    ("[]", "not a recall summary"),
    (json.dumps([{"recalled_ratio": 0.1}]), "run 0 is not an object with the run's name"),
    (json.dumps([{"run": "m", "recalled_memory": 0.4, "recalled_no_memory": 4.0, "recalled_ratio": 0.1}]),
     "run 'm': first_chunk_change None is not a number"),
])
def test_the_goal_check_refuses_results_it_cannot_check_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        check_demo_goal.main([str(path)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and str(path) in error and message in error


def lm_results(losses: dict[str, list[float]]) -> dict:
    """An lm_results.json of `titans-hf eval --lm` over chunks of 32 tokens, 10 tokens a chunk: `losses` per chunk,
    memory and no_memory; the chunk starts' loss is that of the chunks after the first."""
    results = {"chunk_size": 32, "boundary_tokens": 8}
    for mode, per_chunk in losses.items():
        results[mode] = {"loss": per_chunk, "tokens": [10] * len(per_chunk), "loss_first_chunk": per_chunk[0],
                         "loss_after_first_chunk": sum(per_chunk[1:]) / len(per_chunk[1:]),
                         "loss_chunk_starts": sum(per_chunk[1:]) / len(per_chunk[1:])}
    on, off = results["memory"], results["no_memory"]
    results["ratio"] = {"first_chunk": on["loss_first_chunk"] / off["loss_first_chunk"],
                        "after_first_chunk": on["loss_after_first_chunk"] / off["loss_after_first_chunk"]}
    return results


def write_recall_run(run: Path, attend_previous_chunk: bool, recalled: dict, every: dict) -> None:
    """A trained memory's folder as scripts/recall.sh leaves it: its config and the two `eval --lm` results."""
    for name, losses in (("lm_recalled_values", recalled), ("lm_all_tokens", every)):
        (run / name).mkdir(parents=True)
        (run / name / "lm_results.json").write_text(json.dumps(lm_results(losses)))
    (run / "memory_config.json").write_text(json.dumps({"attend_previous_chunk": attend_previous_chunk}))


def test_the_recall_report_prints_losses_only_and_the_goal_check_reads_its_summary(tmp_path, capsys):
    # recalled values: 2.0 / 4.0 = 0.5 and 0.4 / 4.0 = 0.1; first chunk: 1.3 / 1.25 = +4 % and 1.2 / 1.25 = -4 %
    write_recall_run(tmp_path / "local", False, {"memory": [2.0, 2.0], "no_memory": [4.0, 4.0]},
                     {"memory": [1.3, 1.0], "no_memory": [1.25, 1.5]})
    write_recall_run(tmp_path / "memory", True, {"memory": [0.4, 0.4], "no_memory": [4.0, 4.0]},
                     {"memory": [1.2, 0.9], "no_memory": [1.25, 1.5]})
    assert recall_report.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "goal" not in printed.lower() and "met" not in printed.split()  # thresholds are the project's checks
    table = printed.splitlines()
    assert table[1].split()[:2] == ["local", "chunk-local"] and "+4.00%" in table[1].split()
    summary = json.loads((tmp_path / "recall_summary.json").read_text())
    assert [row["run"] for row in summary] == ["local", "memory"]
    assert not [key for row in summary for key in row if "goal" in key]
    before = {path: file_sha256(path) for path in tmp_path.rglob("*.json")}

    assert check_demo_goal.main([str(tmp_path)]) == 1  # the folder: its recall_summary.json
    assert capsys.readouterr().out.splitlines() == [
        "local: recalled values 2.000 with memory, 4.000 off, ratio 0.500 (goal <= 0.6); first chunk +4.00% against "
        "memory off (goal <= +2%): NOT met",
        "memory: recalled values 0.400 with memory, 4.000 off, ratio 0.100 (goal <= 0.6); first chunk -4.00% against "
        "memory off (goal <= +2%): met"]
    assert check_demo_goal.main([str(tmp_path / "recall_summary.json")]) == 1
    assert capsys.readouterr().out.splitlines()[1].endswith(": met")
    assert {path: file_sha256(path) for path in tmp_path.rglob("*.json")} == before


def test_recall_goal_report_needs_both_the_ratio_and_the_first_chunk():
    def row(ratio, change):
        return {"run": "m", "recalled_memory": ratio, "recalled_no_memory": 1.0, "recalled_ratio": ratio,
                "first_chunk_change": change}

    lines = check_demo_goal.recall_goal_report([row(0.59, 0.019), row(0.61, 0.0), row(0.1, 0.021), row(0.5, -0.3)])
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["met", "NOT met", "NOT met", "met"]


def test_the_demo_command_prints_accuracy_with_and_without_memory_and_no_goal(tiny_qwen3_dir, tmp_path, capsys):
    assert cli_main(["demo", "--model", str(tiny_qwen3_dir), "--output-dir", str(tmp_path), "--train-chunks", "0",
                     "3", "--eval-chunks", "4", "--num-train-samples", "4", "--num-eval-samples", "3",
                     "--batch-size", "4", "--max-steps", "1"]) == 0
    printed = capsys.readouterr().out
    accuracy = json.loads((tmp_path / "results.json").read_text())["accuracy"]["qa1"]["128"]
    lines = printed.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("task ") and "last-loc" in line)
    row = lines[header + 1].split()
    assert row[:5] == ["qa1", "128", "3", f"{100 * accuracy['memory']:.1f}", f"{100 * accuracy['no_memory']:.1f}"]
    assert "goal" not in printed.lower() and "met" not in printed.split()  # thresholds are the project's checks


def test_embedding_similarity_measures_whether_names_share_one_vector(tmp_path):
    from titans_hf.commands.demo_job import embedding_similarity
    from titans_hf.testing_utils import build_qwen

    tokenizer = build_demo_tokenizer(tmp_path)
    model = build_qwen(tmp_path, vocab_size=len(tokenizer))
    ids = {word: tokenizer(" " + word, add_special_tokens=False)["input_ids"][0] for word in ACTORS + LOCATIONS}
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        for word in ACTORS:  # one vector (at several scales) for every actor
            weight[ids[word]] = torch.full((weight.shape[1],), 0.1 * (1 + ACTORS.index(word)))
        for index, word in enumerate(LOCATIONS):  # orthogonal vectors for the places
            weight[ids[word]] = torch.nn.functional.one_hot(torch.tensor(index), weight.shape[1]).float()
    assert embedding_similarity(model, tokenizer) == {"actors": pytest.approx(1.0), "locations": 0.0}


def test_demo_runs_qa3_whose_stories_never_fit_one_chunk(tmp_path):
    demo = run_demo(tmp_path, DemoSettings(task="qa3", train_chunks=(0, 4), eval_chunks=(4,), pretrain_steps=2,
                                           num_train_samples=6, num_eval_samples=3, batch_size=3, max_steps=2),
                    show_progress=False)
    accuracy = demo["run_info"]["base_accuracy"]
    # every bare qa3 story is longer than a chunk: the base is scored on bare stories of any length instead
    assert not accuracy["fits_one_chunk"] and accuracy["max_prompt_tokens"] > 32
    assert demo["run_info"]["curriculum_chunks"][0] >= 2
    assert list(demo["results"]["accuracy"]) == ["qa3"] and demo["run_info"]["base_unchanged"] is True


def test_the_toy_bases_tokenizer_is_saved_plain_and_its_base_reads_4096_token_rows(demo, tmp_path):
    """The toy base pretrains on rows cut to 160 tokens: its saved tokenizer must not keep that cut, and eval, the
    builder and train on the CPU demo's own base work at 4096 tokens, also from a folder whose tokenizer.json still
    carries a truncation (as toy bases saved by earlier versions do)."""
    from datasets import load_dataset

    base = demo["paths"]["base"]
    saved = json.loads((base / "tokenizer.json").read_text())
    assert saved["truncation"] is None and saved["padding"] is None
    old_base = tmp_path / "old_base"
    old_base.mkdir()
    for file in base.iterdir():
        (old_base / file.name).write_bytes(file.read_bytes())
    (old_base / "tokenizer.json").write_text(json.dumps(dict(saved, truncation={
        "direction": "Right", "max_length": 159, "strategy": "LongestFirst", "stride": 0})))
    assert AutoTokenizer.from_pretrained(old_base).backend_tokenizer.truncation["max_length"] == 159

    for folder in (base, old_base):
        rows = load_dataset("titans_babilong", task="qa1", length=4000, num_samples=3, seed=4, tokenizer=str(folder),
                            max_length=4096, answer_reserve_tokens=8, train_ratio=None, split="train")
        assert all(3900 < length <= 4088 for length in rows["prompt_length"])
        assert all(len(ids) == 4096 for ids in rows["input_ids"])
    memory = demo["paths"]["memory"]
    output = tmp_path / "eval"
    assert cli_main(["eval", "--model", str(memory), "--tokenizer", str(old_base), "--generate", "--tasks", "qa1",
                     "--lengths", "4096", "--num-samples", "2", "--batch-size", "2", "--max-new-tokens", "2",
                     "--no-ablation", "--output", str(output)]) == 0
    details = json.loads((output / "results.json").read_text())["details"]["qa1"]["4096"]
    assert details["num_samples"] == 2 and details["prompt_tokens"]["min"] > 3900
    assert cli_main(["train", "--model_name_or_path", str(old_base), "--chunk_size", "32", "--memory_chunk_size", "8",
                     "--memory_head_dim", "16", "--generate_lengths", "4000", "--num_samples", "4",
                     "--max_length", "4096", "--answer_reserve_tokens", "8", "--max_steps", "1",
                     "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "train"),
                     "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]) == 0
