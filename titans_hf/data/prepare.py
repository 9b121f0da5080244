"""Raw text -> token stores (`titans-hf prepare` and `prepare()`).

Inputs, per train type (one record per `.jsonl` line or `datasets` row; a `.txt` file is one document):

- `seq`:  `.txt` files, or a text field (`text` by default)
- `sft`:  `prompt`, `response`            -> `sequence`, `loss_mask` (1 on the response)
- `dpo`:  `chosen`, `rejected` (+ `prompt`) -> `chosen`, `rejected`, `chosen_mask`, `rejected_mask`
                                              (the prompt, when given, leads both with mask 0)
- `grpo`: `prompt`, `responses`, `rewards` -> `prompts`, `responses`, `masks`, `rewards` (float32)

Text is encoded without special tokens by the `AutoTokenizer` named (batched, optionally over
`num_proc` processes); EOS ends every document, response and completion, so documents of one
token stream stay separated. Ids are stored as uint16 when the vocabulary fits, else uint32.
Outputs are written under temporary names and renamed only when complete; with `shard_tokens`
they are split at record boundaries into `name-00000-of-00003.h5` style shards.
"""

from __future__ import annotations

import collections
import functools
import json
import multiprocessing
import os
import re
import shutil
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from titans_hf.data.stores import FLOAT_KEYS, STORE_WRITERS, StoreWriter, output_format, token_dtype
from titans_hf.data.windows import TRAIN_TYPE_KEYS

RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "seq": ("text",),
    "sft": ("prompt", "response"),
    "dpo": ("chosen", "rejected"),
    "grpo": ("prompt", "responses", "rewards"),
}
# Long documents are encoded in pieces of about this many characters, cut right after a newline
# that precedes a letter or digit: a point where byte-level BPE pre-tokenizers (GPT-2, Qwen,
# Llama 3) always split, so the ids equal those of encoding the document whole. `_cuts_are_exact`
# checks that on the tokenizer at hand and keeps documents whole when it does not hold.
PIECE_CHARS = 1 << 16
_SAFE_CUT = re.compile(r"\n(?=[^\W_])")
_CUT_PROBES = (("Hello world.\n", "The end"), ("a\n\n", "b c"), ("x \n", "9 y"), ("one\r\n", "Two"), ("é\n", "ü"))
_READ_CHARS = 1 << 20
# A batch also ends at this many characters, which bounds the memory of one tokenizer call.
BATCH_CHARS = 1 << 20


def _cuts_are_exact(tokenizer) -> bool:
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return all(encode(left + right) == encode(left) + encode(right) for left, right in _CUT_PROBES)


def _pieces(text_blocks: Iterable[str], cut: bool) -> Iterator[str]:
    """Regroup a document's text into pieces of about PIECE_CHARS, cut only at safe points."""
    buffer = ""
    for block in text_blocks:
        buffer += block
        while cut and len(buffer) >= PIECE_CHARS:
            match = _SAFE_CUT.search(buffer, PIECE_CHARS)
            if match is None:
                break
            yield buffer[: match.end()]
            buffer = buffer[match.end() :]
    if buffer:
        yield buffer


