"""Whether a CPU demo meets the project's goal: the BABILong demo's length goal (`scripts/demo.sh`, `titans-hf demo`)
or the recall recipe's loss goal (`scripts/recall.sh`).

The length goal, checked on every evaluated length of at least 4 chunks: with the memory >= 95 % up to 256 chunks,
>= 90 % up to 1,024 and >= 80 % beyond; on the rows where the last place mentioned is wrong, within 5 points of all
rows; the same weights without the memory within 10 points of chance. The demo writes 4 memory updates a chunk
(chunks of 32 tokens, an update every 8): 256 chunks are the updates of a 65k-token input of the 32k recipe (chunks
of 4096, an update every 64 tokens), 1,024 chunks of a 262k one, 4,096 chunks of a 1M one.

The recall goal, checked on every run of `recall_summary.json` (written by `scripts/recall_report.py`): the loss on
the recalled values (the tokens that depend on an earlier chunk) with the memory at most 0.6 x the loss without it
on the same weights, and the first chunk's loss on every token no more than 2 % above the memory-off loss (the
memory must not cost the base what it does alone; a lower loss is the negative change it is).

Prints one line per length or run and exits with 1 when one misses the goal; the results file is only read.

    python scripts/check_demo_goal.py outputs/demo                 # the demo's folder
    python scripts/check_demo_goal.py outputs/eval/results.json    # the results.json of titans-hf eval --generate
    python scripts/check_demo_goal.py outputs/recall               # the recall recipe's recall_summary.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

RESULTS_NAME = "results.json"
RECALL_SUMMARY_NAME = "recall_summary.json"
# The floors of the length goal: accuracy with the memory needed up to each chunk count (the last one beyond it).
LENGTH_GOALS = ((256, 0.95), (1024, 0.90), (None, 0.80))
# Lengths shorter than this many chunks are not part of the goal.
FIRST_CHUNKS = 4
# The recall goal: the recalled values' loss with the memory over the loss without it, at most; the first chunk's
# relative change of loss (every token) against the memory-off loss, at most.
RECALL_RATIO_GOAL, RECALL_FIRST_CHUNK_GOAL = 0.6, 0.02
# What the recall goal reads of each run of a recall summary.
RECALL_FIELDS = ("recalled_memory", "recalled_no_memory", "recalled_ratio", "first_chunk_change")


def results_file(path: str | Path) -> Path:
    """The file to check: `path` itself, or in a folder its `RESULTS_NAME` (a demo's or an evaluation's), else its
    `RECALL_SUMMARY_NAME` (the recall recipe's)."""
    path = Path(path)
    if path.is_dir() and not (path / RESULTS_NAME).exists() and (path / RECALL_SUMMARY_NAME).exists():
        return path / RECALL_SUMMARY_NAME
    return path / RESULTS_NAME if path.is_dir() else path


def read_json(file: Path) -> Any:
    """`file`'s JSON; a missing file is a FileNotFoundError, anything but JSON a ValueError, each naming the file."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{file}: no such file (give a demo's folder, an evaluation's {RESULTS_NAME}, or a "
                                f"recall recipe's folder or {RECALL_SUMMARY_NAME})") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not a JSON results file ({error})") from error


def is_number(value: Any) -> bool:
    """Whether `value` is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_results(results: Any, file: Path) -> dict[str, Any]:
    """`results` (read from `file`) if they are a BABILong evaluation's with its memory-off ablation, else a
    ValueError naming the file and what is wrong."""
    chunk_size = results.get("chunk_size") if isinstance(results, dict) else None
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{file}: chunk_size {chunk_size!r} is not a number of tokens (results of a memory's "
                         "evaluation carry the model's chunk size)")
    details = results.get("details")
    if not isinstance(details, dict) or not all(isinstance(cells, dict) for cells in details.values()):
        raise ValueError(f"{file}: 'details' is not {{task: {{length: cell}}}}")
    for task, cells in details.items():
        for length, cell in cells.items():
            where = f"{file}: details.{task}.{length}"
            if not str(length).isdigit():
                raise ValueError(f"{where}: the length is not a number of tokens")
            for field in ("chance", "memory.exact_match", "no_memory.exact_match",
                          "memory.exact_match_not_last_location"):
                value: Any = cell
                for key in field.split("."):
                    if not isinstance(value, dict) or key not in value:
                        raise ValueError(f"{where}: no {field} (the goal needs the memory-off ablation)")
                    value = value[key]
                missing_allowed = field.endswith("not_last_location") and value is None
                if not missing_allowed and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                            or not 0 <= value <= 1):
                    raise ValueError(f"{where}: {field} {value!r} is not an accuracy in [0, 1]")
    return results


