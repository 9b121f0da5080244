"""The two orders in which `TitansQwenModel` streams an input through its chunks; both compute the same thing.

- Chunk by chunk (`_stream`): every layer of a chunk, then the next chunk. What a cache, the previous chunk's keys
  (attend_previous_chunk), prefix tokens (mac) and per-chunk checkpointing need.
- Layer by layer (`_stream_layer_major`), where chunks attend only to themselves: each decoder layer once over all
  chunks of a segment as one batch, each memory once over the segment's tokens in order; far fewer and larger calls
  when chunks are small.

Rows of a batch that start at different places of the chunk cycle (left padding) run as separate streams, one per
`PhaseGroup` (`_stream_groups`); right-padded rows that end chunks apart run each only as far as its own last chunk,
one stream per end (`_stream_row_ends`). A stream returns a `StreamOutput`: what the LM head made of it, chunk by chunk
(`StreamRequest`: `TitansQwenForCausalLM` asks for it), the hidden states asked for, and the memory states and
previous chunk it ends in.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .cache_titans_qwen import PhaseGroup, TitansCache
from .memory import MemoryState
from .variants import TitansMemoryBlock


@dataclass
class PreviousChunk:
    """The previous chunk as the next one's attention sees it (attend_previous_chunk): per layer its keys (RoPE at
    positions 0 ..) and values [B, kv heads, keys, head dim], and its 2-D key mask (None: no padding)."""

    key_values: list[tuple[Tensor, Tensor]]
    mask: Tensor | None

    @property
    def length(self) -> int:
        return self.key_values[0][0].shape[-2] if self.key_values else 0

    def detach(self) -> PreviousChunk:
        return PreviousChunk([(keys.detach(), values.detach()) for keys, values in self.key_values], self.mask)


@dataclass
class StreamRequest:
    """What a stream computes besides the memory: with `lm_head`, the logits of positions >= `keep_start`, the summed
    loss of `shifted_labels` (position t predicts shifted_labels[t]; -100: no label) and, with `predict`, the greedy
    token and loss of every position, all chunk by chunk; `hidden_states` "all" (the embeddings and every layer's
    output, the last normed), "last" (the last alone) or None."""

    lm_head: nn.Module | None = None
    shifted_labels: Tensor | None = None
    keep_start: int = 0
    predict: bool = False
    hidden_states: str | None = None

    def for_rows(self, rows: Tensor, skip: int, stop: int | None = None) -> StreamRequest:
        """The request for `rows` of the batch from column `skip` on (up to column `stop`)."""
        labels = None if self.shifted_labels is None else self.shifted_labels[rows, skip:stop]
        return dataclasses.replace(self, shifted_labels=labels, keep_start=max(0, self.keep_start - skip))


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


def placed_streams(results: Sequence[tuple[Tensor, int, StreamOutput]], shape: tuple[int, int],
                   request: StreamRequest) -> StreamOutput:
    """The streams of some of a batch's rows joined into the batch's: `results` holds (rows, first column, output)
    for streams over columns first .. first + their width. Logits, predictions and hidden states go back in place
    (zeros, predictions -100 elsewhere); losses and writes are summed in order."""
    batch_size, length = shape

    def place(parts: list[tuple[Tensor, int, Tensor | None]], width: int, fill: float) -> Tensor:
        present = [part for part in parts if part[2] is not None]
        template = present[0][2]
        out = template.new_full((batch_size, width, *template.shape[2:]), fill)
        for rows, column, part in present:
            out[rows, column:column + part.shape[1]] = part
        return out

    output = StreamOutput()
    keep_start = request.keep_start
    if any(out.logits is not None for _, _, out in results):
        output.logits = place([(rows, max(0, first - keep_start), out.logits) for rows, first, out in results],
                              length - keep_start, 0.0)
    output.loss_sum = sum_present(out.loss_sum for _, _, out in results)
    output.written = sum_present(out.written for _, _, out in results)
    if request.predict:
        output.predictions = tuple(place([(rows, first, out.predictions[part]) for rows, first, out in results],
                                         length, fill) for part, fill in ((0, -100), (1, 0.0)))
    if request.hidden_states:
        output.hidden_states = tuple(
            place([(rows, first, out.hidden_states[index]) for rows, first, out in results], length, 0.0)
            for index in range(len(results[0][2].hidden_states)))
    return output


def joined_row_states(parts: Sequence[tuple[Tensor, MemoryState]], position: int) -> MemoryState:
    """One memory state of a batch from the states its rows ended in: (rows, state) for rows streamed up to the
    state's position, short of the input's end at `position`, with no unfinished update chunk. The padding after
    them would have written nothing, so the weights stand; the convolution tail is what it would have left: the rows'
    last projections followed by the padding's zeros."""

    def padded(state: MemoryState) -> MemoryState:
        tail = state.conv_tail
        padding = tail.new_zeros(state.batch_size, position - state.position, tail.shape[2])
        tail = torch.cat([tail, padding], dim=1)[:, padding.shape[1]:]
        return dataclasses.replace(state, conv_tail=tail, position=position)

    order = torch.cat([rows for rows, _ in parts]).argsort()
    return MemoryState.concatenated([padded(state) for _, state in parts]).select(order)


