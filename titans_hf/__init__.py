"""titans_hf: a Titans neural long-term memory for pretrained Qwen models on the Hugging Face stack.

Importing `titans_hf` registers `titans_qwen` with transformers' `AutoConfig` / `AutoModelForCausalLM`, and
imports `titans_hf.data`, which registers the `titans_tokens` / `titans_babilong` builders with `datasets` so that
`load_dataset` finds them by name: the package's one registration in another library, whatever the import order.
`import titans_hf.modeling` alone (the model, without the data code) leaves `datasets` unimported.
"""

import importlib

__version__ = "0.4.0"

from .modeling import (  # noqa: E402  (registers titans_qwen with the Auto classes)
    TitansMemoryConfig,
    TitansQwenConfig,
    TitansQwenForCausalLM,
    TitansQwenModel,
)
from . import data  # noqa: E402,F401  (registers the datasets builders)

# The public API at the package top; what needs the Trainer's, TRL's or PEFT's stack loads when first named.
_LAZY_NAMES = {
    "TitansTrainer": "titans_hf.training",
    "TitansTrainingArguments": "titans_hf.training",
    "TitansDataCollator": "titans_hf.data.collator",
    "add_lora": "titans_hf.lora",
    "push_memory_folder": "titans_hf.hub",
}

__all__ = ["TitansMemoryConfig", "TitansQwenConfig", "TitansQwenForCausalLM", "TitansQwenModel", *_LAZY_NAMES, "__version__"]


def __getattr__(name: str) -> object:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})
