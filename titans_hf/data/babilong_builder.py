"""``titans_babilong``: BABILong rows (public JSON or generated offline) as tokenised training examples.

Usage, once ``titans_hf`` is imported (it registers the builder)::

    load_dataset("titans_babilong", data_files="qa1/32k.json", tokenizer="Qwen/Qwen2.5-0.5B",
                 max_length=32768, answer_reserve_tokens=64)
    load_dataset("titans_babilong", task="qa1", length=2048, num_samples=5000, seed=0,
                 tokenizer="path/to/tokenizer", max_length=2304)
    build_babilong(task="qa1", length=2048, num_samples=5000, seed=0,
                   tokenizer="path/to/tokenizer", max_length=2304)   # the builder-class route

Without data files ``load_dataset`` would look for files in the working directory;
``titans_hf.data`` routes this builder past that lookup so that it generates.

Config values are plain (the tokenizer is a name or path), so the Arrow cache key changes exactly
when an input changes. Work is cut into row chunks listed in ``gen_kwargs``, which is what
``num_proc`` parallelises over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import datasets
import pyarrow as pa
from datasets.builder import Key

from titans_hf.tasks.babilong import (
    GENERATED_TASKS,
    build_example,
    iter_babilong_batches,
    read_babilong_json,
    train_eval_split,
)

ROWS_PER_CHUNK = 256

FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "attention_mask": datasets.List(datasets.Value("int8")),
        "labels": datasets.List(datasets.Value("int32")),
        "target": datasets.Value("string"),
        "prompt_length": datasets.Value("int32"),
        "question": datasets.Value("string"),
        "task": datasets.Value("string"),
        "length": datasets.Value("int32"),
    }
)


@dataclass
class TitansBabilongConfig(datasets.BuilderConfig):
    """Settings of ``titans_babilong``.

    Attributes:
        tokenizer: name or path for ``AutoTokenizer.from_pretrained`` (required).
        max_length: every row is exactly this long (unless ``pad_to_max_length=False``).
        answer_reserve_tokens: room kept for the answer; the prompt is cut to the rest.
        pad_to_max_length: False leaves rows unpadded, for a collator that pads to a multiple of
            the chunk size (length curricula).
        task, length, num_samples, seed, haystack_files: generation settings, used when no data
            files are given; with data files, ``task``/``length`` only label the rows (else they
            come from a public path like ``qa1/32k.json``).
        train_ratio: split a single source into seeded ``train``/``validation`` splits (seed =
            ``seed``); None keeps every row in ``train``.
    """

    tokenizer: str | None = None
    max_length: int = 32768
    answer_reserve_tokens: int = 64
    pad_to_max_length: bool = True
    task: str | None = None
    length: int | None = None
    num_samples: int | None = None
    seed: int = 0
    haystack_files: tuple[str, ...] | None = None
    train_ratio: float | None = 0.9

    def __post_init__(self):
        super().__post_init__()
        if not self.tokenizer:
            raise ValueError("titans_babilong needs tokenizer= (a tokenizer name or path)")
        if not 1 <= self.answer_reserve_tokens < self.max_length:
            raise ValueError(
                f"answer_reserve_tokens={self.answer_reserve_tokens} must be >= 1 and below "
                f"max_length={self.max_length}"
            )
        if self.train_ratio is not None and not 0 < self.train_ratio < 1:
            raise ValueError(f"train_ratio={self.train_ratio} must lie strictly between 0 and 1, or be None")
        if self.haystack_files is not None:
            self.haystack_files = tuple(str(f) for f in self.haystack_files)


def _labels_from_path(path: str) -> tuple[str, int]:
    """(task, length) from a public-layout path such as ``.../qa1/32k.json`` ("", -1 when absent)."""
    parent, stem = Path(path).parent.name, Path(path).stem
    task = parent if re.fullmatch(r"qa\d+", parent) else ""
    match = re.fullmatch(r"(\d+)k", stem)
    return task, int(match.group(1)) * 1024 if match else -1


class TitansBabilong(datasets.ArrowBasedBuilder):
    BUILDER_CONFIG_CLASS = TitansBabilongConfig
    config: TitansBabilongConfig

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(
            description="BABILong question answering in a long haystack, tokenised for titans_hf",
            features=FEATURES,
        )

    def _split_generators(self, dl_manager) -> list[datasets.SplitGenerator]:
        if self.config.data_files and self.config.num_samples is not None:
            raise ValueError(
                f"titans_babilong got data files ({dict(self.config.data_files)}) and num_samples="
                f"{self.config.num_samples}: pass data_files to read BABILong JSON, or generate with "
                "titans_hf.data.babilong_builder.build_babilong(task=..., length=..., num_samples=...) "
                "(load_dataset infers data files from the working directory when none are given)"
            )
        if self.config.data_files:
            files = dl_manager.download(self.config.data_files)
            sources = {
                str(split): [row for path in paths for row in self._read_rows(path)] for split, paths in files.items()
            }
        else:
            missing = [name for name in ("task", "length", "num_samples") if getattr(self.config, name) is None]
            if missing:
                raise ValueError(f"titans_babilong without data_files generates rows and needs {missing}")
            if self.config.task not in GENERATED_TASKS:
                raise ValueError(f"titans_babilong generates {list(GENERATED_TASKS)}, not task={self.config.task!r}")
            sources = {"train": list(range(self.config.num_samples))}

        if self.config.train_ratio is not None and list(sources) == ["train"]:
            train, evaluation = train_eval_split(len(sources["train"]), self.config.train_ratio, self.config.seed)
            rows = sources["train"]
            sources = {"train": [rows[i] for i in train], "validation": [rows[i] for i in evaluation]}

        return [
            datasets.SplitGenerator(
                name=split,
                gen_kwargs={"chunks": [rows[i : i + ROWS_PER_CHUNK] for i in range(0, len(rows), ROWS_PER_CHUNK)]},
            )
            for split, rows in sources.items()
        ]

    def _read_rows(self, path: str) -> list[dict]:
        task, length = _labels_from_path(path)
        task = self.config.task or task
        length = self.config.length if self.config.length is not None else length
        return [{**row, "task": task, "length": length} for row in read_babilong_json(path)]

    def _generate_shards(self, chunks: list) -> Iterator[str]:
        for index, _ in enumerate(chunks):
            yield f"chunk {index}"

    def _generate_tables(self, chunks: list) -> Iterator[tuple[Key, pa.Table]]:
        from transformers import AutoTokenizer

        config = self.config
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        if chunks and isinstance(chunks[0][0], int):  # generation: chunks list row indices
            batches = iter_babilong_batches(
                config.task, config.num_samples, config.length, tokenizer, config.seed,
                haystack_files=config.haystack_files, row_indices=[i for chunk in chunks for i in chunk],
                batch_size=ROWS_PER_CHUNK,
            )
            chunks = ([{**row, "task": config.task, "length": config.length} for row in batch] for batch in batches)
        for chunk_index, rows in enumerate(chunks):
            examples = [
                build_example(row, tokenizer, config.max_length, config.answer_reserve_tokens, config.pad_to_max_length)
                for row in rows
            ]
            columns = {name: [example[name] for example in examples] for name in examples[0]}
            columns.update({name: [row[name] for row in rows] for name in ("question", "task", "length")})
            yield Key(chunk_index, 0), pa.Table.from_pydict(columns, schema=FEATURES.arrow_schema)


def build_babilong(cache_dir: str | None = None, num_proc: int | None = None, **config) -> datasets.DatasetDict:
    """The builder-class route (works offline, generation included): prepare the Arrow cache, return the splits.

    ``config`` takes the fields of ``TitansBabilongConfig`` plus ``data_files``.
    """
    from . import source_hash

    builder = TitansBabilong(cache_dir=cache_dir, hash=source_hash(), **config)
    builder.download_and_prepare(num_proc=num_proc)
    return builder.as_dataset()