def _read_blocks(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        while block := handle.read(_READ_CHARS):
            yield block


def _check_record(record: Any, train_type: str, text_field: str, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    fields = (text_field,) if train_type == "seq" else RECORD_FIELDS[train_type]
    missing = [field for field in fields if field not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing} that train_type {train_type!r} needs")
    strings = {"seq": fields, "sft": fields, "dpo": (*fields, *(["prompt"] if "prompt" in record else [])),
               "grpo": ("prompt",)}[train_type]
    for field in strings:
        if not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
    if train_type == "grpo":
        responses, rewards = record["responses"], record["rewards"]
        if not isinstance(responses, list) or not all(isinstance(response, str) for response in responses):
            raise ValueError(f"{where}: field 'responses' must be a list of strings")
        if not isinstance(rewards, list) or not all(
            isinstance(reward, (int, float)) and not isinstance(reward, bool) for reward in rewards
        ):
            raise ValueError(f"{where}: field 'rewards' must be a list of numbers")
        if len(rewards) != len(responses):
            raise ValueError(f"{where}: {len(responses)} responses but {len(rewards)} rewards")
    return record


def _input_paths(inputs: Any) -> list[Path] | None:
    """The input files, or None when `inputs` is a dataset."""
    if isinstance(inputs, (str, Path)):
        return [Path(inputs)]
    if isinstance(inputs, (list, tuple)) and all(isinstance(item, (str, Path)) for item in inputs):
        return [Path(item) for item in inputs]
    return None


def _records(inputs: Any, train_type: str) -> Iterator[tuple[str, Any]]:
    """(where, record) pairs; `where` names the file and line (or row) for error messages.

    A `.txt` file's record is its path: the document is read in blocks, never whole.
    """
    paths = _input_paths(inputs)
    if paths is None:
        for row_number, row in enumerate(inputs):
            yield f"dataset row {row_number}", row
        return
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: input file not found")
        if path.suffix == ".txt":
            if train_type != "seq":
                raise ValueError(f"{path}: a .txt file is one plain document; train_type {train_type!r} needs .jsonl")
            yield str(path), path
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as handle:
                for line_number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from error
                    yield f"{path}:{line_number}", record
        else:
            raise ValueError(f"{path}: unsupported input; use .txt or .jsonl files, or a datasets.Dataset")


def _units(inputs: Any, train_type: str, text_field: str, cut: bool) -> Iterator[tuple[Any, int]]:
    """Units of encoding work and their character counts (for progress).

    `seq` documents become `(piece, ends_document)` pairs so long documents stream through in
    pieces; the other types keep a record whole (its parts must stay aligned).
    """
    for where, record in _records(inputs, train_type):
        if isinstance(record, Path):
            blocks: Iterable[str] = _read_blocks(record)
        else:
            record = _check_record(record, train_type, text_field, where)
            if train_type != "seq":
                yield record, sum(len(value) for value in record.values() if isinstance(value, str))
                continue
            blocks = [record[text_field]]
        previous = None
        for piece in _pieces(blocks, cut):
            if previous is not None:
                yield (previous, False), len(previous)
            previous = piece
        if previous is not None:  # an empty document adds nothing, not a lone EOS
            yield (previous, True), len(previous)


_worker_tokenizer = None


def _load_tokenizer(name: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(name))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{name}: tokenizer has no eos token; prepare ends every document with one")
    return tokenizer


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = _load_tokenizer(tokenizer_name)


def _encode_batch(batch: tuple[str, list[Any], int], tokenizer=None) -> tuple[list[dict[str, Any]], int]:
    """Encode a batch of units with one batched tokenizer call; return store segments per unit."""
    train_type, units, chars = batch
    tokenizer = tokenizer or _worker_tokenizer
    texts: list[str] = []

    def take(text: str) -> int:
        texts.append(text)
        return len(texts) - 1

    if train_type == "seq":
        plans = [take(piece) for piece, _ in units]
    elif train_type == "sft":
        plans = [(take(unit["prompt"]), take(unit["response"])) for unit in units]
    elif train_type == "dpo":
        plans = [
            (take(unit["prompt"]) if "prompt" in unit else None, take(unit["chosen"]), take(unit["rejected"]))
            for unit in units
        ]
    else:
        plans = [(take(unit["prompt"]), [take(response) for response in unit["responses"]]) for unit in units]
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    eos = np.array([tokenizer.eos_token_id], dtype=np.int64)

    def tokens(index: int | None, end: bool = False) -> np.ndarray:
        array = np.array(ids[index] if index is not None else [], dtype=np.int64)
        return np.concatenate([array, eos]) if end else array

    def labelled(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(answer), np.uint8)])
        return np.concatenate([prompt, answer]), mask

    encoded = []
    for unit, plan in zip(units, plans):
        if train_type == "seq":
            encoded.append({"sequence": tokens(plan, end=unit[1]), "ends_document": unit[1]})
        elif train_type == "sft":
            sequence, mask = labelled(tokens(plan[0]), tokens(plan[1], end=True))
            encoded.append({"sequence": sequence, "loss_mask": mask})
        elif train_type == "dpo":
            prompt = tokens(plan[0])
            chosen, chosen_mask = labelled(prompt, tokens(plan[1], end=True))
            rejected, rejected_mask = labelled(prompt, tokens(plan[2], end=True))
            encoded.append(
                {"chosen": chosen, "chosen_mask": chosen_mask, "rejected": rejected, "rejected_mask": rejected_mask}
            )
        else:
            responses = [tokens(index, end=True) for index in plan[1]]
            encoded.append(
                {
                    "prompts": tokens(plan[0]),
                    "responses": responses,
                    "masks": [np.ones(len(response), np.uint8) for response in responses],
                    "rewards": np.asarray(unit["rewards"], dtype=np.float32),
                }
            )
    return encoded, chars


def _batches(units: Iterator[tuple[Any, int]], train_type: str, batch_size: int):
    """(train_type, units, characters) per batch: the characters advance the progress bar once written."""
    batch: list[Any] = []
    chars = 0
    for unit, unit_chars in units:
        batch.append(unit)
        chars += unit_chars
        if len(batch) >= batch_size or chars >= BATCH_CHARS:
            yield train_type, batch, chars
            batch, chars = [], 0
    if batch:
        yield train_type, batch, chars


