"""A pretrained Qwen2/Qwen3 causal LM that reads long inputs chunk by chunk, with a Titans neural memory carrying
information across chunks.

Attention reaches at most one chunk back (`attend_previous_chunk`, the default; without it, not across a chunk
boundary at all), and positions stay within two chunks, so the backbone runs on the lengths it was trained on
whatever the input length; the memory is the only path further back.

`TitansQwenModel` is the decoder: the base's own embeddings, decoder layers and final norm, under a plain Qwen's
names (`model.embed_tokens`, `model.layers.N`, `model.norm`), a memory block at each memory layer
(`model.memory.<layer>`, one `titans_hf.modeling.variants` block each) and, for mac, the persistent tokens
(`model.persistent_tokens`). `TitansQwenForCausalLM` adds the base's LM head (`lm_head`), which runs chunk by chunk
inside the decoder's loop. Beside this file: the cache (`cache_titans_qwen`), the two orders of the chunk loop
(`streams_titans_qwen`), building on a base, loading and saving (`loading_titans_qwen`), scoring completions
(`completions_titans_qwen`) and TRL's reference model (`memory_off_reference`).
"""

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache_titans_qwen import TitansCache, as_previous_chunk_mask
from .completions_titans_qwen import CompletionScoringMixin
from .configuration_titans_qwen import TitansQwenConfig
from .loading_titans_qwen import TitansLoadingMixin, is_memory_name
from .memory import MemoryState, NeuralMemory
from .memory_off_reference import TitansMemoryOffReference
from .streams_titans_qwen import (
    ChunkedLMHead,
    ChunkedLMHeadOutput,
    ChunkStreamsMixin,
    PreviousChunk,
    StreamOutput,
    StreamRequest,
    chunk_lm_head,
    sum_present,
)
from .variants import TitansMemoryBlock, memory_blocks, persistent_tokens

logger = logging.getLogger(__name__)

# what a padding-free (packed) batch carries instead of an attention mask: several documents in one row
PACKED_BATCH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def rotate_half(x: Tensor) -> Tensor:
    """The 90 degree turn of RoPE's pairs, as Qwen2 and Qwen3 pair the two halves of a head."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _restarts_inside_rows(position_ids: Tensor, attention_mask: Tensor | None) -> bool:
    """Whether positions fall back to an earlier value between two real tokens of a row (documents packed)."""
    real = torch.ones_like(position_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    restarts = (position_ids[:, 1:] <= position_ids[:, :-1]) & real[:, 1:] & real[:, :-1]
    return bool(restarts.any())


def cache_argument(cache: TitansCache | None, kwargs: dict[str, Any]) -> TitansCache | None:
    """The stream to continue: `cache`, or `past_key_values` (popped from `kwargs`), the name transformers gave the
    same argument before 5.24 and Qwen's own models still take; both at once is refused."""
    if "past_key_values" not in kwargs:
        return cache
    past_key_values = kwargs.pop("past_key_values")
    if cache is not None and past_key_values is not None and past_key_values is not cache:
        raise ValueError("forward: cache and past_key_values were both given; they are one argument (transformers "
                         "5.24 renamed past_key_values to cache): pass one of them")
    return cache if cache is not None else past_key_values


def refuse_output_attentions(output_attentions: bool | None, config: TitansQwenConfig) -> None:
    """Refuse `output_attentions=True` (by argument or, when not given, by the config), naming why."""
    if output_attentions if output_attentions is not None else config.output_attentions:
        raise ValueError("forward: output_attentions=True: TitansQwenForCausalLM attends chunk by chunk (each "
                         "chunk over itself, the previous chunk and the memory's prefix tokens; the memory carries "
                         "the rest), so it has no attention map over the input to return")


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


class TitansQwenPreTrainedModel(PreTrainedModel):
    config: TitansQwenConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # small, and trained with tiny steps: loaded in fp32 under a bf16 backbone (the model casts at the boundaries)
    _keep_in_fp32_modules_strict = ["memory", "persistent_tokens"]

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config.text_config, "initializer_range", 0.02)
        if isinstance(module, NeuralMemory):
            # its own init (negative gate biases keep the first updates stable) replaces the generic Linear init
            # applied to its children just before; never over weights that were loaded
            if not any(getattr(p, "_is_hf_initialized", False) for p in module.parameters()):
                module.reset_parameters()
        elif isinstance(module, TitansMemoryBlock):
            module.initialize(std)
        elif isinstance(module, TitansQwenModel) and hasattr(module, "persistent_tokens"):
            init.normal_(module.persistent_tokens, std=std)
        else:
            super()._init_weights(module)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint,
                                    every_n_layers: int = 1) -> None:
        """What `activation_checkpointing_enable` / `gradient_checkpointing_enable` (and a Trainer or TRL with
        `gradient_checkpointing=True`) turn on: each chunk is recomputed in backward as one unit, memory update
        included, the same recomputation as `memory_config.checkpoint_chunks`. The decoder layers' own checkpointing
        stays off: it drops the cache that carries the previous chunk's keys (attend_previous_chunk) and would
        replay its writes. The chunk unit is always checkpointed without re-entrance, whatever
        `gradient_checkpointing_func` and `every_n_layers` say."""
        for module in self.modules():
            if isinstance(module, TitansQwenModel):
                module.gradient_checkpointing = enable


