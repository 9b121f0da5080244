"""A trained memory's folder (local, or a Hub repository): its files, read and written.

A memory folder holds exactly

- `memory_config.json`: a `TitansMemoryConfig`, every memory setting plus the base model it belongs to
  (Hub id and revision, or a local folder's absolute path and `base_fingerprint`, a hash of every byte of its
  weights, config, generation config, tokenizer and chat templates; its shape) and the titans_hf version that wrote
  it. A local base loads from that folder only while the fingerprint is recorded and still matches, so a memory
  never runs on another model of the same shape without a word (`recorded_base`);
- `memory_model.safetensors`: the memory's weights, nothing of the base, under the file keys of its parameters
  (`file_key`: `memory.<layer>.*` and `persistent_tokens`, without the decoder's `model.` in front; `is_memory_name`
  tells the memory's parameters from the base's and a LoRA's);
- `config.json`: the model's config (`model_type: titans_qwen`, the base's config and the memory settings), so that
  `AutoConfig` and `AutoModelForCausalLM` / `pipeline` dispatch to the model class, which then loads as above
  (`TitansQwenForCausalLM.from_pretrained` loads a folder without it, from `memory_config.json` and the weights);
- with a LoRA adapter of the base trained beside the memory (`titans_hf.lora`): PEFT's `adapter_config.json` and
  `adapter_model.safetensors`, in PEFT's format;
- `README.md` on the Hub: a model card (`titans_hf.hub`).

Everything read from such a folder is data: only the known settings are read from the config, nothing in it
chooses code to run or options for loading the base; safetensors headers are checked here before any tensor is read.
A base folder is read only as far as its files are regular files of sizes they account for (`open_regular_file`,
`base_fingerprint`): a FIFO, a device behind a link or a sparse file of a terabyte is refused, naming it, before it
is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import torch
from huggingface_hub import file_download, hf_hub_download, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from titans_hf.files import atomic_write, atomic_write_json

logger = logging.getLogger(__name__)

MEMORY_CONFIG_NAME = "memory_config.json"
MEMORY_WEIGHTS_NAME = "memory_model.safetensors"
# The Auto classes' view of a memory folder: the model type they dispatch on, in the file they read.
MODEL_CONFIG_NAME = "config.json"
# Base weights that were trained too (freeze_base=False): kept out of the memory file, but part of a checkpoint.
TRAINABLE_BASE_WEIGHTS_NAME = "trainable_base_model.safetensors"
# A LoRA adapter of the base trained with the memory (titans_hf.lora), in PEFT's own file names and format.
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# Weights titans_hf never loads (pickle can run code): a folder holding only these is refused, naming it.
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A base's fingerprint hashes these files whole, besides config.json and the safetensors files: what makes its token
# ids mean what they mean.
TOKENIZER_FILE_NAMES = ("added_tokens.json", "merges.txt", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer.model", "tokenizer_config.json", "vocab.json")
# ... and these, which change what the base says and how it is prompted: its generation defaults, and the chat
# templates transformers reads beside the tokenizer (the default one from chat_template.jinja, named ones from
# additional_chat_templates/*.jinja). Spelled out here rather than taken from transformers: they define what a
# recorded fingerprint covers, which must not move with a transformers upgrade.
GENERATION_CONFIG_NAME = "generation_config.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"
_FINGERPRINT_READ_BYTES = 8 << 20
# The most bytes a base's config, tokenizer or chat template file may hold for its fingerprint to read it: far above
# any real one (Qwen's tokenizer.json: 7 MB), far below a sparse file that claims a terabyte.
_MAX_BASE_TEXT_FILE_BYTES = 1 << 30
# safetensors' own limit on a header's size
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
# bits per element of every dtype safetensors defines: a tensor's byte range holds exactly its elements
_SAFETENSORS_DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
                           "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16,
                           "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}

# The decoder's prefix of the memory's parameter names, left out of their file keys.
_DECODER_PREFIX = "model."


def is_memory_name(name: str) -> bool:
    """Whether a parameter or module name of a TitansQwenForCausalLM is the memory's (its blocks, the persistent
    tokens) rather than the base's or a LoRA's."""
    return name == "model.memory" or name.startswith(("model.memory.", "model.persistent_tokens"))


def file_key(name: str) -> str:
    """The key under which a memory folder or a full model's file stores the parameter `name`: the memory's without
    the decoder's `model.` in front, every other one as it is."""
    return name.removeprefix(_DECODER_PREFIX) if is_memory_name(name) else name


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


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file; a link to one counts (a Hugging Face cache snapshot
    is links to blobs). Anything else is a ValueError naming it and what it is: a FIFO (whose `open` would wait for a
    writer forever), a device such as /dev/zero behind a link (endless bytes; opening some devices acts on them), a
    socket, a folder. Checked with `os.stat` before opening, and again with `os.fstat` on what was opened, which is
    opened with O_NONBLOCK so that a FIFO put there in between cannot block the `open` either."""
    path = Path(path)
    _refuse_irregular(path, os.stat(path).st_mode)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        _refuse_irregular(path, os.fstat(descriptor).st_mode)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _refuse_irregular(path: Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    kind = next((name for test, name in kinds if test(mode)), "a special file")
    link = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
    raise ValueError(f"{path}: {kind}{link}, not a regular file; a model folder holds regular files only")


def base_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 that tells two local base folders apart: every byte of its config.json, generation_config.json, tokenizer
    files (`TOKENIZER_FILE_NAMES`), chat_template.jinja, additional_chat_templates/*.jinja (by name) and safetensors
    files (by name), in that order, where the folder has them, each file framed by its name (relative to the folder)
    and size, so that bytes moved from one file to the next, or a renamed file, change it too. A base given another
    tokenizer of the same size, another chat template or other generation defaults, or fine-tuned in a few rows of
    one tensor, differs. Recorded at `from_base`, compared at load (`recorded_base`).

    Every file is opened and checked before any is hashed, and is then read only to the size checked: each must be
    a regular file (`open_regular_file`), a safetensors file's header must account for every byte of it (tensor
    ranges that tile the data to the file's end, each as long as its shape and dtype make it), any other file must
    hold at most 1 GiB. Anything else is a ValueError naming the file: a FIFO, /dev/zero behind a link or a sparse
    terabyte is refused at once, not read.

    Hashing every byte costs what sha256 costs, once per recording or load: on a 0.5B-size folder (995 MB: bf16
    weights and a 7 MB tokenizer.json) in the page cache, 1.5 s (650 MB/s, the speed of sha256 on a 2-core
    machine; scripts/bench_fingerprint.py); loading the base reads the same bytes."""
    folder = Path(folder)
    names = [name for name in ("config.json", GENERATION_CONFIG_NAME, *TOKENIZER_FILE_NAMES, CHAT_TEMPLATE_NAME)
             if os.path.lexists(folder / name)]  # whatever the entry is: open_regular_file refuses all but files
    templates = folder / CHAT_TEMPLATES_FOLDER
    if templates.is_dir():
        names += sorted(f"{CHAT_TEMPLATES_FOLDER}/{path.name}" for path in templates.glob("*.jinja"))
    names += sorted(path.name for path in folder.glob("*.safetensors"))
    digest = hashlib.sha256()
    view = memoryview(bytearray(_FINGERPRINT_READ_BYTES))
    with ExitStack() as stack:
        files = []
        for name in names:
            path = folder / name
            handle = stack.enter_context(open_regular_file(path))
            size = os.fstat(handle.fileno()).st_size
            if path.suffix == ".safetensors":
                _safetensors_header(handle, size, path)
                handle.seek(0)
            elif size > _MAX_BASE_TEXT_FILE_BYTES:
                raise ValueError(f"{path}: {size} bytes, more than a model's config, tokenizer or chat template file "
                                 f"holds ({_MAX_BASE_TEXT_FILE_BYTES} at most); not read")
            files.append((name, handle, size))
        for name, handle, size in files:
            digest.update(json.dumps([name, size]).encode())
            left = size
            while left and (count := handle.readinto(view[:min(left, len(view))])):
                digest.update(view[:count])
                left -= count
    return digest.hexdigest()


