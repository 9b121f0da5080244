"""The recall recipe's results (scripts/recall.sh): a table, recall_summary.json and recall.png in OUTPUT_DIR.

For every trained memory below OUTPUT_DIR (a folder holding lm_all_tokens/ and lm_recalled_values/, the two
`titans-hf eval --lm` runs): the loss on the recalled values (the tokens that depend on an earlier chunk) with the
memory and without it on the same weights, the first chunk's loss on every token (and its change with the memory:
a lower loss is a negative change), and the loss of the first tokens of every later chunk.
`scripts/check_demo_goal.py OUTPUT_DIR` checks the runs of recall_summary.json against the recipe's goal.

    python scripts/recall_report.py outputs/recall
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titans_hf.files import atomic_write, atomic_write_json  # noqa: E402


def summarize(run: Path) -> dict:
    every = json.loads((run / "lm_all_tokens" / "lm_results.json").read_text())
    recalled = json.loads((run / "lm_recalled_values" / "lm_results.json").read_text())
    ratio = recalled["ratio"]["after_first_chunk"]
    first_chunk_change = every["ratio"]["first_chunk"] - 1
    config = json.loads((run / "memory_config.json").read_text())
    return {
        "run": run.name,
        "attention": "previous chunk too" if config.get("attend_previous_chunk") else "chunk-local",
        "recalled_memory": recalled["memory"]["loss_after_first_chunk"],
        "recalled_no_memory": recalled["no_memory"]["loss_after_first_chunk"],
        "recalled_ratio": ratio,
        "recalled_tokens": sum(recalled["memory"]["tokens"]),
        "first_chunk_memory": every["memory"]["loss_first_chunk"],
        "first_chunk_no_memory": every["no_memory"]["loss_first_chunk"],
        "first_chunk_change": first_chunk_change,
        "later_chunks_memory": every["memory"]["loss_after_first_chunk"],
        "later_chunks_no_memory": every["no_memory"]["loss_after_first_chunk"],
        "chunk_starts_memory": every["memory"]["loss_chunk_starts"],
        "chunk_starts_no_memory": every["no_memory"]["loss_chunk_starts"],
        "boundary_tokens": every["boundary_tokens"],
        "chunk_size": every["chunk_size"],
        "recalled_per_chunk": {mode: recalled[mode]["loss"] for mode in ("memory", "no_memory")},
        "all_tokens_per_chunk": {mode: every[mode]["loss"] for mode in ("memory", "no_memory")},
    }


def table(rows: list[dict]) -> str:
    header = ["run", "attention", "recalled: memory", "off", "ratio", "first chunk: memory", "off", "change",
              "later chunks: memory", "off", "chunk starts: memory", "off"]
    lines = [header]
    for row in rows:
        lines.append([row["run"], row["attention"], f"{row['recalled_memory']:.3f}", f"{row['recalled_no_memory']:.3f}",
                      f"{row['recalled_ratio']:.3f}", f"{row['first_chunk_memory']:.3f}",
                      f"{row['first_chunk_no_memory']:.3f}", f"{100 * row['first_chunk_change']:+.2f}%",
                      f"{row['later_chunks_memory']:.3f}", f"{row['later_chunks_no_memory']:.3f}",
                      f"{row['chunk_starts_memory']:.3f}", f"{row['chunk_starts_no_memory']:.3f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for axis, key, title in ((axes[0], "recalled_per_chunk", "recalled values (depend on an earlier chunk)"),
                             (axes[1], "all_tokens_per_chunk", "every token")):
        for row in rows:
            for mode, style in (("memory", "-o"), ("no_memory", "--s")):
                points = [(i, loss) for i, loss in enumerate(row[key][mode]) if loss is not None]
                label = f"{row['attention']}: {'with memory' if mode == 'memory' else 'memory off (same weights)'}"
                axis.plot([i for i, _ in points], [loss for _, loss in points], style, label=label)
        axis.set_xlabel(f"chunk index (chunks of {rows[0]['chunk_size']} tokens)")
        axis.set_ylabel("loss per token")
        axis.set_title(title)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120))
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    runs = sorted(path.parent.parent for path in out.glob("*/lm_recalled_values/lm_results.json")
                  if (path.parent.parent / "lm_all_tokens" / "lm_results.json").is_file())
    if not runs:
        raise SystemExit(f"{out}: no run with lm_all_tokens/ and lm_recalled_values/ results below it")
    rows = [summarize(run) for run in runs]
    print(table(rows))
    atomic_write_json(out / "recall_summary.json", rows)
    plot(rows, out / "recall.png")
    print(f"wrote {out / 'recall_summary.json'} and {out / 'recall.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
