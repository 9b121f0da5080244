"""The `titans-hf` command: one module a subcommand, each a thin parser over a library function.

Each module has `register(subcommands)`, which adds its parser and sets `func` (a callable taking the parsed
Namespace, returning the exit status).
"""

from __future__ import annotations

import argparse

from . import babilong, demo, evaluate, prepare, push, recall, train

SUBCOMMANDS = (prepare, babilong, recall, train, evaluate, push, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titans-hf", description=__doc__.splitlines()[0])
    subcommands = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "forwards_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.forwarded = unknown
    return int(args.func(args) or 0)

