"""An offline generator of long documents in which facts stated early are needed far later.

Each document is ordinary narrative prose about a few people. Early on, each person is given an attribute whose
value is a name drawn at random for this document ("Captain Orlen's horse was called Tamsin."); later, many
sentences on, the person is referred to again in a sentence whose continuation is that value ("Orlen saddled
Tamsin and rode off before dawn."). The value cannot be guessed from the reference alone (it is one of
`len(VALUE_POOL)` names, drawn per document), only recalled from the statement.

What the generator returns per document (`RecallDocument`): the text, each statement (its sentence span and the
span of its value) and each reference (the span of the recalled value, the dependent characters, and the
statement it depends on). Spans are `[start, end)` character offsets into the text.

Distances are measured in characters, or in tokens of a tokenizer when one is given (`tokenizer=...`): each
sentence is counted with its leading space, which for byte-level BPE tokenizers (GPT-2, Qwen, the local ones of
`titans_hf.testing_utils`) is exactly how the whole text tokenizes. A reference comes at least `min_distance`
units after the end of the previous sentence that named its value (the statement, or an earlier reference), so
with a distance of at least one chunk of tokens, every recalled value depends on an earlier chunk.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from titans_hf.tasks.babilong import distractor_sentence

# ---- pools ----

# People the documents are about: a title for the statement, the bare name for later references.
TITLES = ["Captain", "Doctor", "Sergeant", "Old", "Young", "Professor", "Judge", "Corporal", "Mayor", "Cousin"]
PEOPLE = [
    "Orlen", "Maris", "Tobin", "Elsa", "Hugo", "Greta", "Anselm", "Ilse", "Corin", "Petra", "Lukas", "Nora",
    "Bram", "Wenna", "Oswin", "Rhea", "Emil", "Sabine", "Jasper", "Livia", "Konrad", "Margit", "Felix", "Hedda",
    "Ansel", "Tilda", "Roland", "Brigid", "Casimir", "Odile", "Matthias", "Yvette", "Gideon", "Agnes", "Leopold",
    "Frieda", "Ambrose", "Clara", "Desmond", "Ursula", "Edmund", "Ingrid", "Florian", "Beatrix", "Henrik", "Judith",
    "Ivo", "Marta", "Quentin", "Sylvie", "Rupert", "Vera", "Silas", "Helga", "Tobias", "Rosalind", "Viktor", "Esther",
    "Wendel", "Amara", "Lorenz", "Ottilie", "Basil", "Cordelia",
]

# Syllables of the invented value names ("Tamsin", "Belkor", ...): far more combinations than any pool needs.
_ONSETS = ["B", "D", "F", "G", "K", "L", "M", "N", "P", "R", "S", "T", "V", "Z", "Th", "Br", "Dr", "Gr", "Kr", "Tr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_MIDDLES = ["l", "m", "n", "r", "s", "v", "z", "nd", "rk", "st", "lv", "rn"]
_ENDINGS = ["a", "in", "or", "ek", "is", "an", "el", "os", "ir", "un", "et", "ax"]
DEFAULT_POOL_SIZE = 32
DEFAULT_PEOPLE = 16


@functools.lru_cache(maxsize=None)
def _all_value_names() -> tuple[str, ...]:
    return tuple(sorted({onset + vowel + middle + ending
                         for onset, vowel, middle, ending in itertools.product(_ONSETS, _VOWELS, _MIDDLES, _ENDINGS)}
                        - set(PEOPLE) - set(TITLES)))


def value_pool(size: int = DEFAULT_POOL_SIZE, seed: int = 0) -> list[str]:
    """`size` distinct invented names ("Tamsin", "Belkor", ...), a fixed function of (size, seed).

    None of them is a person's name, a title or a word of the distractor prose.
    """
    names = _shuffled_value_names(seed)
    if not 1 <= size <= len(names):
        raise ValueError(f"value_pool: size={size} must lie in [1, {len(names)}]")
    return sorted(names[:size])


def _shuffled_value_names(seed: int) -> list[str]:
    names = list(_all_value_names())
    random.Random(f"titans_hf.recall.values:{seed}").shuffle(names)
    return names


VALUE_POOL = value_pool()


def people_pool(size: int = DEFAULT_PEOPLE) -> list[str]:
    """The first `size` of `PEOPLE`: the people documents are drawn from."""
    if not 1 <= size <= len(PEOPLE):
        raise ValueError(f"people_pool: size={size} must lie in [1, {len(PEOPLE)}]")
    return list(PEOPLE[:size])

# What a person can be given, how it is stated, and how it is referred to later: "references" name the person and
# an action ("Orlen saddled Tamsin"), "echoes" repeat the statement's cue, the person and the kind ("Orlen's horse
# Tamsin grazed"). Every reference and echo names the person before the value and ends the value with a space or
# punctuation, so the value's tokens are predicted from a context that says whose value it is.
ATTRIBUTES: dict[str, dict[str, list[str]]] = {
    "horse": {
        "statements": ["{title} {person}'s horse was called {value}.", "{title} {person} owned a horse named {value}.",
                       "{title} {person} rode a grey horse called {value}."],
        "references": ["{person} saddled {value} and rode off {time}.", "{Time}, {person} fed {value} a bucket of oats.",
                       "{person} led the horse {value} down to the river.", "{person} brushed the mane of {value} {manner}."],
        "echoes": ["{person}'s horse {value} grazed {place}.",
                   "{Time}, {person}'s horse {value} threw a shoe.",
                   "{person}'s horse {value} was tired after the journey."],
    },
    "dog": {
        "statements": ["{title} {person}'s dog was called {value}.", "{title} {person} kept a dog named {value}.",
                       "{title} {person} had a small brown dog called {value}."],
        "references": ["{person} whistled for {value}, who came running.", "{Time}, {person} walked the dog {value} {place}.",
                       "{person} threw a stick for {value} {place}.", "{person} gave the dog {value} a bone."],
        "echoes": ["{person}'s dog {value} barked at the gate.",
                   "{Time}, {person}'s dog {value} slept by the fire.",
                   "{person}'s dog {value} followed the cart {place}."],
    },
    "ship": {
        "statements": ["{title} {person}'s ship was named {value}.", "{title} {person} sailed a ship called {value}.",
                       "{title} {person} was master of a ship named {value}."],
        "references": ["{person} boarded the {value} {time}.", "{Time}, {person} sailed the {value} out of the bay.",
                       "{person} painted the hull of the {value} {manner}.", "{person} moored the {value} by the quay."],
        "echoes": ["{person}'s ship {value} left the harbour {time}.",
                   "{Time}, {person}'s ship {value} lost a mast.",
                   "{person}'s ship {value} lay at anchor {place}."],
    },
    "sword": {
        "statements": ["{title} {person}'s sword was named {value}.", "{title} {person} carried a sword called {value}.",
                       "{title} {person} had an old sword known as {value}."],
        "references": ["{person} drew the sword {value} {manner}.", "{Time}, {person} sharpened {value} by the fire.",
                       "{person} hung {value} above the door.", "{person} raised the blade {value} and waited."],
        "echoes": ["{person}'s sword {value} hung on the wall.",
                   "{Time}, {person}'s sword {value} was mended by the smith.",
                   "{person}'s sword {value} lay across the table."],
    },
    "cat": {
        "statements": ["{title} {person}'s cat was called {value}.", "{title} {person} kept a black cat named {value}.",
                       "{title} {person} had a cat known as {value}."],
        "references": ["{person} called the cat {value} in for supper.", "{Time}, {person} found {value} asleep {place}.",
                       "{person} poured milk for {value} {manner}.", "{person} stroked the cat {value} and smiled."],
        "echoes": ["{person}'s cat {value} hunted mice {place}.",
                   "{Time}, {person}'s cat {value} sat on the roof.",
                   "{person}'s cat {value} purred {manner}."],
    },
    "hawk": {
        "statements": ["{title} {person}'s hawk was called {value}.", "{title} {person} trained a hawk named {value}.",
                       "{title} {person} flew a hunting hawk called {value}."],
        "references": ["{person} set the hawk {value} loose over the fields.", "{Time}, {person} fed {value} a strip of meat.",
                       "{person} waited for {value} to return {manner}.", "{person} lifted {value} onto the glove."],
        "echoes": ["{person}'s hawk {value} circled over the fields.",
                   "{Time}, {person}'s hawk {value} caught a hare.",
                   "{person}'s hawk {value} rested on a post {place}."],
    },
    "goat": {
        "statements": ["{title} {person}'s goat was called {value}.", "{title} {person} raised a goat named {value}.",
                       "{title} {person} owned a stubborn goat called {value}."],
        "references": ["{person} milked the goat {value} {time}.", "{Time}, {person} tied {value} to the gate.",
                       "{person} chased {value} out of the garden.", "{person} led the goat {value} to the market."],
        "echoes": ["{person}'s goat {value} ate the washing.",
                   "{Time}, {person}'s goat {value} escaped again.",
                   "{person}'s goat {value} wandered {place}."],
    },
    "boat": {
        "statements": ["{title} {person}'s boat was named {value}.", "{title} {person} rowed a boat called {value}.",
                       "{title} {person} built a little boat named {value}."],
        "references": ["{person} rowed the {value} across the lake.", "{Time}, {person} pulled the {value} onto the shore.",
                       "{person} tarred the keel of the {value} {manner}.", "{person} tied the {value} to the jetty."],
        "echoes": ["{person}'s boat {value} drifted {place}.",
                   "{Time}, {person}'s boat {value} sprang a leak.",
                   "{person}'s boat {value} was painted blue."],
    },
}

_TIMES = ["in the morning", "late that evening", "before dawn", "at noon", "after the storm", "that winter",
          "on the day of the fair", "just before supper", "long after midnight", "in the spring"]
_MANNERS = ["slowly", "with great care", "in silence", "without a word", "cheerfully", "for a long while"]
_PLACES = ["by the mill", "near the harbour", "on the hill", "behind the tavern", "in the orchard", "at the quay",
           "beside the river", "in the square"]


# ---- what the names mean (text for a toy base's pretraining, never part of a recall document) ----

# A small model trained only on recall documents sees every value (and every person) in the same contexts, since
# values are drawn at random per document: language-model training then folds them into one embedding, and a memory
# reading them cannot tell which value it stored (the collapse measured in docs/frozen_base.md). In real text every
# name has contexts of its own; these sentences give each name one: a meaning that is a fixed function of the name.
_MEANING_ADJECTIVES = ["red", "silver", "quiet", "bright", "old", "swift", "hidden", "bitter", "golden", "cold",
                       "gentle", "dark", "high", "broken", "green", "lonely"]
_MEANING_NOUNS = ["river", "stone", "morning", "hill", "wolf", "harvest", "lantern", "oak", "winter", "bell",
                  "meadow", "storm", "salt", "feather", "road", "ember"]
_GLOSSARY_TEMPLATES = ["In the old tongue, {name} means {meaning}.", "The name {name} means {meaning}.",
                       "{name} is an old word for {meaning}.", "They say {name} once meant {meaning}."]


@functools.lru_cache(maxsize=None)
def _meanings() -> dict[str, str]:
    pairs = [f"{a} {n}" for a in _MEANING_ADJECTIVES for n in _MEANING_NOUNS]
    random.Random("titans_hf.recall.meanings").shuffle(pairs)
    # values in the order value_pool draws them (seed 0), so the names of any pool of up to 256 values all have
    # meanings of their own; the people likewise among themselves
    values = _shuffled_value_names(0)
    meanings = {name: pairs[index % len(pairs)] for index, name in enumerate(values)}
    meanings.update({name: pairs[(7 * index) % len(pairs)] for index, name in enumerate(PEOPLE)})
    return meanings


def name_meaning(name: str) -> str:
    """The fixed meaning of a person's or value's name ("quiet river")."""
    meanings = _meanings()
    if name not in meanings:
        raise KeyError(f"name_meaning: {name!r} is not a person or value name of the recall generator")
    return meanings[name]


def glossary_sentence(name: str, rng: random.Random) -> str:
    """A sentence saying what `name` means: a context of its own for every name, for a toy base's pretraining."""
    return rng.choice(_GLOSSARY_TEMPLATES).format(name=name, meaning=name_meaning(name))


