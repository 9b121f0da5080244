"""`titans-hf recall`: the recall corpus, long documents whose facts stated early are needed chunks later.

- `titans-hf recall generate`: training and held-out documents as `.jsonl` text (for `titans-hf prepare`), and the
  held-out documents' `sft` store whose loss mask marks the recalled values (for `titans-hf eval --lm`);
- `titans-hf recall toy-base`: a toy Qwen3 base (a tokenizer and a small Qwen3 pretrained on short recall text), the
  offline base of `scripts/recall.sh` (a pretrained Qwen needs none).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from titans_hf.data.tokenizers import check_tokenizer_argument
from titans_hf.files import give_umask_permissions, remove_path, short_name
from titans_hf.outputs import check_folder_output, check_outputs, record_folder, record_outputs, replace_outputs
from titans_hf.tasks.recall import (
    DEFAULT_PEOPLE,
    DEFAULT_POOL_SIZE,
    iter_recall_documents,
    people_pool,
    value_pool,
    write_recall_jsonl,
)
from titans_hf.tasks.recall.files import check_store_output, write_recall_eval_store
from titans_hf.tasks.recall.toy_base import pretrain_toy_base

from .arguments import length, local_or_hub

TRAIN_NAME, EVAL_NAME, EVAL_DEPENDENT_NAME = "train.jsonl", "eval.jsonl", "eval_dependent"
# What `toy-base` did (steps, loss, shape), in the base's folder (which only ever appears whole).
PRETRAINING_NAME = "pretraining.json"


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """What a document holds (the defaults are the measured recipe's)."""
    parser.add_argument("--pool-size", type=int, default=DEFAULT_POOL_SIZE, help="invented names values come from")
    parser.add_argument("--people", type=int, default=DEFAULT_PEOPLE, help="people documents are about, in all")
    parser.add_argument("--num-people", type=int, default=4, help="people per document, one statement each")
    parser.add_argument("--max-references", type=int, default=8, help="later references per person")
    parser.add_argument("--reference-rate", type=float, default=0.9,
                        help="chance that a body sentence refers back, when a reference is due")
    parser.add_argument("--echo-rate", type=float, default=1.0,
                        help="share of references that repeat the statement's cue (\"Orlen's horse Tamsin ...\"), "
                        "the rest name an action (\"Orlen saddled Tamsin ...\")")


def corpus_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"pool": value_pool(args.pool_size), "people": people_pool(args.people), "num_people": args.num_people,
            "max_references": args.max_references, "reference_rate": args.reference_rate,
            "echo_rate": args.echo_rate}


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "recall", help="write the recall corpus: long documents whose early facts are needed chunks later",
        description="The recall corpus measures what the memory buys on ordinary text: facts stated early in a "
        "document are referred to chunks later, where only the memory can supply them.")
    actions = parser.add_subparsers(dest="recall_command", required=True)

    generate = actions.add_parser(
        "generate",
        help="write recall documents as .jsonl text and the held-out documents' dependent-token store",
        description="Seeded documents of ordinary prose in which people are given attributes early (\"Captain "
        "Orlen's horse was called Tamsin.\") and referred to at least --min-distance tokens later; each is at most "
        "--window-size - 1 tokens of TOKENIZER (EOS makes one window). Writes OUTPUT_DIR/train.jsonl and eval.jsonl "
        "(titans-hf prepare them into seq stores) and OUTPUT_DIR/eval_dependent, an sft store of the held-out "
        "documents whose loss mask marks the recalled values (titans-hf eval --lm --train-type sft).",
    )
    generate.add_argument("--output-dir", required=True)
    generate.add_argument("--tokenizer", required=True, type=local_or_hub,
                          help="the tokenizer that counts the tokens (your model's): Hub id or local folder")
    generate.add_argument("--num-train", type=int, default=19200, help="training documents")
    generate.add_argument("--num-eval", type=int, default=128, help="held-out documents (another seed)")
    generate.add_argument("--window-size", type=length, default=256, help="tokens of a document with its EOS")
    generate.add_argument("--min-distance", type=int, default=32,
                          help="tokens between a value's last mention and its reference; one chunk or more puts every "
                          "recalled value in a later chunk than its statement")
    add_corpus_arguments(generate)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--overwrite", action="store_true",
                          help="replace existing outputs (the store only if it is a token store)")
    generate.set_defaults(func=generate_command)

    toy_base = actions.add_parser(
        "toy-base",
        help="pretrain a toy Qwen3 base and its tokenizer on short recall text (the offline base of scripts/recall.sh)",
        description="Stage a of the recall recipe: a byte-level tokenizer and a small Qwen3 trained with the plain "
        "transformers.Trainer on short recall documents and name glossaries, saved as a plain Qwen folder.",
    )
    toy_base.add_argument("--output-dir", required=True)
    toy_base.add_argument("--steps", type=int, default=1200)
    toy_base.add_argument("--batch-size", type=int, default=32)
    toy_base.add_argument("--learning-rate", type=float, default=3e-3)
    add_corpus_arguments(toy_base)
    toy_base.add_argument("--seed", type=int, default=0)
    toy_base.add_argument("--overwrite", action="store_true",
                          help="replace a toy base folder this command wrote earlier")
    toy_base.set_defaults(func=toy_base_command)


