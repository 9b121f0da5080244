"""The Hub: a memory folder pushed as a model repository, with its model card.

The memory folder's own files (names, headers, fingerprints, reading and writing) are `titans_hf.modeling.memory_folder`;
this module builds on them and on the model's configuration.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from huggingface_hub import CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData, get_token, is_offline_mode
from huggingface_hub.errors import OfflineModeIsEnabled

from titans_hf import __version__
from titans_hf.modeling.configuration_titans_qwen import MODEL_TYPE, read_memory_config
from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MEMORY_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    MODEL_CONFIG_NAME,
    hub_file,
    is_hub_id,
    read_safetensors_header,
)

if TYPE_CHECKING:
    from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig

logger = logging.getLogger(__name__)

CARD_TEMPLATE_PATH = Path(__file__).parent / "hub_cards" / "memory_model_card.md"


def read_model_config(path: str | os.PathLike) -> dict[str, Any]:
    """A memory folder's `config.json` as the Auto classes read it: a JSON object of `model_type` titans_qwen with
    the base's `text_config` and no `auto_map`; anything else is a ValueError naming the file."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON model config ({error})") from error
    if not isinstance(values, dict) or values.get("model_type") != MODEL_TYPE or not isinstance(
            values.get("text_config"), dict):
        raise ValueError(f"{path}: a memory folder's {MODEL_CONFIG_NAME} is a JSON object with model_type "
                         f"{MODEL_TYPE!r} and the base's text_config")
    if "auto_map" in values or "auto_map" in values["text_config"]:
        raise ValueError(f"{path}: names code to run (auto_map); a memory's config never does")
    return values


def _evaluation_rows(results: dict | None) -> list[dict]:
    """Flatten {"accuracy": {task: {length: {"memory", "no_memory"}}}} into table rows, in the given order.

    The evaluator decides the order of tasks and lengths; sorting here would have to guess how lengths such as
    "32k" compare.
    """
    if results is None:
        return []
    accuracy = results.get("accuracy") if isinstance(results, dict) else None
    if not isinstance(accuracy, dict):
        raise ValueError("results: expected {'accuracy': {task: {length: {'memory': acc, 'no_memory': acc}}}}")
    rows = []
    for task, per_length in accuracy.items():
        if not isinstance(per_length, dict):
            raise ValueError(f"results['accuracy'][{task!r}]: expected an object of lengths")
        for length, scores in per_length.items():
            where = f"results['accuracy'][{task!r}][{length!r}]"
            if not isinstance(scores, dict):
                raise ValueError(f"{where}: expected {{'memory': acc, 'no_memory': acc}}")
            for key in ("memory", "no_memory"):
                value = scores.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                    raise ValueError(f"{where}[{key!r}]: expected an accuracy in [0, 1], got {value!r}")
            rows.append({"task": task, "length": str(length), "memory": scores["memory"],
                         "no_memory": scores["no_memory"]})
    return rows


def _sigmoid(x: float) -> float:
    """The logistic function of a gate's bias: where the gate starts."""
    return 0.5 * (1 + math.tanh(x / 2))


