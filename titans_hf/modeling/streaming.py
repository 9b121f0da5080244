"""The chunk stream of a TitansQwen decoder: the input read chunk by chunk through the base's decoder layers, each
memory block around its layer, the memory's state carried from chunk to chunk.

`ChunkStream` holds the stream's methods; `TitansQwenModel` (`modeling_titans_qwen`) is the one class that mixes it
in, and gives it what it reads: the base's modules (`embed_tokens`, `layers`, `norm`, `rotary_emb`), the memory
blocks (`memory`) and persistent tokens, the config, and the switches of the run (`memory_disabled`,
`chunk_by_chunk`, `compile_chunks`, `cache_frozen_trunk`, gradient checkpointing).

`_stream` is the one entry: a dispatcher whose routes are named for when they run.

- `_stream_phase_groups`: rows that start at different places of the chunk cycle (left padding off
  `padding_multiple`) run as one stream per `PhaseGroup`, each from its own first token;
- `_stream_rows_ending_early`: right-padded rows that end whole multiples apart run each only as far as its own last
  chunk, one stream per end;
- `_stream_aligned_rows`: rows whose chunks line up, in one of two orders that compute the same thing:
  - `_stream_layer_by_layer` where chunks attend only to themselves (no previous chunk, no prefix tokens, no cache):
    each decoder layer once over all chunks of a segment as one batch, each memory once over the segment's tokens in
    order; far fewer and larger calls when chunks are small;
  - `_stream_chunk_by_chunk` otherwise: every layer of a chunk, then the next chunk. What a cache, the previous
    chunk's keys (attend_previous_chunk), prefix tokens (mac) and per-chunk checkpointing need.

Both orders run the same layers (`_through_layers`: every decoder layer with its memory block, then the final norm)
and the same LM head (`_lm_head_piece`), chunk by chunk, so no [tokens, vocabulary] tensor is ever whole.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .cache_titans_qwen import PhaseGroup, PreviousChunk, TitansCache, as_previous_chunk_mask
from .frozen_trunk import DEFAULT_TRUNK_BYTES, FrozenTrunkCache
from .memory import MemoryState
from .outputs_titans_qwen import ChunkStepRequest, StreamOutput, StreamRequest, sum_present
from .variants import TitansMemoryBlock


def rotate_half(x: Tensor) -> Tensor:
    """The 90 degree turn of RoPE's pairs, as Qwen2 and Qwen3 pair the two halves of a head."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def chunk_lm_head(request: StreamRequest, hidden: Tensor) -> StreamOutput:
    """What the LM head makes of one chunk's normed hidden states, as `request` (cut to the chunk) asks: the logits of
    positions >= its keep_start, the summed loss over labelled positions and, with `predict`, the greedy next token
    and loss of every position."""
    logits = loss_sum = predictions = None
    length, keep_from = hidden.shape[1], request.keep_start
    if request.shifted_labels is not None:
        shifted_labels = request.shifted_labels
        all_logits = request.lm_head(hidden)
        token_losses = F.cross_entropy(all_logits.float().flatten(0, 1), shifted_labels.flatten(),
                                       ignore_index=-100, reduction="none" if request.predict else "sum")
        if request.predict:  # one cross-entropy: the positions' losses, and their sum
            loss_sum = token_losses.sum()
            predictions = (all_logits.argmax(-1).detach(), token_losses.detach().view(shifted_labels.shape))
        else:
            loss_sum = token_losses
        if keep_from < length:
            logits = all_logits[:, keep_from:]
    elif keep_from < length:
        logits = request.lm_head(hidden[:, keep_from:])
    return StreamOutput(logits=logits, loss_sum=loss_sum, predictions=predictions)


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


