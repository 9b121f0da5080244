"""LoRA adapters (PEFT) on the base of a TitansQwen, trained together with its memory.

`add_lora(model, LoraConfig(...))` injects PEFT's own LoRA layers (`peft.inject_adapter_in_model`) into linear
modules of the base, in place: the model stays a `TitansQwenForCausalLM`, its base weights stay frozen and bitwise
as loaded, and the LoRA weights train together with the memory (`TitansTrainer`, or a plain `transformers.Trainer`).
Its folder (`save_pretrained`, `push_to_hub`, every `TitansTrainer` checkpoint) holds each part in its own format:

- the memory folder as without an adapter: `memory_config.json` (naming the base), `memory_model.safetensors`,
  `config.json`;
- PEFT's adapter: `adapter_config.json` (a `LoraConfig`, its `target_modules` the full names of the adapted modules)
  and `adapter_model.safetensors` under PEFT's keys (`base_model.model.<module>.lora_A.weight`). The base keeps its
  keys inside a TitansQwen, so `PeftModel.from_pretrained(<the plain base>, folder)` puts the same LoRA on the base
  alone. Its `base_model_name_or_path` names the folder itself (pushed: the repository), the base plus the memory,
  so that PEFT's `AutoPeftModelForCausalLM.from_pretrained(folder)` loads the whole model, the LoRA counted once.
  That is PEFT's contract: its auto class loads the model `base_model_name_or_path` names (through
  `AutoModelForCausalLM`), wherever the adapter's file now lies, and puts the given folder's adapter on it, as
  `PeftModel.from_pretrained(<that model>, folder)` does. So for a copy of the folder, a moved folder or an edited
  file, PEFT runs the folder the field names (its memory) under this folder's adapter, and for a file edited to
  name a plain model, the bare base with the LoRA and no memory. Inside a TitansQwen the base's modules keep a plain
  Qwen's names, and PEFT matches `target_modules` and weight keys by name, so what fits the one fits the other.
  `TitansQwenForCausalLM.from_pretrained(folder)` always reads the memory and the adapter that lie together.

`TitansQwenForCausalLM.from_pretrained(folder)` (and `AutoModelForCausalLM`, `from_base_and_memory`) loads the base the
memory names, the memory, then the adapter (`load_lora`), memory and LoRA trainable as they were saved.

Why not `get_peft_model`: PEFT marks every parameter but the adapter's frozen (the memory too) and wraps the model in a
`PeftModel` whose save writes the adapter alone. The LoRA layers are PEFT's own, injected in place
(`inject_adapter_in_model`), with the parameters that trained before (the memory) set trainable again, so the model
keeps its class, its own save and its memory.

An adapter folder is data: `adapter_config.json` may hold plain LoRA settings only (rank, alpha, dropout, rsLoRA,
module names), every other PEFT setting at its default, so nothing in it chooses code, paths or an initialisation
that changes the base; the weights load from safetensors only, and their names and shapes are checked against the
modules they adapt before any LoRA layer is built.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from torch import Tensor, nn
from transformers import PreTrainedModel

from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    hub_file,
    is_memory_name,
    load_memory_weights,
    read_safetensors_header,
)

ADAPTER_NAME = "default"  # PEFT's name for a single adapter; a TitansQwen holds one
PEFT_KEY_PREFIX = "base_model.model."  # what PEFT puts in front of a module's name in an adapter file
# The LoRA settings an adapter may choose; every other key of adapter_config.json must hold LoraConfig's default.
LORA_SETTINGS = ("r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules")
# Keys that describe an adapter and choose nothing: checked for their type, never used to load anything.
DESCRIPTIVE_KEYS = ("peft_type", "task_type", "base_model_name_or_path", "revision", "peft_version", "inference_mode",
                    "init_lora_weights")
# Initialisations that leave the base as it is (PiSSA, OLoRA, LoftQ, EVA, CorDA rewrite base weights).
BASE_PRESERVING_INITS = (True, False, "gaussian")
# What add_lora also takes from a user's own config to find the modules (they are resolved to names, then dropped).
TARGET_SELECTORS = ("exclude_modules", "layers_to_transform", "layers_pattern")
_MODULE_NAME = re.compile(r"[A-Za-z0-9_.]{1,300}")
MAX_TARGETS = 100_000


def _json_ready(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict as it reads back from adapter_config.json (sets as sorted lists, enums as strings)."""
    return json.loads(json.dumps({key: sorted(value) if isinstance(value, set) else value
                                  for key, value in values.items()}, default=str))


def _defaults() -> dict[str, Any]:
    return _json_ready(LoraConfig().to_dict())


