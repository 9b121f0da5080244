"""The needle task: the published passkey prompt word for word, where its key lies, the examples' labels, exact match
of a key, the memory-swap pairing, the registry, and `titans-hf eval --tasks passkey` end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import load_dataset
from transformers import AutoTokenizer

from titans_hf.commands import main as cli_main
from titans_hf.data import task_builders
from titans_hf.modeling.modeling_titans_qwen import TitansQwenForCausalLM
from titans_hf.tasks import TASKS, task, task_builder_names, task_for_builder, task_for_eval
from titans_hf.tasks.babilong import generate as babilong_generate
from titans_hf.tasks.babilong.evaluation import prompt_ids
from titans_hf.tasks.evaluation import answer_batches, generate_answers, greedy_generation_config
from titans_hf.tasks.needle import PROMPT_TEMPLATE, generate_needle, needle_token, score_key
from titans_hf.tasks.needle.evaluation import _decode, _prefill, memory_and_swapped_answers, swap_partners

pytestmark = pytest.mark.usefixtures("one_thread")

BOATS = " ".join(f"The {word} boats sailed home." for word in
                 ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"))


@pytest.fixture
def haystack(tmp_path, monkeypatch):
    """Ten sentences, to follow the rows by eye; the minimum a real haystack needs is pinned in
    test_hostile_round5_haystacks.py."""
    monkeypatch.setattr(babilong_generate, "MIN_HAYSTACK_SENTENCES", 1)
    folder = tmp_path / "haystack"
    folder.mkdir()
    (folder / "story.txt").write_text(BOATS)
    return [str(folder)]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_a_passkey_row_is_the_published_prompt_word_for_word(tokenizer, haystack):
    rows = generate_needle("passkey", 3, 200, tokenizer, seed=0, haystack_files=haystack)
    assert PROMPT_TEMPLATE.format(**rows[0]) == (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz "
        "you about the important information there.\n\nThe pass key is 96110. Remember it. 96110 is the pass key.\n"
        "The three boats sailed home. The four boats sailed home. The five boats sailed home.\n"
        "What is the pass key? The pass key is")
    assert rows[2]["input"].endswith("The ten boats sailed home.\nThe pass key is 71782. Remember it. 71782 is the "
                                     "pass key.\n")  # another seeded depth: after the haystack
    assert [row["target"] for row in rows] == ["96110", "61231", "71782"]
    assert rows == generate_needle("passkey", 3, 200, tokenizer, seed=0, haystack_files=haystack)  # seeded
    for row in rows:
        assert len(tokenizer(row["input"], add_special_tokens=False).input_ids) <= 200


def test_a_multikey_row_holds_four_to_eight_keys_and_asks_one(tokenizer, haystack):
    row = generate_needle("mk", 1, 260, tokenizer, seed=0, haystack_files=haystack)[0]
    assert row["question"] == ("What is the special magic number for Brisco mentioned in the provided text? The "
                               "special magic number for Brisco mentioned in the provided text is")
    assert "One of the special magic numbers for Brisco is: 86132." in row["input"] and row["target"] == "86132"
    assert 4 <= row["input"].count("One of the special magic numbers for") <= 8
    with pytest.raises(ValueError, match="shorter than a mk row without any haystack"):
        generate_needle("mk", 1, 40, tokenizer)


def test_the_needle_position_and_the_labels(tokenizer, haystack, tiny_tokenizer_dir, tmp_path):
    row = generate_needle("passkey", 1, 200, tokenizer, seed=0, haystack_files=haystack)[0]
    place = needle_token(row, tokenizer)
    ids = prompt_ids(row, tokenizer, PROMPT_TEMPLATE)
    assert (place.needle, place.question, place.prompt_tokens) == (99, 186, len(ids))
    assert tokenizer.decode(ids[place.needle:place.needle + 5]).startswith("961")
    assert tokenizer.decode(ids[place.question:]) == "\nWhat is the pass key? The pass key is"
    # another harness's row (no needle_char) is found at the same place
    harness = {key: row[key] for key in ("input", "question", "target")}
    assert needle_token(harness, tokenizer) == place

    rows = load_dataset("titans_needle", task="passkey", length=200, num_samples=4, seed=0, haystack_files=haystack,
                        tokenizer=str(tiny_tokenizer_dir), max_length=224, answer_reserve_tokens=8, train_ratio=None,
                        cache_dir=str(tmp_path / "cache"))["train"]
    first = rows[0]
    assert first["input_ids"][: first["prompt_length"]] == ids and first["needle_position"] == 99
    labelled = [index for index, label in enumerate(first["labels"]) if label != -100]
    assert labelled == list(range(len(ids), len(ids) + len(labelled)))
    assert tokenizer.decode([first["labels"][i] for i in labelled]) == " 96110."  # the key and the period ending it
    # cut to fit: the haystack before the question goes first, and the key with it when it lay there
    short = load_dataset("titans_needle", task="passkey", length=200, num_samples=4, seed=0, haystack_files=haystack,
                         tokenizer=str(tiny_tokenizer_dir), max_length=180, answer_reserve_tokens=8, train_ratio=None,
                         cache_dir=str(tmp_path / "cache"))["train"]
    assert short[0]["needle_position"] == 99 - (len(ids) - short[0]["prompt_length"])
    assert short[2]["needle_position"] == -1 or short[2]["needle_position"] >= 0


def test_exact_match_of_a_key():
    assert score_key(" 68231", "68231") and score_key("68231.", "68231") and score_key(" 68231 is the pass key", "68231")
    assert not score_key(" 6823", "68231") and not score_key("682310", "68231") and not score_key(" 68213", "68231")
    assert not score_key("the pass key", "68231")


def test_the_swap_reads_each_row_with_another_rows_memory():
    assert swap_partners(4) == [3, 0, 1, 2]
    assert all(partner != row for row, partner in enumerate(swap_partners(7)))
    with pytest.raises(ValueError, match="at least 2 rows"):
        swap_partners(1)


def test_the_registry_finds_the_needle_task():
    assert TASKS["needle"] == "titans_hf.tasks.needle.task"
    assert task_for_eval("passkey") is task_for_eval("mk") is task("needle")
    assert task_for_builder("titans_needle").name == "needle" and task_for_eval("qa2").name == "babilong"
    assert task_builder_names() == list(task_builders())  # the builders found by place are the tasks' own
    with pytest.raises(ValueError, match="no task scores 'qa9'"):
        task_for_eval("qa9")


def _memory_model(base_dir):
    return TitansQwenForCausalLM.from_base(base_dir, chunk_size=64, memory_head_dim=16, memory_chunk_size=8)


def test_one_stream_a_row_answers_with_its_own_memory_and_with_anothers(tiny_qwen3_dir, tokenizer, haystack):
    model = _memory_model(tiny_qwen3_dir).eval()
    with torch.no_grad():  # a memory that writes and is read enough for another row's to change the answers
        for block in model.model.memory.values():
            block.output_weight.normal_(std=4.0, generator=torch.Generator().manual_seed(0))
            block.neural_memory.to_gates.bias[: block.neural_memory.memory_num_heads] = 4.0
    rows = generate_needle("passkey", 3, 200, tokenizer, seed=0, haystack_files=haystack)
    prompts = [prompt_ids(row, tokenizer, PROMPT_TEMPLATE) for row in rows]
    questions = [needle_token(row, tokenizer).question for row in rows]
    config = greedy_generation_config(model, tokenizer, 4)
    quiet = type("Quiet", (), {"update": lambda self, n: None})()
    with_memory = generate_answers(model, tokenizer, prompts, answer_batches(prompts, 1, None), config, quiet)
    assert memory_and_swapped_answers(model, tokenizer, prompts, questions, [0, 1, 2], 4) == (with_memory,
                                                                                             with_memory)
    # read with the row before's memory: as two separate streams give it (row i's to its question, with the
    # fast weights and momentum of row i - 1's at its own)
    stop = {config.eos_token_id}
    expected = []
    for index, partner in enumerate(swap_partners(3)):
        cache = _prefill(model, prompts[index][: questions[index]])
        other = _prefill(model, prompts[partner][: questions[partner]]).memory_states
        cache.memory_states = {layer: state.with_rows_from(other[layer], torch.ones(1, dtype=torch.bool))
                               for layer, state in cache.memory_states.items()}
        expected.append(_decode(model, tokenizer, cache, prompts[index][questions[index]:], 4, stop))
    own, swapped = memory_and_swapped_answers(model, tokenizer, prompts, questions, swap_partners(3), 4)
    assert own == with_memory and swapped == expected and swapped != with_memory


def test_eval_command_scores_passkey_rows_with_memory_off_and_swapped(tiny_qwen3_dir, tmp_path, haystack, capsys):
    memory_dir = _memory_model(tiny_qwen3_dir).save_memory(tmp_path / "memory")
    out = tmp_path / "passkey"
    assert cli_main(["eval", "--model", str(memory_dir), "--generate", "--tasks", "passkey", "--lengths", "200",
                     "--num-samples", "3", "--seed", "0", "--max-new-tokens", "3", "--haystack", *haystack, "--output",
                     str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["accuracy"]["passkey"]["200"]) == {"memory", "no_memory", "memory_swap"}
    cell = results["details"]["passkey"]["200"]
    assert cell["num_samples"] == 3 and set(cell["beyond_attention"]) == {"num_samples", "memory", "no_memory",
                                                                         "memory_swap"}
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["needle_token"] for p in predictions] == [99, 99, 155]
    # chunks of 64: the prompts' last tokens (210, 210, 213) in chunk 3, the keys in chunks 1, 1, 2
    assert [p["distance_chunks"] for p in predictions] == [2, 2, 1]
    assert [p["distance_tokens"] for p in predictions] == [186 - 99, 186 - 99, 189 - 155]
    printed = capsys.readouterr().out
    assert "memory swap" in printed and "by distance from the key to the question" in printed
    # a harness's rows as a JSON file score as the generated rows do
    rows = [{key: row[key] for key in ("input", "question", "target")}
            for row in generate_needle("passkey", 3, 200, AutoTokenizer.from_pretrained(tiny_qwen3_dir), seed=1,
                                       haystack_files=haystack)]
    data = tmp_path / "passkey" / "200.json"
    data.write_text(json.dumps(rows))
    assert cli_main(["eval", "--model", str(memory_dir), "--data", str(data), "--tasks", "passkey",
                     "--max-new-tokens", "3", "--output", str(tmp_path / "harness")]) == 0
    assert "memory_swap" in json.loads((tmp_path / "harness" / "results.json").read_text())["accuracy"]["passkey"]["200"]