def glossary_document(rng: random.Random, names: list[str], sentences: int = 8) -> str:
    """`sentences` glossary sentences about names drawn from `names`."""
    return " ".join(glossary_sentence(rng.choice(names), rng) for _ in range(sentences))


# ---- documents ----


@dataclass
class Statement:
    """A sentence that gives `person` an `attribute` whose value is `value`; spans are [start, end) offsets."""

    person: str
    attribute: str
    value: str
    span: tuple[int, int]
    value_span: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {"person": self.person, "attribute": self.attribute, "value": self.value, "span": list(self.span),
                "value_span": list(self.value_span)}


@dataclass
class Reference:
    """A later sentence whose `value` must be recalled from statement `statement` (an index into the document's
    statements). `span` is the recalled value (the dependent characters), `sentence_span` the whole sentence;
    `distance` the units (characters or tokens) between the end of the previous sentence naming the value and
    the start of this one."""

    statement: int
    value: str
    span: tuple[int, int]
    sentence_span: tuple[int, int]
    distance: int

    def to_dict(self) -> dict[str, Any]:
        return {"statement": self.statement, "value": self.value, "span": list(self.span),
                "sentence_span": list(self.sentence_span), "distance": self.distance}


@dataclass
class RecallDocument:
    text: str
    statements: list[Statement] = field(default_factory=list)
    references: list[Reference] = field(default_factory=list)
    length: int = 0  # in the generator's units (characters or tokens)

    @property
    def dependent_spans(self) -> list[tuple[int, int]]:
        """Character spans of the recalled values: the text whose tokens depend on an earlier statement."""
        return [reference.span for reference in self.references]

    def to_record(self, **extra: Any) -> dict[str, Any]:
        """The `.jsonl` record: `text` (what `titans-hf prepare` reads) with the spans beside it."""
        return {"text": self.text, "statements": [s.to_dict() for s in self.statements],
                "references": [r.to_dict() for r in self.references], "length": self.length, **extra}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "RecallDocument":
        statements = [Statement(s["person"], s["attribute"], s["value"], tuple(s["span"]), tuple(s["value_span"]))
                      for s in record.get("statements", [])]
        references = [Reference(r["statement"], r["value"], tuple(r["span"]), tuple(r["sentence_span"]),
                                int(r["distance"])) for r in record.get("references", [])]
        return cls(record["text"], statements, references, int(record.get("length", 0)))


