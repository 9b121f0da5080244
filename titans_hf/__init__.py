"""titans_hf: a Titans neural long-term memory for pretrained Qwen models on the Hugging Face stack.

Importing `titans_hf` registers `titans_qwen` with transformers' `AutoConfig` / `AutoModelForCausalLM`, and the
`titans_tokens` / `titans_babilong` builders with `datasets` (`titans_hf.data`) as soon as `datasets` is imported:
right away when it already is, else when the program first imports it. So `import titans_hf.modeling` alone never
imports or changes `datasets`.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.3.0"

from .modeling import (  # noqa: E402  (registers titans_qwen with the Auto classes)
    TitansMemoryConfig,
    TitansQwenConfig,
    TitansQwenForCausalLM,
    TitansQwenModel,
)

# The public API at the package top; what needs `datasets`, TRL's or PEFT's stack loads when first named.
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


class _RegisterBuildersOnDatasetsImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `datasets` is first imported, it lets the import run, then imports
    `titans_hf.data` (which registers the builders) and steps out of `sys.meta_path`."""

    def find_spec(self, name, path=None, target=None):
        if name != "datasets":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_module_then_register(module):
            exec_module(module)
            importlib.import_module("titans_hf.data")

        spec.loader.exec_module = exec_module_then_register
        return spec


if "datasets" in sys.modules:
    from . import data  # noqa: E402,F401
elif not any(isinstance(finder, _RegisterBuildersOnDatasetsImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterBuildersOnDatasetsImport())
