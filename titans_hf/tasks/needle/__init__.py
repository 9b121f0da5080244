"""The needle in a haystack: a key hidden at a seeded depth of long prose, asked at the end. The passkey prompt of the
Landmark-attention and LongLoRA papers, word for word, and RULER's multi-key variant (4-8 keys, one asked).

`generate` writes rows offline, `builder` is the `titans_needle` builder (training examples, loss on the key and the
period ending it, assembled by BABILong's code), `scoring` finds the key in a prompt and scores an answer,
`evaluation` measures exact match with the memory on, off and swapped with another row's (see docs/needle.md).
"""

from .generate import (
    FILLER,
    MULTIKEY_INTRO,
    MULTIKEY_NEEDLE,
    MULTIKEY_QUESTION,
    NEEDLE_TASKS,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    PROMPT_TEMPLATE,
    generate_needle,
    iter_needle_batches,
)
from .scoring import NeedlePlace, needle_token, score_key

__all__ = [
    "FILLER",
    "MULTIKEY_INTRO",
    "MULTIKEY_NEEDLE",
    "MULTIKEY_QUESTION",
    "NEEDLE_TASKS",
    "NeedlePlace",
    "PASSKEY_INTRO",
    "PASSKEY_NEEDLE",
    "PASSKEY_QUESTION",
    "PROMPT_TEMPLATE",
    "generate_needle",
    "iter_needle_batches",
    "needle_token",
    "score_key",
]
