"""``titans_babilong``: BABILong rows (published parquet, JSON, or generated offline) as tokenised training examples.

Usage, once ``titans_hf`` is imported (it registers the builder)::

    load_dataset("titans_babilong", data_files="qa1/32k.json", tokenizer="Qwen/Qwen2.5-0.5B",
                 max_length=32768, answer_reserve_tokens=64)
    load_dataset("titans_babilong", data_dir="path/to/babilong-1k-samples", task="qa1", length="32k",
                 tokenizer="Qwen/Qwen2.5-0.5B", max_length=32768)   # a snapshot of the Hub set, one task
    load_dataset("titans_babilong", data_files="babilong/32k/qa*-*.parquet", tokenizer=..., max_length=32768)
    load_dataset("titans_babilong", task="qa1", length=2048, num_samples=5000, seed=0,
                 tokenizer="path/to/tokenizer", max_length=2304)
    load_dataset("titans_babilong", task="qa1", length=2048, num_samples=5000, haystack_files=["books/"],
                 tokenizer="path/to/tokenizer", max_length=2304)      # your prose: files, or folders of *.txt
    load_dataset("titans_babilong", task="qa1", length=2048, num_samples=5000, haystack_dataset="json",
                 haystack_data_files=["essays.jsonl"], haystack_column="body",
                 tokenizer="path/to/tokenizer", max_length=2304)      # or a datasets split
    build_babilong(task="qa1", length=2048, num_samples=5000, seed=0,
                   tokenizer="path/to/tokenizer", max_length=2304)   # the builder-class route

Without data files ``load_dataset`` would look for files in the working directory;
``titans_hf.data`` routes this builder past that lookup so that it generates.

Task and length labels of file rows come from the published layouts (``32k/qa1-00000-of-00001.parquet``,
``qa1/32k.json``; see ``titans_hf.tasks.babilong.files``); ``task=`` / ``length=`` keep only the files of that task /
length and label the files whose path says neither. The ``length`` column is the label's token count
(``length_tokens``: "32k" -> 32768), -1 when unknown.

Config values are plain (the tokenizer is a name or path, the haystack files, folders or dataset by name), and the
Arrow cache key also holds what the rows depend on beyond them: the tokenizer's serialised state and pad id, the
contents of the data files and of every haystack file read (or the haystack dataset's texts), so a changed
tokenizer or file under the same name builds anew (and a haystack file whose mtime alone changed does not). Work is
cut into row chunks listed in ``gen_kwargs``, which is what ``num_proc`` parallelises over.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import datasets
import pyarrow as pa
from datasets.builder import Key

from titans_hf.data import source_hash
from titans_hf.data.tokenizers import plain_backend_tokenizer, resolve_pad_token_id
from titans_hf.files import file_sha256
from titans_hf.tasks.babilong import (
    GENERATED_TASKS,
    babilong_path_labels,
    PROMPT_TEMPLATE,
    build_example,
    iter_babilong_batches,
    length_tokens,
    read_babilong_file,
    train_eval_split,
)
from titans_hf.tasks.babilong.generate import HaystackDataset, read_haystack_sentences

logger = logging.getLogger(__name__)

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
        task, length, num_samples, seed: generation settings, used when no data files are given.
            With data files, ``task``/``length`` keep only the files whose layout names that task /
            length and label the files whose path names none. ``length`` may be a published label
            ("32k"); it is stored as its token count.
        haystack_files: the generated haystack from text files and folders (every ``*.txt`` under
            a folder, in sorted order; links out of a folder refused). Default: built-in prose.
        haystack_dataset, haystack_data_files, haystack_split, haystack_column: the generated
            haystack from a ``datasets`` split instead: ``load_dataset(haystack_dataset,
            data_files=haystack_data_files, split=haystack_split or "train")[haystack_column]``
            (streamed; e.g. "json" / "text" / "parquet" with local files, a folder, or a Hub id).
        train_ratio: split a single source into seeded ``train``/``validation`` splits (seed =
            ``seed``); None keeps every row in ``train``.
        truncate_answers: an answer longer than the room left after the prompt is an error naming
            its row; True cuts it instead, and the number of rows cut is logged.
    """

    BUILDER_NAME = "titans_babilong"  # what its messages call it

    tokenizer: str | None = None
    max_length: int = 32768
    answer_reserve_tokens: int = 64
    pad_to_max_length: bool = True
    task: str | None = None
    length: int | str | None = None
    num_samples: int | None = None
    seed: int = 0
    haystack_files: tuple[str, ...] | None = None
    haystack_dataset: str | None = None
    haystack_data_files: tuple[str, ...] | None = None
    haystack_split: str | None = None
    haystack_column: str = "text"
    train_ratio: float | None = 0.9
    truncate_answers: bool = False
    # the haystack's digests as create_config_id read them for the cache key; generation reads the same text
    haystack_key: list[list[str]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if not self.tokenizer or not isinstance(self.tokenizer, (str, os.PathLike)):
            raise ValueError(f"{self.BUILDER_NAME} needs tokenizer= a tokenizer name or path, got {self.tokenizer!r}")
        for name in ("max_length", "answer_reserve_tokens", "seed") + (("num_samples",) if self.num_samples is not None
                                                                        else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{self.BUILDER_NAME}: {name}={value!r} must be an integer (got {type(value).__name__})")
        for name in ("pad_to_max_length", "truncate_answers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{self.BUILDER_NAME}: {name}={getattr(self, name)!r} must be true or false")
        if self.train_ratio is not None and (isinstance(self.train_ratio, bool)
                                             or not isinstance(self.train_ratio, (int, float))):
            raise ValueError(f"{self.BUILDER_NAME}: train_ratio={self.train_ratio!r} must be a number or None")
        if not 1 <= self.answer_reserve_tokens < self.max_length:
            raise ValueError(
                f"answer_reserve_tokens={self.answer_reserve_tokens} must be >= 1 and below "
                f"max_length={self.max_length}"
            )
        if self.train_ratio is not None and not 0 < self.train_ratio < 1:
            raise ValueError(f"train_ratio={self.train_ratio} must lie strictly between 0 and 1, or be None")
        self.haystack_files = _plain_paths(self.haystack_files, f"{self.BUILDER_NAME}: haystack_files")
        self.haystack_data_files = _plain_paths(self.haystack_data_files, f"{self.BUILDER_NAME}: haystack_data_files")
        if self.haystack_dataset is not None and not isinstance(self.haystack_dataset, (str, os.PathLike)):
            raise ValueError(f"{self.BUILDER_NAME}: haystack_dataset={self.haystack_dataset!r} must be a load_dataset "
                             "path (a builder name such as json, a folder or a Hub id); a loaded dataset goes to "
                             "generate_babilong(haystack_dataset=titans_hf.tasks.babilong.generate.HaystackDataset(...))")
        if self.haystack_dataset is None:
            given = [name for name, value in (("haystack_data_files", self.haystack_data_files),
                                              ("haystack_split", self.haystack_split)) if value is not None]
            given += ["haystack_column"] if self.haystack_column != "text" else []
            if given:
                raise ValueError(f"{self.BUILDER_NAME}: {given} describe a haystack_dataset, and none is given")
        else:
            self.haystack_dataset = str(self.haystack_dataset)
        self.haystack_source()  # refuses both sources at once, and a column or split that is not a name
        if isinstance(self.length, str):
            tokens = length_tokens(self.length)
            if tokens is None:
                raise ValueError(f"length={self.length!r} is not a length (tokens, optionally with k or M: 32k)")
            self.length = tokens

    def file_labels(self, path: str) -> tuple[str, int] | None:
        """(task, length in tokens) of the rows of a data file, from its layout or else from ``task`` / ``length``
        ("" / -1 when neither says); None when the layout names another task or length than asked for."""
        task, label = babilong_path_labels(path)
        length = length_tokens(label) if label is not None else None
        if (self.task is not None and task not in (None, self.task)) or (
            self.length is not None and length not in (None, self.length)
        ):
            return None
        return task or self.task or "", length if length is not None else (-1 if self.length is None else self.length)

    def create_config_id(self, config_kwargs: dict, custom_features: datasets.Features | None = None) -> str:
        """The cache key: the config, plus the tokenizer's state and the contents of every local input file read
        (data files of other tasks / lengths than asked for are not)."""
        inputs: dict[str, Any] = {"tokenizer": tokenizer_fingerprint(self.tokenizer, self.BUILDER_NAME)}
        if self.haystack_files or self.haystack_dataset is not None:
            # rows are generated only from text of these digests (checked as it is read), never from a later edit
            self.haystack_key = read_haystack_sentences(self.haystack_files, self.haystack_source())[1]
            inputs["haystack"] = self.haystack_key
        if self.data_files is not None:
            inputs["data_files"] = {
                str(split): [file_digest(file, "BABILong file") for file in files
                             if os.path.isfile(file) and self.file_labels(file) is not None]
                for split, files in self.data_files.items()
            }
        return super().create_config_id({**config_kwargs, "inputs": inputs}, custom_features=custom_features)

    def haystack_source(self) -> HaystackDataset | None:
        """The haystack dataset the settings name, None when they name none."""
        if self.haystack_dataset is None:
            return None
        if self.haystack_files:
            raise ValueError(f"{self.BUILDER_NAME}: the haystack comes from haystack_files ({list(self.haystack_files)}) "
                             f"or from haystack_dataset ({self.haystack_dataset!r}), not both")
        return HaystackDataset(self.haystack_dataset, self.haystack_data_files, self.haystack_split,
                               self.haystack_column)


def _plain_paths(value: Any, name: str) -> tuple[str, ...] | None:
    """A path, or a list of them, as a tuple of strings (one path alone is not split into characters); `name` is
    the setting as messages name it."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return (os.fspath(value),)
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, (str, os.PathLike)) for item in value):
        raise ValueError(f"{name}={value!r} must be a path or a list of paths")
    return tuple(os.fspath(item) for item in value)


def tokenizer_fingerprint(name_or_path: str, builder: str = "titans_babilong") -> str:
    """SHA-256 of what rows depend on in a tokenizer: its serialised Rust tokenizer (vocabulary, merges,
    normaliser, pre-tokeniser, post-processor, added tokens) and its pad id (EOS when it has no pad)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ValueError(f"{builder}: cannot load tokenizer {name_or_path!r}: {error}") from error
    if not tokenizer.is_fast:
        raise ValueError(f"{builder} needs a fast tokenizer; {name_or_path!r} loads as {type(tokenizer).__name__}")
    try:
        pad_id: int | None = resolve_pad_token_id(tokenizer)
    except ValueError:  # only an error once a row is padded
        pad_id = None
    digest = hashlib.sha256(plain_backend_tokenizer(tokenizer).to_str().encode("utf-8"))
    digest.update(f"pad={pad_id}".encode())
    return digest.hexdigest()


def file_digest(path: str | os.PathLike, what: str) -> str:
    """SHA-256 of a file's bytes; a missing file is a FileNotFoundError naming it (as ``what``)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return file_sha256(path)


class TitansBabilong(datasets.ArrowBasedBuilder):
    """The builder of BABILong rows; a task of the same kind (rows of ``input``, ``question``, ``target``, its own
    generator and prompt template) subclasses it, as ``titans_needle`` does."""

    BUILDER_CONFIG_CLASS = TitansBabilongConfig
    config: TitansBabilongConfig
    FEATURES = FEATURES
    GENERATED_TASKS: tuple[str, ...] = GENERATED_TASKS
    PROMPT_TEMPLATE = PROMPT_TEMPLATE
    ANSWER_END = ""  # text labelled after the target (build_example's answer_end)
    DESCRIPTION = "BABILong question answering in a long haystack, tokenised for titans_hf"

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(description=self.DESCRIPTION, features=self.FEATURES)

    def _split_generators(self, dl_manager) -> list[datasets.SplitGenerator]:
        if self.config.data_files and self.config.num_samples is not None:
            raise ValueError(
                f"{self.name} got data files ({dict(self.config.data_files)}) and num_samples="
                f"{self.config.num_samples}: pass data_files to read BABILong files, or generate with "
                f"{type(self).__module__}.build_{self.name.removeprefix('titans_')}(task=..., length=..., "
                "num_samples=...) "
                "(load_dataset infers data files from the working directory when none are given)"
            )
        if self.config.data_files:
            # labels come from the names given (a Hub file downloads to a cache name that has lost its layout)
            files = dl_manager.download(self.config.data_files)
            sources = {str(split): self._read_split(str(split), list(zip(self.config.data_files[split], local)))
                       for split, local in files.items()}
        else:
            missing = [name for name in ("task", "length", "num_samples") if getattr(self.config, name) is None]
            if missing:
                raise ValueError(f"{self.name} without data_files generates rows and needs {missing}")
            if self.config.task not in self.GENERATED_TASKS:
                raise ValueError(f"{self.name} generates {list(self.GENERATED_TASKS)}, not task={self.config.task!r}")
            if self.config.haystack_files or self.config.haystack_dataset is not None:
                # unreadable or changed text fails now, not in every worker
                read_haystack_sentences(self.config.haystack_files, self.config.haystack_source(),
                                        self.config.haystack_key)
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

    def _read_split(self, split: str, files: list[tuple[str, str]]) -> list[dict]:
        """Rows of the files (name given, local copy) of one split that match ``task`` / ``length``, labelled, each
        knowing its source."""
        config, rows, skipped = self.config, [], 0
        for name, local in files:
            labels = config.file_labels(name)
            if labels is None:
                skipped += 1
                continue
            task, length = labels
            rows += [
                {**row, "task": task, "length": length, "source": f"BABILong file {name}, row {index} (0-based)"}
                for index, row in enumerate(read_babilong_file(local))
            ]
        if not rows:
            raise ValueError(f"{self.name}: no file of split {split!r} is task={config.task!r} length="
                             f"{config.length!r}: {[name for name, _ in files]}")
        if skipped:
            logger.info("%s: split %s keeps %d file(s), skips %d of other tasks / lengths", self.name,
                        split, len(files) - skipped, skipped)
        return rows

    def _generate_shards(self, chunks: list) -> Iterator[str]:
        for index, _ in enumerate(chunks):
            yield f"chunk {index}"

    def _generate_tables(self, chunks: list) -> Iterator[tuple[Key, pa.Table]]:
        from transformers import AutoTokenizer

        config = self.config
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=False)
        if chunks and isinstance(chunks[0][0], int):  # generation: chunks list row indices
            indices = [i for chunk in chunks for i in chunk]
            where = f"generated {config.task} (length {config.length}, seed {config.seed})"
            remaining = iter(indices)  # batches come in order: each takes the next len(batch) indices
            chunks = (
                [{**row, "task": config.task, "length": config.length, "source": f"{where} row {index}"}
                 for row, index in zip(batch, remaining)]
                for batch in self._generated_batches(tokenizer, indices)
            )
        for chunk_index, rows in enumerate(chunks):
            examples = [self._example(row, tokenizer) for row in rows]
            cut = sum(example["answer_tokens_cut"] > 0 for example in examples)
            if cut:
                logger.warning("%s: cut the answers of %d of %d rows (from %s) to fit max_length=%d "
                               "(truncate_answers=True)", self.name, cut, len(rows), rows[0]["source"], config.max_length)
            columns = {name: [example[name] for example in examples] for name in self.FEATURES if name in examples[0]}
            columns.update({name: [row[name] for row in rows] for name in ("question", "task", "length")})
            yield Key(chunk_index, 0), pa.Table.from_pydict(columns, schema=self.FEATURES.arrow_schema)

    def _generated_batches(self, tokenizer, indices: list[int]) -> Iterator[list[dict]]:
        """The generated rows of ``indices``, in batches of up to ``ROWS_PER_CHUNK``, in order."""
        config = self.config
        return iter_babilong_batches(
            config.task, config.num_samples, config.length, tokenizer, config.seed,
            haystack_files=config.haystack_files, row_indices=indices, batch_size=ROWS_PER_CHUNK,
            haystack_dataset=config.haystack_source(), expected_haystack_digests=config.haystack_key,
        )

    def _example(self, row: dict, tokenizer) -> dict[str, Any]:
        """``build_example`` of one row; its errors name the row's file and index (or generated row)."""
        config = self.config
        try:
            return build_example(row, tokenizer, config.max_length, config.answer_reserve_tokens,
                                 config.pad_to_max_length, truncate_answers=config.truncate_answers,
                                 prompt_template=self.PROMPT_TEMPLATE, answer_end=self.ANSWER_END)
        except ValueError as error:
            raise ValueError(f"{row['source']}: {error}") from error


def build_babilong(cache_dir: str | None = None, num_proc: int | None = None, **config) -> datasets.DatasetDict:
    """The builder-class route (works offline, generation included): prepare the Arrow cache, return the splits.

    ``config`` takes the fields of ``TitansBabilongConfig`` plus ``data_files``.
    """
    builder = TitansBabilong(cache_dir=cache_dir, hash=source_hash("titans_babilong"), **config)
    builder.download_and_prepare(num_proc=num_proc)
    return builder.as_dataset()