def _ordered_map(pool, function, items: Iterable[Any], lookahead: int) -> Iterator[Any]:
    """`pool.imap` with at most `lookahead` batches in flight (imap would read the whole input ahead)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(function, (item,)))
        if len(pending) >= lookahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _write_unit(writer: StoreWriter, encoded: dict[str, Any]) -> bool:
    """Write one encoded unit; return whether it finished a record (a safe place to start a new shard)."""
    if "ends_document" in encoded:
        writer.append("sequence", encoded["sequence"])
        if encoded["ends_document"]:
            writer.end_segment("sequence")
        return encoded["ends_document"]
    for key, values in encoded.items():
        for segment in values if isinstance(values, list) else [values]:
            writer.add_segment(key, segment)
    return True


def _shard_paths(output: Path, count: int) -> list[Path]:
    """`name.h5` -> `name-00000-of-00003.h5`, ...; a bin directory `name` -> `name-00000-of-00003`, ..."""
    if count == 1:
        return [output]
    return [output.with_name(_shard_name(output, f"{index:05d}", f"{count:05d}")) for index in range(count)]


def _shard_name(output: Path, index: str, count: str) -> str:
    suffix = output.suffix if output_format(output) == "h5" else ""
    return f"{output.name[: len(output.name) - len(suffix)]}-{index}-of-{count}{suffix}"


def _replace_outputs(finished: list[Path], targets: list[Path], existing: list[Path]) -> None:
    """Rename the finished temporaries to their targets in place of the old outputs.

    The old outputs are set aside first (a bin store is a directory, which a rename cannot overwrite) and
    deleted only once every new output is in place; if a rename fails they come back, so nothing is lost.
    """
    set_aside = [path.with_name(f".{path.name}.replaced") for path in existing]
    for path, aside in zip(existing, set_aside):
        _remove(aside)
        os.replace(path, aside)
    try:
        for temp, target in zip(finished, targets):
            os.replace(temp, target)
    except BaseException:
        for target in targets:
            _remove(target)
        for path, aside in zip(existing, set_aside):
            os.replace(aside, path)
        raise
    for aside in set_aside:
        _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def prepare(
    inputs: str | Path | Sequence[str | Path] | Any,
    output: str | Path,
    tokenizer: str | Path,
    train_type: str = "seq",
    text_field: str = "text",
    num_proc: int = 1,
    batch_size: int = 256,
    shard_tokens: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Tokenize `inputs` into a store at `output` (`.h5` file, else a bin directory); return the paths written.

    `inputs`: `.txt`/`.jsonl` paths or a `datasets.Dataset`. `tokenizer`: a hub id or local path
    for `AutoTokenizer`. `shard_tokens`: start a new shard once one holds this many tokens.
    """
    if train_type not in TRAIN_TYPE_KEYS:
        raise ValueError(f"train_type must be one of {list(TRAIN_TYPE_KEYS)}, got {train_type!r}")
    for name, value in (("num_proc", num_proc), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if shard_tokens is not None and (not isinstance(shard_tokens, int) or shard_tokens < 1):
        raise ValueError(f"shard_tokens must be a positive integer or None, got {shard_tokens!r}")
    output = Path(output)
    existing = [path for path in [output, *output.parent.glob(_shard_name(output, "*", "*"))] if path.exists()]
    if existing and not overwrite:
        raise ValueError(f"{existing[0]}: output already exists; pass overwrite=True (--overwrite) to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)

    tok = _load_tokenizer(tokenizer)
    vocab_size = len(tok)
    ids_dtype = token_dtype(vocab_size)
    dtypes = {
        key: np.float32 if key in FLOAT_KEYS else (np.uint8 if key.endswith(("mask", "masks")) else ids_dtype)
        for key in TRAIN_TYPE_KEYS[train_type]
    }
    metadata = {
        "train_type": train_type,
        "tokenizer": str(tokenizer),
        "vocab_size": vocab_size,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    writer_class = STORE_WRITERS[output_format(output)]
    paths = _input_paths(inputs)
    # File sizes in bytes bound the characters from above: the bar may stop a little short of 100%.
    total_chars = sum(path.stat().st_size for path in paths if path.is_file()) if paths is not None else None
    progress = tqdm(total=total_chars, unit="char", unit_scale=True, desc=f"prepare {output.name}")
    batches = _batches(_units(inputs, train_type, text_field, _cuts_are_exact(tok)), train_type, batch_size)

    writers: list[StoreWriter] = []
    finished: list[Path] = []
    # With one process, a thread still encodes batch k+1 (the Rust tokenizer releases the GIL)
    # while this thread parses the input and writes batch k.
    if num_proc > 1:
        pool, encode = multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=(str(tokenizer),)), _encode_batch
    else:
        pool, encode = ThreadPool(1), functools.partial(_encode_batch, tokenizer=tok)
    try:
        encoded_batches = _ordered_map(pool, encode, batches, lookahead=2 * num_proc)
        writer = None
        for encoded_batch, chars in encoded_batches:
            for encoded in encoded_batch:
                if writer is None:
                    writer = writer_class(output, dtypes, metadata)
                    writers.append(writer)
                if _write_unit(writer, encoded) and shard_tokens is not None and writer.num_tokens >= shard_tokens:
                    finished.append(writer.finish())
                    writer = None
            progress.update(chars)
        if writer is not None:
            finished.append(writer.finish())
        if not finished:
            raise ValueError(f"{inputs}: no records to prepare (all inputs empty)")
        targets = _shard_paths(output, len(finished))
        _replace_outputs(finished, targets, existing)
        return targets
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        progress.close()
        pool.terminate()
        pool.join()
