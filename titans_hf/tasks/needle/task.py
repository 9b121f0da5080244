"""What the needle package offers the rest of titans_hf (its line in `titans_hf.tasks.TASKS`)."""

from __future__ import annotations

from functools import partial

from titans_hf.tasks import Task
from titans_hf.tasks.babilong.training import load_babilong_splits
from titans_hf.tasks.evaluation import OUTPUT_NAMES

from .builder import build_needle
from .evaluation import evaluate_needle, format_needle_results
from .generate import NEEDLE_TASKS, generate_needle

TASK = Task(
    name="needle",
    eval_tasks=NEEDLE_TASKS,
    generate_rows=generate_needle,
    evaluate=evaluate_needle,
    format_results=format_needle_results,
    output_names=OUTPUT_NAMES,
    builder="titans_needle",
    training_splits=partial(load_babilong_splits, builder="titans_needle", build=build_needle),
)
