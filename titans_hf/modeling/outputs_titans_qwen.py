"""What a TitansQwen's forward returns, and the values its chunk loop passes around.

- The outputs: `TitansModelOutput` (the decoder's), `TitansCausalLMOutput` (the causal LM's).
- The LM head the causal LM hands its decoder to run chunk by chunk (`ChunkedLMHead`), and what it made of a stream
  (`ChunkedLMHeadOutput`).
- What a stream computes besides the memory (`StreamRequest`), and what it, or one piece of it, returns
  (`StreamOutput`).
- One piece of a stream as the compiled chunk step takes it (`ChunkStepRequest`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache_titans_qwen import PreviousChunk
from .memory import MemoryState


def sum_present(values: Iterable[Tensor | None]) -> Tensor | None:
    """The sum of the values that are not None, in order (None if all are)."""
    total = None
    for value in values:
        if value is not None:
            total = value if total is None else total + value
    return total


@dataclass
class StreamRequest:
    """What a stream computes besides the memory: with `lm_head`, the logits of positions >= `keep_start`, the summed
    loss of `shifted_labels` (position t predicts shifted_labels[t]; -100: no label) and, with `predict`, the greedy
    token and loss of every position, all chunk by chunk; `hidden_states` "all" (the embeddings and every layer's
    output, the last normed), "last" (the last alone) or None; `layers` (first, stop): the decoder layers it runs, its
    input the hidden states entering layer `first` (stop None: through the last layer and the final norm; else its
    "last" hidden states are those entering layer `stop`, not normed)."""

    lm_head: nn.Module | None = None
    shifted_labels: Tensor | None = None
    keep_start: int = 0
    predict: bool = False
    hidden_states: str | None = None
    layers: tuple[int, int | None] = (0, None)

    def for_rows(self, rows: Tensor, skip: int, stop: int | None = None) -> StreamRequest:
        """The request for `rows` of the batch from column `skip` on (up to column `stop`)."""
        labels = None if self.shifted_labels is None else self.shifted_labels[rows, skip:stop]
        return dataclasses.replace(self, shifted_labels=labels, keep_start=max(0, self.keep_start - skip))

    def for_piece(self, start: int, end: int) -> StreamRequest:
        """The request for columns `start` .. `end` of every row: the labels cut alike, `keep_start` counted from
        `start` and at most the piece's width, so it is the same value for every whole chunk before the kept positions
        (one compiled graph serves them all)."""
        labels = None if self.shifted_labels is None else self.shifted_labels[:, start:end]
        return dataclasses.replace(self, shifted_labels=labels,
                                   keep_start=min(end - start, max(0, self.keep_start - start)))


@dataclass
class ChunkedLMHead:
    """The LM head run on a stream chunk by chunk, inside the decoder's loop (in each chunk's checkpointed and
    compiled step), so that no [tokens, vocabulary] tensor is ever whole: what `TitansQwenForCausalLM` passes to
    `TitansQwenModel`. `labels` [batch, tokens] are not shifted (position t predicts labels[t + 1], across chunk
    boundaries too; padding predicts nothing); `logits_to_keep` > 0 keeps the logits of the last positions (0: all
    of them without labels, none with labels); `predict` also keeps the greedy token and the loss of every
    position."""

    module: nn.Module
    labels: Tensor | None = None
    logits_to_keep: int = 0
    predict: bool = False

    def request(self, token_mask: Tensor | None, shape: tuple[int, int], device: torch.device,
                hidden_states: str | None) -> StreamRequest:
        """The stream's request for inputs of `shape` (batch, tokens) with `token_mask` (None: no padding)."""
        length = shape[1]
        shifted_labels = None
        if self.labels is not None:
            if self.labels.shape != shape:
                raise ValueError(f"forward: labels {tuple(self.labels.shape)} must be [batch, tokens] = {shape}")
            labels = self.labels.to(device)
            shifted_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
            if token_mask is not None:  # padding predicts nothing: a row's first token has no label, as alone
                shifted_labels = shifted_labels.masked_fill(token_mask == 0, -100)
        keep_start = 0 if self.logits_to_keep == 0 else max(0, length - self.logits_to_keep)
        if self.labels is not None and self.logits_to_keep == 0:
            keep_start = length
        return StreamRequest(lm_head=self.module, shifted_labels=shifted_labels, keep_start=keep_start,
                             predict=self.predict and self.labels is not None, hidden_states=hidden_states)


