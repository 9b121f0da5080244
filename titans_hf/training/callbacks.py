"""The `TrainerCallback`s `TitansTrainer` registers on itself."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from titans_hf.data.sampler import ChunkCurriculumSampler, ResumableSampler, check_sampler_state
from titans_hf.files import atomic_write_json

from .checkpointing import SAMPLER_STATE_NAME

logger = logging.getLogger(__name__)


class SamplerStateCallback(TrainerCallback):
    """The training sampler's epoch and state (a `ResumableSampler`, or a `ChunkCurriculumSampler` for a length
    curriculum), so that a resumed run draws the rows in the order the interrupted one would have.

    - At the start of each epoch the sampler is set to it, before the loader is iterated. The Trainer reaches the
      sampler's `set_epoch` only through accelerate's loader, which forwards it through a limited depth of batch
      sampler wrappers; the wrapper that skips a resumed epoch's trained batches can put the sampler beyond that
      depth, and a resumed epoch >= 1 would then replay epoch 0's order.
    - A resumed run reads the state saved in the checkpoint (`sampler_state.json`) before training starts
      (`resume_from`), refusing one whose fields are not a sampler's (naming the file and the field); at its first
      epoch the sampler takes it: the saved seed wins over a changed `--seed`.
    - `save` writes that state into a checkpoint folder; `TitansTrainer` calls it before the Trainer writes the
      checkpoint's own files, so a checkpoint whose `trainer_state.json` exists holds it.

    With a length curriculum, the main process logs each epoch's stage.

    Attributes:
        sampler (`ResumableSampler`, `ChunkCurriculumSampler` or `None`): the sampler of the training rows, set when
            the Trainer builds its loader; None for an `IterableDataset`, which has none.
    """

    def __init__(self) -> None:
        self.sampler: ResumableSampler | ChunkCurriculumSampler | None = None
        self._saved: tuple[Path, dict] | None = None  # the state the first epoch loads, and the file it came from
        self._epoch = 0

    def resume_from(self, checkpoint: str | os.PathLike | None) -> None:
        """Read the sampler state saved in `checkpoint`, for the first epoch to load (nothing for a fresh run,
        None, or a checkpoint without one): a ValueError naming the file, and the field where one is wrong
        (`check_sampler_state`), when it is not a sampler's state. `TitansTrainer.train` calls it before training."""
        self._saved = None
        if checkpoint is None or not Path(checkpoint, SAMPLER_STATE_NAME).is_file():
            return
        path = Path(checkpoint, SAMPLER_STATE_NAME)
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            check_sampler_state(state)
        except (UnicodeDecodeError, RecursionError, ValueError) as error:  # json's errors are ValueErrors
            raise ValueError(f"{path}: not the state of this run's sampler ({error})") from error
        self._saved = (path, state)

    def save(self, folder: Path) -> None:
        """Write the sampler's state into the checkpoint `folder` (nothing without a sampler)."""
        if self.sampler is not None:
            atomic_write_json(folder / SAMPLER_STATE_NAME, self.sampler.state_dict())

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader=None, **kwargs) -> None:
        """The epoch the run starts in, as the Trainer counts it: the optimizer steps already taken
        (`state.global_step`, restored from a resumed checkpoint) over the steps of one epoch."""
        if self.sampler is None:
            return
        steps_per_epoch = max(math.ceil(len(train_dataloader) / args.gradient_accumulation_steps), 1)
        self._epoch = state.global_step // steps_per_epoch

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs) -> None:
        sampler, epoch = self.sampler, self._epoch
        self._epoch += 1
        if sampler is None:
            return
        if self._saved is not None:
            (path, saved), self._saved = self._saved, None
            try:
                sampler.load_state_dict(saved)
            except ValueError as error:
                raise ValueError(f"{path}: not the state of this run's sampler ({error})") from error
        sampler.set_epoch(epoch)
        if isinstance(sampler, ChunkCurriculumSampler) and state.is_world_process_zero:
            stage = sampler.stage(epoch)
            logger.info("epoch %d: curriculum stage %d, rows of <= %d chunks (%d rows)", epoch, stage,
                        sampler.stages[stage], len(sampler.pools[stage]))
