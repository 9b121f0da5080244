"""The ``titans-hf`` command: one subcommand per job, each a thin layer over a Python function."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titans-hf", description=__doc__)
    subcommands = parser.add_subparsers(dest="command", required=True)
    # Each subcommand module adds its parser here and sets `func` (a callable taking the Namespace).
    del subcommands
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