@dataclass
class ChunkedLMHeadOutput:
    """What a `ChunkedLMHead` made of a stream: the kept logits, the loss summed over the labelled positions and
    their number, and (with `predict`) the greedy next token and loss of every position [batch, tokens]."""

    logits: Tensor | None = None
    loss_sum: Tensor | None = None
    num_labels: Tensor | None = None
    predictions: tuple[Tensor, Tensor] | None = None


@dataclass
class StreamOutput:
    """What a stream, or one piece of it, computed (None where not asked for): the logits of the kept positions, the
    summed loss, the greedy tokens and losses of every position, the hidden states (one tensor per layer), each along
    the tokens; the memory `states` it ends in and, in the chunk loop without a cache with attend_previous_chunk,
    its last chunk as the next one would see it (`previous`); the sum of its memories' writes (`written`, see
    `MemoryState.written`; None with the memory off)."""

    logits: Tensor | None = None
    loss_sum: Tensor | None = None
    predictions: tuple[Tensor, Tensor] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    states: dict[int, MemoryState] | None = None
    previous: PreviousChunk | None = None
    written: Tensor | None = None

    @classmethod
    def joined(cls, pieces: Sequence[StreamOutput], states: dict[int, MemoryState] | None,
               previous: PreviousChunk | None = None) -> StreamOutput:
        """The pieces' results (in token order) joined along the tokens, their losses and writes summed in order."""
        join = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # noqa: E731
        logits = [piece.logits for piece in pieces if piece.logits is not None]
        predictions = [piece.predictions for piece in pieces if piece.predictions is not None]
        hidden = [piece.hidden_states for piece in pieces if piece.hidden_states is not None]
        return cls(
            logits=join(logits) if logits else None,
            loss_sum=sum_present(piece.loss_sum for piece in pieces),
            predictions=(join([g for g, _ in predictions]), join([t for _, t in predictions])) if predictions else None,
            hidden_states=tuple(join(layer) for layer in zip(*hidden)) if hidden else None,
            states=states,
            previous=previous,
            written=sum_present(piece.written for piece in pieces),
        )


@dataclass
class ChunkStepRequest:
    """One piece of a stream (tokens inside one chunk) as the chunk step takes it (`TitansQwenModel._chunk_step`, what
    `compile_chunks()` compiles), once its embeddings and geometry are built: `hidden` [batch, prefix + tokens,
    hidden], its `num_prefix` prefix tokens first; the memory `states` it starts from; `token_mask` [batch, tokens]
    (None: no padding); whether the memory runs (`memory_enabled`); what to compute of it (`request`: the LM head,
    the labels, the kept logits counted from the piece's first token, predictions, hidden states); and the attention's
    `attention_cache` (None: no keys before the piece), `masks` by layer type, RoPE's `position_embeddings` (cos,
    sin) and the `position_ids`."""

    hidden: Tensor
    states: dict[int, MemoryState]
    token_mask: Tensor | None
    num_prefix: int
    memory_enabled: bool
    request: StreamRequest
    attention_cache: DynamicCache | None
    masks: dict
    position_embeddings: tuple[Tensor, Tensor]
    position_ids: Tensor


@dataclass
class TitansModelOutput(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` (`last_hidden_state` normed, `cache` a `TitansCache`) plus `memory_states`, the
    states the stream ends in when it started from given ones, `lm_head_output`, what a `ChunkedLMHead` passed to
    the decoder made of the stream, and `write_rate`: how open the memories' write gates were on this input, the
    mean of theta / max_lr over the memory layers, heads and real tokens (None with the memory off)."""

    memory_states: dict[int, MemoryState] | None = None
    lm_head_output: ChunkedLMHeadOutput | None = None
    write_rate: torch.FloatTensor | None = None


@dataclass
class TitansCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus, on request, the greedy prediction and the loss of every labelled token, the
    log-probabilities of a group of completions of each prompt, or the memory states the stream ends in; and the
    memories' `write_rate` (see `TitansModelOutput`), which the training loss weighs by `write_cost`."""

    label_predictions: torch.LongTensor | None = None
    token_losses: torch.FloatTensor | None = None
    completion_log_probs: torch.FloatTensor | None = None
    memory_states: dict[int, MemoryState] | None = None
    write_rate: torch.FloatTensor | None = None


__all__ = ["ChunkStepRequest", "ChunkedLMHead", "ChunkedLMHeadOutput", "StreamOutput", "StreamRequest",
           "TitansCausalLMOutput", "TitansModelOutput", "sum_present"]
