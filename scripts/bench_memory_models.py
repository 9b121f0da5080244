"""NeuralMemory speed per memory model, optionally against another copy of memory.py, in one process.

Times `NeuralMemory(hidden, heads, head_dim, depth, memory_chunk_size=chunk, memory_batch_size=memory_batch)` on
`tokens` random tokens, forward (no grad) and forward+backward, for each depth x chunk case. Without --memory-batch
every chunk takes the fused step where the model has one; with it, the memory-batch path. --generic adds
`mlp-autograd`, the MLP with only its forward (inner gradients by autograd): what a model without written-out
gradients costs. Within a case the implementations alternate round by round and the best round counts, so the ratios
compare code measured in the same minutes on the same cores.

    python scripts/bench_memory_models.py                                # the package's memory models
    python scripts/bench_memory_models.py --baseline /tmp/memory_old.py  # plus an older memory.py, side by side
    python scripts/bench_memory_models.py --generic --memory-batch 64 --json bench.json --rounds 9
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from titans_hf.modeling import memory

MODES = ("forward", "forward+backward")


class AutogradMLP(memory.MemoryModel):
    """The MLP memory with only its forward, so NeuralMemory takes its inner gradients by autograd."""

    def __init__(self, head_dim: int, depth: int, expansion: int):
        self.mlp = memory.MLPMemory(head_dim, depth, expansion)
        self.shapes = self.mlp.shapes

    def __call__(self, weights: list[torch.Tensor], z: torch.Tensor) -> torch.Tensor:
        return self.mlp(weights, z)


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def build(impl: str, baseline: ModuleType | None, args: argparse.Namespace, depth: int, chunk: int) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(memory_depth=depth, memory_expansion=args.expansion, memory_chunk_size=chunk,
                  memory_batch_size=None if args.memory_batch is None else max(args.memory_batch, chunk))
    if impl == "baseline":
        return baseline.NeuralMemory(args.hidden, args.heads, args.head_dim, **common)
    return memory.NeuralMemory(args.hidden, args.heads, args.head_dim, memory_model=impl, **common)


def time_once(module: torch.nn.Module, hidden: torch.Tensor, mode: str) -> float:
    start = time.perf_counter()
    if mode == "forward":
        with torch.no_grad():
            module(hidden)
    else:
        reads, _ = module(hidden)
        reads.square().mean().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted(memory.MEMORY_MODELS)
    parser.add_argument("--models", nargs="+", default=names, choices=names)
    parser.add_argument("--generic", action="store_true", help="also time the MLP through the autograd path")
    parser.add_argument("--baseline", type=Path, help="another memory.py to time beside the package's (loaded in "
                        "titans_hf.modeling, where its relative imports resolve; NeuralMemory's arguments as now)")
    parser.add_argument("--memory-batch", type=int, help="NeuralMemory memory_batch_size (a multiple of each chunk)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--expansion", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_module(args.baseline, "titans_hf.modeling.baseline_memory") if args.baseline else None
    if args.generic:
        memory.MEMORY_MODELS["mlp-autograd"] = AutogradMLP
    impls = (["baseline"] if baseline else []) + args.models + (["mlp-autograd"] if args.generic else [])

    rows = []
    for depth in args.depths:
        for chunk in args.chunks:
            modules = {impl: build(impl, baseline, args, depth, chunk) for impl in impls}
            hidden = torch.randn(args.batch, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
            for mode in MODES:
                best = dict.fromkeys(impls, float("inf"))
                for impl in impls:  # warm-up
                    time_once(modules[impl], hidden, mode)
                for _ in range(args.rounds):
                    for impl in impls:
                        best[impl] = min(best[impl], time_once(modules[impl], hidden, mode))
                for impl in impls:
                    row = dict(impl=impl, depth=depth, chunk=chunk, mode=mode, seconds=best[impl],
                               tokens_per_s=args.batch * args.tokens / best[impl])
                    if baseline:
                        row["ratio_to_baseline"] = best[impl] / best["baseline"]
                    rows.append(row)

    header = f"{'impl':>12} {'depth':>5} {'chunk':>5} {'mode':>17} {'ms':>9} {'tok/s':>9}"
    print(f"tokens {args.tokens} x batch {args.batch}, hidden {args.hidden}, {args.heads} heads x {args.head_dim}, "
          f"expansion {args.expansion}, memory batch {args.memory_batch or 'chunk'}, {args.threads} thread(s), "
          f"best of {args.rounds}, torch {torch.__version__}")
    print(header + (" new/old" if baseline else ""))
    for row in rows:
        line = (f"{row['impl']:>12} {row['depth']:>5} {row['chunk']:>5} {row['mode']:>17} {1e3 * row['seconds']:>9.1f}"
                f" {row['tokens_per_s']:>9.0f}")
        print(line + (f" {row['ratio_to_baseline']:>7.3f}" if baseline else ""))
    if args.json:
        args.json.write_text(json.dumps(dict(settings={k: str(v) for k, v in vars(args).items()}, rows=rows), indent=1))


if __name__ == "__main__":
    main()
