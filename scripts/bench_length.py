"""How far a trained memory reaches: BABILong QA1 accuracy at long lengths, and one row of 1,048,576 tokens streamed
through `generate`, with tokens/s and peak memory at each length.

Each measurement runs in a process of its own, so its peak resident memory is its own:

* ``eval`` at every ``--chunks`` (default 1024 and 4096 chunks): generated QA1 rows (seed 11, as docs/results.md's tables)
  scored with the memory on (and off with ``--ablation``), accuracy, accuracy where the last place mentioned is
  wrong, accuracy by distance, prompt tokens/s and peak memory;
* ``stream`` at every ``--stream-tokens`` (default 32768, 131072 and 1048576): one QA1 row of that many input
  tokens, the whole prompt prefilled chunk by chunk into the memory's cache by ``model.generate`` (greedy, 3 new
  tokens), its answer against the target, tokens/s, the process's peak memory and how far `generate` took it above
  what it held before (flat: the cache holds the memory state and at most two chunks of keys and values). That peak
  is the one reached during `generate` alone (Linux VmHWM, reset right before it): the process's lifetime peak also
  holds building the row (its text and the tokenizer's encoding of a 1M-token prompt), which is not generate's.

    python scripts/bench_length.py --model outputs/demo/memory --json bench_results/length.json
    python scripts/bench_length.py --model outputs/demo/memory --chunks 1024 --stream-tokens 32768   # quicker
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def peak_memory_mb() -> float:
    """This process's peak resident memory (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (Linux reports kilobytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def resident_memory_mb() -> float:
    """This process's resident memory now (VmRSS)."""
    return _status_mb("VmRSS")


def reset_peak_memory() -> None:
    """Start VmHWM (the peak resident memory) again from the current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


def run_eval(args: argparse.Namespace, chunks: int) -> dict:
    from titans_hf.tasks.babilong import generate_babilong
    from titans_hf.tasks.babilong.evaluation import evaluate_babilong, load_model_for_eval

    model, tokenizer = load_model_for_eval(args.model, args.memory)
    chunk_size = model.config.memory_config.chunk_size
    rows = generate_babilong("qa1", args.num_samples, chunks * chunk_size, tokenizer, seed=args.seed,
                             haystack_files=args.haystack)
    started = time.perf_counter()
    results = evaluate_babilong(model, tokenizer, {("qa1", chunks * chunk_size): rows}, max_new_tokens=3,
                                batch_size=args.batch_size, ablation=args.ablation, show_progress=False)
    seconds = time.perf_counter() - started
    cell = results["details"]["qa1"][str(chunks * chunk_size)]
    passes = 2 if args.ablation else 1
    return {
        "case": "eval", "chunks": chunks, "tokens": chunks * chunk_size, "rows": len(rows),
        "memory": cell["memory"]["exact_match"], "memory_not_last_location": cell["memory"]["exact_match_not_last_location"],
        "no_memory": cell.get("no_memory", {}).get("exact_match"), "last_location_baseline": cell["last_location_baseline"],
        "by_distance": cell.get("by_distance"), "seconds": round(seconds, 1),
        "tokens_per_s": round(passes * cell["prompt_tokens"]["mean"] * len(rows) / seconds),
        "peak_memory_mb": round(peak_memory_mb()),
    }


def run_stream(args: argparse.Namespace, tokens: int) -> dict:
    import torch

    from titans_hf.tasks.babilong import generate_babilong
    from titans_hf.tasks.babilong.evaluation import greedy_generation_config, load_model_for_eval, prompt_ids

    model, tokenizer = load_model_for_eval(args.model, args.memory)
    model.eval()
    row = generate_babilong("qa1", 1, tokens, tokenizer, seed=args.seed, haystack_files=args.haystack)[0]
    prompt, target = torch.tensor([prompt_ids(row, tokenizer)]), row["target"]
    del row
    lifetime_peak = peak_memory_mb()  # building the row: its text and the tokenizer's encoding
    before = resident_memory_mb()  # the model, the prompt and what building the row left behind
    reset_peak_memory()
    started = time.perf_counter()
    with torch.no_grad():
        output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                generation_config=greedy_generation_config(model, tokenizer, 3))
    seconds = time.perf_counter() - started
    generate_peak = _status_mb("VmHWM")
    answer = tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)
    return {
        "case": "stream", "tokens": prompt.shape[1], "chunks": -(-prompt.shape[1] // model.config.memory_config.chunk_size),
        "answer": answer.strip(), "target": target, "right": answer.strip().split()[:1] == [target],
        "seconds": round(seconds, 1), "tokens_per_s": round(prompt.shape[1] / seconds),
        "peak_memory_mb": round(max(lifetime_peak, generate_peak)), "memory_before_generate_mb": round(before),
        "peak_before_generate_mb": round(lifetime_peak),
        "generate_peak_above_mb": round(max(0.0, generate_peak - before)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a memory folder or Hub id (or a full TitansQwen folder)")
    parser.add_argument("--memory", default=None, help="a memory folder, when --model names its base")
    parser.add_argument("--chunks", type=int, nargs="*", default=[1024, 4096], help="eval lengths, in chunks")
    parser.add_argument("--num-samples", type=int, default=48, help="eval rows per length")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--ablation", action="store_true", help="also score with the memory switched off")
    parser.add_argument("--stream-tokens", type=int, nargs="*", default=[32768, 131072, 1048576],
                        help="input tokens of the rows streamed through generate")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--haystack", nargs="+", default=None,
                        help="haystack text files or folders (default: the generator's built-in prose)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the measurements here")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one measurement, in a child process
    args = parser.parse_args()

    if args.case is not None:
        import torch

        torch.set_num_threads(args.threads)
        kind, value = args.case.split(":")
        result = run_eval(args, int(value)) if kind == "eval" else run_stream(args, int(value))
        print("RESULT " + json.dumps(result))
        return 0

    cases = [f"eval:{chunks}" for chunks in args.chunks] + [f"stream:{tokens}" for tokens in args.stream_tokens]
    forwarded = ["--model", args.model, *(["--memory", args.memory] if args.memory else []),
                 "--num-samples", str(args.num_samples), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
                 "--threads", str(args.threads), *(["--ablation"] if args.ablation else []),
                 *(["--haystack", *args.haystack] if args.haystack else [])]
    measurements = []
    for case in cases:
        completed = subprocess.run([sys.executable, __file__, *forwarded, "--case", case], capture_output=True,
                                   text=True)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if completed.returncode != 0 or not lines:
            print(completed.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"bench_length: case {case} failed (exit {completed.returncode})")
        measurements.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(measurements[-1]), flush=True)

    print("\nQA1 exact match (%), with the memory; tokens/s and peak resident memory of the process")
    print(f"{'case':<8} {'chunks':>7} {'tokens':>9} {'result':>26} {'tokens/s':>9} {'peak MB':>8} "
          f"{'generate above MB':>18}")
    for m in measurements:
        if m["case"] == "eval":
            off = "" if m["no_memory"] is None else f", off {100 * m['no_memory']:.1f}"
            result = f"{100 * m['memory']:.1f} (n={m['rows']}{off})"
        else:
            result = f"{m['answer'] or '-'} ({'right' if m['right'] else 'wrong'}; {m['target']})"
        print(f"{m['case']:<8} {m['chunks']:>7} {m['tokens']:>9} {result:>26} {m['tokens_per_s']:>9} "
              f"{m['peak_memory_mb']:>8} {m.get('generate_peak_above_mb', '-'):>18}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {"model": args.model, "haystack": args.haystack, "measurements": measurements}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
