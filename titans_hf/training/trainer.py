"""`TitansTrainer`: a `transformers.Trainer` that trains, checkpoints, resumes and pushes only the memory.

The base Qwen stays frozen, so a checkpoint holds the trainable weights (`memory_model.safetensors` plus
`memory_config.json`; with a LoRA of the base, `titans_hf.lora`, PEFT's adapter files beside them), optimizer,
scheduler, RNG, trainer and sampler state, the tokenizer and the training arguments: megabytes instead of the
gigabytes of a full-model checkpoint (`titans_hf.training.checkpointing`). Everything else is the stock Trainer,
launched as a single process or with `accelerate launch --config_file titans_hf/accelerate/*.yaml`. The overrides
are the Trainer's saving, loading and pushing hooks (`save_model`, `_save`, `_save_checkpoint`,
`_load_from_checkpoint`, `push_to_hub`, ...) and its sampler hook, each calling the Trainer's own code where it has
any; the sampler follows the epochs through a callback (`SamplerStateCallback`), and the memory states State
Passing carries are saved into each checkpoint and resumed from through another (`PassedStatesCallback`), on the
Trainer's public events. `check_trainer_internals` names every private member of the Trainer relied on, and fails
loudly when a transformers release moves one. A step whose loss or gradients are not finite stops the run before
anything is saved from it (`FiniteSteps`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from accelerate.utils import TorchDynamoPlugin
from torch import nn
from torch.utils.data import Sampler
from transformers import EvalPrediction, Trainer
from transformers import trainer as hf_trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy

from titans_hf.data.collator import CompletionsCollator, TitansDataCollator
from titans_hf.data.sampler import ChunkCurriculumSampler, ResumableSampler, count_chunks
from titans_hf.data.tokenizers import resolve_pad_token_id
from titans_hf.files import atomic_write_json, disk_full_message
from titans_hf.hub import push_memory_folder
from titans_hf.modeling.memory import MemoryState
from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MEMORY_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    MODEL_CONFIG_NAME,
    TRAINABLE_BASE_WEIGHTS_NAME,
    save_memory_folder,
)
from titans_hf.outputs import MANIFEST_NAME, read_manifest, record_outputs, unrecorded_reason

from .callbacks import PassedStatesCallback, SamplerStateCallback
from .checkpointing import (
    TRAINING_ARGS_JSON_NAME,
    check_resume,
    checkpoint_problem,
    gather_optimizer_state_dict,
    gather_trainable_state_dict,
    last_complete_checkpoint,
    load_memory_checkpoint,
    load_optimizer_state_dict,
    refuse_earlier_checkpoints,
    trainable_parameter_names,
    unreadable_file,
    warn_about_changed_arguments,
)
from .preference import COMPLETION_COLUMNS, completions_loss
from .training_args import TitansTrainingArguments
from .training_lock import training_lock

logger = logging.getLogger(__name__)

# The private members of `transformers.Trainer` relied on, each with the parameters it takes (less `self`): the hooks
# overridden by `TitansTrainer`, `CompiledChunks` and the TRL trainers' `MemoryCheckpoints`, the methods called
# (`_get_output_dir`, `_prepare_inputs`), and `save_model`'s `_internal_call`, with which the Trainer saves a
# checkpoint's weights.
TRAINER_INTERNALS: dict[str, tuple[str, ...]] = {
    "_build_accelerator_args": ("kwargs",),
    "_get_train_sampler": ("train_dataset",),
    "_set_signature_columns_if_needed": (),
    "_save": ("output_dir", "state_dict"),
    "_save_checkpoint": ("model", "trial"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_push_from_checkpoint": ("checkpoint_folder",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_get_output_dir": ("trial",),
    "_prepare_inputs": ("inputs",),
    "save_model": ("output_dir", "_internal_call"),
}
# The private attributes of a Trainer read, each with the Trainer method that sets it.
TRAINER_ATTRIBUTES = {"_signature_columns": "_set_signature_columns_if_needed"}
# The names of the Trainer's checkpoint files, read from `transformers.trainer`.
TRAINER_CONSTANTS = ("OPTIMIZER_NAME", "SCHEDULER_NAME", "TRAINER_STATE_NAME")


def check_trainer_internals() -> None:
    """The private members of `transformers.Trainer` that `TitansTrainer` relies on (`TRAINER_INTERNALS`,
    `TRAINER_ATTRIBUTES`, `TRAINER_CONSTANTS`) are where they were, taking the parameters they took; a RuntimeError
    naming each one that moved, when one did. `TitansTrainer` calls it when it is constructed."""
    problems = []
    for name, parameters in TRAINER_INTERNALS.items():
        member = getattr(Trainer, name, None)
        if not callable(member):
            problems.append(f"transformers.Trainer.{name} is gone")
            continue
        taken = tuple(inspect.signature(member).parameters)[1:]
        if taken != parameters:
            problems.append(f"transformers.Trainer.{name} takes ({', '.join(taken)}), not ({', '.join(parameters)})")
    for attribute, setter in TRAINER_ATTRIBUTES.items():
        code = getattr(getattr(Trainer, setter, None), "__code__", None)
        if code is None or attribute not in code.co_names:
            problems.append(f"transformers.Trainer.{setter} no longer sets self.{attribute}")
    for name in TRAINER_CONSTANTS:
        if not isinstance(getattr(hf_trainer, name, None), str):
            problems.append(f"transformers.trainer.{name} is gone")
    if problems:
        raise RuntimeError(f"titans_hf's TitansTrainer relies on private members of transformers.Trainer that "
                           f"transformers {transformers.__version__} moved: " + "; ".join(problems))


def answer_exact_match(prediction: EvalPrediction) -> dict[str, float]:
    """`compute_metrics` for rows whose labelled tokens are an answer (BABILong): the share of rows whose every
    labelled token is the model's greedy prediction, i.e. whose greedy answer begins with exactly those tokens.
    Reads `label_predictions` (what `TitansTrainer.prediction_step` gathers from a TitansQwen)."""
    predictions, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    labelled = labels != -100
    rows = labelled.any(axis=1)
    right = ((predictions == labels) | ~labelled).all(axis=1)
    return {"exact_match": float(right[rows].mean()) if rows.any() else float("nan")}



def passed_memory_states(fresh: dict[int, MemoryState], passed: dict[int, MemoryState] | None,
                         share: float) -> dict[int, MemoryState]:
    """The states a micro-batch starts from under State Passing: for each row, with probability `share` (drawn from
    torch's global generator, which checkpoints save and restore), the weights and momentum the row in its place
    of the previous micro-batch ended with (`passed`, detached); else `fresh`'s. Rows the previous micro-batch did
    not have start fresh. Everything else (convolution tail, position) is `fresh`'s: a new row starts a new text."""
    if passed is None:
        return fresh
    rows = next(iter(fresh.values())).batch_size
    take = torch.rand(rows) < share
    take[min(rows, next(iter(passed.values())).batch_size):] = False
    if not bool(take.any()):
        return fresh

    return {layer: state.with_rows_from(passed[layer], take) for layer, state in fresh.items()}


class CompiledChunks:
    """A Trainer hook (TitansTrainer's and the TRL trainers'): `torch_compile` (with `torch_compile_backend` /
    `torch_compile_mode`) compiles a TitansQwen's chunk step (`compile_chunks`) and hands accelerate no dynamo
    plugin, which would compile the whole forward: its chunk loop unrolled, broken at every read of a tensor's value.
    `_build_accelerator_args` is a private hook of the Trainer, which calls it once `self.model` is set:
    tests/test_compile.py fails if it is no longer called."""

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile and hasattr(self.model, "compile_chunks"):
            mode = {"mode": self.args.torch_compile_mode} if self.args.torch_compile_mode else {}
            self.model.compile_chunks(backend=self.args.torch_compile_backend, **mode)
            accelerator_args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return accelerator_args


class FiniteSteps:
    """A Trainer hook (TitansTrainer's and the TRL trainers'): a step whose loss or gradients are not finite stops the
    run with a ValueError naming the step and what was not finite, after its backward and before the optimizer
    applies it, so no checkpoint and no final memory is ever written from weights a NaN reached (a checkpoint of an
    earlier step stays: it is valid). The Trainer alone goes on: it logs a non-finite loss as the mean of the earlier
    ones, and the optimizer turns NaN gradients into NaN weights, which every loader then refuses.

    The public `training_step` is overridden: each micro-batch's loss is checked as it comes back (the Trainer reads
    it on the host anyway); at the step's last micro-batch, when the gradients are complete (and reduced across
    processes), so are the trainable parameters' gradients, in one read of the device. The verdict is summed over
    processes, so that all of them stop at the same step (under FSDP each holds a shard of the gradients)."""

    _step_problem: str | None = None  # what the micro-batches of the current step found not finite

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._step_problem is None and not bool(torch.isfinite(loss).all()):
            self._step_problem = f"the loss is {loss.float().max().item()}, not a finite number"
        if self.accelerator.sync_gradients:
            problem, self._step_problem = self._step_problem or self._gradient_problem(), None
            stopped = self.accelerator.reduce(torch.tensor(float(problem is not None), device=self.args.device))
            if stopped.item():
                raise ValueError(f"step {self.state.global_step + 1}: "
                                 f"{problem or 'another process found a loss or gradients that are not finite'}; the "
                                 "run stops before the optimizer applies it, so nothing is saved from this step on "
                                 "(check this step's rows, e.g. rewards or labels, or lower the learning rate)")
        return loss

    def _gradient_problem(self) -> str | None:
        """Which trainable parameters' gradients hold NaN or infinite values (this process's shards), or None."""
        named = [(name, param.grad) for name, param in self.model.named_parameters() if param.grad is not None]
        if not named:
            return None
        local = [grad.to_local() if hasattr(grad, "to_local") else grad for _, grad in named]  # an FSDP2 DTensor
        flags = torch.stack([torch.isfinite(grad).all().to(local[0].device) for grad in local]).tolist()
        bad = [name for (name, _), finite in zip(named, flags) if not finite]
        if not bad:
            return None
        more = f" (and those of {len(bad) - 1} more parameters)" if len(bad) > 1 else ""
        return f"the gradient of {bad[0]} holds nan or infinite values{more}"


class TitansTrainer(FiniteSteps, CompiledChunks, Trainer):
    """Trainer for the memory of a frozen base: global resumable sampler (or length curriculum), chunk-padding
    collator, memory-only checkpoints that resume exactly, memory-only pushes with a model card.

    Works for any model whose frozen parameters are the base; only `requires_grad` parameters are
    checkpointed. A model with a `config.memory_config` (a TitansQwen) gets it written beside its weights. dpo and
    grpo rows (a prompt and a group of completions each) train with the losses of `titans_hf.training.preference`.
    `train_sampling_strategy="group_by_length"` gives each step rows of one chunk count where it can (a batch is
    padded to its longest row), with or without the curriculum; other strategies draw a seeded random order.

    Args:
        model (`nn.Module`):
            The model to train: a `TitansQwenForCausalLM` (with a LoRA of its base put on in place by
            `titans_hf.lora.add_lora`, if any), or any model whose trainable parameters are what to train and
            checkpoint. A `peft.get_peft_model` wrapper around a TitansQwen is refused: PEFT froze its memory.
        args (`TitansTrainingArguments`):
            The training arguments; plain `TrainingArguments` are refused.
        data_collator (`Callable`, *optional*, defaults to `None`):
            What batches the rows. None: a `TitansDataCollator` for windows, or a `CompletionsCollator` when
            `train_dataset` holds dpo or grpo rows (a `prompt_ids` column), its pad id from `processing_class` (else
            the model's config) and its chunk size from the model's `memory_config`. A length curriculum needs a
            collator with a `chunk_size`.
        **kwargs:
            The other arguments of `transformers.Trainer` (`train_dataset`, `eval_dataset`, `processing_class`,
            `compute_metrics`, `callbacks`, ...), passed on as they are. `compute_metrics=answer_exact_match` reports
            the exact match of the labelled answers from the greedy predictions a TitansQwen returns.
    """

    def __init__(self, model: nn.Module, args: TitansTrainingArguments, data_collator=None, **kwargs):
        check_trainer_internals()
        if not isinstance(args, TitansTrainingArguments):
            raise ValueError(f"args must be TitansTrainingArguments, got {type(args).__name__}")
        if type(model).__module__.startswith("peft.") and hasattr(getattr(model, "config", None), "memory_config"):
            raise ValueError(f"model is a {type(model).__name__} (peft.get_peft_model) around a TitansQwen: PEFT froze "
                             "its memory and would save the adapter alone; put the LoRA on the model in place instead, "
                             "titans_hf.lora.add_lora(model, LoraConfig(...)), which trains and saves both")
        if not trainable_parameter_names(model):
            raise ValueError("model has no trainable parameter: nothing for TitansTrainer to train or checkpoint")
        if args.frozen_trunk_cache_gb > 0:
            if not hasattr(model, "cache_frozen_trunk"):
                raise ValueError("frozen_trunk_cache_gb keeps the frozen trunk of a TitansQwenForCausalLM "
                                 f"(cache_frozen_trunk); got a {type(model).__name__}")
            model.cache_frozen_trunk(max_bytes=max(1, int(args.frozen_trunk_cache_gb * 2**30)))
        memory_config = getattr(model.config, "memory_config", None)
        completions = COMPLETION_COLUMNS[0] in (getattr(kwargs.get("train_dataset"), "column_names", None) or [])
        if data_collator is None:
            collator = CompletionsCollator if completions else TitansDataCollator
            data_collator = collator(
                pad_token_id=resolve_pad_token_id(kwargs.get("processing_class"), model.config.get_text_config()),
                chunk_size=getattr(memory_config, "chunk_size", None),
            )
        if completions and args.curriculum_chunks is not None:
            raise ValueError("curriculum_chunks counts the chunks of windows; dpo and grpo rows take no curriculum")
        grouped = args.train_sampling_strategy == "group_by_length"
        if completions and grouped:
            raise ValueError("train_sampling_strategy='group_by_length' groups windows by chunk count; dpo and grpo "
                             "rows are not grouped")
        if (args.curriculum_chunks is not None or grouped) and getattr(data_collator, "chunk_size", None) is None:
            option = "curriculum_chunks" if args.curriculum_chunks is not None else "group_by_length"
            raise ValueError(
                f"{option} needs a chunk size: use a TitansQwen model (memory_config.chunk_size) or pass a "
                "data_collator with chunk_size set"
            )
        if args.state_passing and not hasattr(model, "init_memory_states"):
            raise ValueError("state_passing carries a TitansQwen memory's state from row to row; this model has none")
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self._write_rates: list[torch.Tensor] = []  # the training batches' since the last log
        self._write_cost: float | None = None  # the write cost's weight the last training batch was given
        self._sampler_state = SamplerStateCallback()
        self.add_callback(self._sampler_state)
        self._passed_states = PassedStatesCallback()
        # first of the callbacks, so that every other one's on_save finds the checkpoint whole
        self.callback_handler.callbacks.insert(0, self._passed_states)

    # ---- data ----

    def _get_train_sampler(self, train_dataset=None) -> Sampler[int]:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        grouped = self.args.train_sampling_strategy == "group_by_length"
        if self.args.curriculum_chunks is None and not grouped:
            sampler = ResumableSampler(dataset, shuffle=True, seed=seed)
        else:
            # group_by_length: each step's rows (on all ranks) share a chunk count; no curriculum is one stage
            counts = count_chunks(dataset, self.data_collator.chunk_size)
            sampler = ChunkCurriculumSampler(
                counts,
                self.args.curriculum_chunks or [max(counts)],
                self.args.curriculum_epochs_per_stage,
                seed=seed,
                group_size=self.args.per_device_train_batch_size * self.args.world_size if grouped else None,
            )
        self._sampler_state.sampler = sampler
        return sampler

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns, *COMPLETION_COLUMNS]

    # ---- dpo and grpo rows: one prompt, a group of completions ----

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: int | torch.Tensor | None = None):
        """The Trainer's loss for windows (a TitansQwen's write cost weighed as `write_cost_growth` schedules it, the
        batch's `write_rate` kept for the next log; with State Passing, some rows start from the states earlier rows
        ended in); for batches of a `CompletionsCollator` (dpo and grpo rows) the loss of `completions_loss`, every
        completion scored from the memory state its prompt left."""
        titans = self.accelerator.unwrap_model(model)
        if "completion_ids" in inputs:
            loss = completions_loss(model, inputs, self.args.dpo_beta, titans=titans)
            return (loss, None) if return_outputs else loss
        memory_config = getattr(titans.config, "memory_config", None)
        if model.training and memory_config is not None:
            progress = self.state.global_step / max(self.state.max_steps, 1)
            self._write_cost = memory_config.write_cost * self.args.write_cost_factor(progress)
            inputs = {**inputs, "write_cost": self._write_cost}
        if self.args.state_passing and model.training:
            rows = inputs["input_ids"].shape[0]
            fresh = titans.init_memory_states(rows, inputs["input_ids"].device)
            starting = passed_memory_states(fresh, self._passed_states.states, self.args.state_passing)
            loss, outputs = super().compute_loss(model, {**inputs, "memory_states": starting}, True,
                                                 num_items_in_batch)
            self._passed_states.states = {layer: state.detach() for layer, state in outputs.memory_states.items()}
        else:
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        write_rate = getattr(outputs, "write_rate", None)
        if model.training and write_rate is not None:
            self._write_rates.append(write_rate.detach())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log; a training log also gets `write_rate`, the memory's mean write (theta / max_lr, what the
        write cost weighs) over the batches since the last one, averaged over processes as the Trainer averages the
        loss (each process's mean, then their mean), and `write_cost`, the weight the last of them was given. Every
        process logs a training log, so the average is a collective they all reach."""
        if self._write_rates and "loss" in logs:
            rate = self.accelerator.reduce(torch.stack(self._write_rates).mean(), reduction="mean")
            logs = {**logs, "write_rate": round(rate.item(), 6)}
            if self._write_cost is not None:
                logs["write_cost"] = round(self._write_cost, 6)
            self._write_rates = []
        super().log(logs, start_time)

    # ---- evaluation ----

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The Trainer's step; for `compute_metrics`, a TitansQwen returns the greedy prediction of every labelled
        token (`label_predictions`) in place of logits, which for a 32k-token row are what chunking avoids. dpo and
        grpo rows give their loss alone."""
        if "completion_ids" in inputs:  # dpo and grpo rows: their loss, nothing to predict
            with torch.no_grad():
                loss = self.compute_loss(model, self._prepare_inputs(inputs))
            return loss.detach(), None, None
        forward = getattr(self.accelerator.unwrap_model(model), "forward", None)
        if not prediction_loss_only and "return_predictions" in inspect.signature(forward).parameters:
            inputs = {**inputs, "return_predictions": True}
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    # ---- training ----

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` takes the newest *complete* checkpoint (saying which
        incomplete ones it passed over), and an explicit checkpoint that is incomplete is refused, naming why. A
        resume reads and checks, before training, what the checkpoint holds beside the Trainer's files (`check_resume`,
        the memory states State Passing passes on, `PassedStatesCallback.resume_from`, and the sampler's state). The
        main process holds the training lock of output_dir for the whole run (`training_lock`)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        elif resume_from_checkpoint:
            problem = checkpoint_problem(resume_from_checkpoint)
            if problem is not None:
                raise ValueError(f"cannot resume from {resume_from_checkpoint}: {problem}")
        if resume_from_checkpoint:
            main_process = self.is_world_process_zero()
            check_resume(Path(resume_from_checkpoint), self.args, self.accelerator.unwrap_model(self.model),
                         self.train_dataset, main_process)
            warn_about_changed_arguments(Path(resume_from_checkpoint), self.args, main_process)
        self._passed_states.resume_from(resume_from_checkpoint or None, self.args,
                                        self.accelerator.unwrap_model(self.model))
        self._sampler_state.resume_from(resume_from_checkpoint or None)
        with training_lock(self.args.output_dir) if self.is_world_process_zero() else contextlib.nullcontext():
            if not resume_from_checkpoint and self.args.save_strategy != "no":
                refuse_earlier_checkpoints(self.args.output_dir)
            self._check_final_save_outputs(fresh=not resume_from_checkpoint)
            return super().train(resume_from_checkpoint, *args, **kwargs)

    @functools.cached_property
    def _final_save_names(self) -> list[str]:
        """The names of the files the final save writes into output_dir: the memory folder's, the training
        arguments' and the tokenizer's (learnt once by saving it into a scratch folder)."""
        names = [TRAINING_ARGS_JSON_NAME, MEMORY_CONFIG_NAME, MODEL_CONFIG_NAME, MEMORY_WEIGHTS_NAME,
                 TRAINABLE_BASE_WEIGHTS_NAME, ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME]
        if self.processing_class is not None:
            with tempfile.TemporaryDirectory() as scratch:
                self.processing_class.save_pretrained(scratch)
                names += sorted(os.listdir(scratch))
        return list(dict.fromkeys(names))

    def _check_final_save_outputs(self, fresh: bool) -> None:
        """Refuse, before training, a final save that would replace a file in output_dir that titans_hf did not
        write there (a user's `tokenizer.json`, say), or, for a fresh run without `overwrite_output_dir`, the memory
        an earlier run saved there (every rank checks)."""
        folder = Path(self.args.output_dir)
        present = [path for path in (folder / name for name in self._final_save_names)
                   if path.exists() or path.is_symlink()]
        if (folder / MANIFEST_NAME).is_file() and present and read_manifest(folder) == {"whole": None, "files": {}}:
            raise FileExistsError(
                f"output_dir {folder}: the memory saved at the end of training would replace "
                f"{', '.join(path.name for path in present)}, and {folder / MANIFEST_NAME}, the record of what "
                "titans_hf wrote there, vouches for none of them: it holds the inode of the folder it was written in, "
                "and this folder is another (a copy of a run's output_dir, e.g. by cp -r) or the record is "
                "unreadable; resume into a new output_dir (--output_dir, with --resume_from_checkpoint naming the "
                "checkpoint), or delete those files from this folder first")
        for path in present:
            problem = unrecorded_reason(path)
            if problem is not None:
                raise FileExistsError(f"output_dir {folder}: the memory saved at the end of training would replace "
                                      f"{path}, and {problem}: move it, or choose another output_dir")
            if fresh and path.name == MEMORY_WEIGHTS_NAME and not self.args.overwrite_output_dir:
                raise FileExistsError(f"output_dir {folder} holds the memory an earlier run saved ({path}), which "
                                      "this fresh run would replace: pass overwrite_output_dir "
                                      "(--overwrite_output_dir) or choose another output_dir")

    # ---- saving ----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write only the trainable weights (the memory); every rank must call it under FSDP."""
        state_dict = gather_trainable_state_dict(self.model)
        self._save(output_dir, state_dict=state_dict)
        if not _internal_call and self.args.should_save:
            logger.info("Saved the memory to %s", output_dir if output_dir is not None else self.args.output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The memory folder (weights, config), the tokenizer and the training arguments."""
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is None:
            state_dict = gather_trainable_state_dict(self.model)
        model = self.accelerator.unwrap_model(self.model)
        # {parameter name: key in the memory file} of the memory's weights (a TitansQwen's sit in its decoder)
        memory_keys = ({name: key for key, name in model.memory_parameter_names().items()}
                       if hasattr(model, "memory_parameter_names") else {name: name for name in state_dict})
        adapter = None
        if getattr(model, "peft_config", None):  # a LoRA of the base trained with the memory: PEFT's files beside it
            from titans_hf.lora import adapter_files, is_lora_parameter

            adapter = adapter_files(model, state_dict, folder=output_dir)
            state_dict = {name: tensor for name, tensor in state_dict.items() if not is_lora_parameter(name)}
        memory_tensors = {memory_keys[name]: tensor for name, tensor in state_dict.items() if name in memory_keys}
        base_tensors = {name: tensor for name, tensor in state_dict.items() if name not in memory_keys}
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        atomic_write_json(Path(output_dir, TRAINING_ARGS_JSON_NAME),
                          {**json.loads(self.args.to_json_string()), "world_size": self.args.world_size})
        model_config = model.memory_folder_config() if hasattr(model, "memory_folder_config") else None
        memory_config = getattr(model.config, "memory_config", None)
        save_memory_folder(output_dir, None if memory_config is None else memory_config.to_dict(), memory_tensors,
                           base_tensors, model_config, adapter=adapter)
        if Path(output_dir).resolve() == Path(self.args.output_dir).resolve():  # the final save, not a checkpoint
            folder = Path(output_dir)
            record_outputs(folder, [name for name in self._final_save_names if (folder / name).is_file()],
                           "titans-hf train")

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """The Trainer's checkpoint plus the sampler's state, into a fresh folder: what a save that was cut short
        left there is removed first, so none of its files can pass for part of the new checkpoint. (The memory states
        of State Passing follow, written by `PassedStatesCallback.on_save`.)"""
        folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            self._sampler_state.save(folder)
        self.accelerator.wait_for_everyone()
        try:
            super()._save_checkpoint(model, trial)
        except OSError as error:
            message = disk_full_message(error, f"checkpoint {folder}")
            if message is None:
                raise
            if self.args.should_save:
                shutil.rmtree(folder, ignore_errors=True)  # a cut-short checkpoint must not be resumed from
            raise OSError(error.errno, message) from error

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.is_fsdp_enabled:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        # accelerate's FSDP optimizer save also writes a full-model pytorch_model_fsdp.bin: gather
        # the optimizer state alone, which covers only the trainable parameters.
        optimizer_state = gather_optimizer_state_dict(self.model, self.optimizer.optimizer)
        if self.args.should_save:
            torch.save(optimizer_state, os.path.join(output_dir, hf_trainer.OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, hf_trainer.SCHEDULER_NAME))

    # ---- pushing ----

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **kwargs: Any) -> str | None:
        """Save the memory into `output_dir` and push it with its model card (memory weights, config, README.md;
        see `titans_hf.hub.push_memory_folder`) to `hub_model_id`. `kwargs` may hold `results` (a
        `titans-hf eval` results dict), `base_model` and `base_revision` (the base's Hub id when it was loaded
        from a local folder; default `hub_base_model`). Returns the commit URL on the main process."""
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        return self._push_memory(self.args.output_dir, commit_message, token=token, private=private, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """During training (`hub_strategy` other than "end"): push the checkpoint's memory, and nothing else."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        self._push_memory(checkpoint_folder, f"Training in progress, step {self.state.global_step}")

    def _push_memory(self, folder: str, commit_message: str | None, token: str | None = None,
                     private: bool | None = None, results: dict | None = None, base_model: str | None = None,
                     base_revision: str | None = None) -> str:
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        return push_memory_folder(
            folder, repo_id, token=token if token is not None else self.args.hub_token,
            private=self.args.hub_private_repo if private is None else private, commit_message=commit_message,
            results=results, datasets=self.args.hub_dataset_ids, base_model=base_model or self.args.hub_base_model,
            revision=base_revision,
            check_weights=getattr(self.accelerator.unwrap_model(self.model), "check_memory_weights", None),
        )

    # ---- loading ----

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        load_memory_checkpoint(model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        logger.info("Loading best memory from %s (score: %s).", self.state.best_model_checkpoint,
                    self.state.best_metric)
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        names = (hf_trainer.OPTIMIZER_NAME, hf_trainer.SCHEDULER_NAME)
        try:
            if checkpoint is None or not self.is_fsdp_enabled:
                super()._load_optimizer_and_scheduler(checkpoint)
                return
            optimizer_state = torch.load(os.path.join(checkpoint, names[0]), map_location="cpu", weights_only=True)
            load_optimizer_state_dict(self.model, self.optimizer.optimizer, optimizer_state)
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, names[1]), weights_only=True))
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, KeyError, ValueError) as error:
            raise ValueError(f"{unreadable_file(checkpoint, names)}: cannot be loaded into this run's optimizer and "
                             f"scheduler ({error})") from error

    def _load_rng_state(self, checkpoint: str | None) -> None:
        try:
            super()._load_rng_state(checkpoint)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as error:
            names = (f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth",)
            raise ValueError(f"{unreadable_file(checkpoint, names)}: not a random number generator state "
                             f"({error})") from error
