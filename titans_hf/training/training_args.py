"""`TitansTrainingArguments`: `TrainingArguments` for training a memory, every field of its own documented."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments


@dataclass
class TitansTrainingArguments(TrainingArguments):
    """`TrainingArguments` with the seed recipe's batch settings, a logging cadence in micro-batches, a length
    curriculum and the Hub datasets named on a pushed model card.

    Args:
        per_device_train_batch_size: rows per device per micro-batch (default 1: one 32k row is what fits).
        gradient_accumulation_steps: micro-batches per optimizer step (default 8).
        logging_steps: optimizer steps between log lines; when not given, `log_every_batches` decides it.
        log_every_batches: a log line every this many micro-batches, i.e. `logging_steps = ceil(log_every_batches
            / gradient_accumulation_steps)`, used only when `logging_steps` is not given (None: the Trainer's 500).
        curriculum_chunks: chunk-count caps, one per stage, increasing (e.g. 1 2 4 8): stage s trains on the rows
            of at most `curriculum_chunks[s]` chunks, the last stage stays. None: no curriculum.
        curriculum_epochs_per_stage: epochs spent in each curriculum stage before the next one.
        state_passing: share of training rows (0 to 1) whose memory starts from the state the row in the same place
            of the previous micro-batch ended in (detached), instead of a fresh state: the read path then learns on
            states that have taken many more updates than one row brings (State Passing). Default 0.
        dpo_beta: DPO's beta for dpo rows (TRL's default, 0.1).
        hub_dataset_ids: Hub ids of the datasets trained on, written into the model card of a push.
        overwrite_output_dir: let a fresh run replace the memory folder an earlier run saved in `output_dir` (only
            the files titans_hf wrote there and recorded in its `.titans_hf_outputs.json`; a user's own files of the
            same names are never replaced).
        hub_base_model: the base's Hub id for pushes, when the base was loaded from a local folder (a local path
            never goes into a pushed card or config).
    """

    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Rows per device per micro-batch; one 32k row is what fits."}
    )
    gradient_accumulation_steps: int = field(default=8, metadata={"help": "Micro-batches per optimizer step."})
    logging_steps: float | None = field(
        default=None,
        metadata={"help": "Optimizer steps between log lines (a float < 1: a share of all steps). Not given: "
                          "log_every_batches decides."},
    )
    log_every_batches: int | None = field(
        default=80,
        metadata={"help": "A log line every this many micro-batches (logging_steps = ceil(log_every_batches / "
                          "gradient_accumulation_steps)); only used when logging_steps is not given."},
    )
    curriculum_chunks: list[int] | None = field(
        default=None,
        metadata={"help": "Length curriculum: chunk-count caps, one per stage, increasing (e.g. 1 2 4 8). Stage s "
                          "trains on rows of at most curriculum_chunks[s] chunks; the last stage stays. None: no "
                          "curriculum."},
    )
    curriculum_epochs_per_stage: int = field(
        default=1, metadata={"help": "Epochs spent in each curriculum stage before the next one."}
    )
    state_passing: float = field(
        default=0.0, metadata={"help": "Share of rows (0 to 1) whose memory starts where the row in the same place of "
                                       "the previous micro-batch ended (State Passing), instead of fresh."}
    )
    dpo_beta: float = field(
        default=0.1, metadata={"help": "dpo rows: DPO's beta, how far the memory may move the answers' log-ratio "
                                       "against the memory-off model."}
    )
    hub_dataset_ids: list[str] | None = field(
        default=None, metadata={"help": "Hub ids of the datasets trained on, for the model card of a push."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Let a fresh run replace the memory an earlier run saved in output_dir (only the files "
                          "titans_hf recorded writing there; a user's own files are never replaced)."},
    )
    hub_base_model: str | None = field(
        default=None, metadata={"help": "The base's Hub id for pushes, when it was loaded from a local folder."}
    )

    def __post_init__(self):
        if self.log_every_batches is not None and self.log_every_batches < 1:
            raise ValueError(f"log_every_batches must be >= 1 (or None), got {self.log_every_batches}")
        if self.logging_steps is None:
            self.logging_steps = (500 if self.log_every_batches is None
                                  else math.ceil(self.log_every_batches / self.gradient_accumulation_steps))
        if self.curriculum_chunks is not None:
            chunks = list(self.curriculum_chunks)
            if not chunks or chunks[0] < 1 or any(b <= a for a, b in zip(chunks, chunks[1:])):
                raise ValueError(
                    f"curriculum_chunks must be positive and strictly increasing, got {self.curriculum_chunks}"
                )
        if not 0.0 <= self.state_passing <= 1.0:
            raise ValueError(f"state_passing must lie in [0, 1], got {self.state_passing}")
        if self.curriculum_epochs_per_stage < 1:
            raise ValueError(f"curriculum_epochs_per_stage must be >= 1, got {self.curriculum_epochs_per_stage}")
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available():
            # accelerate's multi-process launcher does not pass the config's `use_cpu` on; without it
            # every process would silently train alone instead of joining a gloo DDP group.
            self.use_cpu = True
        super().__post_init__()
