"""A preference only the memory can satisfy, learned by DPO and by GRPO on a frozen toy base, memory off beside it.

Each row opens with a fact ("the key is plum."), then filler prose for several chunks, then "the key was": the
right answer is the word of the fact, which lies further back than attention reaches (the CPU demo's memory
settings: attention inside the current chunk only), so the frozen base alone cannot prefer it (memory off: pair accuracy 0.5, pick accuracy 1 / the
number of words). The rows go the way a user's would: jsonl -> `titans-hf prepare` (dpo pairs: the right word
against another; grpo groups: every word, reward 1 for the right one) -> `load_dataset("titans_tokens")` ->
`TitansTrainer` (each prompt streamed through the memory once, every answer scored from its memory state). The same
toy base, memory settings, seed and step budget for both; held-out rows score each memory with it on and off.

    nice -n 10 python scripts/bench_preference.py --json bench_results/preference.json   # about 6 minutes
    python scripts/bench_preference.py --quick        # a smoke run: few steps, few rows
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import titans_hf  # noqa: E402, F401  (registers the builders)
from titans_hf.commands.demo_job import MEMORY_SETTINGS  # noqa: E402
from titans_hf.data.collator import CompletionsCollator  # noqa: E402
from titans_hf.data.prepare import prepare  # noqa: E402
from titans_hf.files import atomic_write_json  # noqa: E402
from titans_hf.modeling import TitansQwenForCausalLM  # noqa: E402
from titans_hf.testing_utils import build_qwen, build_tokenizer, pretrain_causal_lm  # noqa: E402
from titans_hf.training import TitansTrainer, TitansTrainingArguments  # noqa: E402

WORDS = ["plum", "pear", "lime", "fig"]
FILLER = ("the old clock struck noon while the river carried leaves past the mill . ships waited in the harbour "
          "for the tide and the farmers spoke of rain . letters came from the capital full of news .").split()
CHUNK = 16
# the CPU demo's memory settings (no forgetting, chunk-local attention: memory off, no chunk sees another)
MEMORY = {**MEMORY_SETTINGS, "chunk_size": CHUNK, "memory_chunk_size": 4, "variant": "mag"}


def make_row(rng: random.Random, filler_tokens: int) -> tuple[str, str]:
    """(prompt, right word): the fact, `filler_tokens` words of prose, the question."""
    word = rng.choice(WORDS)
    start = rng.randrange(len(FILLER))
    filler = [FILLER[(start + i) % len(FILLER)] for i in range(filler_tokens)]
    return f"the key is {word} . " + " ".join(filler) + " . the key was", word


def build_toy_base(work: Path, pretrain_steps: int) -> tuple[Path, AutoTokenizer]:
    """A tiny Qwen3 (hidden 64, 2 layers) pretrained as a plain LM on filler prose and facts, saved, then frozen."""
    rng = random.Random(1)
    corpus = [make_row(rng, 40)[0] + f" {w}" for w in WORDS for _ in range(50)] + [" ".join(FILLER)] * 50
    folder = work / "toy_base"
    tokenizer = build_tokenizer(corpus, folder, vocab_size=512)
    model = build_qwen(folder, vocab_size=len(tokenizer), family="qwen3")
    pretrain_causal_lm(model, tokenizer, corpus, folder, steps=pretrain_steps, batch_size=16, max_tokens=64,
                       show_progress=False)
    for word in WORDS:
        if len(tokenizer(f" {word}").input_ids) != 1:
            raise ValueError(f"' {word}' must be one token of the toy base's tokenizer")
    return folder, tokenizer


def write_stores(work: Path, tokenizer_dir: Path, rows: list[tuple[str, str]], seed: int) -> dict[str, Path]:
    rng = random.Random(seed)
    pairs = [{"prompt": prompt, "chosen": f" {word}", "rejected": f" {rng.choice([w for w in WORDS if w != word])}"}
             for prompt, word in rows]
    groups = [{"prompt": prompt, "responses": [f" {w}" for w in WORDS], "rewards": [float(w == word) for w in WORDS]}
              for prompt, word in rows]
    stores = {}
    for train_type, records in (("dpo", pairs), ("grpo", groups)):
        jsonl = work / f"{train_type}.jsonl"
        jsonl.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
        [stores[train_type]] = prepare(jsonl, work / f"{train_type}.h5", str(tokenizer_dir), train_type=train_type)
    return stores


@torch.no_grad()
def score(model: TitansQwenForCausalLM, tokenizer, rows: list[tuple[str, str]], rng: random.Random) -> dict:
    """Pair accuracy (the right word above one other, as in the DPO pairs) and pick accuracy (the right word above
    all others), with the memory on and off, every candidate scored from one read of its prompt."""
    model.eval()
    word_ids = [tokenizer(f" {w}").input_ids for w in WORDS]
    collate = CompletionsCollator(tokenizer.pad_token_id, chunk_size=CHUNK)
    others = [rng.choice([i for i in range(len(WORDS)) if WORDS[i] != word]) for _, word in rows]
    results = {}
    for memory, context in (("memory", torch.enable_grad), ("no_memory", model.memory_disabled)):
        pair = pick = 0
        with context():
            with torch.no_grad():
                for start in range(0, len(rows), 16):
                    block = rows[start:start + 16]
                    batch = collate([{"prompt_ids": tokenizer(prompt).input_ids, "completion_ids": word_ids,
                                      "completion_mask": [[1] * len(ids) for ids in word_ids],
                                      "rewards": [0.0] * len(WORDS)} for prompt, _ in block])
                    log_probs = model.completion_log_probs(batch["prompt_ids"], batch["completion_ids"],
                                                           batch["prompt_attention_mask"],
                                                           batch["completion_mask"]).sum(-1)
                    for row, (_, word) in enumerate(block):
                        right = WORDS.index(word)
                        pair += int(log_probs[row, right] > log_probs[row, others[start + row]])
                        pick += int(int(log_probs[row].argmax()) == right)
        results[memory] = {"pair_accuracy": pair / len(rows), "pick_accuracy": pick / len(rows)}
    return results


def train(train_type: str, base: Path, tokenizer, store: Path, work: Path, args: argparse.Namespace) -> tuple:
    rows = datasets.load_dataset("titans_tokens", data_files=str(store), train_type=train_type,
                                 cache_dir=str(work / "cache"))["train"]
    torch.manual_seed(args.seed)
    model = TitansQwenForCausalLM.from_base(base, **MEMORY)
    training = TitansTrainingArguments(
        output_dir=str(work / f"out_{train_type}"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.steps, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=max(1, args.steps // 10), save_strategy="no",
        report_to="none", use_cpu=True, seed=args.seed, dpo_beta=args.dpo_beta, max_grad_norm=1.0,
        disable_tqdm=not args.progress,
    )
    trainer = TitansTrainer(model=model, args=training, train_dataset=rows, processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, time.perf_counter() - started, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=8,
                        help="Batches per optimizer step (TitansTrainingArguments' default).")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--dpo-beta", type=float, default=1.0)
    parser.add_argument("--chunks", type=int, default=3, help="Chunks of 16 tokens per prompt (the fact in the first).")
    parser.add_argument("--train-rows", type=int, default=512)
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="Write the results here.")
    parser.add_argument("--work", type=Path, default=None,
                        help="Keep stores and the toy base here (default: a temp dir).")
    parser.add_argument("--quick", action="store_true", help="A smoke run: few steps and rows.")
    parser.add_argument("--progress", action="store_true", help="Show the Trainer's progress bars.")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.train_rows, args.eval_rows, args.pretrain_steps = 10, 32, 32, 20
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_preference_"))
    work.mkdir(parents=True, exist_ok=True)

    base, tokenizer = build_toy_base(work, args.pretrain_steps)
    filler_tokens = args.chunks * CHUNK - 12  # fact and question take about 12 tokens
    rng = random.Random(args.seed)
    train_rows = [make_row(rng, filler_tokens) for _ in range(args.train_rows)]
    eval_rows = [make_row(rng, filler_tokens) for _ in range(args.eval_rows)]
    prompt_lengths = [len(tokenizer(prompt).input_ids) for prompt, _ in eval_rows]
    stores = write_stores(work, base, train_rows, args.seed)

    results = {"settings": {**vars(args), "json": str(args.json), "work": str(work), "memory": MEMORY,
                            "words": WORDS, "prompt_tokens": [min(prompt_lengths), max(prompt_lengths)],
                            "fact_distance_chunks": (max(prompt_lengths) - 1) // CHUNK},
               "runs": {}}
    for train_type in ("dpo", "grpo"):
        model, seconds, losses = train(train_type, base, tokenizer, stores[train_type], work, args)
        results["runs"][train_type] = {**score(model, tokenizer, eval_rows, random.Random(args.seed + 1)),
                                       "seconds": round(seconds, 1), "losses": losses}
    untrained = TitansQwenForCausalLM.from_base(base, **MEMORY)
    results["runs"]["untrained"] = score(untrained, tokenizer, eval_rows, random.Random(args.seed + 1))

    print(f"\nfact {results['settings']['fact_distance_chunks']} chunks of {CHUNK} tokens before the question; "
          f"{args.steps} steps of {args.batch_size} x {args.gradient_accumulation_steps} rows; {args.eval_rows} held-out rows; chance: pair 0.5, pick "
          f"{1 / len(WORDS):.2f}")
    print(f"{'memory trained by':<18} {'pair, memory':>13} {'pair, off':>10} {'pick, memory':>13} {'pick, off':>10} "
          f"{'seconds':>8}")
    for name, run in results["runs"].items():
        print(f"{name:<18} {run['memory']['pair_accuracy']:>13.3f} {run['no_memory']['pair_accuracy']:>10.3f} "
              f"{run['memory']['pick_accuracy']:>13.3f} {run['no_memory']['pick_accuracy']:>10.3f} "
              f"{run.get('seconds', 0):>8.1f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, results)


if __name__ == "__main__":
    main()
