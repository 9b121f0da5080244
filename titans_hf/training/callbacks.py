"""The `TrainerCallback`s `TitansTrainer` registers on itself."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import torch
from accelerate.utils import reduce
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from titans_hf.data.sampler import ChunkCurriculumSampler, ResumableSampler, check_sampler_state
from titans_hf.files import atomic_write_json
from titans_hf.modeling.memory import MemoryState

from .checkpointing import SAMPLER_STATE_NAME, load_passed_states, passed_states_name, save_passed_states

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


class PassedStatesCallback(TrainerCallback):
    """The memory states State Passing carries from one micro-batch to the next (`states`, which
    `TitansTrainer.compute_loss` starts rows from and replaces after each micro-batch), kept in every checkpoint so
    that the first micro-batch of a resumed run starts its rows from the states the interrupted run's last one ended
    in, as the uninterrupted run's would have.

    - `on_save`: once the Trainer has written a checkpoint (`args.output_dir`/checkpoint-N), each process writes its
      own states into it (`passed_memory_states.safetensors`, `passed_memory_states_{rank}.safetensors` with several
      processes: `passed_states_name`), atomically. A checkpoint this write fails for is removed, since it cannot be
      resumed without them (a full disk is an OSError saying so, naming the file); one whose run was killed after
      the Trainer's files and before this write is refused by a resume, naming the missing file. `TitansTrainer`
      puts the callback first, so that the other callbacks' `on_save` find the states in the checkpoint.
    - `resume_from`: a resumed run reads and checks the checkpoint's states before training, refusing, naming the
      file, one that is missing, not finite or not this memory's (`load_passed_states`); every process stops when
      one does.
    - `on_train_begin`: the states read take the place of `states`; a fresh run starts with none.

    The Trainer's public events reach this callback on every process, so a run under a hyperparameter search, whose
    checkpoints lie in a trial's folder that the events do not name, is refused with State Passing.

    Attributes:
        states (`dict[int, MemoryState]` or `None`): per memory layer, the states the last training micro-batch of
            this process ended in (detached); None before the first one of a fresh run, and without State Passing.
    """

    def __init__(self) -> None:
        self.states: dict[int, MemoryState] | None = None
        self._saved: dict[int, MemoryState] | None = None  # the states the run starts from, read by resume_from

    def resume_from(self, checkpoint: str | os.PathLike | None, args: TrainingArguments, model: nn.Module) -> None:
        """Under State Passing (`args.state_passing`), read this process's states from `checkpoint`, for the run to
        start from (none for a fresh run, None); a ValueError naming the file when it is missing, not finite or not
        the states of `model`'s memory layers (`model`: the unwrapped TitansQwen, whose `init_memory_states` give
        the shapes). A collective: every process calls it, and all of them raise when one does.
        `TitansTrainer.train` calls it before training."""
        self._saved = None
        if checkpoint is None or not args.state_passing:
            return
        states, problem = None, None
        try:
            states = load_passed_states(Path(checkpoint, passed_states_name(args)), model.init_memory_states(1))
        except ValueError as error:
            problem = error
        failed = reduce(torch.tensor(float(problem is not None), device=args.device), reduction="max")
        if problem is not None:
            raise ValueError(f"cannot resume from {checkpoint}: {problem}") from problem
        if failed.item():
            raise ValueError(f"cannot resume from {checkpoint}: another process's passed memory states are not this "
                             "run's (its error names the file)")
        self._saved = {layer: state.to(args.device) for layer, state in states.items()}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs) -> None:
        if args.state_passing and state.is_hyper_param_search:
            raise ValueError("state_passing keeps its memory states in each checkpoint of args.output_dir; a "
                             "hyperparameter search writes a trial's checkpoints into a folder of its own: run the "
                             "search with state_passing 0")
        self.states, self._saved = self._saved, None

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.states is None:
            return
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            save_passed_states(folder / passed_states_name(args), self.states)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)  # a checkpoint without them would be refused at resume
            raise
