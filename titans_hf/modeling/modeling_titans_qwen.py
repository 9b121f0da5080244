"""A pretrained Qwen2/Qwen3 causal LM that reads long inputs chunk by chunk, with a Titans neural memory carrying
information across chunks.

Attention reaches at most one chunk back (`attend_previous_chunk`, the default; without it, not across a chunk
boundary at all), and positions stay within two chunks, so the backbone runs on the lengths it was trained on
whatever the input length; the memory is the only path further back.

`TitansQwenModel` is the decoder: the base's own embeddings, decoder layers and final norm, under a plain Qwen's
names (`model.embed_tokens`, `model.layers.N`, `model.norm`), a memory block at each memory layer
(`model.memory.<layer>`, one `titans_hf.modeling.variants` block each) and, for mac, the persistent tokens
(`model.persistent_tokens`). Its forward checks the input (`titans_hf.modeling.input_checks`) and streams it
through the chunks, carrying the memory state (`titans_hf.modeling.streaming`: one dispatcher, each route named for
when it runs).

`TitansQwenForCausalLM` adds the base's LM head (`lm_head`), which runs chunk by chunk inside the decoder's loop; it
scores several completions of a prompt from one memory state (DPO, GRPO; `titans_hf.modeling.completions`), and is
built on a base, loaded and saved the way PEFT's adapters are (`titans_hf.modeling.save_and_load`): `from_base` puts a new memory on a base; `from_pretrained` on a memory folder or Hub
repository loads the base its `memory_config.json` names and puts the memory on it (`from_base_and_memory`);
`save_pretrained` and `push_to_hub` of a model with a frozen base write the memory alone (see
`titans_hf.modeling.memory_folder`), `save_full_model=True` the whole model as any `PreTrainedModel`. The memory's
parameters sit in the decoder (`model.memory.<layer>.*`, `model.persistent_tokens`); its files store them without the
decoder's `model.` in front (`memory.<layer>.*`, `persistent_tokens`): a memory folder through `memory_state_dict` /
`load_memory_state_dict`, a full model's `model.safetensors` through transformers' key renaming
(`FULL_MODEL_KEY_RENAMING`, undone on save), so folders keep one format.

Below this file: the input checks (`input_checks`), the chunk stream (`streaming`), the cache (`cache_titans_qwen`), the outputs and the values the chunk
loop passes around (`outputs_titans_qwen`), building, loading and saving (`save_and_load`) over the memory folder's
files (`memory_folder`), completion scoring (`completions`) and TRL's reference model (`memory_off_reference`).
"""

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from .cache_titans_qwen import TitansCache
from .frozen_trunk import DEFAULT_TRUNK_BYTES, FrozenTrunkCache
from .configuration_titans_qwen import TitansMemoryConfig, TitansQwenConfig
from .memory import MemoryState, NeuralMemory
from . import completions, input_checks, save_and_load
from .library_internals import check_transformers_internals_once
from .memory_folder import is_memory, is_memory_name
from .memory_off_reference import TitansMemoryOffReference
from .outputs_titans_qwen import (
    ChunkedLMHead,
    ChunkedLMHeadOutput,
    StreamOutput,
    StreamRequest,
    TitansCausalLMOutput,
    TitansModelOutput,
)
from .streaming import ChunkStream
from .variants import TitansMemoryBlock, memory_blocks, persistent_tokens

logger = logging.getLogger(__name__)

# A full model's file keys of the memory -> its parameter names (and back on save).
FULL_MODEL_KEY_RENAMING = [WeightRenaming(r"^memory\.", "model.memory."),
                           WeightRenaming(r"^persistent_tokens", "model.persistent_tokens")]
register_checkpoint_conversion_mapping("TitansQwenForCausalLM", FULL_MODEL_KEY_RENAMING, overwrite=True)


