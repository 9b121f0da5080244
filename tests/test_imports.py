"""The package's import graph: one way, no circle.

Every import of every module counts, read with `ast`: at module level, inside functions (run when called) and under
`if TYPE_CHECKING:` (read by type checkers); over the package's modules they form no circle, call-time imports
included. The model (`titans_hf.modeling`) imports nothing of the package outside it but the leaf `titans_hf.files`
and, at call time in the listed functions (`INTEGRATION_IMPORTS`, counted), the two integrations its loading and
saving use: `titans_hf.lora` (PEFT's adapter beside the memory) and `titans_hf.hub` (the push with its card), which
import no model code back, as transformers' `PreTrainedModel` uses `integrations/peft.py` and `utils/hub.py` below it.
Its config imports no torch model code; importing every module of it loads none of the Hub, LoRA, training or task
code (the package's import loads the data code, which registers the builders); the data code loads no task.

A module's import of a package it sits in (`titans_hf`, `titans_hf.modeling`) is no edge: the package's
`__init__` has run before any of its modules can be imported.
"""

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
# The model's call-time imports of the integrations below it, each in the function that needs it (PEFT and the
# card's templates load only for an adapter or a push): (importing module, imported module, function): what for.
INTEGRATION_IMPORTS = {
    ("titans_hf.modeling.save_and_load", "titans_hf.lora", "load_on_base"):
        "a memory folder's LoRA adapter checked before the base loads, and loaded with the memory",
    ("titans_hf.modeling.save_and_load", "titans_hf.lora", "save_memory"):
        "the model's LoRA adapter saved beside its memory",
    ("titans_hf.modeling.save_and_load", "titans_hf.hub", "push_memory"): "push_to_hub of the memory",
}
INTEGRATIONS = {"titans_hf.lora", "titans_hf.hub"}
# The package's one leaf module: the atomic write and the file helpers, which import nothing of the package.
LEAF = "titans_hf.files"
CONFIG_MODULE = "titans_hf.modeling.configuration_titans_qwen"

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


def imports_in(name: str) -> set[tuple[str, str, str | None]]:
    """Every import of a titans_hf module in `name`, as (module, kind, function): kind "module" (at module level),
    "call" (inside a function, so when it is called) or "type" (under `if TYPE_CHECKING:`), and the outermost
    function it sits in (a class's method, or a module-level function; None outside any, "<lambda>" for a lambda).
    Packages `name` sits in are left out (see the module docstring)."""
    tree = ast.parse(module_path(name).read_text(encoding="utf-8"))
    package = name if module_path(name).name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[tuple[str, str, str | None]] = set()

    def visit(node: ast.AST, kind: str, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.body:  # its `else:` runs, as the code around it does
                    visit(ast.Module(body=[statement], type_ignores=[]), "type" if kind == "module" else kind,
                          function)
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), kind, function)
                continue
            child_kind, child_function = kind, function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_kind = "call" if kind == "module" else kind
                child_function = function or getattr(child, "name", "<lambda>")
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                else:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1] if child.level else []
                    stem = ".".join([*base, *([child.module] if child.module else [])])
                    targets = [stem, *(f"{stem}.{alias.name}" for alias in child.names)]
                found.update((target, child_kind, child_function) for target in targets
                             if target in MODULES and target != name and not name.startswith(target + "."))
            visit(child, child_kind, child_function)

    visit(tree, "module", None)
    return found


def imports_of(name: str) -> dict[str, str]:
    """{titans_hf module: how `name` imports it} (the kinds of `imports_in`); a module imported several ways counts
    as the first of module, type, call."""
    rank = {"module": 0, "type": 1, "call": 2}
    found: dict[str, str] = {}
    for target, kind, _ in sorted(imports_in(name), key=lambda found_import: rank[found_import[1]]):
        found.setdefault(target, kind)
    return found


def import_graph() -> dict[str, dict[str, str]]:
    return {name: imports_of(name) for name in MODULES}


