"""A pretrained Qwen2/Qwen3 causal LM that reads long inputs chunk by chunk, with a Titans neural memory carrying
information across chunks.

Attention never reaches across a chunk boundary (positions restart at every chunk), so the backbone runs on the
lengths it was trained on whatever the input length; the memory is the only path from one chunk to the next.
The backbone's modules are used as loaded, under their own state-dict keys (`model.*`, `lm_head.*`).
"""


import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_titans_qwen import MEMORY_SETTING_NAMES, TitansQwenConfig
from .memory import MemoryState, NeuralMemory

MEMORY_WEIGHTS_NAME = "memory_model.safetensors"
MEMORY_CONFIG_NAME = "memory_config.json"
BASE_PREFIXES = ("model.", "lm_head.")


class TitansMemoryBlock(nn.Module):
    """One memory layer: the NeuralMemory plus what the model owns around it.

    `output_weight` (W_O) starts at zero so an untrained block adds exactly nothing. The parameters are direct
    `nn.Parameter`s because transformers only initialises custom modules that own parameters themselves.
    """

    def __init__(self, config: TitansQwenConfig):
        super().__init__()
        hidden = config.text_config.hidden_size
        inner = config.memory_num_heads * config.memory_head_dim
        self.variant = config.variant
        self.neural_memory = NeuralMemory(
            hidden_size=hidden,
            num_heads=config.memory_num_heads,
            head_dim=config.memory_head_dim,
            depth=config.memory_depth,
            expansion=config.memory_expansion,
            conv_kernel=config.conv_kernel,
            conv_init=config.conv_init,
            chunk_size=config.memory_chunk_size,
            batch_size=config.memory_batch_size,
            max_lr=config.max_lr,
        )
        self.output_weight = nn.Parameter(torch.zeros(hidden, inner))
        if config.variant == "mag":
            self.gate_weight = nn.Parameter(torch.zeros(hidden, hidden))
            self.gate_bias = nn.Parameter(torch.zeros(hidden))
        if config.variant == "mac":
            self.memory_queries = nn.Parameter(torch.zeros(config.num_memory_tokens, hidden))

    def project(self, read: Tensor, like: Tensor) -> Tensor:
        """W_O·read in `like`'s dtype (memory parameters may stay fp32 under a bf16 backbone)."""
        return F.linear(read.to(self.output_weight.dtype), self.output_weight).to(like.dtype)

    def gated(self, layer_output: Tensor, read: Tensor) -> Tensor:
        """MAG: the attention branch (the layer's output) gates the memory branch, channel by channel."""
        dtype = self.gate_weight.dtype
        normed = F.rms_norm(layer_output.to(dtype), (layer_output.shape[-1],))
        gate = torch.sigmoid(F.linear(normed, self.gate_weight, self.gate_bias))
        update = gate * F.linear(read.to(dtype), self.output_weight)
        return layer_output + update.to(layer_output.dtype)

    def memory_tokens(self, state: MemoryState, batch_size: int) -> Tensor:
        """MAC memory tokens [B, M, hidden]: learned queries plus W_O·(what the memory returns for them), a pure
        read of the current weights (the queries are not part of the stream: they never write)."""
        queries = self.memory_queries.unsqueeze(0).expand(batch_size, -1, -1)
        read = self.neural_memory.retrieve(self.memory_queries.unsqueeze(0), state)
        return queries + self.project(read, queries)


