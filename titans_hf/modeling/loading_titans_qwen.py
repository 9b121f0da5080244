"""How a `TitansQwenForCausalLM` is built on a pretrained base, loaded and saved, the way PEFT's adapters are.

`from_base` puts a new memory on a base; `from_pretrained` on a memory folder or Hub repository loads the base its
`memory_config.json` names and puts the memory on it (`from_base_and_memory`); `save_pretrained` and `push_to_hub`
of a model with a frozen base write the memory alone (see `titans_hf.modeling.memory_folder`), `save_full_model=True`
the whole model as any `PreTrainedModel`.

The memory's parameters sit in the decoder (`model.memory.<layer>.*`, `model.persistent_tokens`); its files store
them without the decoder's `model.` in front (`memory.<layer>.*`, `persistent_tokens`): a memory folder through
`memory_state_dict` / `load_memory_state_dict`, a full model's `model.safetensors` through transformers' key
renaming (`FULL_MODEL_KEY_RENAMING`, undone on save), so folders keep one format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from .configuration_titans_qwen import TitansMemoryConfig, TitansQwenConfig
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
from .variants import memory_blocks, persistent_tokens

if TYPE_CHECKING:
    from .modeling_titans_qwen import TitansQwenForCausalLM

logger = logging.getLogger(__name__)

# The file keys of the base's weights; the rest of a full model's file is the memory's.
BASE_PREFIXES = ("model.", "lm_head.")
# What the Hub download of a memory takes; everything else goes to the base's from_pretrained.
HUB_KWARGS = ("token", "cache_dir", "local_files_only")
# What the Auto classes and pipelines add to a model's from_pretrained; a memory's base never sees them.
AUTO_KWARGS = ("_from_auto", "_from_pipeline", "adapter_kwargs", "trust_remote_code")
# A full model's file keys of the memory -> its parameter names (and back on save).
FULL_MODEL_KEY_RENAMING = [WeightRenaming(r"^memory\.", "model.memory."),
                           WeightRenaming(r"^persistent_tokens", "model.persistent_tokens")]
register_checkpoint_conversion_mapping("TitansQwenForCausalLM", FULL_MODEL_KEY_RENAMING, overwrite=True)
_DECODER_PREFIX = "model."


def is_memory_name(name: str) -> bool:
    """Whether a parameter or module name of a TitansQwenForCausalLM is the memory's (its blocks, the persistent
    tokens) rather than the base's or a LoRA's."""
    return name == "model.memory" or name.startswith(("model.memory.", "model.persistent_tokens"))


def file_key(name: str) -> str:
    """The key under which a memory folder or a full model's file stores the parameter `name`: the memory's without
    the decoder's `model.` in front, every other one as it is."""
    return name.removeprefix(_DECODER_PREFIX) if is_memory_name(name) else name


def _refuse_adapted_base(base: Any) -> None:
    """A base wrapped or adapted by PEFT would keep its adapter frozen under the memory and out of every save:
    refuse it, naming the route that trains a LoRA with the memory."""
    holds_adapters = bool(getattr(base, "peft_config", None))
    if holds_adapters or not isinstance(base, (str, os.PathLike, PreTrainedModel)):
        raise ValueError(f"from_base: the base is a {type(base).__name__}{' holding PEFT adapters' * holds_adapters}; "
                         "pass the plain base (a Hub id, a folder or a loaded Qwen) and put the LoRA on the "
                         "TitansQwen: titans_hf.lora.add_lora(TitansQwenForCausalLM.from_base(base, ...), "
                         "LoraConfig(...)) trains the LoRA with the memory and saves both")


