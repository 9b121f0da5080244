"""What every `titans-hf` parser shares: the types of lengths and of models given by path or Hub id, and one
spelling of the flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from titans_hf.hub import is_hub_id
from titans_hf.tasks.babilong import length_tokens


def length(text: str) -> int:
    """A length in tokens as flags take it: 3500, or 4k (4096), 1M."""
    tokens = length_tokens(text)
    if tokens is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length in tokens (e.g. 3500, or 4k = 4096)")
    return tokens


def local_or_hub(text: str) -> str:
    """A model, memory or tokenizer: a local path, which must exist, or a Hub repository id. A path that is not
    there (a Hub id cannot have it: several slashes, or a first part that is a local folder) is named as missing."""
    path = Path(text)
    if not path.exists() and (not is_hub_id(text) or Path(path.parts[0]).is_dir()):
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder (nor a Hub repository id)")
    return text


def one_spelling(argv: list[str]) -> list[str]:
    """Flags as the parsers declare them: `--a_b` read as `--a-b` (HfArgumentParser, behind `train`, takes both)."""
    normalized = []
    for index, token in enumerate(argv):
        if token == "--":
            return normalized + argv[index:]
        if token.startswith("--"):
            name, equals, value = token.partition("=")
            token = name.replace("_", "-") + equals + value
        normalized.append(token)
    return normalized
