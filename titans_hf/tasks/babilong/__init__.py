"""BABILong (Kuratov et al. 2024): bAbI questions whose supporting facts hide in a long haystack.

`generate` writes rows offline, `files` reads and writes them, `examples` turns a row into a training example
(loss on the answer only), `scoring` scores generated answers.
"""

from .examples import PROMPT_TEMPLATE, build_example, train_eval_split
from .files import REQUIRED_FIELDS, read_babilong_json, render_dataset_card, write_babilong_json, write_dataset_card
from .generate import (
    ACTORS,
    GENERATED_TASKS,
    LOCATIONS,
    MOVE_VERBS,
    OBJECTS,
    World,
    distractor_sentence,
    generate_babilong,
    iter_babilong_batches,
    random_fact,
    random_question,
)
from .scoring import (
    TASK_LABELS,
    last_location_baseline,
    last_mentioned_label,
    score_exact_match,
    score_label_substring,
    score_predictions,
)

__all__ = [
    "ACTORS",
    "GENERATED_TASKS",
    "LOCATIONS",
    "MOVE_VERBS",
    "OBJECTS",
    "PROMPT_TEMPLATE",
    "REQUIRED_FIELDS",
    "TASK_LABELS",
    "World",
    "build_example",
    "distractor_sentence",
    "generate_babilong",
    "iter_babilong_batches",
    "last_location_baseline",
    "last_mentioned_label",
    "random_fact",
    "random_question",
    "read_babilong_json",
    "render_dataset_card",
    "score_exact_match",
    "score_label_substring",
    "score_predictions",
    "train_eval_split",
    "write_babilong_json",
    "write_dataset_card",
]