def causal_lm_loss(head: ChunkedLMHeadOutput, num_items_in_batch: int | Tensor | None, write_cost: float,
                   write_rate: Tensor | None) -> Tensor:
    """The labelled positions' summed loss over `num_items_in_batch` (gradient accumulation; None: their mean), plus
    the write cost: `write_cost` times the memory's `write_rate`, weighted by this batch's share of the accumulated
    labels so that the batches add up to one cost, as they add up to one mean loss.

    Labels with no labelled token are refused when nothing else is labelled either (`num_items_in_batch` None or 0):
    their mean loss is undefined (transformers' own models return NaN). A micro-batch without one inside an
    accumulated batch that has some (`num_items_in_batch` > 0, as the Trainer passes under gradient accumulation)
    adds 0, its share of the accumulated mean."""
    if not int(head.num_labels) and (num_items_in_batch is None or not int(num_items_in_batch)):
        raise ValueError("forward: labels label no token (every label after the first position is -100; the first "
                         "is predicted by nothing), so their mean loss is undefined: pass labels with a token != -100 "
                         "after the first, or num_items_in_batch > 0 counting the labelled tokens of the whole "
                         "accumulated batch")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(head.loss_sum.device)
        loss = head.loss_sum / num_items_in_batch
    else:
        loss = head.loss_sum / head.num_labels.clamp(min=1)
    if write_cost and write_rate is not None:
        share = 1 if num_items_in_batch is None else head.num_labels / num_items_in_batch
        loss = loss + write_cost * share * write_rate.to(loss.dtype)
    return loss


def per_label_outputs(head: ChunkedLMHeadOutput, labels: Tensor | None, return_predictions: bool,
                      return_token_losses: bool) -> tuple[Tensor | None, Tensor | None]:
    """(the greedy prediction of every labelled token, -100 where unlabelled; the cross-entropy of every labelled
    token, 0 where unlabelled), each when asked for, aligned with `labels`: position t - 1 predicts labels[t]."""
    label_predictions = token_losses = None
    if head.predictions is not None:
        greedy, losses = head.predictions
        labels = labels.to(greedy.device)
        labelled = labels[:, 1:] != -100
        if return_predictions:
            label_predictions = torch.full_like(labels, -100)
            label_predictions[:, 1:] = torch.where(labelled, greedy[:, :-1], -100)
        if return_token_losses:
            token_losses = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
            token_losses[:, 1:] = losses[:, :-1]
    return label_predictions, token_losses


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

    def __init__(self, config: TitansQwenConfig, *args: Any, **kwargs: Any):
        check_transformers_internals_once()
        super().__init__(config, *args, **kwargs)

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


