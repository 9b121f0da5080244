"""Deprecated: moved to `titans_hf.tasks.babilong.diagnostics`; this path will be removed in the next release."""

from titans_hf._deprecation import moved_names

__getattr__ = moved_names(__name__, "titans_hf.tasks.babilong.diagnostics")
