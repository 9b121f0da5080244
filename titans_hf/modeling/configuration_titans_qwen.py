"""Configuration of a Qwen causal LM wrapped with a Titans neural long-term memory."""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from titans_hf.hub import MODEL_TYPE, TitansMemoryConfig

from .memory import CONV_INITS, MEMORY_MODELS, UPDATE_RULES
from .variants import MEMORY_VARIANTS

SUPPORTED_BASE_MODEL_TYPES = ("qwen2", "qwen3")


@strict
class TitansQwenConfig(PreTrainedConfig):
    r"""
    A Qwen2/Qwen3 config (`text_config`) plus the memory's settings (`memory_config`, a `TitansMemoryConfig`).

    The Qwen config must live under the name `text_config`: `generate()` builds its cache from
    `config.get_text_config(decoder=True)`, which only looks under a few fixed names. The memory config is fitted to
    the base on construction: its default layer (the middle one) and head count are filled in, its base shape is
    recorded, and its variant and memory model are checked against their registries.

    Args:
        text_config: the backbone's Qwen2Config / Qwen3Config (or its dict).
        memory_config: a `TitansMemoryConfig` (or its dict); None takes its defaults.
    """

    model_type = MODEL_TYPE
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen3")}

    text_config: dict | PreTrainedConfig | None = None
    memory_config: dict | TitansMemoryConfig | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        text = self.text_config
        if text.model_type not in SUPPORTED_BASE_MODEL_TYPES:
            raise ValueError(
                f"text_config.model_type is {text.model_type!r}; TitansQwen wraps only {SUPPORTED_BASE_MODEL_TYPES}"
            )
        # Tying is decided on the top-level config, but Qwen checkpoints record it in their own config.
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))
        memory = self.memory_config
        if memory is None:
            memory = TitansMemoryConfig()
        elif isinstance(memory, dict):
            memory = TitansMemoryConfig.from_dict(memory, source="memory_config")
        memory = memory.for_base(text)
        for name, value, registry in (("variant", memory.variant, MEMORY_VARIANTS),
                                      ("memory_model", memory.memory_model, MEMORY_MODELS),
                                      ("conv_init", memory.conv_init, CONV_INITS),
                                      ("update_rule", memory.update_rule, UPDATE_RULES)):
            if value not in registry:
                raise ValueError(f"{name}={value!r} must be one of {sorted(registry)}")
        if memory.update_rule == "delta":
            if memory.memory_depth != 1 or memory.memory_batch_size not in (None, memory.memory_chunk_size):
                raise ValueError(f"update_rule='delta' writes the linear memory token by token: it needs "
                                 f"memory_depth=1 and no memory_batch_size (got {memory.memory_depth}, "
                                 f"{memory.memory_batch_size}); set update_rule='gradient' for these settings")
            if memory.max_lr > 0.5:
                raise ValueError(f"update_rule='delta' needs max_lr <= 0.5 (a step 2 theta <= 1 keeps each write a "
                                 f"contraction along its key), got {memory.max_lr}")
        elif memory.max_memory_norm is not None:
            raise ValueError("max_memory_norm bounds the delta rule's state; update_rule='gradient' is bounded by "
                             "its surprise clip and the forget gate")
        MEMORY_VARIANTS[memory.variant].check_config(memory)
        if memory.attend_previous_chunk and set(text.layer_types) != {"full_attention"}:
            raise ValueError(f"attend_previous_chunk needs full-attention layers; this base's layer_types are "
                             f"{sorted(set(text.layer_types))}")
        self.memory_config = memory

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["memory_config"] = self.memory_config.to_dict()
        return output


__all__ = ["TitansQwenConfig"]
