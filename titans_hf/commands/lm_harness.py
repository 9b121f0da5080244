"""`titans-hf lm-eval`: any lm-eval task on a memory, through lm-eval's own `simple_evaluate` and `HFLM` (lm-eval
0.4.13 cannot import a package that registers a model type, so its `lm_eval` command cannot load a memory)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from titans_hf.files import atomic_write_json
from titans_hf.outputs import prepare_output_dir, record_outputs

from .arguments import add_model_arguments

RESULTS_NAME = "lm_eval_results.json"
# numpy's seed (lm-eval seeds numpy with --seed) is an unsigned 32-bit integer
MAX_SEED = 2**32 - 1


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "lm-eval",
        help="run lm-eval tasks (loglikelihood, generate_until, ...) on a memory, or on its base with the memory off",
        description="Run tasks of EleutherAI's lm-evaluation-harness on a trained memory, the way `lm_eval --model "
        "hf` runs them on any Hugging Face model: lm-eval's simple_evaluate with HFLM(pretrained=<the loaded "
        "model>). Batches of mixed lengths answer each request as it is answered alone. Needs the lm_eval extra: "
        "pip install 'titans_hf[lm_eval]'. Writes lm_eval_results.json to --output and prints lm-eval's table.",
    )
    model_group = add_model_arguments(parser, None, "e.g. cuda or cpu (default: where the model loads)")
    model_group.add_argument("--memory-off", action="store_true", help="the ablation: the same weights with the "
                             "memory switched off (the base chunk by chunk)")
    tasks = parser.add_argument_group("the tasks")
    tasks.add_argument("--tasks", nargs="+", required=True,
                       help="lm-eval task or group names (or glob patterns), e.g. hellaswag, or your own tasks' names "
                       "with --include-path")
    tasks.add_argument("--include-path", default=None, help="a folder of your own task YAML files")
    tasks.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    tasks.add_argument("--limit", type=float, default=None,
                       help="evaluate only this many documents per task (a fraction below 1)")
    run = parser.add_argument_group("the run")
    run.add_argument("--batch-size", type=int, default=1, help="requests per batch")
    run.add_argument("--seed", type=int, default=0, help="lm-eval's random, numpy, torch and few-shot seeds")
    run.add_argument("--log-samples", action="store_true",
                     help="also write every request's inputs and responses into the results")
    run.add_argument("--output", required=True, help="folder for lm_eval_results.json")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the lm_eval_results.json an earlier lm-eval wrote there (never another file)")
    parser.set_defaults(func=lm_eval_command)


def _check_arguments(args: argparse.Namespace) -> None:
    """The flags lm-eval would take silently (a negative batch or number of shots, a missing --include-path) or fail
    on in its own words, after the model has loaded (a limit of 0, NaN, 2.5 or 1e308, a negative seed), each refused
    naming its flag, before anything loads."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: must be at least 0")
    limit = args.limit
    if limit is not None and not (0 < limit < 1 or (math.isfinite(limit) and limit >= 1 and limit.is_integer())):
        raise ValueError(f"--limit {limit}: must be a count of documents (1, 2, ...) or a fraction in (0, 1)")
    if limit is not None and limit > sys.maxsize:  # lm-eval slices the documents with it
        raise ValueError(f"--limit {limit}: a count of documents must be at most {sys.maxsize}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed {args.seed}: must be in [0, {MAX_SEED}]")
    if args.include_path is not None:
        folder = Path(args.include_path)
        if not folder.exists():
            raise ValueError(f"--include-path {folder}: no such folder")
        if not folder.is_dir():
            raise ValueError(f"--include-path {folder}: a file, not a folder of task YAML files")
        if next(folder.rglob("*.yaml"), None) is None:  # where lm-eval looks for them
            raise ValueError(f"--include-path {folder}: holds no task YAML files (*.yaml)")


def _task_names(task_manager: Any, patterns: list[str], include_path: str | None) -> list[str]:
    """The lm-eval tasks and groups `patterns` (names or glob patterns) name, expanded as lm-eval's own command does;
    a name that matches nothing, and a pattern that matches every task lm-eval knows, are refused naming --tasks."""
    matches = {pattern: task_manager.match_tasks([pattern]) for pattern in patterns}
    unknown = [pattern for pattern, names in matches.items() if not names]
    if unknown:
        raise ValueError(f"titans-hf lm-eval: no lm-eval task or group is called {unknown}"
                         + ("" if include_path else " (your own tasks' folder goes to --include-path)"))
    known = len(task_manager.all_tasks)
    for pattern, names in matches.items():
        if len(names) == known:
            raise ValueError(f"--tasks {pattern}: matches every one of the {known} tasks, groups and tags lm-eval "
                             "knows; name the tasks to run, or a pattern that picks them (e.g. 'mmlu_*')")
    return list(dict.fromkeys(name for names in matches.values() for name in names))


def _check_fewshot(task_manager: Any, task_names: list[str], args: argparse.Namespace) -> None:
    """Refuse --num-fewshot above what a task can draw (lm-eval would stop mid-run, "Sample larger than population"):
    its few-shot documents, less the document asked about when they are its own evaluation split. A task whose
    configuration fixes 0 shots keeps them (lm-eval ignores --num-fewshot there)."""
    if not args.num_fewshot:
        return
    for name, task in task_manager.load(task_names)["tasks"].items():
        if task.get_config("num_fewshot") == 0:
            continue
        docs = task.fewshot_docs()
        available = 0 if docs is None else len(docs)
        # drawn from the evaluation split itself, the document asked about is set aside: one more is drawn
        own_split = getattr(getattr(task, "fewshot_cfg", None), "split", None) == task.get_config("test_split")
        if args.num_fewshot + own_split > available:
            raise ValueError(f"--num-fewshot {args.num_fewshot}: task {name} has {available} few-shot examples to "
                             f"draw from{', less the document asked about' if own_split else ''}; ask for at most "
                             f"{max(available - own_split, 0)}")


def lm_eval_command(args: argparse.Namespace) -> int:
    _check_arguments(args)
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError as error:
        raise ValueError(f"titans-hf lm-eval needs lm-eval: pip install 'titans_hf[lm_eval]' ({error})") from error
    from titans_hf.tasks.babilong.evaluation import load_model_for_eval

    task_manager = TaskManager(include_path=args.include_path)
    task_names = _task_names(task_manager, args.tasks, args.include_path)
    _check_fewshot(task_manager, task_names, args)
    output = prepare_output_dir(args.output, (RESULTS_NAME,), overwrite=args.overwrite)
    model, tokenizer = load_model_for_eval(args.model, args.memory, args.tokenizer, args.dtype, args.device)
    lm = HFLM(pretrained=model.eval(), tokenizer=tokenizer, backend="causal", batch_size=args.batch_size)
    with model.memory_disabled() if args.memory_off else contextlib.nullcontext():
        results = simple_evaluate(
            model=lm, tasks=task_names, num_fewshot=args.num_fewshot, limit=args.limit, task_manager=task_manager,
            log_samples=args.log_samples, random_seed=args.seed, numpy_random_seed=args.seed,
            torch_random_seed=args.seed, fewshot_random_seed=args.seed,
        )
    results["titans_hf"] = {"model": args.model, "memory": args.memory, "memory_off": args.memory_off}
    # lm-eval's own objects become what its handler makes of them; NaN (a stderr of one sample) becomes null
    path = atomic_write_json(output / RESULTS_NAME, json.loads(json.dumps(results, default=handle_non_serializable)))
    record_outputs(output, [RESULTS_NAME], "titans-hf lm-eval")
    print(make_table(results))
    print(f"wrote {path}")
    return 0
