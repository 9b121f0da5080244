"""Recall documents on disk: a `.jsonl` of text (what `titans-hf prepare` reads) and an evaluation store that
marks the tokens depending on an earlier statement.

- `write_recall_jsonl`: one document per line, `{"text", "statements", "references", "length", "id"}`; `prepare`
  (train type `seq`) reads `text` and ignores the rest.
- `build_recall_eval_store`: an `sft`-type store (`sequence`, `loss_mask`) whose `sequence` equals, token for
  token, the `seq` store `prepare` writes from the same `.jsonl` (no special tokens, EOS after each document), and
  whose `loss_mask` is 1 exactly on the tokens of the recalled values. Read it with
  `load_dataset("titans_tokens", data_files=<store>, train_type="sft", ...)`: labels are then -100 everywhere
  but on the dependent tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from titans_hf.data.stores import (
    STORE_WRITERS,
    output_format,
    replaceable_store_problem,
    token_dtype,
    tokenizer_fingerprint,
)
from titans_hf.files import atomic_write, remove_path
from titans_hf.outputs import replace_outputs

from .generate import RecallDocument


def write_recall_jsonl(documents: Iterable[RecallDocument], path: str | Path) -> Path:
    """Write documents as `.jsonl` records (written under a temporary name, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as handle:
            for index, document in enumerate(documents):
                handle.write(json.dumps(document.to_record(id=index)) + "\n")

    return atomic_write(path, write)


def read_recall_jsonl(path: str | Path) -> list[RecallDocument]:
    with open(path, encoding="utf-8") as handle:
        return [RecallDocument.from_record(json.loads(line)) for line in handle if line.strip()]


def _load_tokenizer(tokenizer: Any):
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
    if tokenizer.eos_token_id is None:
        raise ValueError("recall eval store: the tokenizer has no eos token; every document ends with one")
    return tokenizer


def span_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 on every token whose character range `[a, b)` overlaps one of `spans` (a byte-level token carries the
    space before a word, so " Tamsin" overlaps the span of "Tamsin" while "called" and "." do not)."""
    mask = np.zeros(len(offsets), np.uint8)
    if not spans or not len(offsets):
        return mask
    starts = np.array([a for a, _ in offsets])
    stops = np.array([b for _, b in offsets])
    for start, stop in spans:
        mask[(starts < stop) & (stops > start) & (stops > starts)] = 1
    return mask


def encode_document(document: RecallDocument | str, tokenizer: Any,
                    spans: Sequence[tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids with EOS appended, 0/1 mask of the dependent tokens) of one document, tokenized as `prepare`
    does (no special tokens). `spans` default to the document's recalled values."""
    tokenizer = _load_tokenizer(tokenizer)
    text = document if isinstance(document, str) else document.text
    if spans is None:
        spans = [] if isinstance(document, str) else document.dependent_spans
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    ids = np.array(encoded["input_ids"] + [tokenizer.eos_token_id], dtype=np.int64)
    mask = np.concatenate([span_token_mask(encoded["offset_mapping"], spans), np.zeros(1, np.uint8)])
    return ids, mask


def check_store_output(output: Path, overwrite: bool) -> None:
    """Refuse an existing `output` without `overwrite`, and, with it, anything but a token store (never a user's
    folder or file)."""
    if not (output.exists() or output.is_symlink()):
        return
    if not overwrite:
        raise ValueError(f"{output}: output already exists; pass overwrite=True to replace it")
    problem = replaceable_store_problem(output)
    if problem is not None:
        raise ValueError(f"{output}: will not replace it, even with overwrite: {problem}, so it is not a token store")


def write_recall_eval_store(documents: Iterable[RecallDocument], output: Path, tokenizer: Any) -> Path:
    """Write the eval store of `documents` for `output` under a temporary name beside it and return that name
    (the caller renames it into place, `titans_hf.outputs.replace_outputs`); nothing is left when it fails."""
    name = str(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else getattr(tokenizer, "name_or_path", None)
    tokenizer = _load_tokenizer(tokenizer)
    metadata = {"train_type": "sft", "tokenizer": name, "vocab_size": len(tokenizer),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    dtypes = {"sequence": token_dtype(len(tokenizer)), "loss_mask": np.uint8}
    output.parent.mkdir(parents=True, exist_ok=True)
    writer = STORE_WRITERS[output_format(output)](output, dtypes, metadata)
    try:
        written = 0
        for document in documents:
            ids, mask = encode_document(document, tokenizer)
            writer.add_segment("sequence", ids)
            writer.add_segment("loss_mask", mask)
            written += 1
        if not written:
            raise ValueError(f"{output}: no documents to write")
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


def build_recall_eval_store(documents: Iterable[RecallDocument] | str | Path, output: str | Path, tokenizer: Any,
                            overwrite: bool = False) -> Path:
    """An `sft`-type store at `output` (`.h5` file, else a bin directory) of the documents (or a `.jsonl` of
    them): `sequence` the tokens `prepare` writes for their text, `loss_mask` 1 on the recalled values' tokens.
    `tokenizer`: a name or path for `AutoTokenizer` (recorded in the store's metadata), or a loaded tokenizer."""
    if isinstance(documents, (str, Path)):
        documents = read_recall_jsonl(documents)
    output = Path(output)
    check_store_output(output, overwrite)
    temporary = write_recall_eval_store(documents, output, tokenizer)
    try:
        check_store_output(output, overwrite)  # again: something may have appeared there meanwhile
        replace_outputs([temporary], [output])
    except BaseException:
        remove_path(temporary)
        raise
    return output
