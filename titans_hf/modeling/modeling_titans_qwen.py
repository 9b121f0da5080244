"""A pretrained Qwen2/Qwen3 causal LM that reads long inputs chunk by chunk, with a Titans neural memory carrying
information across chunks.

Attention reaches at most one chunk back (`attend_previous_chunk`, the default; without it, not across a chunk
boundary at all), and positions stay within two chunks, so the backbone runs on the lengths it was trained on
whatever the input length; the memory is the only path further back.

`TitansQwenModel` is the decoder: the base's own embeddings, decoder layers and final norm, under a plain Qwen's
names (`model.embed_tokens`, `model.layers.N`, `model.norm`), a memory block at each memory layer
(`model.memory.<layer>`, one `titans_hf.modeling.variants` block each) and, for mac, the persistent tokens
(`model.persistent_tokens`). Its forward streams the input through the chunks in one of two orders, which compute the
same thing:

- chunk by chunk (`_stream`): every layer of a chunk, then the next chunk. What a cache, the previous chunk's keys
  (attend_previous_chunk), prefix tokens (mac) and per-chunk checkpointing need;
- layer by layer (`_stream_layer_major`), where chunks attend only to themselves: each decoder layer once over all
  chunks of a segment as one batch, each memory once over the segment's tokens in order; far fewer and larger calls
  when chunks are small.

Rows of a batch that start at different places of the chunk cycle (left padding) run as separate streams, one per
`PhaseGroup` (`_stream_groups`); right-padded rows that end chunks apart run each only as far as its own last chunk,
one stream per end (`_stream_row_ends`).

`TitansQwenForCausalLM` adds the base's LM head (`lm_head`), which runs chunk by chunk inside the decoder's loop; it
scores several completions of a prompt from one memory state (DPO, GRPO), and is built on a base, loaded and saved
the way PEFT's adapters are: `from_base` puts a new memory on a base; `from_pretrained` on a memory folder or Hub
repository loads the base its `memory_config.json` names and puts the memory on it (`from_base_and_memory`);
`save_pretrained` and `push_to_hub` of a model with a frozen base write the memory alone (see
`titans_hf.modeling.memory_folder`), `save_full_model=True` the whole model as any `PreTrainedModel`. The memory's
parameters sit in the decoder (`model.memory.<layer>.*`, `model.persistent_tokens`); its files store them without the
decoder's `model.` in front (`memory.<layer>.*`, `persistent_tokens`): a memory folder through `memory_state_dict` /
`load_memory_state_dict`, a full model's `model.safetensors` through transformers' key renaming
(`FULL_MODEL_KEY_RENAMING`, undone on save), so folders keep one format.

Below this file: the cache (`cache_titans_qwen`), the outputs and the values the chunk loop passes around
(`outputs_titans_qwen`), the memory folder's files (`memory_folder`) and TRL's reference model
(`memory_off_reference`).
"""

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .cache_titans_qwen import PhaseGroup, PreviousChunk, TitansCache, as_previous_chunk_mask
from .configuration_titans_qwen import TitansMemoryConfig, TitansQwenConfig
from .memory import MemoryState, NeuralMemory
from .memory_folder import (
    ADAPTER_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    base_fingerprint,
    check_safetensors_folder,
    file_key,
    hub_file,
    is_hub_id,
    is_memory,
    is_memory_name,
    load_memory_weights,
    optional_hub_file,
    read_safetensors_header,
    recorded_base,
    save_memory_folder,
)
from .memory_off_reference import TitansMemoryOffReference
from .outputs_titans_qwen import (
    ChunkedLMHead,
    ChunkedLMHeadOutput,
    ChunkStepRequest,
    StreamOutput,
    StreamRequest,
    TitansCausalLMOutput,
    TitansModelOutput,
    sum_present,
)
from .variants import TitansMemoryBlock, memory_blocks, persistent_tokens

logger = logging.getLogger(__name__)

# what a padding-free (packed) batch carries instead of an attention mask: several documents in one row
PACKED_BATCH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# The file keys of the base's weights; the rest of a full model's file is the memory's.
BASE_PREFIXES = ("model.", "lm_head.")
# What the Hub download of a memory takes; everything else goes to the base's from_pretrained.
HUB_KWARGS = ("token", "cache_dir", "local_files_only")
# What the Auto classes and pipelines add to a model's from_pretrained; a memory's base never sees them.
AUTO_KWARGS = ("_from_auto", "_from_pipeline", "adapter_kwargs", "trust_remote_code")
# A full model's file keys of the memory -> its parameter names (and back on save).
FULL_MODEL_KEY_RENAMING = [WeightRenaming(r"^memory\.", "model.memory."),
                           WeightRenaming(r"^persistent_tokens", "model.persistent_tokens")]
