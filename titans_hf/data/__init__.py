"""Token stores, windowed examples and the `datasets` builders serving them.

Importing this package registers the builders below the way `datasets` lists its packaged ones
(csv, json, ...), so `load_dataset("titans_tokens", data_files=..., ...)` works offline, streaming
included: `load_dataset` looks names up in that same dict. Registering one more builder is one
more entry in `BUILDER_MODULES`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

BUILDER_MODULES: dict[str, str] = {
    "titans_tokens": "titans_hf.data.tokens_builder",
    "titans_babilong": "titans_hf.data.babilong_builder",
}


def source_hash() -> str:
    """Hash of this package's code, the `datasets` module hash: changed code rebuilds the Arrow cache."""
    digest = hashlib.sha256()
    for file in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def register_builders() -> None:
    code_hash = source_hash()
    for name, module_path in BUILDER_MODULES.items():
        _PACKAGED_DATASETS_MODULES[name] = (module_path, code_hash)


register_builders()