def _safetensors_header(handle: Any, size: int, path: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name: dtype, shape, data_offsets), checked against the file: its length,
    each tensor's shape, dtype and byte range (as long as its shape and dtype make it), and the ranges tiling the data
    exactly, as safetensors requires (two tensors sharing bytes would alias one another's values): the header
    accounts for every byte of the file. `handle` is left at the start of the data."""
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
            if entry["dtype"] not in _SAFETENSORS_DTYPE_BITS:
                raise ValueError(f"tensor {name!r} has dtype {entry['dtype']!r}, which safetensors does not define")
            if math.prod(shape) * _SAFETENSORS_DTYPE_BITS[entry["dtype"]] != 8 * (offsets[1] - offsets[0]):
                raise ValueError(f"tensor {name!r} of dtype {entry['dtype']} and shape {shape} spans "
                                 f"{offsets[1] - offsets[0]} bytes (data_offsets {offsets!r}), not the bytes its "
                                 "elements take")
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


def recorded_base(base: str | None, fingerprint: str | None, source: str) -> str:
    """The base a memory's config names (`base`, its `base_model_name_or_path`, and `fingerprint`, its
    `base_fingerprint`), checked to be the same model wherever the memory is loaded from: a local base is recorded by
    its absolute path, and must still be there with the fingerprint recorded (else another model would be used
    silently); a relative path that exists here (a config edited by hand, or a Hub id shadowed by a local folder) is
    refused, since it resolves to whatever folder lies at it from here.

    A local base whose config records no fingerprint is refused, naming the memory's memory_config.json and the
    field: `from_base` records one for every local base, so a config without one was edited, and would load on any
    model of the same shape found at that path. A Hub base is pinned by its id and the revision recorded (none: the
    default branch, as `from_base` was given it); no fingerprint applies to it."""
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
    if fingerprint is None:
        raise ValueError(f"{Path(source) / MEMORY_CONFIG_NAME}: names the local base {base} but records no "
                         "base_fingerprint, so nothing shows that the model there is the one the memory was trained "
                         "on (from_base records it for every local base); pass the base explicitly (--model BASE "
                         "--memory MEMORY, or from_base_and_memory(base, memory)) if it is")
    if base_fingerprint(path) != fingerprint:
        raise ValueError(f"{source}: its memory config names the local base {base}, but the model there now is not "
                         "the one the memory was trained on (base_fingerprint differs: other weights, config, "
                         "generation config, tokenizer or chat template); pass the base explicitly if this is "
                         "intended")
    return base


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
    absent (the download that filled the cache may not have asked for it)."""
    folder = Path(name_or_path)
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else None
    offline = is_offline_mode() or local_files_only
    if offline and is_hub_id(str(name_or_path)):
        cached = try_to_load_from_cache(str(name_or_path), filename, cache_dir=cache_dir, revision=revision)
        if cached is file_download._CACHED_NO_EXIST:  # private: see library_internals
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


