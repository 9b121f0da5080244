"""`TitansTrainer`: a `transformers.Trainer` that trains, checkpoints and resumes only the memory.

The base Qwen stays frozen, so a checkpoint holds the trainable weights (`memory_model.safetensors`,
plus `memory_config.json` for a TitansQwen), optimizer, scheduler, RNG, trainer and sampler state:
megabytes instead of the gigabytes of a full-model checkpoint. Everything else is the stock Trainer,
launched as a single process or with `accelerate launch --config_file titans_hf/accelerate/*.yaml`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import safetensors.torch
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils.data import Sampler
from tqdm.auto import tqdm
from transformers import Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from titans_hf.data.collator import TitansDataCollator
from titans_hf.data.sampler import ResumableSampler
from titans_hf.modeling.modeling_titans_qwen import MEMORY_CONFIG_NAME, MEMORY_WEIGHTS_NAME

logger = logging.getLogger(__name__)

# Base weights that were trained too (a TitansQwen with freeze_base=False): kept out of the memory file,
# which `from_base_and_memory` reads, but part of the checkpoint so that resume restores them.
TRAINABLE_BASE_WEIGHTS_NAME = "trainable_base_model.safetensors"
SAMPLER_STATE_NAME = "sampler_state.json"
TRAINING_ARGS_JSON_NAME = "training_args.json"
# A checkpoint is assembled under this prefix and renamed to `checkpoint-N` only when complete;
# `get_last_checkpoint` and checkpoint rotation match `^checkpoint-N$` and never see it.
STAGING_PREFIX = f"tmp-{PREFIX_CHECKPOINT_DIR}"


@dataclass
class TitansTrainingArguments(TrainingArguments):
    """`TrainingArguments` with the seed recipe's batch settings and the memory-training extras."""

    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Rows per device per micro-batch; one 32k row is what fits."}
    )
    gradient_accumulation_steps: int = field(default=8, metadata={"help": "Micro-batches per optimizer step."})
    log_every_batches: int | None = field(
        default=80,
        metadata={
            "help": "Log every this many micro-batches: sets logging_steps = ceil(log_every_batches / "
            "gradient_accumulation_steps). None keeps logging_steps as given."
        },
    )
    curriculum_chunks: list[int] | None = field(
        default=None,
        metadata={
            "help": "Length curriculum: chunk-count caps, one per stage, increasing (e.g. 1 2 4 8). Stage s "
            "trains on rows of at most curriculum_chunks[s] chunks; the last stage stays. None: no curriculum."
        },
    )
    curriculum_epochs_per_stage: int = field(
        default=1, metadata={"help": "Epochs spent in each curriculum stage before the next one."}
    )

    def __post_init__(self):
        if self.log_every_batches is not None:
            if self.log_every_batches < 1:
                raise ValueError(f"log_every_batches must be >= 1 (or None), got {self.log_every_batches}")
            self.logging_strategy = "steps"
            self.logging_steps = math.ceil(self.log_every_batches / self.gradient_accumulation_steps)
        if self.curriculum_chunks is not None:
            chunks = list(self.curriculum_chunks)
            if not chunks or chunks[0] < 1 or any(b <= a for a, b in zip(chunks, chunks[1:])):
                raise ValueError(
                    f"curriculum_chunks must be positive and strictly increasing, got {self.curriculum_chunks}"
                )
        if self.curriculum_epochs_per_stage < 1:
            raise ValueError(f"curriculum_epochs_per_stage must be >= 1, got {self.curriculum_epochs_per_stage}")
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available():
            # accelerate's multi-process launcher does not pass the config's `use_cpu` on; without it
            # every process would silently train alone instead of joining a gloo DDP group.
            self.use_cpu = True
        if self.push_to_hub:
            raise ValueError(
                "push_to_hub: the Trainer's push uploads full-model files; push the memory with "
                "`titans-hf push OUTPUT_DIR REPO_ID` (or model.push_memory_to_hub) instead"
            )
        super().__post_init__()


