"""`titans_hf.tasks.recall`: long documents whose facts stated early are recalled chunks later, their `.jsonl`
and the `sft` evaluation store that marks the recalled values."""

from __future__ import annotations

import json
import random

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import titans_hf  # noqa: F401  (registers the builders)
from titans_hf.data.prepare import prepare
from titans_hf.data.stores import open_store
from titans_hf.tasks.recall import (
    ATTRIBUTES,
    PEOPLE,
    TITLES,
    VALUE_POOL,
    RecallDocument,
    Reference,
    Statement,
    build_recall_eval_store,
    encode_document,
    generate_recall,
    glossary_document,
    iter_recall_documents,
    name_meaning,
    parse_statement,
    people_pool,
    read_recall_jsonl,
    value_pool,
    write_recall_jsonl,
)
from titans_hf.testing_utils import build_tokenizer

CHUNK = 32


@pytest.fixture(scope="module")
def recall_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained on recall documents: every person and value is one token."""
    path = tmp_path_factory.mktemp("recall_tokenizer")
    texts = [document.text for document in generate_recall(300, seed=99, length=2000)]
    texts += [glossary_document(random.Random(i), VALUE_POOL + people_pool()) for i in range(100)]
    build_tokenizer(texts, path, vocab_size=2048)
    return path


@pytest.fixture(scope="module")
def recall_tokenizer(recall_tokenizer_dir):
    return AutoTokenizer.from_pretrained(recall_tokenizer_dir)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- the generator ----

def test_generation_is_seeded_and_ranges_are_reproducible(recall_tokenizer):
    first = [d.to_record() for d in generate_recall(6, seed=3, length=1500)]
    again = [d.to_record() for d in generate_recall(6, seed=3, length=1500)]
    other = [d.to_record() for d in generate_recall(6, seed=4, length=1500)]
    assert first == again
    assert first != other
    assert [d.to_record() for d in iter_recall_documents(2, seed=3, start=4, length=1500)] == first[4:]
    in_tokens = [d.to_record() for d in generate_recall(3, seed=3, tokenizer=recall_tokenizer, length=255)]
    assert in_tokens == [d.to_record() for d in generate_recall(3, seed=3, tokenizer=recall_tokenizer, length=255)]


def test_every_recalled_value_is_the_value_its_statement_gave():
    documents = generate_recall(40, seed=1, length=2500, num_people=6)
    assert sum(len(d.references) for d in documents) > 100
    for document in documents:
        text = document.text
        people = [s.person for s in document.statements]
        values = [s.value for s in document.statements]
        assert len(set(people)) == len(people) and len(set(values)) == len(values)
        for statement in document.statements:
            # read back from the text alone, with the statement templates
            assert parse_statement(text[slice(*statement.span)]) == (statement.person, statement.attribute,
                                                                      statement.value)
            assert text[slice(*statement.value_span)] == statement.value
        for reference in document.references:
            statement = document.statements[reference.statement]
            assert text[slice(*reference.span)] == reference.value == statement.value
            sentence = text[slice(*reference.sentence_span)]
            # the person is named before the value: the context says whose value it is
            assert statement.person in sentence[: reference.span[0] - reference.sentence_span[0]]
            assert statement.span[1] <= reference.sentence_span[0]


def test_values_occur_only_in_their_statement_and_references():
    """Nothing else in a document gives a value away: before its statement it never occurs."""
    for document in generate_recall(30, seed=2, length=2000):
        for index, statement in enumerate(document.statements):
            value = statement.value
            where = [i for i in range(len(document.text)) if document.text.startswith(value, i)]
            expected = [statement.value_span[0]] + [r.span[0] for r in document.references if r.statement == index]
            assert where == sorted(expected)


def test_value_pool_is_disjoint_from_other_words():
    assert len(VALUE_POOL) == len(set(VALUE_POOL)) == 32
    large = value_pool(256)
    assert len(set(large)) == 256 and not set(large) & (set(PEOPLE) | set(TITLES))
    assert set(value_pool(64)) <= set(large)  # smaller pools are prefixes of one order
    assert value_pool(64, seed=1) != value_pool(64)
    # no pool value is ever a word of the prose: the only values in a document are its own, where stated/recalled
    pool = set(large)
    for document in generate_recall(20, seed=5, length=2000, pool=large):
        text = document.text
        for span in sorted([s.value_span for s in document.statements] + document.dependent_spans, reverse=True):
            text = text[: span[0]] + text[span[1]:]
        assert not {word.strip(".,;'") for word in text.split()} & pool
    with pytest.raises(ValueError, match="size"):
        value_pool(0)


def test_people_come_from_the_people_pool():
    assert people_pool(3) == PEOPLE[:3]
    named = {s.person for d in generate_recall(40, seed=12, length=1500) for s in d.statements}
    assert named <= set(people_pool()) and len(named) > 8
    assert {s.person for d in generate_recall(10, seed=12, length=1500, num_people=3, people=people_pool(3))
            for s in d.statements} == set(PEOPLE[:3])
    with pytest.raises(ValueError, match="size"):
        people_pool(len(PEOPLE) + 1)


def test_every_name_has_a_meaning_of_its_own():
    assert len({name_meaning(v) for v in value_pool(256)}) == 256
    assert len({name_meaning(p) for p in PEOPLE}) == len(PEOPLE)
    with pytest.raises(KeyError):
        name_meaning("Nobody")


@pytest.mark.parametrize("min_distance", [0, 150, 400])
def test_references_come_at_least_min_distance_characters_after_the_last_mention(min_distance):
    documents = generate_recall(30, seed=6, length=2500, min_distance=min_distance)
    assert any(d.references for d in documents)
    for document in documents:
        assert len(document.text) == document.length <= 2500
        last_mention = {i: s.span[1] for i, s in enumerate(document.statements)}
        for reference in document.references:
            gap = reference.sentence_span[0] - last_mention[reference.statement]
            assert gap >= min_distance and reference.distance >= min_distance
            last_mention[reference.statement] = reference.sentence_span[1]


def test_token_distances_put_every_recalled_value_in_a_later_chunk(recall_tokenizer):
    """In tokens, a distance of one chunk means the statement's chunk lies before the value's."""
    documents = generate_recall(30, seed=7, tokenizer=recall_tokenizer, length=8 * CHUNK - 1, min_distance=CHUNK)
    assert sum(len(d.references) for d in documents) > 60
    for document in documents:
        encoded = recall_tokenizer(document.text, add_special_tokens=False, return_offsets_mapping=True)
        # per-sentence counts add up to the whole text's tokenization
        assert len(encoded["input_ids"]) == document.length <= 8 * CHUNK - 1
        ends = np.array([end for _, end in encoded["offset_mapping"]])
        starts = np.array([start for start, _ in encoded["offset_mapping"]])

        def token_at(char: int) -> int:  # the token holding character `char`
            return int(np.flatnonzero((starts <= char) & (ends > char))[0])

        last_mention = {i: s.span[1] for i, s in enumerate(document.statements)}
        for reference in document.references:
            before = token_at(last_mention[reference.statement] - 1)  # the mention's last token
            first = token_at(reference.sentence_span[0])  # the reference sentence's first token
            assert first - before - 1 >= CHUNK and reference.distance >= CHUNK
            assert token_at(reference.span[0]) // CHUNK > before // CHUNK
            last_mention[reference.statement] = reference.sentence_span[1]


def test_generator_refuses_impossible_documents():
    with pytest.raises(ValueError, match="too short"):
        generate_recall(1, length=100, num_people=6)
    with pytest.raises(ValueError, match="num_people"):
        generate_recall(1, num_people=len(PEOPLE) + 1)
    with pytest.raises(ValueError, match="distinct values"):
        generate_recall(1, num_people=6, pool=["Tamsin", "Belkor"])


def test_every_attribute_template_names_the_person_before_the_value():
    for kind in ATTRIBUTES.values():
        for template in kind["statements"] + kind["references"] + kind["echoes"]:
            assert template.index("{person}") < template.index("{value}")
            after = template[template.index("{value}") + len("{value}"):]
            assert after[:1] in (" ", ".", ",")


# ---- files and stores ----

def test_jsonl_round_trip_keeps_text_and_spans(tmp_path):
    documents = generate_recall(5, seed=8, length=1200)
    path = write_recall_jsonl(documents, tmp_path / "recall.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == list(range(5))
    assert all(set(r) == {"text", "statements", "references", "length", "id"} for r in records)
    assert [d.to_record() for d in read_recall_jsonl(path)] == [d.to_record() for d in documents]


def word_level_tokenizer(tmp_path, text: str):
    """A tokenizer of whole words and punctuation runs, so positions can be written down by hand."""
    words = sorted({piece for piece, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    vocab = {"<|endoftext|>": 0, **{word: index + 1 for index, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                      pad_token="<|endoftext|>")
    wrapped.save_pretrained(tmp_path / "words")
    return tmp_path / "words", vocab


def test_dependent_positions_on_a_small_hand_made_example(tmp_path):
    text = "Captain Orlen's horse was called Tamsin. The tide turned. Orlen saddled Tamsin."
    statement = Statement("Orlen", "horse", "Tamsin", (0, 40), (33, 39))
    reference = Reference(0, "Tamsin", (72, 78), (58, 79), 17)
    document = RecallDocument(text, [statement], [reference], len(text))
    assert text[33:39] == text[72:78] == "Tamsin"
    path, vocab = word_level_tokenizer(tmp_path, text)
    # Captain Orlen ' s horse was called Tamsin . The tide turned . Orlen saddled Tamsin . <eos>
    #    0      1   2 3   4    5     6      7   8  9   10    11   12  13     14     15   16  17
    ids, mask = encode_document(document, AutoTokenizer.from_pretrained(path))
    assert len(ids) == 18 and ids[-1] == 0 and ids[7] == ids[15] == vocab["Tamsin"]
    assert np.flatnonzero(mask).tolist() == [15]
    store = build_recall_eval_store([document], tmp_path / "eval_sft", path)
    with open_store(store) as opened:
        assert opened.segment("sequence", 0).tolist() == ids.tolist()
        assert np.flatnonzero(opened.segment("loss_mask", 0)).tolist() == [15]
        assert opened.metadata["train_type"] == "sft"


def test_dependent_positions_with_a_byte_level_tokenizer(recall_tokenizer):
    """Byte-level tokens carry the space before a word: " Tamsin" is dependent, " saddled" and "." are not."""
    text = "Captain Orlen's horse was called Tamsin. The tide turned. Orlen saddled Tamsin."
    reference = Reference(0, "Tamsin", (72, 78), (58, 79), 17)
    document = RecallDocument(text, [Statement("Orlen", "horse", "Tamsin", (0, 40), (33, 39))], [reference])
    ids, mask = encode_document(document, recall_tokenizer)
    tokens = recall_tokenizer.convert_ids_to_tokens(ids.tolist())
    # "Tamsin" is no pool value, so this tokenizer splits it: every piece of it is dependent
    marked = [tokens[i] for i in np.flatnonzero(mask)]
    assert len(marked) > 1 and "".join(marked) == "ĠTamsin"
    first_marked = int(np.flatnonzero(mask)[0])
    assert recall_tokenizer.decode(ids[:first_marked].tolist()) == text[:71]  # "... Orlen saddled", not its space
    assert tokens[np.flatnonzero(mask)[-1] + 1] == "."
    # the same positions derived from the prefix: the tokens before " Tamsin" are those of text[:71]
    first = len(encode(recall_tokenizer, text[:71]))
    assert np.flatnonzero(mask).tolist() == list(range(first, first + len(encode(recall_tokenizer, " Tamsin"))))


def test_dependent_tokens_are_exactly_the_recalled_values(recall_tokenizer):
    for document in generate_recall(10, seed=9, tokenizer=recall_tokenizer, length=255, min_distance=CHUNK):
        ids, mask = encode_document(document, recall_tokenizer)
        assert mask[-1] == 0 and ids[-1] == recall_tokenizer.eos_token_id
        marked = recall_tokenizer.convert_ids_to_tokens(ids[mask == 1].tolist())
        assert [token.lstrip("Ġ") for token in marked] == [r.value for r in document.references]
        for reference in document.references:  # derived from the prefix, one value token each
            position = len(encode(recall_tokenizer, document.text[: reference.span[0] - 1]))
            assert mask[position] == 1 and ids[position] == encode(recall_tokenizer, " " + reference.value)[0]


@pytest.mark.parametrize("name", ["eval_sft", "eval.h5"])
def test_eval_store_ids_equal_those_of_prepare(tmp_path, recall_tokenizer_dir, recall_tokenizer, name):
    documents = generate_recall(12, seed=10, tokenizer=recall_tokenizer, length=8 * CHUNK - 1, min_distance=CHUNK)
    jsonl = write_recall_jsonl(documents, tmp_path / "recall.jsonl")
    [seq_store] = prepare(jsonl, tmp_path / "seq", recall_tokenizer_dir)
    eval_store = build_recall_eval_store(jsonl, tmp_path / name, recall_tokenizer_dir)
    with open_store(seq_store) as seq, open_store(eval_store) as sft:
        assert seq.num_segments("sequence") == sft.num_segments("sequence") == 12
        for index in range(12):
            assert sft.segment("sequence", index).tolist() == seq.segment("sequence", index).tolist()
            assert sft.segment("loss_mask", index).sum() == len(documents[index].references)
        assert sft.metadata["vocab_size"] == seq.metadata["vocab_size"]
        assert sft.metadata["eos_token_id"] == seq.metadata["eos_token_id"]
    # one window per document; labels only on the recalled values
    common = dict(window_size=8 * CHUNK, respect_document_boundaries=True, pad_tail=True, split="train")
    files = str(tmp_path / name) if name.endswith(".h5") else str(tmp_path / name / "meta.json")
    masked = datasets.load_dataset("titans_tokens", data_files=files, train_type="sft", **common)
    plain = datasets.load_dataset("titans_tokens", data_files=str(tmp_path / "seq" / "meta.json"), train_type="seq",
                                  **common)
    assert len(masked) == len(plain) == 12 and masked["input_ids"] == plain["input_ids"]
    for row, document in zip(masked, documents):
        ids, mask = encode_document(document, recall_tokenizer)
        labelled = [i for i, label in enumerate(row["labels"]) if label != -100]
        assert labelled == np.flatnonzero(mask).tolist()


def test_eval_store_refuses_to_overwrite(tmp_path, recall_tokenizer_dir):
    documents = generate_recall(2, seed=11, length=800)
    build_recall_eval_store(documents, tmp_path / "store", recall_tokenizer_dir)
    with pytest.raises(ValueError, match="already exists"):
        build_recall_eval_store(documents, tmp_path / "store", recall_tokenizer_dir)
    build_recall_eval_store(documents[:1], tmp_path / "store", recall_tokenizer_dir, overwrite=True)
    with open_store(tmp_path / "store") as store:
        assert store.num_segments("sequence") == 1
    # never a folder of someone's files, even with overwrite
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="notes: will not replace it"):
        build_recall_eval_store(documents, folder, recall_tokenizer_dir, overwrite=True)
    assert (folder / "mine.txt").read_text() == "keep me"
