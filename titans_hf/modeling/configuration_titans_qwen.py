"""Configuration of a Qwen causal LM wrapped with a Titans neural long-term memory."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from titans_hf import __version__
from titans_hf.files import atomic_write_json

from .memory_folder import MEMORY_CONFIG_NAME, hub_file
from .update_rules import UPDATE_RULES, UpdateRule

MODEL_TYPE = "titans_qwen"
BASE_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
SUPPORTED_BASE_MODEL_TYPES = ("qwen2", "qwen3")
# The names the memory settings choose from, each the keys of the registry that implements it (the config imports no
# model code; tests/test_memory.py holds each equal to its registry's keys). The update rules' names are the keys of
# UPDATE_RULES, which holds each rule's defaults and limits (update_rules.py): those of ops.UPDATE_OPS.
VARIANTS = ("mag", "mal", "mac")  # variants.MEMORY_VARIANTS
MEMORY_MODEL_NAMES = ("mlp",)  # memory.MEMORY_MODELS
CONV_INITS = ("identity", "window", "shifted")  # NeuralMemory.reset_parameters
# The format of a saved memory config. A file of this format holds every field (to_dict writes them all), and one that
# lacks a field is refused; a file without `format_version` was written before titans_hf's first release (0.3.0) and is
# refused. A new field means a new format number: files of the older formats then get, when they lack it, the value
# older memories had.
MEMORY_CONFIG_FORMAT_VERSION = 1
# The largest magnitude a float32 holds: the gate biases are float32 parameters and the loss a float32 sum, so a
# number past it cannot reach them (and max_memory_norm past it makes the rescale 0 / inf: a memory wiped every chunk).
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")


@dataclass
class TitansMemoryConfig:
    """Every setting of a Titans memory, and the base model it belongs to (PEFT's adapter config, for a memory).

    The single source of the memory settings: `TitansQwenConfig.memory_config`, the `titans-hf train` flags (each
    field's `help`), the model card and the checkpoints all read them from here. Construction checks every setting
    and every limit of its update rule, and resolves each per-rule default left None (`theta_bias_init`,
    `write_cost`, `max_memory_norm`) into the field, once: what reads the config (the model's `NeuralMemory`, the
    card, a saved `memory_config.json`) takes the values as they are. `memory_layers` and
    `memory_num_heads` may stay None until the config meets a base (`TitansQwenConfig` resolves them: the middle
    layer; hidden size // head dim).

    Args:
        chunk_size (`int`, *optional*, defaults to 4096):
            Attention segment in tokens; attention reaches at most one chunk back, the memory further.
        memory_layers (`list[int]`, *optional*, defaults to `None`):
            Decoder layers that get a memory; None: the middle layer.
        variant (`str`, *optional*, defaults to `"mag"`):
            How the memory joins its layer: "mag" (a gated branch beside the layer), "mal" (on the residual stream
            before it) or "mac" (memory tokens in front of each chunk).
        memory_model (`str`, *optional*, defaults to `"mlp"`):
            What the memory is: "mlp", an MLP of `memory_depth` layers with a residual, whose weights learn at test
            time.
        memory_num_heads (`int`, *optional*, defaults to `None`):
            Memory heads; None: hidden size // `memory_head_dim`.
        memory_head_dim (`int`, *optional*, defaults to 64):
            Size of one memory head.
        memory_depth (`int`, *optional*, defaults to 1):
            Layers of the memory MLP (1: linear with residual).
        memory_expansion (`int`, *optional*, defaults to 4):
            Hidden width of the memory MLP, in head sizes.
        conv_kernel (`int`, *optional*, defaults to 4):
            Causal depthwise convolution over queries, keys and values, in tokens.
        conv_init (`str`, *optional*, defaults to `"window"`):
            Start of the query / key convolution: "window" (the mean over its taps), "shifted" (keys the mean of the
            `conv_kernel` - 1 tokens before their own, queries of those up to their own: a read returns the token
            that followed the same context; needs `conv_kernel` >= 2) or "identity".
        memory_chunk_size (`int`, *optional*, defaults to 64):
            Tokens per memory update chunk: a token reads the weights its chunk started with.
        memory_batch_size (`int`, *optional*, defaults to `None`):
            Tokens between refreshes of the point where inner gradients are taken, a multiple of
            `memory_chunk_size` (the delta rule: `memory_chunk_size` itself); None: every update.
        update_rule (`str`, *optional*, defaults to `"delta"`):
            How the memory writes: "delta" (each token's step at the weights the tokens before it left, its norm
            bounded by `max_memory_norm`) or "gradient" (Titans' chunked rule, with momentum).
        max_lr (`float`, *optional*, defaults to 0.5):
            Upper bound of the data-dependent inner learning rate theta, at most the rule's `UpdateRule.max_lr`
            (delta: 0.5; gradient: 1e6, where its clipped step can still be computed).
        max_memory_norm (`float`, *optional*, defaults to `None`):
            delta: each head's fast weights are rescaled to this Frobenius norm whenever an update leaves them above
            it; None: 4 * sqrt(`memory_head_dim`) (`UpdateRule.memory_norm_per_sqrt_head_dim`), the value the config
            then holds (and saves). The gradient rule has no such bound: None.
        theta_bias_init (`float`, *optional*, defaults to `None`):
            Initial bias of the write gate: theta starts near `max_lr` * sigmoid(`theta_bias_init`); None: the value
            each rule was measured with (`UpdateRule.theta_bias_init`: -6 for delta, -2 for gradient).
        forget_bias_init (`float`, *optional*, defaults to -30.0):
            Initial bias of the forget gate (-30: no forgetting).
        write_cost (`float`, *optional*, defaults to `None`):
            Weight of the write cost, `write_cost` * mean(theta / `max_lr`) over the memory layers, heads and real
            tokens, that a training forward with labels adds to its loss; None: the value each rule was measured
            with (`UpdateRule.write_cost`: 1 for delta, 0 for gradient).
        num_memory_tokens (`int`, *optional*, defaults to 0):
            mac: memory tokens read at the start of a chunk.
        num_persistent_tokens (`int`, *optional*, defaults to 0):
            mac: learned tokens in front of every chunk.
        attend_previous_chunk (`bool`, *optional*, defaults to `True`):
            Each chunk's attention also sees the previous chunk's keys and values; false: chunk-local attention.
        bptt_chunks (`int`, *optional*, defaults to `None`):
            Detach the memory state every this many chunks; None: backpropagate through all of them.
        freeze_base (`bool`, *optional*, defaults to `True`):
            Train only the memory; the base stays as loaded (and a save holds the memory alone).
        checkpoint_chunks (`bool`, *optional*, defaults to `True`):
            Recompute each chunk in backward: training holds one chunk's activations plus the memory states.
        base_model_name_or_path (`str`, *optional*, defaults to `None`):
            The base the memory belongs to: a Hub id, or a local folder's absolute path (set by `from_base`).
        revision (`str`, *optional*, defaults to `None`):
            The base's git revision on the Hub.
        base_shape (`dict`, *optional*, defaults to `None`):
            The base's `model_type`, `hidden_size`, `num_hidden_layers` and `vocab_size`, recorded when the config
            meets a base; a base of another shape is refused.
        base_fingerprint (`str`, *optional*, defaults to `None`):
            A local base's fingerprint (64 hex digits), so that the memory never loads on another model silently.
        titans_hf_version (`str`, *optional*, defaults to the installed version):
            The titans_hf version that wrote the config.
    """

    chunk_size: int = field(default=4096, metadata={"help": "Attention segment in tokens; attention reaches at most "
                                                            "one chunk back (attend_previous_chunk), the memory further."})
    memory_layers: list[int] | None = field(default=None, metadata={
        "help": "Decoder layers that get a memory (default: the middle layer, the one a frozen base learned to use "
                "fastest)."})
    variant: str = field(default="mag", metadata={
        "help": "How the memory joins its layer: mag (a gated branch beside the layer), mal (on the residual "
                "stream before it) or mac (memory tokens in front of each chunk)."})
    memory_model: str = field(default="mlp", metadata={
        "help": "What the memory is: mlp (an MLP of memory_depth layers with a residual, whose weights learn at "
                "test time)."})
    memory_num_heads: int | None = field(default=None, metadata={
        "help": "Memory heads (default: hidden size // memory_head_dim); small heads keep the fast weights cheap."})
    memory_head_dim: int = field(default=64, metadata={"help": "Size of one memory head."})
    memory_depth: int = field(default=1, metadata={"help": "Layers of the memory MLP (1: linear with residual)."})
    memory_expansion: int = field(default=4, metadata={"help": "Hidden width of the memory MLP, in head sizes."})
    conv_kernel: int = field(default=4, metadata={
        "help": "Causal depthwise convolution over q/k/v, in tokens; one wide enough to span a fact sentence "
                "helps recall."})
    conv_init: str = field(default="window", metadata={
        "help": "Start of the q/k convolution: window (mean over its taps), shifted (keys: the mean of the tokens "
                "before their own; queries: of those up to their own; a read returns what followed the same context) "
                "or identity (the plain projection)."})
    memory_chunk_size: int = field(default=64, metadata={
        "help": "Tokens per update chunk: a token reads the weights its chunk started with (with the delta rule "
                "every token still takes its own step)."})
    memory_batch_size: int | None = field(default=None, metadata={
        "help": "Tokens between refreshes of the point where inner gradients are taken, a multiple of "
                "memory_chunk_size (None: every update)."})
    update_rule: str = field(default="delta", metadata={
        "help": "How the memory writes: delta (each token's step at the weights the tokens before it left, a "
                "contraction along its key; the state's norm stays under max_memory_norm) or gradient (Titans' "
                "chunked rule: every token's gradient at its chunk's starting weights, clipped, with momentum)."})
    max_lr: float = field(default=0.5, metadata={
        "help": "Upper bound of the data-dependent inner learning rate theta (delta: at most 0.5, a step 2 theta "
                "<= 1; gradient: at most 1e6, where its clipped step can still be computed in float32)."})
    max_memory_norm: float | None = field(default=None, metadata={
        "help": "delta: each head's fast weights are rescaled to this Frobenius norm whenever an update leaves "
                "them above it (None: 4 * sqrt(memory_head_dim))."})
    theta_bias_init: float | None = field(default=None, metadata={
        "help": "Initial bias of the write gate: theta starts near max_lr * sigmoid(theta_bias_init) (default: -6 "
                "with the delta rule, a write that starts almost closed and opens where the loss needs it; -2 with "
                "the gradient rule)."})
    forget_bias_init: float = field(default=-30.0, metadata={
        "help": "Initial bias of the forget gate: alpha starts near sigmoid(forget_bias_init) per memory update "
                "(-30: no forgetting, and no gradient to raise it; a new value for a key replaces the old through "
                "the update rule)."})
    write_cost: float | None = field(default=None, metadata={
        "help": "Weight of the write cost, write_cost * mean(theta / max_lr) over the memory layers, heads and real "
                "tokens, that a training forward with labels adds to its loss: training then opens the write gate "
                "only where the loss gains from it, and the tokens between facts write little over them (default: "
                "1 with the delta rule, 0 with the gradient rule)."})
    num_memory_tokens: int = field(default=0, metadata={"help": "mac: memory tokens read at the start of a chunk."})
    num_persistent_tokens: int = field(default=0, metadata={"help": "mac: learned tokens prefixing every chunk."})
    attend_previous_chunk: bool = field(default=True, metadata={
        "help": "Each chunk's attention also sees the previous chunk's keys and values (a sliding window, as in "
                "Titans' MAG); positions stay within two chunks, the cache within two chunks' keys. On by default: "
                "it lowers the loss where chunks meet (docs/recall.md); false for chunk-local attention."})
    bptt_chunks: int | None = field(default=None, metadata={
        "help": "Detach the memory state every this many chunks (None: backpropagate through all of them)."})
    freeze_base: bool = field(default=True, metadata={"help": "Train only the memory; the base stays as loaded."})
    checkpoint_chunks: bool = field(default=True, metadata={
        "help": "Recompute each chunk in backward: training memory is one chunk plus the memory states."})
    base_model_name_or_path: str | None = None
    revision: str | None = None
    base_shape: dict[str, Any] | None = None
    base_fingerprint: str | None = None
    titans_hf_version: str = __version__

    # the settings whose None resolves to a value of the update rule's (`__post_init__`)
    PER_RULE_FIELDS: ClassVar[tuple[str, ...]] = ("theta_bias_init", "write_cost", "max_memory_norm")
    BASE_FIELDS: ClassVar[tuple[str, ...]] = ("base_model_name_or_path", "revision", "base_shape",
                                              "base_fingerprint", "titans_hf_version")

    def __post_init__(self) -> None:
        self._check_types()
        self._check_choices()
        rule = UPDATE_RULES[self.update_rule]
        self._resolve_rule_defaults(rule)
        self._check_numbers()
        self._check_rule_limits(rule)
        self._check_variant()
        self._check_base()

    def _check_types(self) -> None:
        """Every field of its type: integers within their lower bounds, strings, true or false, a git revision and a
        fingerprint of their forms."""
        def integer(name: str, low: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}{' or None' if optional else ''}")

        for name in ("chunk_size", "memory_head_dim", "memory_depth", "memory_expansion", "conv_kernel",
                     "memory_chunk_size"):
            integer(name, 1)
        for name in ("memory_num_heads", "memory_batch_size", "bptt_chunks"):
            integer(name, 1, optional=True)
        for name in ("num_memory_tokens", "num_persistent_tokens"):
            integer(name, 0)
        for name in ("variant", "memory_model", "conv_init", "update_rule", "titans_hf_version"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a string")
        for name in ("base_model_name_or_path", "revision", "base_fingerprint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a string or None")
        if self.revision is not None and (not _REVISION.fullmatch(self.revision) or ".." in self.revision):
            raise ValueError(f"revision={self.revision!r} is not a git revision (a branch, tag or commit: letters, "
                             "digits and . _ - /, no '..')")
        if self.base_fingerprint is not None and not re.fullmatch(r"[0-9a-f]{64}", self.base_fingerprint):
            raise ValueError(f"base_fingerprint={self.base_fingerprint!r} must be 64 hex digits")
        for name in ("freeze_base", "checkpoint_chunks", "attend_previous_chunk"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")

    def _check_choices(self) -> None:
        """Each name one its registry holds (an unknown update rule is refused here, named), a convolution the shifted
        start fits in; the memory batch whole update chunks."""
        for name, choices in (("variant", VARIANTS), ("memory_model", MEMORY_MODEL_NAMES), ("conv_init", CONV_INITS),
                              ("update_rule", UPDATE_RULES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {sorted(choices)}")
        if self.conv_init == "shifted" and self.conv_kernel < 2:
            raise ValueError(f"conv_init='shifted' keys the tokens before their own: it needs conv_kernel >= 2, got "
                             f"{self.conv_kernel}")
        if self.memory_batch_size is not None and self.memory_batch_size % self.memory_chunk_size:
            raise ValueError(f"memory_batch_size={self.memory_batch_size!r} must be a multiple of memory_chunk_size "
                             f"({self.memory_chunk_size}) and at least it: the point where inner gradients are taken "
                             "moves only where an update chunk ends")

    def _resolve_rule_defaults(self, rule: UpdateRule) -> None:
        """The settings left None (`PER_RULE_FIELDS`) take the update rule's values; `max_memory_norm` stays None
        under a rule without a norm bound."""
        if self.theta_bias_init is None:
            self.theta_bias_init = rule.theta_bias_init
        if self.write_cost is None:
            self.write_cost = rule.write_cost
        if self.max_memory_norm is None and rule.memory_norm_per_sqrt_head_dim is not None:
            self.max_memory_norm = rule.memory_norm_per_sqrt_head_dim * math.sqrt(self.memory_head_dim)

    def _check_numbers(self) -> None:
        """The real-valued settings finite floats within float32's range; `max_lr` and `max_memory_norm` positive,
        `write_cost` not negative."""
        for name in ("max_lr", "max_memory_norm", "theta_bias_init", "forget_bias_init", "write_cost"):
            value = getattr(self, name)
            if value is None and name == "max_memory_norm":  # a rule without a norm bound
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or abs(value) > FLOAT32_MAX):
                raise ValueError(f"{name}={value!r} must be a finite number within float32's range (|value| <= "
                                 f"{FLOAT32_MAX:.4g}), the precision the memory computes in")
            setattr(self, name, float(value))
        for name in ("max_lr", "max_memory_norm"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.write_cost < 0:
            raise ValueError(f"write_cost={self.write_cost!r} must be >= 0 (a weight on the loss)")

    def _check_rule_limits(self, rule: UpdateRule) -> None:
        """The update rule's limits: the memories it runs on, its largest `max_lr`, its norm bound or none."""
        if rule.writes_every_token and (self.memory_model != "mlp" or self.memory_depth != 1
                                        or self.memory_batch_size not in (None, self.memory_chunk_size)):
            chunked = " or ".join(f"update_rule={name!r}" for name, other in UPDATE_RULES.items()
                                  if not other.writes_every_token)
            raise ValueError(f"update_rule={rule.name!r} writes the linear memory token by token: it needs "
                             f"memory_model='mlp', memory_depth=1 and no memory_batch_size (got "
                             f"{self.memory_model!r}, {self.memory_depth}, {self.memory_batch_size}); set {chunked} "
                             "for these settings")
        if self.max_lr > rule.max_lr:
            raise ValueError(f"max_lr={self.max_lr!r}: update_rule={rule.name!r} needs max_lr <= {rule.max_lr:g} "
                             f"({rule.max_lr_reason})")
        if rule.memory_norm_per_sqrt_head_dim is None and self.max_memory_norm is not None:
            bounded = " / ".join(name for name, other in UPDATE_RULES.items()
                                 if other.memory_norm_per_sqrt_head_dim is not None)
            raise ValueError(f"max_memory_norm bounds the {bounded} rule's state; update_rule={rule.name!r} is "
                             f"bounded by {rule.bounded_by}")

    def _check_variant(self) -> None:
        """mac's memory tokens, and no prefix tokens for the other variants."""
        if self.variant == "mac":
            if self.num_memory_tokens < 1:
                raise ValueError("variant 'mac' needs num_memory_tokens >= 1 (the memory reaches attention through "
                                 "them)")
        elif self.num_memory_tokens or self.num_persistent_tokens:
            raise ValueError(f"num_memory_tokens / num_persistent_tokens are only used by variant 'mac', got "
                             f"variant={self.variant!r}")

    def _check_base(self) -> None:
        """The memory's layers (sorted, once each) and the base's recorded shape."""
        if self.memory_layers is not None:
            if (not isinstance(self.memory_layers, (list, tuple)) or not self.memory_layers
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.memory_layers)):
                raise ValueError(f"memory_layers={self.memory_layers!r} must be a non-empty list of layer indices")
            self.memory_layers = sorted(set(self.memory_layers))
        if self.base_shape is not None:
            if not isinstance(self.base_shape, dict) or set(self.base_shape) != set(BASE_SHAPE_KEYS):
                raise ValueError(f"base_shape={self.base_shape!r} must hold exactly {list(BASE_SHAPE_KEYS)}")
            if not isinstance(self.base_shape["model_type"], str) or not all(
                    isinstance(self.base_shape[key], int) and not isinstance(self.base_shape[key], bool)
                    for key in BASE_SHAPE_KEYS[1:]):
                raise ValueError(f"base_shape={self.base_shape!r}: model_type is a string, the sizes integers")

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The settings that shape the memory (every field but the base's)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.BASE_FIELDS)

    def memory_settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.setting_names()}

    def to_dict(self) -> dict[str, Any]:
        """Every field, and the format they are written in (`format_version`): what `memory_config.json` holds."""
        return {"format_version": MEMORY_CONFIG_FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: Any, source: str = "memory config") -> "TitansMemoryConfig":
        """Build from a dict of known settings only; anything else is a ValueError naming `source`.

        Two kinds of dict: a saved config (it carries `format_version` or `titans_hf_version`, as `to_dict` writes
        them) must be of the current format and hold every field, so that nothing in it falls back to a default that
        could change its meaning (one without `format_version` was written before titans_hf's first release, 0.3.0,
        and is refused); any other dict holds settings over the defaults (what `from_base(**settings)` passes)."""
        if not isinstance(values, dict):
            raise ValueError(f"{source}: expected a JSON object of memory settings, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known - {"format_version"})
        if unknown:
            raise ValueError(f"{source}: unknown memory setting(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        if "format_version" in values or "titans_hf_version" in values:
            if "format_version" not in values:
                raise ValueError(f"{source}: no format_version: the memory config is from before titans_hf's first "
                                 "release (0.3.0), when a setting a file lacked took a default that has changed since; "
                                 "it must be saved again (TitansMemoryConfig(...).save_pretrained) by titans_hf 0.3.0 "
                                 "or later")
            version = values.pop("format_version")
            if version != MEMORY_CONFIG_FORMAT_VERSION or isinstance(version, bool):
                raise ValueError(f"{source}: format_version={version!r}; this titans_hf ({__version__}) reads memory "
                                 f"configs of format {MEMORY_CONFIG_FORMAT_VERSION} (a newer titans_hf wrote it, or "
                                 "the file was edited)")
            missing = sorted(known - set(values))
            if missing:
                raise ValueError(f"{source}: {', '.join(missing)} missing: a memory config of format_version "
                                 f"{version} holds every field, and a default in place of one may not be what the "
                                 "memory was trained with (the file was edited or cut short)")
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error}") from error

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write `memory_config.json` into `save_directory` (atomically)."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        return atomic_write_json(folder / MEMORY_CONFIG_NAME, self.to_dict())

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, revision: str | None = None,
                        **hub_kwargs: Any) -> "TitansMemoryConfig":
        """Read `memory_config.json` from a memory folder or Hub repository (see `hub_file`)."""
        return read_memory_config(hub_file(name_or_path, MEMORY_CONFIG_NAME, revision=revision, **hub_kwargs))

    def for_base(self, base_config: Any) -> "TitansMemoryConfig":
        """This config fitted to a base model's config: default layer and heads filled in, the base's shape
        recorded; a memory made for a base of another shape is refused."""
        shape = {key: getattr(base_config, key, None) for key in BASE_SHAPE_KEYS}
        if self.base_shape is not None and self.base_shape != shape:
            differing = {key: (self.base_shape[key], shape[key]) for key in BASE_SHAPE_KEYS
                         if self.base_shape[key] != shape[key]}
            raise ValueError(f"the memory was made for a base of shape {self.base_shape}, this base has {shape} "
                             f"(memory's vs this base's: {differing})")
        layers = self.memory_layers if self.memory_layers is not None else [base_config.num_hidden_layers // 2]
        outside = [layer for layer in layers if layer >= base_config.num_hidden_layers]
        if outside:
            raise ValueError(f"memory_layers={layers}: the base has layers 0..{base_config.num_hidden_layers - 1}")
        heads = self.memory_num_heads or max(1, base_config.hidden_size // self.memory_head_dim)
        return dataclasses.replace(self, memory_layers=layers, memory_num_heads=heads, base_shape=shape)


def read_memory_config(path: str | os.PathLike) -> TitansMemoryConfig:
    """A `TitansMemoryConfig` from a JSON file; any problem is a ValueError naming the file."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON memory config ({error})") from error
    return TitansMemoryConfig.from_dict(values, source=str(path))


@strict
class TitansQwenConfig(PreTrainedConfig):
    r"""
    A Qwen2/Qwen3 config (`text_config`) plus the memory's settings (`memory_config`, a `TitansMemoryConfig`).

    The Qwen config must live under the name `text_config`: `generate()` builds its cache from
    `config.get_text_config(decoder=True)`, which only looks under a few fixed names. The memory config is fitted to
    the base on construction: its default layer (the middle one) and head count are filled in, its base shape is
    recorded (`TitansMemoryConfig` itself checks every setting).

    Args:
        text_config: the backbone's Qwen2Config / Qwen3Config (or its dict).
        memory_config: a `TitansMemoryConfig` (or its dict); None takes its defaults.
    """

    model_type = MODEL_TYPE
    # what the Trainer's prediction_step leaves out of the predictions it gathers (its default is ["cache"])
    keys_to_ignore_at_inference = ["cache", "memory_states", "write_rate"]
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
        memory_config = self.memory_config
        if memory_config is None:
            memory_config = TitansMemoryConfig()
        elif isinstance(memory_config, dict):
            memory_config = TitansMemoryConfig.from_dict(memory_config, source="memory_config")
        memory_config = memory_config.for_base(text)
        if memory_config.attend_previous_chunk and set(text.layer_types) != {"full_attention"}:
            raise ValueError(f"attend_previous_chunk needs full-attention layers; this base's layer_types are "
                             f"{sorted(set(text.layer_types))}")
        self.memory_config = memory_config

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["memory_config"] = self.memory_config.to_dict()
        return output


__all__ = ["TitansQwenConfig"]
