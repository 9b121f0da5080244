"""Sharing a trained memory on the Hugging Face Hub: its two files and a model card of our own.

`PushToHubMixin.push_to_hub` would upload whatever lies in the folder and replace README.md with a
generic card. A memory repository must hold exactly the memory weights, the memory config and a
card that says which base model the memory belongs to and how to load it there, so the commit
here is built from those three files explicitly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData, get_token, is_offline_mode
from huggingface_hub.errors import HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open

from titans_hf import __version__
from titans_hf.modeling.modeling_titans_qwen import MEMORY_CONFIG_NAME, MEMORY_WEIGHTS_NAME

logger = logging.getLogger(__name__)

CARD_TEMPLATE_PATH = Path(__file__).parent / "hub_cards" / "memory_model_card.md"

# What the card describes; a config lacking one of these would render a card with holes.
CARD_MEMORY_SETTINGS = (
    "variant",
    "chunk_size",
    "memory_layers",
    "memory_num_heads",
    "memory_head_dim",
    "memory_depth",
    "memory_expansion",
    "memory_chunk_size",
    "num_memory_tokens",
    "num_persistent_tokens",
    "bptt_chunks",
    "freeze_base",
)
CARD_BASE_SHAPE = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
EVALUATION_DATASET = "RMT-team/babilong"


def _check_memory_config(memory_config: Any, source: str) -> None:
    """Refuse a config the card cannot describe truthfully; `source` names it in the message."""
    if not isinstance(memory_config, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(memory_config).__name__}")
    base = memory_config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{source}: 'base_model_name_or_path' must be a non-empty string, got {base!r}")
    for section, required in (("memory_settings", CARD_MEMORY_SETTINGS), ("base_shape", CARD_BASE_SHAPE)):
        values = memory_config.get(section)
        if not isinstance(values, dict):
            raise ValueError(f"{source}: '{section}' must be an object, got {type(values).__name__}")
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"{source}: '{section}' lacks {', '.join(missing)}")
    variant = memory_config["memory_settings"]["variant"]
    if variant not in ("mag", "mac", "mal"):
        raise ValueError(f"{source}: memory_settings.variant must be 'mag', 'mac' or 'mal', got {variant!r}")


def _evaluation_rows(results: dict | None) -> list[dict]:
    """Flatten {"accuracy": {task: {length: {"memory", "no_memory"}}}} into table rows, in the given order.

    The evaluator decides the order of tasks and lengths; sorting here would have to guess how
    lengths such as "32k" compare.
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
            rows.append({"task": task, "length": length, "memory": scores["memory"], "no_memory": scores["no_memory"]})
    return rows


def _is_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def render_memory_card(memory_config: dict, results: dict | None = None, *, repo_id: str | None = None) -> str:
    """README.md for a memory repository: YAML metadata, what the memory is, how it was trained,
    its evaluation table, and the line that loads it onto its base.

    `repo_id` is the repository the card will live in (it appears in the loading snippet); without
    it the snippet shows a placeholder.
    """
    _check_memory_config(memory_config, "memory_config")
    rows = _evaluation_rows(results)
    settings = memory_config["memory_settings"]
    base_shape = memory_config["base_shape"]
    base_model = memory_config["base_model_name_or_path"]
    base_is_hub_id = _is_hub_id(base_model)
    card_data = ModelCardData(
        # The Hub links a model to its base only through a valid repository id; a local path is left out.
        base_model=base_model if base_is_hub_id else None,
        library_name="titans_hf",
        tags=["titans", "long-term-memory", "long-context", "babilong", base_shape["model_type"], settings["variant"]],
        datasets=[EVALUATION_DATASET],
        metrics=["accuracy"],
    )
    # StrictUndefined: a name missing from the template's inputs is an error, never an empty hole in the card.
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    template = environment.from_string(CARD_TEMPLATE_PATH.read_text(encoding="utf-8"))
    content = template.render(
        card_data=card_data.to_yaml(),
        repo_id=repo_id or "<repo_id>",
        base_model=base_model,
        base_model_display=f"`{base_model}`",
        base_is_hub_id=base_is_hub_id,
        memory_settings=settings,
        base_shape=base_shape,
        titans_hf_version=memory_config.get("titans_hf_version", "unknown"),
        evaluation_rows=rows,
    )
    # Parsing it back checks that the YAML header is what the Hub will read.
    return ModelCard(content).content


def _read_memory_folder(folder: Path) -> dict:
    """Check the folder holds a loadable memory and return its config."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory (expected a folder written by save_memory)")
    for name in (MEMORY_WEIGHTS_NAME, MEMORY_CONFIG_NAME):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{folder / name}: missing; a memory folder holds {MEMORY_WEIGHTS_NAME} and {MEMORY_CONFIG_NAME}"
            )
    weights_path = folder / MEMORY_WEIGHTS_NAME
    try:
        with safe_open(weights_path, framework="numpy") as weights:
            tensor_names = list(weights.keys())
    except Exception as error:  # safetensors raises its own error types for every kind of corrupt header
        raise ValueError(f"{weights_path}: not a readable safetensors file ({error})") from error
    if not tensor_names:
        raise ValueError(f"{weights_path}: holds no tensors")
    config_path = folder / MEMORY_CONFIG_NAME
    try:
        memory_config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from error
    _check_memory_config(memory_config, str(config_path))
    return memory_config


def push_memory_folder(
    folder: str | Path,
    repo_id: str,
    token: str | None = None,
    endpoint: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    results: dict | None = None,
) -> str:
    """Upload a `save_memory` folder to a Hub model repository and return the commit URL.

    The commit holds exactly memory_model.safetensors, memory_config.json and a README.md rendered
    from hub_cards/memory_model_card.md; anything else in the folder stays local. The token comes
    from `token`, else from HF_TOKEN or `hf auth login`, and is never printed or logged.
    """
    folder = Path(folder)
    memory_config = _read_memory_folder(folder)
    card = render_memory_card(memory_config, results, repo_id=repo_id)
    if is_offline_mode():
        raise OfflineModeIsEnabled(
            f"Cannot push {folder} to {repo_id}: offline mode is on (HF_HUB_OFFLINE=1); unset it to push."
        )
    if token is None and get_token() is None:
        raise ValueError(f"Cannot push to {repo_id}: no Hugging Face token; set HF_TOKEN or run `hf auth login`.")
    api = HfApi(endpoint=endpoint, token=token)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=MEMORY_WEIGHTS_NAME, path_or_fileobj=str(folder / MEMORY_WEIGHTS_NAME)),
        CommitOperationAdd(path_in_repo=MEMORY_CONFIG_NAME, path_or_fileobj=str(folder / MEMORY_CONFIG_NAME)),
        CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")),
    ]
    logger.info("Pushing %s, %s and README.md to %s", MEMORY_WEIGHTS_NAME, MEMORY_CONFIG_NAME, repo_url)
    commit = api.create_commit(
        repo_url.repo_id,
        operations,
        commit_message=commit_message or f"Upload Titans memory (titans_hf {__version__})",
    )
    return commit.commit_url
