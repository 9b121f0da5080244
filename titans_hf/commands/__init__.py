"""The `titans-hf` command: one module per subcommand (`register(subcommands)` adds its parser and sets `func`, a
callable of the parsed Namespace returning the exit status); `arguments` holds what the parsers share. A task's own
subcommand (`titans-hf babilong`, `titans-hf recall`) is the module its `Task` names (`titans_hf.tasks.TASKS`)."""

from __future__ import annotations

import argparse
import importlib
import sys

from huggingface_hub.errors import OfflineModeIsEnabled

from titans_hf import __version__
from titans_hf.tasks import all_tasks

from . import demo, evaluate, lm_harness, prepare, push, train
from .arguments import one_spelling

TASK_SUBCOMMANDS = tuple(importlib.import_module(task.command) for task in all_tasks() if task.command)
SUBCOMMANDS = (prepare, *TASK_SUBCOMMANDS, train, evaluate, lm_harness, push, demo)
DESCRIPTION = ("Give a pretrained Qwen a Titans long-term memory, so it reads inputs far longer than its attention "
               "window, and measure what the memory buys.")
EPILOG = ("`titans-hf COMMAND --help` says what each flag does. Every flag takes both spellings (--window-size and "
          "--window_size), lengths take 4k for 4096 tokens, and a usage error is one line, not a traceback.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titans-hf", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; its errors propagate (what tests and callers from Python see)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(one_spelling(sys.argv[1:] if argv is None else argv))
    if unknown and not getattr(args, "forwards_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.forwarded = unknown
    return int(args.func(args) or 0)


def cli() -> None:
    """The `titans-hf` program: what a user did wrong (a bad setting, a missing file, an output it may not replace
    or a folder it cannot write, offline) is one line on stderr and exit status 2; anything else keeps its
    traceback."""
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError, IsADirectoryError, PermissionError,
            OfflineModeIsEnabled) as error:
        print(f"titans-hf: error: {error}", file=sys.stderr)
        sys.exit(2)