def goal_report(results: dict[str, Any], chunk_size: int) -> list[str]:
    """One line per evaluated length of at least `FIRST_CHUNKS` chunks of `chunk_size` tokens, in the results'
    order, ending in "met" or "NOT met" (see the module's docstring for the goal)."""
    lines = []
    for task, per_length in results["details"].items():
        for length, cell in per_length.items():
            chunks = math.ceil(int(length) / chunk_size)
            if chunks < FIRST_CHUNKS:
                continue
            needed = next(goal for limit, goal in LENGTH_GOALS if limit is None or chunks <= limit)
            memory, no_memory, chance = cell["memory"]["exact_match"], cell["no_memory"]["exact_match"], cell["chance"]
            not_last = cell["memory"]["exact_match_not_last_location"]
            met = (memory >= needed and abs(no_memory - chance) <= 0.10
                   and (not_last is None or not_last >= memory - 0.05))
            not_last_text = "-" if not_last is None else f"{100 * not_last:.1f}%"
            lines.append(f"{task} {length:>6} tokens ({chunks} chunks): memory {100 * memory:.1f}% "
                         f"(goal >= {100 * needed:.0f}%), where the last place is wrong {not_last_text} (goal within "
                         f"5 points), no memory {100 * no_memory:.1f}% (goal within 10 points of {100 * chance:.1f}%): "
                         f"{'met' if met else 'NOT met'}")
    return lines


def check_recall_summary(rows: Any, file: Path) -> list[dict[str, Any]]:
    """`rows` (read from `file`) if they are a recall summary, one run each with a name and the numbers the goal
    reads, else a ValueError naming the file and what is wrong."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{file}: not a recall summary (a list with one run each, as scripts/recall_report.py "
                         "writes it)")
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("run"), str):
            raise ValueError(f"{file}: run {index} is not an object with the run's name")
        for field in RECALL_FIELDS:
            if not is_number(row.get(field)):
                raise ValueError(f"{file}: run {row['run']!r}: {field} {row.get(field)!r} is not a number")
    return rows


def recall_goal_report(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run of a recall summary, in its order, ending in "met" or "NOT met" (see the module's docstring
    for the goal)."""
    lines = []
    for row in rows:
        ratio, change = row["recalled_ratio"], row["first_chunk_change"]
        met = ratio <= RECALL_RATIO_GOAL and change <= RECALL_FIRST_CHUNK_GOAL
        lines.append(f"{row['run']}: recalled values {row['recalled_memory']:.3f} with memory, "
                     f"{row['recalled_no_memory']:.3f} off, ratio {ratio:.3f} (goal <= {RECALL_RATIO_GOAL}); "
                     f"first chunk {100 * change:+.2f}% against memory off (goal <= "
                     f"{100 * RECALL_FIRST_CHUNK_GOAL:+.0f}%): {'met' if met else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the goal's lines for the results named on the command line; 0 when every length or run meets it,
    else 1. A JSON list is read as a recall summary, anything else as a BABILong evaluation's results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help=f"a demo's output folder, a {RESULTS_NAME} with the memory-off ablation, "
                                        f"or the recall recipe's folder or {RECALL_SUMMARY_NAME}")
    args = parser.parse_args(argv)
    file = results_file(args.results)
    try:
        content = read_json(file)
        if isinstance(content, list):
            lines = recall_goal_report(check_recall_summary(content, file))
        else:
            results = check_results(content, file)
            lines = goal_report(results, results["chunk_size"])
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if not lines:
        parser.error(f"{args.results}: no evaluated length of {FIRST_CHUNKS} chunks or more; nothing to check")
    print("\n".join(lines))
    return 0 if all(line.endswith(": met") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