def _fill(template: str, rng: random.Random, **slots: str) -> tuple[str, tuple[int, int] | None]:
    """The template with its slots filled; and the span of `{value}` in the result (None if it has none)."""
    time = rng.choice(_TIMES)
    values = {"time": time, "Time": time[:1].upper() + time[1:], "manner": rng.choice(_MANNERS),
              "place": rng.choice(_PLACES), **slots}
    head, marker, tail = template.partition("{value}")
    if not marker:
        return template.format(**values), None
    before = head.format(**values)
    text = before + slots["value"] + tail.format(**values)
    return text, (len(before), len(before) + len(slots["value"]))


def token_counter(tokenizer) -> Callable[[str], int]:
    """Counts tokens of `tokenizer` (no special tokens): the unit of lengths and distances when given. Counts are
    cached: documents repeat many of their sentences."""
    @functools.lru_cache(maxsize=1 << 16)
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return count


@dataclass
class _DocumentText:
    """The text of a document being written, sentence by sentence, within `length` units of `count`."""

    length: int
    count: Callable[[str], int]
    pieces: list[str] = field(default_factory=list)
    position: int = 0  # units written so far, separators included
    chars: int = 0

    def add(self, sentence: str) -> tuple[int, int] | None:
        """Append a sentence if it fits; return its character span (None if it does not fit)."""
        piece = sentence if not self.pieces else " " + sentence
        units = self.count(piece)
        if self.position + units > self.length:
            return None
        start = self.chars + (len(piece) - len(sentence))
        self.pieces.append(piece)
        self.position += units
        self.chars += len(piece)
        return start, self.chars


