"""A trained memory as a PEFT-style adapter: its config, its folder, the Hub.

A memory folder (or Hub repository) holds exactly

- `memory_config.json`: a :class:`TitansMemoryConfig`, every memory setting plus the base model it belongs to
  (Hub id and revision, or a local folder's absolute path and `base_fingerprint`, a hash of every byte of its
  weights, config and tokenizer; its shape) and the titans_hf version that wrote it. A local base loads from that
  folder only while the fingerprint still matches, so a memory never runs on another model of the same shape
  without a word (`recorded_base`);
- `memory_model.safetensors`: the memory's weights, nothing of the base;
- `config.json`: the model's config (`model_type: titans_qwen`, the base's config and the memory settings), so that
  `AutoConfig` and `AutoModelForCausalLM` / `pipeline` dispatch to the model class, which then loads as above
  (folders written before it existed load without it);
- with a LoRA adapter of the base trained beside the memory (`titans_hf.lora`): PEFT's `adapter_config.json` and
  `adapter_model.safetensors`, in PEFT's format;
- `README.md` on the Hub: a model card rendered from `hub_cards/memory_model_card.md`.

Everything read from such a folder is data: only the known settings are read from the config, nothing in it
chooses code to run or options for loading the base. This module knows nothing of the model classes; the model
(`titans_hf.modeling`) builds on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import jinja2
from huggingface_hub import (
    _CACHED_NO_EXIST,
    CommitOperationAdd,
    EvalResult,
    HfApi,
    ModelCard,
    ModelCardData,
    get_token,
    hf_hub_download,
    is_offline_mode,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from titans_hf import __version__
from titans_hf.utils import atomic_write, atomic_write_json

logger = logging.getLogger(__name__)

MEMORY_CONFIG_NAME = "memory_config.json"
MEMORY_WEIGHTS_NAME = "memory_model.safetensors"
# The Auto classes' view of a memory folder: the model type they dispatch on, in the file they read.
MODEL_CONFIG_NAME = "config.json"
MODEL_TYPE = "titans_qwen"
# Base weights that were trained too (freeze_base=False): kept out of the memory file, but part of a checkpoint.
TRAINABLE_BASE_WEIGHTS_NAME = "trainable_base_model.safetensors"
# A LoRA adapter of the base trained with the memory (titans_hf.lora), in PEFT's own file names and format.
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
CARD_TEMPLATE_PATH = Path(__file__).parent / "hub_cards" / "memory_model_card.md"
BASE_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
# Weights titans_hf never loads (pickle can run code): a folder holding only these is refused, naming it.
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A base's fingerprint hashes these files whole, besides config.json and the safetensors files: what makes its token
# ids mean what they mean.
TOKENIZER_FILE_NAMES = ("added_tokens.json", "merges.txt", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer.model", "tokenizer_config.json", "vocab.json")
_FINGERPRINT_READ_BYTES = 8 << 20
# The sampled fingerprints earlier releases recorded, still accepted at load with a warning (`recorded_base`): per
# tensor its name, dtype, shape and blocks at the start, middle and end of its bytes; before that, blocks spread over
# each file.
_SAMPLED_FINGERPRINT_TENSOR_BLOCK_BYTES = 1 << 12
_LEGACY_FINGERPRINT_BLOCKS, _LEGACY_FINGERPRINT_BLOCK_BYTES = 16, 1 << 16
# safetensors' own limit on a header's size
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


@dataclass
class TitansMemoryConfig:
    """Every setting of a Titans memory, and the base model it belongs to (PEFT's adapter config, for a memory).

    The single source of the memory settings: `TitansQwenConfig.memory_config`, the `titans-hf train` flags, the
    model card and the checkpoints all read them from here. `memory_layers` and `memory_num_heads` may stay None
    until the config meets a base (`TitansQwenConfig` resolves them: the middle layer; hidden size // head dim).
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
        "help": "Start of the q/k convolution: window (mean over its taps) or identity (the plain projection)."})
    memory_chunk_size: int = field(default=64, metadata={
        "help": "Tokens per update chunk: a token reads the weights its chunk started with (with the delta rule "
                "every token still takes its own step)."})
    memory_batch_size: int | None = field(default=None, metadata={
        "help": "Tokens between refreshes of the point where inner gradients are taken (None: every update)."})
    update_rule: str = field(default="delta", metadata={
        "help": "How the memory writes: delta (each token's step at the weights the tokens before it left, a "
                "contraction along its key; the state's norm stays under max_memory_norm) or gradient (Titans' "
                "chunked rule: every token's gradient at its chunk's starting weights, clipped, with momentum)."})
    max_lr: float = field(default=0.5, metadata={
        "help": "Upper bound of the data-dependent inner learning rate theta (delta: at most 0.5, a step 2 theta "
                "<= 1)."})
    max_memory_norm: float | None = field(default=None, metadata={
        "help": "delta: each head's fast weights are rescaled to this Frobenius norm whenever an update leaves "
                "them above it (None: 4 * sqrt(memory_head_dim))."})
    theta_bias_init: float = field(default=-2.0, metadata={
        "help": "Initial bias of the write gate: theta starts near max_lr * sigmoid(theta_bias_init)."})
    forget_bias_init: float = field(default=-30.0, metadata={
        "help": "Initial bias of the forget gate: alpha starts near sigmoid(forget_bias_init) per memory update "
                "(-30: no forgetting, and no gradient to raise it; a new value for a key replaces the old through "
                "the update rule)."})
    num_memory_tokens: int = field(default=0, metadata={"help": "mac: memory tokens read at the start of a chunk."})
    num_persistent_tokens: int = field(default=0, metadata={"help": "mac: learned tokens prefixing every chunk."})
    attend_previous_chunk: bool = field(default=True, metadata={
        "help": "Each chunk's attention also sees the previous chunk's keys and values (a sliding window, as in "
                "Titans' MAG); positions stay within two chunks, the cache within two chunks' keys. On by default: "
                "it lowers the loss where chunks meet (README, recall corpus); false for chunk-local attention."})
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

    BASE_FIELDS: ClassVar[tuple[str, ...]] = ("base_model_name_or_path", "revision", "base_shape",
                                              "base_fingerprint", "titans_hf_version")

    def __post_init__(self) -> None:
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
        if isinstance(self.max_lr, bool) or not isinstance(self.max_lr, (int, float)) or not self.max_lr > 0:
            raise ValueError(f"max_lr={self.max_lr!r} must be a number > 0")
        self.max_lr = float(self.max_lr)
        if self.max_memory_norm is not None:
            if (isinstance(self.max_memory_norm, bool) or not isinstance(self.max_memory_norm, (int, float))
                    or not math.isfinite(self.max_memory_norm) or not self.max_memory_norm > 0):
                raise ValueError(f"max_memory_norm={self.max_memory_norm!r} must be a finite number > 0 or None")
            self.max_memory_norm = float(self.max_memory_norm)
        for name in ("theta_bias_init", "forget_bias_init"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
            setattr(self, name, float(value))
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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any, source: str = "memory config") -> "TitansMemoryConfig":
        """Build from a dict of known settings only; anything else is a ValueError naming `source`."""
        if not isinstance(values, dict):
            raise ValueError(f"{source}: expected a JSON object of memory settings, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown memory setting(s) {unknown}; known: {sorted(known)}")
        if "titans_hf_version" in values:
            # a saved config (they carry the version) from before an option existed keeps what it was trained with
            for name, before in (("attend_previous_chunk", False), ("update_rule", "gradient")):
                values = {name: before, **values}
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