def sum_present(values: Iterable[Tensor | None]) -> Tensor | None:
    """The sum of the values that are not None, in order (None if all are)."""
    total = None
    for value in values:
        if value is not None:
            total = value if total is None else total + value
    return total


def chunk_lm_head(lm_head: nn.Module, hidden: Tensor, shifted_labels: Tensor | None, keep_from: int, predict: bool
                  ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None]:
    """What the LM head makes of one chunk's normed hidden states: (logits of positions >= keep_from or None,
    summed loss over labelled positions or None, with `predict` the greedy next token and loss of every
    position)."""
    logits = loss_sum = predictions = None
    length = hidden.shape[1]
    if shifted_labels is not None:
        all_logits = lm_head(hidden)
        token_losses = F.cross_entropy(all_logits.float().flatten(0, 1), shifted_labels.flatten(),
                                       ignore_index=-100, reduction="none" if predict else "sum")
        if predict:  # one cross-entropy: the positions' losses, and their sum
            loss_sum = token_losses.sum()
            predictions = (all_logits.argmax(-1).detach(), token_losses.detach().view(shifted_labels.shape))
        else:
            loss_sum = token_losses
        if keep_from < length:
            logits = all_logits[:, keep_from:]
    elif keep_from < length:
        logits = lm_head(hidden[:, keep_from:])
    return logits, loss_sum, predictions


