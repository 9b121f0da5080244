"""Configuration of a Qwen causal LM wrapped with Titans neural long-term memory."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from .memory import CONV_INITS

VARIANTS = ("mag", "mac", "mal")
SUPPORTED_BASE_MODEL_TYPES = ("qwen2", "qwen3")

# Every setting that shapes the memory (and so must travel with saved memory weights). `base_model_name_or_path`
# is not one of them: it names where the backbone came from, not how the memory is built.
MEMORY_SETTING_NAMES = (
    "chunk_size",
    "memory_layers",
    "variant",
    "memory_num_heads",
    "memory_head_dim",
    "memory_depth",
    "memory_expansion",
    "conv_kernel",
    "conv_init",
    "memory_chunk_size",
    "memory_batch_size",
    "max_lr",
    "num_memory_tokens",
    "num_persistent_tokens",
    "bptt_chunks",
    "freeze_base",
    "checkpoint_chunks",
)


@strict
class TitansQwenConfig(PreTrainedConfig):
    r"""
    A Qwen2/Qwen3 config (`text_config`) plus the Titans memory settings.

    The Qwen config must live under the name `text_config`: `generate()` builds its cache from
    `config.get_text_config(decoder=True)`, which only looks under a few fixed names.

    Args:
        text_config: the backbone's Qwen2Config / Qwen3Config (or its dict).
        chunk_size: attention segment; attention never reaches across a chunk boundary, the memory does.
        memory_layers: decoder-layer indices that get a memory (default: the middle layer, which learned fastest on
            a frozen base; see `scripts/bench_frozen.py`).
        variant: "mag" (gated parallel branch after the layer), "mac" (memory tokens prefix each chunk),
            "mal" (memory on the residual stream before the layer).
        memory_num_heads / memory_head_dim: memory heads (default head dim 64, heads = hidden // head dim);
            small heads keep the fast weights cheap (a single 896-wide head costs gigabytes).
        memory_depth / memory_expansion: the memory MLP (default depth 1: a linear memory with residual, which
            learned on a frozen base where depth 2 did not on the same budget).
        conv_kernel: causal depthwise convolution on q/k/v; wide enough to hold a fact sentence helps recall.
        conv_init: "window" starts the q/k convolution as a mean over its taps, "identity" as the plain
            projection. On BABILong QA1 the identity start learned only recency (0.54 accuracy, 0.27 where the
            answer is not the last place mentioned) where the window start reached 0.99 (see titans_hf.demo).
        memory_chunk_size: tokens per memory update (the granularity of the inner gradient step).
        memory_batch_size: tokens between refreshes of the point where inner gradients are taken (None: every
            memory chunk).
        max_lr: upper bound of the data-dependent inner learning rate.
        num_memory_tokens / num_persistent_tokens: `mac` prefix sizes.
        bptt_chunks: detach the memory state every this many chunks (None: full backprop through all chunks).
        freeze_base: only memory parameters train; the backbone stays as loaded.
        checkpoint_chunks: recompute each chunk in backward so training memory is one chunk plus memory states.
        base_model_name_or_path: where the backbone was loaded from (hub id or folder), written into saved memory.
    """

    model_type = "titans_qwen"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen3")}

    text_config: dict | PreTrainedConfig | None = None
    chunk_size: int = 4096
    memory_layers: list[int] | None = None
    variant: str = "mag"
    memory_num_heads: int | None = None
    memory_head_dim: int = 64
    memory_depth: int = 1
    memory_expansion: int = 4
    conv_kernel: int = 4
    conv_init: str = "window"
    memory_chunk_size: int = 64
    memory_batch_size: int | None = None
    max_lr: float = 0.1
    num_memory_tokens: int = 0
    num_persistent_tokens: int = 0
    bptt_chunks: int | None = None
    freeze_base: bool = True
    checkpoint_chunks: bool = True
    base_model_name_or_path: str | None = None
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
        num_layers = text.num_hidden_layers
        if self.memory_layers is None:
            self.memory_layers = [num_layers // 2]
        self.memory_layers = sorted(set(self.memory_layers))
        if not self.memory_layers or not all(0 <= layer < num_layers for layer in self.memory_layers):
            raise ValueError(f"memory_layers={self.memory_layers} must be non-empty indices in [0, {num_layers})")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
        if self.memory_num_heads is None:
            self.memory_num_heads = max(1, text.hidden_size // self.memory_head_dim)
        for name in ("chunk_size", "memory_num_heads", "memory_head_dim", "memory_depth", "memory_expansion",
                     "conv_kernel", "memory_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("memory_batch_size", "bptt_chunks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be None or >= 1")
        if self.num_memory_tokens < 0 or self.num_persistent_tokens < 0:
            raise ValueError("num_memory_tokens and num_persistent_tokens must be >= 0")
        if self.variant != "mac" and (self.num_memory_tokens or self.num_persistent_tokens):
            raise ValueError(
                "num_memory_tokens / num_persistent_tokens are only used by variant 'mac', "
                f"got variant={self.variant!r}"
            )
        if self.variant == "mac" and self.num_memory_tokens == 0:
            raise ValueError("variant 'mac' needs num_memory_tokens >= 1 (the memory reaches attention through them)")
        if self.conv_init not in CONV_INITS:
            raise ValueError(f"conv_init={self.conv_init!r} must be one of {CONV_INITS}")
        if not 0 < self.max_lr:
            raise ValueError(f"max_lr={self.max_lr} must be > 0")

    def memory_settings(self) -> dict:
        """The settings that must match for saved memory weights to load."""
        return {name: getattr(self, name) for name in MEMORY_SETTING_NAMES}

    def base_shape(self) -> dict:
        """What a base model must look like for saved memory weights to fit it."""
        text = self.text_config
        return {
            "hidden_size": text.hidden_size,
            "num_hidden_layers": text.num_hidden_layers,
            "vocab_size": text.vocab_size,
            "model_type": text.model_type,
        }


__all__ = ["TitansQwenConfig", "MEMORY_SETTING_NAMES", "VARIANTS"]