def render_memory_card(config: TitansMemoryConfig, results: dict | None = None, *, repo_id: str | None = None,
                       datasets: list[str] | None = None, adapter: dict[str, Any] | None = None) -> str:
    """README.md of a memory repository: Hub metadata (base model, library, tags, datasets, evaluation results),
    what the memory is, how it was trained, its evaluation table and the line that loads it.

    The prose follows the settings: the attention context (`attend_previous_chunk`), the memory model, the update
    rule (the delta rule and its norm bound, or the gradient rule with momentum), whether the forget gate starts
    open enough to forget, the write cost, the variant.

    The base must be named by a Hub id: a local path never goes into a public card. `repo_id` is the repository
    the card will live in (it appears in the loading snippet); `datasets` are Hub ids of the training data;
    `adapter` the adapter_config.json of a LoRA adapter trained with the memory (`titans_hf.lora`), if any.
    """
    base_model = config.base_model_name_or_path
    if not base_model or not is_hub_id(base_model) or Path(base_model).exists():
        raise ValueError(f"the memory's base_model_name_or_path is {base_model!r}, not a Hub id: a local path never "
                         "goes into a public card; pass the base's Hub id (push --base-model ORG/NAME, or "
                         "base_model= in Python)")
    rows = _evaluation_rows(results)
    settings = config.memory_settings()
    eval_results = [
        EvalResult(task_type="question-answering", dataset_type="RMT-team/babilong", dataset_name="BABILong",
                   dataset_config=row["task"], dataset_split=row["length"], metric_type="exact_match",
                   metric_name=f"exact match, {mode.replace('_', ' ')}", metric_value=row[mode])
        for row in rows for mode in ("memory", "no_memory")
    ]
    card_data = ModelCardData(
        base_model=base_model,
        base_model_relation="adapter",
        library_name="titans_hf",
        pipeline_tag="text-generation",
        tags=["titans", "long-term-memory", "long-context", config.base_shape["model_type"], config.variant,
              *(["lora", "peft"] if adapter is not None else [])],
        datasets=datasets or None,
        model_name=repo_id or f"titans memory for {base_model}",
        eval_results=eval_results or None,
    )
    # StrictUndefined: a name missing from the template's inputs is an error, never an empty hole in the card.
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    template = environment.from_string(CARD_TEMPLATE_PATH.read_text(encoding="utf-8"))
    content = template.render(
        card_data=card_data.to_yaml(),
        repo_id=repo_id or "<repo_id>",
        base_model=base_model,
        revision=config.revision,
        memory_settings=settings,
        initial_theta=config.max_lr * _sigmoid(config.theta_bias_init),
        forget_rate=_sigmoid(config.forget_bias_init),
        base_shape=config.base_shape,
        titans_hf_version=config.titans_hf_version,
        evaluation_rows=rows,
        datasets=datasets or [],
        adapter=adapter,
    )
    # Parsing it back checks that the YAML header is what the Hub will read.
    return ModelCard(content).content


def _adapter_to_push(folder: Path, repo_id: str) -> tuple[dict[str, Any], Path] | None:
    """(the adapter_config.json to upload, the weights) of a folder holding a LoRA adapter beside its memory, else
    None; both files are checked first (`titans_hf.lora.read_adapter_config`, a readable LoRA header). The uploaded
    config names the repository itself as the model the adapter goes on: the base plus this memory, which is what
    `AutoModelForCausalLM.from_pretrained(repo_id)` then loads (naming the bare base, it would load the base and
    the LoRA and drop the memory)."""
    paths = [folder / ADAPTER_CONFIG_NAME, folder / ADAPTER_WEIGHTS_NAME]
    if not any(path.exists() for path in paths):
        return None
    for path in paths:
        if path.is_symlink():
            raise ValueError(f"{path}: is a link ({os.readlink(path)}); a memory folder holds its own files")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; an adapter is {ADAPTER_CONFIG_NAME} and "
                                    f"{ADAPTER_WEIGHTS_NAME} together (written by save_pretrained of a model with a "
                                    "LoRA adapter)")
    from titans_hf.lora import (  # needs peft, which only an adapter does
        PEFT_KEY_PREFIX,
        read_adapter_config,
    )

    read_adapter_config(paths[0])
    header = read_safetensors_header(paths[1])
    wrong = [name for name in header if not (name.startswith(PEFT_KEY_PREFIX)
                                             and name.endswith((".lora_A.weight", ".lora_B.weight")))]
    if not header or wrong:
        raise ValueError(f"{paths[1]}: not the weights of a LoRA adapter (tensors {wrong[:3] or 'none'})")
    values = json.loads(paths[0].read_text(encoding="utf-8"))
    values.update(base_model_name_or_path=repo_id, revision=None)
    return values, paths[1]