def _people_count(rng: random.Random, num_people: int | tuple[int, int], people: list[str], pool: list[str],
                  min_distance: int, max_references: int, reference_rate: float, echo_rate: float) -> int:
    """The number of people of this document (drawn when `num_people` is a (min, max) range), the settings
    checked."""
    if isinstance(num_people, (tuple, list)):  # a range: drawn per document
        low, high = num_people
        if not 1 <= low <= high:
            raise ValueError(f"generate_document: num_people range {num_people} must satisfy 1 <= min <= max")
        num_people = rng.randint(low, high)
    if not 1 <= num_people <= len(people):
        raise ValueError(f"generate_document: num_people={num_people} must lie in [1, {len(people)}]")
    if num_people > len(pool):
        raise ValueError(f"generate_document: num_people={num_people} needs that many distinct values, the pool "
                         f"holds {len(pool)}")
    if min_distance < 0 or max_references < 0 or not 0 <= reference_rate <= 1 or not 0 <= echo_rate <= 1:
        raise ValueError("generate_document: min_distance and max_references must be >= 0, reference_rate and "
                         "echo_rate in [0, 1]")
    return num_people


def _write_statements(rng: random.Random, text: _DocumentText, people: list[str], attributes: list[str],
                      values: list[str], intro_prose: tuple[int, int]) -> tuple[list[Statement], dict[int, int]]:
    """The introduction: each person's statement, each followed by up to `intro_prose` (min, max) prose sentences
    that leave room for the statements still to come. Returns the statements and, per person index, the units at
    the end of its statement."""
    stated = [_fill(rng.choice(ATTRIBUTES[attributes[index]]["statements"]), rng, title=rng.choice(TITLES),
                    person=people[index], value=values[index]) for index in range(len(people))]
    needed = [text.count(" " + sentence) for sentence, _ in stated]  # what the statements still to come take
    if sum(needed) > text.length:
        raise ValueError(f"generate_document: length={text.length} is too short for {len(people)} statements")
    statements: list[Statement] = []
    last_named = {}
    for index, (sentence, value_span) in enumerate(stated):
        span = text.add(sentence)
        statements.append(Statement(people[index], attributes[index], values[index], span,
                                    (span[0] + value_span[0], span[0] + value_span[1])))
        last_named[index] = text.position
        for _ in range(rng.randint(*intro_prose)):
            prose = distractor_sentence(rng)
            if text.position + text.count(" " + prose) + sum(needed[index + 1:]) <= text.length:
                text.add(prose)
    return statements, last_named