def reachable(graph: dict[str, dict[str, str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_imports_are_read_at_module_level_inside_functions_and_for_type_checkers():
    graph = import_graph()
    assert graph["titans_hf.modeling.modeling_titans_qwen"]["titans_hf.modeling.memory"] == "module"
    assert graph["titans_hf.modeling.save_and_load"]["titans_hf.hub"] == "call"
    assert graph["titans_hf.lora"]["titans_hf.modeling.memory_folder"] == "module"
    assert "titans_hf" not in graph["titans_hf.lora"]  # no module is imported before its own package's __init__
    assert ("titans_hf.modeling.configuration_titans_qwen", "type", None) in imports_in("titans_hf.hub")
    loading = imports_in("titans_hf.modeling.save_and_load")
    assert ("titans_hf.hub", "call", "push_memory") in loading  # the function it sits in
    assert ("titans_hf.modeling.memory_folder", "module", None) in loading


def circle_in(graph: dict[str, dict[str, str]]) -> str | None:
    """The first import circle of `graph`, written out with each import's kind, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def walk(name: str) -> str | None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circle = [*stack[stack.index(target):], target]
                return circle[0] + "".join(f" -({graph[a][b]})-> {b}" for a, b in zip(circle, circle[1:]))
            if target not in state and (found := walk(target)) is not None:
                return found
        stack.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := walk(name)) is not None:
            return found
    return None


def test_imports_form_no_circle_call_time_imports_included():
    circle = circle_in(import_graph())
    assert circle is None, f"import circle: {circle}"


def test_a_circle_through_a_call_time_import_is_found():
    """The model importing the LoRA code inside a method, and the LoRA code importing the model back for type
    checking: a circle."""
    graph = import_graph()
    graph["titans_hf.modeling.modeling_titans_qwen"]["titans_hf.lora"] = "call"
    graph["titans_hf.lora"]["titans_hf.modeling.modeling_titans_qwen"] = "type"
    assert circle_in(graph) == ("titans_hf.modeling.modeling_titans_qwen -(call)-> titans_hf.lora -(type)-> "
                                "titans_hf.modeling.modeling_titans_qwen")


def test_the_model_imports_nothing_outside_it_but_the_leaf_and_the_listed_integration_calls():
    """Each import of code outside the model is the leaf, or a call-time import of an integration inside one of the
    listed functions: one more (at module level, or in another function) fails here, until it is listed."""
    outside = {(name, target, kind, function) for name in MODULES if name.startswith("titans_hf.modeling")
               for target, kind, function in imports_in(name)
               if not target.startswith("titans_hf.modeling") and target != LEAF}
    assert outside == {(name, target, "call", function) for name, target, function in INTEGRATION_IMPORTS}
    assert imports_in(LEAF) == set()


def test_the_integrations_import_no_model_code():
    """The LoRA and Hub code reach, of the model, only its config (with the update rules' settings it reads) and the
    memory folder's format: not the model (not even for type checking), so the model's calls into them run one way."""
    graph = import_graph()
    for integration in INTEGRATIONS:
        reached = {name for name in reachable(graph, integration) if name.startswith("titans_hf.modeling")}
        assert reached <= {CONFIG_MODULE, "titans_hf.modeling.memory_folder", "titans_hf.modeling.update_rules"}, (
            integration, reached)


def test_the_config_module_imports_no_torch_model_code():
    graph = import_graph()
    # like transformers' configuration_qwen2.py: the settings, each update rule's defaults and limits, the folder
    # format's file names, the atomic write
    assert reachable(graph, CONFIG_MODULE) <= {"titans_hf.modeling.memory_folder", "titans_hf.modeling.update_rules",
                                               LEAF}
    assert graph["titans_hf.modeling.update_rules"] == {}
    # what the model itself reaches, for contrast: the memory, the variants, the cache
    assert {"titans_hf.modeling.memory", "titans_hf.modeling.variants", "titans_hf.modeling.cache_titans_qwen",
            CONFIG_MODULE} <= reachable(graph, "titans_hf.modeling.modeling_titans_qwen")


def test_the_model_loads_no_hub_lora_training_or_task_code():
    """Importing every module of the model loads nothing beyond them but what the package's import loads (the data
    code, which registers the builders, and `datasets`): no Hub, LoRA, training, task or command code."""
    modeling = [name for name in MODULES if name.startswith("titans_hf.modeling")]
    loaded = loaded_by(modeling)
    forbidden = ("titans_hf.hub", "titans_hf.lora", "titans_hf.training", "titans_hf.tasks", "titans_hf.commands")
    assert not [name for name in loaded if name.startswith(forbidden)]
    assert "titans_hf.modeling.modeling_titans_qwen" in loaded
    assert loaded - set(modeling) <= loaded_by(["titans_hf"])


def test_the_data_code_loads_no_task_training_or_command_code():
    data = [name for name in MODULES if name.startswith("titans_hf.data")]
    loaded = loaded_by(data)
    assert not [name for name in loaded if name.startswith(("titans_hf.tasks", "titans_hf.training",
                                                             "titans_hf.commands", "titans_hf.hub", "titans_hf.lora"))]


def test_the_package_top_names_the_public_api():
    loaded = loaded_by(["titans_hf"])
    assert {"datasets", "titans_hf.data"} <= loaded  # the builders' registration, the package's one
    assert not [name for name in loaded if name.startswith(("titans_hf.training", "titans_hf.lora", "titans_hf.hub",
                                                            "titans_hf.tasks"))]  # the lazy names stay unloaded
    public = {name: getattr(titans_hf, name) for name in titans_hf.__all__}
    assert public["TitansTrainer"].__module__.startswith("titans_hf.training")
    assert public["add_lora"].__module__ == "titans_hf.lora"
    assert set(titans_hf.__all__) <= set(dir(titans_hf))
