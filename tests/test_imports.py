"""The package's import graph: one way, no circle. The model (`titans_hf.modeling`) stands alone: importing every
module of it loads none of the Hub, LoRA, training, data or task code, nor `datasets`; the data code loads no task;
and the module-level imports between the package's modules form no circle. The model's few call-time imports
(pushing to the Hub, a LoRA adapter saved or loaded beside the memory) are listed, so a new one fails here."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import titans_hf

PACKAGE = Path(titans_hf.__file__).resolve().parent
MODULES = sorted(".".join(("titans_hf", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
                 for path in PACKAGE.rglob("*.py") if path.name != "__main__.py")
# What the model loads only when a method needs it: pushing to the Hub, and a LoRA adapter (PEFT) beside the memory.
MODEL_CALL_TIME_IMPORTS = {("titans_hf.modeling.loading_titans_qwen", "titans_hf.hub"),
                           ("titans_hf.modeling.loading_titans_qwen", "titans_hf.lora")}

LOADED = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
print(json.dumps(sorted(name for name in sys.modules if name.startswith("titans_hf") or name == "datasets")))
"""


def loaded_by(modules: list[str]) -> set[str]:
    result = subprocess.run([sys.executable, "-c", LOADED.format(modules=modules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.splitlines()[-1]))


def module_path(name: str) -> Path:
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported_names(name: str, module_level: bool) -> set[str]:
    """The titans_hf modules `name` imports: at module level (outside `if TYPE_CHECKING:`), or inside functions."""
    tree = ast.parse(module_path(name).read_text(encoding="utf-8"))
    package = name if module_path(name).name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and nested != module_level:
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                else:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1] if child.level else []
                    stem = ".".join([*base, *([child.module] if child.module else [])])
                    targets = [stem, *(f"{stem}.{alias.name}" for alias in child.names)]
                found.update(target for target in targets if target in MODULES or target == "titans_hf")
            visit(child, nested)

    visit(tree, False)
    found.discard(name)
    return found


def test_the_model_loads_no_hub_lora_training_data_or_task_code():
    modeling = [name for name in MODULES if name.startswith("titans_hf.modeling")]
    loaded = loaded_by(modeling)
    forbidden = ("titans_hf.hub", "titans_hf.lora", "titans_hf.training", "titans_hf.data", "titans_hf.tasks",
                 "titans_hf.commands", "datasets")
    assert not [name for name in loaded if name.startswith(forbidden)]
    assert "titans_hf.modeling.modeling_titans_qwen" in loaded


def test_the_data_code_loads_no_task_training_or_command_code():
    data = [name for name in MODULES if name.startswith("titans_hf.data")]
    loaded = loaded_by(data)
    assert not [name for name in loaded if name.startswith(("titans_hf.tasks", "titans_hf.training",
                                                             "titans_hf.commands", "titans_hf.hub", "titans_hf.lora"))]


def test_module_level_imports_form_no_circle():
    graph = {name: imported_names(name, module_level=True) for name in MODULES}
    # a package's __init__ runs before any of its modules: a module importing its own package is no edge back
    graph = {name: {target for target in targets if not name.startswith(target + ".")} for name, targets in graph.items()}
    state: dict[str, str] = {}
    stack: list[str] = []

    def walk(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            assert state.get(target) != "open", "import circle: " + " -> ".join([*stack[stack.index(target):], target])
            if target not in state:
                walk(target)
        stack.pop()
        state[name] = "done"

    for name in MODULES:
        if name not in state:
            walk(name)


def test_the_models_call_time_imports_are_the_listed_ones():
    modeling = [name for name in MODULES if name.startswith("titans_hf.modeling")]
    outside = {(name, target) for name in modeling for target in imported_names(name, module_level=False)
               if not target.startswith("titans_hf.modeling")}
    assert outside == MODEL_CALL_TIME_IMPORTS


def test_the_package_top_names_the_public_api():
    loaded = loaded_by(["titans_hf"])
    assert "datasets" not in loaded and "titans_hf.training" not in loaded  # the lazy names stay unloaded
    public = {name: getattr(titans_hf, name) for name in titans_hf.__all__}
    assert public["TitansTrainer"].__module__.startswith("titans_hf.training")
    assert public["add_lora"].__module__ == "titans_hf.lora"
    assert set(titans_hf.__all__) <= set(dir(titans_hf))


def test_old_import_paths_warn_and_give_the_moved_names():
    import pytest

    from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig
    from titans_hf.modeling.memory_folder import save_memory_folder
    from titans_hf.outputs import writing_folder
    from titans_hf.tasks.babilong.builder import TitansBabilong
    from titans_hf.testing_utils import build_qwen

    old = [("titans_hf.hub", "TitansMemoryConfig", TitansMemoryConfig),
           ("titans_hf.hub", "save_memory_folder", save_memory_folder),
           ("titans_hf.utils", "writing_folder", writing_folder),
           ("titans_hf.local_models", "build_qwen", build_qwen),
           ("titans_hf.data.babilong_builder", "TitansBabilong", TitansBabilong)]
    for module, name, moved in old:
        with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} moved to "):
            assert getattr(__import__(module, fromlist=[name]), name) is moved