class TitansLoadingMixin:
    """Building, loading and saving of `TitansQwenForCausalLM` (see the module docstring)."""

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
    ) -> TitansQwenForCausalLM:
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
                an unknown name is a ValueError.

        Returns:
            `TitansQwenForCausalLM`: the base with a freshly initialised memory, on the base's device.
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
    ) -> TitansQwenForCausalLM:
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
                        **kwargs: Any) -> TitansQwenForCausalLM:
        """A memory folder or Hub repository (its `memory_config.json` names the base, which is loaded first; see
        `from_base_and_memory` for the keyword arguments), or a full model saved with `save_full_model=True`, whose
        files must hold every tensor of the model (transformers would start a missing one at random: a ValueError
        names the folder, the count and the first missing names) and whose tensors must all be finite once loaded (a
        ValueError names the file and the tensor), as a memory's are. `output_loading_info=True` returns
        `(model, loading_info)` as `PreTrainedModel.from_pretrained` does, for a full model.

        `AutoModelForCausalLM.from_pretrained` and `pipeline` arrive here through the folder's `config.json`; what
        they add (the config they read from it, their own markers, `trust_remote_code`) does not reach the base,
        which always loads with `trust_remote_code=False`."""
        hub = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
        if not args and is_memory(pretrained_model_name_or_path, revision=kwargs.get("revision"), **hub):
            config = kwargs.pop("config", None)
            if config is not None and not isinstance(config, TitansQwenConfig):
                raise ValueError(f"from_pretrained: config must be a TitansQwenConfig for a memory, got "
                                 f"{type(config).__name__}")
            if config is not None and config._attn_implementation_internal is not None:
                # the Auto classes put the caller's attn_implementation on the config they pass
                kwargs.setdefault("attn_implementation", config._attn_implementation_internal)
            for key in AUTO_KWARGS:
                kwargs.pop(key, None)
            return cls.from_base_and_memory(None, pretrained_model_name_or_path, **kwargs)
        check_safetensors_folder(pretrained_model_name_or_path, "from_pretrained: the model folder")
        folder = Path(pretrained_model_name_or_path)
        files: dict[str, Path] = {}  # file key: the file of the folder that holds it
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
        return_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                      **kwargs)
        missing = sorted(file_key(name) for name in loading_info["missing_keys"])
        if missing:
            raise ValueError(f"{pretrained_model_name_or_path}: its weight files lack {len(missing)} of the model's "
                             f"tensors ({', '.join(missing[:5])}{', ...' * (len(missing) > 5)}), which would start "
                             "at random; a full model folder holds every tensor of the base and the memory, as "
                             "save_pretrained(save_full_model=True) writes it")
        # loading swaps in new Parameter objects, which forget the freeze applied in __init__
        model._apply_freeze_base()
        # as a memory folder's weights are (load_memory_state_dict): one pass over the loaded tensors, no file read
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
                key = file_key(name)
                raise ValueError(f"{files.get(key, pretrained_model_name_or_path)}: {key} holds NaN or infinite "
                                 "values; the model is broken (a diverged training run), not loaded")
        return (model, loading_info) if return_loading_info else model

    def memory_parameter_names(self) -> dict[str, str]:
        """{key in a memory folder: parameter name} of every memory parameter (memory blocks, persistent tokens),
        e.g. "memory.1.output_weight": "model.memory.1.output_weight"."""
        return {file_key(name): name for name, _ in self.named_parameters() if is_memory_name(name)}

    def memory_state_dict(self) -> dict[str, Tensor]:
        """The memory's own parameters (memory layers, gates, persistent tokens) under a memory folder's keys
        (`memory.<layer>.*`, `persistent_tokens`): exactly what `save_pretrained` writes. The base is never part of
        it."""
        return {key: self.get_parameter(name).detach() for key, name in self.memory_parameter_names().items()}

    def load_memory_state_dict(self, state_dict: dict[str, Tensor], source: str = "memory state dict") -> None:
        """Copy memory weights in, keyed as `memory_state_dict` keys them; names, shapes and a floating dtype must
        match (a ValueError naming `source`)."""
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


__all__ = ["TitansLoadingMixin", "file_key", "is_memory_name"]
