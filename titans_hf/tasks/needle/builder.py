"""``titans_needle``: passkey and multi-key rows (generated offline, or another harness's JSON) as tokenised
training examples, loss on the key and the period that ends it.

Usage, once ``titans_hf`` is imported (it registers the builder)::

    load_dataset("titans_needle", task="passkey", length=4096, num_samples=1000, seed=0,
                 haystack_files=["books/"], tokenizer="path/to/tokenizer", max_length=4160)
    load_dataset("titans_needle", task="mk", length=4096, num_samples=1000, tokenizer=..., max_length=4160)
    load_dataset("titans_needle", data_files="passkey/4k.json", task="passkey", tokenizer=..., max_length=4160)
    build_needle(task="passkey", length=4096, num_samples=1000, tokenizer=..., max_length=4160)  # the class route

The settings are BABILong's (``titans_hf.tasks.babilong.builder.TitansBabilongConfig``: the rows are assembled by the
same code, with the needle's prompt template) plus ``filler``. Each row also holds ``needle_position``: the index in
``input_ids`` of the asked key's first token inside the haystack (-1 when truncation cut it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import datasets

from titans_hf.data import source_hash
from titans_hf.tasks.babilong.builder import FEATURES, ROWS_PER_CHUNK, TitansBabilong, TitansBabilongConfig

from .generate import NEEDLE_TASKS, PROMPT_TEMPLATE, iter_needle_batches
from .scoring import needle_token

NEEDLE_FEATURES = datasets.Features({**FEATURES, "needle_position": datasets.Value("int32")})


@dataclass
class TitansNeedleConfig(TitansBabilongConfig):
    """Settings of ``titans_needle``: those of ``titans_babilong`` (``task`` is "passkey" or "mk"), and ``filler``:
    LongLoRA's repeated filler sentence as the haystack instead of prose (for comparison only)."""

    BUILDER_NAME = "titans_needle"

    filler: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.filler, bool):
            raise ValueError(f"titans_needle: filler={self.filler!r} must be true or false")


class TitansNeedle(TitansBabilong):
    BUILDER_CONFIG_CLASS = TitansNeedleConfig
    config: TitansNeedleConfig
    FEATURES = NEEDLE_FEATURES
    GENERATED_TASKS = NEEDLE_TASKS
    PROMPT_TEMPLATE = PROMPT_TEMPLATE
    # the key is labelled with the period that ends it in the needle ("The pass key is 68231."): a model trained on
    # the key alone learns to go on with digits after it, and greedy scoring reads " 6823133" as a wrong key
    ANSWER_END = "."
    DESCRIPTION = "A key hidden in a long haystack (passkey, RULER's multi-key), tokenised for titans_hf"

    def _generated_batches(self, tokenizer, indices: list[int]) -> Iterator[list[dict]]:
        config = self.config
        return iter_needle_batches(
            config.task, config.num_samples, config.length, tokenizer, config.seed,
            haystack_files=config.haystack_files, row_indices=indices, batch_size=ROWS_PER_CHUNK,
            haystack_dataset=config.haystack_source(), filler=config.filler,
            expected_haystack_digests=config.haystack_key,
        )

    def _example(self, row: dict, tokenizer) -> dict[str, Any]:
        example = super()._example(row, tokenizer)
        place = needle_token(row, tokenizer, self.PROMPT_TEMPLATE)
        cut = place.prompt_tokens - example["prompt_length"]  # the tokens after the special prefix that truncation cut
        kept = place.needle is not None and place.needle >= place.special_prefix + cut
        example["needle_position"] = place.needle - cut if kept else -1
        return example


def build_needle(cache_dir: str | None = None, num_proc: int | None = None, **config) -> datasets.DatasetDict:
    """The builder-class route (works offline): prepare the Arrow cache, return the splits. ``config`` takes the
    fields of ``TitansNeedleConfig`` plus ``data_files``."""
    builder = TitansNeedle(cache_dir=cache_dir, hash=source_hash("titans_needle"), **config)
    builder.download_and_prepare(num_proc=num_proc)
    return builder.as_dataset()