def _write_body(rng: random.Random, text: _DocumentText, people: list[str], attributes: list[str],
                values: list[str], last_named: dict[int, int], min_distance: int, max_references: int,
                reference_rate: float, echo_rate: float) -> list[Reference]:
    """The body: prose in which, at each sentence, with probability `reference_rate`, a person whose value was last
    named at least `min_distance` units ago is referred to; until three sentences in a row no longer fit."""
    references: list[Reference] = []
    referenced = [0] * len(people)
    failures = 0
    while failures < 3:  # stop once sentences no longer fit
        due = [i for i in range(len(people))
               if referenced[i] < max_references and text.position - last_named[i] >= min_distance]
        if due and rng.random() < reference_rate:
            index = rng.choice(due)
            kind = ATTRIBUTES[attributes[index]]
            templates = kind["echoes"] if rng.random() < echo_rate else kind["references"]
            sentence, value_span = _fill(rng.choice(templates), rng, person=people[index], value=values[index])
            before = text.position
            span = text.add(sentence)
            if span is None:
                failures += 1
                continue
            references.append(Reference(index, values[index], (span[0] + value_span[0], span[0] + value_span[1]),
                                        span, before - last_named[index]))
            last_named[index] = text.position
            referenced[index] += 1
        elif text.add(distractor_sentence(rng)) is None:
            failures += 1
    return references


