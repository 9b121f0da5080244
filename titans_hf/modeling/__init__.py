"""Titans-augmented Qwen: config, model, memory variants, memory; registered with the transformers Auto classes
on import."""

from transformers import AutoConfig, AutoModelForCausalLM

from .cache_titans_qwen import TitansCache
from .configuration_titans_qwen import TitansMemoryConfig, TitansQwenConfig
from .memory import MemoryState, NeuralMemory
from .modeling_titans_qwen import TitansQwenForCausalLM, TitansQwenModel, TitansQwenPreTrainedModel
from .variants import MEMORY_VARIANTS

AutoConfig.register(TitansQwenConfig.model_type, TitansQwenConfig, exist_ok=True)
AutoModelForCausalLM.register(TitansQwenConfig, TitansQwenForCausalLM, exist_ok=True)

__all__ = [
    "MEMORY_VARIANTS",
    "MemoryState",
    "NeuralMemory",
    "TitansCache",
    "TitansMemoryConfig",
    "TitansQwenConfig",
    "TitansQwenForCausalLM",
    "TitansQwenModel",
    "TitansQwenPreTrainedModel",
]
