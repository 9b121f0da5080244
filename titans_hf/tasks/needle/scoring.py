"""Where a needle row's key lies in the prompt, and exact match of a generated key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from titans_hf.data.tokenizers import plain_backend_tokenizer

from .generate import PROMPT_TEMPLATE

_DIGITS = re.compile(r"\d+")


class NeedlePlace(NamedTuple):
    """Token indices in a row's prompt (special tokens included, as the model reads it)."""

    needle: int | None  # the asked key's first token in the haystack; None when the input does not hold the key
    question: int  # the first token after the input (where the question starts)
    prompt_tokens: int  # tokens of the whole prompt
    special_prefix: int  # special tokens in front of the text (a BOS), never cut by truncation


def needle_token(row: Mapping[str, object], tokenizer, template: str = PROMPT_TEMPLATE) -> NeedlePlace:
    """Where the asked key lies in the prompt of `row`: at `row["needle_char"]` of the input (a generated row), else
    where the target first appears in it (a row of another harness: the passkey needle is the first place that names
    the key, and a multi-key row names each key once)."""
    text, target = str(row["input"]), str(row["target"]).strip()
    prompt = template.format(input=text, question=row["question"])
    encoding = plain_backend_tokenizer(tokenizer).encode(prompt, add_special_tokens=True)
    special = encoding.special_tokens_mask
    prefix = next((i for i, is_special in enumerate(special) if not is_special), len(special))
    at = int(row["needle_char"]) if "needle_char" in row else text.find(target)
    needle = None
    if at >= 0 and target:
        needle = next((token for char in range(at, at + len(target))
                       if (token := encoding.char_to_token(char)) is not None), None)
    question = next(token for char in range(len(text), len(prompt)) if (token := encoding.char_to_token(char)) is not None)
    return NeedlePlace(needle, question, len(encoding.ids), prefix)


def score_key(prediction: str, target: str) -> bool:
    """Exact match of a key: the first number in the generated text is the target's ("68231", " 68231." and
    "68231 is the pass key" are right; "6823", "682310" and "68213" are not)."""
    found = _DIGITS.search(prediction)
    return found is not None and found.group() == target.strip()