class TitansQwenModel(ChunkStreamsMixin, TitansQwenPreTrainedModel):
    """The decoder of a TitansQwen: the base's embeddings, decoder layers and final norm, and at each layer of
    `memory_config.memory_layers` a memory block of the configured variant (`memory`), which runs around the decoder
    layer chunk after chunk; for mac, learned tokens in front of every chunk (`persistent_tokens`).

    Calling it streams the input through its chunks (see `forward`) and returns the last layer's hidden states,
    normed, as a Qwen model does; `TitansQwenForCausalLM` passes its LM head in, to run chunk by chunk. Its
    dtypes: see `TitansQwenForCausalLM`.
    """

    # graphs of the compiled chunk step a process may hold: torch's limit (8 per function) counts every model, mode
    # (training, evaluation, generate) and backend together, and fullgraph=True turns reaching it into an error
    COMPILED_CHUNK_GRAPHS = 64
    gradient_checkpointing = False  # set by (gradient|activation)_checkpointing_enable: checkpoint every chunk

    def __init__(self, config: TitansQwenConfig, decoder: PreTrainedModel | None = None):
        """`decoder`: the base's Qwen2Model / Qwen3Model, whose modules are used as they are (None: a new one from
        `config.text_config`)."""
        super().__init__(config)
        decoder = AutoModel.from_config(config.text_config) if decoder is None else decoder
        self.embed_tokens, self.layers, self.norm = decoder.embed_tokens, decoder.layers, decoder.norm
        self.rotary_emb = decoder.rotary_emb
        self.memory = memory_blocks(config)
        tokens = persistent_tokens(config)
        if tokens is not None:
            self.persistent_tokens = tokens
        self._memory_enabled = True
        self._layer_major_enabled = True
        self._warned_frozen_memory = False
        self._compiled_chunk_step = None  # set by compile_chunks()
        self._chunk_compiler: tuple[dict, Callable] | None = None  # (its options, the compiled step), kept when off
        self.post_init()
        # the base decoder's placement and parallel plans, over the modules it holds under the same names
        self._no_split_modules = set(decoder._no_split_modules or ())
        self._tp_plan, self._pp_plan = dict(decoder._tp_plan or {}), dict(decoder._pp_plan or {})

    # ---- switches of the run ----

    @contextlib.contextmanager
    def memory_disabled(self) -> Iterator["TitansQwenModel"]:
        """The ablation: the model runs as its frozen base does, chunk by chunk. Memory blocks are skipped (the
        same as zero reads, and cheaper), and nothing is put in front of the chunks."""
        previous = self._memory_enabled
        self._memory_enabled = False
        try:
            yield self
        finally:
            self._memory_enabled = previous

    @contextlib.contextmanager
    def chunk_by_chunk(self) -> Iterator["TitansQwenModel"]:
        """Always the chunk loop (`_stream`), never the layer-major order it would otherwise take where chunks
        attend only to themselves: the same results, with each memory called once per chunk (what hooks that
        record the memory's state after every chunk need)."""
        previous = self._layer_major_enabled
        self._layer_major_enabled = False
        try:
            yield self
        finally:
            self._layer_major_enabled = previous

    def compile_chunks(self, enable: bool = True, **compile_options: Any) -> "TitansQwenModel":
        """Run the chunk step under `torch.compile(fullgraph=True, **compile_options)` (e.g. `backend="inductor"`,
        `mode="max-autotune"`), or with `enable=False` eagerly again (enabled again with the same options, the graphs
        compiled so far serve); returns the model.

        The step is one chunk (or decoding piece) through every decoder layer with its memory block, the final norm
        and the LM head the causal LM passes (`_chunk_step`): one graph without breaks, compiled on the first chunk and reused by every
        chunk after it, in forward, backward, per-chunk checkpointing and generate's prefill. The chunk loop around
        it, the masks and positions (built once per shape), the embedding and the cache stay in Python. A stream
        compiles a few graphs whatever its length (the first chunk, which has no previous chunk to attend to, the
        chunks after it, and a last partial chunk); decoding's tokens that continue a chunk run eagerly (each length
        of the memory's unfinished update chunk would be a graph of its own). A process may hold up to
        `COMPILED_CHUNK_GRAPHS` graphs of the step (torch's own limit, 8 per function, would count every model, mode
        and backend together, and stop the ninth with an error). With compiled chunks the stream always
        runs chunk by chunk: the layer-major order would compile the memory's whole segment, every update chunk
        unrolled.

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

    @property
    def padding_multiple(self) -> int:
        """Left padding by a multiple of this many tokens (whole chunks, whole memory updates and batches) leaves a
        row's outputs exactly as they are without it: fully padded chunks attend nothing real and write nothing.
        Rows whose left padding differs by such multiples run as one batch; any other left padding works too, each
        residue as its own batch (`PhaseGroup`)."""
        memory = self.config.memory_config
        return math.lcm(memory.chunk_size, memory.memory_chunk_size,
                        memory.memory_batch_size or memory.memory_chunk_size)

    def init_memory_states(self, batch_size: int, device: torch.device | None = None) -> dict[int, MemoryState]:
        """A fresh state per memory layer for `batch_size` rows: what a stream starts from."""
        return {int(layer): block.neural_memory.init_state(batch_size, device) for layer, block in self.memory.items()}

    # ---- forward ----

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: TitansCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        memory_states: dict[int, MemoryState] | None = None,
        output_hidden_states: bool | None = None,
        lm_head: ChunkedLMHead | None = None,
        **kwargs: Any,
    ) -> TitansModelOutput:
        """Stream the input through its chunks, carrying the memory state.

        Each row's chunks start at its own first real token, so a row left-padded by any amount answers as it does
        alone (rows at different places of the chunk cycle run as separate batches: see `padding_multiple`); rows
        right-padded by whole multiples more than others stop at their own last multiple (the padding after it
        would write nothing). Hidden states and logits at padding positions mean nothing (zeros where a row's batch
        starts after them or has stopped).
        `output_attentions=True` (or the config's) is refused: the chunks' attention is no map over the input.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, tokens)`, *optional*, defaults to `None`):
                Token ids; exactly one of `input_ids` and `inputs_embeds` is given.
            attention_mask (`torch.Tensor` of shape `(batch_size, >= tokens)`, *optional*, defaults to `None`):
                1 on tokens, 0 on padding; its last `tokens` columns are this call's.
            position_ids (`torch.LongTensor`, *optional*, defaults to `None`):
                Only checked: positions restart at every chunk, and positions that restart inside a row (a packed,
                padding-free batch, whose documents would share one memory) are refused.
            cache (`TitansCache`, *optional*, defaults to `None`):
                A stream to continue; it is left after these tokens. Taken under its name before transformers 5.24,
                `past_key_values`, too. An input split over calls through one cache (`use_cache=True` on the first)
                gives what the input in one call gives, wherever the splits fall and whatever the attention: the
                cache holds the keys attention still sees (the previous chunk's with attend_previous_chunk) and the
                memory's state.
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, tokens, hidden)`, *optional*, defaults to `None`):
                The tokens' embeddings, in place of `input_ids`.
            use_cache (`bool`, *optional*, defaults to `None`):
                Start a new `TitansCache` when `cache` is None.
            memory_states (`dict[int, MemoryState]`, *optional*, defaults to `None`):
                A new input read with this memory: one state per memory layer for the batch's rows (e.g. another
                stream's end, detached) for the memory to start from instead of fresh states; the output's
                `memory_states` then holds the states the stream ends in. Only the memory carries over, attention
                starts afresh: this input's first chunk sees no previous chunk. So with chunk-local attention
                (attend_previous_chunk=False) an input split over calls this way reads as it does in one call, and
                with attend_previous_chunk=True it does not (its first chunk misses the previous chunk's keys): to
                continue a stream, pass `cache`. What TitansTrainer's State Passing does: a row starts from the
                memory another row ended with. Each state must be what this model's memories make for the batch's
                rows (shapes, dtypes, finite values; `NeuralMemory.state_problem`) at a chunk boundary. Not with a
                cache (which holds its own) or rows left-padded off the chunk cycle.
            output_hidden_states (`bool`, *optional*, defaults to `None`):
                Also return the embeddings and every layer's output over the whole input (the chunks' concatenated,
                the memory's contribution included; the last one normed); None: the config's.
            lm_head (`ChunkedLMHead`, *optional*, defaults to `None`):
                The LM head to run on each chunk (`TitansQwenForCausalLM`'s); its results are `lm_head_output`, and
                `last_hidden_state` is then kept only with `output_hidden_states`.

        Returns:
            `TitansModelOutput`: `last_hidden_state` [batch, tokens, hidden] of the chunk loop over the whole input,
            the memory included (inside `memory_disabled()`, the base's chunk by chunk), normed; `cache`;
            `hidden_states` when asked for; `memory_states`; `lm_head_output`; `write_rate`.
        """
        refuse_output_attentions(kwargs.get("output_attentions"), self.config)
        cache = cache_argument(cache, kwargs)
        packed = [key for key in PACKED_BATCH_KWARGS if kwargs.get(key) is not None]
        if packed or (position_ids is not None and _restarts_inside_rows(position_ids, attention_mask)):
            raise ValueError("TitansQwenForCausalLM reads each row as one stream through its memory: packed / "
                             f"padding-free batches (position_ids restarting inside a row{', ' if packed else ''}"
                             f"{', '.join(packed)}) are not supported; use padding (e.g. TRL's padding_free=False, "
                             "packing=False)")
        if self.training and torch.is_grad_enabled() and self._memory_enabled and not self._warned_frozen_memory:
            self._warn_if_memory_frozen()
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("forward: pass exactly one of input_ids and inputs_embeds")
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        hidden_size = self.config.text_config.hidden_size
        if input_ids is not None:
            self._check_input_ids(input_ids)
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0
                                          or inputs_embeds.shape[2] != hidden_size
                                          or not inputs_embeds.is_floating_point()):
            raise ValueError(f"forward: inputs_embeds must be a [batch, tokens >= 1, {hidden_size}] float tensor, got "
                             f"{inputs_embeds.dtype} {tuple(inputs_embeds.shape)}")
        batch_size, length = inputs.shape[:2]
        if cache is not None and not isinstance(cache, TitansCache):
            raise ValueError(f"forward: cache must be a TitansCache, got {type(cache).__name__}")
        if memory_states is not None:
            self._check_memory_states(memory_states, batch_size, cache is not None or bool(use_cache))
            memory_states = dict(memory_states)
        if cache is None and use_cache:
            cache = TitansCache(self.config)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if not isinstance(output_hidden_states, bool):
            raise ValueError(f"forward: output_hidden_states must be true or false, got {output_hidden_states!r}")
        token_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] < length:
                raise ValueError(f"forward: attention_mask must be [batch, >= {length}] (2D, 1 = token, 0 = padding), "
                                 f"got {tuple(attention_mask.shape)}")
            token_mask = attention_mask[:, -length:].to(inputs.device)
            if bool(token_mask.all()):
                token_mask = None  # the common case: skip every masking path

        hidden_mode = "all" if output_hidden_states else "last" if lm_head is None else None
        request = (StreamRequest(hidden_states=hidden_mode) if lm_head is None
                   else lm_head.request(token_mask, (batch_size, length), inputs.device, hidden_mode))
        seen = cache.seen_tokens if cache is not None else 0
        groups = cache.phase_groups if seen else self._phase_groups(token_mask, cache)
        if groups is not None and memory_states is not None:
            raise ValueError("forward: memory_states need rows that start together (right padding, or left padding "
                             f"by whole multiples of padding_multiple = {self.padding_multiple})")
        ends = None if groups is not None or cache is not None else self._row_ends(token_mask, length, memory_states)
        if ends is not None:
            stream = self._stream_row_ends(ends, inputs, token_mask, memory_states, request)
        elif groups is None:
            stream = self._stream(inputs, token_mask, cache, memory_states, request)
        else:
            stream = self._stream_groups(groups, inputs, token_mask, seen, request)
            if cache is not None:
                cache.seen_tokens = seen + length

        hidden_states, last_hidden_state = stream.hidden_states, None
        if hidden_mode == "last":
            (last_hidden_state,), hidden_states = hidden_states, None
        elif hidden_mode == "all":
            last_hidden_state = hidden_states[-1]
        write_rate = None
        if stream.written is not None:  # theta summed over rows, tokens and heads, per memory layer
            tokens = batch_size * length if token_mask is None else token_mask.sum().clamp(min=1)
            write_rate = stream.written / (tokens * self.config.memory_config.memory_num_heads * len(self.memory))
        head_output = None
        if lm_head is not None:
            labelled = None if request.shifted_labels is None else (request.shifted_labels != -100).sum()
            head_output = ChunkedLMHeadOutput(logits=stream.logits, loss_sum=stream.loss_sum, num_labels=labelled,
                                              predictions=stream.predictions)
        return TitansModelOutput(last_hidden_state=last_hidden_state, cache=cache, hidden_states=hidden_states,
                                 memory_states=None if memory_states is None else stream.states,
                                 lm_head_output=head_output, write_rate=write_rate)

    def _check_input_ids(self, input_ids: Tensor | None) -> None:
        """Refuse, naming what is wrong, input_ids that are not a [batch, tokens >= 1] tensor of integer ids below
        the vocabulary size (torch would say "index out of range in self", or assert on the device)."""
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError("forward: input_ids must be a [batch, tokens >= 1] LongTensor")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"forward: input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
        vocab_size = self.config.text_config.vocab_size
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"forward: input_ids hold the id {low if low < 0 else high}, outside the vocabulary of "
                             f"{vocab_size} tokens (ids 0..{vocab_size - 1}): they come from another tokenizer")

    def _check_memory_states(self, memory_states: Any, batch_size: int, cached: bool) -> None:
        """Refuse given memory states that cannot start this stream, in one line naming the layer, the field and
        what was expected: a dict {memory layer: MemoryState} whose states are what this model's memories make
        for `batch_size` rows (`NeuralMemory.state_problem`: shapes, dtypes, finite values), at a chunk boundary."""
        if cached:
            raise ValueError("forward: memory_states start a stream without a cache; a cache holds its own states")
        layers = sorted(int(layer) for layer in self.memory)
        if not isinstance(memory_states, dict) or set(memory_states) != set(layers):
            got = (f"a dict with keys {sorted(memory_states, key=repr)}" if isinstance(memory_states, dict)
                   else f"a {type(memory_states).__name__}")
            raise ValueError(f"forward: memory_states must be a dict with one MemoryState per memory layer {layers} "
                             f"(e.g. an output's memory_states, or init_memory_states(batch_size)), got {got}")
        chunk_size = self.config.memory_config.chunk_size
        for layer in layers:
            state, where = memory_states[layer], f"memory_states[{layer}]"
            if not isinstance(state, MemoryState):
                hint = " (MemoryState.from_state_dict makes one of a state_dict)" if isinstance(state, dict) else ""
                raise ValueError(f"forward: {where} must be a MemoryState, got a {type(state).__name__}{hint}")
            tail = state.conv_tail
            if isinstance(tail, Tensor) and tail.dim() == 3 and tail.shape[0] != batch_size:
                raise ValueError(f"forward: memory_states must hold {batch_size} rows each (one per input row); "
                                 f"{where} holds {tail.shape[0]}")
            problem = self.memory[str(layer)].neural_memory.state_problem(state, batch_size)
            if problem is not None:
                raise ValueError(f"forward: {where}.{problem}")
            if state.position % chunk_size:
                raise ValueError(f"forward: {where}.position is {state.position}: memory_states must be at a chunk "
                                 f"boundary (a multiple of chunk_size {chunk_size})")

    def _warn_if_memory_frozen(self) -> None:
        """Say once, in a training forward, that nothing trains the memory: every one of its weights is frozen, as
        `peft.get_peft_model` leaves them (a Trainer would then save a memory at its initial weights)."""
        weights = list(self.memory.parameters())
        if weights and not any(weight.requires_grad for weight in weights):
            self._warned_frozen_memory = True
            logger.warning("TitansQwenForCausalLM trains with every memory weight frozen (requires_grad=False): "
                           "the memory keeps its initial weights. peft.get_peft_model freezes it; put a LoRA on the "
                           "model with titans_hf.lora.add_lora(model, LoraConfig(...)) to train both")

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

    def _forward_piece(
        self,
        inputs: Tensor,
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        states: dict[int, MemoryState],
        cache: TitansCache | None,
        starts_chunk: bool,
        keep_from: int,
        enabled: bool,
        lm_head: nn.Module | None,
        predict: bool = False,
        previous: PreviousChunk | None = None,
        hidden_states: str | None = None,
        geometry: dict | None = None,
    ) -> StreamOutput:
        """Run tokens (ids [B, T], or embeddings [B, T, hidden]) that lie inside one chunk through the base's own
        layers, each memory block around its layer, then `lm_head` (if any: logits of positions >= keep_from,
        summed loss over the labelled ones, with `predict` the greedy token and loss of each). Returns them, the new
        memory states, without a cache but with `previous` (attend_previous_chunk) this chunk's keys, values and mask
        for the next chunk, and the `hidden_states` asked for. `geometry` keeps the masks and positions built for one
        shape for the next chunks of the stream (see `_chunk_geometry`). Kept separate so it can be checkpointed as
        one unit, so every input is an argument (`enabled` too: the recomputation in backward may run after
        `memory_disabled()` has exited) and no cache is changed in it but the decoding one."""
        batch_size, length = inputs.shape[:2]
        hidden = inputs if inputs.is_floating_point() else self.embed_tokens(inputs)
        prefix = self._chunk_prefix(states, batch_size) if starts_chunk and enabled else None
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
            for index, (keys, values) in enumerate(previous.key_values):
                attention_cache.update(keys, values, index)
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
            token_mask, shifted_labels = fresh(token_mask), fresh(shifted_labels)
            if inputs.is_floating_point():  # a slice of the caller's embeddings (ids were embedded afresh)
                hidden = fresh(hidden)
        logits, loss_sum, predictions, new_states, all_hidden, written = step(
            hidden, states, token_mask, shifted_labels, num_prefix, keep_from, enabled, lm_head, predict,
            hidden_states, attention_cache, masks, position_embeddings, position_ids)
        current = None
        if previous is not None:
            current = PreviousChunk(
                [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in attention_cache.layers],
                None if attention_mask is None else as_previous_chunk_mask(attention_mask[:, past:], num_prefix),
            )
        return StreamOutput(logits=logits, loss_sum=loss_sum, predictions=predictions, hidden_states=all_hidden,
                            states=new_states, previous=current, written=written)

    def _chunk_step(
        self,
        hidden: Tensor,
        states: dict[int, MemoryState],
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        num_prefix: int,
        keep_from: int,
        enabled: bool,
        lm_head: nn.Module | None,
        predict: bool,
        hidden_states: str | None,
        attention_cache: DynamicCache | None,
        masks: dict,
        position_embeddings: tuple[Tensor, Tensor],
        position_ids: Tensor,
    ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None, dict[int, MemoryState],
               tuple[Tensor, ...] | None, Tensor | None]:
        """The arithmetic of one piece, once its embeddings [B, prefix + T, hidden] and geometry are built: every
        decoder layer with its memory block, the final norm and the LM head. Returns (logits, summed loss, per-token
        predictions and losses, new memory states, hidden states) as `_forward_piece` describes them, and the sum of
        the memories' writes (`MemoryState.written`; None with the memory off). What `compile_chunks()` compiles
        (one graph, no breaks): nothing in it reads a tensor's value into Python."""
        new_states, written = dict(states), []
        layer_types = self.config.text_config.layer_types
        all_hidden = [hidden[:, num_prefix:]] if hidden_states == "all" else None
        for index, decoder_layer in enumerate(self.layers):
            layer = functools.partial(decoder_layer, attention_mask=masks[layer_types[index]],
                                      position_embeddings=position_embeddings, position_ids=position_ids,
                                      cache=attention_cache, use_cache=attention_cache is not None)
            block = self.memory[str(index)] if enabled and str(index) in self.memory else None
            if block is None:
                hidden = layer(hidden)
            else:
                hidden, new_states[index] = block(layer, hidden, states[index], token_mask, num_prefix)
                written.append(new_states[index].written)
            if all_hidden is not None:
                all_hidden.append(hidden[:, num_prefix:])
        hidden = self.norm(hidden[:, num_prefix:])
        if all_hidden is not None:
            all_hidden[-1] = hidden
        logits = loss_sum = predictions = None
        if lm_head is not None:
            logits, loss_sum, predictions = chunk_lm_head(lm_head, hidden, shifted_labels, keep_from, predict)
        last_hidden = (hidden,) if hidden_states == "last" else None
        return (logits, loss_sum, predictions, new_states, last_hidden if all_hidden is None else tuple(all_hidden),
                sum_present(written))


class TitansQwenForCausalLM(CompletionScoringMixin, TitansLoadingMixin, TitansQwenPreTrainedModel, GenerationMixin):
    """Qwen + Titans memory: the decoder with its memory (`model`, a `TitansQwenModel`) and the base's LM head
    (`lm_head`), run chunk by chunk.

    Build one on a pretrained base with `from_base(...)`; load a trained memory with `from_pretrained(<memory
    folder or Hub id>)` or `from_base_and_memory(base, memory)` (see `titans_hf.modeling.loading_titans_qwen`).

    The memory stays in float32 under a half-precision base when the model is built or loaded in that dtype:
    `from_base(dtype=torch.bfloat16)` builds it in float32 beside the base it loads, and `from_pretrained(...,
    dtype=...)` keeps it there (`_keep_in_fp32_modules_strict`); its small, slowly accumulating steps would vanish in
    half precision. `.to(dtype)`, `.half()`, `.bfloat16()` cast every parameter, the memory's too, as on any module.
    The memory's state is float32 in any case.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_stateful = True  # the memory cannot roll back, so assisted decoding is refused

    def __init__(self, config: TitansQwenConfig, backbone: PreTrainedModel | None = None):
        """`backbone`: the base's Qwen2ForCausalLM / Qwen3ForCausalLM, whose modules are used as they are and keep
        their weights (None: new ones from `config.text_config`)."""
        super().__init__(config)
        if backbone is not None:  # loaded weights are final: post_init must not re-initialise them
            for tensor in backbone.state_dict(keep_vars=True).values():
                tensor._is_hf_initialized = True
            for module in backbone.modules():
                module._is_hf_initialized = True
        self.model = TitansQwenModel(config, decoder=None if backbone is None else backbone.model)
        text = config.text_config
        self.lm_head = backbone.lm_head if backbone is not None else nn.Linear(text.hidden_size, text.vocab_size,
                                                                               bias=False)
        self.post_init()
        self._apply_freeze_base()

    def _apply_freeze_base(self) -> None:
        if self.config.memory_config.freeze_base:
            for name, param in self.named_parameters():
                if not is_memory_name(name):
                    param.requires_grad_(False)

    @property
    def memory(self) -> nn.ModuleDict:
        """The memory blocks by layer index (the decoder's `memory`)."""
        return self.model.memory

    @property
    def padding_multiple(self) -> int:
        """See `TitansQwenModel.padding_multiple`."""
        return self.model.padding_multiple

    def init_memory_states(self, batch_size: int, device: torch.device | None = None) -> dict[int, MemoryState]:
        """A fresh state per memory layer for `batch_size` rows: what a stream starts from."""
        return self.model.init_memory_states(batch_size, device)

    def memory_disabled(self) -> contextlib.AbstractContextManager:
        """The ablation, as a context: the model runs as its frozen base does, chunk by chunk (see
        `TitansQwenModel.memory_disabled`)."""
        return self.model.memory_disabled()

    def chunk_by_chunk(self) -> contextlib.AbstractContextManager:
        """Always the chunk loop, never the layer-major order (see `TitansQwenModel.chunk_by_chunk`)."""
        return self.model.chunk_by_chunk()

    def compile_chunks(self, enable: bool = True, **compile_options: Any) -> "TitansQwenForCausalLM":
        """Run the chunk step, LM head included, under `torch.compile(fullgraph=True, **compile_options)`, or eagerly
        again with `enable=False`; returns the model (see `TitansQwenModel.compile_chunks`)."""
        self.model.compile_chunks(enable, **compile_options)
        return self

    def memory_off_reference(self) -> TitansMemoryOffReference:
        """This model with its memory switched off (the frozen base, chunk by chunk), on the same weights: pass it
        as TRL's `ref_model` to DPO / GRPO so that no second model loads."""
        return TitansMemoryOffReference(self)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: TitansCache | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | Tensor | None = None,
        logits_to_keep: int = 0,
        return_predictions: bool = False,
        return_token_losses: bool = False,
        inputs_embeds: torch.FloatTensor | None = None,
        output_hidden_states: bool | None = None,
        memory_states: dict[int, MemoryState] | None = None,
        completion_ids: torch.LongTensor | None = None,
        completion_mask: Tensor | None = None,
        write_cost: float | None = None,
        **kwargs: Any,
    ) -> TitansCausalLMOutput:
        """Stream the input through the chunks (see `TitansQwenModel.forward`), the LM head chunk by chunk. Logits and
        hidden states at padding positions mean nothing, and padding positions predict no label.
        `position_ids` from callers are ignored: positions restart at every chunk.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, tokens)`, *optional*, defaults to `None`):
                Token ids; exactly one of `input_ids` and `inputs_embeds` is given.
            attention_mask (`torch.Tensor` of shape `(batch_size, >= tokens)`, *optional*, defaults to `None`):
                1 on tokens, 0 on padding (left padding by any amount: each row answers as it does alone).
            labels (`torch.LongTensor` of shape `(batch_size, tokens)`, *optional*, defaults to `None`):
                Not shifted: position t predicts labels[t + 1], across chunk boundaries too; -100 labels nothing.
            cache (`TitansCache`, *optional*, defaults to `None`):
                A stream to continue (what `generate` passes; `past_key_values`, its name before transformers 5.24,
                is taken too): an input split over calls through one cache gives what it gives in one call.
            use_cache (`bool`, *optional*, defaults to `None`):
                Start a new `TitansCache` when `cache` is None.
            num_items_in_batch (`int` or `torch.Tensor`, *optional*, defaults to `None`):
                The loss is the labelled positions' summed loss divided by it (gradient accumulation); None: their
                mean. In training the write cost is then weighted by this batch's share of them, so that the
                accumulated batches add up to one cost, as they add up to one mean loss.
            logits_to_keep (`int`, *optional*, defaults to `0`):
                Return the logits of the last this many positions; 0: all of them without labels, none with labels
                (a 32k x vocab tensor is what chunking avoids).
            return_predictions (`bool`, *optional*, defaults to `False`):
                Return the greedy prediction of every labelled token (`label_predictions[b, t]` predicts
                `labels[b, t]`, -100 where unlabelled): what `TitansTrainer` hands to `compute_metrics` (the name
                avoids "label": the Trainer takes such arguments for label columns).
            return_token_losses (`bool`, *optional*, defaults to `False`):
                Return the cross-entropy of every labelled token (`token_losses[b, t]` of predicting `labels[b, t]`,
                0 where unlabelled): what the per-chunk language-model evaluation sums.
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, tokens, hidden)`, *optional*, defaults to `None`):
                The tokens' embeddings, in place of `input_ids`.
            output_hidden_states (`bool`, *optional*, defaults to `None`):
                Return the embeddings and every layer's output over the whole input, as `TitansQwenModel` does.
            memory_states (`dict[int, MemoryState]`, *optional*, defaults to `None`):
                States for the memory to start this input from; the output's `memory_states` are those it ends in.
                A new input read with a given memory, not the continuation of a stream where attention reaches the
                previous chunk (that is `cache`; see `TitansQwenModel.forward`).
            completion_ids (`torch.LongTensor` of shape `(batch_size, group, tokens)`, *optional*, defaults to `None`):
                Score these completions of the prompts `input_ids` / `attention_mask`: the output holds only
                `completion_log_probs` [batch, group, tokens] (see `completion_log_probs`). The entry through which a
                DDP or FSDP wrapper sees that call; nothing else may be given with it.
            completion_mask (`torch.Tensor` of shape `(batch_size, group, tokens)`, *optional*, defaults to `None`):
                1 on the completions' tokens, 0 on their right padding.
            write_cost (`float`, *optional*, defaults to `None`):
                The write cost's weight for this call, in place of `memory_config.write_cost` (`TitansTrainer` passes
                the weight its schedule reaches at each step, see `TitansTrainingArguments.write_cost_growth`).

        Returns:
            `TitansCausalLMOutput`. In training mode, with labels, `loss` also holds the write cost, `write_cost`
            (default: `memory_config`'s) times `write_rate`: a price on every write, so training opens the write gate
            only where the loss gains from it and the tokens between facts write little over them (docs/length.md).
        """
        refuse_output_attentions(kwargs.get("output_attentions"), self.config)
        cache = cache_argument(cache, kwargs)
        if write_cost is not None and not write_cost >= 0:
            raise ValueError(f"forward: write_cost={write_cost!r} must be >= 0 (a weight on the loss)")
        if completion_ids is not None:
            given = [name for name, value in (("labels", labels), ("cache", cache), ("use_cache", use_cache or None),
                                              ("inputs_embeds", inputs_embeds)) if value is not None]
            if given:
                raise ValueError(f"forward: completion_ids score completions of input_ids from a fresh stream; "
                                 f"{', '.join(given)} cannot be given with them")
            return TitansCausalLMOutput(completion_log_probs=self._score_completions(
                input_ids, attention_mask, completion_ids, completion_mask))
        lm_head = ChunkedLMHead(self.lm_head, labels, logits_to_keep, predict=return_predictions or return_token_losses)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, memory_states=memory_states,
                             output_hidden_states=output_hidden_states,
                             output_attentions=kwargs.get("output_attentions"), lm_head=lm_head)
        head = outputs.lm_head_output
        loss = None
        if head.loss_sum is not None:
            if num_items_in_batch is not None:
                if isinstance(num_items_in_batch, Tensor):
                    num_items_in_batch = num_items_in_batch.to(head.loss_sum.device)
                loss = head.loss_sum / num_items_in_batch
            else:
                loss = head.loss_sum / head.num_labels.clamp(min=1)
            if write_cost is None:
                write_cost = self.config.memory_config.write_cost
            if self.training and write_cost and outputs.write_rate is not None:
                share = 1 if num_items_in_batch is None else head.num_labels / num_items_in_batch
                loss = loss + write_cost * share * outputs.write_rate.to(loss.dtype)
        label_predictions = token_losses = None
        if head.predictions is not None:  # position t - 1 predicts labels[t]
            greedy, losses = head.predictions
            labels = labels.to(greedy.device)
            labelled = labels[:, 1:] != -100
            if return_predictions:
                label_predictions = torch.full_like(labels, -100)
                label_predictions[:, 1:] = torch.where(labelled, greedy[:, :-1], -100)
            if return_token_losses:
                token_losses = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
                token_losses[:, 1:] = losses[:, :-1]
        return TitansCausalLMOutput(loss=loss, logits=head.logits, cache=outputs.cache,
                                    hidden_states=outputs.hidden_states, label_predictions=label_predictions,
                                    token_losses=token_losses, memory_states=outputs.memory_states,
                                    write_rate=outputs.write_rate)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                                      max_cache_length: int) -> None:
        """Always a TitansCache: the default DynamicCache would hold the whole prompt and no memory."""
        user_cache = model_kwargs.get("cache")
        if user_cache is not None:
            if not isinstance(user_cache, TitansCache):
                raise ValueError(f"generate: cache must be a TitansCache, got {type(user_cache).__name__}")
            user_cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        model_kwargs["cache"] = TitansCache(self.config)


__all__ = [
    "TitansCausalLMOutput",
    "TitansModelOutput",
    "TitansQwenForCausalLM",
    "TitansQwenModel",
    "TitansQwenPreTrainedModel",
]
