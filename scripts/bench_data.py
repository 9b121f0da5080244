#!/usr/bin/env python
"""Benchmark the data pipeline against the baselines it must stay close to.

(a) prepare: `titans_hf.data.prepare.prepare` (read .jsonl, tokenize, write a store) against the
    tokenizer's own batched encode of the same documents held in memory. Goal: <= 20% overhead.
(b) windows: iterating the Arrow window dataset (`load_dataset("titans_tokens", ...)`) against
    slicing the same windows straight from the memmap. Goal: >= 50% of raw memmap throughput.
(c) memory: peak RSS of a process serving every window of a ~1 GB store (`TokenExamples` over
    `MmapStore`) against one loading that store whole; each in its own subprocess.
    Goal: serving stays < 300 MB whatever the store size.

    python scripts/bench_data.py [--quick] [--json results.json]

Runs offline: the tokenizer is a byte-level BPE trained here on the synthetic corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WINDOW = 2048
BATCH = 64


def _cpu_seconds() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(item.ru_utime + item.ru_stime for item in usage)


def timed_rounds(repeats: int, functions: dict) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds of each function over `repeats` rounds, run in turns so that load from
    other work on a shared machine falls on all of them alike; runs of one round are neighbours in
    time, so their ratio is steadier than the ratio of separate minima. CPU time counts all threads
    and reaped worker processes."""
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            wall, cpu = time.perf_counter(), _cpu_seconds()
            function()
            times[name]["wall"].append(time.perf_counter() - wall)
            times[name]["cpu"].append(_cpu_seconds() - cpu)
    return times


def best_times(repeats: int, functions: dict) -> dict[str, dict[str, float]]:
    """Fastest wall and CPU time of each function (see `timed_rounds`)."""
    rounds = timed_rounds(repeats, functions)
    return {name: {kind: min(values) for kind, values in kinds.items()} for name, kinds in rounds.items()}


