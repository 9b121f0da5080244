"""What the BABILong package offers the rest of titans_hf (its line in `titans_hf.tasks.TASKS`)."""

from __future__ import annotations

from titans_hf.tasks import Task

from .evaluation import OUTPUT_NAMES, evaluate_babilong, format_evaluation
from .generate import GENERATED_TASKS, generate_babilong
from .training import load_babilong_splits

TASK = Task(
    name="babilong",
    eval_tasks=GENERATED_TASKS,
    generate_rows=generate_babilong,
    evaluate=evaluate_babilong,
    format_results=format_evaluation,
    output_names=OUTPUT_NAMES,
    builder="titans_babilong",
    training_splits=load_babilong_splits,
    command="titans_hf.commands.babilong",
)