def push_memory_folder(folder: str | os.PathLike, repo_id: str, *, token: str | None = None,
                       endpoint: str | None = None, private: bool = False, commit_message: str | None = None,
                       results: dict | None = None, datasets: list[str] | None = None,
                       base_model: str | None = None, revision: str | None = None,
                       check_weights: Callable[[TitansMemoryConfig, dict, str], None] | None = None) -> str:
    """Upload a memory folder to a Hub model repository and return the commit URL.

    The commit holds exactly memory_model.safetensors, memory_config.json, the folder's config.json (for the Auto
    classes; its memory settings replaced by the pushed ones, no local path of the base in it) when it has one, the
    LoRA adapter (adapter_model.safetensors, adapter_config.json naming the repository as its model) when it has one,
    and a README.md rendered from hub_cards/memory_model_card.md; anything else in the folder stays local, and a file
    that is a link is refused.
    `check_weights(config, {name: (shape, dtype)}, source)` (the model's `check_memory_weights`) vets the weights
    against the config before anything is sent. `base_model` / `revision` name the base on the Hub when the
    memory was trained on a local copy of it (they replace the local path in the uploaded config). The token comes
    from `token`, else from HF_TOKEN or `hf auth login`, and is never printed or logged.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory (expected a memory folder written by save_pretrained)")
    config_path, weights_path = hub_file(folder, MEMORY_CONFIG_NAME), hub_file(folder, MEMORY_WEIGHTS_NAME)
    model_config_path = folder / MODEL_CONFIG_NAME
    for path in (config_path, weights_path, model_config_path):
        if path.is_symlink():
            raise ValueError(f"{path}: is a link ({os.readlink(path)}); a memory folder holds its own files")
    config = read_memory_config(config_path)
    header = read_safetensors_header(weights_path)
    if not header:
        raise ValueError(f"{weights_path}: holds no tensors")
    if check_weights is not None:
        check_weights(config, header, str(weights_path))
    if base_model is not None:
        config = dataclasses.replace(config, base_model_name_or_path=base_model, revision=revision)
    model_config = read_model_config(model_config_path) if model_config_path.is_file() else None
    adapter = _adapter_to_push(folder, repo_id)
    card = render_memory_card(config, results, repo_id=repo_id, datasets=datasets,
                              adapter=None if adapter is None else adapter[0])
    if is_offline_mode():
        raise OfflineModeIsEnabled(f"Cannot push {folder} to {repo_id}: offline mode is on (HF_HUB_OFFLINE=1); "
                                   "unset it to push.")
    if token is None and get_token() is None:
        raise ValueError(f"Cannot push to {repo_id}: no Hugging Face token; set HF_TOKEN or run `hf auth login`.")
    api = HfApi(endpoint=endpoint, token=token)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    config_bytes = (json.dumps(config.to_dict(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    operations = [
        CommitOperationAdd(path_in_repo=MEMORY_WEIGHTS_NAME, path_or_fileobj=str(weights_path)),
        CommitOperationAdd(path_in_repo=MEMORY_CONFIG_NAME, path_or_fileobj=config_bytes),
        CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")),
    ]
    if adapter is not None:
        operations[2:2] = [
            CommitOperationAdd(path_in_repo=ADAPTER_WEIGHTS_NAME, path_or_fileobj=str(folder / ADAPTER_WEIGHTS_NAME)),
            CommitOperationAdd(path_in_repo=ADAPTER_CONFIG_NAME, path_or_fileobj=(
                json.dumps(adapter[0], indent=2, ensure_ascii=False) + "\n").encode("utf-8")),
        ]
    if model_config is not None:
        model_config["memory_config"] = config.to_dict()
        model_config["text_config"].pop("_name_or_path", None)
        operations.insert(2, CommitOperationAdd(path_in_repo=MODEL_CONFIG_NAME, path_or_fileobj=(
            json.dumps(model_config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")))
    logger.info("Pushing %s, %s and README.md to %s", MEMORY_WEIGHTS_NAME, MEMORY_CONFIG_NAME, repo_url)
    commit = api.create_commit(repo_url.repo_id, operations,
                               commit_message=commit_message or f"Upload Titans memory (titans_hf {__version__})")
    return commit.commit_url