register_checkpoint_conversion_mapping("TitansQwenForCausalLM", FULL_MODEL_KEY_RENAMING, overwrite=True)


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


def _refuse_adapted_base(base: Any) -> None:
    """A base wrapped or adapted by PEFT would keep its adapter frozen under the memory and out of every save:
    refuse it, naming the route that trains a LoRA with the memory."""
    holds_adapters = bool(getattr(base, "peft_config", None))
    if holds_adapters or not isinstance(base, (str, os.PathLike, PreTrainedModel)):
        raise ValueError(f"from_base: the base is a {type(base).__name__}{' holding PEFT adapters' * holds_adapters}; "
                         "pass the plain base (a Hub id, a folder or a loaded Qwen) and put the LoRA on the "
                         "TitansQwen: titans_hf.lora.add_lora(TitansQwenForCausalLM.from_base(base, ...), "
                         "LoraConfig(...)) trains the LoRA with the memory and saves both")


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


class TitansQwenModel(TitansQwenPreTrainedModel):
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
    # tokens the layer-major stream runs through each layer at once (`_stream_layer_major`)
    LAYER_MAJOR_TOKENS = 8192
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
        and the LM head the causal LM passes (`_chunk_step`, given a `ChunkStepRequest`): one graph without breaks,
        compiled on the first chunk and reused by every chunk after it, in forward, backward, per-chunk checkpointing
        and generate's prefill. The chunk loop around it, the masks and positions (built once per shape), the
        embedding and the cache stay in Python. A stream compiles a few graphs whatever its length (the first chunk,
        which has no previous chunk to attend to, the chunks after it, and a last partial chunk); decoding's tokens
        that continue a chunk run eagerly (each length of the memory's unfinished update chunk would be a graph of its
        own). A process may hold up to `COMPILED_CHUNK_GRAPHS` graphs of the step (torch's own limit, 8 per function,
        would count every model, mode and backend together, and stop the ninth with an error). With compiled chunks
        the stream always runs chunk by chunk: the layer-major order would compile the memory's whole segment, every
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
            piece = (inputs[:, start:end], None if token_mask is None else token_mask[:, start:end], states, cache,
                     starts_chunk, self._memory_enabled, request.for_piece(start, end), previous, geometry)
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
            token_mask = fresh(token_mask)
            request = dataclasses.replace(request, shifted_labels=fresh(request.shifted_labels))
            if inputs.is_floating_point():  # a slice of the caller's embeddings (ids were embedded afresh)
                hidden = fresh(hidden)
        out = step(ChunkStepRequest(hidden=hidden, states=states, token_mask=token_mask, num_prefix=num_prefix,
                                    memory_enabled=memory_enabled, request=request, attention_cache=attention_cache,
                                    masks=masks, position_embeddings=position_embeddings, position_ids=position_ids))
        if previous is not None:
            out.previous = PreviousChunk(
                [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in attention_cache.layers],
                None if attention_mask is None else as_previous_chunk_mask(attention_mask[:, past:], num_prefix),
            )
        return out

    def _chunk_step(self, step: ChunkStepRequest) -> StreamOutput:
        """The arithmetic of one piece, once its embeddings and geometry are built (`ChunkStepRequest`): every decoder
        layer with its memory block, the final norm and the LM head. Returns what `_forward_piece` describes but the
        previous chunk: the LM head's results, the hidden states asked for, the new memory states and the sum of the
        memories' writes (`MemoryState.written`; None with the memory off). What `compile_chunks()` compiles (one
        graph, no breaks): nothing in it reads a tensor's value into Python."""
        request, num_prefix, hidden = step.request, step.num_prefix, step.hidden
        new_states, written = dict(step.states), []
        layer_types = self.config.text_config.layer_types
        all_hidden = [hidden[:, num_prefix:]] if request.hidden_states == "all" else None
        for index, decoder_layer in enumerate(self.layers):
            layer = functools.partial(decoder_layer, attention_mask=step.masks[layer_types[index]],
                                      position_embeddings=step.position_embeddings, position_ids=step.position_ids,
                                      cache=step.attention_cache, use_cache=step.attention_cache is not None)
            block = self.memory[str(index)] if step.memory_enabled and str(index) in self.memory else None
            if block is None:
                hidden = layer(hidden)
            else:
                hidden, new_states[index] = block(layer, hidden, step.states[index], step.token_mask, num_prefix)
                written.append(new_states[index].written)
            if all_hidden is not None:
                all_hidden.append(hidden[:, num_prefix:])
        hidden = self.norm(hidden[:, num_prefix:])
        if all_hidden is not None:
            all_hidden[-1] = hidden
        logits = loss_sum = predictions = None
        if request.lm_head is not None:
            logits, loss_sum, predictions = chunk_lm_head(request.lm_head, hidden, request.shifted_labels,
                                                          request.keep_start, request.predict)
        hidden_states = (hidden,) if request.hidden_states == "last" else None
        return StreamOutput(logits=logits, loss_sum=loss_sum, predictions=predictions,
                            hidden_states=hidden_states if all_hidden is None else tuple(all_hidden),
                            states=new_states, written=sum_present(written))


