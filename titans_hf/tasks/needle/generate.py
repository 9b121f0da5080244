"""A seeded needle-in-a-haystack generator: the passkey prompt of the Landmark-attention and LongLoRA papers, and
RULER's multi-key variant (S-NIAH-MK), in a haystack of prose sized in tokens of the tokenizer that will read it.

Rows are `{"input", "question", "target"}` like BABILong's, read with `PROMPT_TEMPLATE` ("{input}\\n{question}"),
which gives the published passkey prompt word for word:

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you
    about the important information there.
    <haystack before the needle>
    The pass key is 68231. Remember it. 68231 is the pass key.
    <haystack after it>
    What is the pass key? The pass key is

and the answer " 68231" (no chat template). So a passkey row written by another harness (RULER's, LongLoRA's) in the
same three fields is the same prompt. The haystack is contiguous text of the user's files or folders or of a
`datasets` split (BABILong's haystack sources: `titans_hf.tasks.babilong.generate`), or the built-in distractor
prose; LongLoRA's repeated filler sentence ("The grass is green. ...") only when asked for (`filler=True`), for
comparison. Each row also records where its needle lies: `needle_char` (the character where the asked key first
appears in `input`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from titans_hf.tasks.babilong.generate import (
    HaystackDataset,
    checked_row_indices,
    draw_haystack,
    haystack_sentence_pool,
    split_sentences,
    token_counts,
)

PROMPT_TEMPLATE = "{input}\n{question}"

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I "
                 "will quiz you about the important information there.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

MULTIKEY_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
                  "quiz you about the numbers afterwards.")
MULTIKEY_NEEDLE = "One of the special magic numbers for {name} is: {key}."
MULTIKEY_QUESTION = ("What is the special magic number for {name} mentioned in the provided text? The special magic "
                     "number for {name} mentioned in the provided text is")
MULTIKEY_COUNT = (4, 8)  # fewest and most keys of a multi-key row; one of them is asked
NAMES = [
    "Alder", "Brisco", "Calloway", "Delphine", "Everard", "Fenwick", "Gideon", "Hollis", "Isolde", "Jasper",
    "Kestrel", "Lorimer", "Marigold", "Nettie", "Orrin", "Prudence", "Quillon", "Rosalind", "Sylvester", "Thaddeus",
    "Ursula", "Vesper", "Winifred", "Xander", "Yardley", "Zebedee",
]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE_TASKS = ("passkey", "mk")


def _row_random(task: str, length: int, seed: int, index: int) -> random.Random:
    """Row `index` depends only on (task, length, seed, index), so any subset generates alone (num_proc)."""
    return random.Random(f"titans_needle:{task}:{length}:{seed}:{index}")


def _key(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _needles(task: str, rng: random.Random) -> tuple[str, list[str], str, str]:
    """(intro, needle sentences, question, asked key) of one row."""
    if task == "passkey":
        key = _key(rng)
        return PASSKEY_INTRO, [PASSKEY_NEEDLE.format(key=key)], PASSKEY_QUESTION, key
    names = rng.sample(NAMES, rng.randint(*MULTIKEY_COUNT))
    keys: list[str] = []
    while len(keys) < len(names):  # distinct keys: the answer names one needle only
        key = _key(rng)
        if key not in keys:
            keys.append(key)
    asked = rng.randrange(len(names))
    needles = [MULTIKEY_NEEDLE.format(name=name, key=key) for name, key in zip(names, keys)]
    return MULTIKEY_INTRO, needles, MULTIKEY_QUESTION.format(name=names[asked]), keys[asked]


def _haystack_sentences(haystack_files, haystack_dataset, filler: bool, num_samples: int, length: int,
                        seed: int, expected_digests: list[list[str]] | None = None) -> tuple[list[str], bool]:
    """(sentences, contiguous): LongLoRA's filler, or `haystack_sentence_pool`'s (the user's prose or built-in)."""
    if filler:
        if haystack_files is not None or haystack_dataset is not None:
            raise ValueError("filler=True is LongLoRA's repeated filler sentence: it takes no haystack files or dataset")
        return split_sentences(FILLER), True
    return haystack_sentence_pool("titans_needle", haystack_files, haystack_dataset, num_samples, length, seed,
                                  expected_digests)


def _join(intro: str, haystack: list[str], needles: list[str], gaps: list[int], task: str) -> str:
    """The input: the intro, then the haystack with each needle before haystack sentence `gaps[k]`; the passkey
    stands on its own line as in LongLoRA's prompt, the multi-key needles sit between sentences as in RULER's."""
    if task == "passkey":
        before, after = " ".join(haystack[: gaps[0]]), " ".join(haystack[gaps[0]:])
        return "\n".join([intro, before, needles[0], after])
    pieces = list(haystack)
    for gap, needle in sorted(zip(gaps, needles), key=lambda pair: -pair[0]):
        pieces.insert(gap, needle)
    return intro + "\n" + " ".join(pieces)


def generate_needle_row(task: str, index: int, length: int, tokenizer, seed: int, sentences: list[str],
                        counts: list[int], contiguous: bool) -> dict[str, object]:
    """Row `index` of a set: its needles at seeded depths of a haystack that keeps the input within `length`
    tokens (the last haystack sentences dropped while it measures more)."""
    rng = _row_random(task, length, seed, index)
    intro, needles, question, key = _needles(task, rng)
    fixed = sum(token_counts(tokenizer, [intro, *needles])) + len(needles) + 2
    haystack = draw_haystack(sentences, counts, length - fixed, contiguous, rng) if length > fixed else []
    gaps = [rng.randint(0, len(haystack)) for _ in needles]
    while True:
        text = _join(intro, haystack, needles, gaps, task)
        measured = token_counts(tokenizer, [text], leading_space=False)[0]
        if measured <= length:
            break
        if not haystack:
            raise ValueError(f"length={length} is shorter than a {task} row without any haystack ({measured} tokens "
                             "of this tokenizer): use a larger length")
        haystack.pop()
        gaps = [min(gap, len(haystack)) for gap in gaps]
    return {"input": text, "question": question, "target": key, "needle_char": text.index(key)}


def iter_needle_batches(
    task: str,
    num_samples: int,
    length: int,
    tokenizer,
    seed: int = 0,
    haystack_files: str | Path | Sequence[str | Path] | None = None,
    row_indices: Sequence[int] | None = None,
    batch_size: int = 256,
    haystack_dataset: HaystackDataset | None = None,
    filler: bool = False,
    expected_haystack_digests: list[list[str]] | None = None,
) -> Iterator[list[dict[str, object]]]:
    """`generate_needle` in batches of rows; the haystack is read and token-counted once for all of them (and
    refused unless its digests are ``expected_haystack_digests``, a cache key's, when given)."""
    if task not in NEEDLE_TASKS:
        raise ValueError(f"task={task!r}: the needle generator writes {list(NEEDLE_TASKS)}")
    if not tokenizer.is_fast:
        raise ValueError("generate_needle needs a fast (Rust) tokenizer to count tokens quickly")
    if num_samples < 1 or length < 1:
        raise ValueError(f"num_samples={num_samples} and length={length} must be at least 1")
    indices = checked_row_indices(num_samples, row_indices)
    sentences, contiguous = _haystack_sentences(haystack_files, haystack_dataset, filler, num_samples, length, seed,
                                                expected_haystack_digests)
    counts = token_counts(tokenizer, sentences)
    for start in range(0, len(indices), batch_size):
        yield [generate_needle_row(task, index, length, tokenizer, seed, sentences, counts, contiguous)
               for index in indices[start : start + batch_size]]


def generate_needle(
    task: str,
    num_samples: int,
    length: int,
    tokenizer,
    seed: int = 0,
    haystack_files: str | Path | Sequence[str | Path] | None = None,
    row_indices: Sequence[int] | None = None,
    haystack_dataset: HaystackDataset | None = None,
    filler: bool = False,
) -> list[dict[str, object]]:
    """Generate needle rows `{"input", "question", "target", "needle_char"}` of `task` ("passkey" or "mk").

    `input` is at most `length` tokens of `tokenizer` (no special tokens). The haystack is contiguous text from a
    seeded start of `haystack_files` (text files, folders of `*.txt`) or of `haystack_dataset`, else built-in prose;
    `filler=True` uses LongLoRA's filler sentence instead. The needle sits at a seeded depth (a uniform sentence gap);
    a multi-key row holds 4-8 needles at seeded gaps and asks one.
    """
    batches = iter_needle_batches(task, num_samples, length, tokenizer, seed, haystack_files, row_indices,
                                  haystack_dataset=haystack_dataset, filler=filler)
    return [row for batch in batches for row in batch]
