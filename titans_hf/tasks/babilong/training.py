"""Training rows of a question-answering task's builder for `titans-hf train`: published files, or generated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets

from .builder import build_babilong
from .files import find_babilong_sources


def load_babilong_splits(
    data_args: Any, tokenizer_name_or_path: str, pad_to_max_length: bool, builder: str = "titans_babilong",
    build: Callable[..., datasets.DatasetDict] = build_babilong,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and evaluation rows of the `builder` builder (`titans_babilong`, or a task's builder of the same
    settings, as `titans_needle`), one build per source; `data_args` is the recipe's `DataArguments`.

    Files go through `load_dataset(builder, data_files=...)`, as a user would load them, after folders are expanded
    into the files they hold and `data_tasks` / `data_lengths` have picked the sets (`find_babilong_sources`);
    generated rows through the builder-class route (`build`), one build per length.
    """
    common = dict(
        tokenizer=tokenizer_name_or_path,
        max_length=data_args.max_length,
        answer_reserve_tokens=data_args.answer_reserve_tokens,
        pad_to_max_length=pad_to_max_length,
        train_ratio=data_args.train_ratio,
        seed=data_args.generation_seed,
        truncate_answers=data_args.truncate_answers,
    )
    if data_args.data_files:
        tasks, lengths = data_args.data_tasks, data_args.data_lengths
        sources = find_babilong_sources(data_args.data_files, tasks, lengths)
        files = [str(path) for source in sources for path in source.paths]
        # a single task / length names the files whose path does not (the builder keeps the ones that do)
        labels = {name: values[0] for name, values in (("task", tasks), ("length", lengths))
                  if values and len(values) == 1}
        builds = [datasets.load_dataset(builder, data_files=files, **labels, **common)]
    elif data_args.generate_lengths:
        haystack = dict(
            haystack_files=tuple(data_args.haystack_files) if data_args.haystack_files else None,
            haystack_dataset=data_args.haystack_dataset,
            haystack_data_files=tuple(data_args.haystack_data_files) if data_args.haystack_data_files else None,
            haystack_split=data_args.haystack_split,
            haystack_column=data_args.haystack_column,
        )
        builds = [build(task=data_args.task, length=length, num_samples=data_args.num_samples, **haystack, **common)
                  for length in data_args.generate_lengths]
    else:
        raise ValueError("no data: pass --data_files (BABILong files or folders) or --generate_lengths (offline "
                         "generator)")
    train = datasets.concatenate_datasets([build["train"] for build in builds])
    evaluation = datasets.concatenate_datasets([build["validation"] for build in builds])
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))
    return train, evaluation
