"""BABILong generator, JSON format, example assembly, split and scoring."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from titans_hf.tasks import babilong
from titans_hf.tasks.babilong import (
    build_example,
    distractor_sentence,
    generate_babilong,
    read_babilong_json,
    score_exact_match,
    score_label_substring,
    train_eval_split,
    write_babilong_json,
)

ACTORS = ["John", "Mary", "Sandra", "Daniel"]
LOCATIONS = ["bathroom", "bedroom", "garden", "hallway", "kitchen", "office"]
OBJECTS = ["football", "apple", "milk"]
TASK_WORDS = [w.lower() for w in ACTORS + LOCATIONS + OBJECTS]

MOVE = re.compile(r"^(John|Mary|Sandra|Daniel) (?:moved to|went to|journeyed to|travelled to|went back to) the (\w+)\.$")
PICK = re.compile(r"^(John|Mary|Sandra|Daniel) (?:picked up|got|grabbed|took) the (\w+) there\.$")
DROP = re.compile(r"^(John|Mary|Sandra|Daniel) (?:dropped|discarded|put down|left) the (\w+) there\.$")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def sentences_of(text: str) -> list[str]:
    return re.split(r"(?<=\.) ", text)


def facts_of(text: str) -> list[str]:
    return [s for s in sentences_of(text) if MOVE.match(s) or PICK.match(s) or DROP.match(s)]


def resimulate(facts: list[str], question: str) -> str:
    """The answer, from the facts alone, by the plain bAbI rules."""
    person_at: dict[str, str] = {}
    carried_by: dict[str, str] = {}
    object_at: dict[str, str] = {}
    places_of: dict[str, list[str]] = {}

    def put(obj: str, place: str) -> None:
        object_at[obj] = place
        if not places_of.setdefault(obj, []) or places_of[obj][-1] != place:
            places_of[obj].append(place)

    for fact in facts:
        if match := MOVE.match(fact):
            person, place = match.groups()
            person_at[person] = place
            for obj, carrier in carried_by.items():
                if carrier == person:
                    put(obj, place)
        elif match := PICK.match(fact):
            person, obj = match.groups()
            carried_by[obj] = person
            put(obj, person_at[person])
        elif match := DROP.match(fact):
            person, obj = match.groups()
            assert carried_by.pop(obj) == person
    if match := re.fullmatch(r"Where is (John|Mary|Sandra|Daniel)\? ", question):
        return person_at[match.group(1)]
    if match := re.fullmatch(r"Where is the (\w+)\? ", question):
        return object_at[match.group(1)]
    match = re.fullmatch(r"Where was the (\w+) before the (\w+)\? ", question)
    places, later = places_of[match.group(1)], match.group(2)
    last_arrival = max(i for i, place in enumerate(places) if place == later and i > 0)
    return places[last_arrival - 1]


@pytest.mark.parametrize("task,min_facts", [("qa1", 2), ("qa2", 2), ("qa3", 3)])
def test_answers_match_a_resimulation_of_the_story(tokenizer, task, min_facts):
    rows = generate_babilong(task, 80, 200, tokenizer, seed=3)
    for row in rows:
        facts = facts_of(row["input"])
        assert min_facts <= len(facts) <= 10
        assert row["target"] in LOCATIONS
        assert resimulate(facts, row["question"]) == row["target"], row
    if task == "qa3":  # the asked place is not always where the object is now
        asked = [re.fullmatch(r"Where was the (\w+) before the (\w+)\? ", r["question"]).groups() for r in rows]
        now = [resimulate(facts_of(r["input"]), f"Where is the {obj}? ") for r, (obj, _) in zip(rows, asked)]
        assert 0 < sum(place != later for place, (_, later) in zip(now, asked)) < len(rows)


def test_haystack_never_names_a_task_word_and_facts_are_scattered(tokenizer):
    rows = generate_babilong("qa2", 40, 1500, tokenizer, seed=0)
    first_fact_positions = set()
    for row in rows:
        sentences = sentences_of(row["input"])
        facts = set(facts_of(row["input"]))
        for sentence in sentences:
            if sentence not in facts:
                assert not any(word in sentence.lower() for word in TASK_WORDS), sentence
        first_fact_positions.add(next(i for i, s in enumerate(sentences) if s in facts))
    assert len(first_fact_positions) > 5


def test_distractor_prose_is_varied_and_free_of_task_words():
    import random

    rng = random.Random(0)
    sentences = [distractor_sentence(rng) for _ in range(3000)]
    assert len(set(sentences)) > 2900
    assert all(s[0].isupper() and s.endswith(".") for s in sentences)
    assert not [s for s in sentences if any(word in s.lower() for word in TASK_WORDS)]


@pytest.mark.parametrize("length", [120, 700])
def test_input_length_is_exact_to_within_one_sentence(tokenizer, length):
    for row in generate_babilong("qa1", 30, length, tokenizer, seed=1):
        measured = len(tokenizer(row["input"], add_special_tokens=False)["input_ids"])
        longest = max(len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in sentences_of(row["input"]))
        assert length - longest < measured <= length


def test_length_zero_is_the_story_alone(tokenizer):
    for row in generate_babilong("qa1", 10, 0, tokenizer, seed=0):
        assert sentences_of(row["input"]) == facts_of(row["input"])


def test_same_seed_same_rows_other_seed_other_rows(tokenizer):
    first = generate_babilong("qa3", 12, 250, tokenizer, seed=5)
    assert generate_babilong("qa3", 12, 250, tokenizer, seed=5) == first
    other = generate_babilong("qa3", 12, 250, tokenizer, seed=6)
    assert all(a != b for a, b in zip(first, other))
    # Any subset of rows generates alone (how builder workers split the work).
    assert generate_babilong("qa3", 12, 250, tokenizer, seed=5, row_indices=[7, 2]) == [first[7], first[2]]


def test_story_longer_than_length_is_an_error(tokenizer):
    with pytest.raises(ValueError, match=r"length=5 is shorter than the longest qa1 story \(\d+ tokens"):
        generate_babilong("qa1", 3, 5, tokenizer)
    with pytest.raises(ValueError, match="task='qa9'"):
        generate_babilong("qa9", 3, 100, tokenizer)
    with pytest.raises(ValueError, match="row_indices"):
        generate_babilong("qa1", 3, 100, tokenizer, row_indices=[3])


def test_haystack_files_give_contiguous_filtered_book_text(tokenizer, tmp_path):
    book_sentences = [f"Chapter line number {i} tells of the sea and the long winter." for i in range(40)]
    book_sentences[5] = "Then Mary entered the kitchen with a lamp."
    book_sentences[9] = "The office was closed."
    book = tmp_path / "book.txt"
    # Wrapped lines, as books come.
    book.write_text("\n".join(" ".join(book_sentences[i : i + 3]).replace(" of the", "\nof the") for i in range(0, 40, 3)))
    kept = [s for i, s in enumerate(book_sentences) if i not in (5, 9)]
    for row in generate_babilong("qa1", 6, 150, tokenizer, seed=2, haystack_files=[book]):
        facts = facts_of(row["input"])
        haystack = [s for s in sentences_of(row["input"]) if s not in facts]
        start = kept.index(haystack[0])
        assert haystack == [kept[(start + k) % len(kept)] for k in range(len(haystack))]
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        generate_babilong("qa1", 1, 150, tokenizer, haystack_files=[tmp_path / "missing.txt"])
    (tmp_path / "names.txt").write_text("Mary was in the garden. John sat in the office.")
    with pytest.raises(ValueError, match="no sentence free of the task words"):
        generate_babilong("qa1", 1, 150, tokenizer, haystack_files=[tmp_path / "names.txt"])


# ----------------------------------------------------------------------------------------------
# Example assembly


def test_rows_are_exactly_max_length_with_only_the_answer_labelled(tokenizer):
    pad_id = tokenizer.pad_token_id
    for row in generate_babilong("qa2", 30, 200, tokenizer, seed=4):
        example = build_example(row, tokenizer, max_length=320, answer_reserve_tokens=16)
        prompt = f"{row['input']}\n\nQuestion: {row['question']}\nAnswer:"
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        answer_ids = tokenizer(" " + row["target"], add_special_tokens=False)["input_ids"]
        n_prompt, n_answer = len(prompt_ids), len(answer_ids)
        assert len(example["input_ids"]) == len(example["labels"]) == len(example["attention_mask"]) == 320
        assert example["prompt_length"] == n_prompt
        assert example["input_ids"][: n_prompt + n_answer] == prompt_ids + answer_ids
        assert example["input_ids"][n_prompt + n_answer :] == [pad_id] * (320 - n_prompt - n_answer)
        assert example["attention_mask"] == [1] * (n_prompt + n_answer) + [0] * (320 - n_prompt - n_answer)
        labelled = [t for t in example["labels"] if t != -100]
        assert example["labels"][n_prompt : n_prompt + n_answer] == labelled
        assert tokenizer.decode(labelled) == " " + row["target"]
        assert example["target"] == row["target"]


def test_a_tokenizer_left_truncating_by_an_earlier_call_still_builds_whole_rows(tiny_tokenizer_dir, tokenizer):
    """A call with truncation=True leaves the backend truncating (as the CPU demo's toy base pretraining once did, which
    crashed every row longer than its 159 tokens): generation and example building must not see that state."""
    clean_rows = generate_babilong("qa1", 3, 600, tokenizer, seed=5)
    clean = [build_example(row, tokenizer, max_length=700, answer_reserve_tokens=8) for row in clean_rows]
    truncating = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    truncating(["a long enough text to cut"] * 2, truncation=True, max_length=20)
    truncating.backend_tokenizer.enable_truncation(20)  # whatever the wrapper did, the backend now cuts
    assert truncating.backend_tokenizer.truncation is not None
    rows = generate_babilong("qa1", 3, 600, truncating, seed=5)
    assert rows == clean_rows
    examples = [build_example(row, truncating, max_length=700, answer_reserve_tokens=8) for row in rows]
    assert examples == clean
    assert all(example["prompt_length"] > 550 for example in examples)
    assert truncating.backend_tokenizer.truncation["max_length"] == 20  # the caller's tokenizer is left as it was


def test_truncation_cuts_the_start_of_the_haystack_and_keeps_the_question(tokenizer):
    row = generate_babilong("qa3", 1, 400, tokenizer, seed=9)[0]
    prompt = f"{row['input']}\n\nQuestion: {row['question']}\nAnswer:"
    full_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    example = build_example(row, tokenizer, max_length=64, answer_reserve_tokens=8)
    assert len(example["input_ids"]) == 64
    assert example["prompt_length"] == 56
    assert example["input_ids"][:56] == full_ids[-56:]  # this tokenizer adds no special tokens
    assert tokenizer.decode(example["input_ids"][:56]).endswith(f"\n\nQuestion: {row['question']}\nAnswer:")
    assert tokenizer.decode([t for t in example["labels"] if t != -100]) == " " + row["target"]


def test_special_tokens_survive_truncation(tokenizer, monkeypatch):
    from tokenizers import processors

    bos = tokenizer.eos_token_id  # the only special token of the tiny tokenizer, used as a BOS here
    monkeypatch.setattr(
        tokenizer.backend_tokenizer,
        "post_processor",
        processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]),
    )
    row = {"input": "The old sailor repaired a torn sail. " * 20, "question": "Where is Mary? ", "target": "garden"}
    example = build_example(row, tokenizer, max_length=40, answer_reserve_tokens=4)
    assert example["input_ids"][0] == bos and example["input_ids"][1] != bos
    assert example["prompt_length"] == 36
    assert tokenizer.decode(example["input_ids"][1:36]).endswith("\n\nQuestion: Where is Mary? \nAnswer:")


def test_question_too_long_for_max_length_is_an_error(tokenizer):
    row = {"input": "Mary went to the garden.", "question": "Where is Mary? " * 20, "target": "garden"}
    with pytest.raises(ValueError, match="more than max_length - answer_reserve_tokens = 24"):
        build_example(row, tokenizer, max_length=32, answer_reserve_tokens=8)
    with pytest.raises(ValueError, match="answer_reserve_tokens=0"):
        build_example(row, tokenizer, max_length=32, answer_reserve_tokens=0)


def test_pad_falls_back_to_eos_and_unpadded_rows_keep_their_length(tiny_tokenizer_no_pad_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_no_pad_dir)
    assert tokenizer.pad_token_id is None
    row = {"input": "Mary went to the garden.", "question": "Where is Mary? ", "target": "garden"}
    padded = build_example(row, tokenizer, max_length=48, answer_reserve_tokens=8)
    used = padded["attention_mask"].count(1)
    assert padded["input_ids"][used:] == [tokenizer.eos_token_id] * (48 - used)
    unpadded = build_example(row, tokenizer, max_length=48, answer_reserve_tokens=8, pad_to_max_length=False)
    assert unpadded["input_ids"] == padded["input_ids"][:used]
    assert unpadded["labels"] == padded["labels"][:used] and unpadded["attention_mask"] == [1] * used


# ----------------------------------------------------------------------------------------------
# JSON, split, scoring, card


def test_json_round_trip_and_public_layouts(tmp_path):
    rows = [{"input": "Mary went to the garden.", "question": "Where is Mary? ", "target": "garden"}]
    path = write_babilong_json(rows, tmp_path / "qa1" / "0k.json")
    assert read_babilong_json(path) == rows
    assert [p.name for p in path.parent.iterdir()] == ["0k.json"]  # no temporary file left behind
    lines = tmp_path / "rows.jsonl"
    lines.write_text("\n".join(json.dumps({**row, "extra": 1}) for row in rows * 2) + "\n")
    assert read_babilong_json(lines) == rows * 2


@pytest.mark.parametrize(
    "content,message",
    [
        ('[{"input": "a", "question": "q"}]', r"row 0 \(0-based\): missing field\(s\) \['target'\]"),
        ('[{"input": "a", "question": "q", "target": "x"}, {"input": "a", "question": "q", "target": " "}]',
         r"row 1 \(0-based\): empty target"),
        ('[{"input": "a", "question": 3, "target": "x"}]', r"row 0 \(0-based\): field\(s\) \['question'\] must be strings"),
        ('["just text"]', "row 0 .*expected an object"),
        ('[{"input": "a", ', "not valid JSON"),
        ("[]", "holds no rows"),
    ],
)
def test_malformed_files_are_errors_naming_file_and_row(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        read_babilong_json(path)
    assert str(path) in str(error.value)
    assert path.read_text() == content  # input files are never modified


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_babilong_json(tmp_path / "nope.json")


def test_train_eval_split_is_seeded_disjoint_and_complete():
    import torch

    train, evaluation = train_eval_split(100, 0.9, seed=3)
    assert len(train) == 90 and len(evaluation) == 10
    assert sorted(train + evaluation) == list(range(100))
    assert train + evaluation == torch.randperm(100, generator=torch.Generator().manual_seed(3)).tolist()
    assert train_eval_split(100, 0.9, seed=3) == (train, evaluation)
    assert train_eval_split(100, 0.9, seed=4)[1] != evaluation
    with pytest.raises(ValueError, match="empty train or eval split"):
        train_eval_split(5, 0.1)
    with pytest.raises(ValueError, match="train_ratio=1.5"):
        train_eval_split(5, 1.5)


def test_scoring():
    assert score_exact_match(" Garden. Mary is there", "garden")
    assert not score_exact_match("the garden", "garden")
    assert not score_exact_match("", "garden")
    labels = babilong.TASK_LABELS["qa1"]
    assert score_label_substring("She is in the garden.", "garden", labels)
    assert not score_label_substring("garden or kitchen", "garden", labels)
    assert not score_label_substring("hallway", "garden", labels)
    question = "Where was the milk before the kitchen? "
    assert score_label_substring("garden, before the kitchen", "garden", labels, question=question)
    assert not score_label_substring("garden, before the kitchen", "garden", labels)
    # BABILong's own label sets (booydar/babilong, babilong/metrics.py); other tasks use the rows' targets
    assert sorted(labels) == LOCATIONS and babilong.TASK_LABELS["qa4"] == LOCATIONS
    assert set(babilong.TASK_LABELS) == {"qa1", "qa2", "qa3", "qa4", "qa5", "qa6", "qa7", "qa9", "qa10"}
    assert sorted(babilong.TASK_LABELS["qa5"]) == ["Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"]
    assert babilong.TASK_LABELS["qa7"] == ["none", "one", "two"] and babilong.TASK_LABELS["qa10"] == ["maybe", "no", "yes"]
    rows = [{"target": "Yes"}, {"target": " no"}, {"target": "yes"}]
    assert babilong.task_labels("qa6", rows) == (["no", "yes"], babilong.LABELS_FROM_BABILONG)
    assert babilong.task_labels("qa18", rows) == (["no", "yes"], babilong.LABELS_FROM_TARGETS)
    # qa5's labels are names and objects, scored case-blind
    assert score_label_substring("Fred gave it.", "Fred", babilong.TASK_LABELS["qa5"])


def test_dataset_card_names_the_settings(tmp_path):
    path = write_babilong_json([{"input": "a", "question": "q", "target": "x"}], tmp_path / "4k.json")
    settings = {"task": "qa2", "length": 4096, "num_samples": 1, "seed": 7, "tokenizer": "tok",
                "haystack_files": ["pg19/book.txt"], "files": path.name}
    card = babilong.write_dataset_card(path, settings)
    text = card.read_text()
    assert card == tmp_path / "README.md" and text.startswith("---\n")
    assert "--task qa2 --length 4096 --num-samples 1" in text and "--seed 7 --tokenizer tok --haystack pg19/book.txt" in text
    assert "Files: 4k.json" in text and "{{" not in text


def test_cli_generate_writes_the_generator_rows_and_card(tmp_path, tiny_tokenizer_dir, tokenizer):
    from titans_hf.commands import main

    output = tmp_path / "qa2" / "300.json"
    argv = ["babilong", "generate", "--task", "qa2", "--length", "300", "--num-samples", "5", "--seed", "4",
            "--tokenizer", str(tiny_tokenizer_dir), "--output", str(output), "--card"]
    assert main(argv) == 0
    assert json.loads(output.read_text()) == generate_babilong("qa2", 5, 300, tokenizer, seed=4)
    assert "--task qa2 --length 300 --num-samples 5" in (output.parent / "README.md").read_text()
