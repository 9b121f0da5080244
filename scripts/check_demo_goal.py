"""Whether a CPU demo's evaluation meets the project's length goal (`scripts/demo.sh`, `titans-hf demo`).

The goal, checked on every evaluated length of at least 4 chunks: with the memory >= 95 % up to 256 chunks, >= 90 %
up to 1,024 and >= 80 % beyond; on the rows where the last place mentioned is wrong, within 5 points of all rows; the
same weights without the memory within 10 points of chance. The demo writes 4 memory updates a chunk (chunks of 32
tokens, an update every 8): 256 chunks are the updates of a 65k-token input of the 32k recipe (chunks of 4096, an
update every 64 tokens), 1,024 chunks of a 262k one, 4,096 chunks of a 1M one. Prints one line per length and exits
with 1 when a length misses the goal; the results file is only read.

    python scripts/check_demo_goal.py outputs/demo                 # the demo's folder, or
    python scripts/check_demo_goal.py outputs/eval/results.json    # the results.json of titans-hf eval --generate
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

RESULTS_NAME = "results.json"
# The floors of the length goal: accuracy with the memory needed up to each chunk count (the last one beyond it).
LENGTH_GOALS = ((256, 0.95), (1024, 0.90), (None, 0.80))
# Lengths shorter than this many chunks are not part of the goal.
FIRST_CHUNKS = 4


def read_results(path: str | Path) -> dict[str, Any]:
    """The results of a BABILong evaluation with its memory-off ablation: `path` is a results.json or a folder
    holding one. Anything else is a ValueError (or an OSError) naming the file and what is wrong."""
    path = Path(path)
    file = path / RESULTS_NAME if path.is_dir() else path
    try:
        results = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{file}: no such file (give a demo's folder or an evaluation's {RESULTS_NAME})"
                                ) from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not a JSON results file ({error})") from error
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


def main(argv: list[str] | None = None) -> int:
    """Print the goal's lines for the results named on the command line; 0 when every length meets it, else 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help=f"a demo's output folder, or a {RESULTS_NAME} with the memory-off ablation")
    args = parser.parse_args(argv)
    try:
        results = read_results(args.results)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    lines = goal_report(results, results["chunk_size"])
    if not lines:
        parser.error(f"{args.results}: no evaluated length of {FIRST_CHUNKS} chunks or more; nothing to check")
    print("\n".join(lines))
    return 0 if all(line.endswith(": met") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