class ChunkStreamsMixin:
    """The stream orders of `TitansQwenModel` (see the module docstring)."""

    # tokens the layer-major stream runs through each layer at once (`_stream_layer_major`)
    LAYER_MAJOR_TOKENS = 8192

    def _phase_groups(self, token_mask: Tensor | None, cache: TitansCache | None) -> list[PhaseGroup] | None:
        """The rows of a first call grouped by where their first real token falls in the chunk cycle, so each row's
        chunks (and memory updates) start at its own first token; None when every row's left padding is a whole
        multiple of `padding_multiple` (the batch runs as one). With a cache, each group gets its own and the groups
        stay in it for the calls that continue the stream."""
        if token_mask is None:
            return None
        real = token_mask.bool()
        has_tokens = real.any(1)
        if cache is not None and not bool(has_tokens.all()):
            row = int((~has_tokens).nonzero()[0])
            raise ValueError(f"forward: row {row} has no real token in the first piece given to an empty cache; a "
                             "row's chunks start at its first real token, so the first piece must hold it")
        phases = torch.where(has_tokens, real.int().argmax(1), 0) % self.padding_multiple
        if not bool(phases.any()):
            return None
        groups = [PhaseGroup(rows=(phases == phase).nonzero().flatten(), phase=phase,
                             cache=None if cache is None else TitansCache(self.config))
                  for phase in sorted(set(phases.tolist()))]
        if cache is not None:
            cache.phase_groups = groups
        return groups

    def _stream_groups(self, groups: list[PhaseGroup], inputs: Tensor, token_mask: Tensor | None, seen: int,
                       request: StreamRequest) -> StreamOutput:
        """`_stream` for each phase group from its phase on (a first call drops the group's first `phase` columns,
        padding in all its rows), each with its own cache, the results put back in the batch's rows and columns."""
        results = []
        for group in groups:
            skip = max(0, group.phase - seen)
            take = lambda t: None if t is None else t[group.rows, skip:]  # noqa: E731
            results.append((group.rows, skip, self._stream(take(inputs), take(token_mask), group.cache, None,
                                                           request.for_rows(group.rows, skip))))
        return placed_streams(results, inputs.shape[:2], request)

    def _row_ends(self, token_mask: Tensor | None, length: int, states: dict[int, MemoryState] | None
                  ) -> Tensor | None:
        """Where each row of a first call without a cache stops streaming: after its last real token's
        `padding_multiple` of tokens (at least one), the longest rows at the input's end; None when the batch runs
        whole: no padding, no row ending a multiple earlier, an input or starting `states` off the multiples,
        compiled chunks (one graph a shape), or processes under `torch.distributed` (a sharded layer must be called
        alike on every rank)."""
        multiple = self.padding_multiple
        if (token_mask is None or length % multiple or self._compiled_chunk_step is not None
                or any(state.position % multiple for state in (states or {}).values())
                or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)):
            return None
        real = token_mask.bool()
        last = torch.where(real.any(1), length - real.flip(1).int().argmax(1), 1)
        ends = (last + multiple - 1) // multiple * multiple
        ends = torch.where(ends == ends.max(), length, ends)
        return None if bool((ends == length).all()) else ends

    def _stream_row_ends(self, ends: Tensor, inputs: Tensor, token_mask: Tensor, states: dict[int, MemoryState] | None,
                         request: StreamRequest) -> StreamOutput:
        """`_stream` for each set of rows that end together (`_row_ends`), up to their end: the trailing chunks of
        padding, which attend nothing real and write nothing, are not computed. Outputs there are zeros (no logits,
        no hidden states; predictions -100), and the memory states are those the whole batch would end in."""
        batch_size, length = inputs.shape[:2]
        results = []
        for end in sorted(set(ends.tolist())):
            rows = (ends == end).nonzero().flatten()
            start = None if states is None else {layer: state.select(rows) for layer, state in states.items()}
            out = self._stream(inputs[rows, :end], token_mask[rows, :end], None, start,
                               request.for_rows(rows, 0, end))
            results.append((rows, 0, out))
        output = placed_streams(results, (batch_size, length), request)
        if states is not None:
            output.states = {layer: joined_row_states([(rows, out.states[layer]) for rows, _, out in results],
                                                      states[layer].position + length)
                             for layer in states}
        return output

    def _stream(self, inputs: Tensor, token_mask: Tensor | None, cache: TitansCache | None,
                states: dict[int, MemoryState] | None, request: StreamRequest) -> StreamOutput:
        """The chunk loop over rows whose chunks line up. Continues `cache`'s stream and leaves it after these
        tokens; without a cache, starts from `states` (fresh ones if None) and returns the stream's end (the
        memory states and, with attend_previous_chunk, the last chunk: what a cache would hold)."""
        batch_size, length = inputs.shape[:2]
        if cache is not None and cache.memory_states is not None:
            states = cache.memory_states
        elif states is None:
            states = self.init_memory_states(batch_size, inputs.device)
        seen = cache.seen_tokens if cache is not None else 0
        memory = self.config.memory_config
        chunk_size, bptt = memory.chunk_size, memory.bptt_chunks
        use_checkpoint = ((memory.checkpoint_chunks or self.gradient_checkpointing) and self.training
                          and torch.is_grad_enabled() and cache is None)

        if self._runs_layer_major(length, cache, use_checkpoint):
            return self._stream_layer_major(inputs, token_mask, states, request)

        window = memory.attend_previous_chunk
        # without a cache, the previous chunk's keys travel from piece to piece (with one, the cache holds them)
        previous = PreviousChunk([], None) if window and cache is None else None
        # the memory off and chunk-local attention: a chunk's outputs reach nothing but itself, so a whole chunk none
        # of whose outputs are asked for (no kept logits, labels or hidden states) is not computed; the ablation's
        # prefill of a long prompt runs its last chunk alone
        unread = (not self._memory_enabled and not window and request.shifted_labels is None
                  and request.hidden_states is None)
        pieces, start = [], 0
        geometry: dict = {}  # masks and positions by shape, shared by the chunks of this stream
        while start < length:
            position = seen + start
            end = min(length, start + chunk_size - position % chunk_size)
            starts_chunk = position % chunk_size == 0
            chunk_index = position // chunk_size
            if starts_chunk and cache is not None and position > 0:
                cache.start_new_chunk(
                    functools.partial(self._move_keys, offset=-cache.previous_length) if window else None)
            if unread and end <= request.keep_start and (seen + end) % chunk_size == 0:
                start = end
                continue
            if bptt and starts_chunk and chunk_index > 0 and chunk_index % bptt == 0:
                states = {layer: state.detach() for layer, state in states.items()}
                previous = previous.detach() if previous is not None else None
            piece = (
                inputs[:, start:end],
                None if token_mask is None else token_mask[:, start:end],
                None if request.shifted_labels is None else request.shifted_labels[:, start:end],
                states,
                cache,
                starts_chunk,
                min(end - start, max(0, request.keep_start - start)),  # the same value for every chunk before it
                self._memory_enabled,
                request.lm_head,
                request.predict,
                previous,
                request.hidden_states,
                geometry,
            )
            out = (checkpoint(self._forward_piece, *piece, use_reentrant=False) if use_checkpoint
                   else self._forward_piece(*piece))
            states, current = out.states, out.previous
            if current is not None:  # the next chunk sees this one at the positions before its own
                current.key_values = [(self._move_keys(keys, -previous.length), values)
                                      for keys, values in current.key_values]
                previous = current
            pieces.append(dataclasses.replace(out, states=None, previous=None))  # the loop carries those
            start = end

        if cache is not None:
            cache.memory_states = states
            cache.seen_tokens = seen + length
        return StreamOutput.joined(pieces, states, previous)

    def _runs_layer_major(self, length: int, cache: TitansCache | None, use_checkpoint: bool) -> bool:
        """Whether `_stream_layer_major` computes this stream: chunks that attend only to themselves (no previous
        chunk, no prefix tokens), no cache, no per-chunk checkpointing or truncated BPTT, more than one chunk, and
        not inside `chunk_by_chunk()` or with `compile_chunks()`."""
        memory = self.config.memory_config
        return (self._layer_major_enabled and self._compiled_chunk_step is None and cache is None
                and not use_checkpoint and not memory.attend_previous_chunk and not memory.bptt_chunks
                and length > memory.chunk_size and not hasattr(self, "persistent_tokens")
                and all(type(block).prefix_tokens is TitansMemoryBlock.prefix_tokens for block in self.memory.values()))

    def _stream_layer_major(self, inputs: Tensor, token_mask: Tensor | None, states: dict[int, MemoryState],
                            request: StreamRequest) -> StreamOutput:
        """`_stream` where no chunk sees another through attention (see `_runs_layer_major`), layer by layer instead
        of chunk by chunk: each decoder layer runs once on all chunks of a segment as rows of one batch, each memory
        block once over the segment's tokens in order (a memory reads only its own layer's inputs or outputs, and
        feeding it a segment at once equals feeding it chunk by chunk). The same arithmetic as the chunk loop with
        far fewer, larger calls. Segments hold at most `LAYER_MAJOR_TOKENS` tokens (at least one chunk), which bounds
        the activations an inference holds at once."""
        batch_size, length = inputs.shape[:2]
        chunk_size = self.config.memory_config.chunk_size
        layer_types = self.config.text_config.layer_types
        segment = chunk_size * max(1, self.LAYER_MAJOR_TOKENS // chunk_size)
        geometry: dict = {}
        states = dict(states)
        pieces = []
        for start in range(0, length, segment):
            end = min(length, start + segment)
            hidden = inputs[:, start:end]
            hidden = hidden if hidden.is_floating_point() else self.embed_tokens(hidden)
            mask = None if token_mask is None else token_mask[:, start:end]
            # the whole chunks as rows of one batch, the unfinished last chunk (if any) as a batch of its own
            whole = (end - start) // chunk_size * chunk_size
            batches = []  # (first, stop, rows, (position ids, masks, RoPE)) of each batch
            for first, stop, rows in ((0, whole, batch_size * (whole // chunk_size)), (whole, end - start, batch_size)):
                if stop > first:
                    width = (stop - first) * batch_size // rows
                    batch_mask = None if mask is None else mask[:, first:stop].reshape(rows, width)
                    batches.append((first, stop, rows, self._chunk_geometry(hidden.new_empty(rows, width, 0),
                                                                            batch_mask, None, 0, geometry)))
            segment_hidden = [hidden] if request.hidden_states == "all" else None
            written = []
            for index, decoder_layer in enumerate(self.layers):
                def layer(h: Tensor, decoder_layer=decoder_layer, kind=layer_types[index]) -> Tensor:
                    outs = []
                    for first, stop, rows, (position_ids, masks, position_embeddings) in batches:
                        out = decoder_layer(h[:, first:stop].reshape(rows, -1, h.shape[-1]), attention_mask=masks[kind],
                                            position_ids=position_ids, position_embeddings=position_embeddings)
                        outs.append(out.reshape(batch_size, stop - first, -1))
                    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

                block = self.memory[str(index)] if self._memory_enabled and str(index) in self.memory else None
                if block is None:
                    hidden = layer(hidden)
                else:
                    hidden, states[index] = block(layer, hidden, states[index], mask, 0)
                    written.append(states[index].written)
                if segment_hidden is not None:
                    segment_hidden.append(hidden)
            hidden = self.norm(hidden)
            if segment_hidden is not None:
                segment_hidden[-1] = hidden
            segment_output = StreamOutput(hidden_states=tuple(segment_hidden) if segment_hidden is not None
                                          else (hidden,) if request.hidden_states == "last" else None,
                                          written=sum_present(written))
            pieces.append(segment_output)
            if request.lm_head is None:
                continue
            for piece in range(start, end, chunk_size):  # the head chunk by chunk: never [T, vocab] logits at once
                stop = min(end, piece + chunk_size)
                labels = None if request.shifted_labels is None else request.shifted_labels[:, piece:stop]
                logits, loss_sum, predictions = chunk_lm_head(request.lm_head, hidden[:, piece - start:stop - start],
                                                              labels, max(0, request.keep_start - piece),
                                                              request.predict)
                pieces.append(StreamOutput(logits=logits, loss_sum=loss_sum, predictions=predictions))
        return StreamOutput.joined(pieces, states)


__all__ = ["ChunkStreamsMixin", "ChunkedLMHead", "ChunkedLMHeadOutput", "PreviousChunk", "StreamOutput",
           "StreamRequest", "chunk_lm_head", "joined_row_states", "placed_streams", "sum_present"]
