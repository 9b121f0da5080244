"""The frozen trunk: with the base frozen, the decoder layers below the first memory layer give a row the same hidden
states every time it is read, whatever the memory has learnt. `FrozenTrunkCache` keeps those hidden states per row
(the trunk), so that from a row's second reading on a step runs only the layers from the memory up: the same
arithmetic on the same inputs, so the same loss and gradients, at the cost of the layers above the trunk alone.

A row is known by its token ids and attention mask (and the trunk's depth): any change to the row computes its trunk
afresh. What the trunk does not record is the batch a row was computed in; matrix kernels may round a row's values
differently in batches of other sizes, as they do in any batched computation."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from torch import Tensor

# the trunks a model keeps by default: 8 GiB (a 1,024-token row of a 576-wide base in bfloat16 is 1.2 MB)
DEFAULT_TRUNK_BYTES = 8 * 2**30


@dataclass
class FrozenTrunkCache:
    """Trunks of rows by `row_key`, kept on the CPU up to `max_bytes` (the oldest go first); `hits` and `misses`
    count rows read from it and rows computed."""

    max_bytes: int
    rows: OrderedDict[bytes, Tensor] = field(default_factory=OrderedDict)
    stored_bytes: int = 0
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1:
            raise ValueError(f"FrozenTrunkCache: max_bytes must be a positive integer, got {self.max_bytes!r}")

    @staticmethod
    def row_key(ids: Tensor, mask: Tensor | None, first_layer: int) -> bytes:
        """The key of one row: its ids, its mask (None: no padding) and the layer its trunk ends before."""
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"{first_layer}:{ids.shape[0]}:{ids.dtype}".encode())
        digest.update(ids.detach().cpu().numpy().tobytes())
        if mask is not None:
            digest.update(mask.detach().to("cpu", dtype=ids.dtype).numpy().tobytes())
        return digest.digest()

    def get(self, keys: list[bytes]) -> list[Tensor] | None:
        """The trunks of all `keys`' rows, or None when any of them is not kept (the batch is then computed whole)."""
        rows = [self.rows.get(key) for key in keys]
        if any(row is None for row in rows):
            return None
        self.hits += len(rows)
        return rows

    def put(self, keys: list[bytes], trunk: Tensor) -> None:
        """Keep each row of `trunk` [rows, tokens, hidden] under its key, dropping the oldest rows over `max_bytes`."""
        self.misses += len(keys)
        for key, row in zip(keys, trunk.detach().to("cpu")):
            row = row.clone()  # its own storage: a row view would keep the whole batch's
            size = row.numel() * row.element_size()
            if size > self.max_bytes:
                continue
            if key in self.rows:
                old = self.rows.pop(key)
                self.stored_bytes -= old.numel() * old.element_size()
            self.rows[key] = row
            self.stored_bytes += size
            while self.stored_bytes > self.max_bytes:
                _, dropped = self.rows.popitem(last=False)
                self.stored_bytes -= dropped.numel() * dropped.element_size()
