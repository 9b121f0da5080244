"""What every `titans-hf` parser shares: the types of lengths and of models given by path or Hub id, the flags that
load a model for evaluation, and one spelling of the flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from titans_hf.modeling.memory_folder import is_hub_id
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


def add_model_arguments(parser: argparse.ArgumentParser, device_default: str | None, device_help: str
                        ) -> argparse._ArgumentGroup:
    """The group "the model" of the commands that load a memory to evaluate it (`load_model_for_eval`'s inputs):
    --model, --memory, --tokenizer, --dtype, --device."""
    group = parser.add_argument_group("the model")
    group.add_argument("--model", required=True, type=local_or_hub,
                       help="a memory folder or Hub id (it names its base), a base Qwen (with --memory), or a full "
                       "TitansQwen folder")
    group.add_argument("--memory", default=None, type=local_or_hub,
                       help="memory folder or Hub id, to put on the --model base")
    group.add_argument("--tokenizer", default=None, type=local_or_hub,
                       help="tokenizer name or path (default: the base model's)")
    group.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    group.add_argument("--device", default=device_default, help=device_help)
    return group


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
