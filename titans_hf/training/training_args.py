"""`TitansTrainingArguments`: `TrainingArguments` for training a memory, every field of its own documented."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments


@dataclass
class TitansTrainingArguments(TrainingArguments):
    """`TrainingArguments` for training a memory: the seed recipe's batch settings, a logging cadence counted in
    micro-batches, a length curriculum, State Passing, DPO's beta, and what a push names on its model card; every other
    argument is the `TrainingArguments`' own. Under a multi-process launch on a machine without an accelerator,
    `use_cpu` is set, so that the processes join one gloo DDP group (accelerate's launcher does not pass its config's
    `use_cpu` on).

    Args:
        per_device_train_batch_size (`int`, *optional*, defaults to `1`):
            Rows per device per micro-batch: one 32k-token row is what fits.
        gradient_accumulation_steps (`int`, *optional*, defaults to `8`):
            Micro-batches per optimizer step.
        logging_steps (`float`, *optional*, defaults to `None`):
            Optimizer steps between log lines (a float below 1: that share of all steps). When not given,
            `log_every_batches` decides it.
        log_every_batches (`int`, *optional*, defaults to `80`):
            A log line every this many micro-batches, i.e. `logging_steps = ceil(log_every_batches /
            gradient_accumulation_steps)`, used only when `logging_steps` is not given. None: the Trainer's 500
            steps.
        curriculum_chunks (`list[int]`, *optional*, defaults to `None`):
            The chunk-count caps of a length curriculum, one per stage, strictly increasing (e.g. `[1, 2, 4, 8]`):
            stage s trains on the rows of at most `curriculum_chunks[s]` chunks, and the last stage stays. None: no
            curriculum.
        curriculum_epochs_per_stage (`int`, *optional*, defaults to `1`):
            Epochs spent in each curriculum stage before the next one.
        state_passing (`float`, *optional*, defaults to `0.0`):
            Share of training rows (0 to 1) whose memory starts from the state the row in the same place of the
            previous micro-batch ended in (detached), instead of a fresh state: the read path then learns on states
            that have taken many more updates than one row brings (State Passing).
        write_cost_growth (`float`, *optional*, defaults to `8.0`):
            What the write cost's weight (`memory_config.write_cost`) is multiplied by at the end of training. The
            memory first learns to write the facts at the config's weight; the grown weight then closes the write
            gate further on the tokens between them, which is what lets a fact outlast many thousand updates
            (docs/length.md). 1: the config's weight throughout.
        write_cost_growth_span (`list[float]`, *optional*, defaults to `[0.3, 0.6]`):
            The shares of the training steps between which the weight grows, linearly, from the config's to
            `write_cost_growth` times it: before the first, the config's weight; after the second, the grown one.
            Like the learning rate's schedule, it follows `max_steps`: a run resumed with other `max_steps` goes on
            along another schedule.
        dpo_beta (`float`, *optional*, defaults to `0.1`):
            DPO's beta for dpo rows (TRL's default): how far the memory may move the answers' log-ratio against the
            model with its memory switched off.
        hub_dataset_ids (`list[str]`, *optional*, defaults to `None`):
            Hub ids of the datasets trained on, written into the model card of a push.
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            Let a fresh run replace the memory folder an earlier run saved in `output_dir`: only the files titans_hf
            wrote there and recorded in its `.titans_hf_outputs.json` (a user's own files of the same names are never
            replaced).
        hub_base_model (`str`, *optional*, defaults to `None`):
            The base's Hub id for pushes, when the base was loaded from a local folder (a local path never goes into
            a pushed card or config).
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
    write_cost_growth: float = field(
        default=8.0, metadata={"help": "The write cost's weight (memory_config.write_cost) is multiplied by this at the "
                                       "end of training; 1: the config's weight throughout."}
    )
    write_cost_growth_span: list[float] = field(
        default_factory=lambda: [0.3, 0.6],
        metadata={"help": "Shares of the training steps between which the write cost's weight grows linearly from "
                          "the config's to write_cost_growth times it."},
    )
    frozen_trunk_cache_gb: float = field(
        default=0.0, metadata={"help": "GiB of trunk hidden states (the frozen layers below the first memory layer, per "
                                       "row) to keep on the CPU, so that each row's later readings start at the "
                                       "memory (TitansQwenForCausalLM.cache_frozen_trunk; the same losses and "
                                       "gradients); 0: off."}
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
        if not self.write_cost_growth >= 0:
            raise ValueError(f"write_cost_growth must be >= 0, got {self.write_cost_growth}")
        span = list(self.write_cost_growth_span)
        if len(span) != 2 or not 0.0 <= span[0] <= span[1] <= 1.0:
            raise ValueError("write_cost_growth_span must be two shares of the training steps, 0 <= start <= end <= 1, "
                             f"got {self.write_cost_growth_span}")
        if not self.frozen_trunk_cache_gb >= 0:
            raise ValueError(f"frozen_trunk_cache_gb={self.frozen_trunk_cache_gb} must be 0 (off) or positive")
        if self.curriculum_epochs_per_stage < 1:
            raise ValueError(f"curriculum_epochs_per_stage must be >= 1, got {self.curriculum_epochs_per_stage}")
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available():
            # accelerate's multi-process launcher does not pass the config's `use_cpu` on; without it
            # every process would silently train alone instead of joining a gloo DDP group.
            self.use_cpu = True
        super().__post_init__()

    def write_cost_factor(self, progress: float) -> float:
        """What the write cost's weight is multiplied by at `progress` (the share of the training steps done): 1 until
        `write_cost_growth_span[0]`, `write_cost_growth` from `write_cost_growth_span[1]` on, linear between."""
        start, end = self.write_cost_growth_span
        if progress < start:
            return 1.0
        if progress >= end:
            return self.write_cost_growth
        return 1.0 + (self.write_cost_growth - 1.0) * (progress - start) / (end - start)