class TitansQwenForCausalLM(TitansQwenPreTrainedModel, GenerationMixin):
    """Qwen + Titans memory: the decoder with its memory (`model`, a `TitansQwenModel`) and the base's LM head
    (`lm_head`), run chunk by chunk.

    Build one on a pretrained base with `from_base(...)`; load a trained memory with `from_pretrained(<memory
    folder or Hub id>)` or `from_base_and_memory(base, memory)` (see the module docstring).

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

    # ---- completions: several of each prompt scored with the prompt read once (DPO, GRPO) ----

    def completion_log_probs(self, prompt_ids: torch.LongTensor, completion_ids: torch.LongTensor,
                             prompt_attention_mask: Tensor | None = None,
                             completion_mask: Tensor | None = None) -> Tensor:
        """Log-probability of every token of several completions of each prompt, the prompt read once: the
        prompt [batch, prompt tokens] (left padding allowed) streams through the chunks and the memory into a
        cache, which is then repeated for the completions [batch, group, tokens] (right-padded; `completion_mask`
        1 on their tokens), all of which continue from that one memory state. Returns [batch, group, tokens],
        0 where the mask is 0; differentiable, through the prompt's memory updates too (under checkpointing the
        prompt's chunks but its last are recomputed in backward, row by row). What DPO (a group of 2) and GRPO
        score; equal to the log-probabilities of each completion read after its prompt as one row.

        It calls the model (`forward` with `completion_ids`), so that the hooks of a DDP or FSDP wrapper run: through
        a wrapper, call the wrapper the same way (`wrapper(input_ids=prompt_ids, attention_mask=...,
        completion_ids=..., completion_mask=...).completion_log_probs`)."""
        return self(input_ids=prompt_ids, attention_mask=prompt_attention_mask, completion_ids=completion_ids,
                    completion_mask=completion_mask).completion_log_probs

    def _score_completions(self, prompt_ids: torch.LongTensor, prompt_attention_mask: Tensor | None,
                           completion_ids: torch.LongTensor, completion_mask: Tensor | None) -> Tensor:
        """`completion_log_probs`' work: the prompt into a cache, then every completion from it. Under checkpointing
        (a training call with `checkpoint_chunks` or gradient checkpointing) each row goes alone, its prompt up to its
        last chunk as a cache-less stream whose chunks are recomputed in backward (`_prompt_cache`), so a long prompt
        holds one chunk's activations, not all of them."""
        if prompt_ids is None or prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
            raise ValueError(f"completion_log_probs: prompt_ids must be [batch, tokens >= 1], got "
                             f"{None if prompt_ids is None else tuple(prompt_ids.shape)}: the first completion "
                             "token is predicted from the prompt")
        if completion_ids.dim() != 3 or completion_ids.shape[0] != prompt_ids.shape[0]:
            raise ValueError(f"completion_log_probs: completion_ids must be [batch {prompt_ids.shape[0]}, group, "
                             f"tokens], got {tuple(completion_ids.shape)}")
        if prompt_attention_mask is None:
            prompt_attention_mask = torch.ones_like(prompt_ids)
        if completion_mask is None:
            completion_mask = torch.ones_like(completion_ids)
        checkpointed = self.config.memory_config.checkpoint_chunks or self.model.gradient_checkpointing
        if not (self.training and torch.is_grad_enabled() and checkpointed):
            return self._score_from_cache(TitansCache(self.config), prompt_ids, prompt_attention_mask, completion_ids,
                                          completion_mask)
        rows = []
        for row in range(prompt_ids.shape[0]):
            prompt = prompt_ids[row:row + 1, prompt_attention_mask[row].bool()]  # its tokens, without left padding
            if prompt.shape[1] == 0:
                raise ValueError(f"completion_log_probs: prompt row {row} has no token (attention mask all 0)")
            cache, tail = self._prompt_cache(prompt)
            rows.append(self._score_from_cache(cache, tail, torch.ones_like(tail), completion_ids[row:row + 1],
                                               completion_mask[row:row + 1]))
        return torch.cat(rows)

    def _prompt_cache(self, prompt: torch.LongTensor) -> tuple[TitansCache, torch.LongTensor]:
        """(a cache holding one row's stream after every chunk of `prompt` [1, tokens] but its last, the prompt's
        last chunk): the chunks before run as a cache-less stream, checkpointed chunk by chunk, and the cache is
        seeded with the memory states and the last of those chunks' keys (as `start_new_chunk` leaves them)."""
        chunk_size = self.config.memory_config.chunk_size
        head = (prompt.shape[1] - 1) // chunk_size * chunk_size
        cache = TitansCache(self.config)
        if head:
            end = self.model._stream(prompt[:, :head], None, None, None, StreamRequest())
            cache.memory_states, cache.seen_tokens = end.states, head
            for index, (keys, values) in enumerate(end.previous.key_values if end.previous else []):
                cache.update(keys, values, index)  # at the positions before the next chunk's: nothing to move
        return cache, prompt[:, head:]

    def _score_from_cache(self, cache: TitansCache, prompt_ids: torch.LongTensor, prompt_attention_mask: Tensor,
                          completion_ids: torch.LongTensor, completion_mask: Tensor) -> Tensor:
        """The prompt (or its rest) into `cache`, then every completion from the state it leaves."""
        batch_size, group, length = completion_ids.shape
        last = self.model(input_ids=prompt_ids, attention_mask=prompt_attention_mask, cache=cache,
                          lm_head=ChunkedLMHead(self.lm_head, logits_to_keep=1)).lm_head_output.logits
        cache.batch_repeat_interleave(group)
        tokens, mask = completion_ids.flatten(0, 1), completion_mask.flatten(0, 1)
        attention_mask = torch.cat([prompt_attention_mask.repeat_interleave(group, 0),
                                    mask.to(prompt_attention_mask)], 1)
        logits = self.model(input_ids=tokens, attention_mask=attention_mask, cache=cache,
                            lm_head=ChunkedLMHead(self.lm_head, logits_to_keep=length)).lm_head_output.logits
        logits = torch.cat([last.repeat_interleave(group, 0), logits[:, :-1]], dim=1)
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        # not a view: FSDP2 hooks the outputs of a call for backward, and warns of views (in-place ops drop the hook)
        return log_probs.view(batch_size, group, length) * completion_mask

    # ---- building on a base, loading and saving (see the module docstring) ----

    @classmethod
    def from_base(
        cls,
        base: str | os.PathLike | PreTrainedModel,
        memory_config: TitansMemoryConfig | None = None,
        *,
        revision: str | None = None,
        dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **memory_settings: Any,
    ) -> "TitansQwenForCausalLM":
        """Wrap a pretrained Qwen2/Qwen3 with a new memory; the base's weights and parameter names stay as loaded.

        The base loads through `AutoModelForCausalLM.from_pretrained`, which never runs code from the base's
        repository here (`trust_remote_code=False`) and reads its weights from safetensors only. The memory is built
        in float32 whatever `dtype` the base loads in.

        Args:
            base (`str`, `os.PathLike` or `PreTrainedModel`):
                A Hub id, a local folder, or a loaded Qwen2/Qwen3 causal LM (used as it is, not copied; a model
                holding PEFT adapters is refused: put the LoRA on the TitansQwen with `titans_hf.lora.add_lora`).
            memory_config (`TitansMemoryConfig`, *optional*, defaults to `None`):
                The memory's settings; None takes `TitansMemoryConfig`'s defaults.
            revision (`str`, *optional*, defaults to `None`):
                The base's git revision on the Hub (recorded in the memory config).
            dtype (`torch.dtype` or `str`, *optional*, defaults to `None`):
                The base's dtype, passed to its `from_pretrained` (None: as the base's config says).
            attn_implementation (`str`, *optional*, defaults to `None`):
                The base's attention ("sdpa", "eager", "flash_attention_2", ...), passed to its `from_pretrained`.
            load_kwargs (`dict`, *optional*, defaults to `None`):
                Further arguments of the base's `from_pretrained` (`token`, `device_map`, ...).
            **memory_settings:
                `TitansMemoryConfig` fields (`chunk_size`, `memory_layers`, `variant`, ...), over `memory_config`'s;
                an unknown name is a ValueError. An `update_rule` other than `memory_config`'s takes its own rule's
                defaults for the settings `memory_config` resolved per rule (`PER_RULE_FIELDS`) unless given here.

        Returns:
            `TitansQwenForCausalLM`: the base with a freshly initialised memory, on the base's device.
        """
        unknown = sorted(set(memory_settings) - set(TitansMemoryConfig.setting_names()))
        if unknown:
            raise ValueError(f"from_base: unknown memory settings {unknown}; valid: "
                             f"{list(TitansMemoryConfig.setting_names())}")
        _refuse_adapted_base(base)
        if isinstance(base, PreTrainedModel):
            backbone, name = base, base.config.name_or_path
        else:
            check_safetensors_folder(base, "from_base: the base")
            load_kwargs = {**(load_kwargs or {}), "trust_remote_code": False, "use_safetensors": True}
            for key, value in (("revision", revision), ("dtype", dtype), ("attn_implementation", attn_implementation)):
                if value is not None:
                    load_kwargs[key] = value
            backbone, name = AutoModelForCausalLM.from_pretrained(base, **load_kwargs), str(base)
        if not (hasattr(backbone, "model") and hasattr(backbone, "lm_head")):
            raise ValueError(f"from_base: {name} is a {type(backbone).__name__}, not a Qwen causal LM")
        values = memory_config.to_dict() if memory_config is not None else {}
        if values and memory_settings.get("update_rule", values["update_rule"]) != values["update_rule"]:
            # the other rule's values: None resolves them anew for this one
            values.update(dict.fromkeys(TitansMemoryConfig.PER_RULE_FIELDS))
        values.update(memory_settings)
        if values.get("base_model_name_or_path") is None:
            values.update(base_model_name_or_path=name, revision=revision)
            if name and Path(name).is_dir():  # a local base: the same folder from anywhere, and the same model
                values.update(base_model_name_or_path=str(Path(name).resolve()),
                              base_fingerprint=base_fingerprint(name))
        memory = TitansMemoryConfig.from_dict(values, source="from_base")
        attention = backbone.config._attn_implementation
        config = TitansQwenConfig(text_config=backbone.config, memory_config=memory)
        # building the config resets its sub-config's attention choice; keep the one the backbone was loaded with
        config._attn_implementation = attention
        config.name_or_path = name  # what TRL and PEFT read as the base's name
        model = cls(config, backbone=backbone)
        model.to(backbone.device)
        model.generation_config = backbone.generation_config
        return model

    @classmethod
    def from_base_and_memory(
        cls,
        base: str | os.PathLike | PreTrainedModel | None,
        memory: str | os.PathLike,
        revision: str | None = None,
        *,
        base_revision: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        **load_kwargs: Any,
    ) -> "TitansQwenForCausalLM":
        """Put a trained memory on a base. The memory's files are checked (names, shapes, dtypes against its config)
        before the base loads, so a base of another shape or a broken memory is refused first. Downloads go
        through `huggingface_hub` (cached; with HF_HUB_OFFLINE=1 only the cache is read). A LoRA adapter saved
        beside the memory (`titans_hf.lora`) is put on the base too.

        Args:
            base (`str`, `os.PathLike`, `PreTrainedModel` or `None`):
                A Hub id, a folder or a loaded model; None loads the base the memory config names (a Hub id, or a
                local folder whose fingerprint still matches), at the revision it names.
            memory (`str` or `os.PathLike`):
                A memory folder written by `save_pretrained` / `save_memory`, or a Hub repository holding one.
            revision (`str`, *optional*, defaults to `None`):
                The memory repository's git revision.
            base_revision (`str`, *optional*, defaults to `None`):
                The base's revision; None takes the one the memory config records.
            token (`str`, *optional*, defaults to `None`):
                The Hub token, for the memory and the base.
            cache_dir (`str` or `os.PathLike`, *optional*, defaults to `None`):
                The Hub cache folder.
            local_files_only (`bool`, *optional*, defaults to `False`):
                Read the Hub cache only.
            dtype (`torch.dtype` or `str`, *optional*, defaults to `None`):
                The base's dtype (the memory stays float32, as saved).
            attn_implementation (`str`, *optional*, defaults to `None`):
                The base's attention implementation.
            **load_kwargs:
                Further arguments of the base's `from_pretrained`.

        Returns:
            `TitansQwenForCausalLM`: the base with the trained memory (and LoRA), memory and LoRA trainable as saved.
        """
        hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
        memory_config = TitansMemoryConfig.from_pretrained(memory, revision=revision, **hub)
        weights_path = hub_file(memory, MEMORY_WEIGHTS_NAME, revision=revision, **hub)
        adapter_config_path = optional_hub_file(memory, ADAPTER_CONFIG_NAME, revision=revision, **hub)
        if adapter_config_path is not None:  # a LoRA trained with the memory: checked before the base loads
            from titans_hf.lora import read_adapter_config

            read_adapter_config(adapter_config_path)
        elif "peft" in sys.modules:  # PEFT's AutoPeftModel may be loading a memory-only folder for another's adapter
            from titans_hf.lora import auto_peft_adapter, check_auto_peft_base

            peft_adapter = auto_peft_adapter()
            if peft_adapter is not None:
                check_auto_peft_base(*peft_adapter, str(memory), revision)
        if base is None:
            base = memory_config.base_model_name_or_path
            if base and not Path(memory).is_dir() and (not is_hub_id(base) or Path(base).exists()):
                # a downloaded file never picks a path on this machine
                raise ValueError(f"{memory}: its memory config names the base {base!r}, which is not a Hub id; pass "
                                 "the base explicitly (from_base_and_memory(base, memory))")
            base = recorded_base(memory_config.base_model_name_or_path, memory_config.base_fingerprint, str(memory))
        elif (not isinstance(base, PreTrainedModel) and memory_config.base_fingerprint is not None
              and Path(base).is_dir() and base_fingerprint(base) != memory_config.base_fingerprint):
            logger.warning("%s: the base %s is not the model the memory was trained on (%s; base_fingerprint "
                           "differs); using it as asked", memory, base, memory_config.base_model_name_or_path)
        base_revision = base_revision if base_revision is not None else memory_config.revision
        if isinstance(base, PreTrainedModel):
            text = base.config
        else:
            text = AutoConfig.from_pretrained(base, revision=base_revision, trust_remote_code=False, **hub)
        try:
            fitted = memory_config.for_base(text)
        except ValueError as error:
            raise ValueError(f"{memory}: {error}") from error
        # the weights' names, shapes and dtypes against a memory built from the config on the meta device, before
        # anything is allocated: a config declaring a huge memory (memory_head_dim 2^20) is refused here, naming
        # the file, not after the model has tried to allocate terabytes
        cls.check_memory_weights(fitted, read_safetensors_header(weights_path), str(weights_path))
        model = cls.from_base(base, memory_config, revision=base_revision, dtype=dtype,
                              attn_implementation=attn_implementation, load_kwargs={**load_kwargs, **hub})
        model.load_memory_state_dict(load_memory_weights(weights_path), source=str(weights_path))
        if adapter_config_path is not None:
            from titans_hf.lora import load_lora

            load_lora(model, memory, revision=revision, **hub)
        return model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                        **kwargs: Any) -> "TitansQwenForCausalLM":
        """A memory folder or Hub repository (its `memory_config.json` names the base, which is loaded first; see
        `from_base_and_memory` for the keyword arguments), or a full model saved with `save_full_model=True`, whose
        files must hold every tensor of the model (transformers would start a missing one at random: a ValueError
        names the folder, the count and the first missing names) and whose tensors must all be finite once loaded (a
        ValueError names the file and the tensor), as a memory's are. `output_loading_info=True` returns
        `(model, loading_info)` as `PreTrainedModel.from_pretrained` does, for a full model.

        `AutoModelForCausalLM.from_pretrained` and `pipeline` arrive here through the folder's `config.json`; what
        they add (the config they read from it, their own markers, `trust_remote_code`) does not reach the base,
        which always loads with `trust_remote_code=False`."""
        hub = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
        if not args and is_memory(pretrained_model_name_or_path, revision=kwargs.get("revision"), **hub):
            config = kwargs.pop("config", None)
            if config is not None and not isinstance(config, TitansQwenConfig):
                raise ValueError(f"from_pretrained: config must be a TitansQwenConfig for a memory, got "
                                 f"{type(config).__name__}")
            if config is not None and config._attn_implementation_internal is not None:
                # the Auto classes put the caller's attn_implementation on the config they pass
                kwargs.setdefault("attn_implementation", config._attn_implementation_internal)
            for key in AUTO_KWARGS:
                kwargs.pop(key, None)
            return cls.from_base_and_memory(None, pretrained_model_name_or_path, **kwargs)
        check_safetensors_folder(pretrained_model_name_or_path, "from_pretrained: the model folder")
        folder = Path(pretrained_model_name_or_path)
        files: dict[str, Path] = {}  # file key: the file of the folder that holds it
        if folder.is_dir() and any(folder.glob("*.safetensors")):
            # a full model folder: its memory's shapes against its config before anything is built (a config that
            # declares a huge memory is named here, not in the loader's size-mismatch report)
            config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            headers = {path: read_safetensors_header(path) for path in sorted(folder.glob("*.safetensors"))}
            files = {name: path for path, header in headers.items() for name in header}
            if isinstance(config, TitansQwenConfig):
                header = {name: entry for header in headers.values() for name, entry in header.items()
                          if not name.startswith(BASE_PREFIXES)}
                cls.check_memory_weights(config.memory_config, header, str(folder), check_dtype=False)
        return_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                      **kwargs)
        missing = sorted(file_key(name) for name in loading_info["missing_keys"])
        if missing:
            raise ValueError(f"{pretrained_model_name_or_path}: its weight files lack {len(missing)} of the model's "
                             f"tensors ({', '.join(missing[:5])}{', ...' * (len(missing) > 5)}), which would start "
                             "at random; a full model folder holds every tensor of the base and the memory, as "
                             "save_pretrained(save_full_model=True) writes it")
        # loading swaps in new Parameter objects, which forget the freeze applied in __init__
        model._apply_freeze_base()
        # as a memory folder's weights are (load_memory_state_dict): one pass over the loaded tensors, no file read
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
                key = file_key(name)
                raise ValueError(f"{files.get(key, pretrained_model_name_or_path)}: {key} holds NaN or infinite "
                                 "values; the model is broken (a diverged training run), not loaded")
        return (model, loading_info) if return_loading_info else model

    def memory_parameter_names(self) -> dict[str, str]:
        """{key in a memory folder: parameter name} of every memory parameter (memory blocks, persistent tokens),
        e.g. "memory.1.output_weight": "model.memory.1.output_weight"."""
        return {file_key(name): name for name, _ in self.named_parameters() if is_memory_name(name)}

    def memory_state_dict(self) -> dict[str, Tensor]:
        """The memory's own parameters (memory layers, gates, persistent tokens) under a memory folder's keys
        (`memory.<layer>.*`, `persistent_tokens`): exactly what `save_pretrained` writes. The base is never part of
        it."""
        return {key: self.get_parameter(name).detach() for key, name in self.memory_parameter_names().items()}

    def load_memory_state_dict(self, state_dict: dict[str, Tensor], source: str = "memory state dict") -> None:
        """Copy memory weights in, keyed as `memory_state_dict` keys them; names, shapes and a floating dtype must
        match (a ValueError naming `source`)."""
        own = self.memory_state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(f"{source}: the memory weights do not fit this model's memory settings: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(own[name].shape) or not value.is_floating_point():
                raise ValueError(f"{source}: {name} is {value.dtype} {tuple(value.shape)}, the model expects a "
                                 f"floating tensor of shape {tuple(own[name].shape)}")
            if value.dtype != own[name].dtype:  # never cast silently (push refuses such a file too)
                raise ValueError(f"{source}: {name} is {value.dtype}, this model's memory is {own[name].dtype}; "
                                 "save the memory in its own dtype")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{source}: {name} holds NaN or infinite values; the memory is broken (a diverged "
                                 "training run), not loaded")
        with torch.no_grad():
            for name, value in state_dict.items():
                own[name].copy_(value)

    @staticmethod
    def check_memory_weights(config: TitansMemoryConfig, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                             source: str, check_dtype: bool = True) -> None:
        """Refuse weights that are not exactly the memory `config` describes: every name, shape and (unless not
        `check_dtype`: a full model may be saved in any dtype) dtype, given as {file key: (shape, dtype)}, e.g. read
        from a safetensors header, against a memory built from the config on the meta device. A ValueError naming
        `source` and the first difference."""
        if config.base_shape is None:
            raise ValueError(f"{source}: the memory config records no base_shape, so its weights cannot be checked")
        shape = config.base_shape
        text = AutoConfig.for_model(shape["model_type"], hidden_size=shape["hidden_size"],
                                    num_hidden_layers=shape["num_hidden_layers"], vocab_size=shape["vocab_size"])
        with torch.device("meta"):
            titans = TitansQwenConfig(text_config=text, memory_config=config)
            expected = {f"memory.{name}": param for name, param in memory_blocks(titans).named_parameters()}
            tokens = persistent_tokens(titans)
            if tokens is not None:
                expected["persistent_tokens"] = tokens
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{source}: not the weights of this memory config (missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]})")
        for name, param in expected.items():
            if tuple(tensors[name][0]) != tuple(param.shape) or (check_dtype and tensors[name][1] != param.dtype):
                raise ValueError(f"{source}: {name} is {tensors[name][1]} {tuple(tensors[name][0])}, the memory "
                                 f"config makes it {param.dtype} {tuple(param.shape)}")

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, save_full_model: bool = False,
                        **kwargs: Any) -> None:
        """With a frozen base: the memory alone (`memory_config.json` + `memory_model.safetensors`), the way PEFT
        saves an adapter. `save_full_model=True` (or a base that trains too) saves the whole model as any
        `PreTrainedModel` does, the memory under its file keys."""
        if save_full_model or not self.config.memory_config.freeze_base:
            if getattr(self, "peft_config", None):
                raise ValueError("save_pretrained(save_full_model=True): the model holds a LoRA adapter "
                                 "(titans_hf.lora), whose layers rename the base's weights; save the memory and the "
                                 "adapter (save_pretrained without save_full_model)")
            super().save_pretrained(save_directory, *args, **kwargs)
            return
        self.save_memory(save_directory)

    def save_memory(self, save_directory: str | os.PathLike) -> Path:
        """The memory alone, whatever `freeze_base` says, and beside it the LoRA adapter of the base if the model
        holds one (`titans_hf.lora`: PEFT's adapter_config.json, naming this folder as the model it goes on, and
        adapter_model.safetensors)."""
        adapter = None
        if getattr(self, "peft_config", None):
            from titans_hf.lora import adapter_files

            adapter = adapter_files(self, folder=save_directory)
        return save_memory_folder(save_directory, self.config.memory_config.to_dict(), self.memory_state_dict(),
                                  model_config=self.memory_folder_config(), adapter=adapter)

    def memory_folder_config(self) -> dict[str, Any]:
        """The `config.json` of a memory folder: this model's config (the base's config as `text_config`, the
        memory settings), by which `AutoConfig` and `AutoModelForCausalLM` recognise the folder; no local path in it.
        Loading reads the memory from `memory_config.json` and the base from the base itself."""
        values = json.loads(self.config.to_json_string(use_diff=True))
        values["architectures"] = [type(self).__name__]
        values.pop("_name_or_path", None)
        values["text_config"].pop("_name_or_path", None)
        return values

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings` for a base that trains (freeze_base=False): the new rows train
        with it and the whole model saves, its memory config's `base_shape` recording the new vocabulary so that
        the folder loads back. With a frozen base a change of size is refused here: the base stays as loaded and a
        memory folder holds the memory alone, so new rows could neither train nor be saved, and the folder would
        load on the base's vocabulary."""
        rows = self.get_input_embeddings().weight.shape[0]
        target = rows if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of:
            target = math.ceil(target / pad_to_multiple_of) * pad_to_multiple_of
        memory = self.config.memory_config
        if memory.freeze_base and target != rows:
            raise ValueError(f"resize_token_embeddings: {rows} -> {target} tokens, but the base is frozen "
                             "(freeze_base=True) and a memory folder holds the memory alone, so the changed rows could "
                             "neither train nor be saved; resize the base and save it as a new base before from_base, "
                             "or build the model with freeze_base=False to train and save the whole model")
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.config.memory_config = dataclasses.replace(memory, base_shape={
            **memory.base_shape, "vocab_size": self.config.text_config.vocab_size})
        return embeddings

    def push_to_hub(self, repo_id: str, *args: Any, push_full_model: bool = False, token: str | None = None,
                    private: bool | None = None, commit_message: str | None = None, results: dict | None = None,
                    datasets: list[str] | None = None, base_model: str | None = None,
                    base_revision: str | None = None, **kwargs: Any) -> str:
        """Upload the memory with its model card (see `titans_hf.hub.push_memory_folder`); `push_full_model=True`
        uploads the whole model the way `PreTrainedModel.push_to_hub` does. Returns the commit URL."""
        if push_full_model:
            return super().push_to_hub(repo_id, *args, token=token, private=private, commit_message=commit_message,
                                       **kwargs)
        from titans_hf.hub import push_memory_folder  # the Hub builds on the model, not the other way

        with tempfile.TemporaryDirectory() as folder:
            self.save_memory(folder)
            return push_memory_folder(folder, repo_id, token=token, private=bool(private),
                                      commit_message=commit_message, results=results, datasets=datasets,
                                      base_model=base_model, revision=base_revision,
                                      check_weights=self.check_memory_weights)


__all__ = ["TitansQwenForCausalLM", "TitansQwenModel", "TitansQwenPreTrainedModel"]
