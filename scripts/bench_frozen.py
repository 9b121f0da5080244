"""Which memory integration a frozen base learns to use: variant, layer and memory depth on one fixed budget.

Stage a of the CPU demo runs once (a toy Qwen3 base pretrained and saved), or `--base` names a Qwen folder; then
every configuration runs stage b of the CPU demo (`titans-hf demo --model BASE ...`: BABILong files, the
titans-hf train code on the frozen base, the titans-hf eval function) with the same steps, seed and data, two at a
time on one thread each. Prints a table (accuracy with the memory and with it off at 4 and 8 chunks) and writes JSON.

    python scripts/bench_frozen.py --json bench_results/frozen.json
    python scripts/bench_frozen.py --entity-share 0 --only "mag, layer 0, depth 1"   # a toy base without names
    python scripts/bench_frozen.py --quick        # a smoke run: few steps, few rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titans_hf.commands.demo_job import (  # noqa: E402
    build_demo_tokenizer,
    embedding_similarity,
    pretrain_base,
)


def configurations(num_layers: int) -> dict[str, list[str]]:
    """Name -> demo flags. The reference is mag on the first layer with a linear memory; each other row changes one
    thing: the variant, the layer (middle, last; one row when they coincide), or the memory depth."""
    first, middle, last = 0, num_layers // 2, num_layers - 1
    rows = {}
    for variant in ("mag", "mal", "mac"):
        rows[f"{variant}, layer {first}, depth 1"] = ["--variant", variant, "--memory-layers", str(first)]
    for layer in (middle, last):
        rows[f"mag, layer {layer}, depth 1"] = ["--variant", "mag", "--memory-layers", str(layer)]
    rows[f"mag, layer {first}, depth 2"] = ["--variant", "mag", "--memory-layers", str(first), "--memory-depth", "2"]
    return {name: flags if "--memory-depth" in flags else [*flags, "--memory-depth", "1"]
            for name, flags in rows.items()}


def run_configuration(name: str, flags: list[str], base: str, output: Path, common: list[str]) -> dict:
    folder = output / name.replace(", ", "_").replace(" ", "")
    command = [sys.executable, "-m", "titans_hf.commands", "demo", "--model", base, "--output-dir", str(folder), *common, *flags]
    started = time.time()
    log = folder.with_suffix(".log")
    folder.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        completed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise RuntimeError(f"{name}: the demo failed (exit {completed.returncode}); see {log}")
    results = json.loads((folder / "results.json").read_text())
    info = json.loads((folder / "run.json").read_text())
    task = info["task"]
    return {
        "name": name,
        "seconds": round(time.time() - started, 1),
        "steps": info["steps"],
        "trainable_parameters": info["trainable_parameters"]["memory"],
        "base_unchanged": info["base_unchanged"],
        "accuracy": results["accuracy"][task],
        "not_last_location": {length: cell["memory"]["exact_match_not_last_location"]
                              for length, cell in results["details"][task].items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None,
                        help="a Qwen folder to freeze; default: pretrain the CPU demo's toy base once")
    parser.add_argument("--output-dir", default="bench_results/frozen")
    parser.add_argument("--steps", type=int, default=900, help="the fixed budget: optimizer steps per configuration")
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="configurations run at once, one thread each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--entity-share", type=float, default=0.5,
                        help="toy base pretraining: share of sentences about the story's people and places")
    parser.add_argument("--only", nargs="+", default=None, help="run only the configurations of these names")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 pretraining steps, 10 steps, 20 rows")
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    pretrain_steps, steps, samples = (20, 10, 20) if args.quick else (None, args.steps, args.eval_samples)

    started = time.time()
    base = args.base
    if base is None:
        base = str(output / "base")
        tokenizer = build_demo_tokenizer(base, seed=args.seed)
        extra = {} if pretrain_steps is None else {"steps": pretrain_steps}
        pretrain_base(base, tokenizer, entity_share=args.entity_share, seed=args.seed, show_progress=False, **extra)
        print(f"toy base pretrained in {time.time() - started:.0f}s: {base}")
    similarity = embedding_similarity(AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base))
    print(f"mean cosine of the base's embeddings: actors {similarity['actors']:.2f}, "
          f"locations {similarity['locations']:.2f}")
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    common = ["--max-steps", str(steps), "--num-eval-samples", str(samples), "--eval-chunks", "4", "8",
              "--seed", str(args.seed), "--threads", "1"]
    rows = configurations(num_layers)
    if args.only:
        unknown = sorted(set(args.only) - set(rows))
        if unknown:
            parser.error(f"--only: unknown configurations {unknown}; known: {sorted(rows)}")
        rows = {name: rows[name] for name in args.only}
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_configuration, name, flags, base, output, common) for name, flags in rows.items()]
        table = [future.result() for future in futures]

    header = f"{'configuration':<24} {'mem 4ch':>8} {'mem 8ch':>8} {'off 4ch':>8} {'off 8ch':>8} " \
             f"{'not-last 4ch':>13} {'params':>7} {'time':>6}"
    print(f"\nQA1 exact match (%) after {steps} steps on a frozen base ({base}); chance 16.7; 'not-last 4ch': "
          "with memory, on rows whose answer is not the last place mentioned")
    print(header)
    for row in table:
        accuracy = row["accuracy"]
        cells = [100 * accuracy[length][mode] for mode in ("memory", "no_memory") for length in ("128", "256")]
        not_last = 100 * row["not_last_location"]["128"]
        print(f"{row['name']:<24} {cells[0]:>8.1f} {cells[1]:>8.1f} {cells[2]:>8.1f} {cells[3]:>8.1f} "
              f"{not_last:>13.1f} {row['trainable_parameters']:>7} {row['seconds']:>5.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        summary = {"base": base, "steps": steps, "seed": args.seed, "embedding_similarity": similarity, "rows": table}
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