def save_memory_folder(save_directory: str | os.PathLike, memory_config: dict[str, Any] | None,
                       memory: dict[str, Any], trainable_base: dict[str, Any] | None = None,
                       model_config: dict[str, Any] | None = None,
                       adapter: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Path:
    """Write a memory folder: `memory_config.json` (`memory_config`, a `TitansMemoryConfig.to_dict()`; None for a
    model without one), the model's config for the Auto classes (`model_config`, a dict with `model_type`
    titans_qwen, or None), the memory weights, (a checkpoint of a model whose base trains too) the trainable base
    weights, and (a model with a LoRA adapter, `titans_hf.lora`) the adapter as PEFT writes it: (adapter_config.json's
    dict, adapter_model.safetensors' tensors). Each file is written under a temporary name and renamed; the memory
    weights go last, so their presence means the folder is complete. Files of an earlier save into the folder that
    this one does not write (trainable base, adapter) are removed."""
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
    if memory_config is not None:
        atomic_write_json(folder / MEMORY_CONFIG_NAME, memory_config)
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
    """{name: (shape, torch dtype)} of a safetensors file, from its header alone (no tensor data is read). The file
    must be a regular file (`open_regular_file`), and its header is checked against it here, whatever the installed
    safetensors checks: its length, every tensor's byte range inside the data and as long as its shape and dtype make
    it, and no two tensors sharing bytes; any problem is a ValueError naming the file."""
    try:
        with open_regular_file(path) as handle:
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
