"""The private members of transformers and huggingface_hub that the model relies on, in one place, and
`check_transformers_internals`, which fails loudly, naming each one, when a release moves one. The model checks them
when it is first built (`TitansQwenPreTrainedModel.__init__`).

- `GenerationMixin._prepare_cache_for_generation`, overridden so that `generate` always streams through a
  `TitansCache`, and the `_is_user_defined` mark it puts on a caller's cache (`generate` returns such a cache);
- `PreTrainedModel._set_gradient_checkpointing`, overridden so that `activation_checkpointing_enable` (and
  `gradient_checkpointing_enable`) checkpoints whole chunks (called from `_activation_checkpointing_enable`);
- `_is_hf_initialized`, the mark by which transformers' initialisers leave loaded weights alone;
- a config's `_attn_implementation` and `_attn_implementation_internal`, the attention choice a config carries;
- the base's placement and parallel plans (`_no_split_modules`, `_tp_plan`, `_pp_plan`) and
  `_keep_in_fp32_modules_strict`, read from the model class;
- huggingface_hub's `file_download._CACHED_NO_EXIST`, what `try_to_load_from_cache` returns for a file the cache knows is absent.
"""

from __future__ import annotations

import functools
import inspect

import huggingface_hub
import transformers
from huggingface_hub import file_download
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization

# {(class, private method the model overrides): the parameters, after self, the library calls it with}
OVERRIDDEN_METHODS = {
    (GenerationMixin, "_prepare_cache_for_generation"): ("generation_config", "model_kwargs", "generation_mode",
                                                        "batch_size", "max_cache_length"),
    (PreTrainedModel, "_set_gradient_checkpointing"): ("enable", "gradient_checkpointing_func", "every_n_layers"),
}
# {private name: the library function whose code reads it}
READ_BY_LIBRARY = {
    "_is_user_defined": (GenerationMixin, "_sample"),
    "_is_hf_initialized": (initialization, "normal_"),
    "_set_gradient_checkpointing": (PreTrainedModel, "_activation_checkpointing_enable"),
}
# private class attributes of PreTrainedModel the model reads or sets
MODEL_ATTRIBUTES = ("_no_split_modules", "_tp_plan", "_pp_plan", "_keep_in_fp32_modules_strict")


def _owner_name(owner: object) -> str:
    return getattr(owner, "__qualname__", None) or owner.__name__


def check_transformers_internals() -> None:
    """The private members of transformers and huggingface_hub listed in this module's docstring are where they
    were, taking the parameters they took; a RuntimeError naming each one that moved, when one did."""
    problems = []
    for (owner, name), parameters in OVERRIDDEN_METHODS.items():
        member = getattr(owner, name, None)
        if not callable(member):
            problems.append(f"transformers.{_owner_name(owner)}.{name} is gone")
            continue
        taken = tuple(inspect.signature(member).parameters)[1:]
        if taken != parameters:
            problems.append(f"transformers.{_owner_name(owner)}.{name} takes ({', '.join(taken)}), not "
                            f"({', '.join(parameters)})")
    for name, (owner, reader) in READ_BY_LIBRARY.items():
        function = getattr(owner, reader, None)
        try:
            source = inspect.getsource(function) if callable(function) else ""
        except (OSError, TypeError):
            source = ""
        if name not in source:
            problems.append(f"transformers.{_owner_name(owner)}.{reader} no longer reads {name}")
    attention = getattr(PreTrainedConfig, "_attn_implementation", None)
    if not isinstance(attention, property) or "_attn_implementation_internal" not in attention.fget.__code__.co_names:
        problems.append("transformers.PreTrainedConfig._attn_implementation is no longer a property over "
                        "_attn_implementation_internal")
    problems += [f"transformers.PreTrainedModel.{name} is gone" for name in MODEL_ATTRIBUTES
                 if not hasattr(PreTrainedModel, name)]
    if not hasattr(file_download, "_CACHED_NO_EXIST"):
        problems.append("huggingface_hub.file_download._CACHED_NO_EXIST is gone")
    if problems:
        raise RuntimeError(f"titans_hf's TitansQwen model relies on private members that transformers "
                           f"{transformers.__version__} / huggingface_hub {huggingface_hub.__version__} moved: "
                           + "; ".join(problems))


@functools.cache
def check_transformers_internals_once() -> None:
    """`check_transformers_internals`, run by the first model built (a failure is not cached: it raises again)."""
    check_transformers_internals()
