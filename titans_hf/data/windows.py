"""Examples cut from a token store, per train type: windows for `seq`/`sft`, whole records for `dpo`/`grpo`.

Window arithmetic: over the token stream of all segments in order,
window i covers `[i*S, i*S + W)`; the tail that does not fill a window is dropped unless
`pad_tail=True` adds one padded window; `respect_document_boundaries=True` applies the same rule
inside each document instead of over the whole stream. Nothing here imports `datasets`: the
builder turns these examples into Arrow tables, and `TokenExamples` also works as a map-style
torch dataset on its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from titans_hf.data.stores import MAX_TOKEN_ID, TokenStore, is_int, key_kind

TRAIN_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "seq": ("sequence",),
    "sft": ("sequence", "loss_mask"),
    "dpo": ("chosen", "rejected", "chosen_mask", "rejected_mask"),
    "grpo": ("prompts", "responses", "masks", "rewards"),
}
WINDOWED_TRAIN_TYPES = ("seq", "sft")
IGNORE_INDEX = -100


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def windows_per_document(lengths: np.ndarray, window_size: int, stride: int, pad_tail: bool) -> np.ndarray:
    """How many windows each document of `lengths` yields.

    Full windows start at 0, S, 2S, ... while they fit. With `pad_tail`, one more (padded) window
    starts at the next multiple of S when the full windows leave tokens after them uncovered;
    tokens in the gaps of a stride larger than the window are skipped by design, not a tail.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    full = np.where(lengths >= window_size, (lengths - window_size) // stride + 1, 0)
    if not pad_tail:
        return full
    covered_until = np.where(full > 0, (full - 1) * stride + window_size, 0)
    return full + ((full * stride < lengths) & (covered_until < lengths))


class WindowIndex:
    """Maps window numbers to flat `[start, stop)` token ranges; `stop - start < W` means padding."""

    def __init__(
        self,
        offsets: np.ndarray,
        window_size: int,
        stride: int | None = None,
        pad_tail: bool = False,
        respect_document_boundaries: bool = False,
    ):
        self.window_size = _positive_int(window_size, "window_size")
        self.stride = self.window_size if stride is None else _positive_int(stride, "stride")
        offsets = np.asarray(offsets, dtype=np.int64)
        bounds = offsets if respect_document_boundaries else offsets[[0, -1]]
        self.document_lengths = np.diff(bounds)
        counts = windows_per_document(self.document_lengths, self.window_size, self.stride, pad_tail)
        self._document_starts = bounds[:-1]
        self._document_ends = bounds[1:]
        self._first_window = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._first_window[-1])

    def spans(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat starts and stops of windows `indices` (assumed in range)."""
        indices = np.asarray(indices, dtype=np.int64)
        documents = np.searchsorted(self._first_window, indices, side="right") - 1
        starts = self._document_starts[documents] + (indices - self._first_window[documents]) * self.stride
        stops = np.minimum(starts + self.window_size, self._document_ends[documents])
        return starts, stops

    def __getitem__(self, index: int) -> tuple[int, int]:
        index = _checked_index(index, len(self), "window")
        starts, stops = self.spans(np.array([index]))
        return int(starts[0]), int(stops[0])


def _checked_index(index: int, count: int, what: str) -> int:
    if not -count <= index < count:
        raise IndexError(f"{what} index {index} out of range for {count} {what}s")
    return index % count


class TokenExamples:
    """The examples of one train type drawn from one store, addressable by index.

    Keys of each example (TRL's names where TRL has them):
    - `seq`, `sft`: `input_ids`, `attention_mask`, `labels` (all of length `window_size`; labels
      are -100 on padding and, for `sft`, where `loss_mask` is 0; the model shifts them).
    - `dpo`: `prompt_ids`, `chosen_ids`, `rejected_ids` (TRL 1.16's tokenized columns): one whole
      pair per row; the prompt is the part of both records before their first masked-in token (the
      same tokens on both sides), each answer the rest, every token of which counts. A mask that
      turns off again inside an answer, or prompts that differ, are refused naming the record.
    - `grpo`: `prompt_ids`, `completion_ids` (one list per response), `completion_mask`,
      `rewards` (float32): one whole group per row.

    `vocab_size` (the model's, e.g. `len(tokenizer)` or `config.vocab_size`) checks, before any
    example is made, that every token id the store holds, and the padding id, is below it: the
    store's recorded maximum per key, or one scan of the key for a store that records none.
    """

    def __init__(
        self,
        store: TokenStore,
        train_type: str,
        window_size: int | None = None,
        stride: int | None = None,
        pad_tail: bool = False,
        respect_document_boundaries: bool = False,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
    ):
        if train_type not in TRAIN_TYPE_KEYS:
            raise ValueError(f"train_type must be one of {list(TRAIN_TYPE_KEYS)}, got {train_type!r}")
        missing = [key for key in TRAIN_TYPE_KEYS[train_type] if key not in store.keys]
        if missing:
            raise ValueError(
                f"{store.path}: train_type {train_type!r} needs key(s) {missing}, the store holds {store.keys}"
            )
        self.store, self.train_type = store, train_type
        self._check_records_aligned()
        if vocab_size is not None:
            self._check_vocabulary(_positive_int(vocab_size, "vocab_size"))
        if train_type not in WINDOWED_TRAIN_TYPES:
            if window_size is not None or stride is not None or pad_tail or respect_document_boundaries:
                raise ValueError(
                    f"train_type {train_type!r} yields whole records: window_size, stride, pad_tail and "
                    "respect_document_boundaries apply to 'seq' and 'sft' only"
                )
            self.windows = None
            self._count = store.num_segments(TRAIN_TYPE_KEYS[train_type][0])
            return
        if window_size is None:
            raise ValueError(f"train_type {train_type!r} needs window_size")
        self.windows = WindowIndex(store.offsets("sequence"), window_size, stride, pad_tail, respect_document_boundaries)
        self._count = len(self.windows)
        if self._count == 0:
            longest = int(self.windows.document_lengths.max())
            where = "longest document" if respect_document_boundaries else "whole token stream"
            raise ValueError(
                f"{store.path}: window_size {window_size} is larger than the {where} ({longest} tokens), "
                "so no window fits; lower window_size or pass pad_tail=True"
            )
        self.pad_token_id = 0
        if pad_tail:
            pad = pad_token_id if pad_token_id is not None else store.metadata.get("pad_token_id")
            pad = pad if pad is not None else store.metadata.get("eos_token_id")
            if pad is None:
                raise ValueError(f"{store.path}: pad_tail=True needs pad_token_id (the store records no pad or eos id)")
            # Below the model's vocabulary when given, else below the store's own.
            limit = min(vocab_size or store.metadata.get("vocab_size") or MAX_TOKEN_ID + 1, MAX_TOKEN_ID + 1)
            if not is_int(pad) or not 0 <= pad < limit:
                raise ValueError(f"{store.path}: pad_token_id must be a token id in [0, {limit - 1}], got {pad!r}")
            self.pad_token_id = int(pad)

    def _check_vocabulary(self, vocab_size: int) -> None:
        """Refuse a store holding token ids at or above `vocab_size`, naming the store, the key and the id."""
        store = self.store
        for key in TRAIN_TYPE_KEYS[self.train_type]:
            value_range = store.value_range(key) if key_kind(key) == "token" else None
            if value_range is not None and value_range[1] >= vocab_size:
                raise ValueError(
                    f"{store.path}: key {key!r} holds token id {value_range[1]}, but the vocabulary has {vocab_size} ids "
                    f"(0..{vocab_size - 1}); the store was prepared with tokenizer {store.metadata.get('tokenizer')!r} "
                    f"(vocab_size {store.metadata.get('vocab_size')})"
                )

    def _check_records_aligned(self) -> None:
        store = self.store

        def same_segments(first: str, second: str) -> None:
            a, b = store.segment_lengths(first), store.segment_lengths(second)
            if len(a) != len(b):
                raise ValueError(f"{store.path}: keys {first!r} and {second!r} hold {len(a)} and {len(b)} records")
            differing = np.flatnonzero(a != b)
            if differing.size:
                record = int(differing[0])
                raise ValueError(
                    f"{store.path}: record {record} has {a[record]} {first!r} values but {b[record]} {second!r} values"
                )

        if self.train_type == "sft":
            same_segments("sequence", "loss_mask")
        elif self.train_type == "dpo":
            same_segments("chosen", "chosen_mask")
            same_segments("rejected", "rejected_mask")
            if store.num_segments("chosen") != store.num_segments("rejected"):
                raise ValueError(
                    f"{store.path}: {store.num_segments('chosen')} 'chosen' records but "
                    f"{store.num_segments('rejected')} 'rejected' records"
                )
        elif self.train_type == "grpo":
            same_segments("responses", "masks")
            if store.num_segments("prompts") != store.num_segments("rewards"):
                raise ValueError(
                    f"{store.path}: {store.num_segments('prompts')} 'prompts' but {store.num_segments('rewards')} 'rewards' records"
                )
            if store.total_length("rewards") != store.num_segments("responses"):
                raise ValueError(
                    f"{store.path}: {store.total_length('rewards')} rewards but {store.num_segments('responses')} responses"
                )
            empty = np.flatnonzero(store.segment_lengths("rewards") == 0)
            if empty.size:
                raise ValueError(f"{store.path}: grpo record {int(empty[0])} has no responses; a group needs at least one")

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = _checked_index(index, self._count, "example")
        return {key: column[0] for key, column in self.batch(index, index + 1).items()}

    def batch(self, start: int, stop: int) -> dict[str, Any]:
        """Examples `[start, stop)` as columns: 2-D arrays for windows, lists of arrays for records."""
        if not 0 <= start <= stop <= self._count:
            raise IndexError(f"examples [{start}, {stop}) out of range for {self._count} examples")
        if self.windows is not None:
            return self._window_batch(start, stop)
        if self.train_type == "dpo":
            return self._dpo_batch(start, stop)
        return self._grpo_batch(start, stop)

    def _window_batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        starts, stops = self.windows.spans(np.arange(start, stop))
        width = self.windows.window_size
        lengths = stops - starts
        valid = np.arange(width)[None, :] < lengths[:, None]
        tokens, row_offsets = self._read_rows("sequence", starts, stops)
        positions = np.minimum(row_offsets[:, None] + np.arange(width)[None, :], max(len(tokens) - 1, 0))
        window_tokens = tokens[positions].astype(np.int32)
        labelled = valid
        if self.train_type == "sft":
            mask, _ = self._read_rows("loss_mask", starts, stops)
            labelled = valid & (mask[positions] != 0)
        return {
            "input_ids": np.where(valid, window_tokens, self.pad_token_id).astype(np.int32),
            "attention_mask": valid.astype(np.int8),
            "labels": np.where(labelled, window_tokens, IGNORE_INDEX).astype(np.int32),
        }

    def _read_rows(self, key: str, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of all rows in one buffer plus each row's offset in it.

        Consecutive windows overlap or touch, so one read of their span serves them all; when a
        stride far larger than the window leaves most of the span unused, rows are read one by one.
        """
        span_start, span_stop = int(starts[0]), int(stops.max())
        if span_stop - span_start <= 2 * int((stops - starts).sum()) + 1:
            return self.store.read(key, span_start, span_stop), starts - span_start
        pieces = [self.store.read(key, int(a), int(b)) for a, b in zip(starts, stops)]
        lengths = np.array([len(piece) for piece in pieces], dtype=np.int64)
        return np.concatenate(pieces), np.concatenate([[0], np.cumsum(lengths)[:-1]])

    def _split_answer(self, side: str, record: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, answer) of one side of a dpo record: the tokens before its first masked-in one, and the rest."""
        tokens = self.store.segment(side, record).astype(np.int32)
        mask = self.store.segment(f"{side}_mask", record) != 0
        first = int(mask.argmax()) if mask.any() else len(mask)
        if not mask[first:].all():
            raise ValueError(f"{self.store.path}: dpo record {record}: '{side}_mask' turns off again inside the answer "
                             f"(at token {first + int((~mask[first:]).argmax())}); an answer is scored whole")
        return tokens[:first], tokens[first:]

    def _dpo_batch(self, start: int, stop: int) -> dict[str, list[np.ndarray]]:
        columns: dict[str, list[np.ndarray]] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
        for record in range(start, stop):
            prompt, chosen = self._split_answer("chosen", record)
            rejected_prompt, rejected = self._split_answer("rejected", record)
            if not np.array_equal(prompt, rejected_prompt):
                raise ValueError(f"{self.store.path}: dpo record {record}: the tokens before the answer differ between "
                                 f"'chosen' ({len(prompt)} tokens) and 'rejected' ({len(rejected_prompt)} tokens); "
                                 "both answers must follow one prompt")
            columns["prompt_ids"].append(prompt)
            columns["chosen_ids"].append(chosen)
            columns["rejected_ids"].append(rejected)
        return columns

    def _grpo_batch(self, start: int, stop: int) -> dict[str, list]:
        store = self.store
        first_response = store.offsets("rewards")
        columns: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "completion_mask": [], "rewards": []}
        for record in range(start, stop):
            responses = range(int(first_response[record]), int(first_response[record + 1]))
            columns["prompt_ids"].append(store.segment("prompts", record).astype(np.int32))
            columns["completion_ids"].append([store.segment("responses", j).astype(np.int32) for j in responses])
            columns["completion_mask"].append([store.segment("masks", j).astype(np.int8) for j in responses])
            columns["rewards"].append(store.segment("rewards", record).astype(np.float32))
        return columns