def generate_document(
    rng: random.Random,
    length: int = 2000,
    num_people: int | tuple[int, int] = 4,
    min_distance: int = 200,
    max_references: int = 8,
    reference_rate: float = 0.9,
    intro_prose: tuple[int, int] = (0, 1),
    echo_rate: float = 1.0,
    pool: list[str] | None = None,
    people: list[str] | None = None,
    count: Callable[[str], int] = len,
) -> RecallDocument:
    """One document of at most `length` units (`count` measures a sentence; characters by default).

    Layout: an introduction in which each of `num_people` people (or a number drawn from a (min, max) range)
    gets one attribute (a kind of its own while
    kinds last) by a statement, each followed by `intro_prose` (min, max) prose sentences; then a body of
    prose in which, at each sentence, with probability `reference_rate`, a person whose value was last named at
    least `min_distance` units ago is referred to (at most `max_references` times each), by an echo of its
    statement's cue ("Orlen's horse Tamsin ...") with probability `echo_rate`, else by an action ("Orlen saddled
    Tamsin ..."). Values are distinct within a document, drawn from `pool` (default `VALUE_POOL`); people from
    `people` (default `people_pool()`). The defaults are those the recall recipe was measured with (docs/results.md).
    """
    pool = VALUE_POOL if pool is None else pool
    people = people_pool() if people is None else people
    kinds = sorted(ATTRIBUTES)
    num_people = _people_count(rng, num_people, people, pool, min_distance, max_references, reference_rate,
                               echo_rate)
    people = rng.sample(people, num_people)
    attributes = [kinds[i % len(kinds)] for i in rng.sample(range(max(num_people, len(kinds))), num_people)]
    values = rng.sample(pool, num_people)

    text = _DocumentText(length, count)
    statements, last_named = _write_statements(rng, text, people, attributes, values, intro_prose)
    references = _write_body(rng, text, people, attributes, values, last_named, min_distance, max_references,
                             reference_rate, echo_rate)
    return RecallDocument("".join(text.pieces), statements, references, text.position)


def _document_random(seed: int, index: int) -> random.Random:
    return random.Random(f"titans_hf.recall:{seed}:{index}")


def iter_recall_documents(num_documents: int, seed: int = 0, tokenizer=None, start: int = 0,
                          **settings: Any) -> Iterator[RecallDocument]:
    """Documents `start .. start + num_documents - 1` of the stream of `seed`; each depends only on (seed, index,
    settings), so any range is reproducible on its own. `tokenizer`: lengths and distances in its tokens.
    `settings` go to `generate_document`."""
    count = token_counter(tokenizer) if tokenizer is not None else len
    for index in range(start, start + num_documents):
        yield generate_document(_document_random(seed, index), count=count, **settings)


def generate_recall(num_documents: int, seed: int = 0, tokenizer=None, **settings: Any) -> list[RecallDocument]:
    """`num_documents` seeded documents (see `generate_document` for `settings`)."""
    return list(iter_recall_documents(num_documents, seed=seed, tokenizer=tokenizer, **settings))


def parse_statement(sentence: str) -> tuple[str, str, str] | None:
    """(person, attribute, value) stated by `sentence`, read back from the statement templates; None if it is
    not a statement."""
    for attribute, templates in ATTRIBUTES.items():
        for template in templates["statements"]:
            pattern = re.escape(template).replace(re.escape("{title}"), r"(?P<title>\w+)")
            pattern = pattern.replace(re.escape("{person}"), r"(?P<person>\w+)")
            pattern = pattern.replace(re.escape("{value}"), r"(?P<value>\w+)")
            match = re.fullmatch(pattern, sentence)
            if match:
                return match["person"], attribute, match["value"]
    return None
