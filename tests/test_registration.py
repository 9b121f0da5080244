"""What importing titans_hf does: transformers' Auto classes know titans_qwen; the datasets builders register
once, when titans_hf and datasets are both imported, in either order; titans_hf.modeling alone leaves datasets
untouched; and a datasets release that moves the internals the registration uses fails loudly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHECK = """
import json, sys
{imports}
state = {{"datasets_imported": "datasets" in sys.modules}}
if state["datasets_imported"]:
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    state["registered"] = sorted(n for n in _PACKAGED_DATASETS_MODULES if n.startswith("titans_"))
from transformers import AutoConfig
state["auto_config"] = AutoConfig.for_model("titans_qwen").model_type
state["hooks"] = sum(type(f).__name__ == "_RegisterBuildersOnDatasetsImport" for f in sys.meta_path)
print(json.dumps(state))
"""


def run(imports: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_model_leaves_datasets_untouched():
    assert run("import titans_hf.modeling") == {"datasets_imported": False, "auto_config": "titans_qwen", "hooks": 1}


@pytest.mark.parametrize("imports", ["import titans_hf\nimport datasets", "import datasets\nimport titans_hf",
                                     "import titans_hf.data", "import titans_hf.modeling\nimport datasets"])
def test_the_builders_register_once_datasets_and_titans_hf_are_both_imported(imports):
    assert run(imports) == {"datasets_imported": True, "registered": ["titans_babilong", "titans_needle", "titans_tokens"],
                            "auto_config": "titans_qwen", "hooks": 0}


def test_moved_datasets_internals_fail_loudly(monkeypatch):
    from datasets import load as datasets_load

    from titans_hf.data import check_datasets_internals

    check_datasets_internals()  # the installed datasets has what the registration uses
    monkeypatch.setattr(datasets_load, "_PACKAGED_DATASETS_MODULES", {})
    with pytest.raises(RuntimeError, match="no longer reads datasets.packaged_modules._PACKAGED_DATASETS_MODULES"):
        check_datasets_internals()
    monkeypatch.undo()
    monkeypatch.delattr(datasets_load.PackagedDatasetModuleFactory, "get_module")
    with pytest.raises(RuntimeError, match="PackagedDatasetModuleFactory.get_module is gone"):
        check_datasets_internals()