# ---- local bases ----

def check_safetensors_folder(folder: str | os.PathLike, what: str) -> None:
    """Refuse a local model folder that titans_hf cannot load, naming the folder or file instead of the loader's own
    error: weights as pickle files only (pytorch_model.bin, *.pt, ...), which titans_hf never loads; a safetensors
    file whose header is unreadable or does not fit the file (`read_safetensors_header`); a memory's weights
    without the memory_config.json that describes them."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    if (folder / MEMORY_WEIGHTS_NAME).is_file() and not (folder / MEMORY_CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder / MEMORY_CONFIG_NAME}: not found, though {folder} holds a memory's weights "
                                f"({MEMORY_WEIGHTS_NAME}); a memory folder holds both, written by save_pretrained / "
                                "save_memory")
    weights = sorted(folder.glob("*.safetensors"))
    for path in weights:
        read_safetensors_header(path)
    if weights:
        return
    pickled = sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_WEIGHT_SUFFIXES)
    if pickled:
        raise ValueError(f"{what} {folder}: holds weights only as pickle files {pickled[:3]}, which titans_hf never "
                         "loads (they can run code); save the model with save_pretrained (safetensors) first")


def base_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 that tells two local base folders apart: every byte of its config.json, of the tokenizer files it has
    (`TOKENIZER_FILE_NAMES`) and of its safetensors files, in that order (the safetensors files by name), each file
    framed by its name and size, so that bytes moved from one file to the next, or a renamed file, change it too.
    A base given another tokenizer of the same size, or fine-tuned in a few rows of one tensor, differs.
    Recorded at `from_base`, compared at load (`recorded_base`, `base_matches_fingerprint`).

    Hashing every byte costs what sha256 costs, once per recording or load: on a 0.5B-size folder (995 MB: bf16
    weights and a 7 MB tokenizer.json) in the page cache, 1.5 s (650 MB/s, the speed of sha256 on that 2-core
    machine) against 10 ms for the sampled fingerprint it replaces (scripts/bench_fingerprint.py); loading the base
    reads the same bytes."""
    folder = Path(folder)
    paths = [folder / name for name in ("config.json", *TOKENIZER_FILE_NAMES) if (folder / name).is_file()]
    paths += sorted(folder.glob("*.safetensors"))
    digest = hashlib.sha256()
    view = memoryview(bytearray(_FINGERPRINT_READ_BYTES))
    for path in paths:
        with open(path, "rb") as handle:
            digest.update(json.dumps([path.name, os.fstat(handle.fileno()).st_size]).encode())
            while count := handle.readinto(view):
                digest.update(view[:count])
    return digest.hexdigest()