class TitansCache(DynamicCache):
    """What decoding needs to continue a stream: the current chunk's keys/values (attention never looks further
    back) and every memory layer's state. Its size does not grow with the prompt.

    `get_seq_length()` is the number of tokens seen (what `generate` means by it); the attention layers' own
    offsets come from `get_query_offset()`, the length of the current chunk's keys (prefix included).
    """

    def __init__(self, config: TitansQwenConfig):
        super().__init__(config=config.text_config)
        self.seen_tokens = 0
        self.memory_states: dict[int, MemoryState] | None = None
        self.chunk_attention_mask: Tensor | None = None  # [B, keys in the current chunk], prefix included

    is_croppable = False  # the memory cannot un-write tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx)

    def start_new_chunk(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.chunk_attention_mask = None

    def _select_rows(self, index: Tensor) -> None:
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
        if self.memory_states is not None:  # set together with the chunk mask, by the same forward
            rows = next(iter(self.memory_states.values())).batch_size
            self._select_rows(torch.arange(rows).repeat_interleave(repeats))


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
            init.zeros_(module.output_weight)
            if hasattr(module, "gate_weight"):
                init.normal_(module.gate_weight, std=std)
                init.zeros_(module.gate_bias)
            if hasattr(module, "memory_queries"):
                init.normal_(module.memory_queries, std=std)
        elif isinstance(module, TitansQwenForCausalLM) and hasattr(module, "persistent_tokens"):
            init.normal_(module.persistent_tokens, std=std)
        else:
            super()._init_weights(module)


class TitansQwenForCausalLM(TitansQwenPreTrainedModel, GenerationMixin):
    """Qwen + Titans memory. Build one with `from_base(...)`; `from_pretrained` loads a full saved model.

    Variants, at each layer in `memory_layers`:
    - `mag`: the memory reads the layer's input in parallel with the layer; its output is added after the layer,
      gated by the layer's output (hidden += sigmoid(gate) * W_O·read). W_O starts at zero: an untrained model
      is exactly the base model.
    - `mal`: the memory output is added to the residual stream before the layer (hidden += W_O·read).
    - `mac`: every chunk starts with persistent tokens and memory tokens (learned queries read from the memory)
      prepended at the embeddings; the layer's outputs for the chunk's tokens are written to the memory; the
      prefix positions carry no loss.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_stateful = True  # the memory cannot roll back, so assisted decoding is refused

    def __init__(self, config: TitansQwenConfig, backbone: PreTrainedModel | None = None):
        super().__init__(config)
        text = config.text_config
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
        self.memory = nn.ModuleDict({str(layer): TitansMemoryBlock(config) for layer in config.memory_layers})
        if config.num_persistent_tokens:
            self.persistent_tokens = nn.Parameter(torch.zeros(config.num_persistent_tokens, text.hidden_size))
        self._memory_enabled = True
        self.post_init()
        self._apply_freeze_base()

    def _apply_freeze_base(self) -> None:
        if self.config.freeze_base:
            self.model.requires_grad_(False)
            self.lm_head.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> "TitansQwenForCausalLM":
        # loading swaps in new Parameter objects, which forget the freeze applied in __init__
        model = super().from_pretrained(*args, **kwargs)
        model._apply_freeze_base()
        return model

    # ---- construction and persistence ----

    @classmethod
    def from_base(
        cls,
        base_id_or_path: str | os.PathLike,
        dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        load_kwargs: dict | None = None,
        **memory_settings,
    ) -> "TitansQwenForCausalLM":
        """Wrap a pretrained Qwen2/Qwen3 (hub id or local folder); its weights and keys stay as loaded.

        `memory_settings` are TitansQwenConfig fields (chunk_size, memory_layers, variant, ...); `load_kwargs` go to
        the backbone's `from_pretrained` (revision, token, device_map, ...).
        """
        unknown = sorted(set(memory_settings) - set(MEMORY_SETTING_NAMES))
        if unknown:
            raise ValueError(f"from_base: unknown memory settings {unknown}; valid: {list(MEMORY_SETTING_NAMES)}")
        load_kwargs = dict(load_kwargs or {})
        if dtype is not None:
            load_kwargs["dtype"] = dtype
        if attn_implementation is not None:
            load_kwargs["attn_implementation"] = attn_implementation
        backbone = AutoModelForCausalLM.from_pretrained(base_id_or_path, **load_kwargs)
        if not (hasattr(backbone, "model") and hasattr(backbone, "lm_head")):
            raise ValueError(f"from_base: {base_id_or_path} is a {type(backbone).__name__}, not a Qwen causal LM")
        attention = backbone.config._attn_implementation
        config = TitansQwenConfig(
            text_config=backbone.config, base_model_name_or_path=str(base_id_or_path), **memory_settings
        )
        # building the config resets its sub-config's attention choice; keep the one the backbone was loaded with
        config._attn_implementation = attention
        model = cls(config, backbone=backbone)
        model.to(backbone.device)
        model.generation_config = backbone.generation_config
        return model

    def trainable_memory_state_dict(self) -> dict[str, Tensor]:
        """The memory's own parameters (memory layers, gates, persistent tokens) under their model names: exactly
        what `save_memory` writes. The backbone is never part of it."""
        return {
            name: param.detach() for name, param in self.named_parameters() if not name.startswith(BASE_PREFIXES)
        }

    def load_memory_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        own = self.trainable_memory_state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise ValueError(f"memory state dict does not fit this model: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name, value in state_dict.items():
                if name not in own:
                    continue
                if tuple(value.shape) != tuple(own[name].shape):
                    raise ValueError(
                        f"memory state dict: {name} has shape {tuple(value.shape)}, the model expects "
                        f"{tuple(own[name].shape)} (memory settings differ)"
                    )
                own[name].copy_(value)

    def memory_config_dict(self) -> dict:
        from titans_hf import __version__

        return {
            "base_model_name_or_path": self.config.base_model_name_or_path,
            "model_type": self.config.model_type,
            "titans_hf_version": __version__,
            "memory_settings": self.config.memory_settings(),
            "base_shape": self.config.base_shape(),
        }

    def save_memory(self, save_directory: str | os.PathLike) -> Path:
        """Write only the memory weights (`memory_model.safetensors`) and `memory_config.json` naming the base.

        Each file is written under a temporary name and renamed, so a folder never looks complete half-written.
        """
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: value.to("cpu").contiguous().clone() for name, value in self.trainable_memory_state_dict().items()}
        weights_tmp = folder / f".{MEMORY_WEIGHTS_NAME}.tmp"
        save_file(tensors, str(weights_tmp), metadata={"format": "pt"})
        config_tmp = folder / f".{MEMORY_CONFIG_NAME}.tmp"
        config_tmp.write_text(json.dumps(self.memory_config_dict(), indent=2, sort_keys=True) + "\n")
        # the weights go last: their presence means the folder is complete
        os.replace(config_tmp, folder / MEMORY_CONFIG_NAME)
        os.replace(weights_tmp, folder / MEMORY_WEIGHTS_NAME)
        return folder

    @classmethod
    def from_base_and_memory(
        cls, base_id_or_path: str | os.PathLike, memory_dir: str | os.PathLike, **from_base_kwargs
    ) -> "TitansQwenForCausalLM":
        """Rebuild a model saved with `save_memory` on top of its base; refuses a base of another shape."""
        folder = Path(memory_dir)
        config_path, weights_path = folder / MEMORY_CONFIG_NAME, folder / MEMORY_WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: not found (a memory folder holds {MEMORY_CONFIG_NAME} and "
                                        f"{MEMORY_WEIGHTS_NAME}, written by save_memory)")
        try:
            saved = json.loads(config_path.read_text())
            settings, expected_shape = saved["memory_settings"], saved["base_shape"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{config_path}: not a memory config ({error!r})") from error
        text = AutoConfig.from_pretrained(base_id_or_path, **from_base_kwargs.get("load_kwargs", {}))
        actual_shape = {key: getattr(text, key, None) for key in expected_shape}
        if actual_shape != expected_shape:
            differences = {k: (expected_shape[k], actual_shape[k]) for k in expected_shape
                           if expected_shape[k] != actual_shape[k]}
            raise ValueError(
                f"{config_path}: memory was trained on a base of shape {expected_shape}, but {base_id_or_path} has "
                f"{actual_shape} (saved vs actual: {differences})"
            )
        model = cls.from_base(base_id_or_path, **from_base_kwargs, **settings)
        model.load_memory_state_dict(load_file(str(weights_path)))
        return model

    def push_memory_to_hub(self, repo_id: str, **kwargs) -> str:
        """Save the memory into a temporary folder and upload it with its model card (see `titans_hf.hub`)."""
        import tempfile

        from titans_hf.hub import push_memory_folder

        with tempfile.TemporaryDirectory() as folder:
            self.save_memory(folder)
            return push_memory_folder(folder, repo_id, **kwargs)

    @contextlib.contextmanager
    def memory_disabled(self) -> Iterator["TitansQwenForCausalLM"]:
        """The ablation: the model runs as its frozen base does, chunk by chunk. Memory reads are skipped (the same
        as zero reads, and cheaper), and `mac` puts neither persistent nor memory tokens in front of the chunks."""
        previous = self._memory_enabled
        self._memory_enabled = False
        try:
            yield self
        finally:
            self._memory_enabled = previous

    # ---- forward ----

    def init_memory_states(self, batch_size: int, device: torch.device | None = None) -> dict[int, MemoryState]:
        return {int(layer): block.neural_memory.init_state(batch_size, device) for layer, block in self.memory.items()}

    def _attention_masks(self, hidden: Tensor, attention_mask: Tensor | None, cache: TitansCache | None,
                         position_ids: Tensor) -> dict:
        text = self.config.text_config
        kwargs = dict(config=text, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                      position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in text.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def _forward_piece(
        self,
        input_ids: Tensor,
        token_mask: Tensor | None,
        shifted_labels: Tensor | None,
        states: dict[int, MemoryState],
        cache: TitansCache | None,
        starts_chunk: bool,
        keep_from: int,
        enabled: bool,
    ) -> tuple[Tensor | None, Tensor | None, dict[int, MemoryState]]:
        """Run tokens that lie inside one chunk. Returns (logits of positions >= keep_from or None, summed loss over
        labelled positions or None, new memory states). Kept separate so it can be checkpointed as one unit; hence
        `enabled` is an argument: the recomputation in backward may run after `memory_disabled()` has exited."""
        batch_size, length = input_ids.shape
        variant = self.config.variant
        hidden = self.model.embed_tokens(input_ids)
        num_prefix = 0
        new_mask = token_mask
        if variant == "mac" and starts_chunk and enabled:  # memory off: no prefix, the chunk as the base sees it
            parts = [self.persistent_tokens.unsqueeze(0).expand(batch_size, -1, -1)] if hasattr(
                self, "persistent_tokens") else []
            parts += [block.memory_tokens(states[int(layer)], batch_size)
                      for layer, block in self.memory.items()]
            prefix = torch.cat(parts, dim=1).to(hidden.dtype)
            num_prefix = prefix.shape[1]
            hidden = torch.cat([prefix, hidden], dim=1)
            if token_mask is not None:
                new_mask = torch.cat([token_mask.new_ones(batch_size, num_prefix), token_mask], dim=1)
        past = 0
        attention_mask = new_mask
        if cache is not None:
            past = cache.get_query_offset()
            if new_mask is None and cache.chunk_attention_mask is None:
                attention_mask = None
            else:
                full = new_mask if new_mask is not None else torch.ones(
                    batch_size, hidden.shape[1], dtype=torch.long, device=hidden.device)
                previous = cache.chunk_attention_mask
                if previous is None and past:
                    previous = full.new_ones(batch_size, past)
                attention_mask = full if previous is None else torch.cat([previous, full], dim=1)
                cache.chunk_attention_mask = attention_mask
        position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = self._attention_masks(hidden, attention_mask, cache, position_ids)
        position_embeddings = self.model.rotary_emb(hidden, position_ids)

        new_states = dict(states)
        layer_types = self.config.text_config.layer_types
        for index, decoder_layer in enumerate(self.model.layers):
            block = self.memory[str(index)] if str(index) in self.memory else None
            read = None
            if block is not None and enabled and variant in ("mag", "mal"):
                read, new_states[index] = block.neural_memory(hidden, states[index], token_mask)
                if variant == "mal":
                    hidden = hidden + block.project(read, hidden)
            output = decoder_layer(
                hidden,
                attention_mask=masks[layer_types[index]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
            )
            if read is not None and variant == "mag":
                output = block.gated(output, read)
            if block is not None and enabled and variant == "mac":
                _, new_states[index] = block.neural_memory(output[:, num_prefix:], states[index], token_mask)
            hidden = output
        hidden = self.model.norm(hidden[:, num_prefix:])

        logits = loss_sum = None
        if shifted_labels is not None:
            all_logits = self.lm_head(hidden)
            loss_sum = F.cross_entropy(all_logits.float().flatten(0, 1), shifted_labels.flatten(), ignore_index=-100,
                                       reduction="sum")
            if keep_from < length:
                logits = all_logits[:, keep_from:]
        elif keep_from < length:
            logits = self.lm_head(hidden[:, keep_from:])
        return logits, loss_sum, new_states

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: TitansCache | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Stream `input_ids` through the chunks, carrying the memory state.

        `labels` are not shifted (position t predicts labels[t + 1], across chunk boundaries too); the loss is the
        mean over labelled positions, or their sum / `num_items_in_batch` when given (gradient accumulation).
        With labels, logits are only returned when `logits_to_keep` > 0 (a 32k x vocab tensor is what chunking
        avoids). `position_ids` from callers are ignored: positions restart at every chunk.
        """
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError("forward: input_ids must be a [batch, tokens >= 1] LongTensor")
        batch_size, length = input_ids.shape
        if cache is not None and not isinstance(cache, TitansCache):
            raise ValueError(f"forward: cache must be a TitansCache, got {type(cache).__name__}")
        if cache is None and use_cache:
            cache = TitansCache(self.config)

        token_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] < length:
                raise ValueError(f"forward: attention_mask must be [batch, >= {length}] (2D, 1 = token, 0 = padding), "
                                 f"got {tuple(attention_mask.shape)}")
            token_mask = attention_mask[:, -length:].to(input_ids.device)
            if bool(token_mask.all()):
                token_mask = None  # the common case: skip every masking path

        shifted_labels = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"forward: labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
            shifted_labels = F.pad(labels[:, 1:], (0, 1), value=-100).to(input_ids.device)

        if cache is not None and cache.memory_states is not None:
            states = cache.memory_states
        else:
            states = self.init_memory_states(batch_size, input_ids.device)
        seen = cache.seen_tokens if cache is not None else 0
        chunk_size, bptt = self.config.chunk_size, self.config.bptt_chunks
        keep_start = 0 if logits_to_keep == 0 else max(0, length - logits_to_keep)
        if labels is not None and logits_to_keep == 0:
            keep_start = length
        use_checkpoint = (self.config.checkpoint_chunks and self.training and torch.is_grad_enabled()
                          and cache is None)

        all_logits, loss_sum, start = [], None, 0
        while start < length:
            position = seen + start
            end = min(length, start + chunk_size - position % chunk_size)
            starts_chunk = position % chunk_size == 0
            chunk_index = position // chunk_size
            if starts_chunk and cache is not None and position > 0:
                cache.start_new_chunk()
            if bptt and starts_chunk and chunk_index > 0 and chunk_index % bptt == 0:
                states = {layer: state.detach() for layer, state in states.items()}
            piece = (
                input_ids[:, start:end],
                None if token_mask is None else token_mask[:, start:end],
                None if shifted_labels is None else shifted_labels[:, start:end],
                states,
                cache,
                starts_chunk,
                max(0, keep_start - start),
                self._memory_enabled,
            )
            if use_checkpoint:
                logits, piece_loss, states = checkpoint(self._forward_piece, *piece, use_reentrant=False)
            else:
                logits, piece_loss, states = self._forward_piece(*piece)
            if logits is not None:
                all_logits.append(logits)
            if piece_loss is not None:
                loss_sum = piece_loss if loss_sum is None else loss_sum + piece_loss
            start = end

        if cache is not None:
            cache.memory_states = states
            cache.seen_tokens = seen + length

        loss = None
        if loss_sum is not None:
            if num_items_in_batch is not None:
                if isinstance(num_items_in_batch, Tensor):
                    num_items_in_batch = num_items_in_batch.to(loss_sum.device)
                loss = loss_sum / num_items_in_batch
            else:
                loss = loss_sum / (shifted_labels != -100).sum().clamp(min=1)
        logits = None
        if all_logits:
            logits = all_logits[0] if len(all_logits) == 1 else torch.cat(all_logits, dim=1)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

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


__all__ = ["TitansQwenForCausalLM", "TitansQwenPreTrainedModel", "TitansCache", "TitansMemoryBlock"]