def _is_base_module(name: str) -> bool:
    """Whether a module of a TitansQwen is the base's (its decoder's layers, embeddings, norm, LM head), not the
    memory's."""
    return (name == "lm_head" or name.startswith(("model.", "lm_head."))) and not is_memory_name(name)


def has_lora(model: nn.Module) -> bool:
    """Whether LoRA layers of PEFT are injected into `model`."""
    return any(isinstance(module, LoraLayer) for module in model.modules())


def _lora_settings(values: dict[str, Any], source: str, own_config: bool = False) -> dict[str, Any]:
    """The LoRA settings of a config dict (read from adapter_config.json, or `LoraConfig.to_dict()` of the user's
    own config when `own_config`), checked: a ValueError naming `source` and the key for anything else."""
    if values.get("peft_type") != "LORA":
        raise ValueError(f"{source}: peft_type is {values.get('peft_type')!r}; titans_hf puts LoRA adapters only "
                         "(peft_type LORA) on a TitansQwen")
    defaults = _defaults()
    allowed = LORA_SETTINGS + DESCRIPTIVE_KEYS + (TARGET_SELECTORS if own_config else ())
    for key, value in values.items():
        if key in allowed:
            continue
        if key not in defaults:
            raise ValueError(f"{source}: unknown adapter setting {key!r}; an adapter of titans_hf holds LoraConfig "
                             "fields only")
        if value != defaults[key]:
            raise ValueError(f"{source}: {key}={value!r}; titans_hf trains and loads plain LoRA only, so {key} must "
                             f"stay at PEFT's default {defaults[key]!r}")
    settings = {key: values.get(key, defaults[key]) for key in LORA_SETTINGS}
    r, alpha, dropout = settings["r"], settings["lora_alpha"], settings["lora_dropout"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{source}: r={r!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{source}: lora_alpha={alpha!r} must be a finite number > 0")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{source}: lora_dropout={dropout!r} must be a number in [0, 1)")
    if not isinstance(settings["use_rslora"], bool):
        raise ValueError(f"{source}: use_rslora={settings['use_rslora']!r} must be true or false")
    targets = settings["target_modules"]
    if not own_config and (not isinstance(targets, list) or not targets or len(targets) > MAX_TARGETS or not all(
            isinstance(name, str) and _MODULE_NAME.fullmatch(name) for name in targets)):
        raise ValueError(f"{source}: target_modules must be a non-empty list of module names (letters, digits, _ and "
                         f"., as titans_hf saves them), got {str(targets)[:200]}")
    if own_config and not targets:
        raise ValueError(f"{source}: target_modules must name the base's modules to adapt (e.g. ['q_proj', 'v_proj'] "
                         "or 'all-linear'); PEFT has no default for a titans_qwen model")
    if values.get("task_type") not in (None, "CAUSAL_LM"):
        raise ValueError(f"{source}: task_type={values.get('task_type')!r}; a TitansQwen is a causal LM (CAUSAL_LM)")
    if values.get("init_lora_weights", True) not in BASE_PRESERVING_INITS:
        raise ValueError(f"{source}: init_lora_weights={values.get('init_lora_weights')!r} rewrites the base's "
                         f"weights; the base stays frozen and as loaded, so only {list(BASE_PRESERVING_INITS)} are "
                         "allowed")
    for key in ("base_model_name_or_path", "revision", "peft_version"):
        if values.get(key) is not None and not isinstance(values[key], str):
            raise ValueError(f"{source}: {key}={values[key]!r} must be a string or null")
    if not isinstance(values.get("inference_mode", False), bool):
        raise ValueError(f"{source}: inference_mode={values['inference_mode']!r} must be true or false")
    return settings


def read_adapter_config(path: str | Path) -> LoraConfig:
    """The `LoraConfig` of an adapter_config.json, built from its LoRA settings alone (see the module docstring); any
    problem is a ValueError naming the file."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON adapter config ({error})") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of LoRA settings, got {type(values).__name__}")
    settings = _lora_settings(values, str(path))
    return LoraConfig(**settings, task_type="CAUSAL_LM")


def _target_names(model: nn.Module, config: LoraConfig, source: str) -> list[str]:
    """The full names of the modules `config` adapts in `model`: linear modules of the base only."""
    if config.target_modules == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        names = [name for name, module in model.named_modules()
                 if isinstance(module, nn.Linear) and name.startswith("model.") and not is_memory_name(name)]
    else:
        names = [name for name, _ in model.named_modules() if bool(check_target_module_exists(config, name))]
    if not names:
        raise ValueError(f"{source}: target_modules {str(config.target_modules)[:200]} match no module of the base")
    modules = dict(model.named_modules())
    outside = [name for name in names if not _is_base_module(name)]
    if outside:
        raise ValueError(f"{source}: target_modules reach {outside[:5]}, which are not the base's: the memory trains "
                         "in full beside the LoRA, so adapt base modules only (e.g. ['q_proj', 'v_proj'])")
    not_linear = [name for name in names if type(modules[name]) is not nn.Linear]
    if not_linear:
        raise ValueError(f"{source}: target_modules reach {not_linear[:5]}, which are not plain linear layers (or "
                         "hold an adapter already); titans_hf adapts nn.Linear modules of the base only")
    return names


def add_lora(model: PreTrainedModel, lora_config: LoraConfig) -> PreTrainedModel:
    """Inject PEFT's LoRA layers, as `lora_config` describes them, into linear modules of the (frozen) base, in
    place; the memory stays trainable beside them.

    The base's modules have a plain Qwen's names (`model.layers.0.self_attn.q_proj`, `lm_head`), so target modules
    are written as for any Qwen. Settings other than rank, alpha, dropout and rsLoRA (DoRA, modules_to_save, biases,
    initialisations that rewrite the base, ...) are refused: the folder's formats and the frozen base leave no place
    for them. A model built on a loaded base shares that base's modules, so the base object holds the LoRA layers
    too.

    Args:
        model (`TitansQwenForCausalLM`):
            A model with a frozen base (`freeze_base=True`) and no LoRA yet.
        lora_config (`peft.LoraConfig`):
            `r`, `lora_alpha`, `lora_dropout`, `use_rslora`, and the modules to adapt: `target_modules` (names or
            name suffixes such as `["q_proj", "v_proj"]`, full names such as `"model.layers.0.self_attn.q_proj"`, a
            regex, or `"all-linear"`: every linear layer of the decoder), optionally narrowed by `exclude_modules`,
            `layers_to_transform` and `layers_pattern`. They must reach base modules only, and are recorded as the
            full names of the adapted modules.

    Returns:
        `TitansQwenForCausalLM`: `model` itself, adapted.
    """
    if not isinstance(lora_config, LoraConfig):
        raise ValueError(f"add_lora: lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}")
    memory = model.config.memory_config
    if not memory.freeze_base:
        raise ValueError("add_lora: the model trains its whole base (freeze_base=False); LoRA adapts a frozen base, "
                         "so build the model with freeze_base=True")
    if has_lora(model):
        raise ValueError("add_lora: the model holds a LoRA adapter already; a TitansQwen holds one")
    values = _json_ready(lora_config.to_dict())
    settings = _lora_settings(values, "add_lora: lora_config", own_config=True)
    names = _target_names(model, lora_config, "add_lora: lora_config")
    config = LoraConfig(**{**settings, "target_modules": names}, task_type="CAUSAL_LM",
                        init_lora_weights=values.get("init_lora_weights", True),
                        base_model_name_or_path=memory.base_model_name_or_path, revision=memory.revision)
    _inject(model, config)
    return model


def _inject(model: nn.Module, config: LoraConfig) -> None:
    """PEFT's injection, which marks everything but the adapter frozen; what trained before (the memory) trains
    again."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    inject_adapter_in_model(config, model, ADAPTER_NAME)
    for param in trainable:
        param.requires_grad_(True)


def _file_key(name: str) -> str | None:
    """The adapter-file key of a model parameter name (None for a parameter that is not LoRA's)."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{ADAPTER_NAME}.weight"
        if name.endswith(marker):
            return PEFT_KEY_PREFIX + name[: -len(marker)] + f".{part}.weight"
    return None


def _parameter_name(key: str) -> str:
    """The model parameter name of an adapter-file key (the inverse of `_file_key`)."""
    module, part, _ = key[len(PEFT_KEY_PREFIX):].rsplit(".", 2)
    return f"{module}.{part}.{ADAPTER_NAME}.weight"


def is_lora_parameter(name: str) -> bool:
    return _file_key(name) is not None


def adapter_files(model: nn.Module, state_dict: dict[str, Tensor] | None = None, *,
                  folder: str | os.PathLike | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(adapter_config.json as a dict, adapter_model.safetensors' tensors under PEFT's keys) of a model with a LoRA
    adapter; the weights from `state_dict` (named as the model's parameters) when given, else from the model.

    With `folder`, the folder the files go to, the config names that folder (absolute) as the model the adapter goes
    on: the base plus the memory beside it, which is what PEFT's `AutoPeftModelForCausalLM` then loads (through
    `AutoModelForCausalLM`) before putting the adapter on it; naming the bare base, it would drop the memory. A push
    names the repository the same way (`titans_hf.hub`)."""
    config = model.peft_config[ADAPTER_NAME]
    values = _json_ready(config.to_dict())
    values["inference_mode"] = False
    if folder is not None:
        values.update(base_model_name_or_path=str(Path(folder).resolve()), revision=None)
    if state_dict is None:
        state_dict = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
        tensors = {PEFT_KEY_PREFIX + name: tensor for name, tensor in state_dict.items()}
    else:
        tensors = {key: tensor for name, tensor in state_dict.items() if (key := _file_key(name)) is not None}
    expected = set(expected_adapter_tensors(model, config))
    if set(tensors) != expected:
        raise ValueError(f"the LoRA weights to save ({len(tensors)}) are not the adapter's ({len(expected)}): missing "
                         f"{sorted(expected - set(tensors))[:3]}, unexpected {sorted(set(tensors) - expected)[:3]}")
    return values, tensors


def expected_adapter_tensors(model: nn.Module, config: LoraConfig,
                             source: str = "adapter") -> dict[str, tuple[int, ...]]:
    """{adapter-file key: shape} of the LoRA `config` puts on `model` (adapted or not yet)."""
    modules = dict(model.named_modules())
    names = [name for name, module in modules.items() if isinstance(module, LoraLayer)] or _target_names(
        model, config, source)
    expected = {}
    for name in names:
        module = modules[name]
        layer = module.get_base_layer() if isinstance(module, LoraLayer) else module
        expected[f"{PEFT_KEY_PREFIX}{name}.lora_A.weight"] = (config.r, layer.in_features)
        expected[f"{PEFT_KEY_PREFIX}{name}.lora_B.weight"] = (layer.out_features, config.r)
    return expected


def check_adapter_weights(expected: dict[str, tuple[int, ...]], header: dict[str, tuple[tuple[int, ...], Any]],
                          source: str) -> None:
    """The names, shapes and floating dtypes of an adapter file's header against what its config makes."""
    missing, unexpected = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: not the weights of its adapter config on this model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    for key, shape in expected.items():
        if tuple(header[key][0]) != tuple(shape) or not header[key][1].is_floating_point:
            raise ValueError(f"{source}: {key} is {header[key][1]} {tuple(header[key][0])}, its adapter config makes "
                             f"a floating tensor of shape {tuple(shape)}")


def adapter_state_dict(model: nn.Module, weights_path: str | Path) -> dict[str, Tensor]:
    """The LoRA weights of an adapter file, checked against the model's adapter, under the model's parameter names."""
    config = model.peft_config[ADAPTER_NAME]
    check_adapter_weights(expected_adapter_tensors(model, config), read_safetensors_header(weights_path),
                          str(weights_path))
    weights = load_memory_weights(weights_path)
    for key, tensor in weights.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{weights_path}: {key} holds NaN or infinite values; the adapter is broken, not loaded")
    return {_parameter_name(key): tensor for key, tensor in weights.items()}


def load_lora(model: PreTrainedModel, name_or_path: str | Path, revision: str | None = None,
              **hub_kwargs: Any) -> PreTrainedModel:
    """Put the adapter of a folder or Hub repository (adapter_config.json, adapter_model.safetensors) on `model`, in
    place: the config and the weights' header are checked before any LoRA layer is built. What trained before (the
    memory) and the LoRA train; the base stays frozen. Returns `model`."""
    config_path = hub_file(name_or_path, ADAPTER_CONFIG_NAME, revision=revision, **hub_kwargs)
    weights_path = hub_file(name_or_path, ADAPTER_WEIGHTS_NAME, revision=revision, **hub_kwargs)
    config = read_adapter_config(config_path)
    if has_lora(model):
        raise ValueError(f"{name_or_path}: the model holds a LoRA adapter already; a TitansQwen holds one")
    names = _target_names(model, config, str(config_path))
    check_adapter_weights(expected_adapter_tensors(model, config, str(config_path)),
                          read_safetensors_header(weights_path), str(weights_path))
    memory = model.config.memory_config
    config.base_model_name_or_path, config.revision = memory.base_model_name_or_path, memory.revision
    config.target_modules = names
    _inject(model, config)
    weights = adapter_state_dict(model, weights_path)
    parameters = dict(model.named_parameters())
    for name, tensor in weights.items():
        if tensor.dtype != parameters[name].dtype:
            raise ValueError(f"{weights_path}: {name} is {tensor.dtype}, this model's LoRA is {parameters[name].dtype}")
    with torch.no_grad():
        for name, tensor in weights.items():
            parameters[name].copy_(tensor)
    return model


def lora_settings(config: LoraConfig) -> dict[str, Any]:
    """What makes two adapters the same training setup (rank, alpha, dropout, rsLoRA, adapted modules): what a resume
    compares with the checkpoint's adapter_config.json."""
    return _lora_settings(_json_ready(config.to_dict()), "adapter config")


__all__ = ["add_lora", "has_lora", "load_lora", "read_adapter_config"]
