"""Benchmark TitansQwenForCausalLM against the same Qwen without memory, side by side in one run.

1. Training step (forward + backward), tokens/s and peak memory: TitansQwen (`mag`, memory on one layer) vs the same
   Qwen with the same chunking and no memory vs the plain Qwen with full attention, on a tiny config and on a
   Qwen2.5-0.5B-shaped config with random weights. All three train every weight (freeze_base=False) so that each
   step has the same backward to do; the frozen-base Titans step (the actual recipe) is listed as well.
2. Peak training memory at 2, 4 and 8 chunks (tiny config, frozen base), with and without chunk checkpointing.
3. `generate` prefill (one new token) at 8k, 32k and 128k prompt tokens (`--long`: and 1M), chunks of 4096: time,
   tokens/s and peak memory (tiny config).
4. `demo`: the CPU demo's model (`titans_hf.commands.demo_job`: a toy Qwen3 base of hidden size 64 and 2 layers,
   chunks of 32 tokens attending to themselves, the demo's memory settings) at batch 1, forward only, best of 5:
   tokens/s with the memory, with the memory switched off (the same chunk loop), and the plain base with full
   attention, at 1024 and 4096 tokens.
5. `--gpu`: the GPU run (`scripts/device_bench.sh` installs the pinned wheels on a GPU machine and runs it),
   the 0.5B-shaped model at 32k tokens, chunk 4096, bf16, training step: tokens/s with the memory vs the same
   chunking vs full attention (SDPA, which takes its flash kernel on CUDA for causal attention without a mask), and
   the share of the device's bf16 peak (`--peak-tflops`, default an H100/H200's 989 dense) that the model FLOPs
   (6 N per token plus attention) reach; beside them the Titans step with `compile_chunks()` (inductor;
   `--compile-backend none` leaves it out), its first call's time (the compile) in `compile_seconds`.
6. `trunk`: a frozen-base training step with every layer run and from the trunk kept by `cache_frozen_trunk` (the
   layers below the memory computed once per row), side by side: on the tiny config, or with `--base DIR` on a real
   base such as scripts/real_base.sh's converted SmolLM2-135M-Instruct (bfloat16, 8 rows of 512 tokens, the memory
   where the real-base recipe puts it).
7. `--compile`: the CPU demo's model at batch 1, 1024 tokens, forward, with `compile_chunks()` (inductor, CPU)
   against the eager model (layer-major) and the eager chunk loop, and the tiny config's training step (256 tokens,
   chunks of 64) as in part 1 with the compiled step beside it: compile times (first call) and tokens/s side by side.

Goals: memory adds <= 25% to the tiny training step; training memory grows sub-linearly in chunks;
prefill tokens/s within 15% and peak memory flat from 32k to 1M; the demo's model with memory >= 0.6x the tokens/s of
its memory-off loop, and that loop within 1.5x of full attention at 1024 tokens.

CPU runs use one thread by default and report CPU time beside wall time (a shared machine disturbs CPU time
least). CPU peak memory is the peak resident set size above the level just before the measured call (sampled every 2 ms,
freed heap returned to the OS first); on CUDA it is `max_memory_allocated` above the level before.

    python scripts/bench_model.py --quick --json bench_model.json
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titans_hf.modeling import TitansCache, TitansQwenConfig, TitansQwenForCausalLM  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936)
MEMORY = dict(variant="mag", memory_head_dim=64, memory_chunk_size=64)


class PeakMemory:
    """Peak memory above the starting level while the block runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        _release_free_heap()
        self.start = self.peak = _rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            self.running = False
            self.thread.join()
            self.peak_bytes = max(self.peak, _rss()) - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def qwen_config(shape: dict, layers: int | None, dtype: torch.dtype) -> Qwen2Config:
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    config = Qwen2Config(**{**shape, **overrides}, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                         max_position_embeddings=1 << 20, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    config.dtype = dtype
    return config


def build_models(shape: dict, layers: int | None, chunk_size: int, device, dtype, freeze_base: bool):
    """One random Qwen, and a TitansQwen wrapping the very same modules (so the weights are identical)."""
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(qwen_config(shape, layers, dtype)).to(device=device, dtype=dtype)
    n_layers = base.config.num_hidden_layers
    config = TitansQwenConfig(text_config=base.config, memory_config=dict(
        chunk_size=chunk_size, memory_layers=[n_layers // 2], freeze_base=freeze_base, **MEMORY))
    config._attn_implementation = "sdpa"
    titans = TitansQwenForCausalLM(config, backbone=base).to(device)
    base.requires_grad_(not freeze_base)
    return base, titans


def peak_of_first_call(fn, device) -> int:
    """The first call also warms up; its peak is the honest one (later calls reuse a warm allocator)."""
    with PeakMemory(device) as peak:
        fn()
    return peak.peak_bytes


def fastest_interleaved(fns: list, device, repeats: int) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds) per call of each fn, each the minimum over rounds that call every fn once in
    turn: the machine may be shared, interleaving exposes every contender to the same contention, and CPU time
    (all threads of this process) is what contention disturbs least."""
    best = [(float("inf"), float("inf"))] * len(fns)
    for _ in range(repeats):
        for index, fn in enumerate(fns):
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[index] = (min(best[index][0], wall), min(best[index][1], cpu))
    return best


def train_step(model, ids, context=None):
    def step():
        with context() if context else _null():
            loss = model(ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


COMPILED = "titans mag, compiled chunks"


def bench_training(name, shape, layers, tokens, chunk_size, device, dtype, repeats,
                   compile_backend: str | None = None) -> list[dict]:
    """With `compile_backend`, the Titans step with `compile_chunks(backend=...)` too (its first call, which
    compiles, timed on its own); a compile that fails is reported in its row, the other rows still run."""
    base, titans = build_models(shape, layers, chunk_size, device, dtype, freeze_base=False)
    base.train(), titans.train()
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)

    base_modules = (titans.model.embed_tokens, titans.model.layers, titans.model.norm, titans.lm_head)

    def frozen_base_step():
        for module in base_modules:
            module.requires_grad_(False)
        train_step(titans, ids)()
        for module in base_modules:
            module.requires_grad_(True)

    def compiled_step():
        titans.compile_chunks(backend=compile_backend)
        try:
            train_step(titans, ids)()
        finally:
            titans.compile_chunks(enable=False)

    runs = {
        "titans mag (1 memory layer)": train_step(titans, ids),
        "same chunking, no memory": train_step(titans, ids, titans.memory_disabled),
        "plain qwen, full attention": train_step(base, ids),
        "titans mag, frozen base (recipe)": frozen_base_step,
    }
    compiled = {}
    if compile_backend is not None:
        compiled = dict(compile_backend=compile_backend)
        try:
            ((compiled["compile_seconds"], compiled["compile_cpu_seconds"]),) = fastest_interleaved(
                [compiled_step], device, 1)
            runs[COMPILED] = compiled_step
        except Exception as error:  # noqa: BLE001 - a one-call device run keeps its other columns
            compiled["compile_error"] = f"{type(error).__name__}: {error}"[:2000]
        print(f"{name}: compile_chunks(backend={compile_backend!r}) {compiled}", file=sys.stderr, flush=True)
    peaks = {label: peak_of_first_call(fn, device) for label, fn in runs.items()}
    print(f"{name}: peaks (MB) {({label: round(peak / 2**20) for label, peak in peaks.items()})}", file=sys.stderr,
          flush=True)
    times = dict(zip(runs, fastest_interleaved(list(runs.values()), device, repeats)))
    rows = [dict(bench="train_step", config=name, model=label, tokens=tokens, chunk_size=chunk_size,
                 tokens_per_s=tokens / times[label][0], seconds=times[label][0], cpu_seconds=times[label][1],
                 peak_mb=peaks[label] / 2**20, **(compiled if label == COMPILED else {}))
            for label in runs]
    if compiled and COMPILED not in runs:
        rows.append(dict(bench="train_step", config=name, model=COMPILED, tokens=tokens, chunk_size=chunk_size,
                         **compiled))
    return rows


TRUNK_MODELS = ("every layer, each step", "from the kept trunk (cache_frozen_trunk)")


def bench_frozen_trunk(base: str | None, rows: int, tokens: int, chunk_size: int, repeats: int,
                       base_dtype: str = "bfloat16") -> list[dict]:
    """A frozen-base training step (forward + backward, batch of `rows`) with every layer run, and with the trunk
    below the memory read from `cache_frozen_trunk` (filled by a first step), interleaved: on `base` (a local Qwen
    folder, e.g. scripts/real_base.sh's converted SmolLM2, in `base_dtype`, the memory at 0.8 of its depth as the
    real-base recipe puts it) or, without one, the tiny config (float32, the memory on its middle layer)."""
    if base is None:
        _, titans = build_models(TINY, None, chunk_size, torch.device("cpu"), torch.float32, freeze_base=True)
        name, vocab = "tiny", TINY["vocab_size"]
    else:
        layers = AutoConfig.from_pretrained(base).num_hidden_layers
        torch.manual_seed(0)
        titans = TitansQwenForCausalLM.from_base(base, dtype=getattr(torch, base_dtype), chunk_size=chunk_size,
                                                 memory_layers=[int(0.8 * layers)], memory_chunk_size=8, conv_kernel=8,
                                                 checkpoint_chunks=False)
        name, vocab = f"{Path(base).name} ({base_dtype})", titans.config.text_config.vocab_size
    titans.train()
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    kept = titans.model.cache_frozen_trunk
    kept(False)
    every_layer = train_step(titans, ids)
    kept(True)
    train_step(titans, ids)()  # fills the trunk cache

    def from_trunk():
        train_step(titans, ids)()

    def without_trunk():
        kept(False)
        try:
            every_layer()
        finally:
            titans.model._frozen_trunk_cache = store

    store = titans.model._frozen_trunk_cache
    times = fastest_interleaved([without_trunk, from_trunk], torch.device("cpu"), repeats)
    memory_layer = min(int(layer) for layer in titans.model.memory)
    return [dict(bench="frozen_trunk", config=f"{name}, memory on layer {memory_layer}", model=label, rows=rows,
                 tokens=tokens, chunk_size=chunk_size, tokens_per_s=rows * tokens / wall, seconds=wall,
                 cpu_seconds=cpu) for label, (wall, cpu) in zip(TRUNK_MODELS, times)]


def bench_chunks(chunk_size, counts, device, dtype) -> list[dict]:
    rows = []
    for checkpoint_chunks in (True, False):
        _, titans = build_models(TINY, None, chunk_size, device, dtype, freeze_base=True)
        titans.config.memory_config.checkpoint_chunks = checkpoint_chunks
        titans.train()
        for count in counts:
            ids = torch.randint(0, TINY["vocab_size"], (1, count * chunk_size), device=device)
            step = train_step(titans, ids)
            peak = peak_of_first_call(step, device)
            ((seconds, cpu_seconds),) = fastest_interleaved([step], device, 1)
            rows.append(dict(bench="train_memory_vs_chunks", checkpoint_chunks=checkpoint_chunks, chunks=count,
                             tokens=count * chunk_size, peak_mb=peak / 2**20, seconds=seconds,
                             cpu_seconds=cpu_seconds))
    return rows


def bench_prefill(lengths, chunk_size, device, dtype) -> list[dict]:
    rows = []
    _, titans = build_models(TINY, None, chunk_size, device, dtype, freeze_base=True)
    titans.eval()
    for length in lengths:
        ids = torch.randint(1, TINY["vocab_size"], (1, length), device=device)

        def prefill():
            with torch.no_grad():
                out = titans.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                      pad_token_id=0, return_dict_in_generate=True)
            assert isinstance(out.cache, TitansCache)

        peak = peak_of_first_call(prefill, device)
        ((seconds, cpu_seconds),) = fastest_interleaved([prefill], device, 1)
        rows.append(dict(bench="prefill", tokens=length, chunk_size=chunk_size, seconds=seconds,
                         cpu_seconds=cpu_seconds, tokens_per_s=length / seconds, peak_mb=peak / 2**20))
    return rows


def toy_base_models() -> tuple[Qwen3ForCausalLM, TitansQwenForCausalLM]:
    """The CPU demo's toy Qwen3 base (random weights) and a TitansQwen with the demo's memory settings around it."""
    # imported here: the demo pulls in the data stack (datasets, h5py), which the device run does without
    from titans_hf.commands.demo_job import MEMORY_SETTINGS
    from titans_hf.tasks.recall.toy_base import TOY_BASE_SHAPE

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, intermediate_size=2 * TOY_BASE_SHAPE["hidden_size"],
                         head_dim=TOY_BASE_SHAPE["hidden_size"] // TOY_BASE_SHAPE["num_attention_heads"],
                         max_position_embeddings=1 << 20, tie_word_embeddings=True, **TOY_BASE_SHAPE)
    config._attn_implementation = "sdpa"
    base = Qwen3ForCausalLM(config).eval()
    titans_config = TitansQwenConfig(text_config=base.config, memory_config=dict(chunk_size=32, **MEMORY_SETTINGS))
    titans_config._attn_implementation = "sdpa"
    titans = TitansQwenForCausalLM(titans_config, backbone=base).eval()
    with torch.no_grad():
        for block in titans.memory.values():  # off its zero init, so the memory's read reaches the output
            block.output_weight.normal_(std=0.02)
    return base, titans


def forward_only(model, ids, context=None):
    def run():
        with torch.no_grad(), context() if context else _null():
            model(ids)
    return run


def bench_toy_base(lengths, repeats: int) -> list[dict]:
    """The CPU demo's model at batch 1, forward only (what evaluation and the loss over long rows run)."""
    base, titans = toy_base_models()
    rows = []
    for length in lengths:
        ids = torch.randint(0, base.config.vocab_size, (1, length))

        runs = {"toy base with memory": forward_only(titans, ids),
                "same chunk loop, memory off": forward_only(titans, ids, titans.memory_disabled),
                "plain base, full attention": forward_only(base, ids)}
        times = dict(zip(runs, fastest_interleaved(list(runs.values()), torch.device("cpu"), repeats)))
        rows += [dict(bench="toy_base_forward", model=label, tokens=length, chunk_size=32,
                      tokens_per_s=length / times[label][1],  # of CPU time: steadier on a shared machine
                      seconds=times[label][0], cpu_seconds=times[label][1])
                 for label in runs]
    return rows


def bench_compiled_toy_base(length: int, repeats: int, backend: str) -> list[dict]:
    """The CPU demo's model at batch 1, forward only, with `compile_chunks(backend=...)` against the eager model (its
    layer-major order, which the demo's chunk-local attention allows) and the eager chunk loop (what is
    compiled). Compile time is the first compiled call's, less an eager chunk-loop call's time; a second call shows
    whether anything compiled again."""
    base, titans = toy_base_models()
    ids = torch.randint(0, base.config.vocab_size, (1, length))
    eager_loop = forward_only(titans, ids, titans.chunk_by_chunk)
    eager_loop()
    ((loop_wall, loop_cpu),) = fastest_interleaved([eager_loop], torch.device("cpu"), 1)
    compiled_forward = forward_only(titans, ids)
    first = []
    for _ in range(2):
        titans.compile_chunks(backend=backend)
        wall, cpu = time.perf_counter(), time.process_time()
        compiled_forward()
        first.append((time.perf_counter() - wall, time.process_time() - cpu))
        titans.compile_chunks(enable=False)

    def switched(compiled: bool, run):
        def call():
            titans.compile_chunks(enable=compiled, **({"backend": backend} if compiled else {}))
            try:
                run()
            finally:
                titans.compile_chunks(enable=False)
        return call

    runs = {"eager (layer-major)": switched(False, forward_only(titans, ids)),
            "eager chunk loop": switched(False, eager_loop),
            f"compiled chunk loop ({backend})": switched(True, compiled_forward)}
    times = dict(zip(runs, fastest_interleaved(list(runs.values()), torch.device("cpu"), repeats)))
    rows = [dict(bench="toy_base_compiled", model=label, tokens=length, chunk_size=32,
                 tokens_per_s=length / times[label][1], seconds=times[label][0], cpu_seconds=times[label][1])
            for label in runs]
    rows[-1].update(compile_seconds=first[0][0] - loop_wall, compile_cpu_seconds=first[0][1] - loop_cpu,
                    second_call_seconds=first[1][0])
    return rows


def bench_device(name: str, shape: dict, tokens: int, chunk_size: int, device: torch.device, dtype: torch.dtype,
                 peak_tflops: float, compile_backend: str | None, repeats: int = 3) -> list[dict]:
    """The prepared device run (`--gpu`: the 0.5B shape, 32k tokens, chunks of 4096, bf16 on CUDA): the training
    step of `bench_training`, each row with the model TFLOP/s it reaches and their share of `peak_tflops` (the
    memory's own FLOPs are left out: the backbone's work is what every row does)."""
    rows = bench_training(name, shape, None, tokens, chunk_size, device, dtype, repeats=repeats,
                          compile_backend=compile_backend)
    for row in (r for r in rows if "seconds" in r):
        flops = model_flops(shape, row["tokens"], None if "full attention" in row["model"] else chunk_size)
        row["model_tflops_per_s"] = flops / row["seconds"] / 1e12
        row["percent_of_bf16_peak"] = 100 * row["model_tflops_per_s"] / peak_tflops
    return rows


def model_flops(shape: dict, tokens: int, chunk_size: int | None) -> float:
    """Training FLOPs of one step, analytically: 6 N per token for the non-embedding weights and the LM head, plus
    the attention products (QK^T and AV, 4 d FLOPs per query-key pair forward, x3 with the backward) over the keys
    each query sees: half the sequence for full causal attention, or with chunks (attend_previous_chunk) the
    previous chunk and half of its own."""
    hidden, layers, heads, kv = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads"))
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * shape["intermediate_size"]
    weights = layers * per_layer + hidden * shape["vocab_size"]
    if chunk_size is None:
        keys = tokens / 2
    else:
        first = min(tokens, chunk_size)
        keys = (first * first / 2 + (tokens - first) * 1.5 * chunk_size) / tokens
    return 6 * weights * tokens + 3 * 4 * hidden * layers * tokens * keys


def summarise(rows: list[dict], clock: str) -> dict:
    """Ratios side by side; `clock` is "cpu_seconds" on CPU (steadier on a shared machine) or "seconds"."""
    summary = {"time_ratios_use": clock}
    for config in sorted({r["config"] for r in rows if r["bench"] == "train_step"}):
        step = {r["model"]: r for r in rows if r["bench"] == "train_step" and r["config"] == config}
        titans, chunked = step["titans mag (1 memory layer)"], step["same chunking, no memory"]
        plain = step["plain qwen, full attention"]
        summary[config] = dict(
            step_time_vs_same_chunking=titans[clock] / chunked[clock],
            step_time_vs_full_attention=titans[clock] / plain[clock],
            frozen_base_step_vs_same_chunking=step["titans mag, frozen base (recipe)"][clock] / chunked[clock],
            peak_vs_same_chunking=titans["peak_mb"] / max(chunked["peak_mb"], 1e-9),
        )
        compiled = step.get(COMPILED)
        if compiled is not None and clock in compiled:
            summary[config].update(compiled_step_time_vs_eager=compiled[clock] / titans[clock],
                                   compiled_step_time_vs_same_chunking=compiled[clock] / chunked[clock],
                                   compiled_step_time_vs_full_attention=compiled[clock] / plain[clock],
                                   compile_seconds=compiled["compile_seconds"])
        elif compiled is not None:
            summary[config].update(compile_error=compiled["compile_error"])
    compiled = {r["model"]: r for r in rows if r["bench"] == "toy_base_compiled"}
    if compiled:
        eager, loop = compiled["eager (layer-major)"], compiled["eager chunk loop"]
        label, = (label for label in compiled if label.startswith("compiled"))
        summary[f"toy_base_{eager['tokens']}_tokens_compiled"] = dict(  # tokens/s of CPU time
            compiled_vs_eager=compiled[label]["tokens_per_s"] / eager["tokens_per_s"],
            compiled_vs_eager_chunk_loop=compiled[label]["tokens_per_s"] / loop["tokens_per_s"],
            compile_seconds=compiled[label]["compile_seconds"],
            compile_cpu_seconds=compiled[label]["compile_cpu_seconds"],
            second_call_seconds=compiled[label]["second_call_seconds"],
        )
    trunk = {r["model"]: r for r in rows if r["bench"] == "frozen_trunk"}
    if trunk:
        every_layer, kept = (trunk[label] for label in TRUNK_MODELS)
        summary[f"frozen_trunk ({every_layer['config']})"] = dict(step_time_from_trunk_vs_every_layer=kept[clock]
                                                                  / every_layer[clock])
    for checkpointed in (True, False):
        chunks = [r for r in rows if r["bench"] == "train_memory_vs_chunks" and r["checkpoint_chunks"] == checkpointed]
        if chunks:
            summary[f"train_peak_growth_{'checkpointed' if checkpointed else 'no_checkpoint'}"] = {
                f"{r['chunks']}_vs_{chunks[0]['chunks']}_chunks": r["peak_mb"] / max(chunks[0]["peak_mb"], 1e-9)
                for r in chunks[1:]
            }
    prefill = [r for r in rows if r["bench"] == "prefill"]
    if prefill:
        first = prefill[0]
        summary["prefill_vs_shortest"] = {
            f"{r['tokens']}": dict(length_ratio=r["tokens"] / first["tokens"], time_ratio=r[clock] / first[clock],
                                   time_per_token_ratio=(r[clock] / r["tokens"]) / (first[clock] / first["tokens"]),
                                   peak_ratio=r["peak_mb"] / max(first["peak_mb"], 1e-9))
            for r in prefill[1:]
        }
    for length in sorted({r["tokens"] for r in rows if r["bench"] == "toy_base_forward"}):
        speed = {r["model"]: r["tokens_per_s"] for r in rows if r["bench"] == "toy_base_forward"
                 and r["tokens"] == length}
        memory_off = speed["same chunk loop, memory off"]
        summary[f"toy_base_{length}_tokens"] = dict(  # tokens/s of CPU time
            memory_vs_memory_off=speed["toy base with memory"] / memory_off,
            memory_off_time_vs_full_attention=speed["plain base, full attention"] / memory_off,
        )
    return summary


def print_table(rows: list[dict]) -> None:
    columns = ["bench", "config", "model", "checkpoint_chunks", "chunks", "rows", "tokens", "chunk_size", "tokens_per_s",
               "seconds", "cpu_seconds", "peak_mb", "compile_seconds", "model_tflops_per_s", "percent_of_bf16_peak"]
    shown = [c for c in columns if any(c in r for r in rows)]
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    table = [shown] + [[fmt(r.get(c)) for c in shown] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(shown))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute on 2 CPU cores")
    parser.add_argument("--json", type=Path, help="write rows and summary here")
    parser.add_argument("--gpu", action="store_true", help="only the prepared device run (0.5B shape, 32k, bf16)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="--gpu: the device's dense bf16 peak in TFLOP/s (H100 / H200 SXM: 989)")
    parser.add_argument("--compile", action="store_true",
                        help="only compile_chunks() against eager (CPU, --compile-backend): the CPU demo's model at "
                             "batch 1 (1024 tokens, forward) and the tiny training step (256 tokens); compile time "
                             "and tokens/s")
    parser.add_argument("--compile-backend", default="inductor",
                        help="--compile and --gpu: torch.compile's backend for compile_chunks() (--gpu: 'none' leaves "
                             "the compiled column out)")
    parser.add_argument("--long", action="store_true", help="full mode: the prefill at 1M prompt tokens as well")
    parser.add_argument("--base", default=None,
                        help="trunk part: a local Qwen folder (e.g. outputs/real_base/base, scripts/real_base.sh's "
                             "converted SmolLM2) for the frozen-trunk step; default the tiny config")
    parser.add_argument("--base-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="--base: the base's dtype (bfloat16, the real-base recipe's; float32 on a CPU without "
                             "bfloat16 units, AVX512-BF16 or AMX, where bfloat16 runs emulated)")
    parser.add_argument("--only", choices=["train", "chunks", "prefill", "demo", "trunk"], nargs="*",
                        help="full or quick mode: only these parts")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: idle OpenMP threads spin, which inflates CPU time when shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows: list[dict] = []
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device here")
        device = torch.device("cuda")
        rows += bench_device("qwen2.5-0.5b shape, bf16", QWEN25_05B, 32768, 4096, device, torch.bfloat16,
                             args.peak_tflops, None if args.compile_backend == "none" else args.compile_backend)
    elif args.compile:
        device = torch.device("cpu")
        rows += bench_compiled_toy_base(1024, repeats=5, backend=args.compile_backend)
        rows += bench_training("tiny", TINY, None, 256, 64, device, torch.float32, repeats=3,
                               compile_backend=args.compile_backend)
    else:
        device, dtype = torch.device("cpu"), torch.float32
        parts = set(args.only or ["train", "chunks", "prefill", "demo", "trunk"])
        if "trunk" in parts:  # 8 rows of 8 chunks of 64 tokens: a batch of the real-base recipe's longest stage
            rows += bench_frozen_trunk(args.base, 8, 512 if not args.quick else 128, 64, repeats=3,
                                       base_dtype=args.base_dtype)
        if args.quick:
            if "train" in parts:
                rows += bench_training("tiny", TINY, None, 256, 64, device, dtype, repeats=2)
                rows += bench_training("qwen2.5-0.5b shape, 1 of 24 layers", QWEN25_05B, 1, 32, 16, device, dtype,
                                       repeats=1)
            if "chunks" in parts:
                rows += bench_chunks(32, (2, 4, 8), device, dtype)
            if "prefill" in parts:
                rows += bench_prefill((512, 2048, 8192), 512, device, dtype)
            if "demo" in parts:
                rows += bench_toy_base((1024,), repeats=3)
        else:
            if "train" in parts:
                rows += bench_training("tiny", TINY, None, 4096, 512, device, dtype, repeats=3)
                rows += bench_training("qwen2.5-0.5b shape", QWEN25_05B, None, 512, 128, device, dtype, repeats=2)
            if "chunks" in parts:
                rows += bench_chunks(512, (2, 4, 8), device, dtype)
            if "prefill" in parts:
                rows += bench_prefill((8192, 32768, 131072) + ((1 << 20,) if args.long else ()), 4096, device, dtype)
            if "demo" in parts:
                rows += bench_toy_base((1024, 4096), repeats=5)

    print_table(rows)
    summary = summarise(rows, "seconds" if device.type == "cuda" else "cpu_seconds")
    print(json.dumps(summary, indent=2))
    if args.json:
        tmp = args.json.with_name(f".{args.json.name}.tmp")
        tmp.write_text(json.dumps({"device": str(device), "threads": torch.get_num_threads(),
                                   "load_average_at_end": os.getloadavg(), "rows": rows, "summary": summary},
                                  indent=2))
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
