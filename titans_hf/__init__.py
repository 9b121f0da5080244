"""titans_hf: a Titans neural long-term memory for pretrained Qwen models on the Hugging Face stack."""

__version__ = "0.1.0"

from . import modeling  # noqa: E402,F401  (registers titans_qwen with AutoConfig / AutoModelForCausalLM)
from . import data  # noqa: E402,F401  (registers the titans_tokens datasets builder)