class ChunkCurriculumSampler(Sampler[int]):
    """Epoch-staged length curriculum, deterministic in (seed, epoch).

    RMT/ARMT learned BABILong only when trained on one segment first, then more. Epoch `e` is in
    stage `s = min(e // epochs_per_stage, last)` and draws from the rows of at most `stages[s]`
    chunks, reshuffled and cycled until the epoch holds `len(chunk_counts)` indices. A fixed epoch
    length keeps the Trainer's step arithmetic (steps per epoch, batches to skip on resume) valid,
    and an order that depends only on (seed, epoch) makes resume exact. Like `ResumableSampler` it
    is global: accelerate shards it across ranks.
    """

    def __init__(self, chunk_counts: Sequence[int], stages: Sequence[int], epochs_per_stage: int = 1, seed: int = 0):
        if not chunk_counts:
            raise ValueError("chunk_counts is empty: the curriculum needs at least one training row")
        counts = torch.as_tensor(list(chunk_counts), dtype=torch.long)
        self.pools = [torch.nonzero(counts <= cap).flatten() for cap in stages]
        for cap, pool in zip(stages, self.pools):
            if len(pool) == 0:
                raise ValueError(
                    f"curriculum stage of <= {cap} chunks has no training row (shortest row has {int(counts.min())} chunks)"
                )
        self.num_rows = len(counts)
        self.stages = list(stages)
        self.epochs_per_stage = epochs_per_stage
        self.seed = seed
        self.epoch = 0

    def stage(self, epoch: int) -> int:
        return min(epoch // self.epochs_per_stage, len(self.stages) - 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_rows

    def __iter__(self):
        pool = self.pools[self.stage(self.epoch)]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        rounds = math.ceil(self.num_rows / len(pool))
        order = torch.cat([pool[torch.randperm(len(pool), generator=generator)] for _ in range(rounds)])
        return iter(order[: self.num_rows].tolist())

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "stages": self.stages,
            "epochs_per_stage": self.epochs_per_stage,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["stages"], state["epochs_per_stage"], state["num_rows"])
        if saved != (self.stages, self.epochs_per_stage, self.num_rows):
            raise ValueError(
                f"checkpoint curriculum (stages, epochs per stage, rows) {saved} differs from "
                f"{(self.stages, self.epochs_per_stage, self.num_rows)}: resuming would not replay the same data"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]


def count_chunks(dataset, chunk_size: int) -> list[int]:
    """Chunks each row occupies once padded to a multiple of `chunk_size` (real tokens only)."""
    if isinstance(dataset, datasets.Dataset):
        # numpy format: a 32k-token mask is one array, not 32k Python ints
        masks = (
            mask
            for batch in dataset.select_columns(["attention_mask"]).with_format("numpy").iter(batch_size=64)
            for mask in batch["attention_mask"]
        )
    else:
        masks = (dataset[i]["attention_mask"] for i in range(len(dataset)))
    return [
        max(1, math.ceil(int(np.asarray(mask).sum()) / chunk_size))
        for mask in tqdm(masks, total=len(dataset), desc="Counting chunks per row", leave=False)
    ]