def synthetic_documents(total_chars: int, seed: int = 0) -> list[str]:
    """Prose-like documents of ~40k characters: Zipf-distributed words in sentences and paragraphs."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = np.array(["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(3000)])
    weights = 1.0 / np.arange(1, len(words) + 1)
    drawn = words[rng.choice(len(words), size=total_chars // 5, p=weights / weights.sum())]
    sentences = [" ".join(drawn[start : start + 12]).capitalize() + "." for start in range(0, len(drawn), 12)]
    paragraphs = [" ".join(sentences[start : start + 5]) for start in range(0, len(sentences), 5)]
    return ["\n".join(paragraphs[start : start + 50]) for start in range(0, len(paragraphs), 50)]


def bench_prepare(workdir: Path, total_chars: int, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from titans_hf.data.prepare import prepare
    from titans_hf.testing_utils import build_tokenizer

    documents = synthetic_documents(total_chars)
    tokenizer_dir = workdir / "tokenizer"
    build_tokenizer(documents[:20], tokenizer_dir, vocab_size=8192)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    source = workdir / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))

    def encode_only():
        for start in range(0, len(documents), 256):
            tokenizer(documents[start : start + 256], add_special_tokens=False, return_attention_mask=False)

    def run_prepare(num_proc: int):
        return lambda: prepare(source, workdir / "prepared_bin", tokenizer_dir, num_proc=num_proc, overwrite=True)

    chars = sum(len(document) for document in documents)
    rounds = timed_rounds(repeats, {"encode": encode_only, "prepare": run_prepare(1), "prepare_2": run_prepare(2)})
    seconds = {name: {kind: min(values) for kind, values in kinds.items()} for name, kinds in rounds.items()}
    paired = np.median(np.array(rounds["prepare"]["wall"]) / np.array(rounds["encode"]["wall"])) - 1
    encode_seconds, prepare_seconds = seconds["encode"]["wall"], seconds["prepare"]["wall"]
    prepare2_seconds = seconds["prepare_2"]["wall"]
    tokens = json.loads((workdir / "prepared_bin" / "meta.json").read_text())["keys"]["sequence"]["length"]
    return {
        "chars": chars,
        "tokens": tokens,
        "tokenizer_encode_s": encode_seconds,
        "prepare_s": prepare_seconds,
        "prepare_num_proc_2_s": prepare2_seconds,
        "tokenizer_chars_per_s": chars / encode_seconds,
        "prepare_chars_per_s": chars / prepare_seconds,
        "prepare_overhead": prepare_seconds / encode_seconds - 1,
        "prepare_overhead_median_of_rounds": float(paired),
        "rounds": rounds,
        "tokenizer_encode_cpu_s": seconds["encode"]["cpu"],
        "prepare_cpu_s": seconds["prepare"]["cpu"],
        "prepare_cpu_overhead": seconds["prepare"]["cpu"] / seconds["encode"]["cpu"] - 1,
    }


def write_random_store(path: Path, num_tokens: int, seed: int = 0) -> Path:
    """A bin store of random uint16 tokens in documents of 1k-100k tokens, written in place of text."""
    from titans_hf.data.stores import MmapStoreWriter

    if (path / "meta.json").exists():
        return path
    rng = np.random.default_rng(seed)
    writer = MmapStoreWriter(path, {"sequence": np.uint16}, {"train_type": "seq", "vocab_size": 50_000, "eos_token_id": 0})
    written = 0
    while written < num_tokens:
        length = min(int(rng.integers(1_000, 100_000)), num_tokens - written)
        writer.add_segment("sequence", rng.integers(1, 50_000, size=length, dtype=np.uint16))
        written += length
    os.replace(writer.finish(), path)
    return path


def bench_windows(workdir: Path, num_tokens: int, repeats: int) -> dict:
    from datasets import load_dataset

    import titans_hf  # noqa: F401  (registers titans_tokens)
    from titans_hf.data.windows import WindowIndex

    store = write_random_store(workdir / f"windows_{num_tokens}_bin", num_tokens)
    build_start = time.perf_counter()
    dataset = load_dataset(
        "titans_tokens", data_files=str(store / "meta.json"), split="train", window_size=WINDOW,
        cache_dir=str(workdir / "hf_cache"),
    )
    build_seconds = time.perf_counter() - build_start
    meta = json.loads((store / "meta.json").read_text())["keys"]["sequence"]
    memmap = np.memmap(store / "sequence.bin", dtype=np.uint16, mode="r")
    starts, _ = WindowIndex(np.asarray(meta["offsets"]), WINDOW).spans(np.arange(len(dataset)))
    numpy_dataset = dataset.with_format("numpy")

    def arrow_batches():
        for batch in numpy_dataset.iter(batch_size=BATCH):
            batch["input_ids"].sum()  # touch the data, as a collator would

    def memmap_batches():
        # The same example a window row holds: input_ids, labels (a copy) and an attention mask.
        for first in range(0, len(starts), BATCH):
            rows = np.stack([memmap[start : start + WINDOW] for start in starts[first : first + BATCH]]).astype(np.int64)
            batch = {"input_ids": rows, "labels": rows.copy(), "attention_mask": np.ones_like(rows)}
            batch["input_ids"].sum()

    def arrow_rows():
        for index in range(min(len(dataset), 2000)):
            dataset[index]

    tokens = len(starts) * WINDOW
    seconds = best_times(repeats, {"arrow": arrow_batches, "memmap": memmap_batches, "rows": arrow_rows})
    arrow_seconds, memmap_seconds, rows_seconds = (seconds[name]["wall"] for name in ("arrow", "memmap", "rows"))
    return {
        "windows": len(dataset),
        "window_size": WINDOW,
        "arrow_build_s": build_seconds,
        "arrow_batches_tokens_per_s": tokens / arrow_seconds,
        "memmap_batches_tokens_per_s": tokens / memmap_seconds,
        "arrow_python_rows_tokens_per_s": min(len(dataset), 2000) * WINDOW / rows_seconds,
        "arrow_vs_memmap": memmap_seconds / arrow_seconds,
    }


def _memory_now() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) // 1024
    return fields


def rss_child(mode: str, store: str) -> None:
    """Serve the store one way and print memory figures as JSON (run in a fresh process).

    Importing titans_hf brings torch, transformers and datasets (a few hundred MB that any training
    process holds anyway), so the figure that tells lazy serving from loading is the growth of RSS
    over the post-import baseline; RSS is sampled while serving, file-backed pages included.
    """
    from titans_hf.data.stores import MmapStore
    from titans_hf.data.windows import TokenExamples

    baseline = _memory_now()
    peak = dict(baseline)

    def sample() -> None:
        for name, value in _memory_now().items():
            peak[name] = max(peak[name], value)

    checksum, start = 0, time.perf_counter()
    store_handle = MmapStore(store)
    if mode == "serve":
        examples = TokenExamples(store_handle, "seq", window_size=4096)
        for number, first in enumerate(range(0, len(examples), BATCH)):
            batch = examples.batch(first, min(first + BATCH, len(examples)))
            checksum += int(batch["input_ids"][:, 0].sum())
            if number % 16 == 0:
                sample()
    else:
        whole = np.fromfile(Path(store) / "sequence.bin", dtype=np.uint16)
        checksum = int(whole[::4096].sum())
    sample()
    print(json.dumps({
        "mode": mode,
        "seconds": time.perf_counter() - start,
        "baseline_rss_mb": baseline["VmRSS"],
        "peak_rss_mb": peak["VmRSS"],
        "growth_rss_mb": peak["VmRSS"] - baseline["VmRSS"],
        "peak_anon_mb": peak["RssAnon"],
        "peak_file_mb": peak["RssFile"],
        "process_max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "checksum": checksum,
    }))


def bench_rss(workdir: Path, num_tokens: int) -> dict:
    store = write_random_store(workdir / f"rss_{num_tokens}_bin", num_tokens)
    results = {"store_mb": (store / "sequence.bin").stat().st_size / 2**20}
    for mode in ("serve", "load_whole"):
        output = subprocess.run(
            [sys.executable, __file__, "--rss-child", mode, str(store)], capture_output=True, text=True, check=True
        ).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small inputs, under a minute")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--workdir", default=None, help="keep inputs and stores here (default: a temporary dir)")
    parser.add_argument("--rss-child", nargs=2, metavar=("MODE", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scale = {"prepare_chars": 1_000_000, "window_tokens": 8_000_000, "rss_tokens": 64 << 20, "repeats": 3} if args.quick else {
        "prepare_chars": 6_000_000, "window_tokens": 64_000_000, "rss_tokens": 512 << 20, "repeats": 5}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as temporary:
        workdir = Path(args.workdir or temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        results = {
            "quick": args.quick,
            "prepare": bench_prepare(workdir, scale["prepare_chars"], scale["repeats"]),
            "windows": bench_windows(workdir, scale["window_tokens"], scale["repeats"]),
            "rss": bench_rss(workdir, scale["rss_tokens"]),
        }
    prepare_result, windows, rss = results["prepare"], results["windows"], results["rss"]
    serve, whole = rss["serve"], rss["load_whole"]
    rows = [
        ("(a) tokenizer batched encode", f"{prepare_result['tokenizer_chars_per_s'] / 1e6:.2f} M chars/s", ""),
        ("(a) prepare, num_proc=1", f"{prepare_result['prepare_chars_per_s'] / 1e6:.2f} M chars/s",
         f"overhead {100 * prepare_result['prepare_overhead_median_of_rounds']:+.1f}% wall (median of rounds; "
         f"{100 * prepare_result['prepare_overhead']:+.1f}% of minima, {100 * prepare_result['prepare_cpu_overhead']:+.1f}% CPU)"
         " (goal <= +20%)"),
        ("(a) prepare, num_proc=2", f"{prepare_result['chars'] / prepare_result['prepare_num_proc_2_s'] / 1e6:.2f} M chars/s", ""),
        ("(b) raw memmap window slicing", f"{windows['memmap_batches_tokens_per_s'] / 1e6:.1f} M tok/s", ""),
        ("(b) Arrow windows, numpy batches", f"{windows['arrow_batches_tokens_per_s'] / 1e6:.1f} M tok/s",
         f"{100 * windows['arrow_vs_memmap']:.0f}% of memmap (goal >= 50%)"),
        ("(b) Arrow windows, ds[i] python rows", f"{windows['arrow_python_rows_tokens_per_s'] / 1e6:.1f} M tok/s", ""),
        (f"(c) serve all windows, {rss['store_mb']:.0f} MB store", f"RSS +{serve['growth_rss_mb']} MB",
         f"peak {serve['peak_rss_mb']} MB over {serve['baseline_rss_mb']} MB of imports, {serve['seconds']:.1f} s "
         "(goal < 300 MB)"),
        (f"(c) load the {rss['store_mb']:.0f} MB store whole", f"RSS +{whole['growth_rss_mb']} MB",
         f"peak {whole['peak_rss_mb']} MB; x{whole['growth_rss_mb'] / max(serve['growth_rss_mb'], 1):.0f} the growth of serving"),
    ]
    width = max(len(row[0]) for row in rows)
    print(f"\n{'benchmark':<{width}}  {'figure':<22}  comparison")
    for name, figure, comparison in rows:
        print(f"{name:<{width}}  {figure:<22}  {comparison}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