class ChunkStream:
    """The chunk stream's methods, mixed into `TitansQwenModel` (see the module docstring for what they read)."""

    # graphs of the compiled chunk step a process may hold: torch's limit (8 per function) counts every model, mode
    # (training, evaluation, generate) and backend together, and fullgraph=True turns reaching it into an error
    COMPILED_CHUNK_GRAPHS = 64

    def compile_chunks(self, enable: bool = True, **compile_options: Any) -> ChunkStream:
        """Run the chunk step under `torch.compile(fullgraph=True, **compile_options)` (e.g. `backend="inductor"`,
        `mode="max-autotune"`), or with `enable=False` eagerly again (enabled again with the same options, the graphs
        compiled so far serve); returns the model.

        The step is one chunk (or decoding piece) through every decoder layer with its memory block, the final norm
        and the LM head the causal LM passes (`_chunk_step`, given a `ChunkStepRequest`): one graph without breaks,
        compiled on the first chunk and reused by every chunk after it, in forward, backward, per-chunk checkpointing
        and generate's prefill. The chunk loop around it, the masks and positions (built once per shape), the
        embedding and the cache stay in Python. A stream compiles a few graphs whatever its length (the first chunk,
        which has no previous chunk to attend to, the chunks after it, and a last partial chunk); decoding's tokens
        that continue a chunk run eagerly (each length of the memory's unfinished update chunk would be a graph of its
        own). A process may hold up to `COMPILED_CHUNK_GRAPHS` graphs of the step (torch's own limit, 8 per function,
        would count every model, mode and backend together, and stop the ninth with an error). With compiled chunks
        the stream always runs chunk by chunk: the layer-by-layer order would compile the memory's whole segment, every
        update chunk unrolled.

        A setting of the run, not of the memory: it is not saved, and a memory trained with it loads and runs
        eagerly. Call it instead of `torch.compile(model)` (or the Trainer's `torch_compile`), which traces the whole
        forward: the chunk loop unrolled, broken wherever the input checks and the rows' padding read a tensor."""
        if enable and (self._chunk_compiler is None or self._chunk_compiler[0] != compile_options):
            compiled = torch.compile(type(self)._chunk_step, fullgraph=True, **compile_options)
            limit = self.COMPILED_CHUNK_GRAPHS

            def step(*args: Any) -> tuple:
                # the limit is read when a call compiles, so it is raised for this step's calls only
                with torch._dynamo.config.patch(recompile_limit=limit):
                    return compiled(*args)

            self._chunk_compiler = (compile_options, step)
        self._compiled_chunk_step = self._chunk_compiler[1] if enable else None
        return self

    def cache_frozen_trunk(self, enable: bool = True, max_bytes: int = DEFAULT_TRUNK_BYTES) -> ChunkStream:
        """Keep each row's hidden states below the first memory layer (its trunk, in a `FrozenTrunkCache` of up to
        `max_bytes` on the CPU) and start the row's later readings there, or with `enable=False` drop them and run
        every layer again; returns the model.

        With the base frozen below the memory, those layers give a row the same hidden states every time (see
        `frozen_trunk`): a training epoch after the first, or the memory read on, off and swapped over the same rows,
        then costs only the layers from the memory up. The first reading of a batch computes its trunk without
        gradients by the route the stream takes, so losses and gradients are those of the stream without it. Used
        by forward calls on token ids without a cache that do not ask for every layer's hidden states (prefill and
        decoding run every layer); refused at the call when a layer below the memory trains (a LoRA there,
        freeze_base=False) or training draws attention dropout. Nothing when tokens from the memory enter the first
        layer (mac, persistent tokens). A setting of the run: not saved."""
        self._frozen_trunk_cache = FrozenTrunkCache(max_bytes) if enable else None
        return self

    # ---- the stream: its two orders, its phase groups and row ends (see the module docstring) ----

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

    def _stream_phase_groups(self, groups: list[PhaseGroup], inputs: Tensor, token_mask: Tensor | None, seen: int,
                             request: StreamRequest) -> StreamOutput:
        """`_stream_aligned_rows` for each phase group from its phase on (a first call drops the group's first `phase`
        columns, padding in all its rows), each with its own cache, the results put back in the batch's rows and
        columns."""
        results = []
        for group in groups:
            skip = max(0, group.phase - seen)
            take = lambda t: None if t is None else t[group.rows, skip:]  # noqa: E731
            results.append((group.rows, skip, self._stream_aligned_rows(
                take(inputs), take(token_mask), group.cache, None, request.for_rows(group.rows, skip))))
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

    def _stream_rows_ending_early(self, ends: Tensor, inputs: Tensor, token_mask: Tensor,
                                  states: dict[int, MemoryState] | None, request: StreamRequest) -> StreamOutput:
        """`_stream_aligned_rows` for each set of rows that end together (`_row_ends`), up to their end: the trailing
        chunks of padding, which attend nothing real and write nothing, are not computed. Outputs there are zeros (no logits,
        no hidden states; predictions -100), and the memory states are those the whole batch would end in."""
        batch_size, length = inputs.shape[:2]
        results = []
        for end in sorted(set(ends.tolist())):
            rows = (ends == end).nonzero().flatten()
            start = None if states is None else {layer: state.select(rows) for layer, state in states.items()}
            out = self._stream_aligned_rows(inputs[rows, :end], token_mask[rows, :end], None, start,
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
        """The stream of `inputs` (ids [B, T] or embeddings [B, T, hidden]), by the route its rows take (see the
        module docstring): continues `cache`'s stream, or starts one from `states` (fresh ones if None)."""
        length = inputs.shape[1]
        seen = cache.seen_tokens if cache is not None else 0
        groups = cache.phase_groups if seen else self._phase_groups(token_mask, cache)
        if groups is not None:
            if states is not None:
                raise ValueError("forward: memory_states need rows that start together (right padding, or left "
                                 f"padding by whole multiples of padding_multiple = {self.padding_multiple})")
            stream = self._stream_phase_groups(groups, inputs, token_mask, seen, request)
            if cache is not None:
                cache.seen_tokens = seen + length
            return stream
        ends = None if cache is not None else self._row_ends(token_mask, length, states)
        if ends is not None:
            return self._stream_rows_ending_early(ends, inputs, token_mask, states, request)
        return self._stream_aligned_rows(inputs, token_mask, cache, states, request)

    def _stream_aligned_rows(self, inputs: Tensor, token_mask: Tensor | None, cache: TitansCache | None,
                             states: dict[int, MemoryState] | None, request: StreamRequest) -> StreamOutput:
        """Rows whose chunks line up, layer by layer where chunks attend only to themselves, else chunk by chunk.
        Continues `cache`'s stream and leaves it after these tokens; without a cache, starts from `states` (fresh ones
        if None) and returns the stream's end (the memory states and, with attend_previous_chunk, the last chunk: what
        a cache would hold)."""
        if cache is not None and cache.memory_states is not None:
            states = cache.memory_states
        elif states is None:
            states = self.init_memory_states(inputs.shape[0], inputs.device)
        if self._runs_layer_by_layer(inputs.shape[1], cache):
            return self._stream_layer_by_layer(inputs, token_mask, states, request)
        return self._stream_chunk_by_chunk(inputs, token_mask, cache, states, request)

    def _checkpoints_chunks(self, cache: TitansCache | None) -> bool:
        """Whether each chunk is recomputed in backward (`checkpoint_chunks` or gradient checkpointing, in a training
        call with gradients and no cache)."""
        memory = self.config.memory_config
        return bool((memory.checkpoint_chunks or self.gradient_checkpointing) and self.training
                    and torch.is_grad_enabled() and cache is None)

    def _stream_chunk_by_chunk(self, inputs: Tensor, token_mask: Tensor | None, cache: TitansCache | None,
                               states: dict[int, MemoryState], request: StreamRequest) -> StreamOutput:
        """The chunk loop: every layer of a chunk (`_forward_piece`, checkpointed as one unit when
        `_checkpoints_chunks`), then the next chunk, the previous chunk's keys carried along without a cache;
        truncated BPTT detaches the states every `bptt_chunks` chunks."""
        length = inputs.shape[1]
        seen = cache.seen_tokens if cache is not None else 0
        memory = self.config.memory_config
        chunk_size, bptt = memory.chunk_size, memory.bptt_chunks
        use_checkpoint = self._checkpoints_chunks(cache)
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
            piece = (inputs[:, start:end], None if token_mask is None else token_mask[:, start:end], states, cache,
                     starts_chunk, self._memory_enabled, request.for_piece(start, end), previous, geometry)
            out = (checkpoint(self._forward_piece, *piece, use_reentrant=False) if use_checkpoint
                   else self._forward_piece(*piece))
            states, current = out.states, out.previous
            if current is not None:  # the next chunk sees this one at the positions before its own
                current.key_values = [None if pair is None else (self._move_keys(pair[0], -previous.length), pair[1])
                                      for pair in current.key_values]
                previous = current
            pieces.append(dataclasses.replace(out, states=None, previous=None))  # the loop carries those
            start = end

        if cache is not None:
            cache.memory_states = states
            cache.seen_tokens = seen + length
        return StreamOutput.joined(pieces, states, previous)

    def _runs_layer_by_layer(self, length: int, cache: TitansCache | None) -> bool:
        """Whether `_stream_layer_by_layer` computes this stream: chunks that attend only to themselves (no previous
        chunk, no prefix tokens), no cache, no per-chunk checkpointing or truncated BPTT, more than one chunk, and
        not inside `chunk_by_chunk()` or with `compile_chunks()`."""
        memory = self.config.memory_config
        return (self._layer_major_enabled and self._compiled_chunk_step is None and cache is None
                and not self._checkpoints_chunks(cache) and not memory.attend_previous_chunk and not memory.bptt_chunks
                and length > memory.chunk_size and not hasattr(self, "persistent_tokens")
                and all(type(block).prefix_tokens is TitansMemoryBlock.prefix_tokens for block in self.memory.values()))

    def _stream_layer_by_layer(self, inputs: Tensor, token_mask: Tensor | None, states: dict[int, MemoryState],
                               request: StreamRequest) -> StreamOutput:
        """The aligned rows' stream where no chunk sees another through attention (see `_runs_layer_by_layer`), layer
        by layer instead of chunk by chunk: each decoder layer runs once on all chunks of a segment as rows of one
        batch, each memory block once over the segment's tokens in order (a memory reads only its own layer's inputs
        or outputs, and feeding it a segment at once equals feeding it chunk by chunk). The same arithmetic as the
        chunk loop with far fewer, larger calls; the LM head still runs chunk by chunk. Segments hold at most
        `LAYER_MAJOR_TOKENS` tokens (at least one chunk), which bounds the activations an inference holds at once."""
        length = inputs.shape[1]
        chunk_size = self.config.memory_config.chunk_size
        segment = chunk_size * max(1, self.LAYER_MAJOR_TOKENS // chunk_size)
        geometry: dict = {}
        pieces = []
        for start in range(0, length, segment):
            end = min(length, start + segment)
            hidden = inputs[:, start:end]
            hidden = hidden if hidden.is_floating_point() else self.embed_tokens(hidden)
            mask = None if token_mask is None else token_mask[:, start:end]
            layer_call = self._segment_layer_call(hidden, mask, geometry)
            hidden, segment_output = self._through_layers(hidden, layer_call, states, mask, 0, self._memory_enabled,
                                                          request.hidden_states, request.layers)
            states = segment_output.states
            pieces.append(segment_output)
            if request.lm_head is None:
                continue
            for piece in range(start, end, chunk_size):  # the head chunk by chunk: never [T, vocab] logits at once
                stop = min(end, piece + chunk_size)
                pieces.append(chunk_lm_head(request.for_piece(piece, stop), hidden[:, piece - start:stop - start]))
        return StreamOutput.joined(pieces, states)

    def _segment_layer_call(self, hidden: Tensor, mask: Tensor | None, geometry: dict
                            ) -> Callable[[int, nn.Module], Callable[[Tensor], Tensor]]:
        """How `_stream_layer_by_layer` calls a decoder layer on a segment `hidden` [batch, tokens, hidden]: its whole
        chunks as rows of one batch, its unfinished last chunk (if any) as a batch of its own, each chunk attending
        only to itself (masks and positions from `_chunk_geometry`, kept in `geometry`)."""
        batch_size, width = hidden.shape[:2]
        chunk_size = self.config.memory_config.chunk_size
        layer_types = self.config.text_config.layer_types
        whole = width // chunk_size * chunk_size
        batches = []  # (first, stop, rows, (position ids, masks, RoPE)) of each batch
        for first, stop, rows in ((0, whole, batch_size * (whole // chunk_size)), (whole, width, batch_size)):
            if stop > first:
                columns = (stop - first) * batch_size // rows
                batch_mask = None if mask is None else mask[:, first:stop].reshape(rows, columns)
                batches.append((first, stop, rows, self._chunk_geometry(hidden.new_empty(rows, columns, 0),
                                                                        batch_mask, None, 0, geometry)))

        def layer_call(index: int, decoder_layer: nn.Module) -> Callable[[Tensor], Tensor]:
            def layer(h: Tensor) -> Tensor:
                outs = []
                for first, stop, rows, (position_ids, masks, position_embeddings) in batches:
                    out = decoder_layer(h[:, first:stop].reshape(rows, -1, h.shape[-1]),
                                        attention_mask=masks[layer_types[index]], position_ids=position_ids,
                                        position_embeddings=position_embeddings)
                    outs.append(out.reshape(batch_size, stop - first, -1))
                return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

            return layer

        return layer_call

    def _through_layers(self, hidden: Tensor, layer_call: Callable[[int, nn.Module], Callable[[Tensor], Tensor]],
                        states: dict[int, MemoryState], token_mask: Tensor | None, num_prefix: int,
                        memory_enabled: bool, hidden_states: str | None, layers: tuple[int, int | None] = (0, None)
                        ) -> tuple[Tensor, StreamOutput]:
        """The decoder layers `layers` (first, stop; see `StreamRequest.layers`) over `hidden` (its first `num_prefix`
        positions prefix tokens), each memory block around its layer while the memory is on, then the final norm when
        they run to the last; `layer_call(index, decoder_layer)` is the layer as a chunk or a segment calls it.
        Returns (the hidden states without the prefix, normed after the last layer, a `StreamOutput` of the hidden
        states asked for ("all": the input and every layer's output, the last normed; "last"), the new memory states
        and the sum of the memories' writes (`MemoryState.written`; None with the memory off))."""
        new_states, written = dict(states), []
        all_hidden = [hidden[:, num_prefix:]] if hidden_states == "all" else None
        first, stop = layers
        for index, decoder_layer in enumerate(self.layers):
            if index < first or (stop is not None and index >= stop):
                continue
            layer = layer_call(index, decoder_layer)
            block = self.memory[str(index)] if memory_enabled and str(index) in self.memory else None
            if block is None:
                hidden = layer(hidden)
            else:
                hidden, new_states[index] = block(layer, hidden, states[index], token_mask, num_prefix)
                written.append(new_states[index].written)
            if all_hidden is not None:
                all_hidden.append(hidden[:, num_prefix:])
        hidden = hidden[:, num_prefix:] if stop is not None else self.norm(hidden[:, num_prefix:])
        if all_hidden is not None:
            all_hidden[-1] = hidden
        kept = tuple(all_hidden) if all_hidden is not None else (hidden,) if hidden_states == "last" else None
        return hidden, StreamOutput(hidden_states=kept, states=new_states, written=sum_present(written))

    # ---- the frozen trunk (`cache_frozen_trunk`) ----

    def _trunk_depth(self) -> int:
        """The decoder layers below every memory block, whose outputs no memory changes: those below the first memory
        layer; none when tokens read from the memory or learnt with it (mac's, persistent tokens) enter the first."""
        if hasattr(self, "persistent_tokens") or any(
                type(block).prefix_tokens is not TitansMemoryBlock.prefix_tokens for block in self.memory.values()):
            return 0
        return min(int(layer) for layer in self.memory)

    def _check_trunk_frozen(self, depth: int) -> None:
        """Refuse to keep trunks whose layers train (a LoRA below the memory, freeze_base=False) or whose training
        steps draw dropout: their outputs would change from one reading of a row to the next."""
        below = ("embed_tokens.", *(f"layers.{index}." for index in range(depth)))
        trainable = [name for name, parameter in self.named_parameters()
                     if parameter.requires_grad and name.startswith(below)]
        if trainable:
            raise ValueError(f"cache_frozen_trunk: {trainable[0]}{f' and {len(trainable) - 1} more' if trainable[1:] else ''}"
                             f" below the first memory layer ({depth}) train, so a row's trunk changes every step; "
                             "freeze them or call cache_frozen_trunk(False)")
        if self.training and self.config.text_config.attention_dropout:
            raise ValueError(f"cache_frozen_trunk: attention_dropout={self.config.text_config.attention_dropout} draws "
                             "new dropout at every training step, so a row's trunk is not the same twice")

    def _from_trunk(self, inputs: Tensor, token_mask: Tensor | None, cache: TitansCache | None,
                    states: dict[int, MemoryState] | None, request: StreamRequest) -> tuple[Tensor, StreamRequest]:
        """The stream's (inputs, request): unchanged, or, with `cache_frozen_trunk` on and a stream that can start
        above the trunk (ids, no cache, not every layer's hidden states asked for, a memory above layer 0), the
        hidden states entering the first memory layer, kept or computed for the whole batch without gradients by the
        same route the stream takes, and the request for the layers from there on."""
        store = self._frozen_trunk_cache
        if store is None or cache is not None or inputs.is_floating_point() or request.hidden_states == "all":
            return inputs, request
        depth = self._trunk_depth()
        if depth == 0:
            return inputs, request
        self._check_trunk_frozen(depth)
        keys = [store.row_key(inputs[row], None if token_mask is None else token_mask[row], depth)
                for row in range(inputs.shape[0])]
        rows = store.get(keys)
        if rows is not None:
            trunk = torch.stack(rows).to(inputs.device)
        else:
            with torch.no_grad():
                below = self._stream(inputs, token_mask, None, states,
                                     StreamRequest(hidden_states="last", layers=(0, depth)))
            trunk = below.hidden_states[0]
            store.put(keys, trunk)
        return trunk, dataclasses.replace(request, layers=(depth, None))

    # ---- one chunk ----

    def _move_keys(self, keys: Tensor, offset: int) -> Tensor:
        """Keys that RoPE rotated at positions p, as if rotated at p + offset (rotations compose: R(p + o) =
        R(o) R(p)): how a chunk's keys keep their place when it becomes the previous chunk, so positions stay within
        two chunks."""
        if offset == 0:
            return keys
        rotary = self.rotary_emb
        cos, sin = rotary(keys, torch.full((1, 1), offset, device=keys.device))
        cos, sin = cos.unsqueeze(1) / rotary.attention_scaling, sin.unsqueeze(1) / rotary.attention_scaling
        return keys * cos + rotate_half(keys) * sin

    def _chunk_geometry(self, hidden: Tensor, attention_mask: Tensor | None, attention_cache: DynamicCache | None,
                        past: int, reuse: dict | None) -> tuple[Tensor, dict, tuple[Tensor, Tensor]]:
        """(position ids, attention masks by layer type, RoPE's cos and sin) of a piece whose queries sit at positions
        `past` .. behind `past` keys. Without padding they depend only on the shapes, so they are built once per shape
        and kept in `reuse` (one dict per stream) for every chunk after: building them costs as much as a small
        chunk's attention. A boolean mask is kept as the additive float mask SDPA turns it into (0 / -inf), so that
        conversion is not paid at every layer either."""
        key = (past, *hidden.shape[:2], hidden.dtype, hidden.device)
        if attention_mask is None and reuse is not None and key in reuse:
            return reuse[key]
        text = self.config.text_config
        position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        kwargs = dict(config=text, inputs_embeds=hidden, attention_mask=attention_mask, cache=attention_cache,
                      position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in text.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        geometry = (position_ids, masks, self.rotary_emb(hidden, position_ids))
        if attention_mask is None and reuse is not None:
            # no padding: every query sees at least itself, so no row of the float mask is all -inf
            masks.update({kind: torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf")) for kind, mask in masks.items()
                if isinstance(mask, Tensor) and mask.dtype == torch.bool})
            reuse[key] = geometry
        return geometry

    def _chunk_prefix(self, states: dict[int, MemoryState], batch_size: int) -> Tensor | None:
        """What goes in front of a chunk: persistent tokens, then each memory block's prefix tokens (or None)."""
        parts = [self.persistent_tokens.unsqueeze(0).expand(batch_size, -1, -1)] if hasattr(
            self, "persistent_tokens") else []
        for layer, block in self.memory.items():
            tokens = block.prefix_tokens(states[int(layer)], batch_size)
            if tokens is not None:
                parts.append(tokens)
        return torch.cat(parts, dim=1) if parts else None

    def _chunk_attention_mask(self, mask: Tensor | None, cache: TitansCache | None, batch_size: int, length: int,
                              device: torch.device) -> tuple[Tensor | None, int]:
        """(2-D attention mask over the current chunk's keys, number of keys already in the cache). With a cache
        the mask grows with the chunk's keys, so a decoding step sees its chunk's padding too."""
        if cache is None:
            return mask, 0
        past = cache.get_query_offset()
        if mask is None and cache.chunk_attention_mask is None:
            return None, past
        full = mask if mask is not None else torch.ones(batch_size, length, dtype=torch.long, device=device)
        previous = cache.chunk_attention_mask
        if previous is None and past:
            previous = full.new_ones(batch_size, past)
        cache.chunk_attention_mask = full if previous is None else torch.cat([previous, full], dim=1)
        return cache.chunk_attention_mask, past

    def _forward_piece(self, inputs: Tensor, token_mask: Tensor | None, states: dict[int, MemoryState],
                       cache: TitansCache | None, starts_chunk: bool, memory_enabled: bool, request: StreamRequest,
                       previous: PreviousChunk | None = None, geometry: dict | None = None) -> StreamOutput:
        """Run tokens (ids [B, T], or embeddings [B, T, hidden]) that lie inside one chunk through the base's own
        layers, each memory block around its layer, then what `request` asks of this piece (`StreamRequest.for_piece`:
        with its LM head, the logits of positions >= its keep_start, the summed loss over the labelled ones and, with
        `predict`, the greedy token and loss of each; the hidden states asked for). Returns them, the new memory
        states and, without a cache but with `previous` (attend_previous_chunk), this chunk's keys, values and mask for
        the next chunk. `geometry` keeps the masks and positions built for one shape for the next chunks of the stream
        (see `_chunk_geometry`). Kept separate so it can be checkpointed as one unit, so every input is an argument
        (`memory_enabled` too: the recomputation in backward may run after `memory_disabled()` has exited) and no
        cache is changed in it but the decoding one."""
        batch_size, length = inputs.shape[:2]
        hidden = inputs if inputs.is_floating_point() else self.embed_tokens(inputs)
        prefix = self._chunk_prefix(states, batch_size) if starts_chunk and memory_enabled else None
        num_prefix, mask = 0, token_mask
        if prefix is not None:
            num_prefix = prefix.shape[1]
            hidden = torch.cat([prefix.to(hidden.dtype), hidden], dim=1)
            if token_mask is not None:
                mask = torch.cat([token_mask.new_ones(batch_size, num_prefix), token_mask], dim=1)
        if starts_chunk and cache is not None:
            cache.prefix_length = num_prefix
        attention_cache = cache
        if previous is not None:  # the previous chunk's keys in a cache made here, which the layers extend
            attention_cache = DynamicCache(config=self.config.text_config)
            # a layer the stream does not run (`StreamRequest.layers`) holds zeros of the previous chunk's shape:
            # transformers sizes the attention mask from the cache's first layer
            present = next((pair for pair in previous.key_values if pair is not None), None)
            for index, pair in enumerate(previous.key_values):
                attention_cache.update(*(pair or (present[0].new_zeros(present[0].shape),
                                                  present[1].new_zeros(present[1].shape))), index)
            past = previous.length
            if mask is not None or previous.mask is not None:
                full = hidden.new_ones(batch_size, hidden.shape[1], dtype=torch.long)
                attention_mask = torch.cat([full.new_ones(batch_size, past) if previous.mask is None else previous.mask,
                                            full if mask is None else mask], dim=1)
            else:
                attention_mask = None
        else:
            attention_mask, past = self._chunk_attention_mask(mask, cache, batch_size, hidden.shape[1], hidden.device)
        position_ids, masks, position_embeddings = self._chunk_geometry(hidden, attention_mask, attention_cache, past,
                                                                        geometry)
        if self._compiled_chunk_step is None or not starts_chunk:
            # decoding continues a chunk token by token: each length of the memory's unfinished update chunk would
            # compile a graph of its own, so those pieces run eagerly
            step = self._chunk_step
        else:  # what a compiled graph guards on: fresh contiguous tensors, whatever the stream's length
            step = functools.partial(self._compiled_chunk_step, self)
            fresh = lambda t: None if t is None else t.clone(memory_format=torch.contiguous_format)  # noqa: E731
            token_mask = fresh(token_mask)
            request = dataclasses.replace(request, shifted_labels=fresh(request.shifted_labels))
            if inputs.is_floating_point():  # a slice of the caller's embeddings (ids were embedded afresh)
                hidden = fresh(hidden)
        out = step(ChunkStepRequest(hidden=hidden, states=states, token_mask=token_mask, num_prefix=num_prefix,
                                    memory_enabled=memory_enabled, request=request, attention_cache=attention_cache,
                                    masks=masks, position_embeddings=position_embeddings, position_ids=position_ids))
        if previous is not None:
            first, stop = request.layers
            out.previous = PreviousChunk(
                [(layer.keys[:, :, past:], layer.values[:, :, past:]) if first <= index < (stop or index + 1) else None
                 for index, layer in enumerate(attention_cache.layers)],
                None if attention_mask is None else as_previous_chunk_mask(attention_mask[:, past:], num_prefix),
            )
        return out

    def _chunk_step(self, step: ChunkStepRequest) -> StreamOutput:
        """The arithmetic of one piece, once its embeddings and geometry are built (`ChunkStepRequest`): every decoder
        layer with its memory block, the final norm (`_through_layers`) and the LM head. Returns what `_forward_piece`
        describes but the previous chunk: the LM head's results, the hidden states asked for, the new memory states
        and the sum of the memories' writes. What `compile_chunks()` compiles (one graph, no breaks): nothing in it
        reads a tensor's value into Python."""
        layer_types = self.config.text_config.layer_types

        def layer_call(index: int, decoder_layer: nn.Module) -> Callable[[Tensor], Tensor]:
            return functools.partial(decoder_layer, attention_mask=step.masks[layer_types[index]],
                                     position_embeddings=step.position_embeddings, position_ids=step.position_ids,
                                     cache=step.attention_cache, use_cache=step.attention_cache is not None)

        hidden, out = self._through_layers(step.hidden, layer_call, step.states, step.token_mask, step.num_prefix,
                                           step.memory_enabled, step.request.hidden_states, step.request.layers)
        if step.request.lm_head is None:
            return out
        head = chunk_lm_head(step.request, hidden)
        return StreamOutput(logits=head.logits, loss_sum=head.loss_sum, predictions=head.predictions,
                            hidden_states=out.hidden_states, states=out.states, written=out.written)
