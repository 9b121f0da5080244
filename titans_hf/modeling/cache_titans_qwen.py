"""What a TitansQwen stream carries from one call to the next: the attention keys it still sees and every memory
layer's state (`TitansCache`), one cache per group of rows that start at the same place of the chunk cycle
(`PhaseGroup`); and, in a call without a cache, what it carries from one chunk to the next for attention
(`PreviousChunk`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from .memory import MemoryState

if TYPE_CHECKING:
    from .configuration_titans_qwen import TitansQwenConfig


def as_previous_chunk_mask(mask: Tensor | None, num_prefix: int) -> Tensor | None:
    """A finished chunk's attention mask (its `num_prefix` prefix tokens first) as the next chunk sees it: the
    prefix only in rows with a real token in the chunk, so a chunk of left padding stays as invisible as it is to
    the row alone."""
    if mask is None or not num_prefix:
        return mask
    tokens = mask[:, num_prefix:]
    return torch.cat([tokens.amax(dim=1, keepdim=True).expand(-1, num_prefix), tokens], dim=1)


@dataclass
class PreviousChunk:
    """The previous chunk as the next one's attention sees it (attend_previous_chunk): per layer its keys (RoPE at
    positions 0 ..) and values [B, kv heads, keys, head dim] (None for a layer the stream does not run, see
    `StreamRequest.layers`), and its 2-D key mask (None: no padding)."""

    key_values: list[tuple[Tensor, Tensor] | None]
    mask: Tensor | None

    @property
    def length(self) -> int:
        return next((pair[0].shape[-2] for pair in self.key_values if pair is not None), 0)

    def detach(self) -> PreviousChunk:
        return PreviousChunk([None if pair is None else (pair[0].detach(), pair[1].detach())
                              for pair in self.key_values], self.mask)


@dataclass
class PhaseGroup:
    """Rows of a batch whose first real tokens fall at the same place of the chunk cycle: `phase` = the row's left
    padding % `padding_multiple`. They run as one batch from column `phase` on, where their left padding is a whole
    multiple (whole chunks and memory updates, which leave a row's outputs as they are without them); with a cache,
    in their own `cache`."""

    rows: Tensor
    phase: int
    cache: TitansCache | None = None


def select_phase_groups(groups: list[PhaseGroup], index: Tensor) -> list[PhaseGroup]:
    """The groups of a batch whose new row r is old row `index[r]` (beams reordered, rows repeated or dropped)."""
    old_rows = sum(len(group.rows) for group in groups)
    index = index.to(groups[0].rows.device)
    selected = []
    for group in groups:
        local = torch.full((old_rows,), -1, dtype=torch.long, device=index.device)
        local[group.rows] = torch.arange(len(group.rows), device=index.device)
        position = local[index]
        rows = (position >= 0).nonzero().flatten()
        if rows.numel():
            if group.cache is not None:
                group.cache.reorder_cache(position[rows])
            selected.append(PhaseGroup(rows, group.phase, group.cache))
    return selected


class TitansCache(DynamicCache):
    """What decoding needs to continue a stream: the current chunk's keys/values (and, with
    attend_previous_chunk, the previous chunk's: attention never looks further back) and every memory layer's state.
    Its size does not grow with the prompt.

    `get_seq_length()` is the number of tokens seen (what `generate` means by it); the attention layers' own
    offsets come from `get_query_offset()`, the length of the current chunk's keys (prefix included). A batch whose
    rows start at different places of the chunk cycle (left padding that is not a whole multiple of
    `padding_multiple`) keeps one cache per `PhaseGroup` in `phase_groups`, set by the first forward.
    """

    def __init__(self, config: TitansQwenConfig):
        super().__init__(config=config.text_config)
        self.seen_tokens = 0
        # the update rule of the memory whose states it holds: a model of another rule refuses the cache
        self.update_rule = config.memory_config.update_rule
        self.memory_states: dict[int, MemoryState] | None = None
        self.phase_groups: list[PhaseGroup] | None = None
        self.chunk_attention_mask: Tensor | None = None  # [B, keys held], prefix included
        self.previous_length = 0  # keys of the previous chunk held before the current one's (attend_previous_chunk)
        self.prefix_length = 0  # tokens in front of the current chunk (mac's memory and persistent tokens)

    is_croppable = False  # the memory cannot un-write tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx)

    def start_new_chunk(self, keep_previous: Callable[[Tensor], Tensor] | None = None) -> None:
        """Drop the keys attention no longer sees. With `keep_previous` (the model's shift of keys to the positions
        they hold as the previous chunk), the chunk just finished stays, shifted, and everything before it goes."""
        if keep_previous is None:
            for layer in self.layers:
                layer.reset()
            self.chunk_attention_mask = None
            return
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = keep_previous(layer.keys[:, :, self.previous_length:])
                layer.values = layer.values[:, :, self.previous_length:]
        if self.chunk_attention_mask is not None:
            self.chunk_attention_mask = as_previous_chunk_mask(self.chunk_attention_mask[:, self.previous_length:],
                                                               self.prefix_length)
        self.previous_length = super().get_seq_length()

    def _rows(self) -> int | None:
        """Rows the cache holds (None before the first forward)."""
        if self.phase_groups is not None:
            return sum(len(group.rows) for group in self.phase_groups)
        if self.memory_states is not None:  # set together with the chunk mask, by the same forward
            return next(iter(self.memory_states.values())).batch_size
        return None

    def _select_rows(self, index: Tensor) -> None:
        if self.phase_groups is not None:
            self.phase_groups = select_phase_groups(self.phase_groups, index)
        if self.memory_states is not None:
            self.memory_states = {i: s.select(index) for i, s in self.memory_states.items()}
        if self.chunk_attention_mask is not None:
            mask = self.chunk_attention_mask
            self.chunk_attention_mask = mask.index_select(0, index.to(mask.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        rows = self._rows()
        if rows is not None:
            self._select_rows(torch.arange(rows).repeat_interleave(repeats))


__all__ = ["PhaseGroup", "PreviousChunk", "TitansCache", "as_previous_chunk_mask"]
