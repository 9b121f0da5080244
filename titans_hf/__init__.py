"""titans_hf: a Titans neural long-term memory for pretrained Qwen models on the Hugging Face stack."""

__version__ = "0.1.0"
