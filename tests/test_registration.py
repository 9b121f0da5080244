"""What importing titans_hf does: transformers' Auto classes know titans_qwen; `import titans_hf` registers the
datasets builders itself, with no import hook, so `load_dataset` finds them whatever was imported before or after
(transformers' Trainer, datasets), and importing any of its modules runs that package import; and a datasets release
that moves the internals the registration uses fails loudly."""

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
state["hooks"] = sum(type(f).__module__.startswith("titans_hf") for f in sys.meta_path)
print(json.dumps(state))
"""


def run(imports: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_model_runs_the_package_import_and_installs_no_import_hook():
    """`titans_hf.modeling` sits in the package: its import runs `titans_hf`'s, which registers the builders."""
    assert run("import titans_hf.modeling") == {"datasets_imported": True,
                                                "registered": ["titans_babilong", "titans_needle", "titans_tokens"],
                                                "auto_config": "titans_qwen", "hooks": 0}


LOAD = CHECK + """
from datasets import load_dataset
rows = load_dataset("titans_babilong", task="qa1", length=150, num_samples=4, seed=3, tokenizer=sys.argv[1],
                    max_length=224, answer_reserve_tokens=8, cache_dir=sys.argv[2])
print(sum(split.num_rows for split in rows.values()))
"""


@pytest.mark.parametrize("imports", [
    "import titans_hf",
    "import titans_hf.data",
    "import datasets\nimport titans_hf",
    "import titans_hf\nfrom transformers import Trainer",  # the Trainer probes for datasets before its import
    "from transformers import Trainer\nimport titans_hf",
    "import titans_hf.modeling\nfrom transformers import Trainer\nimport titans_hf",
])
def test_the_builders_are_registered_and_found_by_name_whatever_the_import_order(imports, tiny_tokenizer_dir,
                                                                                 tmp_path):
    """A fresh interpreter, offline: after the imports the builders are registered with no import hook, and
    `load_dataset("titans_babilong", ...)` generates its rows by name, however titans_hf, transformers' Trainer and
    datasets were imported before it."""
    result = subprocess.run([sys.executable, "-c", LOAD.format(imports=imports), str(tiny_tokenizer_dir),
                             str(tmp_path / "cache")], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    state, rows = result.stdout.splitlines()[-2:]
    assert json.loads(state) == {"datasets_imported": True,
                                 "registered": ["titans_babilong", "titans_needle", "titans_tokens"],
                                 "auto_config": "titans_qwen", "hooks": 0}
    assert rows == "4"


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