class TitansQwenModel(ChunkStream, TitansQwenPreTrainedModel):
    """The decoder of a TitansQwen: the base's embeddings, decoder layers and final norm, and at each layer of
    `memory_config.memory_layers` a memory block of the configured variant (`memory`), which runs around the decoder
    layer chunk after chunk; for mac, learned tokens in front of every chunk (`persistent_tokens`).

    Calling it streams the input through its chunks (see `forward`) and returns the last layer's hidden states,
    normed, as a Qwen model does; `TitansQwenForCausalLM` passes its LM head in, to run chunk by chunk. Its
    dtypes: see `TitansQwenForCausalLM`.
    """

    # tokens the layer-by-layer stream runs through each layer at once (`_stream_layer_by_layer`)
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
        self._frozen_trunk_cache: FrozenTrunkCache | None = None  # set by cache_frozen_trunk()
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
        """Always the chunk loop (`_stream_chunk_by_chunk`), never the layer-by-layer order it would otherwise take
        where chunks attend only to themselves: the same results, with each memory called once per chunk (what hooks
        that record the memory's state after every chunk need)."""
        previous = self._layer_major_enabled
        self._layer_major_enabled = False
        try:
            yield self
        finally:
            self._layer_major_enabled = previous

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
        input_checks.refuse_output_attentions(kwargs.get("output_attentions"), self.config)
        cache = input_checks.cache_argument(cache, kwargs)
        input_checks.check_inputs(self.config, input_ids, inputs_embeds, position_ids, attention_mask, kwargs)
        if self.training and torch.is_grad_enabled() and self._memory_enabled and not self._warned_frozen_memory:
            self._warn_if_memory_frozen()
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        batch_size, length = inputs.shape[:2]
        input_checks.check_cache(cache, self.config)
        if memory_states is not None:
            input_checks.check_memory_states(memory_states, self.memory, self.config.memory_config.chunk_size,
                                             batch_size, cache is not None or bool(use_cache))
            memory_states = dict(memory_states)
        if cache is None and use_cache:
            cache = TitansCache(self.config)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if not isinstance(output_hidden_states, bool):
            raise ValueError(f"forward: output_hidden_states must be true or false, got {output_hidden_states!r}")
        token_mask = input_checks.token_mask(attention_mask, batch_size, length, inputs.device)
        hidden_mode = "all" if output_hidden_states else "last" if lm_head is None else None
        request = (StreamRequest(hidden_states=hidden_mode) if lm_head is None
                   else lm_head.request(token_mask, (batch_size, length), inputs.device, hidden_mode))
        inputs, request = self._from_trunk(inputs, token_mask, cache, memory_states, request)
        stream = self._stream(inputs, token_mask, cache, memory_states, request)
        return self._model_output(stream, request, token_mask, batch_size * length, cache, memory_states is not None)

    def _model_output(self, stream: StreamOutput, request: StreamRequest, token_mask: Tensor | None, tokens: int,
                      cache: TitansCache | None, states_given: bool) -> TitansModelOutput:
        """What `forward` returns of a stream of `tokens` positions: the hidden states as `request` asked for them,
        the LM head's results, the memory's write rate (theta summed over rows, real tokens and heads, per memory
        layer) and, when the stream started from given states, the states it ends in."""
        hidden_states, last_hidden_state = stream.hidden_states, None
        if request.hidden_states == "last":
            (last_hidden_state,), hidden_states = hidden_states, None
        elif request.hidden_states == "all":
            last_hidden_state = hidden_states[-1]
        write_rate = None
        if stream.written is not None:
            if token_mask is not None:
                tokens = token_mask.sum().clamp(min=1)
            write_rate = stream.written / (tokens * self.config.memory_config.memory_num_heads * len(self.memory))
        head_output = None
        if request.lm_head is not None:
            labelled = None if request.shifted_labels is None else (request.shifted_labels != -100).sum()
            head_output = ChunkedLMHeadOutput(logits=stream.logits, loss_sum=stream.loss_sum, num_labels=labelled,
                                              predictions=stream.predictions)
        return TitansModelOutput(last_hidden_state=last_hidden_state, cache=cache, hidden_states=hidden_states,
                                 memory_states=stream.states if states_given else None,
                                 lm_head_output=head_output, write_rate=write_rate)

    def _warn_if_memory_frozen(self) -> None:
        """Say once, in a training forward, that nothing trains the memory: every one of its weights is frozen, as
        `peft.get_peft_model` leaves them (a Trainer would then save a memory at its initial weights)."""
        weights = list(self.memory.parameters())
        if weights and not any(weight.requires_grad for weight in weights):
            self._warned_frozen_memory = True
            logger.warning("TitansQwenForCausalLM trains with every memory weight frozen (requires_grad=False): "
                           "the memory keeps its initial weights. peft.get_peft_model freezes it; put a LoRA on the "
                           "model with titans_hf.lora.add_lora(model, LoraConfig(...)) to train both")

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
        """Always the chunk loop, never the layer-by-layer order (see `TitansQwenModel.chunk_by_chunk`)."""
        return self.model.chunk_by_chunk()

    def cache_frozen_trunk(self, enable: bool = True, max_bytes: int = DEFAULT_TRUNK_BYTES) -> "TitansQwenForCausalLM":
        """Keep each row's hidden states below the first memory layer and start its later readings there; returns the
        model (see `TitansQwenModel.cache_frozen_trunk`)."""
        self.model.cache_frozen_trunk(enable, max_bytes)
        return self

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
        input_checks.refuse_output_attentions(kwargs.get("output_attentions"), self.config)
        cache = input_checks.cache_argument(cache, kwargs)
        if write_cost is not None and not write_cost >= 0:
            raise ValueError(f"forward: write_cost={write_cost!r} must be >= 0 (a weight on the loss)")
        if completion_ids is not None:
            given = [name for name, value in (("labels", labels), ("cache", cache), ("use_cache", use_cache or None),
                                              ("inputs_embeds", inputs_embeds)) if value is not None]
            if given:
                raise ValueError(f"forward: completion_ids score completions of input_ids from a fresh stream; "
                                 f"{', '.join(given)} cannot be given with them")
            return TitansCausalLMOutput(completion_log_probs=completions.score_completions(
                self, input_ids, attention_mask, completion_ids, completion_mask))
        lm_head = ChunkedLMHead(self.lm_head, labels, logits_to_keep, predict=return_predictions or return_token_losses)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, memory_states=memory_states,
                             output_hidden_states=output_hidden_states,
                             output_attentions=kwargs.get("output_attentions"), lm_head=lm_head)
        head = outputs.lm_head_output
        if write_cost is None:
            write_cost = self.config.memory_config.write_cost
        loss = None
        if head.loss_sum is not None:
            loss = causal_lm_loss(head, num_items_in_batch, write_cost if self.training else 0, outputs.write_rate)
        label_predictions, token_losses = per_label_outputs(head, labels, return_predictions, return_token_losses)
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
        input_checks.refuse_output_attentions_at_load(load_kwargs or {}, "from_base")
        return save_and_load.build_on_base(cls, base, memory_config, save_and_load.BaseLoading(
            revision, dtype, attn_implementation, dict(load_kwargs or {})), memory_settings)

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
        input_checks.refuse_output_attentions_at_load(load_kwargs, "from_base_and_memory")
        source = save_and_load.MemorySource(memory, revision, token, cache_dir, local_files_only)
        return save_and_load.load_on_base(cls, base, source, save_and_load.BaseLoading(
            base_revision, dtype, attn_implementation, load_kwargs))

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
        input_checks.refuse_output_attentions_at_load(kwargs, "from_pretrained")
        hub = {key: kwargs[key] for key in save_and_load.HUB_KWARGS if key in kwargs}
        if not args and is_memory(pretrained_model_name_or_path, revision=kwargs.get("revision"), **hub):
            return cls.from_base_and_memory(None, pretrained_model_name_or_path,
                                            **save_and_load.memory_folder_kwargs(kwargs))
        files = save_and_load.check_full_model_folder(pretrained_model_name_or_path)
        return_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                      **kwargs)
        save_and_load.check_loaded_full_model(model, loading_info["missing_keys"], files,
                                              pretrained_model_name_or_path)
        # loading swaps in new Parameter objects, which forget the freeze applied in __init__
        model._apply_freeze_base()
        return (model, loading_info) if return_loading_info else model

    def memory_parameter_names(self) -> dict[str, str]:
        """{key in a memory folder: parameter name} of every memory parameter (memory blocks, persistent tokens),
        e.g. "memory.1.output_weight": "model.memory.1.output_weight"."""
        return save_and_load.memory_parameter_names(self)

    def memory_state_dict(self) -> dict[str, Tensor]:
        """The memory's own parameters (memory layers, gates, persistent tokens) under a memory folder's keys
        (`memory.<layer>.*`, `persistent_tokens`): exactly what `save_pretrained` writes. The base is never part of
        it."""
        return save_and_load.memory_state_dict(self)

    def load_memory_state_dict(self, state_dict: dict[str, Tensor], source: str = "memory state dict") -> None:
        """Copy memory weights in, keyed as `memory_state_dict` keys them; names, shapes and a floating dtype must
        match (a ValueError naming `source`)."""
        save_and_load.load_memory_state_dict(self, state_dict, source)

    @staticmethod
    def check_memory_weights(config: TitansMemoryConfig, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                             source: str, check_dtype: bool = True) -> None:
        """Refuse weights that are not exactly the memory `config` describes: every name, shape and (unless not
        `check_dtype`: a full model may be saved in any dtype) dtype, given as {file key: (shape, dtype)}, e.g. read
        from a safetensors header, against a memory built from the config on the meta device. A ValueError naming
        `source` and the first difference."""
        save_and_load.check_memory_weights(config, tensors, source, check_dtype)

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
        return save_and_load.save_memory(self, save_directory)

    def memory_folder_config(self) -> dict[str, Any]:
        """The `config.json` of a memory folder: this model's config (the base's config as `text_config`, the
        memory settings), by which `AutoConfig` and `AutoModelForCausalLM` recognise the folder; no local path in it.
        Loading reads the memory from `memory_config.json` and the base from the base itself."""
        return save_and_load.memory_folder_config(self)

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
        memory_config = self.config.memory_config
        if memory_config.freeze_base and target != rows:
            raise ValueError(f"resize_token_embeddings: {rows} -> {target} tokens, but the base is frozen "
                             "(freeze_base=True) and a memory folder holds the memory alone, so the changed rows could "
                             "neither train nor be saved; resize the base and save it as a new base before from_base, "
                             "or build the model with freeze_base=False to train and save the whole model")
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.config.memory_config = dataclasses.replace(memory_config, base_shape={
            **memory_config.base_shape, "vocab_size": self.config.text_config.vocab_size})
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
        return save_and_load.push_memory(self, repo_id, token=token, private=bool(private),
                                         commit_message=commit_message, results=results, datasets=datasets,
                                         base_model=base_model, revision=base_revision)


__all__ = ["TitansQwenForCausalLM", "TitansQwenModel", "TitansQwenPreTrainedModel"]
