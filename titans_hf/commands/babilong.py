"""`titans-hf babilong generate`: write a generated BABILong set as a JSON file (and optionally its dataset card)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from titans_hf.data.tokenizers import check_tokenizer_argument
from titans_hf.outputs import check_outputs, record_outputs
from titans_hf.tasks.babilong import (
    GENERATED_TASKS,
    dataset_card_path,
    generate_babilong,
    write_babilong_json,
    write_dataset_card,
)
from titans_hf.tasks.babilong.generate import HaystackDataset

from .arguments import length, local_or_hub


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "babilong", help="write BABILong question-answering rows (facts hidden in long filler text), offline",
        description="BABILong (Kuratov et al. 2024): a question about facts scattered through a long haystack of "
        "filler text; the memory has to carry the facts to the question.")
    actions = parser.add_subparsers(dest="babilong_command", required=True)
    generate = actions.add_parser(
        "generate",
        help="generate BABILong QA1/QA2/QA3 rows offline and write them as BABILong JSON",
        description="Generate bAbI stories hidden in a haystack of LENGTH tokens of TOKENIZER; "
        "the same arguments always give the same file.",
    )
    generate.add_argument("--task", required=True, choices=GENERATED_TASKS)
    generate.add_argument("--length", required=True, type=length,
                          help="tokens of each row's input, e.g. 4000 or 4k (0 = the story alone)")
    generate.add_argument("--num-samples", required=True, type=int)
    generate.add_argument("--tokenizer", required=True, type=local_or_hub,
                          help="the tokenizer that counts the length (your model's): Hub id or local folder")
    generate.add_argument("--seed", type=int, default=0)
    add_haystack_arguments(generate)
    generate.add_argument("--output", required=True, help="JSON file to write, e.g. data/qa1/4k.json")
    generate.add_argument("--card", action="store_true", help="also write a dataset card README.md beside it")
    generate.add_argument("--overwrite", action="store_true",
                          help="replace an existing output file (and README.md with --card); without it they are kept")
    generate.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    output = Path(args.output)
    check_outputs([output, dataset_card_path(output)] if args.card else [output], args.overwrite)
    check_tokenizer_argument(args.tokenizer, "--tokenizer")
    haystack = haystack_from_arguments(args)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    rows = generate_babilong(args.task, args.num_samples, args.length, tokenizer, args.seed, show_progress=True,
                             **haystack)
    output = write_babilong_json(rows, output)
    written = [output.name]
    if args.card:
        settings = {
            "task": args.task, "length": args.length, "num_samples": args.num_samples, "seed": args.seed,
            "tokenizer": args.tokenizer, "haystack_files": args.haystack or [], "files": output.name,
            "haystack_dataset": None if haystack["haystack_dataset"] is None else {
                "path": args.haystack_dataset, "data_files": args.haystack_data_files or [],
                "split": args.haystack_split or "train", "column": args.haystack_column or "text"},
        }
        try:
            written.append(write_dataset_card(output, settings).name)
        except BaseException:  # no half of the outputs: the data file goes with the card that failed
            output.unlink(missing_ok=True)
            raise
    record_outputs(output.parent, written, "titans-hf babilong generate")
    print(output)
    return 0


def add_haystack_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, when: str = "") -> None:
    """The flags that choose a generated haystack: --haystack (files, folders), or --haystack-dataset and its
    --haystack-data-files, --haystack-split, --haystack-column. `when` ends each help text (e.g. " (--generate)")."""
    parser.add_argument("--haystack", nargs="+", default=None,
                        help="text files or folders (every *.txt under a folder, in sorted order), e.g. PG-19 "
                        f"books, for the haystack; default: built-in distractor prose{when}")
    parser.add_argument("--haystack-dataset", default=None,
                        help="a datasets split for the haystack instead: what load_dataset takes as its path (json, "
                        f"text, parquet or csv with --haystack-data-files, a folder, a Hub id), read streaming{when}")
    parser.add_argument("--haystack-data-files", nargs="+", default=None,
                        help=f"the files of --haystack-dataset (load_dataset's data_files){when}")
    parser.add_argument("--haystack-split", default=None, help=f"the split of --haystack-dataset (default train){when}")
    parser.add_argument("--haystack-column", default=None,
                        help=f"the column of --haystack-dataset that holds the text (default text){when}")


def haystack_from_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """`generate_babilong`'s haystack_files and haystack_dataset from the flags of `add_haystack_arguments`; flags
    of a dataset given without --haystack-dataset, or both sources at once, are a ValueError naming the flags."""
    dataset_flags = {"--haystack-data-files": args.haystack_data_files, "--haystack-split": args.haystack_split,
                     "--haystack-column": args.haystack_column}
    if args.haystack_dataset is None:
        stray = [flag for flag, value in dataset_flags.items() if value is not None]
        if stray:
            raise ValueError(f"{' '.join(stray)}: describe a --haystack-dataset, and none is given")
        return {"haystack_files": args.haystack, "haystack_dataset": None}
    if args.haystack:
        raise ValueError("--haystack and --haystack-dataset: the haystack comes from one of them, not both")
    dataset = HaystackDataset(args.haystack_dataset, args.haystack_data_files, args.haystack_split,
                              args.haystack_column or "text")
    return {"haystack_files": None, "haystack_dataset": dataset}
