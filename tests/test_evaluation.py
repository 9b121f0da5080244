"""BABILong evaluation: scoring with known answers, the recency baseline, the ablation switch, written outputs."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from titans_hf.commands import main as cli_main
from titans_hf.hub import render_memory_card
from titans_hf.modeling.modeling_titans_qwen import TitansQwenForCausalLM
from titans_hf.tasks.babilong import TASK_LABELS, generate_babilong, supporting_fact_spans, write_babilong_json
from titans_hf.tasks.babilong.evaluation import (
    babilong_files_by_task_length,
    distance_bucket,
    evaluate_babilong,
    last_location_baseline,
    last_mentioned_label,
    prompt_ids,
    score_predictions,
)

LOCATIONS = TASK_LABELS["qa1"]
MEMORY_SETTINGS = dict(chunk_size=64, memory_head_dim=16, memory_chunk_size=8)


pytestmark = pytest.mark.usefixtures("one_thread")


def _story(*facts: str) -> str:
    return " ".join(facts)


def _row(input_text: str, question: str, target: str) -> dict[str, str]:
    return {"input": input_text, "question": question, "target": target}


# ----------------------------------------------------------------------------------------------
# Scoring on hand-made outputs


def test_last_mentioned_label_takes_the_last_whole_word():
    text = "Mary went to the kitchen. The officer smiled. John journeyed to the Garden. The bathrooms were closed."
    # "officer" and "bathrooms" are not the labels office / bathroom; case is ignored
    assert last_mentioned_label(text, LOCATIONS) == "garden"
    assert last_mentioned_label("Nobody moved at all.", LOCATIONS) is None


def test_last_location_baseline_on_hand_made_stories():
    rows = [
        # Mary moved last: the recency guess (garden) is right
        _row(_story("John went to the office.", "Mary moved to the garden."), "Where is Mary? ", "garden"),
        # John is asked about but Mary moved after him: recency says bedroom, the answer is hallway
        _row(_story("John went to the hallway.", "Mary went to the bedroom."), "Where is John? ", "hallway"),
        # the answer is mentioned last even though it was an earlier fact about someone else... and then repeated
        _row(_story("Sandra went to the kitchen.", "Daniel went to the bathroom.", "Daniel went back to the kitchen."),
             "Where is Daniel? ", "kitchen"),
        _row(_story("Daniel went to the office.", "Sandra travelled to the bathroom."), "Where is Daniel? ", "office"),
    ]
    baseline = last_location_baseline(rows, LOCATIONS)
    assert baseline == {"accuracy": 0.5, "num_not_last_location": 2}


def test_score_predictions_on_hand_made_outputs():
    rows = [
        _row("John went to the office. Mary moved to the garden.", "Where is Mary? ", "garden"),
        _row("John went to the hallway. Mary went to the bedroom.", "Where is John? ", "hallway"),
        _row("Sandra went to the kitchen. Daniel went to the bathroom.", "Where is Sandra? ", "kitchen"),
        _row("Daniel went to the office. Sandra travelled to the bathroom.", "Where is Daniel? ", "office"),
    ]
    predictions = [
        " Garden.\nQuestion",          # first word right (case, punctuation ignored); only label named
        " the hallway",                 # first word wrong; the only label named is right
        " kitchen or bathroom",         # first word right; two labels named -> substring wrong
        " bathroom",                    # wrong on both
    ]
    scores = score_predictions(rows, predictions, LOCATIONS)
    assert scores["exact_match"] == 0.5
    assert scores["label_substring"] == 0.5
    # rows 2, 3 and 4 have an answer other than the last location named; of those only row 3 is an exact match
    assert scores["exact_match_not_last_location"] == pytest.approx(1 / 3)
    # every answer is the last location named: the subset is empty, which is not a zero
    only_recent = score_predictions(rows[:1], [" garden"], LOCATIONS)
    assert only_recent["exact_match_not_last_location"] is None
    with pytest.raises(ValueError, match="2 rows but 1 predictions"):
        score_predictions(rows[:2], [" garden"], LOCATIONS)


def test_babilong_files_are_keyed_by_folder_and_stem(tmp_path):
    row = _row("Mary went to the kitchen.", "Where is Mary? ", "kitchen")
    first = write_babilong_json([row], tmp_path / "qa1" / "32k.json")
    second = write_babilong_json([row], tmp_path / "qa2" / "0k.json")
    assert babilong_files_by_task_length([first, second]) == {("qa1", "32k"): (first,), ("qa2", "0k"): (second,)}
    stray = write_babilong_json([row], tmp_path / "stories" / "32k.json")
    with pytest.raises(ValueError, match=r"stories/32k\.json: its path does not say its task"):
        babilong_files_by_task_length([stray])
    # a single --tasks names it; a filter keeps only what it names
    assert babilong_files_by_task_length([stray], tasks=["qa4"]) == {("qa4", "32k"): (stray,)}
    assert babilong_files_by_task_length([first, second], tasks=["qa2"]) == {("qa2", "0k"): (second,)}
    with pytest.raises(FileNotFoundError, match="missing.json"):
        babilong_files_by_task_length([tmp_path / "qa1" / "missing.json"])
    duplicate = write_babilong_json([row], tmp_path / "again" / "qa1" / "32k.json")
    with pytest.raises(ValueError, match="are both task qa1 length 32k"):
        babilong_files_by_task_length([first, duplicate])


# ----------------------------------------------------------------------------------------------
# The ablation switch


def _memory_model(base_dir, seed: int = 0, **settings) -> TitansQwenForCausalLM:
    """A TitansQwen whose memory path contributes: W_O set non-zero (it starts at zero, which adds nothing). Seeded
    whole (the memory's initial weights too), so that its answers do not depend on the tests run before it."""
    torch.manual_seed(seed)
    model = TitansQwenForCausalLM.from_base(base_dir, **{**MEMORY_SETTINGS, **settings}).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.copy_(torch.randn(block.output_weight.shape, generator=generator))
    return model


@pytest.mark.parametrize(
    "settings",
    [dict(variant="mag"), dict(variant="mal"), dict(variant="mac", num_memory_tokens=2, num_persistent_tokens=3)],
    ids=["mag", "mal", "mac"],
)
def test_memory_disabled_gives_exactly_the_base_models_logits(tiny_qwen3_dir, settings):
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    model = _memory_model(tiny_qwen3_dir, **settings, attend_previous_chunk=False)
    chunk = MEMORY_SETTINGS["chunk_size"]
    input_ids = torch.randint(0, base.config.vocab_size, (2, 2 * chunk), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_memory = model(input_ids).logits
        with model.memory_disabled():
            without_memory = model(input_ids).logits
        after = model(input_ids).logits
        # attention is chunk-local, positions restart per chunk: the base model run on each chunk on its own
        base_per_chunk = torch.cat([base(input_ids[:, :chunk]).logits, base(input_ids[:, chunk:]).logits], dim=1)
    assert torch.equal(without_memory, base_per_chunk)
    # the memory path is live: every chunk differs, the first one too (it reads the initial fast weights; mac's
    # prefix of persistent and memory tokens changes it as well)
    assert not torch.allclose(with_memory[:, :chunk], base_per_chunk[:, :chunk], atol=1e-3)
    assert not torch.allclose(with_memory[:, chunk:], base_per_chunk[:, chunk:], atol=1e-3)
    # the switch is a context: leaving it restores the memory
    assert torch.equal(after, with_memory)


def test_evaluation_without_memory_answers_as_the_base_model(tiny_qwen3_dir, tmp_path):
    """The no-memory answers are the base Qwen's greedy answers (its own generate and cache), row by row; the
    prompts fit one chunk, so the base sees exactly what the chunked model sees."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    model = _memory_model(tiny_qwen3_dir, chunk_size=128)
    rows = generate_babilong("qa1", 4, 0, tokenizer, seed=5)  # length 0: the bare story
    results = evaluate_babilong(model, tokenizer, {("qa1", 0): rows}, max_new_tokens=3, output_dir=tmp_path,
                                show_progress=False)
    assert results["details"]["qa1"]["0"]["prompt_tokens"]["max"] + 3 <= 128
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    greedy = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    for line, row in zip(lines, rows):
        ids = torch.tensor([prompt_ids(row, tokenizer)])
        assert tokenizer.decode(ids[0]).endswith(f"Question: {row['question']}\nAnswer:")
        out = base.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
        assert line["no_memory"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert line["target"] == row["target"]
        assert line["last_location"] == last_mentioned_label(row["input"], LOCATIONS)
    assert any(line["memory"] != line["no_memory"] for line in lines)


# ----------------------------------------------------------------------------------------------
# Written outputs on a tiny untrained model


def test_results_json_heatmap_and_predictions_are_written(tiny_qwen3_dir, tmp_path):
    import matplotlib.image

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **MEMORY_SETTINGS)
    model.train()  # evaluation switches to eval mode and hands the model back as it found it
    data = {
        ("qa1", 96): generate_babilong("qa1", 5, 96, tokenizer, seed=1),
        ("qa1", 192): generate_babilong("qa1", 4, 192, tokenizer, seed=1),
        ("qa2", 192): generate_babilong("qa2", 3, 192, tokenizer, seed=1),  # no qa2 at 96: an empty cell
    }
    results = evaluate_babilong(model, tokenizer, data, max_new_tokens=3, batch_size=2, output_dir=tmp_path,
                                show_progress=False)
    assert model.training

    written = json.loads((tmp_path / "results.json").read_text())
    assert written == results
    assert list(written["accuracy"]) == ["qa1", "qa2"] and list(written["accuracy"]["qa1"]) == ["96", "192"]
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == 5 + 4 + 3
    for (task, length), rows in data.items():
        cell = written["details"][task][str(length)]
        answers = [line for line in lines if line["task"] == task and line["length"] == str(length)]
        assert cell["num_samples"] == len(rows) == len(answers)
        # W_O is zero in an untrained model: the memory adds nothing, so both passes answer alike
        assert [a["memory"] for a in answers] == [a["no_memory"] for a in answers]
        for mode in ("memory", "no_memory"):
            expected = score_predictions(rows, [a[mode] for a in answers], TASK_LABELS[task])
            assert cell[mode] == expected
            assert written["accuracy"][task][str(length)][mode] == expected["exact_match"]
        assert cell["last_location_baseline"] == last_location_baseline(rows, TASK_LABELS[task])["accuracy"]
        assert cell["chance"] == pytest.approx(1 / 6)
        assert cell["prompt_tokens"]["max"] > length  # prompt = input + question: longer than the input
    # the model card renders this results dict as its table
    memory_config = dataclasses.replace(model.config.memory_config, base_model_name_or_path="someone/qwen3-base")
    card = render_memory_card(memory_config, written)
    assert "qa2" in card and "192" in card

    image = matplotlib.image.imread(tmp_path / "heatmap.png")
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 100
    assert sorted(os.listdir(tmp_path)) == [".titans_hf_outputs.json", "accuracy_by_distance.png", "heatmap.png",
                                            "predictions.jsonl", "results.json"]  # no temp files left


def test_supporting_facts_are_found_by_replaying_the_story():
    qa1 = _row("Mary went to the kitchen. John moved to the garden. Mary travelled to the office. The end.",
               "Where is Mary? ", "office")
    assert [qa1["input"][a:b] for a, b in supporting_fact_spans(qa1, "qa1")] == ["Mary travelled to the office."]
    assert supporting_fact_spans(_row("John moved to the garden.", "Where is Mary? ", "office"), "qa1") is None
    qa2 = _row("Mary went to the kitchen. Mary took the apple there. John went to the hallway. Mary journeyed to the "
               "office. Mary dropped the apple there. Mary went to the garden. John got the milk there.",
               "Where is the apple? ", "office")
    assert [qa2["input"][a:b] for a, b in supporting_fact_spans(qa2, "qa2")] == [
        "Mary took the apple there.", "Mary journeyed to the office.", "Mary dropped the apple there."]
    held = _row("John went to the hallway. John got the milk there. John moved to the bedroom.",
                "Where is the milk? ", "bedroom")
    assert [held["input"][a:b] for a, b in supporting_fact_spans(held, "qa2")] == [
        "John got the milk there.", "John moved to the bedroom."]
    assert supporting_fact_spans(qa2, "qa3") is None and supporting_fact_spans(qa1, "qa2") is None


def test_distance_bins():
    assert [distance_bucket(d) for d in (0, 1, 2, 3, 4, 7, 8, 255, 256)] == [
        "0", "1", "2-3", "2-3", "4-7", "4-7", "8-15", "128-255", "256-511"]


def test_accuracy_by_distance_counts_chunks_from_the_supporting_fact(tiny_qwen3_dir, tmp_path):
    from conftest import PROSE

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = _memory_model(tiny_qwen3_dir, seed=2)
    chunk = MEMORY_SETTINGS["chunk_size"]
    filler = " ".join(PROSE * 2)
    rows = [_row(f"Mary went to the kitchen. {filler} {filler}", "Where is Mary? ", "kitchen"),
            _row(f"{filler} Mary went to the kitchen. {filler}", "Where is Mary? ", "kitchen"),
            _row(f"{filler} {filler} Mary went to the garden.", "Where is Mary? ", "garden"),
            _row(f"{filler} Sandra moved to the office. {filler}", "Where is Sandra? ", "office")]
    results = evaluate_babilong(model, tokenizer, {("qa1", 512): rows}, max_new_tokens=2, batch_size=2,
                                output_dir=tmp_path, show_progress=False)
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    expected_distances = []
    for row, line in zip(rows, lines):
        start = row["input"].index(row["question"].split()[2].rstrip("?"))  # the actor of the fact: its first token
        before = len(tokenizer(row["input"][: start - 1])["input_ids"]) if start else 0  # " Mary" holds the space
        prompt = prompt_ids(row, tokenizer)
        assert (line["fact_chunk"], line["question_chunk"]) == (before // chunk, (len(prompt) - 1) // chunk)
        assert line["distance_chunks"] == line["question_chunk"] - line["fact_chunk"]
        expected_distances.append(line["distance_chunks"])
    assert expected_distances[0] > expected_distances[1] > expected_distances[2] and expected_distances[2] <= 1
    cell = results["details"]["qa1"]["512"]
    assert cell["distance_chunks"]["max"] == expected_distances[0] and cell["distance_chunks"]["num_samples"] == 4
    for label, entry in cell["by_distance"].items():
        members = [line for line, d in zip(lines, expected_distances) if distance_bucket(d) == label]
        assert entry["num_samples"] == len(members)
        for mode in ("memory", "no_memory"):
            assert entry[mode] == sum(line[mode].strip().split()[:1] == [line["target"]] for line in members) / len(members)
    assert list(cell["by_distance"]) == sorted(cell["by_distance"], key=lambda label: int(label.split("-")[0]))
    assert (tmp_path / "accuracy_by_distance.png").read_bytes()[:4] == b"\x89PNG"


def test_batched_answers_equal_one_row_at_a_time(tiny_qwen3_dir, tmp_path):
    from collections import Counter

    from conftest import PROSE

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = _memory_model(tiny_qwen3_dir, seed=2)
    # same template, other names (one token each): prompts of equal length, over two chunks, batched together
    rows = [
        _row(f"{PROSE[0]} {actor} went to the {first}. {PROSE[1]} {PROSE[2]} John moved to the {second}. {PROSE[3]}",
             f"Where is {actor}? ", first)
        for actor, first, second in [("Mary", "kitchen", "garden"), ("Sandra", "office", "hallway"),
                                     ("Daniel", "bedroom", "bathroom"), ("Mary", "garden", "office"),
                                     ("Sandra", "hallway", "kitchen")]
    ] + generate_babilong("qa1", 3, 72, tokenizer, seed=4)  # and some of other lengths
    lengths = Counter(len(prompt_ids(row, tokenizer)) for row in rows)
    assert max(lengths.values()) == 5 and max(lengths) > MEMORY_SETTINGS["chunk_size"]
    data = {("qa1", 72): rows}
    one = evaluate_babilong(model, tokenizer, data, max_new_tokens=3, batch_size=1, output_dir=tmp_path / "one",
                            show_progress=False)
    many = evaluate_babilong(model, tokenizer, data, max_new_tokens=3, batch_size=4, output_dir=tmp_path / "many",
                             show_progress=False)
    assert one == many
    answers = (tmp_path / "one" / "predictions.jsonl").read_text()
    assert answers == (tmp_path / "many" / "predictions.jsonl").read_text()
    assert len(set(json.loads(line)["memory"] for line in answers.splitlines())) > 1  # not one constant answer


def test_bad_inputs_are_refused(tiny_qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    row = _row("Mary went to the kitchen.", "Where is Mary? ", "kitchen")
    with pytest.raises(ValueError, match="memory_disabled"):
        evaluate_babilong(base, tokenizer, {("qa1", 8): [row]}, show_progress=False)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **MEMORY_SETTINGS)
    with pytest.raises(ValueError, match="row 0 lacks \\['target'\\]"):
        evaluate_babilong(model, tokenizer, {("qa1", 8): [{"input": "x", "question": "y"}]}, show_progress=False)
    with pytest.raises(ValueError, match="batch_size=0"):
        evaluate_babilong(model, tokenizer, {("qa1", 8): [row]}, batch_size=0, show_progress=False)
    # the plain model is fine without the ablation: one column
    results = evaluate_babilong(base, tokenizer, {("qa1", 8): [row]}, max_new_tokens=2, ablation=False,
                                show_progress=False)
    assert list(results["accuracy"]["qa1"]["8"]) == ["memory"]


# ----------------------------------------------------------------------------------------------
# titans-hf eval


def test_eval_command_on_generated_rows_and_on_files(tiny_qwen3_dir, tmp_path, capsys):
    model = _memory_model(tiny_qwen3_dir)
    memory_dir = model.save_memory(tmp_path / "memory")

    # a save_memory folder alone: its config names the base
    out = tmp_path / "generated"
    assert cli_main(["eval", "--model", str(memory_dir), "--generate", "--tasks", "qa1", "--lengths", "72", "96",
                     "--num-samples", "2", "--max-new-tokens", "2", "--output", str(out)]) == 0
    generated = json.loads((out / "results.json").read_text())
    assert list(generated["accuracy"]["qa1"]) == ["72", "96"]
    assert (out / "heatmap.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out

    # base + --memory on a BABILong file laid out as TASK/LENGTH.json
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    data_file = write_babilong_json(generate_babilong("qa1", 2, 72, tokenizer, seed=1), tmp_path / "qa1" / "72.json")
    before = data_file.read_bytes()
    out = tmp_path / "files"
    assert cli_main(["eval", "--model", str(tiny_qwen3_dir), "--memory", str(memory_dir), "--data", str(data_file),
                     "--max-new-tokens", "2", "--output", str(out)]) == 0
    from_file = json.loads((out / "results.json").read_text())
    # the same seed, task and length: the same rows, the same memory, the same answers
    assert from_file["accuracy"]["qa1"]["72"] == generated["accuracy"]["qa1"]["72"]
    file_answers = (out / "predictions.jsonl").read_text().splitlines()
    assert file_answers == (tmp_path / "generated" / "predictions.jsonl").read_text().splitlines()[:2]
    assert data_file.read_bytes() == before

    # a full save_pretrained folder of the TitansQwen, with the tokenizer named apart
    model.save_pretrained(tmp_path / "full")
    out = tmp_path / "full_model"
    assert cli_main(["eval", "--model", str(tmp_path / "full"), "--tokenizer", str(tiny_qwen3_dir), "--data",
                     str(data_file), "--max-new-tokens", "2", "--output", str(out)]) == 0
    assert (out / "predictions.jsonl").read_text().splitlines() == file_answers

    with pytest.raises(ValueError, match="without a memory"):
        cli_main(["eval", "--model", str(tiny_qwen3_dir), "--generate", "--lengths", "72", "--output", str(out),
                  "--overwrite"])
    with pytest.raises(ValueError, match="needs --lengths"):
        cli_main(["eval", "--model", str(memory_dir), "--generate", "--output", str(out)])


def test_mixed_length_batches_answer_as_each_row_alone(tiny_qwen3_dir, tmp_path):
    """Rows of different lengths share a batch, left-padded by whole multiples of the model's padding_multiple,
    and every answer is the answer of the row alone; the memory matters (W_O perturbed off zero) and the prompts
    span several chunks, so a misplaced chunk boundary would show."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = _memory_model(tiny_qwen3_dir, seed=3, chunk_size=8, memory_chunk_size=4)
    assert model.padding_multiple == 8
    rows = generate_babilong("qa1", 16, 0, tokenizer, seed=8)  # bare stories: 2 to 10 facts, prompts of many lengths
    lengths = [len(prompt_ids(row, tokenizer)) for row in rows]
    assert min(lengths) > 2 * 8 and len(set(lengths)) > 6
    calls = []
    generate = model.generate

    def recording_generate(*args, **kwargs):
        calls.append(kwargs["attention_mask"].clone())
        return generate(*args, **kwargs)

    model.generate = recording_generate
    data = {("qa1", "0k"): rows}
    one = evaluate_babilong(model, tokenizer, data, max_new_tokens=3, batch_size=1, ablation=False,
                            output_dir=tmp_path / "one", show_progress=False)
    assert len(calls) == len(rows) and all(bool(mask.all()) for mask in calls)
    calls.clear()
    many = evaluate_babilong(model, tokenizer, data, max_new_tokens=3, batch_size=4, ablation=False,
                             output_dir=tmp_path / "many", show_progress=False)
    assert (tmp_path / "one" / "predictions.jsonl").read_text() == (tmp_path / "many" / "predictions.jsonl").read_text()
    assert one == many
    padded = [mask for mask in calls if not bool(mask.all())]
    assert padded, "no batch mixed prompt lengths"
    for mask in calls:
        padding = (mask == 0).sum(dim=1)
        assert all(int(count) % 8 == 0 for count in padding)  # whole multiples of padding_multiple
        assert bool((mask.cumsum(dim=1) > 0).eq(mask.bool()).all())  # padding on the left only
    assert len(calls) < len(set(lengths))  # fewer generate calls than batches of equal length would need
    answers = [json.loads(line)["memory"] for line in (tmp_path / "one" / "predictions.jsonl").read_text().splitlines()]
    assert len(set(answers)) > 1

    # equal-length batching on request, and for a model without padding_multiple
    calls.clear()
    exact = evaluate_babilong(model, tokenizer, data, max_new_tokens=3, batch_size=4, ablation=False,
                              show_progress=False, mixed_length_batches=False)
    assert exact == one and all(bool(mask.all()) for mask in calls)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="mixed_length_batches=True needs a model with padding_multiple"):
        evaluate_babilong(base, tokenizer, data, ablation=False, show_progress=False, mixed_length_batches=True)
