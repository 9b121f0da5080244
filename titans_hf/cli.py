"""The ``titans-hf`` command: one subcommand per job, each a thin layer over a Python function."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titans_hf.data.babilong import add_babilong_parser
from titans_hf.data.prepare import add_prepare_parser
from titans_hf.evaluation import add_eval_parser


def push(args: argparse.Namespace) -> int:
    from titans_hf.hub import push_memory_folder

    results = None
    if args.results is not None:
        try:
            results = json.loads(Path(args.results).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{args.results}: not valid JSON ({error})") from error
    commit_url = push_memory_folder(
        args.folder,
        args.repo_id,
        endpoint=args.endpoint,
        private=args.private,
        commit_message=args.commit_message,
        results=results,
    )
    print(commit_url)
    return 0


def add_push_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "push",
        help="upload a save_memory folder (weights, config, model card) to a Hub model repository",
        # No --token: a token typed on the command line ends up in shell history.
        description="Upload memory_model.safetensors, memory_config.json and a rendered README.md to the Hub. "
        "The token comes from HF_TOKEN or `hf auth login`.",
    )
    parser.add_argument("folder", help="folder written by model.save_memory")
    parser.add_argument("repo_id", help="Hub model repository, e.g. your-name/qwen-titans-memory")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--results", default=None, help="evaluation JSON from `titans-hf eval` for the card's table")
    parser.add_argument("--commit-message", default=None)
    parser.set_defaults(func=push)


def train(args: argparse.Namespace) -> int:
    from titans_hf.training.train_babilong import main as train_main

    return train_main(args.forwarded)


def add_train_parser(subcommands: argparse._SubParsersAction) -> None:
    # HfArgumentParser owns the flags (model, data and training dataclasses): they pass through untouched.
    parser = subcommands.add_parser(
        "train",
        add_help=False,
        help="train the memory on BABILong, same flags as scripts/train_babilong.py (`titans-hf train --help`)",
    )
    parser.set_defaults(func=train, forwards_unknown_args=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titans-hf", description=__doc__)
    subcommands = parser.add_subparsers(dest="command", required=True)
    # Each subcommand module adds its parser here and sets `func` (a callable taking the Namespace).
    add_push_parser(subcommands)
    add_prepare_parser(subcommands)
    add_babilong_parser(subcommands)
    add_eval_parser(subcommands)
    add_train_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "forwards_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.forwarded = unknown
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
