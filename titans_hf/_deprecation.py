"""Old import paths kept for one release: a module that lost names to new homes serves them through a module
`__getattr__` that warns (`DeprecationWarning`) and names the new home."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(old_module: str, homes: dict[str, str] | str) -> Callable[[str], Any]:
    """A module `__getattr__` for `old_module`: each name of `homes` ({name: new module}, or one new module for every
    public name) comes from its new home, with a DeprecationWarning saying where that is."""

    def __getattr__(name: str) -> Any:
        home = homes if isinstance(homes, str) and not name.startswith("_") else (
            homes.get(name) if isinstance(homes, dict) else None)
        if home is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        warnings.warn(f"{old_module}.{name} moved to {home}.{name}; the old path will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
