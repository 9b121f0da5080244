"""BABILong evaluation throughput: one row per generate call, batches of equal prompt length, batches of mixed length.

A tiny TitansQwen is built offline (a BPE tokenizer and a random Qwen3 saved to a temporary folder, as the tests do,
with the memory's output projection set off its zero init so the memory takes part), and the same generated rows
are answered three ways by `evaluate_babilong`:

- batch size 1;
- `mixed_length_batches=False`: only prompts of identical length share a batch (the behaviour before padding);
- `mixed_length_batches=True`: prompts left-padded by whole multiples of the model's `padding_multiple`.

Mixed-length batching groups rows by `len % padding_multiple`, so it fills batches when a cell holds many more rows
than `padding_multiple` has residues (small chunks, or many rows); at chunk sizes of thousands of tokens rows of
distinct lengths rarely share a residue. `rows/call` shows how full the batches were.

Each mode runs `--repeats` times after one warm-up; the best time counts. The answers of every mode must equal those
of batch size 1 (the script fails otherwise). Prints a table (answers per second, ratio to batch size 1) and, with
`--json`, writes it.

    python scripts/bench_eval.py
    python scripts/bench_eval.py --rows 128 --batch-size 32 --lengths 64 256 1024 --json bench_results/eval.json
    python scripts/bench_eval.py --device cuda --hidden-size 256 --chunk-size 256
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titans_hf.files import atomic_write_json  # noqa: E402
from titans_hf.modeling import TitansQwenForCausalLM  # noqa: E402
from titans_hf.tasks.babilong import ACTORS, LOCATIONS, MOVE_VERBS, generate_babilong  # noqa: E402
from titans_hf.tasks.babilong.evaluation import evaluate_babilong, prompt_ids  # noqa: E402
from titans_hf.tasks.babilong.generate import distractor_sentence  # noqa: E402
from titans_hf.testing_utils import build_qwen, build_tokenizer  # noqa: E402

MODES = {
    "batch size 1": dict(batch_size=1, mixed_length_batches=False),
    "equal-length batches": dict(mixed_length_batches=False),
    "mixed-length batches": dict(mixed_length_batches=True),
}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48, help="rows per length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[0, 96, 192], help="haystack lengths in tokens (0: bare stories)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--memory-chunk-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per mode (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    if args.json is not None and Path(args.json).is_dir():
        parser.error(f"--json {args.json} is a folder; give a file name")
    return args


def build_model(folder: Path, args: argparse.Namespace):
    """(model, tokenizer): a BPE tokenizer and random Qwen3 saved in `folder`, a memory on top, W_O perturbed."""
    from transformers import AutoTokenizer

    rng = random.Random(args.seed)
    corpus = [f"{a} {v} the {loc}." for a in ACTORS for v in MOVE_VERBS for loc in LOCATIONS]
    corpus += [f"Question: Where is {a}? Answer: {loc}" for a in ACTORS for loc in LOCATIONS]
    corpus += [distractor_sentence(rng) for _ in range(400)]
    build_tokenizer(corpus * 5, folder, vocab_size=1024)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    build_qwen(folder, vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.layers,
               seed=args.seed)
    model = TitansQwenForCausalLM.from_base(folder, chunk_size=args.chunk_size, memory_head_dim=16,
                                            memory_chunk_size=args.memory_chunk_size)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.copy_(torch.randn(block.output_weight.shape, generator=generator))
    return model.to(args.device).eval(), tokenizer


def run(args: argparse.Namespace) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="titans_bench_eval_") as scratch:
        model, tokenizer = build_model(Path(scratch), args)
        data = {("qa1", length): generate_babilong("qa1", args.rows, length, tokenizer, seed=args.seed + 1)
                for length in args.lengths}
    prompt_lengths = [len(prompt_ids(row, tokenizer)) for rows in data.values() for row in rows]
    num_answers = len(prompt_lengths)
    table, reference = [], None
    for name, settings in MODES.items():
        kwargs = {"max_new_tokens": args.max_new_tokens, "ablation": False, "show_progress": False,
                  "batch_size": args.batch_size, **settings}
        calls = []
        generate = model.generate

        def counting_generate(*positional, **keywords):
            calls.append(int(keywords["input_ids"].numel()))
            return generate(*positional, **keywords)

        model.generate = counting_generate
        results = evaluate_babilong(model, tokenizer, data, **kwargs)  # warm-up; also the answers compared
        num_calls, tokens_run = len(calls), sum(calls)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            evaluate_babilong(model, tokenizer, data, **kwargs)
            times.append(time.perf_counter() - started)
        del model.generate
        if reference is None:
            reference = results
        elif results != reference:
            raise RuntimeError(f"{name}: the answers differ from those of batch size 1")
        best = min(times)
        table.append({"mode": name, "batch_size": kwargs["batch_size"], "generate_calls": num_calls,
                      "rows_per_call": round(num_answers / num_calls, 2),
                      "prompt_tokens_run": tokens_run, "seconds": round(best, 3),
                      "answers_per_second": round(num_answers / best, 2)})
    for row in table:
        row["ratio_to_batch_size_1"] = round(row["answers_per_second"] / table[0]["answers_per_second"], 2)
    return {
        "answers": num_answers,
        "prompt_tokens": {"min": min(prompt_lengths), "max": max(prompt_lengths),
                          "distinct": len(set(prompt_lengths))},
        "padding_multiple": model.padding_multiple,
        "answers_equal_batch_size_1": True,
        "settings": {key: value for key, value in vars(args).items() if key != "json"},
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "table": table,
    }


def format_table(report: dict) -> str:
    header = ["mode", "batch", "generate calls", "rows/call", "prompt tokens run", "seconds", "answers/s", "x batch 1"]
    lines = [header] + [[row["mode"], str(row["batch_size"]), str(row["generate_calls"]), f"{row['rows_per_call']:.1f}",
                         str(row["prompt_tokens_run"]), f"{row['seconds']:.3f}", f"{row['answers_per_second']:.1f}",
                         f"{row['ratio_to_batch_size_1']:.2f}"] for row in report["table"]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    body = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
    tokens = report["prompt_tokens"]
    return (f"{report['answers']} answers, prompts of {tokens['min']}-{tokens['max']} tokens ({tokens['distinct']} "
            f"lengths), padding_multiple={report['padding_multiple']}, {report['torch_threads']} threads; answers "
            f"equal to batch size 1 in every mode\n{body}")


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    report = run(args)
    print(format_table(report))
    if args.json is not None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