def trainable_parameter_names(model: nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def gather_trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full trainable weights on CPU (on rank 0 only under FSDP); frozen base weights are never gathered.

    A collective under FSDP: every rank must call it. `ignore_frozen_params` keeps the frozen base
    sharded, so a 7B base costs no gather; buffers, which it keeps, are dropped by name.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    trainable = trainable_parameter_names(model)
    return {
        name: tensor.detach().contiguous()
        for name, tensor in get_model_state_dict(model, options=options).items()
        if name in trainable
    }


def load_trainable_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Load exactly the trainable weights (sharding them under FSDP); any mismatch is an error naming `source`."""
    expected = trainable_parameter_names(model)
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{source}: trainable weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))


def gather_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full optimizer state keyed by parameter name (rank 0 only under FSDP); a collective under FSDP."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def _atomic_write(path: str, write) -> None:
    """Write through `write(tmp_path)` then rename, so an interrupted write never leaves `path` half-written."""
    tmp_path = f"{path}.tmp"
    write(tmp_path)
    os.replace(tmp_path, path)


def save_memory_folder(model: nn.Module, state_dict: dict[str, torch.Tensor], output_dir: str) -> None:
    """Write the trainable weights (and a TitansQwen's memory_config.json) that `from_base_and_memory` reads.

    A TitansQwen's memory goes to `memory_model.safetensors`; trainable base weights, if any, to
    `trainable_base_model.safetensors`. A model without a memory keeps all its trainable weights in the first.
    """
    os.makedirs(output_dir, exist_ok=True)
    if hasattr(model, "trainable_memory_state_dict"):
        memory_names = set(model.trainable_memory_state_dict())
    else:
        memory_names = set(state_dict)
    memory = {name: tensor for name, tensor in state_dict.items() if name in memory_names}
    base = {name: tensor for name, tensor in state_dict.items() if name not in memory_names}
    base_path = os.path.join(output_dir, TRAINABLE_BASE_WEIGHTS_NAME)
    if base:
        _atomic_write(base_path, lambda p: safetensors.torch.save_file(base, p, metadata={"format": "pt"}))
    elif os.path.exists(base_path):
        os.remove(base_path)  # left by an earlier save into the same folder: it would be loaded on resume
    if hasattr(model, "memory_config_dict"):
        text = json.dumps(model.memory_config_dict(), indent=2, sort_keys=True) + "\n"
        _atomic_write(os.path.join(output_dir, MEMORY_CONFIG_NAME), lambda p: Path(p).write_text(text))
    # The weights file goes last: its presence means the folder's memory is complete.
    _atomic_write(
        os.path.join(output_dir, MEMORY_WEIGHTS_NAME),
        lambda p: safetensors.torch.save_file(memory, p, metadata={"format": "pt"}),
    )


class TitansTrainer(Trainer):
    """Trainer for the memory of a frozen base: global resumable sampler, chunk-padding collator,
    memory-only checkpoints that resume exactly, a rank-0 log line.

    Works for any model whose frozen parameters are the base; only `requires_grad` parameters are
    checkpointed, so it does not depend on TitansQwen internals.
    """

    def __init__(self, model: nn.Module, args: TitansTrainingArguments, data_collator=None, **kwargs):
        if not isinstance(args, TitansTrainingArguments):
            raise ValueError(f"args must be TitansTrainingArguments, got {type(args).__name__}")
        if not trainable_parameter_names(model):
            raise ValueError("model has no trainable parameter: nothing for TitansTrainer to train or checkpoint")
        if data_collator is None:
            data_collator = TitansDataCollator(
                pad_token_id=_pad_token_id(model, kwargs.get("processing_class")),
                chunk_size=getattr(model.config, "chunk_size", None),
            )
        if args.curriculum_chunks is not None and getattr(data_collator, "chunk_size", None) is None:
            raise ValueError(
                "curriculum_chunks needs a chunk size: use a TitansQwen model (config.chunk_size) or pass a "
                "data_collator with chunk_size set"
            )
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self._train_sampler: ResumableSampler | ChunkCurriculumSampler | None = None

    # ---- data ----

    def _get_train_sampler(self, train_dataset=None) -> Sampler[int]:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        if self.args.curriculum_chunks is None:
            self._train_sampler = ResumableSampler(dataset, shuffle=True, seed=seed)
        else:
            self._train_sampler = ChunkCurriculumSampler(
                count_chunks(dataset, self.data_collator.chunk_size),
                self.args.curriculum_chunks,
                self.args.curriculum_epochs_per_stage,
                seed=seed,
            )
        return self._train_sampler

    def _run_epoch(self, model, epoch, train_dataloader, *args, **kwargs):
        # The Trainer reaches the sampler's set_epoch only through accelerate's loader wrappers; when
        # one of them does not forward it (seen after the resume skip, NOTES.md), a resumed epoch >= 1
        # replays epoch 0's order. Setting it here, before the loader is iterated, covers every path.
        sampler = self._train_sampler  # None for an IterableDataset, which has no sampler
        resume_from_checkpoint = kwargs.get("resume_from_checkpoint")
        if sampler is not None and resume_from_checkpoint is not None and epoch == kwargs.get("epochs_trained"):
            sampler_state = Path(resume_from_checkpoint, SAMPLER_STATE_NAME)
            if sampler_state.is_file():  # the saved seed wins over a changed --seed: same order as the run
                sampler.load_state_dict(json.loads(sampler_state.read_text()))
        if sampler is not None:
            sampler.set_epoch(epoch)
        if isinstance(sampler, ChunkCurriculumSampler) and self.is_world_process_zero():
            stage = sampler.stage(epoch)
            logger.info(
                "epoch %d: curriculum stage %d, rows of <= %d chunks (%d rows)",
                epoch,
                stage,
                sampler.stages[stage],
                len(sampler.pools[stage]),
            )
        return super()._run_epoch(model, epoch, train_dataloader, *args, **kwargs)

    # ---- logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        if self.is_world_process_zero():
            batches = self.state.global_step * self.args.gradient_accumulation_steps
            values = " | ".join(f"{key} {_format_value(value)}" for key, value in logs.items())
            logger.info("step %d | batches %d | %s", self.state.global_step, batches, values)

    # ---- saving ----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write only the trainable weights (the memory); every rank must call it under FSDP."""
        state_dict = gather_trainable_state_dict(self.model)
        self._save(output_dir, state_dict=state_dict)
        if not _internal_call and self.args.should_save:
            logger.info("Saved the memory to %s", output_dir if output_dir is not None else self.args.output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is None:
            state_dict = gather_trainable_state_dict(self.model)
        save_memory_folder(self.accelerator.unwrap_model(self.model), state_dict, output_dir)
        args_json = self.args.to_json_string()
        _atomic_write(os.path.join(output_dir, TRAINING_ARGS_JSON_NAME), lambda p: Path(p).write_text(args_json))

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """Assemble the checkpoint in `tmp-checkpoint-N`, rename to `checkpoint-N` once every rank is done.

        An interrupted save leaves only the staging folder, which resume and rotation ignore.
        """
        checkpoint_name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = self._get_output_dir(trial=trial)
        final_dir = os.path.join(run_dir, checkpoint_name)
        staging_dir = os.path.join(run_dir, f"{STAGING_PREFIX}-{self.state.global_step}")
        if self.args.should_save:
            shutil.rmtree(staging_dir, ignore_errors=True)
            os.makedirs(staging_dir)
        self.accelerator.wait_for_everyone()

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self.save_model(staging_dir, _internal_call=True)
        if self.state.best_global_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best_dir):
                self.state.best_model_checkpoint = best_dir
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(staging_dir)
            self._save_scaler(staging_dir)
            self._save_rng_state(staging_dir)

        if self.args.should_save:
            if self._train_sampler is not None:
                Path(staging_dir, SAMPLER_STATE_NAME).write_text(json.dumps(self._train_sampler.state_dict()))
            for callback in self.callback_handler.callbacks + [self.control]:
                if isinstance(callback, ExportableState):
                    name = callback.__class__.__name__
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(callback.state())
                    else:
                        self.state.stateful_callbacks[name] = callback.state()
            self.state.save_to_json(os.path.join(staging_dir, TRAINER_STATE_NAME))

        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if os.path.isdir(final_dir):
                shutil.rmtree(final_dir)
            os.rename(staging_dir, final_dir)
            logger.info("Saved checkpoint %s", final_dir)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.is_fsdp_enabled:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        # accelerate's FSDP optimizer save also writes a full-model pytorch_model_fsdp.bin: gather
        # the optimizer state alone, which covers only the trainable parameters.
        optimizer_state = gather_optimizer_state_dict(self.model, self.optimizer.optimizer)
        if self.args.should_save:
            torch.save(optimizer_state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ---- loading ----

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        weights_path = os.path.join(resume_from_checkpoint, MEMORY_WEIGHTS_NAME)
        if not os.path.isfile(weights_path):
            raise FileNotFoundError(
                f"{weights_path} not found: {resume_from_checkpoint} is not a complete TitansTrainer checkpoint"
            )
        state_dict = safetensors.torch.load_file(weights_path, device="cpu")
        base_path = os.path.join(resume_from_checkpoint, TRAINABLE_BASE_WEIGHTS_NAME)
        if os.path.isfile(base_path):
            state_dict.update(safetensors.torch.load_file(base_path, device="cpu"))
        load_trainable_state_dict(model if model is not None else self.model, state_dict, weights_path)

    def _load_best_model(self) -> None:
        logger.info("Loading best memory from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self.is_fsdp_enabled:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer_state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
        load_optimizer_state_dict(self.model, self.optimizer.optimizer, optimizer_state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _pad_token_id(model: nn.Module, tokenizer) -> int:
    """Pad id for the collator: the tokenizer's pad, else its EOS (Qwen base tokenizers), else the config's."""
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "pad_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(candidate, int):
            return candidate
    raise ValueError("no pad token id: pass a processing_class with a pad or EOS token, or a data_collator")


def _format_value(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
