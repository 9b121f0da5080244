"""What a local base's fingerprint costs (`titans_hf.modeling.memory_folder.base_fingerprint`: every byte of the
weights, config and tokenizer files).

A folder the size of a 0.5B-parameter model is built in a temporary folder: `--params` random bf16 values in
safetensors files of Qwen2.5-0.5B's proportions (an embedding, then the layers' weights), a config.json and a
tokenizer.json of `--tokenizer-mb` MB. The fingerprint runs `--rounds` times over it, the first after the folder was
just written (so from the page cache, as a base that was just loaded or downloaded is); the table gives the median
seconds and MB/s over the folder's bytes. With `--json`, writes it.

    python scripts/bench_fingerprint.py
    python scripts/bench_fingerprint.py --params 494000000 --rounds 3 --json bench_results/fingerprint.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titans_hf.modeling.memory_folder import base_fingerprint  # noqa: E402


def build_folder(folder: Path, params: int, tokenizer_mb: int, seed: int = 0) -> int:
    """A base-like folder of `params` random bf16 values (two files, tensors of 896 columns, the embedding first)
    and a tokenizer.json of `tokenizer_mb` MB; returns its size in bytes."""
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = 896, 151_936
    rows = [vocab] + [4864] * ((params - vocab * hidden) // (4864 * hidden))
    for shard, part in enumerate((rows[:len(rows) // 2], rows[len(rows) // 2:])):
        tensors = {f"tensor.{shard}.{index}": torch.randint(-(1 << 15), 1 << 15, (count, hidden), generator=generator,
                                                            dtype=torch.int16).view(torch.bfloat16)
                   for index, count in enumerate(part)}
        save_file(tensors, str(folder / f"model-0000{shard + 1}-of-00002.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": hidden,
                                                    "vocab_size": vocab}))
    vocabulary = {f"token{index:08d}": index for index in range(tokenizer_mb * 1_000_000 // 22)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocabulary}}))
    return sum(path.stat().st_size for path in folder.iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=494_000_000, help="bf16 values in the weights")
    parser.add_argument("--tokenizer-mb", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_fingerprint_") as name:
        folder = Path(name)
        size = build_folder(folder, args.params, args.tokenizer_mb)
        seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            base_fingerprint(folder)
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    row = {"fingerprint": "full", "median_s": median, "rounds_s": seconds, "mb_per_s": size / 1e6 / median}
    print(f"folder: {size / 1e6:.0f} MB ({args.params:,} bf16 values, tokenizer.json {args.tokenizer_mb} MB), "
          f"{args.rounds} rounds, page cache")
    print(f"{'fingerprint':<18} {'median s':>10} {'MB/s':>10}")
    print(f"{row['fingerprint']:<18} {row['median_s']:>10.4f} {row['mb_per_s']:>10.0f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"folder_bytes": size, "params": args.params, "rounds": args.rounds,
                                         "rows": [row], "machine": platform.platform(),
                                         "processor": platform.processor()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
