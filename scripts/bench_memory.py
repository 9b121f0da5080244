"""NeuralMemory vs titans-pytorch 0.5.5 on the same math, side by side in one run; and the delta rule's op against the
field's torch reference, transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next's fallback where fla is absent).

Both: multi-head memory (heads x 64), 2-layer MLP memory with expansion 4, update chunk 64, inner gradient point
refreshed every chunk (titans-pytorch `batch_size=64`), surprise clipped to norm 1, max lr 0.1. Every case runs in a
fresh subprocess so peak memory is that case's alone (Linux VmHWM, reset right before the first call; CUDA: peak
allocated); timings alternate the two implementations and a 2048^2 sgemm in one process, best of --repeats rounds.
Matmul FLOPs are counted analytically from the shapes (the same count for both, so the fraction of that sgemm's
FLOP/s compares like with like). Other processes sharing the cores make timings noisy: read the ratios, which are
measured in the same minute.

The delta rule (`--delta-rule`): `ops.delta`, the op a delta-rule NeuralMemory binds, against
`torch_chunk_gated_delta_rule` at the same shapes (one row, 4096 tokens, chunks of 64; heads x head size 14 x 64 and
4 x 16), forward+backward of the reads and the final state, fp32, one thread, the two alternated in one process, best
of --repeats rounds. Both are chunkwise WY solvers of the delta rule with a decay; the reference also reads within
its chunk (an attention-like product per chunk) and ours caps the state's norm per chunk, so the work is alike but
not the same.

    python scripts/bench_memory.py --quick
    python scripts/bench_memory.py --json bench_memory.json [--threads 1]
    python scripts/bench_memory.py --device cuda --dtype bfloat16 --cases d896-32k   # on a GPU machine
    python scripts/bench_memory.py --delta-rule [--quick] --json bench_delta_rule.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "d256-2k": dict(dim=256, heads=4, tokens=2048),
    "d256-8k": dict(dim=256, heads=4, tokens=8192),
    "d896-4k": dict(dim=896, heads=14, tokens=4096),
    "d896-32k": dict(dim=896, heads=14, tokens=32768),
}
HEAD_DIM, EXPANSION, CHUNK = 64, 4, 64
IMPLS = ("titans_hf", "titans_pytorch")
MODES = ("forward", "forward+backward")
DELTA_RULE_CASES = {"h14x64-4k": dict(heads=14, head_dim=64, tokens=4096),
                    "h4x16-4k": dict(heads=4, head_dim=16, tokens=4096)}
DELTA_RULE_IMPLS = ("ops.delta", "torch_chunk_gated_delta_rule")


def matmul_flops(dim: int, heads: int, tokens: int, backward: bool) -> float:
    """Forward: q/k/v + gate projections, then per head and token one MLP pass for the read, one for the surprise,
    and its written-out backward (weight gradients of both layers + the delta through the second)."""
    hidden = HEAD_DIM * EXPANSION
    mlp = 2 * (HEAD_DIM * hidden + hidden * HEAD_DIM)
    inner_backward = 3 * 2 * HEAD_DIM * hidden
    forward = tokens * (2 * dim * 3 * heads * (HEAD_DIM + 1) + heads * (2 * mlp + inner_backward))
    return forward * (3 if backward else 1)  # each matmul's backward is two matmuls of the same size


def build(impl: str, dim: int, heads: int):
    if impl == "titans_hf":
        from titans_hf.modeling.memory import NeuralMemory

        return NeuralMemory(dim, heads, HEAD_DIM, memory_depth=2, memory_expansion=EXPANSION, conv_kernel=4,
                            memory_chunk_size=CHUNK, memory_batch_size=CHUNK, max_lr=0.1, max_surprise_norm=1.0)
    from titans_pytorch import MemoryMLP
    from titans_pytorch import NeuralMemory as ReferenceMemory

    return ReferenceMemory(dim, chunk_size=CHUNK, batch_size=CHUNK, dim_head=HEAD_DIM, heads=heads,
                           model=MemoryMLP(HEAD_DIM, depth=2, expansion_factor=EXPANSION),
                           default_step_transform_max_lr=0.1, max_grad_norm=1.0)


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _setup(spec: dict, impl: str):
    import torch

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    torch.manual_seed(0)
    module = build(impl, spec["dim"], spec["heads"]).to(device)
    if impl == "titans_pytorch":
        module = module.to(dtype)  # ours keeps fp32 parameters and state; activations come in as `dtype`
    hidden = torch.randn(1, spec["tokens"], spec["dim"], device=device, dtype=dtype)
    backward = spec["mode"] == "forward+backward"

    def run():
        with torch.set_grad_enabled(backward):
            reads = module(hidden)[0]
            if backward:
                reads.float().square().mean().backward()
        module.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return run


def worker(spec: dict) -> dict:
    """Peak memory of one implementation's first call (a warm-up would leave freed pages resident and hide the
    peak), or, with spec["impl"] == "both", the timings: both implementations alternated in one process, so the
    load other processes put on the machine falls on both alike."""
    import torch

    torch.set_num_threads(spec["threads"])
    cuda = spec["device"].startswith("cuda")
    if spec["impl"] != "both":
        run = _setup(spec, spec["impl"])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _rss_peak_reset()
            base = _status_kb("VmRSS") * 1024
        run()
        peak = torch.cuda.max_memory_allocated() if cuda else _status_kb("VmHWM") * 1024
        return dict(spec, peak_mb=(peak - base) / 2**20)
    runs = {impl: _setup(spec, impl) for impl in IMPLS}
    runs["sgemm"] = _sgemm(spec["device"], spec["dtype"])  # the ceiling, measured in the same rounds
    times = {impl: [] for impl in runs}
    for impl, run in runs.items():
        run()  # warm-up
    for _ in range(spec["repeats"]):
        for impl, run in runs.items():
            start = time.perf_counter()
            run()
            times[impl].append(time.perf_counter() - start)
    return dict(spec, seconds={impl: min(t) for impl, t in times.items()},
                sgemm_gflops=SGEMM_FLOPS / min(times["sgemm"]) / 1e9)


SGEMM_SIZE = 2048
SGEMM_FLOPS = 2 * SGEMM_SIZE**3


def _sgemm(device: str, dtype: str):
    """One large square product: the machine's matmul ceiling as it stands during the timed rounds."""
    import torch

    a, b = (torch.randn(SGEMM_SIZE, SGEMM_SIZE, device=device, dtype=getattr(torch, dtype)) for _ in range(2))

    def run():
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return run


