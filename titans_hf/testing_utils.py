"""A public helper: small tokenizers and Qwen models built on disk, with no download.

The CPU demo's toy Qwen3 base, the tests and the benchmarks run offline, yet they exercise the same
``from_pretrained`` path a Hub id takes: these functions write ordinary Hugging Face folders that
``AutoTokenizer`` / ``AutoModelForCausalLM`` load. Useful for trying a recipe on a laptop in seconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

END_OF_TEXT = "<|endoftext|>"


def build_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int = 1024,
    pad_token: str | None = END_OF_TEXT,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer like Qwen's (leading spaces live inside tokens).

    Byte-level means any text round-trips, so `" " + target` decodes back exactly,
    which the BABILong label tests rely on. ``pad_token=None`` gives a tokenizer
    without a pad token, the case where callers must fall back to EOS.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END_OF_TEXT, pad_token=pad_token, model_max_length=1 << 30
    )
    wrapped.save_pretrained(str(out_dir))
    return wrapped


def build_qwen(
    out_dir: str | Path,
    vocab_size: int,
    family: str = "qwen3",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    seed: int = 0,
    **config_overrides,
):
    """Save a randomly initialised Qwen2 or Qwen3 causal LM to ``out_dir`` and return it."""
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=True,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out_dir))
    return model


def pretrain_causal_lm(
    model,
    tokenizer,
    documents: list[str],
    out_dir: str | Path,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    max_tokens: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> list[float]:
    """Train `model` as an ordinary causal LM on `documents` (each ended by EOS, at most `max_tokens` tokens) with
    the plain `transformers.Trainer`, cosine schedule, then save it with its tokenizer in `out_dir`. Returns the
    logged training losses."""
    import datasets
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    # cut by hand: the tokenizer's own truncation would stay set in its backend and be saved in tokenizer.json
    keep = max_tokens - 1 if max_tokens else None
    encoded = tokenizer(documents)["input_ids"]
    rows = datasets.Dataset.from_dict({"input_ids": [ids[:keep] + [tokenizer.eos_token_id] for ids in encoded]})
    with tempfile.TemporaryDirectory(prefix="titans_pretrain_") as scratch:
        args = TrainingArguments(
            output_dir=scratch,
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            learning_rate=learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=30,
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=max(1, steps // 10),
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=seed,
            disable_tqdm=not show_progress,
        )
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
        trainer.train()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def mean_embedding_cosine(model, tokenizer, words: list[str]) -> float:
    """Mean cosine similarity between the input embeddings of `words` (the first token of " word" each). Near 1,
    the model holds one vector for all of them, and a memory reading them cannot tell them apart."""
    ids = [tokenizer(" " + word, add_special_tokens=False)["input_ids"][0] for word in words]
    vectors = torch.nn.functional.normalize(model.get_input_embeddings().weight.detach()[ids].float(), dim=-1)
    cosines = vectors @ vectors.T
    return float((cosines.sum() - cosines.diagonal().sum()) / (len(ids) * (len(ids) - 1)))
