"""`titans-hf babilong generate`: write a generated BABILong set as a JSON file (and optionally its dataset card)."""

from __future__ import annotations

import argparse
from pathlib import Path

from titans_hf.data.tokenizers import check_tokenizer_argument
from titans_hf.outputs import check_outputs, record_outputs
from titans_hf.tasks.babilong import (
    GENERATED_TASKS,
    dataset_card_path,
    generate_babilong,
    write_babilong_json,
    write_dataset_card,
)

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
    generate.add_argument("--haystack", nargs="+", default=None, help="text files (e.g. PG19 books) for the haystack")
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
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    rows = generate_babilong(
        args.task, args.num_samples, args.length, tokenizer, args.seed, args.haystack, show_progress=True
    )
    output = write_babilong_json(rows, output)
    written = [output.name]
    if args.card:
        settings = {
            "task": args.task, "length": args.length, "num_samples": args.num_samples, "seed": args.seed,
            "tokenizer": args.tokenizer, "haystack_files": args.haystack or [], "files": output.name,
        }
        try:
            written.append(write_dataset_card(output, settings).name)
        except BaseException:  # no half of the outputs: the data file goes with the card that failed
            output.unlink(missing_ok=True)
            raise
    record_outputs(output.parent, written, "titans-hf babilong generate")
    print(output)
    return 0
