"""Building a TitansQwen on a base, loading and saving its memory: the model's side of the memory folder.

`memory_folder` defines the folder's files and reads them safely; this module puts them to work on a model, the way
PEFT keeps `utils/save_and_load.py` apart from `peft_model.py`. `TitansQwenForCausalLM`'s public methods
(`from_base`, `from_base_and_memory`, `from_pretrained` of a memory folder, `save_memory`, `memory_state_dict`,
`load_memory_state_dict`, `check_memory_weights`, `push_to_hub` of the memory) are thin calls of the functions here,
which take the model (or its class) as an argument and never import it.

A LoRA adapter saved beside the memory is read and written through `titans_hf.lora` (it needs PEFT), and a push goes
through `titans_hf.hub` (the model card): both are imported when first needed, and neither imports the model, so the
package's imports run one way: model -> this module -> lora / hub -> the folder format.

PEFT's `AutoPeftModelForCausalLM.from_pretrained(folder)` reaches this module through `AutoModelForCausalLM` for the
model its `adapter_config.json` names (`base_model_name_or_path`), then puts that folder's adapter on it: PEFT's
contract, which names nothing else. A saved folder names itself (`titans_hf.lora.adapter_files`), so there PEFT loads
the folder's own memory and adapter; a copied or moved folder, or an edited file, names another folder, whose memory
PEFT then runs under this folder's adapter. `TitansQwenForCausalLM.from_pretrained(folder)` always reads the memory
and the adapter that lie together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .configuration_titans_qwen import TitansMemoryConfig, TitansQwenConfig
from .memory_folder import (
    ADAPTER_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    base_fingerprint,
    check_safetensors_folder,
    file_key,
    hub_file,
    is_hub_id,
    is_memory_name,
    load_memory_weights,
    optional_hub_file,
    read_safetensors_header,
    recorded_base,
    save_memory_folder,
)
from .variants import memory_blocks, persistent_tokens

logger = logging.getLogger(__name__)

# The file keys of the base's weights; the rest of a full model's file is the memory's.
BASE_PREFIXES = ("model.", "lm_head.")
# What the Hub download of a memory takes; everything else goes to the base's from_pretrained.
HUB_KWARGS = ("token", "cache_dir", "local_files_only")
# What the Auto classes and pipelines add to a model's from_pretrained; a memory's base never sees them.
AUTO_KWARGS = ("_from_auto", "_from_pipeline", "adapter_kwargs", "trust_remote_code")


@dataclasses.dataclass(frozen=True)
class BaseLoading:
    """How the base loads: its revision on the Hub, dtype, attention implementation and any further arguments of its
    `from_pretrained` (`token`, `device_map`, ...). Not used for a base given as a loaded model."""

    revision: str | None = None
    dtype: torch.dtype | str | None = None
    attn_implementation: str | None = None
    load_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """The base's `from_pretrained` arguments: never code from its repository, safetensors only."""
        kwargs = {**self.load_kwargs, "trust_remote_code": False, "use_safetensors": True}
        for key in ("revision", "dtype", "attn_implementation"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return kwargs


@dataclasses.dataclass(frozen=True)
class MemorySource:
    """A memory folder, or a Hub repository holding one, and how to reach it."""

    name_or_path: str | os.PathLike
    revision: str | None = None
    token: str | None = None
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False

    @property
    def hub_kwargs(self) -> dict[str, Any]:
        return {"token": self.token, "cache_dir": self.cache_dir, "local_files_only": self.local_files_only}

    def file(self, name: str) -> Path:
        return hub_file(self.name_or_path, name, revision=self.revision, **self.hub_kwargs)

    def optional_file(self, name: str) -> Path | None:
        return optional_hub_file(self.name_or_path, name, revision=self.revision, **self.hub_kwargs)


# ---- a new memory on a base ----


def refuse_adapted_base(base: Any) -> None:
    """A base wrapped or adapted by PEFT would keep its adapter frozen under the memory and out of every save:
    refuse it, naming the route that trains a LoRA with the memory."""
    holds_adapters = bool(getattr(base, "peft_config", None))
    if holds_adapters or not isinstance(base, (str, os.PathLike, PreTrainedModel)):
        raise ValueError(f"from_base: the base is a {type(base).__name__}{' holding PEFT adapters' * holds_adapters}; "
                         "pass the plain base (a Hub id, a folder or a loaded Qwen) and put the LoRA on the "
                         "TitansQwen: titans_hf.lora.add_lora(TitansQwenForCausalLM.from_base(base, ...), "
                         "LoraConfig(...)) trains the LoRA with the memory and saves both")


def load_backbone(base: str | os.PathLike | PreTrainedModel, loading: BaseLoading) -> tuple[PreTrainedModel, str]:
    """(the base's causal LM, its name): `base` itself when loaded, else loaded as `loading` says."""
    if isinstance(base, PreTrainedModel):
        backbone, name = base, base.config.name_or_path
    else:
        check_safetensors_folder(base, "from_base: the base")
        backbone, name = AutoModelForCausalLM.from_pretrained(base, **loading.from_pretrained_kwargs()), str(base)
    if not (hasattr(backbone, "model") and hasattr(backbone, "lm_head")):
        raise ValueError(f"from_base: {name} is a {type(backbone).__name__}, not a Qwen causal LM")
    return backbone, name


def new_memory_config(memory_config: TitansMemoryConfig | None, memory_settings: dict[str, Any], base_name: str,
                      revision: str | None) -> TitansMemoryConfig:
    """`memory_config` (None: the defaults) with `memory_settings` over it, naming the base it goes on: a Hub id at
    `revision`, or a local folder by its absolute path and fingerprint. An `update_rule` other than
    `memory_config`'s takes its own rule's defaults for the per-rule settings not given."""
    values = memory_config.to_dict() if memory_config is not None else {}
    if values and memory_settings.get("update_rule", values["update_rule"]) != values["update_rule"]:
        # the other rule's values: None resolves them anew for this one
        values.update(dict.fromkeys(TitansMemoryConfig.PER_RULE_FIELDS))
    values.update(memory_settings)
    if values.get("base_model_name_or_path") is None:
        values.update(base_model_name_or_path=base_name, revision=revision)
        if base_name and Path(base_name).is_dir():  # a local base: the same folder from anywhere, and the same model
            values.update(base_model_name_or_path=str(Path(base_name).resolve()),
                          base_fingerprint=base_fingerprint(base_name))
    return TitansMemoryConfig.from_dict(values, source="from_base")


def build_on_base(model_class: type, base: str | os.PathLike | PreTrainedModel,
                  memory_config: TitansMemoryConfig | None, loading: BaseLoading,
                  memory_settings: dict[str, Any]) -> PreTrainedModel:
    """`TitansQwenForCausalLM.from_base`'s work: the base loaded (or taken), a new memory of `memory_config` with
    `memory_settings` over it, the model of `model_class` on the base's device."""
    unknown = sorted(set(memory_settings) - set(TitansMemoryConfig.setting_names()))
    if unknown:
        raise ValueError(f"from_base: unknown memory settings {unknown}; valid: "
                         f"{list(TitansMemoryConfig.setting_names())}")
    refuse_adapted_base(base)
    backbone, name = load_backbone(base, loading)
    resolved = new_memory_config(memory_config, memory_settings, name, loading.revision)
    attention = backbone.config._attn_implementation
    config = TitansQwenConfig(text_config=backbone.config, memory_config=resolved)
    # building the config resets its sub-config's attention choice; keep the one the backbone was loaded with
    config._attn_implementation = attention
    config.name_or_path = name  # what TRL and PEFT read as the base's name
    model = model_class(config, backbone=backbone)
    model.to(backbone.device)
    model.generation_config = backbone.generation_config
    return model


# ---- a trained memory on a base ----


def memory_base(base: str | os.PathLike | PreTrainedModel | None, source: MemorySource,
                memory_config: TitansMemoryConfig) -> str | os.PathLike | PreTrainedModel:
    """The base a memory goes on: `base`, or (None) the one its config names, checked to be the model it was
    trained on (`recorded_base`); a local `base` other than the recorded one is used, with a warning."""
    memory_path = source.name_or_path
    if base is None:
        named = memory_config.base_model_name_or_path
        if named and not Path(memory_path).is_dir() and (not is_hub_id(named) or Path(named).exists()):
            # a downloaded file never picks a path on this machine
            raise ValueError(f"{memory_path}: its memory config names the base {named!r}, which is not a Hub id; pass "
                             "the base explicitly (from_base_and_memory(base, memory))")
        return recorded_base(named, memory_config.base_fingerprint, str(memory_path))
    if (not isinstance(base, PreTrainedModel) and memory_config.base_fingerprint is not None
            and Path(base).is_dir() and base_fingerprint(base) != memory_config.base_fingerprint):
        logger.warning("%s: the base %s is not the model the memory was trained on (%s; base_fingerprint "
                       "differs); using it as asked", memory_path, base, memory_config.base_model_name_or_path)
    return base


def check_memory_on_base(base: str | os.PathLike | PreTrainedModel, source: MemorySource,
                         memory_config: TitansMemoryConfig, weights_path: Path, base_revision: str | None) -> None:
    """The memory's weights against the memory its config makes on `base` (names, shapes, dtypes), from the
    base's config alone: nothing is allocated, so a config declaring a huge memory (memory_head_dim 2^20) is
    refused naming the file, not after the model has tried to allocate terabytes."""
    if isinstance(base, PreTrainedModel):
        text = base.config
    else:
        text = AutoConfig.from_pretrained(base, revision=base_revision, trust_remote_code=False, **source.hub_kwargs)
    try:
        fitted = memory_config.for_base(text)
    except ValueError as error:
        raise ValueError(f"{source.name_or_path}: {error}") from error
    check_memory_weights(fitted, read_safetensors_header(weights_path), str(weights_path))


def load_on_base(model_class: type, base: str | os.PathLike | PreTrainedModel | None, source: MemorySource,
                 loading: BaseLoading) -> PreTrainedModel:
    """`TitansQwenForCausalLM.from_base_and_memory`'s work: the memory's files checked, the base resolved and
    loaded, the memory's weights and (saved beside them) the LoRA adapter put on it. `loading.revision` None takes
    the base revision the memory config records."""
    memory_config = TitansMemoryConfig.from_pretrained(source.name_or_path, revision=source.revision,
                                                       **source.hub_kwargs)
    weights_path = source.file(MEMORY_WEIGHTS_NAME)
    adapter_config_path = source.optional_file(ADAPTER_CONFIG_NAME)
    if adapter_config_path is not None:  # a LoRA trained with the memory: checked before the base loads
        from titans_hf.lora import read_adapter_config  # needs PEFT, which only an adapter does

        read_adapter_config(adapter_config_path)
    base = memory_base(base, source, memory_config)
    if loading.revision is None:
        loading = dataclasses.replace(loading, revision=memory_config.revision)
    check_memory_on_base(base, source, memory_config, weights_path, loading.revision)
    loading = dataclasses.replace(loading, load_kwargs={**loading.load_kwargs, **source.hub_kwargs})
    model = build_on_base(model_class, base, memory_config, loading, {})
    load_memory_state_dict(model, load_memory_weights(weights_path), source=str(weights_path))
    if adapter_config_path is not None:
        from titans_hf.lora import load_lora

        load_lora(model, source.name_or_path, revision=source.revision, **source.hub_kwargs)
    return model


def memory_folder_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`from_pretrained`'s keyword arguments for a memory folder, as `from_base_and_memory` takes them: the config the
    Auto classes read from the folder gives only its attention choice, and their own markers are dropped."""
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    if config is not None and not isinstance(config, TitansQwenConfig):
        raise ValueError(f"from_pretrained: config must be a TitansQwenConfig for a memory, got "
                         f"{type(config).__name__}")
    if config is not None and config._attn_implementation_internal is not None:
        # the Auto classes put the caller's attn_implementation on the config they pass
        kwargs.setdefault("attn_implementation", config._attn_implementation_internal)
    for key in AUTO_KWARGS:
        kwargs.pop(key, None)
    return kwargs


# ---- a full model's folder ----


def check_full_model_folder(path: str | os.PathLike) -> dict[str, Path]:
    """{file key: the file holding it} of a full model's folder (empty for a Hub id), its memory's shapes checked
    against its config before anything is built: a config that declares a huge memory is named here, not in the
    loader's size-mismatch report."""
    check_safetensors_folder(path, "from_pretrained: the model folder")
    folder = Path(path)
    if not (folder.is_dir() and any(folder.glob("*.safetensors"))):
        return {}
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    headers = {weights: read_safetensors_header(weights) for weights in sorted(folder.glob("*.safetensors"))}
    if isinstance(config, TitansQwenConfig):
        header = {name: entry for header in headers.values() for name, entry in header.items()
                  if not name.startswith(BASE_PREFIXES)}
        check_memory_weights(config.memory_config, header, str(folder), check_dtype=False)
    return {name: weights for weights, header in headers.items() for name in header}


def check_loaded_full_model(model: PreTrainedModel, missing_keys: list[str], files: dict[str, Path],
                            path: str | os.PathLike) -> None:
    """Refuse a full model whose files lacked some of its tensors (transformers would start them at random) or hold
    NaN or infinite values, naming the folder (or file) and the tensors."""
    missing = sorted(file_key(name) for name in missing_keys)
    if missing:
        raise ValueError(f"{path}: its weight files lack {len(missing)} of the model's "
                         f"tensors ({', '.join(missing[:5])}{', ...' * (len(missing) > 5)}), which would start "
                         "at random; a full model folder holds every tensor of the base and the memory, as "
                         "save_pretrained(save_full_model=True) writes it")
    # as a memory folder's weights are (load_memory_state_dict): one pass over the loaded tensors, no file read
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
            key = file_key(name)
            raise ValueError(f"{files.get(key, path)}: {key} holds NaN or infinite values; the model is broken (a "
                             "diverged training run), not loaded")


# ---- the memory's weights ----


def memory_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """{key in a memory folder: parameter name} of every memory parameter of `model`."""
    return {file_key(name): name for name, _ in model.named_parameters() if is_memory_name(name)}


def memory_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The memory's own parameters of `model` under a memory folder's keys."""
    return {key: model.get_parameter(name).detach() for key, name in memory_parameter_names(model).items()}


def load_memory_state_dict(model: torch.nn.Module, state_dict: dict[str, Tensor], source: str) -> None:
    """Copy memory weights into `model`, keyed as `memory_state_dict` keys them; names, shapes and a floating dtype
    must match, and the values be finite (a ValueError naming `source`)."""
    own = memory_state_dict(model)
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


# ---- saving and pushing the memory ----


def memory_folder_config(model: PreTrainedModel) -> dict[str, Any]:
    """The `config.json` of a memory folder: the model's config (the base's config as `text_config`, the memory
    settings), by which `AutoConfig` and `AutoModelForCausalLM` recognise the folder; no local path in it."""
    values = json.loads(model.config.to_json_string(use_diff=True))
    values["architectures"] = [type(model).__name__]
    values.pop("_name_or_path", None)
    values["text_config"].pop("_name_or_path", None)
    return values


def save_memory(model: PreTrainedModel, save_directory: str | os.PathLike) -> Path:
    """The memory folder of `model`, and beside it its LoRA adapter if it holds one (`titans_hf.lora`: PEFT's
    adapter_config.json, naming this folder as the model it goes on, and adapter_model.safetensors)."""
    adapter = None
    if getattr(model, "peft_config", None):
        from titans_hf.lora import adapter_files  # needs PEFT, which only an adapter does

        adapter = adapter_files(model, folder=save_directory)
    return save_memory_folder(save_directory, model.config.memory_config.to_dict(), memory_state_dict(model),
                              model_config=memory_folder_config(model), adapter=adapter)


def push_memory(model: PreTrainedModel, repo_id: str, **push_kwargs: Any) -> str:
    """The memory folder of `model` (and its LoRA adapter) uploaded with its model card
    (`titans_hf.hub.push_memory_folder`, given `push_kwargs`); returns the commit URL."""
    from titans_hf.hub import push_memory_folder  # the model card's templates load only for a push

    with tempfile.TemporaryDirectory() as folder:
        save_memory(model, folder)
        return push_memory_folder(folder, repo_id, check_weights=check_memory_weights, **push_kwargs)
