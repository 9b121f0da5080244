"""BABILong rows on disk: the public JSON / JSON Lines files, and the dataset card of a generated set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from titans_hf.utils import atomic_write_text

REQUIRED_FIELDS = ("input", "question", "target")



def read_babilong_json(path: str | Path) -> list[dict[str, str]]:
    """Rows of a BABILong file: a JSON list (the public files) or JSON Lines.

    Extra fields of the public files are dropped; a row missing a field, with a non-string
    field or an empty target is an error naming the file and row, never silently skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"BABILong file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ValueError(f"BABILong file {path} is not valid JSON or JSON Lines: {error}") from error
    rows = []
    for index, record in enumerate(records):
        where = f"BABILong file {path}, row {index} (0-based)"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected an object with {list(REQUIRED_FIELDS)}, got {type(record).__name__}")
        missing = [field for field in REQUIRED_FIELDS if field not in record]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        wrong = [field for field in REQUIRED_FIELDS if not isinstance(record[field], str)]
        if wrong:
            raise ValueError(f"{where}: field(s) {wrong} must be strings")
        if not record["target"].strip():
            raise ValueError(f"{where}: empty target")
        rows.append({field: record[field] for field in REQUIRED_FIELDS})
    if not rows:
        raise ValueError(f"BABILong file {path} holds no rows")
    return rows


def write_babilong_json(rows: Sequence[dict[str, str]], path: str | Path) -> Path:
    """Write rows as a JSON list (the public layout) through a temporary name, so a partial file never looks done."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = [{field: row[field] for field in REQUIRED_FIELDS} for row in rows]
    return atomic_write_text(path, json.dumps(payload, ensure_ascii=False, indent=1))


DATASET_CARD_TEMPLATE = Path(__file__).resolve().parents[2] / "hub_cards" / "babilong_dataset_card.md"


def render_dataset_card(settings: dict[str, Any]) -> str:
    """The dataset card of a generated set: how to regenerate it and what its rows mean.

    ``settings`` holds task, length, num_samples, seed, tokenizer, haystack_files (list) and files.
    """
    from huggingface_hub import DatasetCard, DatasetCardData

    card_data = DatasetCardData(
        language="en", license="apache-2.0", pretty_name=f"Generated BABILong {settings['task']}",
        task_categories=["question-answering"], tags=["babilong", "long-context", "titans_hf", "synthetic"],
    )
    card = DatasetCard.from_template(card_data, template_path=str(DATASET_CARD_TEMPLATE), **settings)
    return str(card)


def write_dataset_card(json_path: str | Path, settings: dict[str, Any]) -> Path:
    """Render the card as README.md in the folder of a generated JSON file (temporary name, then rename)."""
    card_path = Path(json_path).parent / "README.md"
    return atomic_write_text(card_path, render_dataset_card(settings))
