"""What a trained memory does over long BABILong rows: write strength, forgetting and momentum on the supporting
fact and on the haystack, the fast weights' norm, and how much of the fact is left as chunks pass (a counterfactual
row whose fact names another place streams beside each row). Prints a summary, writes JSON and a PNG.

    python scripts/diagnose_memory.py --model outputs/demo/memory --length 8192 --num-rows 8 --output outputs/diagnose
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titans_hf.files import atomic_write_json
from titans_hf.outputs import prepare_output_dir  # noqa: E402
from titans_hf.tasks.babilong import generate_babilong, length_tokens  # noqa: E402
from titans_hf.tasks.babilong.diagnostics import diagnose_memory, plot_diagnostics  # noqa: E402
from titans_hf.tasks.babilong.evaluation import load_model_for_eval  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a memory folder or Hub id (or a full TitansQwen folder)")
    parser.add_argument("--memory", default=None, help="a memory folder, when --model names its base")
    parser.add_argument("--task", default="qa1", choices=["qa1", "qa2"])
    parser.add_argument("--length", default="8192", help="input tokens of the generated rows (e.g. 8192 or 8k)")
    parser.add_argument("--num-rows", type=int, default=8)
    parser.add_argument("--seed", type=int, default=11, help="generation seed; use one the training data did not")
    parser.add_argument("--haystack", nargs="+", default=None,
                        help="haystack text files or folders (default: the generator's built-in prose)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", required=True, help="folder for memory_diagnostics.json and .png")
    args = parser.parse_args()
    length = length_tokens(args.length)
    if length is None or length < 1:
        parser.error(f"--length {args.length!r} is not a number of tokens (e.g. 8192 or 8k)")
    folder = prepare_output_dir(args.output, ("memory_diagnostics.json", "memory_diagnostics.png"))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_for_eval(args.model, args.memory)
    rows = generate_babilong(args.task, args.num_rows, length, tokenizer, seed=args.seed,
                            haystack_files=args.haystack)
    diagnostics = diagnose_memory(model, tokenizer, rows, task=args.task)
    for layer, summary in diagnostics["layers"].items():
        print(f"memory layer {layer}, {diagnostics['num_rows']} rows of {length} tokens "
              f"(chunks of {diagnostics['chunk_size']}):")
        for name in ("theta", "forget", "momentum"):
            print(f"  {name:<9} on fact tokens {summary[name]['fact']:.4g}, on haystack {summary[name]['haystack']:.4g}")
        signal = summary["fact_signal"]
        marks = [d for d in ("1", "4", "16", "64", "256", "1024") if d in signal]
        print("  left of the fact in the weights after " + ", ".join(f"{d} chunks: {signal[d]:.3g}" for d in marks))
        print(f"  ||W|| at the first / last chunk: {summary['weight_norm'][0]:.3g} / {summary['weight_norm'][-1]:.3g}")
    atomic_write_json(folder / "memory_diagnostics.json", diagnostics)
    plot_diagnostics(diagnostics, folder / "memory_diagnostics.png")
    print(f"wrote {folder / 'memory_diagnostics.json'}, {folder / 'memory_diagnostics.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
