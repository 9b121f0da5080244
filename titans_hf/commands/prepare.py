"""`titans-hf prepare`: tokenize .txt / .jsonl files or a `datasets` dataset into an .h5 or .bin token store."""

from __future__ import annotations

import argparse
from typing import Any

from titans_hf.data import prepare as prepare_module
from titans_hf.data.windows import TRAIN_TYPE_KEYS

from .arguments import local_or_hub


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "prepare",
        help="tokenize your documents (text, chats, preference pairs, groups) into a token store to train on",
        description="Tokenize your documents once, into a token store that `titans-hf train --dataset titans_tokens` "
        "and `titans-hf eval --lm` read in windows of many chunks. Plain text (.txt files, one document each, or a "
        "text field of .jsonl / a datasets dataset) for seq; chats (messages, rendered with the tokenizer's chat "
        "template, loss on the assistant turns only), prompt + completion or prompt + response records for sft; "
        "prompt / chosen / rejected for dpo; prompt / responses / rewards for grpo. The store is written whole or "
        "not at all, and an existing one is replaced only with --overwrite.",
    )
    parser.add_argument("inputs", nargs="*", help=".txt / .jsonl files")
    parser.add_argument("--output", "-o", required=True, help="store path: NAME.h5, or a directory for .bin + meta.json")
    parser.add_argument("--tokenizer", required=True, type=local_or_hub,
                        help="the tokenizer of the model you will train: Hub id or local folder")
    processing = parser.add_argument_group("data and processing")
    parser.add_argument(
        "--train-type", default="seq", choices=list(TRAIN_TYPE_KEYS),
        help="seq: text; sft: records with messages (chat template), prompt + completion, or prompt + response; "
        "dpo: prompt?, chosen, rejected; grpo: prompt, responses, rewards",
    )
    processing.add_argument("--text-field", default="text", help="field holding the text (seq)")
    processing.add_argument("--dataset", default=None, help="datasets name or path to load instead of input files")
    processing.add_argument("--dataset-split", default="train")
    processing.add_argument("--num-proc", type=int, default=1)
    processing.add_argument("--batch-size", type=int, default=256, help="units per tokenizer call")
    processing.add_argument("--shard-tokens", type=int, default=None, help="start a new shard after this many tokens")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing output, only if it is a token store prepare wrote (never other files or an input)",
    )
    parser.set_defaults(func=prepare_command)


def prepare_command(args: argparse.Namespace) -> int:
    inputs: Any = args.inputs
    if args.dataset is not None:
        if inputs:
            raise ValueError("pass input files or --dataset, not both")
        import datasets

        inputs = datasets.load_dataset(args.dataset, split=args.dataset_split)
    elif not inputs:
        raise ValueError("no inputs: pass .txt/.jsonl files or --dataset")
    paths = prepare_module.prepare(
        inputs,
        args.output,
        args.tokenizer,
        train_type=args.train_type,
        text_field=args.text_field,
        num_proc=args.num_proc,
        batch_size=args.batch_size,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
    )
    for path in paths:
        print(path)
    return 0