def _sampled_base_fingerprint(folder: Path) -> str:
    """The fingerprint titans_hf recorded before `base_fingerprint` read every byte: config.json, and for every
    tensor of every safetensors file its name, dtype, shape and three blocks of 4 KiB of its bytes (start, middle,
    end)."""

    def tensor_blocks(path: Path, handle: Any, size: int) -> Iterator[bytes]:
        header = _safetensors_header(handle, size, path)
        data_start = handle.tell()
        for name in sorted(name for name in header if name != "__metadata__"):
            entry = header[name]
            begin, end = entry["data_offsets"]
            yield json.dumps([name, entry["dtype"], entry["shape"], end - begin]).encode()
            block = _SAMPLED_FINGERPRINT_TENSOR_BLOCK_BYTES
            middle = max(begin, (begin + end) // 2 - block // 2)
            for offset in dict.fromkeys((begin, middle, max(begin, end - block))):
                handle.seek(data_start + offset)
                yield handle.read(min(block, end - offset))

    return _folder_fingerprint(folder, tensor_blocks)


def _folder_fingerprint(folder: Path, file_blocks: Callable[[Path, Any, int], Iterator[bytes]]) -> str:
    """sha256 of a folder's config.json, then for each safetensors file (by name) its name and size and the
    blocks `file_blocks(path, open handle, size)` reads from it: the sampled fingerprints of earlier releases."""
    digest = hashlib.sha256()
    config = folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            for block in file_blocks(path, handle, size):
                digest.update(block)
    return digest.hexdigest()


def _safetensors_header(handle: Any, size: int, path: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name: dtype, shape, data_offsets), checked against the file: its length,
    each tensor's shape and byte range, and the ranges tiling the data exactly, as safetensors requires (two tensors
    sharing bytes would alias one another's values); `handle` is left at the start of the data."""
    length = int.from_bytes(handle.read(8), "little")
    if not 0 < length <= min(size - 8, _MAX_SAFETENSORS_HEADER_BYTES):
        raise ValueError(f"{path}: not a readable safetensors file (its header claims {length} bytes of a "
                         f"{size}-byte file)")
    data_size = size - 8 - length
    try:
        header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        ranges = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not isinstance(entry["dtype"], str) or not isinstance(shape, list) or not all(
                    _is_count(dim) for dim in shape):
                raise ValueError(f"tensor {name!r} has dtype {entry['dtype']!r} and shape {shape!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(offset) for offset in offsets)
                    and offsets[0] <= offsets[1] <= data_size):
                raise ValueError(f"tensor {name!r} lies outside the file (data_offsets {offsets!r}, {data_size} "
                                 "bytes of data)")
            ranges.append((*offsets, name))
        end, previous = 0, None
        for begin, stop, name in sorted(ranges):
            if begin < end:
                raise ValueError(f"tensors {previous!r} and {name!r} share bytes [{begin}, {min(stop, end)}) of the "
                                 "data")
            if begin > end:
                raise ValueError(f"bytes [{end}, {begin}) of the data belong to no tensor")
            end, previous = stop, name
        if end != data_size:
            raise ValueError(f"bytes [{end}, {data_size}) of the data belong to no tensor")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors header ({error})") from error
    return header


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _legacy_base_fingerprint(folder: Path) -> str:
    """The fingerprint titans_hf <= 0.3 recorded: config.json, and per safetensors file its name, size, header and
    16 blocks of 64 KiB spread over it."""

    def spread_blocks(path: Path, handle: Any, size: int) -> Iterator[bytes]:
        header = handle.read(8)
        yield header + handle.read(min(int.from_bytes(header, "little"), size) if len(header) == 8 else 0)
        for index in range(_LEGACY_FINGERPRINT_BLOCKS):
            handle.seek(size * index // _LEGACY_FINGERPRINT_BLOCKS)
            yield handle.read(_LEGACY_FINGERPRINT_BLOCK_BYTES)

    return _folder_fingerprint(folder, spread_blocks)


def _base_fingerprint_match(folder: Path, recorded: str) -> str | None:
    """The folder's `base_fingerprint` when `recorded` is it, or is the sampled fingerprint an earlier release
    recorded for this folder; None when the folder holds another model."""
    current = base_fingerprint(folder)
    if recorded == current or recorded in (_sampled_base_fingerprint(folder), _legacy_base_fingerprint(folder)):
        return current
    return None


def base_matches_fingerprint(folder: str | os.PathLike, recorded: str) -> bool:
    """Whether the base folder is the one whose fingerprint a memory recorded (for a memory saved by an earlier
    release, whose fingerprint sampled the weights: whether the folder matches those samples)."""
    return _base_fingerprint_match(Path(folder), recorded) is not None


def recorded_base(config: TitansMemoryConfig, source: str) -> str:
    """The base a memory's config names, checked to be the same model wherever the memory is loaded from: a local
    base is recorded by its absolute path, and must still be there with the fingerprint recorded (else another
    model would be used silently); a relative path that exists here (recorded by an older version, or a Hub id
    shadowed by a local folder) is refused, since it resolves to whatever folder lies at it from here.

    A memory saved by an earlier release recorded a sampled fingerprint (blocks of each tensor or file), which a
    base with another tokenizer, or with rows edited between the samples, still matches. Such a memory loads when
    the base matches the samples, with a warning that says what they cover, and `config` is given the base's full
    fingerprint, so the model loaded records it when saved again. That is how transformers and PEFT treat a
    checkpoint of an older format (load it, warn, write the current format on the next save); refusing would strand
    every memory trained on a local base by that release, whose base is the one it was trained on unless edited
    where the samples do not look."""
    base = config.base_model_name_or_path
    if not base:
        raise ValueError(f"{source}: its memory config names no base model; pass the base explicitly")
    path = Path(base)
    if not path.is_absolute():
        if path.exists():
            raise ValueError(f"{source}: its memory config names the base {base!r}, a relative path that here resolves "
                             f"to {path.resolve()}, which need not be the model it was trained on; pass the base "
                             "explicitly (--model BASE --memory MEMORY, or from_base_and_memory(base, memory))")
        return base
    if not path.is_dir():
        raise ValueError(f"{source}: its memory config names the local base {base}, which does not exist on this "
                         "machine; pass the base explicitly")
    if config.base_fingerprint is not None:
        current = _base_fingerprint_match(path, config.base_fingerprint)
        if current is None:
            raise ValueError(f"{source}: its memory config names the local base {base}, but the model there now is not "
                             "the one the memory was trained on (base_fingerprint differs: other weights, config or "
                             "tokenizer); pass the base explicitly if this is intended")
        if current != config.base_fingerprint:
            logger.warning("%s: its memory config records a base_fingerprint of an earlier titans_hf, which covers "
                           "samples of the base's weights only, not every byte; the base %s matches them and is "
                           "used. The model loaded records the base's full fingerprint: save the memory again "
                           "(save_pretrained) to keep it", source, base)
            config.base_fingerprint = current
    return base


def read_model_config(path: str | os.PathLike) -> dict[str, Any]:
    """A memory folder's `config.json` as the Auto classes read it: a JSON object of `model_type` titans_qwen with
    the base's `text_config` and no `auto_map`; anything else is a ValueError naming the file."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON model config ({error})") from error
    if not isinstance(values, dict) or values.get("model_type") != MODEL_TYPE or not isinstance(
            values.get("text_config"), dict):
        raise ValueError(f"{path}: a memory folder's {MODEL_CONFIG_NAME} is a JSON object with model_type "
                         f"{MODEL_TYPE!r} and the base's text_config")
    if "auto_map" in values or "auto_map" in values["text_config"]:
        raise ValueError(f"{path}: names code to run (auto_map); a memory's config never does")
    return values


# ---- memory folders, local or on the Hub ----

def is_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_file(name_or_path: str | os.PathLike, filename: str, revision: str | None = None, token: str | None = None,
             cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> Path:
    """`filename` of a local folder, or of a Hub model repository downloaded through `huggingface_hub` (cached,
    offline-aware: with HF_HUB_OFFLINE=1 only the cache is read). Errors say which file of which source is missing."""
    folder = Path(name_or_path)
    if folder.is_dir():
        path = folder / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found (a memory folder holds {MEMORY_CONFIG_NAME} and "
                                    f"{MEMORY_WEIGHTS_NAME}, written by save_pretrained / save_memory)")
        return path
    name = str(name_or_path)
    if not is_hub_id(name):
        raise FileNotFoundError(f"{name}: neither a local folder nor a Hub repository id")
    where = f"{name}{'@' + revision if revision else ''}"
    try:
        return Path(hf_hub_download(name, filename, revision=revision, token=token, cache_dir=cache_dir,
                                    local_files_only=local_files_only))
    except EntryNotFoundError as error:  # LocalEntryNotFoundError is one too: offline and not cached
        if isinstance(error, LocalEntryNotFoundError) or is_offline_mode():
            raise FileNotFoundError(f"{filename} of {where} is not in the local Hugging Face cache and the Hub "
                                    "cannot be reached (offline: HF_HUB_OFFLINE=1 or no network); download it "
                                    "once online, or pass a local folder") from error
        raise FileNotFoundError(f"{where} has no {filename}: not a titans_hf memory repository") from error
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise FileNotFoundError(f"{where}: no such Hub repository or revision (private repositories need a "
                                "token: HF_TOKEN or `hf auth login`)") from error


def optional_hub_file(name_or_path: str | os.PathLike, filename: str, revision: str | None = None,
                      token: str | None = None, cache_dir: str | os.PathLike | None = None,
                      local_files_only: bool = False) -> Path | None:
    """`hub_file`, or None where the folder or repository has no such file: the Hub says so, or offline, the cache
    recorded that it has none. Offline with nothing cached about the file, a warning says so and the file counts as
    absent (a repository downloaded by an older titans_hf never asked for it)."""
    folder = Path(name_or_path)
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else None
    offline = is_offline_mode() or local_files_only
    if offline and is_hub_id(str(name_or_path)):
        cached = try_to_load_from_cache(str(name_or_path), filename, cache_dir=cache_dir, revision=revision)
        if cached is _CACHED_NO_EXIST:
            return None
        if cached is None:
            logger.warning("%s: %s is not in the local Hugging Face cache and the Hub cannot be reached (offline); "
                           "loading without it", name_or_path, filename)
            return None
    try:
        return hub_file(name_or_path, filename, revision=revision, token=token, cache_dir=cache_dir,
                        local_files_only=local_files_only)
    except FileNotFoundError as error:
        if isinstance(error.__cause__, EntryNotFoundError) and not isinstance(error.__cause__,
                                                                              LocalEntryNotFoundError):
            return None
        raise


def is_memory(name_or_path: str | os.PathLike, revision: str | None = None, **hub_kwargs: Any) -> bool:
    """Whether a folder or Hub repository holds a memory (its `memory_config.json`), as opposed to a full model.

    Offline, the cache decides: a cached full model (its config.json) is not a memory; a repository with neither
    file cached is an error saying so."""
    if Path(name_or_path).is_dir():
        return (Path(name_or_path) / MEMORY_CONFIG_NAME).is_file()
    name = str(name_or_path)
    if not is_hub_id(name):
        return False
    if is_offline_mode() or hub_kwargs.get("local_files_only"):
        cache_dir = hub_kwargs.get("cache_dir")
        if isinstance(try_to_load_from_cache(name, MEMORY_CONFIG_NAME, cache_dir=cache_dir, revision=revision), str):
            return True
        if isinstance(try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision), str):
            return False
        hub_file(name, MEMORY_CONFIG_NAME, revision=revision, **hub_kwargs)  # raises: not in the cache, offline
    try:
        hub_file(name, MEMORY_CONFIG_NAME, revision=revision, **hub_kwargs)
    except FileNotFoundError:
        return False
    return True


def save_memory_folder(save_directory: str | os.PathLike, config: TitansMemoryConfig | None, memory: dict[str, Any],
                       trainable_base: dict[str, Any] | None = None, model_config: dict[str, Any] | None = None,
                       adapter: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Path:
    """Write a memory folder: the config (None for a model without one), the model's config for the Auto classes
    (`model_config`, a dict with `model_type` titans_qwen, or None), the memory weights, (a checkpoint of a model
    whose base trains too) the trainable base weights, and (a model with a LoRA adapter, `titans_hf.lora`) the
    adapter as PEFT writes it: (adapter_config.json's dict, adapter_model.safetensors' tensors). Each file is written
    under a temporary name and renamed; the memory weights go last, so their presence means the folder is complete.
    Files of an earlier save into the folder that this one does not write (trainable base, adapter) are removed."""
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    base_path = folder / TRAINABLE_BASE_WEIGHTS_NAME
    if trainable_base:
        tensors = _contiguous(trainable_base)
        atomic_write(base_path, lambda temporary: save_file(tensors, temporary, metadata={"format": "pt"}))
    elif base_path.exists():
        base_path.unlink()  # left by an earlier save into the same folder: it would be loaded on resume
    if adapter is not None:
        adapter_config, adapter_weights = adapter
        tensors = _contiguous(adapter_weights)
        atomic_write(folder / ADAPTER_WEIGHTS_NAME, lambda temporary: save_file(tensors, temporary,
                                                                               metadata={"format": "pt"}))
        atomic_write_json(folder / ADAPTER_CONFIG_NAME, adapter_config)
    else:
        for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
            if (folder / name).exists():
                (folder / name).unlink()  # an earlier save's adapter would be loaded with this memory
    if config is not None:
        config.save_pretrained(folder)
    if model_config is not None:
        atomic_write_json(folder / MODEL_CONFIG_NAME, model_config)
    tensors = _contiguous(memory)
    atomic_write(folder / MEMORY_WEIGHTS_NAME, lambda temporary: save_file(tensors, temporary,
                                                                          metadata={"format": "pt"}))
    return folder


def load_memory_weights(path: str | os.PathLike) -> dict[str, Any]:
    """The tensors of a safetensors file on the CPU, its header checked first (`read_safetensors_header`); an
    unreadable file is a ValueError naming it."""
    read_safetensors_header(path)
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, torch dtype)} of a safetensors file, from its header alone (no tensor data is read). The
    header is checked against the file here, whatever the installed safetensors checks: its length, every tensor's
    byte range inside the data, and no two tensors sharing bytes; any problem is a ValueError naming the file."""
    try:
        with open(path, "rb") as handle:
            _safetensors_header(handle, os.fstat(handle.fileno()).st_size, Path(path))
    except OSError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error
    try:
        with safe_open(str(path), framework="pt") as weights:
            return {name: (tuple(weights.get_slice(name).get_shape()),
                           _TORCH_DTYPES[weights.get_slice(name).get_dtype()]) for name in weights.keys()}
    except (SafetensorError, OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error


def _contiguous(tensors: dict[str, Any]) -> dict[str, Any]:
    return {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}


# ---- the model card ----

def _evaluation_rows(results: dict | None) -> list[dict]:
    """Flatten {"accuracy": {task: {length: {"memory", "no_memory"}}}} into table rows, in the given order.

    The evaluator decides the order of tasks and lengths; sorting here would have to guess how lengths such as
    "32k" compare.
    """
    if results is None:
        return []
    accuracy = results.get("accuracy") if isinstance(results, dict) else None
    if not isinstance(accuracy, dict):
        raise ValueError("results: expected {'accuracy': {task: {length: {'memory': acc, 'no_memory': acc}}}}")
    rows = []
    for task, per_length in accuracy.items():
        if not isinstance(per_length, dict):
            raise ValueError(f"results['accuracy'][{task!r}]: expected an object of lengths")
        for length, scores in per_length.items():
            where = f"results['accuracy'][{task!r}][{length!r}]"
            if not isinstance(scores, dict):
                raise ValueError(f"{where}: expected {{'memory': acc, 'no_memory': acc}}")
            for key in ("memory", "no_memory"):
                value = scores.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                    raise ValueError(f"{where}[{key!r}]: expected an accuracy in [0, 1], got {value!r}")
            rows.append({"task": task, "length": str(length), "memory": scores["memory"],
                         "no_memory": scores["no_memory"]})
    return rows


def render_memory_card(config: TitansMemoryConfig, results: dict | None = None, *, repo_id: str | None = None,
                       datasets: list[str] | None = None, adapter: dict[str, Any] | None = None) -> str:
    """README.md of a memory repository: Hub metadata (base model, library, tags, datasets, evaluation results),
    what the memory is, how it was trained, its evaluation table and the line that loads it.

    The base must be named by a Hub id: a local path never goes into a public card. `repo_id` is the repository
    the card will live in (it appears in the loading snippet); `datasets` are Hub ids of the training data;
    `adapter` the adapter_config.json of a LoRA adapter trained with the memory (`titans_hf.lora`), if any.
    """
    base_model = config.base_model_name_or_path
    if not base_model or not is_hub_id(base_model) or Path(base_model).exists():
        raise ValueError(f"the memory's base_model_name_or_path is {base_model!r}, not a Hub id: a local path never "
                         "goes into a public card; pass the base's Hub id (push --base-model ORG/NAME, or "
                         "base_model= in Python)")
    rows = _evaluation_rows(results)
    settings = config.memory_settings()
    eval_results = [
        EvalResult(task_type="question-answering", dataset_type="RMT-team/babilong", dataset_name="BABILong",
                   dataset_config=row["task"], dataset_split=row["length"], metric_type="exact_match",
                   metric_name=f"exact match, {mode.replace('_', ' ')}", metric_value=row[mode])
        for row in rows for mode in ("memory", "no_memory")
    ]
    card_data = ModelCardData(
        base_model=base_model,
        base_model_relation="adapter",
        library_name="titans_hf",
        pipeline_tag="text-generation",
        tags=["titans", "long-term-memory", "long-context", config.base_shape["model_type"], config.variant,
              *(["lora", "peft"] if adapter is not None else [])],
        datasets=datasets or None,
        model_name=repo_id or f"titans memory for {base_model}",
        eval_results=eval_results or None,
    )
    # StrictUndefined: a name missing from the template's inputs is an error, never an empty hole in the card.
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    template = environment.from_string(CARD_TEMPLATE_PATH.read_text(encoding="utf-8"))
    content = template.render(
        card_data=card_data.to_yaml(),
        repo_id=repo_id or "<repo_id>",
        base_model=base_model,
        revision=config.revision,
        memory_settings=settings,
        base_shape=config.base_shape,
        titans_hf_version=config.titans_hf_version,
        evaluation_rows=rows,
        datasets=datasets or [],
        adapter=adapter,
    )
    # Parsing it back checks that the YAML header is what the Hub will read.
    return ModelCard(content).content


# ---- pushing ----

def _adapter_to_push(folder: Path, repo_id: str) -> tuple[dict[str, Any], Path] | None:
    """(the adapter_config.json to upload, the weights) of a folder holding a LoRA adapter beside its memory, else
    None; both files are checked first (`titans_hf.lora.read_adapter_config`, a readable LoRA header). The uploaded
    config names the repository itself as the model the adapter goes on: the base plus this memory, which is what
    `AutoModelForCausalLM.from_pretrained(repo_id)` then loads (naming the bare base, it would load the base and
    the LoRA and drop the memory)."""
    paths = [folder / ADAPTER_CONFIG_NAME, folder / ADAPTER_WEIGHTS_NAME]
    if not any(path.exists() for path in paths):
        return None
    for path in paths:
        if path.is_symlink():
            raise ValueError(f"{path}: is a link ({os.readlink(path)}); a memory folder holds its own files")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; an adapter is {ADAPTER_CONFIG_NAME} and "
                                    f"{ADAPTER_WEIGHTS_NAME} together (written by save_pretrained of a model with a "
                                    "LoRA adapter)")
    from titans_hf.lora import PEFT_KEY_PREFIX, read_adapter_config  # needs peft, which only an adapter does

    read_adapter_config(paths[0])
    header = read_safetensors_header(paths[1])
    wrong = [name for name in header if not (name.startswith(PEFT_KEY_PREFIX)
                                             and name.endswith((".lora_A.weight", ".lora_B.weight")))]
    if not header or wrong:
        raise ValueError(f"{paths[1]}: not the weights of a LoRA adapter (tensors {wrong[:3] or 'none'})")
    values = json.loads(paths[0].read_text(encoding="utf-8"))
    values.update(base_model_name_or_path=repo_id, revision=None)
    return values, paths[1]


def push_memory_folder(folder: str | os.PathLike, repo_id: str, *, token: str | None = None,
                       endpoint: str | None = None, private: bool = False, commit_message: str | None = None,
                       results: dict | None = None, datasets: list[str] | None = None,
                       base_model: str | None = None, revision: str | None = None,
                       check_weights: Callable[[TitansMemoryConfig, dict, str], None] | None = None) -> str:
    """Upload a memory folder to a Hub model repository and return the commit URL.

    The commit holds exactly memory_model.safetensors, memory_config.json, the folder's config.json (for the Auto
    classes; its memory settings replaced by the pushed ones, no local path of the base in it) when it has one, the
    LoRA adapter (adapter_model.safetensors, adapter_config.json naming the repository as its model) when it has one,
    and a README.md rendered from hub_cards/memory_model_card.md; anything else in the folder stays local, and a file
    that is a link is refused.
    `check_weights(config, {name: (shape, dtype)}, source)` (the model's `check_memory_weights`) vets the weights
    against the config before anything is sent. `base_model` / `revision` name the base on the Hub when the
    memory was trained on a local copy of it (they replace the local path in the uploaded config). The token comes
    from `token`, else from HF_TOKEN or `hf auth login`, and is never printed or logged.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory (expected a memory folder written by save_pretrained)")
    config_path, weights_path = hub_file(folder, MEMORY_CONFIG_NAME), hub_file(folder, MEMORY_WEIGHTS_NAME)
    model_config_path = folder / MODEL_CONFIG_NAME
    for path in (config_path, weights_path, model_config_path):
        if path.is_symlink():
            raise ValueError(f"{path}: is a link ({os.readlink(path)}); a memory folder holds its own files")
    config = read_memory_config(config_path)
    header = read_safetensors_header(weights_path)
    if not header:
        raise ValueError(f"{weights_path}: holds no tensors")
    if check_weights is not None:
        check_weights(config, header, str(weights_path))
    if base_model is not None:
        config = dataclasses.replace(config, base_model_name_or_path=base_model, revision=revision)
    model_config = read_model_config(model_config_path) if model_config_path.is_file() else None
    adapter = _adapter_to_push(folder, repo_id)
    card = render_memory_card(config, results, repo_id=repo_id, datasets=datasets,
                              adapter=None if adapter is None else adapter[0])
    if is_offline_mode():
        raise OfflineModeIsEnabled(f"Cannot push {folder} to {repo_id}: offline mode is on (HF_HUB_OFFLINE=1); "
                                   "unset it to push.")
    if token is None and get_token() is None:
        raise ValueError(f"Cannot push to {repo_id}: no Hugging Face token; set HF_TOKEN or run `hf auth login`.")
    api = HfApi(endpoint=endpoint, token=token)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    config_bytes = (json.dumps(config.to_dict(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    operations = [
        CommitOperationAdd(path_in_repo=MEMORY_WEIGHTS_NAME, path_or_fileobj=str(weights_path)),
        CommitOperationAdd(path_in_repo=MEMORY_CONFIG_NAME, path_or_fileobj=config_bytes),
        CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")),
    ]
    if adapter is not None:
        operations[2:2] = [
            CommitOperationAdd(path_in_repo=ADAPTER_WEIGHTS_NAME, path_or_fileobj=str(folder / ADAPTER_WEIGHTS_NAME)),
            CommitOperationAdd(path_in_repo=ADAPTER_CONFIG_NAME, path_or_fileobj=(
                json.dumps(adapter[0], indent=2, ensure_ascii=False) + "\n").encode("utf-8")),
        ]
    if model_config is not None:
        model_config["memory_config"] = config.to_dict()
        model_config["text_config"].pop("_name_or_path", None)
        operations.insert(2, CommitOperationAdd(path_in_repo=MODEL_CONFIG_NAME, path_or_fileobj=(
            json.dumps(model_config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")))
    logger.info("Pushing %s, %s and README.md to %s", MEMORY_WEIGHTS_NAME, MEMORY_CONFIG_NAME, repo_url)
    commit = api.create_commit(repo_url.repo_id, operations,
                               commit_message=commit_message or f"Upload Titans memory (titans_hf {__version__})")
    return commit.commit_url
