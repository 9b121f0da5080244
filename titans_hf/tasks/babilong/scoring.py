"""Scoring BABILong answers: exact match, BABILong's label substring, and the recency baseline.

A model can score well on BABILong without any memory by answering the location mentioned last, so every score
comes with what that recency guess gets and the accuracy on the rows where the answer is *not* the last label in
the text: only there does a gain show that the memory carried a fact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from .generate import ACTORS, DROP_VERBS, LOCATIONS, MOVE_VERBS, OBJECTS, PICK_VERBS

# BABILong's own label sets (booydar/babilong, babilong/metrics.py, TASK_LABELS); the tasks it lists no set for
# (qa8, qa11-qa20) are scored against the distinct targets of the rows (see `task_labels`).
TASK_LABELS: dict[str, list[str]] = {
    "qa1": list(LOCATIONS),
    "qa2": list(LOCATIONS),
    "qa3": list(LOCATIONS),
    "qa4": list(LOCATIONS),
    "qa5": ["Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"],
    "qa6": ["no", "yes"],
    "qa7": ["none", "one", "two"],
    "qa9": ["no", "yes"],
    "qa10": ["maybe", "no", "yes"],
}
LABELS_FROM_BABILONG = "BABILong's label set of the task"
LABELS_FROM_TARGETS = "the distinct targets of the rows scored (BABILong publishes no label set for this task)"


def task_labels(task: str, rows: Sequence[Mapping[str, str]]) -> tuple[list[str], str]:
    """(labels, where they come from): BABILong's published set of ``task``, else the distinct targets of ``rows``
    (lowercased, sorted), which is what an unknown task can be scored against."""
    if task in TASK_LABELS:
        return list(TASK_LABELS[task]), LABELS_FROM_BABILONG
    return sorted({row["target"].strip().lower() for row in rows}), LABELS_FROM_TARGETS


def _first_word(text: str) -> str:
    words = text.strip().split()
    return words[0].strip(".,;:!?\"'()").lower() if words else ""


def score_exact_match(prediction: str, target: str) -> bool:
    """The first generated word, without punctuation and case, equals the target (fine-tuned systems' metric)."""
    return _first_word(prediction) == target.strip().lower()


def score_label_substring(prediction: str, target: str, labels: Sequence[str], question: str = "") -> bool:
    """BABILong's scoring: right when the target is the only task label in the output.

    Labels named in the question (QA3's "before the kitchen") are not counted, as in BABILong.
    """
    output, question = prediction.lower(), question.lower()
    mentioned = {label.lower() for label in labels if label.lower() in output and label.lower() not in question}
    return mentioned == {target.strip().lower()}


def last_mentioned_label(text: str, labels: Sequence[str]) -> str | None:
    """The task label (e.g. a location) named last in `text`, whole words only; None when none is named.

    This is the recency guess: for QA1 it is right whenever the person asked about was the last to move.
    """
    pattern = re.compile(r"\b(" + "|".join(re.escape(label) for label in labels) + r")\b", re.IGNORECASE)
    matches = pattern.findall(text)
    return matches[-1].lower() if matches else None


def _alternatives(words: Sequence[str]) -> str:
    return "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True))


_ACTOR, _OBJECT = f"({_alternatives(ACTORS)})", f"({_alternatives(OBJECTS)})"
_FACT = re.compile(
    rf"\b{_ACTOR} (?:(?:{_alternatives(MOVE_VERBS)}) the ({_alternatives(LOCATIONS)})\."
    rf"|(?P<pick>{_alternatives(PICK_VERBS)}) the {_OBJECT} there\."
    rf"|(?P<drop>{_alternatives(DROP_VERBS)}) the {_OBJECT} there\.)"
)
_QUESTION = {
    "qa1": re.compile(rf"^Where is {_ACTOR}\?"),
    "qa2": re.compile(rf"^Where is the {_OBJECT}\?"),
}
SUPPORTED_FACT_TASKS = tuple(_QUESTION)


def supporting_fact_spans(row: Mapping[str, str], task: str) -> list[tuple[int, int]] | None:
    """Character spans in ``row["input"]`` of the facts the answer rests on, found by replaying the bAbI story.

    QA1 ("Where is Mary?"): Mary's last move. QA2 ("Where is the apple?"): the pick-up of the apple by its latest
    holder, that holder's last move while holding it, and the drop if it was put down. None for other tasks, or when
    the story does not settle the question (a row that is not bAbI text)."""
    question = _QUESTION.get(task)
    asked = question.match(row["question"].strip()) if question else None
    if asked is None:
        return None
    last_move: dict[str, tuple[int, int]] = {}
    holder: dict[str, str | None] = {}
    support: dict[str, list[tuple[int, int]]] = {}
    for fact in _FACT.finditer(row["input"]):
        actor, span = fact.group(1), fact.span()
        if fact.group("pick"):
            obj = fact.group(4)
            holder[obj] = actor
            support[obj] = [span] + ([last_move[actor]] if actor in last_move else [])
        elif fact.group("drop"):
            obj = fact.group(6)
            holder[obj] = None
            support.setdefault(obj, []).append(span)
        else:
            last_move[actor] = span
            for obj, held_by in holder.items():
                if held_by == actor:
                    support[obj] = [support[obj][0], span]
    subject = asked.group(1)
    spans = ([last_move[subject]] if subject in last_move else None) if task == "qa1" else support.get(subject)
    return sorted(spans) if spans else None


def _mean(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def score_predictions(
    rows: Sequence[Mapping[str, str]], predictions: Sequence[str], labels: Sequence[str]
) -> dict[str, float | int | None]:
    """Exact match, label-substring accuracy, and exact match on rows whose answer is not the last label named.

    The last value is None when every row's answer is the last label named (no row can tell memory from recency).
    """
    if len(rows) != len(predictions):
        raise ValueError(f"score_predictions: {len(rows)} rows but {len(predictions)} predictions")
    exact = [score_exact_match(p, r["target"]) for r, p in zip(rows, predictions)]
    substring = [score_label_substring(p, r["target"], labels, r["question"]) for r, p in zip(rows, predictions)]
    not_last = [
        hit for hit, row in zip(exact, rows) if last_mentioned_label(row["input"], labels) != row["target"].strip().lower()
    ]
    return {
        "exact_match": _mean(exact),
        "label_substring": _mean(substring),
        "exact_match_not_last_location": _mean(not_last),
    }


def last_location_baseline(rows: Sequence[Mapping[str, str]], labels: Sequence[str]) -> dict[str, float | int]:
    """What answering the last label named in the input scores, and how many rows that guess gets wrong."""
    guesses = [last_mentioned_label(row["input"], labels) for row in rows]
    right = [guess == row["target"].strip().lower() for guess, row in zip(guesses, rows)]
    return {"accuracy": sum(right) / len(rows), "num_not_last_location": len(rows) - sum(right)}
