"""`titans-hf train`: train a memory on BABILong or on token stores; the flags are `HfArgumentParser` dataclasses
(model, memory, data, training), in that order of groups. Also the entry of `accelerate launch scripts/train.py` and
`accelerate launch -m titans_hf.commands.train`."""

from __future__ import annotations

import argparse
import logging
import sys

from transformers import HfArgumentParser

from titans_hf.tasks.babilong import length_tokens
from titans_hf.training.recipe import (
    RecipeTrainingArguments,
    DataArguments,
    MemoryArguments,
    ModelArguments,
    train_memory,
)

from .arguments import local_or_hub

DESCRIPTION = (
    "Train a Titans memory on a frozen pretrained Qwen: BABILong rows (published files, or generated) or windows of "
    "your token stores (--dataset titans_tokens), through TitansTrainer; checkpoints and the final folder hold the "
    "memory only, and load with AutoModelForCausalLM.from_pretrained. Most runs set --model_name_or_path, "
    "--data_files, --output_dir, --chunk_size, --max_length (BABILong) or --window_size (token stores), "
    "--max_steps or --num_train_epochs, --learning_rate, --per_device_train_batch_size, "
    "--gradient_accumulation_steps, --save_steps, --bf16 and --resume_from_checkpoint last; the Trainer's other "
    "flags are in the last group. Flags can also come from one .json or .yaml file."
)
# Flags whose values are lengths in tokens: they take 4k for 4096 too (HfArgumentParser reads them as int).
LENGTH_FLAGS = ("max_length", "answer_reserve_tokens", "window_size", "stride", "generate_lengths", "chunk_size",
                "memory_chunk_size", "memory_batch_size")


def register(subcommands: argparse._SubParsersAction) -> None:
    # HfArgumentParser owns the flags: they pass through untouched.
    parser = subcommands.add_parser(
        "train",
        add_help=False,
        help="train a memory on a frozen Qwen, on BABILong or on token stores of your documents",
    )
    parser.set_defaults(func=lambda args: main(args.forwarded), forwards_unknown_args=True)


def lengths_in_tokens(argv: list[str]) -> list[str]:
    """The values of LENGTH_FLAGS as token counts (`--window_size 4k` -> `--window_size 4096`); anything else, and
    a value that is no length, as given (the parser then names it)."""
    converted, in_length_flag = [], False
    for token in argv:
        if token.startswith("--"):
            name, equals, value = token.partition("=")
            in_length_flag = name[2:].replace("-", "_") in LENGTH_FLAGS
            if in_length_flag and equals:
                token, in_length_flag = f"{name}={length_tokens(value) or value}", False
        elif in_length_flag:
            token = str(length_tokens(token) or token)
        converted.append(token)
    return converted


def parse_arguments(argv: list[str] | None = None) -> tuple:
    """(model, memory, data, training) arguments from command-line flags, or from one .json / .yaml file."""
    parser = HfArgumentParser((ModelArguments, MemoryArguments, DataArguments, RecipeTrainingArguments),
                              prog="titans-hf train", description=DESCRIPTION,
                              usage="titans-hf train --model_name_or_path MODEL [FLAGS ...] | titans-hf train ARGS.json")
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        arguments = parser.parse_json_file(argv[0])
    elif len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        arguments = parser.parse_yaml_file(argv[0])
    else:
        arguments = parser.parse_args_into_dataclasses(args=lengths_in_tokens(argv))
    model_args, _, data_args, _ = arguments
    for flag, value in (("--model_name_or_path", model_args.model_name_or_path),
                        ("--tokenizer_name_or_path", data_args.tokenizer_name_or_path)):
        try:
            value is None or local_or_hub(value)
        except argparse.ArgumentTypeError as error:
            parser.error(f"{flag}: {error}")
    return arguments


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
