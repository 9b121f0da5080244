"""A toy Qwen3 base for the recall corpus: a tokenizer and a small Qwen3 pretrained on short recall text, so the
recall recipe runs offline on a CPU (`titans-hf recall toy-base`, `scripts/recall.sh`).

A pretrained Qwen reads recall documents as it reads any prose; a model made here has to learn that text first,
from rows short enough for full attention (stage a, the plain `transformers.Trainer`):

- copy documents (`copy_share`): one person, dense with references, so the base learns to continue "Orlen's horse"
  with the value the context gave, which keeps the values' embeddings apart;
- glossary documents (`glossary_share`): sentences saying what each name means, a context of its own for every
  name (without one, training folds names that occur in the same contexts into one vector; docs/frozen_base.md);
- short documents (the rest): several people, laid out like the long ones, so the base knows a long document's
  first chunk when it later reads it alone.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from titans_hf.testing_utils import build_qwen, build_tokenizer, mean_embedding_cosine, pretrain_causal_lm

from .generate import generate_recall, glossary_document, people_pool, value_pool

# The toy base's shape (the CPU demo's and the recall recipe's): big enough to learn the domain's language, small
# enough for minutes of CPU.
TOY_BASE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def toy_base_documents(
    num_documents: int,
    tokenizer,
    corpus: dict[str, Any],
    copy_share: float = 0.3,
    glossary_share: float = 0.4,
    copy_length: int = 64,
    short_length: int = 128,
    seed: int = 0,
) -> list[str]:
    """`num_documents` texts of stage a, shuffled: copy, glossary and short documents (lengths in tokens of
    `tokenizer`). `corpus`: the long documents' settings (`pool`, `people`, `num_people`, `echo_rate`, ...), whose
    names, people and sentence forms the stage-a text shares."""
    if not (0 <= copy_share and 0 <= glossary_share and copy_share + glossary_share <= 1):
        raise ValueError(f"toy_base_documents: copy_share={copy_share} and glossary_share={glossary_share} must be "
                         ">= 0 and sum to at most 1")
    shared = {key: corpus[key] for key in ("pool", "people", "echo_rate") if key in corpus}
    copies = round(copy_share * num_documents)
    glossaries = round(glossary_share * num_documents)
    documents = [d.text for d in generate_recall(copies, seed=seed + 1, tokenizer=tokenizer, length=copy_length,
                                                 num_people=1, min_distance=0, max_references=4, reference_rate=0.9,
                                                 **shared)]
    documents += [d.text for d in generate_recall(num_documents - copies - glossaries, seed=seed + 2,
                                                  tokenizer=tokenizer, length=short_length,
                                                  num_people=corpus.get("num_people", 4), min_distance=0,
                                                  max_references=2, reference_rate=0.5, **shared)]
    names = list(corpus.get("pool") or value_pool()) + list(corpus.get("people") or people_pool())
    rng = random.Random(f"titans_hf.recall.glossary:{seed}")
    documents += [glossary_document(rng, names) for _ in range(glossaries)]
    random.Random(seed).shuffle(documents)
    return documents


def build_recall_tokenizer(out_dir: str | Path, corpus: dict[str, Any], vocab_size: int = 2048, seed: int = 0):
    """A byte-level BPE tokenizer trained on recall text (sized in characters) and glossaries: every person and
    value of the pools is one token."""
    sample = [d.text for d in generate_recall(1500, seed=seed + 77, length=1500, **corpus)]
    names = list(corpus.get("pool") or value_pool()) + list(corpus.get("people") or people_pool())
    sample += [glossary_document(random.Random(index), names) for index in range(500)]
    return build_tokenizer(sample, out_dir, vocab_size=vocab_size)


def pretrain_toy_base(
    out_dir: str | Path,
    corpus: dict[str, Any],
    steps: int = 1200,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    vocab_size: int = 2048,
    seed: int = 0,
    show_progress: bool = True,
    **text_settings: Any,
) -> dict[str, Any]:
    """Stage a: tokenizer, then a small Qwen3 (`TOY_BASE_SHAPE`) trained on `steps * batch_size` stage-a documents
    (`text_settings` go to `toy_base_documents`), saved with its tokenizer as a plain Qwen folder in `out_dir`.
    Returns what was done."""
    out_dir = Path(out_dir)
    tokenizer = build_recall_tokenizer(out_dir, corpus, vocab_size=vocab_size, seed=seed)
    documents = toy_base_documents(steps * batch_size, tokenizer, corpus, seed=seed, **text_settings)
    model = build_qwen(out_dir, vocab_size=len(tokenizer), family="qwen3", seed=seed,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TOY_BASE_SHAPE)
    losses = pretrain_causal_lm(model, tokenizer, documents, out_dir, steps, batch_size=batch_size,
                                learning_rate=learning_rate, seed=seed, show_progress=show_progress)
    pool = list(corpus.get("pool") or value_pool())
    return {"steps": steps, "documents": len(documents), "final_loss": losses[-1], "shape": TOY_BASE_SHAPE,
            "vocab_size": len(tokenizer), "value_embedding_cosine": mean_embedding_cosine(model, tokenizer, pool)}