def _at_least(args: argparse.Namespace, names: tuple[str, ...], low: int) -> None:
    """Refuse, before anything is written, a count flag below `low`, naming the flag."""
    for name in names:
        value = getattr(args, name)
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {low}")


def _check_corpus_arguments(args: argparse.Namespace) -> None:
    _at_least(args, ("pool_size", "people", "num_people"), 1)
    _at_least(args, ("max_references",), 0)
    for name in ("reference_rate", "echo_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a rate in [0, 1]")


def generate_command(args: argparse.Namespace) -> int:
    """Every argument and output is checked first; the three outputs are written under temporary names and
    renamed into place together, so a run that fails leaves none of them (and the previous ones, with
    --overwrite, as they were)."""
    from transformers import AutoTokenizer

    _at_least(args, ("num_train", "num_eval"), 1)
    _at_least(args, ("window_size",), 2)
    _at_least(args, ("min_distance",), 0)
    _check_corpus_arguments(args)
    check_tokenizer_argument(args.tokenizer, "--tokenizer")
    output = Path(args.output_dir)
    targets = [output / TRAIN_NAME, output / EVAL_NAME, output / EVAL_DEPENDENT_NAME]
    check_outputs(targets[:2], args.overwrite)
    check_store_output(targets[2], args.overwrite)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    settings = dict(corpus_settings(args), length=args.window_size - 1, min_distance=args.min_distance)
    output.mkdir(parents=True, exist_ok=True)
    partial = [output / f".{target.name}.partial-{uuid.uuid4().hex[:8]}" for target in targets[:2]]
    finished: list[Path] = []
    try:
        write_recall_jsonl(iter_recall_documents(args.num_train, seed=args.seed, tokenizer=tokenizer, **settings),
                           partial[0])
        held_out = list(iter_recall_documents(args.num_eval, seed=args.seed + 1, tokenizer=tokenizer, **settings))
        write_recall_jsonl(held_out, partial[1])
        finished = [*partial, write_recall_eval_store(held_out, targets[2], tokenizer)]
        check_outputs(targets[:2], args.overwrite)  # again: something may have appeared there meanwhile
        check_store_output(targets[2], args.overwrite)
        replace_outputs(finished, targets)
    except BaseException:
        for path in [*partial, *finished]:
            remove_path(path)
        raise
    record_outputs(output, [TRAIN_NAME, EVAL_NAME], "titans-hf recall generate")
    references = sum(len(document.references) for document in held_out)
    print(f"wrote {output / TRAIN_NAME} ({args.num_train} documents), {output / EVAL_NAME} ({args.num_eval}, "
          f"{references} recalled values) and {output / EVAL_DEPENDENT_NAME}")
    return 0


def toy_base_command(args: argparse.Namespace) -> int:
    """Trained in a temporary folder beside the output and renamed into place once saved (a killed run leaves no
    folder that looks like a finished base); --overwrite replaces only a folder this command wrote whole (its
    outputs manifest lists every file in it), never a folder that merely holds a config.json."""
    _at_least(args, ("steps", "batch_size"), 1)
    if not args.learning_rate > 0:
        raise ValueError(f"--learning-rate {args.learning_rate}: must be > 0")
    _check_corpus_arguments(args)
    output = Path(args.output_dir)
    check_folder_output(output, args.overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{short_name(output.name)}.partial-", dir=output.parent))
    try:
        give_umask_permissions(scratch)
        done = pretrain_toy_base(scratch, corpus_settings(args), steps=args.steps, batch_size=args.batch_size,
                                 learning_rate=args.learning_rate, seed=args.seed)
        (scratch / PRETRAINING_NAME).write_text(json.dumps(done, indent=2) + "\n")
        record_folder(scratch, "titans-hf recall toy-base")
        check_folder_output(output, args.overwrite)  # again: something may have appeared there meanwhile
        replace_outputs([scratch], [output])
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    print(f"toy base {output}: {done['steps']} steps, final loss {done['final_loss']:.3f}, mean cosine of the "
          f"values' embeddings {done['value_embedding_cosine']:.2f}")
    return 0
