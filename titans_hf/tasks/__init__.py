"""Tasks: where their rows come from, how a row becomes a training example, how answers are scored.

A task is one package here, registered by one line in `TASKS` (its name and the module holding its `TASK`). The
rest of titans_hf finds it there: `titans-hf eval --tasks` (the names a task generates and scores), `titans-hf
train --dataset` (the task's `datasets` builder and its training rows), and the `titans-hf` subcommand a task may
bring. The packages load when first asked for, as transformers' Auto classes load a model's module by name.

A task package holding a `builder.py` has its `datasets` builder registered as `titans_<package>` by
`titans_hf.data` (which loads no task code: it finds the builders by their place, see `task_builders`), so
`load_dataset("titans_<package>", ...)` works offline.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# task package name -> the module whose `TASK` says what the package offers. One line per task.
TASKS: dict[str, str] = {
    "babilong": "titans_hf.tasks.babilong.task",
    "recall": "titans_hf.tasks.recall.task",
    "needle": "titans_hf.tasks.needle.task",
}


@dataclass(frozen=True)
class Task:
    """What a task package offers the rest of titans_hf; a part it lacks is left out.

    Attributes:
        name: the package's name (its key in `TASKS`).
        eval_tasks: the names `titans-hf eval --tasks` scores with this package (e.g. qa1, qa2, qa3).
        generate_rows: rows of one eval task, `(eval_task, num_samples, length_in_tokens, tokenizer, seed,
            haystack_files=, haystack_dataset=) -> [{"input", "question", "target", ...}]`.
        evaluate: `(model, tokenizer, data, **options) -> results`, `data` mapping (eval task, length) to rows or
            files, writing results.json and its plots with `output_dir=`.
        format_results: the printed tables of `evaluate`'s results.
        output_names: the files `evaluate` writes into its output folder.
        builder: the name of its `datasets` builder (`titans_<package>`, in `<package>/builder.py`), if any.
        training_splits: `(data_args, tokenizer_name_or_path, pad_to_max_length) -> (train, evaluation)` rows of
            its builder for `titans-hf train --dataset <builder>` (`data_args`: the recipe's `DataArguments`).
        command: the module of its `titans-hf` subcommand (with `register(subcommands)`), if it has one.
    """

    name: str
    eval_tasks: tuple[str, ...] = ()
    generate_rows: Callable[..., list[dict[str, Any]]] | None = None
    evaluate: Callable[..., dict[str, Any]] | None = None
    format_results: Callable[[dict[str, Any]], str] | None = None
    output_names: tuple[str, ...] = field(default=())
    builder: str | None = None
    training_splits: Callable[..., tuple[Any, Any]] | None = None
    command: str | None = None


def task(name: str) -> Task:
    """The `Task` of package `name` (imported on first use); a ValueError naming the registered ones otherwise."""
    if name not in TASKS:
        raise ValueError(f"no task package {name!r}; the registered ones are {sorted(TASKS)}")
    return importlib.import_module(TASKS[name]).TASK


def all_tasks() -> list[Task]:
    """Every registered task, in the order of `TASKS`."""
    return [task(name) for name in TASKS]


def task_for_eval(eval_task: str) -> Task:
    """The task package that scores `eval_task` (e.g. "qa1" -> babilong); a ValueError listing them otherwise."""
    for candidate in all_tasks():
        if eval_task in candidate.eval_tasks:
            return candidate
    raise ValueError(f"no task scores {eval_task!r}; the tasks are {eval_task_names()}")


def task_for_builder(builder: str) -> Task:
    """The task package whose `datasets` builder is `builder` (e.g. "titans_babilong")."""
    for candidate in all_tasks():
        if candidate.builder == builder:
            return candidate
    raise ValueError(f"no task builds {builder!r}; the task builders are {task_builder_names()}")


def eval_task_names() -> list[str]:
    """Every name `titans-hf eval --tasks` takes, task by task."""
    return [name for candidate in all_tasks() for name in candidate.eval_tasks]


def task_builder_names() -> list[str]:
    """The `datasets` builders of the tasks, in the order of `TASKS`."""
    return [candidate.builder for candidate in all_tasks() if candidate.builder]
