"""A pretrained Qwen2/Qwen3 causal LM that reads long inputs chunk by chunk, with a Titans neural memory carrying
information across chunks.

Attention reaches at most one chunk back (`attend_previous_chunk`, the default; without it, not across a chunk
boundary at all), and positions stay within two chunks, so the backbone runs on the lengths it was trained on
whatever the input length; the memory is the only path further back.
Two orders compute the same stream: chunk by chunk (`_stream`: every layer of a chunk, then the next chunk; what a
cache, the previous chunk's keys, prefix tokens and per-chunk checkpointing need) and, where chunks attend only to
themselves, layer by layer (`_stream_layer_major`: each layer once over all chunks as one batch, each memory once over
the tokens in order), which makes far fewer and larger calls when chunks are small.
The backbone's modules are used as loaded, under their own state-dict keys (`model.*`, `lm_head.*`); the memory
layers (`memory.<layer>.*`, one `titans_hf.modeling.variants` block each) and persistent tokens are the rest.

Loading and saving follow PEFT's adapters: `from_pretrained` on a memory folder or Hub repository loads the base it
names and puts the memory on it; `save_pretrained` and `push_to_hub` of a model with a frozen base write the memory
alone (see `titans_hf.hub`).
"""

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_titans_qwen import TitansMemoryConfig, TitansQwenConfig
from .memory import MemoryState, NeuralMemory
from .memory_folder import (
    ADAPTER_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    base_fingerprint,
    base_matches_fingerprint,
    check_safetensors_folder,
    hub_file,
    is_hub_id,
    is_memory,
    load_memory_weights,
    optional_hub_file,
    read_safetensors_header,
    recorded_base,
    save_memory_folder,
)
from .variants import MEMORY_VARIANTS, TitansMemoryBlock

logger = logging.getLogger(__name__)

BASE_PREFIXES = ("model.", "lm_head.")
# What the Hub download of a memory takes; everything else goes to the base's from_pretrained.
HUB_KWARGS = ("token", "cache_dir", "local_files_only")
# What the Auto classes and pipelines add to a model's from_pretrained; a memory's base never sees them.
AUTO_KWARGS = ("_from_auto", "_from_pipeline", "adapter_kwargs", "trust_remote_code")


def _memory_blocks(config: TitansQwenConfig) -> nn.ModuleDict:
    """One block of the configured variant per memory layer, keyed by the layer's index."""
    variant = MEMORY_VARIANTS[config.memory_config.variant]
    return nn.ModuleDict({str(layer): variant(config) for layer in config.memory_config.memory_layers})


def _persistent_tokens(config: TitansQwenConfig) -> nn.Parameter:
    return nn.Parameter(torch.zeros(config.memory_config.num_persistent_tokens, config.text_config.hidden_size))


def rotate_half(x: Tensor) -> Tensor:
    """The 90 degree turn of RoPE's pairs, as Qwen2 and Qwen3 pair the two halves of a head."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
    positions 0 ..) and values [B, kv heads, keys, head dim], and its 2-D key mask (None: no padding)."""

    key_values: list[tuple[Tensor, Tensor]]
    mask: Tensor | None

    @property
    def length(self) -> int:
        return self.key_values[0][0].shape[-2] if self.key_values else 0

    def detach(self) -> "PreviousChunk":
        return PreviousChunk([(keys.detach(), values.detach()) for keys, values in self.key_values], self.mask)


@dataclass
class TitansCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus, on request, the greedy prediction and the loss of every labelled token, the
    last layer's normed hidden states, or the log-probabilities of a group of completions of each prompt."""

    label_predictions: torch.LongTensor | None = None
    token_losses: torch.FloatTensor | None = None
    completion_log_probs: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    memory_states: dict[int, MemoryState] | None = None


@dataclass
class PhaseGroup:
    """Rows of a batch whose first real tokens fall at the same place of the chunk cycle: `phase` = the row's left
    padding % `padding_multiple`. They run as one batch from column `phase` on, where their left padding is a whole
    multiple (whole chunks and memory updates, which leave a row's outputs as they are without them); with a cache,
    in their own `cache`."""

    rows: Tensor
    phase: int
    cache: "TitansCache | None" = None


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


# what a padding-free (packed) batch carries instead of an attention mask: several documents in one row
PACKED_BATCH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class TitansBackbone(nn.Module):
    """The decoder of a `TitansQwenForCausalLM` as code that reaches for `model.base_model` or `model.get_decoder()`
    calls it (TRL's fused LM head: backbone, then the LM head tile by tile): calling it runs the model's chunk loop,
    the memory included (or switched off, with `memory=False`), and returns the last hidden state, normed, before
    the LM head. Every other attribute (`layers`, `embed_tokens`, `get_input_embeddings`, `config`, ...) is the
    Qwen backbone's. A view, made on each access: it owns no parameters and is no submodule of the model."""

    def __init__(self, model: "TitansQwenForCausalLM", memory: bool = True):
        super().__init__()
        self.__dict__["_titans"], self.__dict__["_memory"] = model, memory  # not registered as a submodule

    def __getattr__(self, name: str) -> Any:
        titans = self.__dict__.get("_titans")
        if titans is None:
            raise AttributeError(name)
        return getattr(titans.model, name)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: Tensor | None = None,
                inputs_embeds: torch.FloatTensor | None = None, position_ids: Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> BaseModelOutputWithPast:
        """`last_hidden_state` [batch, tokens, hidden] of the chunk loop over the whole input (positions restart
        every chunk; `position_ids` are only checked). A packed (padding-free) batch is refused: its documents
        would share one stream of chunks and one memory."""
        if use_cache:
            raise ValueError("base_model / get_decoder() of a TitansQwenForCausalLM run without a cache; generate "
                             "with the model itself")
        packed = [key for key in PACKED_BATCH_KWARGS if kwargs.get(key) is not None]
        if packed or (position_ids is not None and _restarts_inside_rows(position_ids, attention_mask)):
            raise ValueError("TitansQwenForCausalLM reads each row as one stream through its memory: packed / "
                             f"padding-free batches (position_ids restarting inside a row{', ' if packed else ''}"
                             f"{', '.join(packed)}) are not supported; use padding (e.g. TRL's padding_free=False, "
                             "packing=False)")
        titans = self._titans
        context = contextlib.nullcontext() if self._memory else titans.memory_disabled()
        with context:
            # the class's forward: this view is called from inside the model's own (possibly patched) forward
            outputs = type(titans).forward(titans, input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, return_last_hidden_state=True,
                                           output_attentions=kwargs.get("output_attentions"))
        return BaseModelOutputWithPast(last_hidden_state=outputs.last_hidden_state)


