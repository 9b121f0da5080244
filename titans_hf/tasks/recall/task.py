"""What the recall package offers the rest of titans_hf (its line in `titans_hf.tasks.TASKS`): its corpus is
trained and scored as token stores (`titans-hf prepare`, `titans-hf eval --lm`), so only its command."""

from __future__ import annotations

from titans_hf.tasks import Task

TASK = Task(name="recall", command="titans_hf.commands.recall")