def run_case(spec: dict) -> dict:
    # large blocks straight from mmap and back on free: RSS then follows live memory instead of glibc's heap cache
    # (memory runs only: the extra mmap calls would slow the timed runs)
    env = dict(os.environ, **({} if spec["impl"] == "both" else {"MALLOC_MMAP_THRESHOLD_": "65536"}))
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        return dict(spec, error=proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _delta_rule_runs(heads: int, head_dim: int, tokens: int) -> dict:
    """One forward+backward of each delta-rule implementation on the same random inputs (unit keys and queries, a
    step beta in (0, 1) per token, a decay near 1, an initial state that trains), as closures."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from titans_hf.modeling.memory import NeuralMemory

    memory = NeuralMemory(heads * head_dim, heads, head_dim, memory_depth=1, memory_chunk_size=CHUNK, max_lr=0.5,
                          update_rule="delta", max_memory_norm=4 * head_dim**0.5)
    generator = torch.Generator().manual_seed(0)
    random = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    chunks = tokens // CHUNK
    q, k = (F.normalize(random(heads, tokens, head_dim), dim=-1) for _ in range(2))
    v = random(heads, tokens, head_dim)
    beta = torch.sigmoid(random(heads, tokens))
    decay = torch.full((heads, chunks), -1e-3)  # log of the kept share per chunk
    state = 0.1 * random(heads, head_dim, head_dim)
    leaves = [t.requires_grad_() for t in (q, k, v, beta, decay, state)]

    def ours():
        keeps = decay.exp().view(heads, chunks, 1, 1).unbind(1)
        W = state
        reads, (W,), _, _ = memory.update_op(q, k, v, beta, keeps, keeps, [None] * chunks, [W],  # etas: unused
                                             [torch.zeros_like(W)], [W], 0, memory.update_settings)
        (reads.square().mean() + W.square().mean()).backward()

    def theirs():
        per_token = (decay / CHUNK).repeat_interleave(CHUNK, dim=1)  # the same decay over a chunk, token by token
        as_rows = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731  [heads, T, ...] -> [1, T, heads, ...]
        reads, W = torch_chunk_gated_delta_rule(as_rows(q), as_rows(k), as_rows(v), as_rows(per_token),
                                                as_rows(beta), chunk_size=CHUNK, initial_state=state.unsqueeze(0),
                                                output_final_state=True)
        (reads.square().mean() + W.square().mean()).backward()

    def clearing(run):
        def timed():
            run()
            for leaf in leaves:
                leaf.grad = None
        return timed

    return {"ops.delta": clearing(ours), "torch_chunk_gated_delta_rule": clearing(theirs)}


def delta_rule_bench(repeats: int, json_path: Path | None) -> None:
    """`ops.delta` against `torch_chunk_gated_delta_rule`, forward+backward, one thread: a table and, with
    `json_path`, its figures."""
    import torch

    torch.set_num_threads(1)
    results = []
    for name, case in DELTA_RULE_CASES.items():
        runs = _delta_rule_runs(**case)
        times = {impl: [] for impl in runs}
        for run in runs.values():
            run()  # warm-up
        for _ in range(repeats):
            for impl, run in runs.items():
                start = time.perf_counter()
                run()
                times[impl].append(time.perf_counter() - start)
        seconds = {impl: min(t) for impl, t in times.items()}
        results.append(dict(case=name, **case, chunk=CHUNK, seconds=seconds,
                            theirs_over_ours=seconds["torch_chunk_gated_delta_rule"] / seconds["ops.delta"]))
    print(f"\ndelta rule, forward+backward, 1 thread, fp32, chunks of {CHUNK}, best of {repeats}; ratio > 1: ops.delta "
          "is faster")
    print(f"{'case':<10} {'ops.delta s':>12} {'torch_chunk_gated_delta_rule s':>31} {'ratio':>7}")
    for res in results:
        print(f"{res['case']:<10} {res['seconds']['ops.delta']:>12.4f} "
              f"{res['seconds']['torch_chunk_gated_delta_rule']:>31.4f} {res['theirs_over_ours']:>6.2f}x")
    if json_path:
        tmp = json_path.with_suffix(json_path.suffix + ".tmp")
        tmp.write_text(json.dumps(dict(bench="delta_rule", threads=1, device="cpu", dtype="float32", repeats=repeats,
                                       torch=torch.__version__, results=results), indent=2))
        tmp.replace(json_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="d256-2k forward+backward only, two timed rounds (< 1 minute); with --delta-rule, two "
                             "timed rounds")
    parser.add_argument("--delta-rule", action="store_true",
                        help="time ops.delta against transformers' torch_chunk_gated_delta_rule instead (1 thread)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["d256-2k", "d256-8k", "d896-4k"])
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="write all figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.delta_rule:
        delta_rule_bench(2 if args.quick else args.repeats, args.json)
        return
    modes = MODES
    if args.quick:
        args.cases, args.repeats, modes = ["d256-2k"], 2, ("forward+backward",)

    from tqdm import tqdm

    common = dict(threads=args.threads, repeats=args.repeats, device=args.device, dtype=args.dtype)
    specs = [dict(CASES[name], case=name, mode=mode, impl=impl, **common)
             for name in args.cases for mode in modes for impl in ("both", *IMPLS)]
    done = {}
    for spec in tqdm(specs, desc="bench_memory", unit="run"):
        done[spec["case"], spec["mode"], spec["impl"]] = run_case(spec)
    results = []
    for name in args.cases:
        for mode in modes:
            timing = done[name, mode, "both"]
            for impl in IMPLS:
                res = dict(done[name, mode, impl])
                if "error" in timing or "error" in res:
                    res["error"] = timing.get("error") or res.get("error")
                else:
                    seconds, ceiling = timing["seconds"][impl], timing["sgemm_gflops"]
                    flops = matmul_flops(res["dim"], res["heads"], res["tokens"], mode == "forward+backward")
                    res.update(seconds=seconds, tokens_per_s=res["tokens"] / seconds, gflops=flops / seconds / 1e9,
                               sgemm_gflops=ceiling, fraction_of_sgemm=flops / seconds / 1e9 / ceiling)
                results.append(res)

    print(f"\n{args.threads} threads, {args.device}, {args.dtype}; % sgemm = matmul FLOP/s over a {SGEMM_SIZE}^2 "
          "product timed in the same rounds")
    print(f"{'case':<9} {'mode':<17} {'impl':<15} {'tok/s':>9} {'peak MB':>9} {'GFLOP/s':>8} {'% sgemm':>8}")
    ratios = {}
    for res in results:
        if "error" in res:
            print(f"{res['case']:<9} {res['mode']:<17} {res['impl']:<15} error: {res['error']}")
            continue
        print(f"{res['case']:<9} {res['mode']:<17} {res['impl']:<15} {res['tokens_per_s']:>9.0f} "
              f"{res['peak_mb']:>9.1f} {res['gflops']:>8.1f} {100 * res['fraction_of_sgemm']:>7.1f}%")
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in results if "error" not in r}
    print(f"\n{'case':<9} {'mode':<17} {'throughput ours/theirs':>23} {'peak memory ours/theirs':>24}")
    for name in args.cases:
        for mode in modes:
            ours, theirs = by_key.get((name, mode, "titans_hf")), by_key.get((name, mode, "titans_pytorch"))
            if ours and theirs:
                ratio = dict(throughput=ours["tokens_per_s"] / theirs["tokens_per_s"],
                             peak_memory=ours["peak_mb"] / max(theirs["peak_mb"], 1e-9))
                ratios[f"{name}/{mode}"] = ratio
                print(f"{name:<9} {mode:<17} {ratio['throughput']:>22.2f}x {ratio['peak_memory']:>23.2f}x")
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(dict(threads=args.threads, device=args.device,
                                       dtype=args.dtype, results=results, ratios=ratios), indent=2))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
