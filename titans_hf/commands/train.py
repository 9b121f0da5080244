"""`titans-hf train`: train a memory on BABILong or on token stores; the flags are `HfArgumentParser` dataclasses
(model, memory, data, training). Also the entry of `accelerate launch scripts/train.py` and
`accelerate launch -m titans_hf.commands.train`."""

from __future__ import annotations

import argparse
import logging
import sys

from transformers import HfArgumentParser

from titans_hf.training.recipe import (
    RecipeTrainingArguments,
    DataArguments,
    MemoryArguments,
    ModelArguments,
    train_memory,
)


def register(subcommands: argparse._SubParsersAction) -> None:
    # HfArgumentParser owns the flags: they pass through untouched.
    parser = subcommands.add_parser(
        "train",
        add_help=False,
        help="train a memory on BABILong or on token stores of your own documents (`titans-hf train --help`)",
    )
    parser.set_defaults(func=lambda args: main(args.forwarded), forwards_unknown_args=True)


def parse_arguments(argv: list[str] | None = None) -> tuple:
    """(model, memory, data, training) arguments from command-line flags, or from one .json / .yaml file."""
    parser = HfArgumentParser((ModelArguments, MemoryArguments, DataArguments, RecipeTrainingArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> int:
    model_args, memory_args, data_args, training_args = parse_arguments(argv)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if training_args.process_index == 0 else logging.WARNING,
    )
    train_memory(model_args, memory_args, data_args, training_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