def _joined_stream(all_logits: list[Tensor], loss_sum: Tensor | None, per_token: list[tuple[Tensor, Tensor]],
                   all_hidden: list[Sequence[Tensor]]
                   ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None, tuple[Tensor, ...] | None]:
    """A stream's result from its pieces' (each list in token order): the logits, the summed loss, the greedy
    tokens and losses, and per layer the hidden states, each joined along the tokens (None where none were made)."""
    join = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # noqa: E731
    return (
        join(all_logits) if all_logits else None,
        loss_sum,
        (join([g for g, _ in per_token]), join([t for _, t in per_token])) if per_token else None,
        tuple(join(layer) for layer in zip(*all_hidden)) if all_hidden else None,
    )


def _restarts_inside_rows(position_ids: Tensor, attention_mask: Tensor | None) -> bool:
    """Whether positions fall back to an earlier value between two real tokens of a row (documents packed)."""
    real = torch.ones_like(position_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    restarts = (position_ids[:, 1:] <= position_ids[:, :-1]) & real[:, 1:] & real[:, :-1]
    return bool(restarts.any())


class TitansMemoryOffReference(nn.Module):
    """The frozen base run chunk by chunk (the memory switched off) as a reference model for TRL's DPO / GRPO, on
    the policy's own weights: no second copy loads. It owns no parameters and no submodules; calls run without
    gradients. Made by `TitansQwenForCausalLM.memory_off_reference()`."""

    def __init__(self, model: "TitansQwenForCausalLM"):
        super().__init__()
        self.__dict__["policy"] = model  # not registered: the reference holds nothing to train, cast or shard
        self.config = model.config

    @property
    def base_model(self) -> TitansBackbone:
        return TitansBackbone(self.policy, memory=False)

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    def get_output_embeddings(self) -> nn.Module:
        return self.policy.get_output_embeddings()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """The weights it computes with: the policy's base (what TRL hashes to key its cached reference scores)."""
        return {name: tensor for name, tensor in self.policy.state_dict(*args, **kwargs).items()
                if name.startswith(BASE_PREFIXES)}

    def forward(self, *args: Any, **kwargs: Any) -> "TitansCausalLMOutput":
        with torch.no_grad(), self.policy.memory_disabled():
            return self.policy(*args, **kwargs)


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
    # small, and trained with tiny steps: stay fp32 under a bf16 backbone (the model casts at the boundaries)
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
        elif isinstance(module, TitansQwenForCausalLM) and hasattr(module, "persistent_tokens"):
            init.normal_(module.persistent_tokens, std=std)
        else:
            super()._init_weights(module)


class TitansQwenForCausalLM(TitansQwenPreTrainedModel, GenerationMixin):
    """Qwen + Titans memory: at each layer of `memory_config.memory_layers`, a memory block of the configured
    variant (`titans_hf.modeling.variants`) runs around the decoder layer, chunk after chunk.

    Build one on a pretrained base with `from_base(...)`; load a trained memory with `from_pretrained(<memory
    folder or Hub id>)` or `from_base_and_memory(base, memory)`.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # tokens the layer-major stream runs through each layer at once (`_stream_layer_major`)
    LAYER_MAJOR_TOKENS = 8192
    # graphs of the compiled chunk step a process may hold: torch's limit (8 per function) counts every model, mode
    # (training, evaluation, generate) and backend together, and fullgraph=True turns reaching it into an error
    COMPILED_CHUNK_GRAPHS = 64
    _is_stateful = True  # the memory cannot roll back, so assisted decoding is refused

    def __init__(self, config: TitansQwenConfig, backbone: PreTrainedModel | None = None):
        super().__init__(config)
        text, memory = config.text_config, config.memory_config
        if backbone is None:
            self.model = AutoModel.from_config(text)
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        else:
            # loaded weights are final: post_init must not re-initialise them
            for tensor in backbone.state_dict(keep_vars=True).values():
                tensor._is_hf_initialized = True
            for module in backbone.modules():
                module._is_hf_initialized = True
            self.model, self.lm_head = backbone.model, backbone.lm_head
        self.memory = _memory_blocks(config)
        if memory.num_persistent_tokens:
            self.persistent_tokens = _persistent_tokens(config)
        self._memory_enabled = True
        self._layer_major_enabled = True
        self._warned_frozen_memory = False
        self._compiled_chunk_step = None  # set by compile_chunks()
        self._chunk_compiler: tuple[dict, Callable] | None = None  # (its options, the compiled step), kept when off
        self.post_init()
        self._apply_freeze_base()

    def _apply_freeze_base(self) -> None:
        if self.config.memory_config.freeze_base:
            self.model.requires_grad_(False)
            self.lm_head.requires_grad_(False)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "TitansQwenForCausalLM":
        """`to`, `half`, `bfloat16`, `cuda`, ... as on any module, except that a cast to float16 / bfloat16 leaves
        the memory (`_keep_in_fp32_modules_strict`) in float32 (moved to the same device): what `from_base(dtype=)`
        and loading do, since its small, slowly accumulating steps vanish in half precision. `float()` and
        `double()` cast it too."""
        probe = fn(torch.zeros(1))  # what fn makes of a float32 tensor: the target device and dtype
        if probe.dtype not in (torch.float16, torch.bfloat16):
            return super()._apply(fn, recurse)
        kept = set()
        for name in self._keep_in_fp32_modules_strict:
            part = getattr(self, name, None)
            tensors = [part] if isinstance(part, Tensor) else [] if part is None else [*part.parameters(),
                                                                                        *part.buffers()]
            kept.update(id(t) for t in tensors)
            kept.update(id(t.grad) for t in tensors if t.grad is not None)
        return super()._apply(lambda t: t.to(probe.device) if id(t) in kept else fn(t), recurse)

    # ---- construction, loading, saving ----

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
        """Wrap a pretrained Qwen2/Qwen3 (Hub id, local folder, or a loaded model) with a new memory; the base's
        weights and keys stay as loaded.

        The memory's settings come from `memory_config` and/or `memory_settings` (TitansMemoryConfig fields:
        chunk_size, memory_layers, variant, ...). `revision`, `dtype`, `attn_implementation` and `load_kwargs`
        (token, device_map, ...) go to the base's `from_pretrained`, which never runs code from the base's
        repository (`trust_remote_code=False`) and reads its weights from safetensors only.
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
        values = {**(memory_config.to_dict() if memory_config is not None else {}), **memory_settings}
        if values.get("base_model_name_or_path") is None:
            values.update(base_model_name_or_path=name, revision=revision)
            if name and Path(name).is_dir():  # a local base: the same folder from anywhere, and the same model
                values.update(base_model_name_or_path=str(Path(name).resolve()), base_fingerprint=base_fingerprint(name))
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
        """Put a trained memory (a folder written by `save_pretrained`, or a Hub repository at `revision`) on a base:
        a Hub id, a folder, a loaded model, or None for the base the memory names (at the revision it names, unless
        `base_revision` is given). A base of another shape is refused before its weights load. Downloads go
        through `huggingface_hub` (cached; with HF_HUB_OFFLINE=1 only the cache is read); `load_kwargs` go to the
        base's `from_pretrained`."""
        hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
        memory_config = TitansMemoryConfig.from_pretrained(memory, revision=revision, **hub)
        weights_path = hub_file(memory, MEMORY_WEIGHTS_NAME, revision=revision, **hub)
        adapter_config_path = optional_hub_file(memory, ADAPTER_CONFIG_NAME, revision=revision, **hub)
        if adapter_config_path is not None:  # a LoRA trained with the memory: checked before the base loads
            from titans_hf.lora import read_adapter_config

            read_adapter_config(adapter_config_path)
        if base is None:
            base = memory_config.base_model_name_or_path
            if base and not Path(memory).is_dir() and (not is_hub_id(base) or Path(base).exists()):
                # a downloaded file never picks a path on this machine
                raise ValueError(f"{memory}: its memory config names the base {base!r}, which is not a Hub id; pass "
                                 "the base explicitly (from_base_and_memory(base, memory))")
            base = recorded_base(memory_config, str(memory))
        elif (not isinstance(base, PreTrainedModel) and memory_config.base_fingerprint is not None
              and Path(base).is_dir() and not base_matches_fingerprint(base, memory_config.base_fingerprint)):
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
        tensors must all be finite once loaded (a ValueError names the file and the tensor), as a memory's are.

        `AutoModelForCausalLM.from_pretrained` and `pipeline` arrive here through the folder's `config.json`; what
        they add (the config they read from it, their own markers, `trust_remote_code`) does not reach the base,
        which always loads with `trust_remote_code=False`."""
        hub = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
        if not args and is_memory(pretrained_model_name_or_path, revision=kwargs.get("revision"), **hub):
            config = kwargs.pop("config", None)
            if config is not None and not isinstance(config, TitansQwenConfig):
                raise ValueError(f"from_pretrained: config must be a TitansQwenConfig for a memory, got "
                                 f"{type(config).__name__}")
            for key in AUTO_KWARGS:
                kwargs.pop(key, None)
            return cls.from_base_and_memory(None, pretrained_model_name_or_path, **kwargs)
        check_safetensors_folder(pretrained_model_name_or_path, "from_pretrained: the model folder")
        folder = Path(pretrained_model_name_or_path)
        files: dict[str, Path] = {}  # tensor name: the file of the folder that holds it
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
        # loading swaps in new Parameter objects, which forget the freeze applied in __init__
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model._apply_freeze_base()
        # as a memory folder's weights are (load_memory_state_dict): one pass over the loaded tensors, no file read
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{files.get(name, pretrained_model_name_or_path)}: {name} holds NaN or infinite "
                                 "values; the model is broken (a diverged training run), not loaded")
        return model

    def memory_state_dict(self) -> dict[str, Tensor]:
        """The memory's own parameters (memory layers, gates, persistent tokens) under their model names: exactly
        what `save_pretrained` writes. The base is never part of it."""
        return {name: param.detach() for name, param in self.named_parameters() if not name.startswith(BASE_PREFIXES)}

    def load_memory_state_dict(self, state_dict: dict[str, Tensor], source: str = "memory state dict") -> None:
        """Copy memory weights in; names, shapes and a floating dtype must match (a ValueError naming `source`)."""
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
        `check_dtype`: a full model may be saved in any dtype) dtype, given as {name: (shape, dtype)}, e.g. read
        from a safetensors header, against a memory built from the config on the meta device. A ValueError naming
        `source` and the first difference."""
        if config.base_shape is None:
            raise ValueError(f"{source}: the memory config records no base_shape, so its weights cannot be checked")
        shape = config.base_shape
        text = AutoConfig.for_model(shape["model_type"], hidden_size=shape["hidden_size"],
                                    num_hidden_layers=shape["num_hidden_layers"], vocab_size=shape["vocab_size"])
        with torch.device("meta"):
            titans = TitansQwenConfig(text_config=text, memory_config=config)
            expected = {f"memory.{name}": param for name, param in _memory_blocks(titans).named_parameters()}
            if config.num_persistent_tokens:
                expected["persistent_tokens"] = _persistent_tokens(titans)
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
        `PreTrainedModel` does."""
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
        return save_memory_folder(save_directory, self.config.memory_config, self.memory_state_dict(),
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
        from titans_hf.hub import (
            push_memory_folder,  # the Hub builds on the model, not the other way
        )

        with tempfile.TemporaryDirectory() as folder:
            self.save_memory(folder)
            return push_memory_folder(folder, repo_id, token=token, private=bool(private),
                                      commit_message=commit_message, results=results, datasets=datasets,
                                      base_model=base_model, revision=base_revision,
                                      check_weights=self.check_memory_weights)

    @contextlib.contextmanager
    def memory_disabled(self) -> Iterator["TitansQwenForCausalLM"]:
        """The ablation: the model runs as its frozen base does, chunk by chunk. Memory blocks are skipped (the
        same as zero reads, and cheaper), and nothing is put in front of the chunks."""
        previous = self._memory_enabled
        self._memory_enabled = False
        try:
            yield self
        finally:
            self._memory_enabled = previous

    @contextlib.contextmanager
    def chunk_by_chunk(self) -> Iterator["TitansQwenForCausalLM"]:
        """Always the chunk loop (`_stream`), never the layer-major order it would otherwise take where chunks
        attend only to themselves: the same results, with each memory called once per chunk (what hooks that
        record the memory's state after every chunk need)."""
        previous = self._layer_major_enabled
        self._layer_major_enabled = False
        try:
            yield self
        finally:
            self._layer_major_enabled = previous

    def compile_chunks(self, enable: bool = True, **compile_options: Any) -> "TitansQwenForCausalLM":
        """Run the chunk step under `torch.compile(fullgraph=True, **compile_options)` (e.g. `backend="inductor"`,
        `mode="max-autotune"`), or with `enable=False` eagerly again (enabled again with the same options, the graphs
        compiled so far serve); returns the model.

        The step is one chunk (or decoding piece) through every decoder layer with its memory block, the final norm
        and the LM head (`_chunk_step`): one graph without breaks, compiled on the first chunk and reused by every
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

    # ---- what trainers reach for inside the model (TRL) ----

    @property
    def base_model(self) -> nn.Module:
        """The decoder as the memory makes it (`TitansBackbone`): `model.base_model(...)` and
        `model.get_decoder()(...)` run the chunk loop with the memory, as `forward` does, never the bare Qwen."""
        if "model" not in self._modules:  # still being built
            return self
        return TitansBackbone(self)

    def get_decoder(self) -> nn.Module:
        return self.base_model

    def memory_off_reference(self) -> TitansMemoryOffReference:
        """This model with its memory switched off (the frozen base, chunk by chunk), on the same weights: pass it
        as TRL's `ref_model` to DPO / GRPO so that no second model loads."""
        return TitansMemoryOffReference(self)

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

        The same as `model(input_ids=prompt_ids, attention_mask=prompt_attention_mask, completion_ids=...,
        completion_mask=...).completion_log_probs`, the call to make through a DDP / FSDP wrapper."""
        return self(input_ids=prompt_ids, attention_mask=prompt_attention_mask, completion_ids=completion_ids,
                    completion_mask=completion_mask).completion_log_probs

    def _score_completions(self, prompt_ids: torch.LongTensor, prompt_attention_mask: Tensor | None,
                           completion_ids: torch.LongTensor, completion_mask: Tensor | None) -> Tensor:
        """`completion_log_probs`' work, run by `forward`: the prompt into a cache, then every completion from it.
        Under checkpointing (a training call with `checkpoint_chunks` or gradient checkpointing) each row goes
        alone, its prompt up to its last chunk as a cache-less stream whose chunks are recomputed in backward
        (`_prompt_cache`), so a long prompt holds one chunk's activations, not all of them."""
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
        memory = self.config.memory_config
        checkpointed = memory.checkpoint_chunks or self.gradient_checkpointing
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
            carry: dict[str, Any] = {}
            self._stream(prompt[:, :head], token_mask=None, shifted_labels=None, cache=None, keep_start=head,
                         predict=False, hidden_states=None, carry=carry)  # no logits: keep_start is its end
            cache.memory_states, cache.seen_tokens = carry["states"], head
            for index, (keys, values) in enumerate(carry["previous"].key_values if carry["previous"] else []):
                cache.update(keys, values, index)  # at the positions before the next chunk's: nothing to move
        return cache, prompt[:, head:]

    def _score_from_cache(self, cache: TitansCache, prompt_ids: torch.LongTensor, prompt_attention_mask: Tensor,
                          completion_ids: torch.LongTensor, completion_mask: Tensor) -> Tensor:
        """The prompt (or its rest) into `cache`, then every completion from the state it leaves."""
        batch_size, group, length = completion_ids.shape
        # `forward`, not `self(...)`: inside the call a DDP / FSDP wrapper made, its hooks must not run again
        last = self.forward(input_ids=prompt_ids, attention_mask=prompt_attention_mask, cache=cache, use_cache=True,
                            logits_to_keep=1).logits
        cache.batch_repeat_interleave(group)
        tokens, mask = completion_ids.flatten(0, 1), completion_mask.flatten(0, 1)
        attention_mask = torch.cat([prompt_attention_mask.repeat_interleave(group, 0), mask.to(prompt_attention_mask)], 1)
        logits = self.forward(input_ids=tokens, attention_mask=attention_mask, cache=cache, use_cache=True,
                              logits_to_keep=length).logits
        logits = torch.cat([last.repeat_interleave(group, 0), logits[:, :-1]], dim=1)
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        # not a view: FSDP2 hooks the outputs of a call for backward, and warns of views (in-place ops drop the hook)
        return log_probs.view(batch_size, group, length) * completion_mask

    # ---- activation checkpointing ----

    gradient_checkpointing = False  # set by (gradient|activation)_checkpointing_enable: checkpoint every chunk

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint,
                                    every_n_layers: int = 1) -> None:
        """What `activation_checkpointing_enable` / `gradient_checkpointing_enable` (and a Trainer or TRL with
        `gradient_checkpointing=True`) turn on: each chunk is recomputed in backward as one unit, memory update
        included, the same recomputation as `memory_config.checkpoint_chunks`. The decoder layers' own checkpointing
        stays off: it drops the cache that carries the previous chunk's keys (attend_previous_chunk) and would
        replay its writes. The chunk unit is always checkpointed without re-entrance, whatever
        `gradient_checkpointing_func` and `every_n_layers` say."""
        self.gradient_checkpointing = enable

    # ---- forward ----

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

    def _warn_if_memory_frozen(self) -> None:
        """Say once, in a training forward, that nothing trains the memory: every one of its weights is frozen, as
        `peft.get_peft_model` leaves them (a Trainer would then save a memory at its initial weights)."""
        weights = list(self.memory.parameters())
        if weights and not any(weight.requires_grad for weight in weights):
            self._warned_frozen_memory = True
            logger.warning("TitansQwenForCausalLM trains with every memory weight frozen (requires_grad=False): "
                           "the memory keeps its initial weights. peft.get_peft_model freezes it; put a LoRA on the "
                           "model with titans_hf.lora.add_lora(model, LoraConfig(...)) to train both")

    @property
    def padding_multiple(self) -> int:
        """Left padding by a multiple of this many tokens (whole chunks, whole memory updates and batches) leaves a
        row's outputs exactly as they are without it: fully padded chunks attend nothing real and write nothing.
        Rows whose left padding differs by such multiples run as one batch; any other left padding works too, each
        residue as its own batch (`PhaseGroup`)."""
        memory = self.config.memory_config
        return math.lcm(memory.chunk_size, memory.memory_chunk_size,
                        memory.memory_batch_size or memory.memory_chunk_size)

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

    def _move_keys(self, keys: Tensor, offset: int) -> Tensor:
        """Keys that RoPE rotated at positions p, as if rotated at p + offset (rotations compose: R(p + o) =
        R(o) R(p)): how a chunk's keys keep their place when it becomes the previous chunk, so positions stay within
        two chunks."""
        if offset == 0:
            return keys
        rotary = self.model.rotary_emb
        cos, sin = rotary(keys, torch.full((1, 1), offset, device=keys.device))
        cos, sin = cos.unsqueeze(1) / rotary.attention_scaling, sin.unsqueeze(1) / rotary.attention_scaling
        return keys * cos + rotate_half(keys) * sin

    def init_memory_states(self, batch_size: int, device: torch.device | None = None) -> dict[int, MemoryState]:
        return {int(layer): block.neural_memory.init_state(batch_size, device) for layer, block in self.memory.items()}

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
        geometry = (position_ids, masks, self.model.rotary_emb(hidden, position_ids))
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
        predict: bool = False,
        previous: PreviousChunk | None = None,
        hidden_states: str | None = None,
        geometry: dict | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, dict[int, MemoryState], PreviousChunk | None,
               tuple[Tensor, ...] | None]:
        """Run tokens (ids [B, T], or embeddings [B, T, hidden]) that lie inside one chunk through the base's own
        layers, each memory block around its layer. Returns (logits of positions >= keep_from or None, summed loss
        over labelled positions or None, with `predict` the greedy next token and the loss of every position or
        None, new memory states, without a cache but with `previous` (attend_previous_chunk) this chunk's keys,
        values and mask for the next chunk, with `hidden_states` the embeddings and every layer's output, the last
        one normed, as a Qwen model returns them). `geometry` keeps the masks and positions built for one shape for
        the next chunks of the stream (see `_chunk_geometry`). Kept separate so it can be checkpointed as one unit,
        so every input is an argument (`enabled` too: the recomputation in backward may run after `memory_disabled()`
        has exited) and no cache is changed in it but the decoding one."""
        batch_size, length = inputs.shape[:2]
        hidden = inputs if inputs.is_floating_point() else self.model.embed_tokens(inputs)
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
        logits, loss_sum, per_token, new_states, all_hidden = step(
            hidden, states, token_mask, shifted_labels, num_prefix, keep_from, enabled, predict, hidden_states,
            attention_cache, masks, position_embeddings, position_ids)
        current = None
        if previous is not None:
            current = PreviousChunk(
                [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in attention_cache.layers],
                None if attention_mask is None else as_previous_chunk_mask(attention_mask[:, past:], num_prefix),
            )
        return logits, loss_sum, per_token, new_states, current, all_hidden

    def _chunk_step(
        self,
        hidden: Tensor,
        states: dict[int, MemoryState],
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        num_prefix: int,
        keep_from: int,
        enabled: bool,
        predict: bool,
        hidden_states: str | None,
        attention_cache: DynamicCache | None,
        masks: dict,
        position_embeddings: tuple[Tensor, Tensor],
        position_ids: Tensor,
    ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None, dict[int, MemoryState],
               tuple[Tensor, ...] | None]:
        """The arithmetic of one piece, once its embeddings [B, prefix + T, hidden] and geometry are built: every
        decoder layer with its memory block, the final norm and the LM head. Returns (logits, summed loss, per-token
        predictions and losses, new memory states, hidden states) as `_forward_piece` describes them. What
        `compile_chunks()` compiles (one graph, no breaks): nothing in it reads a tensor's value into Python."""
        new_states = dict(states)
        layer_types = self.config.text_config.layer_types
        all_hidden = [hidden[:, num_prefix:]] if hidden_states == "all" else None
        for index, decoder_layer in enumerate(self.model.layers):
            layer = functools.partial(decoder_layer, attention_mask=masks[layer_types[index]],
                                      position_embeddings=position_embeddings, position_ids=position_ids,
                                      cache=attention_cache, use_cache=attention_cache is not None)
            block = self.memory[str(index)] if enabled and str(index) in self.memory else None
            if block is None:
                hidden = layer(hidden)
            else:
                hidden, new_states[index] = block(layer, hidden, states[index], token_mask, num_prefix)
            if all_hidden is not None:
                all_hidden.append(hidden[:, num_prefix:])
        hidden = self.model.norm(hidden[:, num_prefix:])
        if all_hidden is not None:
            all_hidden[-1] = hidden
        logits, loss_sum, per_token = self._head(hidden, shifted_labels, keep_from, predict)
        last_hidden = (hidden,) if hidden_states == "last" else None
        return logits, loss_sum, per_token, new_states, last_hidden if all_hidden is None else tuple(all_hidden)

    def _head(self, hidden: Tensor, shifted_labels: Tensor | None, keep_from: int, predict: bool
              ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None]:
        """What the LM head makes of one chunk's normed hidden states: (logits of positions >= keep_from or None,
        summed loss over labelled positions or None, with `predict` the greedy next token and loss of every
        position)."""
        logits = loss_sum = per_token = None
        length = hidden.shape[1]
        if shifted_labels is not None:
            all_logits = self.lm_head(hidden)
            token_losses = F.cross_entropy(all_logits.float().flatten(0, 1), shifted_labels.flatten(),
                                           ignore_index=-100, reduction="none" if predict else "sum")
            if predict:  # one cross-entropy: the positions' losses, and their sum
                loss_sum = token_losses.sum()
                per_token = (all_logits.argmax(-1).detach(), token_losses.detach().view(shifted_labels.shape))
            else:
                loss_sum = token_losses
            if keep_from < length:
                logits = all_logits[:, keep_from:]
        elif keep_from < length:
            logits = self.lm_head(hidden[:, keep_from:])
        return logits, loss_sum, per_token

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
        completion_ids: torch.LongTensor | None = None,
        completion_mask: Tensor | None = None,
        return_last_hidden_state: bool = False,
        memory_states: dict[int, MemoryState] | None = None,
        **kwargs,
    ) -> "TitansCausalLMOutput":
        """Stream `input_ids` (or `inputs_embeds`, the embeddings of tokens) through the chunks, carrying the
        memory state.

        `labels` are not shifted (position t predicts labels[t + 1], across chunk boundaries too); the loss is the
        mean over labelled positions, or their sum / `num_items_in_batch` when given (gradient accumulation).
        With labels, logits are only returned when `logits_to_keep` > 0 (a 32k x vocab tensor is what chunking
        avoids); `return_predictions` returns the greedy prediction for every labelled token instead
        (`label_predictions[b, t]` predicts `labels[b, t]`, -100 where unlabelled), what `TitansTrainer` hands to
        `compute_metrics` (the name avoids "label": the Trainer takes such arguments for label columns), and
        `return_token_losses` the cross-entropy of every labelled token (`token_losses[b, t]` of predicting
        `labels[b, t]`, 0 where unlabelled), what the per-chunk language-model evaluation sums.
        `output_hidden_states` returns the embeddings and every layer's output over the whole input (the chunks'
        concatenated, the memory's contribution included; the last one normed), as a Qwen model does;
        `return_last_hidden_state` only that last one (`last_hidden_state`), what `base_model` returns, without
        keeping every layer's. `output_attentions=True` (or the config's) is refused: the chunks' attention is no
        map over the input.
        `memory_states` (one `MemoryState` per memory layer, for the batch's rows, e.g. another stream's end,
        detached) start the stream instead of fresh states; the output's `memory_states` then holds the states the
        stream ends in. Not with a `cache` (which holds its own) or rows left-padded off the chunk cycle.

        Each row's chunks start at its own first real token, so a row left-padded by any amount answers as it does
        alone (rows at different places of the chunk cycle run as separate batches: see `padding_multiple`);
        logits and hidden states at padding positions mean nothing (zeros where a row's batch starts after them),
        and padding positions predict no label.
        `position_ids` from callers are ignored: positions restart at every chunk.

        With `completion_ids` [batch, group, tokens] (and `completion_mask`), `input_ids` / `attention_mask` are
        the prompts and the output holds only `completion_log_probs` [batch, group, tokens]: each prompt read once,
        every completion scored from the memory state it leaves (see `completion_log_probs`). This is how the DPO
        and GRPO losses of dpo / grpo rows call the model, so that a DDP or FSDP wrapper sees the call.
        """
        output_attentions = kwargs.get("output_attentions")
        if output_attentions if output_attentions is not None else self.config.output_attentions:
            raise ValueError("forward: output_attentions=True: TitansQwenForCausalLM attends chunk by chunk (each "
                             "chunk over itself, the previous chunk and the memory's prefix tokens; the memory carries "
                             "the rest), so it has no attention map over the input to return")
        if self.training and torch.is_grad_enabled() and self._memory_enabled and not self._warned_frozen_memory:
            self._warn_if_memory_frozen()
        if completion_ids is not None:
            given = [name for name, value in (("labels", labels), ("cache", cache), ("use_cache", use_cache or None),
                                              ("inputs_embeds", inputs_embeds)) if value is not None]
            if given:
                raise ValueError(f"forward: completion_ids score completions of input_ids from a fresh stream; "
                                 f"{', '.join(given)} cannot be given with them")
            return TitansCausalLMOutput(completion_log_probs=self._score_completions(
                input_ids, attention_mask, completion_ids, completion_mask))
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
            if cache is not None or use_cache:
                raise ValueError("forward: memory_states start a stream without a cache; a cache holds its own states")
            if sorted(memory_states) != sorted(int(layer) for layer in self.memory):
                raise ValueError(f"forward: memory_states must hold one state per memory layer "
                                 f"{sorted(int(layer) for layer in self.memory)}, got {sorted(memory_states)}")
            if any(state.batch_size != batch_size or state.position % self.config.memory_config.chunk_size
                   for state in memory_states.values()):
                raise ValueError(f"forward: memory_states must hold {batch_size} rows each, at a chunk boundary")
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

        shifted_labels = None
        if labels is not None:
            if labels.shape != (batch_size, length):
                raise ValueError(f"forward: labels {tuple(labels.shape)} must be [batch, tokens] = "
                                 f"{(batch_size, length)}")
            labels = labels.to(inputs.device)
            shifted_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
            if token_mask is not None:  # padding predicts nothing: a row's first token has no label, as alone
                shifted_labels = shifted_labels.masked_fill(token_mask == 0, -100)

        keep_start = 0 if logits_to_keep == 0 else max(0, length - logits_to_keep)
        if labels is not None and logits_to_keep == 0:
            keep_start = length
        predict = (return_predictions or return_token_losses) and labels is not None
        seen = cache.seen_tokens if cache is not None else 0
        groups = cache.phase_groups if seen else self._phase_groups(token_mask, cache)
        hidden_mode = "all" if output_hidden_states else "last" if return_last_hidden_state else None
        if groups is not None and memory_states is not None:
            raise ValueError("forward: memory_states need rows that start together (right padding, or left padding "
                             f"by whole multiples of padding_multiple = {self.padding_multiple})")
        if groups is None:
            logits, loss_sum, per_token, hidden_states = self._stream(inputs, token_mask, shifted_labels, cache,
                                                                      keep_start, predict, hidden_mode,
                                                                      states=memory_states)
        else:
            logits, loss_sum, per_token, hidden_states = self._stream_groups(
                groups, inputs, token_mask, shifted_labels, seen, keep_start, predict, hidden_mode)
            if cache is not None:
                cache.seen_tokens = seen + length

        loss = None
        if loss_sum is not None:
            if num_items_in_batch is not None:
                if isinstance(num_items_in_batch, Tensor):
                    num_items_in_batch = num_items_in_batch.to(loss_sum.device)
                loss = loss_sum / num_items_in_batch
            else:
                loss = loss_sum / (shifted_labels != -100).sum().clamp(min=1)
        label_predictions = token_losses = None
        if per_token is not None:  # position t - 1 predicts labels[t]
            labelled = labels[:, 1:] != -100
            greedy, losses = per_token
            if return_predictions:
                label_predictions = torch.full_like(labels, -100)
                label_predictions[:, 1:] = torch.where(labelled, greedy[:, :-1], -100)
            if return_token_losses:
                token_losses = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
                token_losses[:, 1:] = losses[:, :-1]
        last_hidden_state = None
        if hidden_mode == "last":
            (last_hidden_state,), hidden_states = hidden_states, None
        return TitansCausalLMOutput(loss=loss, logits=logits, cache=cache, hidden_states=hidden_states,
                                    label_predictions=label_predictions, token_losses=token_losses,
                                    last_hidden_state=last_hidden_state, memory_states=memory_states)

    def _stream_groups(
        self,
        groups: list[PhaseGroup],
        inputs: Tensor,
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        seen: int,
        keep_start: int,
        predict: bool,
        hidden_states: str | None,
    ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None, tuple[Tensor, ...] | None]:
        """`_stream` for each phase group from its phase on (a first call drops the group's first `phase` columns,
        padding in all its rows), each with its own cache, the results put back in the batch's rows and columns."""
        batch_size, length = inputs.shape[:2]
        results = []
        for group in groups:
            skip = max(0, group.phase - seen)
            take = lambda t: None if t is None else t[group.rows, skip:]  # noqa: E731
            results.append((group.rows, skip, self._stream(take(inputs), take(token_mask), take(shifted_labels),
                                                           group.cache, max(0, keep_start - skip), predict,
                                                           hidden_states)))

        def place(parts: list[tuple[Tensor, int, Tensor]], width: int, fill: float) -> Tensor:
            out = parts[0][2].new_full((batch_size, width, *parts[0][2].shape[2:]), fill)
            for rows, column, part in parts:
                out[rows, column:] = part
            return out

        logits = loss_sum = per_token = all_hidden = None
        if results[0][2][0] is not None:
            logits = place([(rows, max(0, skip - keep_start), out[0]) for rows, skip, out in results],
                           length - keep_start, 0.0)
        sums = [out[1] for _, _, out in results if out[1] is not None]
        if sums:
            loss_sum = functools.reduce(torch.add, sums)
        if predict:
            per_token = (place([(rows, skip, out[2][0]) for rows, skip, out in results], length, -100),
                         place([(rows, skip, out[2][1]) for rows, skip, out in results], length, 0.0))
        if hidden_states:
            all_hidden = tuple(place([(rows, skip, out[3][index]) for rows, skip, out in results], length, 0.0)
                               for index in range(len(results[0][2][3])))
        return logits, loss_sum, per_token, all_hidden

    def _stream(
        self,
        inputs: Tensor,
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        cache: TitansCache | None,
        keep_start: int,
        predict: bool,
        hidden_states: str | None,
        carry: dict[str, Any] | None = None,
        states: dict[int, MemoryState] | None = None,
    ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None, tuple[Tensor, ...] | None]:
        """The chunk loop over rows whose chunks line up: (logits of positions >= keep_start or None, summed loss or
        None, with `predict` the greedy next token and loss of every position, with `hidden_states` the per-layer
        hidden states). Continues `cache`'s stream and leaves it after these tokens; without a cache, `carry` (a
        dict) receives the stream's end: the memory `states` and the `previous` chunk (None without
        attend_previous_chunk), what a cache would hold. Given `states` (no cache), the stream starts from them and
        leaves its end in that dict."""
        batch_size, length = inputs.shape[:2]
        given = states
        if cache is not None and cache.memory_states is not None:
            states = cache.memory_states
        elif states is None:
            states = self.init_memory_states(batch_size, inputs.device)
        seen = cache.seen_tokens if cache is not None else 0
        memory = self.config.memory_config
        chunk_size, bptt = memory.chunk_size, memory.bptt_chunks
        use_checkpoint = ((memory.checkpoint_chunks or self.gradient_checkpointing) and self.training
                          and torch.is_grad_enabled() and cache is None)

        if carry is None and self._runs_layer_major(length, cache, use_checkpoint):
            return self._stream_layer_major(inputs, token_mask, shifted_labels, states, keep_start, predict,
                                            hidden_states)

        window = memory.attend_previous_chunk
        # without a cache, the previous chunk's keys travel from piece to piece (with one, the cache holds them)
        previous = PreviousChunk([], None) if window and cache is None else None
        all_logits, per_token, all_hidden, loss_sum, start = [], [], [], None, 0
        geometry: dict = {}  # masks and positions by shape, shared by the chunks of this stream
        while start < length:
            position = seen + start
            end = min(length, start + chunk_size - position % chunk_size)
            starts_chunk = position % chunk_size == 0
            chunk_index = position // chunk_size
            if starts_chunk and cache is not None and position > 0:
                cache.start_new_chunk(
                    functools.partial(self._move_keys, offset=-cache.previous_length) if window else None)
            if bptt and starts_chunk and chunk_index > 0 and chunk_index % bptt == 0:
                states = {layer: state.detach() for layer, state in states.items()}
                previous = previous.detach() if previous is not None else None
            piece = (
                inputs[:, start:end],
                None if token_mask is None else token_mask[:, start:end],
                None if shifted_labels is None else shifted_labels[:, start:end],
                states,
                cache,
                starts_chunk,
                min(end - start, max(0, keep_start - start)),  # the same value for every chunk before keep_start
                self._memory_enabled,
                predict,
                previous,
                hidden_states,
                geometry,
            )
            if use_checkpoint:
                logits, piece_loss, piece_tokens, states, current, piece_hidden = checkpoint(
                    self._forward_piece, *piece, use_reentrant=False)
            else:
                logits, piece_loss, piece_tokens, states, current, piece_hidden = self._forward_piece(*piece)
            if current is not None:  # the next chunk sees this one at the positions before its own
                current.key_values = [(self._move_keys(keys, -previous.length), values)
                                      for keys, values in current.key_values]
                previous = current
            if logits is not None:
                all_logits.append(logits)
            if piece_tokens is not None:
                per_token.append(piece_tokens)
            if piece_hidden is not None:
                all_hidden.append(piece_hidden)
            if piece_loss is not None:
                loss_sum = piece_loss if loss_sum is None else loss_sum + piece_loss
            start = end

        if cache is not None:
            cache.memory_states = states
            cache.seen_tokens = seen + length
        if carry is not None:
            carry.update(states=states, previous=previous)
        if given is not None:
            given.update(states)
        return _joined_stream(all_logits, loss_sum, per_token, all_hidden)

    def _runs_layer_major(self, length: int, cache: TitansCache | None, use_checkpoint: bool) -> bool:
        """Whether `_stream_layer_major` computes this stream: chunks that attend only to themselves (no previous
        chunk, no prefix tokens), no cache, no per-chunk checkpointing or truncated BPTT, more than one chunk, and
        not inside `chunk_by_chunk()` or with `compile_chunks()`."""
        memory = self.config.memory_config
        return (self._layer_major_enabled and self._compiled_chunk_step is None and cache is None
                and not use_checkpoint and not memory.attend_previous_chunk and not memory.bptt_chunks
                and length > memory.chunk_size and not hasattr(self, "persistent_tokens")
                and all(type(block).prefix_tokens is TitansMemoryBlock.prefix_tokens for block in self.memory.values()))

    def _stream_layer_major(
        self,
        inputs: Tensor,
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        states: dict[int, MemoryState],
        keep_start: int,
        predict: bool,
        hidden_states: str | None,
    ) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None, tuple[Tensor, ...] | None]:
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
        all_logits, per_token, all_hidden, loss_sum = [], [], [], None
        for start in range(0, length, segment):
            end = min(length, start + segment)
            hidden = inputs[:, start:end]
            hidden = hidden if hidden.is_floating_point() else self.model.embed_tokens(hidden)
            mask = None if token_mask is None else token_mask[:, start:end]
            # the whole chunks as rows of one batch, the unfinished last chunk (if any) as a batch of its own
            whole = (end - start) // chunk_size * chunk_size
            pieces = []  # (first, stop, rows, (position ids, masks, RoPE)) of each batch
            for first, stop, rows in ((0, whole, batch_size * (whole // chunk_size)), (whole, end - start, batch_size)):
                if stop > first:
                    width = (stop - first) * batch_size // rows
                    piece_mask = None if mask is None else mask[:, first:stop].reshape(rows, width)
                    pieces.append((first, stop, rows, self._chunk_geometry(hidden.new_empty(rows, width, 0),
                                                                           piece_mask, None, 0, geometry)))
            segment_hidden = [hidden] if hidden_states == "all" else None
            for index, decoder_layer in enumerate(self.model.layers):
                def layer(h: Tensor, decoder_layer=decoder_layer, kind=layer_types[index]) -> Tensor:
                    outs = []
                    for first, stop, rows, (position_ids, masks, position_embeddings) in pieces:
                        out = decoder_layer(h[:, first:stop].reshape(rows, -1, h.shape[-1]), attention_mask=masks[kind],
                                            position_ids=position_ids, position_embeddings=position_embeddings)
                        outs.append(out.reshape(batch_size, stop - first, -1))
                    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

                block = self.memory[str(index)] if self._memory_enabled and str(index) in self.memory else None
                if block is None:
                    hidden = layer(hidden)
                else:
                    hidden, states[index] = block(layer, hidden, states[index], mask, 0)
                if segment_hidden is not None:
                    segment_hidden.append(hidden)
            hidden = self.model.norm(hidden)
            if segment_hidden is not None:
                segment_hidden[-1] = hidden
                all_hidden.append(segment_hidden)
            elif hidden_states == "last":
                all_hidden.append([hidden])
            for piece in range(start, end, chunk_size):  # the head chunk by chunk: never [T, vocab] logits at once
                stop = min(end, piece + chunk_size)
                labels = None if shifted_labels is None else shifted_labels[:, piece:stop]
                logits, piece_loss, piece_tokens = self._head(hidden[:, piece - start:stop - start], labels,
                                                              max(0, keep_start - piece), predict)
                if logits is not None:
                    all_logits.append(logits)
                if piece_tokens is not None:
                    per_token.append(piece_tokens)
                if piece_loss is not None:
                    loss_sum = piece_loss if loss_sum is None else loss_sum + piece_loss
        return _joined_stream(all_logits, loss_sum, per_token, all_hidden)

    # ---- generation ----

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
    "TitansBackbone",
    "TitansCache",
    "TitansCausalLMOutput",
    "TitansMemoryOffReference",
    "TitansQwenForCausalLM",
    "TitansQwenPreTrainedModel",
]
