"""`TitansTrainer`: a `transformers.Trainer` that trains, checkpoints, resumes and pushes only the memory.

The base Qwen stays frozen, so a checkpoint holds the trainable weights (`memory_model.safetensors` plus
`memory_config.json`; with a LoRA of the base, `titans_hf.lora`, PEFT's adapter files beside them), optimizer,
scheduler, RNG, trainer and sampler state, the tokenizer and the training arguments: megabytes instead of the
gigabytes of a full-model checkpoint. Everything else is the stock Trainer, launched as a single process or with
`accelerate launch --config_file titans_hf/accelerate/*.yaml`; the overrides are the Trainer's saving, loading and
pushing hooks (`save_model`, `_save`, `_load_from_checkpoint`, `push_to_hub`), its sampler hook and the per-epoch
sampler position, each calling the Trainer's own code where it has any. A step whose loss or gradients are not finite
stops the run before anything is saved from it (`FiniteSteps`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import inspect
import json
import logging
import math
import os
import pickle
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import TorchDynamoPlugin, extract_model_from_parallel
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Sampler
from transformers import EvalPrediction, Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy

from titans_hf.data.collator import CompletionsCollator, TitansDataCollator
from titans_hf.data.sampler import ChunkCurriculumSampler, ResumableSampler, count_chunks
from titans_hf.data.tokenizers import resolve_pad_token_id
from titans_hf.files import atomic_write, atomic_write_json, disk_full_message
from titans_hf.hub import push_memory_folder
from titans_hf.modeling.configuration_titans_qwen import read_memory_config
from titans_hf.modeling.memory import MemoryState
from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MEMORY_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    MODEL_CONFIG_NAME,
    TRAINABLE_BASE_WEIGHTS_NAME,
    load_memory_weights,
    save_memory_folder,
)
from titans_hf.outputs import record_outputs, unrecorded_reason

from .training_args import TitansTrainingArguments

logger = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "sampler_state.json"
PASSED_STATES_NAME = "passed_memory_states.safetensors"  # with several processes, one file each: _{rank} before .
LOCK_NAME = ".titans_hf_train.lock"
TRAINING_ARGS_JSON_NAME = "training_args.json"
# Settings that make a resumed run another run when they change (the global batch among them).
RESUME_SETTINGS = (
    "learning_rate", "gradient_accumulation_steps", "per_device_train_batch_size", "world_size", "num_train_epochs",
    "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "seed", "data_seed", "bf16", "fp16",
    "curriculum_chunks", "curriculum_epochs_per_stage",
)


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
    """Load exactly the trainable weights (sharding them under FSDP); any mismatch of names or shapes, and weights
    that are not finite, are errors naming `source`."""
    expected = trainable_parameter_names(model)
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{source}: trainable weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters() if name in expected}
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != shapes[name] and tensor.numel() != math.prod(shapes[name]):
            raise ValueError(f"{source}: {name} is {tuple(tensor.shape)}, this model's is {shapes[name]} (other "
                             "memory settings, e.g. memory_head_dim, than the checkpoint's)")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: {name} holds NaN or infinite values; the checkpoint is broken (a diverged "
                             "run), not resumed from")
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))


def load_memory_checkpoint(model: nn.Module, folder: str | os.PathLike) -> None:
    """The trainable weights of a memory-only checkpoint (`memory_model.safetensors`, plus the trainable base
    weights when the base trains too) into `model`, as resuming needs them."""
    weights_path = Path(folder, MEMORY_WEIGHTS_NAME)
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found: {folder} is not a complete memory checkpoint")
    unwrapped = extract_model_from_parallel(model)
    # the memory file's keys as the model's parameter names (a TitansQwen's memory sits in its decoder)
    names = unwrapped.memory_parameter_names() if hasattr(unwrapped, "memory_parameter_names") else {}
    state_dict = {names.get(key, key): tensor for key, tensor in load_memory_weights(weights_path).items()}
    base_path = Path(folder, TRAINABLE_BASE_WEIGHTS_NAME)
    if base_path.is_file():
        state_dict.update(load_memory_weights(base_path))
    adapter_path = Path(folder, ADAPTER_WEIGHTS_NAME)
    if getattr(unwrapped, "peft_config", None):
        from titans_hf.lora import adapter_state_dict

        if not adapter_path.is_file():
            raise FileNotFoundError(f"{adapter_path} not found: the model holds a LoRA adapter, and {folder} is the "
                                    "checkpoint of a model without one")
        state_dict.update(adapter_state_dict(unwrapped, adapter_path))
    elif adapter_path.is_file():
        raise ValueError(f"cannot load {folder}: it holds a LoRA adapter ({adapter_path}), this model none; put it "
                         "on with titans_hf.lora.add_lora first")
    load_trainable_state_dict(model, state_dict, str(weights_path))


def gather_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full optimizer state keyed by parameter name (rank 0 only under FSDP); a collective under FSDP."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def answer_exact_match(prediction: EvalPrediction) -> dict[str, float]:
    """`compute_metrics` for rows whose labelled tokens are an answer (BABILong): the share of rows whose every
    labelled token is the model's greedy prediction, i.e. whose greedy answer begins with exactly those tokens.
    Reads `label_predictions` (what `TitansTrainer.prediction_step` gathers from a TitansQwen)."""
    predictions, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    labelled = labels != -100
    rows = labelled.any(axis=1)
    right = ((predictions == labels) | ~labelled).all(axis=1)
    return {"exact_match": float(right[rows].mean()) if rows.any() else float("nan")}


# what a CompletionsCollator batch (dpo and grpo rows) carries into compute_loss
COMPLETION_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "completion_ids", "completion_mask", "rewards")


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's advantages [B, G]: each reward less its group's mean, over the group's standard deviation (+1e-4, as
    TRL); 0 for a group of one, or of equal rewards."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    return centred / (rewards.std(dim=1, keepdim=True) + 1e-4)


def _keep_frozen_fsdp_units_gathered(titans: nn.Module) -> None:
    """Under FSDP2, keep the units below the root (the base's decoder layers) gathered from backward to the next
    forward, which reshards them. With attend_previous_chunk the completions attend to the prompt's last chunk
    through the cache, so that chunk's layer calls get gradient after the completions' layer calls, at whose end of
    backward FSDP2 would free the layer's weights. Frozen units never change, so keeping them is exact; a trainable
    one (a LoRA on the layer) would keep its pre-step weights, so it is refused."""
    if not isinstance(titans, FSDPModule):  # not sharded (accelerate's FSDP2 always shards the root): nothing to do
        return
    units = [module for module in titans.modules() if isinstance(module, FSDPModule) and module is not titans]
    trainable = [type(unit).__name__ for unit in units if any(p.requires_grad for p in unit.parameters())]
    if trainable:
        raise ValueError("dpo / grpo rows under FSDP2 with attend_previous_chunk=True cannot train sharded base "
                         f"layers ({trainable[0]} holds trainable weights, e.g. a LoRA): the answers attend to the "
                         "prompt's last chunk, whose layers FSDP2 would free before backward is done with them. "
                         "Use DDP (titans_hf/accelerate/ddp.yaml), or a memory with attend_previous_chunk=False")
    for unit in units:
        unit.set_reshard_after_backward(False, recurse=False)


def completions_loss(model: nn.Module, inputs: dict[str, torch.Tensor], dpo_beta: float,
                     titans: nn.Module | None = None) -> torch.Tensor:
    """The loss of a batch of prompts with a group of completions each, every prompt streamed through the memory
    once (the model's forward with `completion_ids`, `TitansQwenForCausalLM.completion_log_probs`). `model` may be
    a DDP / FSDP wrapper; `titans` is the TitansQwen inside it (default: `model` itself), whose memory the
    reference switches off.

    - dpo (group = chosen, rejected): DPO's sigmoid loss, -log sigmoid(beta * (policy margin - reference margin)),
      the reference being the same model with its memory switched off (the frozen base, chunk by chunk).
    - grpo (`rewards` [B, G], responses stored with their rewards): the GRPO loss at an importance ratio of 1, i.e.
      -sum(advantage * log p(token)) over all completion tokens / their count, the advantages group-relative
      (`group_advantages`). The stored responses were not sampled from the model being trained and carry no
      behaviour log-probabilities, so there is no ratio to clip: each group gives the first, on-policy step's
      gradient (REINFORCE with the group's mean as baseline). No KL term.
    """
    titans = model if titans is None else titans
    if titans.config.memory_config.attend_previous_chunk:
        _keep_frozen_fsdp_units_gathered(titans)
    scored = {"input_ids": inputs["prompt_ids"], "attention_mask": inputs["prompt_attention_mask"],
              "completion_ids": inputs["completion_ids"], "completion_mask": inputs["completion_mask"]}
    if "rewards" not in inputs:
        if inputs["completion_ids"].shape[1] != 2:
            raise ValueError(f"dpo batches hold a chosen and a rejected answer per prompt, got "
                             f"{inputs['completion_ids'].shape[1]}")
        with torch.no_grad(), titans.memory_disabled():
            reference = model(**scored).completion_log_probs
    log_probs = model(**scored).completion_log_probs
    mask = inputs["completion_mask"].to(log_probs.dtype)
    if "rewards" in inputs:
        advantages = group_advantages(inputs["rewards"].to(log_probs.device, log_probs.dtype))
        return -(advantages.unsqueeze(-1) * log_probs * mask).sum() / mask.sum().clamp(min=1)
    margins = log_probs.sum(-1) - reference.sum(-1)  # [B, 2]: chosen, rejected
    return -F.logsigmoid(dpo_beta * (margins[:, 0] - margins[:, 1])).mean()


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

    def mixed(new: list[torch.Tensor], old: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for n, o in zip(new, old):
            kept = take.to(n.device).view(-1, *[1] * (n.dim() - 1))
            o = torch.cat([o[:rows].to(n.dtype), n[o.shape[0]:].detach()]) if o.shape[0] < rows else o[:rows]
            out.append(torch.where(kept, o.to(n.dtype), n))
        return out

    states = {}
    for layer, state in fresh.items():
        weights = mixed(state.weights, passed[layer].weights)
        shared = state.batch_start_weights is state.weights
        states[layer] = dataclasses.replace(
            state, weights=weights, momentum=mixed(state.momentum, passed[layer].momentum),
            batch_start_weights=weights if shared else mixed(state.batch_start_weights,
                                                             passed[layer].batch_start_weights))
    return states


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """What makes `folder` an incomplete checkpoint (a save that was cut short), or None when it is complete.

    The Trainer writes `trainer_state.json` last, after the weights, optimizer, scheduler and RNG state: a folder
    whose state file parses and whose memory weights open is complete.
    """
    folder = Path(folder)
    state_path, weights_path = folder / TRAINER_STATE_NAME, folder / MEMORY_WEIGHTS_NAME
    if not weights_path.is_file():
        return f"{weights_path} is missing"
    if not state_path.is_file():
        return f"{state_path} is missing (the save was cut short)"
    try:
        json.loads(state_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{state_path} is not valid JSON ({error})"
    try:
        with safe_open(weights_path, framework="pt"):
            pass
    except Exception as error:  # safetensors raises its own error types for every kind of broken file
        return f"{weights_path} is not a readable safetensors file ({error})"
    return None


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
    checkpointed. A model with a `config.memory_config` (a TitansQwen) gets it written beside its weights.
    """

    def __init__(self, model: nn.Module, args: TitansTrainingArguments, data_collator=None, **kwargs):
        if not isinstance(args, TitansTrainingArguments):
            raise ValueError(f"args must be TitansTrainingArguments, got {type(args).__name__}")
        if type(model).__module__.startswith("peft.") and hasattr(getattr(model, "config", None), "memory_config"):
            raise ValueError(f"model is a {type(model).__name__} (peft.get_peft_model) around a TitansQwen: PEFT froze "
                             "its memory and would save the adapter alone; put the LoRA on the model in place instead, "
                             "titans_hf.lora.add_lora(model, LoraConfig(...)), which trains and saves both")
        if not trainable_parameter_names(model):
            raise ValueError("model has no trainable parameter: nothing for TitansTrainer to train or checkpoint")
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
        if args.curriculum_chunks is not None and getattr(data_collator, "chunk_size", None) is None:
            raise ValueError(
                "curriculum_chunks needs a chunk size: use a TitansQwen model (memory_config.chunk_size) or pass a "
                "data_collator with chunk_size set"
            )
        if args.state_passing and not hasattr(model, "init_memory_states"):
            raise ValueError("state_passing carries a TitansQwen memory's state from row to row; this model has none")
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self._train_sampler: ResumableSampler | ChunkCurriculumSampler | None = None
        self._passed_states: dict[int, MemoryState] | None = None

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
                try:
                    sampler.load_state_dict(json.loads(sampler_state.read_text(encoding="utf-8")))
                except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, ValueError) as error:
                    raise ValueError(f"{sampler_state}: not the state of this run's sampler ({error})") from error
        if sampler is not None:
            sampler.set_epoch(epoch)
        if isinstance(sampler, ChunkCurriculumSampler) and self.is_world_process_zero():
            stage = sampler.stage(epoch)
            logger.info("epoch %d: curriculum stage %d, rows of <= %d chunks (%d rows)", epoch, stage,
                        sampler.stages[stage], len(sampler.pools[stage]))
        return super()._run_epoch(model, epoch, train_dataloader, *args, **kwargs)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns, *COMPLETION_COLUMNS]

    # ---- dpo and grpo rows: one prompt, a group of completions ----

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: int | torch.Tensor | None = None):
        """The Trainer's loss for windows; for batches of a `CompletionsCollator` (dpo and grpo rows) the loss of
        `completions_loss`, every completion scored from the memory state its prompt left."""
        if "completion_ids" not in inputs and self.args.state_passing and model.training:
            titans = self.accelerator.unwrap_model(model)
            rows = inputs["input_ids"].shape[0]
            fresh = titans.init_memory_states(rows, inputs["input_ids"].device)
            starting = passed_memory_states(fresh, self._passed_states, self.args.state_passing)
            loss, outputs = super().compute_loss(model, {**inputs, "memory_states": starting}, True,
                                                 num_items_in_batch)
            self._passed_states = {layer: state.detach() for layer, state in outputs.memory_states.items()}
            return (loss, outputs) if return_outputs else loss
        if "completion_ids" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = completions_loss(model, inputs, self.args.dpo_beta, titans=self.accelerator.unwrap_model(model))
        return (loss, None) if return_outputs else loss

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
        incomplete ones it passed over), and an explicit checkpoint that is incomplete is refused, naming why."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_complete_checkpoint()
        elif resume_from_checkpoint:
            problem = checkpoint_problem(resume_from_checkpoint)
            if problem is not None:
                raise ValueError(f"cannot resume from {resume_from_checkpoint}: {problem}")
        if resume_from_checkpoint:
            self._check_resume(Path(resume_from_checkpoint))
            self._warn_about_changed_arguments(Path(resume_from_checkpoint))
        lock = self._lock_output_dir()
        try:
            if not resume_from_checkpoint and self.args.save_strategy != "no":
                self._refuse_earlier_checkpoints()
            self._check_final_save_outputs(fresh=not resume_from_checkpoint)
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if lock is not None:
                _release_lock(lock)

    def _lock_output_dir(self) -> Any:
        """Hold `output_dir/.titans_hf_train.lock` (an flock, released when this process ends however it ends,
        and the file removed when the run ends) for the whole run: a second run into the same output_dir is refused,
        naming the lock and its holder, instead of both overwriting each other's checkpoints. None on processes that
        do not save. The lock is only ever a plain file of its own (`_open_lock`): what lies there is never written
        through."""
        if not self.is_world_process_zero():
            return None
        folder = Path(self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_NAME
        while True:
            handle = _open_lock(path)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = " ".join(handle.read(100).split()) or "another process"
                handle.close()
                raise RuntimeError(f"{path}: held by {holder}: another run is training into output_dir {folder}; two "
                                   "runs there would overwrite each other's checkpoints (give this one another "
                                   "output_dir)") from None
            if _is_at(handle, path):
                break
            handle.close()  # the run that held it removed it as we opened it: take the new one
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}\n")
        handle.flush()
        return handle

    def _refuse_earlier_checkpoints(self) -> None:
        """A fresh run would replace the checkpoint-N folders of an earlier run in output_dir as it reaches each
        step: refuse it, naming them, unless it resumes (every rank checks)."""
        earlier = sorted(path.name for path in Path(self.args.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
                         if path.is_dir())
        if earlier:
            raise ValueError(f"output_dir {self.args.output_dir} holds checkpoints of an earlier run ({', '.join(earlier[:3])}"
                             f"{', ...' if len(earlier) > 3 else ''}), which this fresh run would replace: resume it "
                             "(resume_from_checkpoint, --resume_from_checkpoint last) or choose another output_dir")

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
        for path in (folder / name for name in self._final_save_names):
            if not (path.exists() or path.is_symlink()):
                continue
            problem = unrecorded_reason(path)
            if problem is not None:
                raise FileExistsError(f"output_dir {folder}: the memory saved at the end of training would replace "
                                      f"{path}, and {problem}: move it, or choose another output_dir")
            if fresh and path.name == MEMORY_WEIGHTS_NAME and not self.args.overwrite_output_dir:
                raise FileExistsError(f"output_dir {folder} holds the memory an earlier run saved ({path}), which "
                                      "this fresh run would replace: pass overwrite_output_dir "
                                      "(--overwrite_output_dir) or choose another output_dir")

    def _check_resume(self, checkpoint: Path) -> None:
        """Refuse a resume that would silently be another run, naming the file or setting: a missing optimizer
        or scheduler state (a fresh optimizer and schedule), memory settings or a base that differ from the
        checkpoint's (memory_config.json), a global_step in trainer_state.json that this run cannot have reached;
        warn when the RNG state is missing (the run is then no longer reproducible)."""
        for name in (OPTIMIZER_NAME, SCHEDULER_NAME):
            if not (checkpoint / name).is_file():
                raise ValueError(f"cannot resume from {checkpoint}: {checkpoint / name} is missing, so the optimizer "
                                 "and learning-rate schedule would start afresh: another run, not this one resumed")
        rng = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        if not (checkpoint / rng).is_file() and self.is_world_process_zero():
            logger.warning("%s is missing: the resumed run draws other random numbers than the interrupted one "
                           "would have (dropout, sampling), so it is not reproducible", checkpoint / rng)
        model = self.accelerator.unwrap_model(self.model)
        current = getattr(model.config, "memory_config", None)
        if current is not None and (checkpoint / MEMORY_CONFIG_NAME).is_file():
            saved = read_memory_config(checkpoint / MEMORY_CONFIG_NAME)
            names = [name for name in saved.setting_names() if name != "checkpoint_chunks"]
            names += ["base_model_name_or_path", "base_shape", "base_fingerprint"]
            changed = [f"{name} {getattr(saved, name)!r} -> {getattr(current, name)!r}" for name in names
                       if getattr(saved, name) != getattr(current, name)]
            if changed:
                raise ValueError(f"cannot resume from {checkpoint}: this model differs from the checkpoint's "
                                 f"{checkpoint / MEMORY_CONFIG_NAME}: {'; '.join(changed)}")
        if getattr(model, "peft_config", None) and (checkpoint / ADAPTER_CONFIG_NAME).is_file():
            from titans_hf.lora import ADAPTER_NAME, lora_settings, read_adapter_config

            saved = lora_settings(read_adapter_config(checkpoint / ADAPTER_CONFIG_NAME))
            current = lora_settings(model.peft_config[ADAPTER_NAME])
            changed = [f"{name} {saved[name]!r} -> {current[name]!r}" for name in saved if saved[name] != current[name]]
            if changed:
                raise ValueError(f"cannot resume from {checkpoint}: this model's LoRA differs from the checkpoint's "
                                 f"{checkpoint / ADAPTER_CONFIG_NAME}: {'; '.join(changed)}")
        self._check_global_step(checkpoint)

    def _check_global_step(self, checkpoint: Path) -> None:
        path = checkpoint / TRAINER_STATE_NAME
        state = json.loads(path.read_text(encoding="utf-8"))
        step = state.get("global_step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"cannot resume from {checkpoint}: {path} records global_step {step!r}, not a step count")
        number = checkpoint.name.rsplit("-", 1)[-1]
        if checkpoint.name.startswith(PREFIX_CHECKPOINT_DIR) and number.isdigit() and int(number) != step:
            raise ValueError(f"cannot resume from {checkpoint}: {path} records global_step {step}, but the folder is "
                             f"the checkpoint of step {number}")
        limit = self.args.max_steps if self.args.max_steps > 0 else None
        if limit is None and hasattr(self.train_dataset, "__len__"):
            batches = math.ceil(len(self.train_dataset) / (self.args.per_device_train_batch_size * self.args.world_size))
            limit = math.ceil(batches / self.args.gradient_accumulation_steps) * math.ceil(self.args.num_train_epochs)
        if limit is not None and step > limit:
            raise ValueError(f"cannot resume from {checkpoint}: {path} records global_step {step}, beyond the {limit} "
                             "steps this run has (max_steps, or what its data and epochs allow)")

    def _warn_about_changed_arguments(self, checkpoint: Path) -> None:
        """Resuming with other settings is another run: name every setting of `RESUME_SETTINGS` that changed."""
        path = checkpoint / TRAINING_ARGS_JSON_NAME
        if not path.is_file():
            logger.warning("%s is missing: cannot tell whether this run's settings equal the checkpoint's", path)
            return
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from error
        current = {**json.loads(self.args.to_json_string()), "world_size": self.args.world_size}
        changed = [f"{name} {saved.get(name)!r} -> {current.get(name)!r}" for name in RESUME_SETTINGS
                   if saved.get(name) != current.get(name)]
        if changed and self.is_world_process_zero():
            logger.warning("resuming %s with changed settings, so the run will not be the one that was "
                           "interrupted: %s", checkpoint, "; ".join(changed))

    def _last_complete_checkpoint(self) -> str:
        run_dir = Path(self.args.output_dir)
        checkpoints = sorted(
            (path for path in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
             if path.is_dir() and path.name.split("-")[-1].isdigit()),
            key=lambda path: int(path.name.split("-")[-1]), reverse=True,
        )
        for checkpoint in checkpoints:
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                return str(checkpoint)
            logger.warning("skipping the incomplete checkpoint %s: %s", checkpoint, problem)
        raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {run_dir}")

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
        memory = {memory_keys[name]: tensor for name, tensor in state_dict.items() if name in memory_keys}
        base = {name: tensor for name, tensor in state_dict.items() if name not in memory_keys}
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        atomic_write_json(Path(output_dir, TRAINING_ARGS_JSON_NAME),
                          {**json.loads(self.args.to_json_string()), "world_size": self.args.world_size})
        model_config = model.memory_folder_config() if hasattr(model, "memory_folder_config") else None
        save_memory_folder(output_dir, getattr(model.config, "memory_config", None), memory, base, model_config,
                           adapter=adapter)
        if Path(output_dir).resolve() == Path(self.args.output_dir).resolve():  # the final save, not a checkpoint
            folder = Path(output_dir)
            record_outputs(folder, [name for name in self._final_save_names if (folder / name).is_file()],
                           "titans-hf train")

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """The Trainer's checkpoint plus the sampler's state, into a fresh folder: what a save that was cut short
        left there is removed first, so none of its files can pass for part of the new checkpoint."""
        folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            if self._train_sampler is not None:
                atomic_write_json(folder / SAMPLER_STATE_NAME, self._train_sampler.state_dict())
        self.accelerator.wait_for_everyone()
        if self._passed_states is not None:  # every process its own rows
            atomic_write(folder / self._passed_states_name(), lambda temporary: save_file(
                {f"{layer}.{key}": value for layer, state in self._passed_states.items()
                 for key, value in state.state_dict().items()}, temporary))
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
            torch.save(optimizer_state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

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
        logger.info("Loading best memory from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        try:
            if checkpoint is None or not self.is_fsdp_enabled:
                super()._load_optimizer_and_scheduler(checkpoint)
                return
            optimizer_state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu",
                                         weights_only=True)
            load_optimizer_state_dict(self.model, self.optimizer.optimizer, optimizer_state)
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, KeyError, ValueError) as error:
            raise ValueError(f"{_unreadable(checkpoint, (OPTIMIZER_NAME, SCHEDULER_NAME))}: cannot be loaded into this "
                             f"run's optimizer and scheduler ({error})") from error

    def _passed_states_name(self) -> str:
        stem, suffix = PASSED_STATES_NAME.split(".", 1)
        return f"{stem}_{self.args.process_index}.{suffix}" if self.args.world_size > 1 else PASSED_STATES_NAME

    def _load_passed_states(self, checkpoint: str) -> None:
        """State Passing resumes from the states the checkpoint's last micro-batch ended in (saved beside it)."""
        path = Path(checkpoint, self._passed_states_name())
        if not self.args.state_passing or not path.is_file():
            return
        titans = self.accelerator.unwrap_model(self.model)
        fresh = titans.init_memory_states(1)
        try:
            flat = load_file(str(path))
            states = {}
            for layer in fresh:
                prefix = f"{layer}."
                state = MemoryState.from_state_dict({key[len(prefix):]: value for key, value in flat.items()
                                                     if key.startswith(prefix)})
                if [w.shape[1:] for w in state.weights] != [w.shape[1:] for w in fresh[layer].weights]:
                    raise ValueError(f"layer {layer}'s weights do not fit this model's memory")
                if not all(torch.isfinite(w).all() for w in (*state.weights, *state.momentum)):
                    raise ValueError(f"layer {layer}'s state is not finite")
                states[layer] = state
        except (OSError, SafetensorError, KeyError, ValueError) as error:
            raise ValueError(f"{path}: not the passed memory states of this run ({error})") from error
        device = next(titans.parameters()).device
        self._passed_states = {layer: state.to(device) for layer, state in states.items()}

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._load_passed_states(checkpoint)
        try:
            super()._load_rng_state(checkpoint)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as error:
            names = (f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth",)
            raise ValueError(f"{_unreadable(checkpoint, names)}: not a random number generator state ({error})") from error


def _lock_problem(status: os.stat_result) -> str | None:
    """What a training lock with this `lstat` / `fstat` is, when it is not a plain file with no other name."""
    if stat.S_ISLNK(status.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(status.st_mode):
        return "a folder"
    if not stat.S_ISREG(status.st_mode):
        return "not a plain file"
    return None if status.st_nlink == 1 else "a file with other names (hard links)"


def _open_lock(path: Path) -> Any:
    """The training lock at `path`, opened (created when absent) for reading and writing. Anything there but a plain
    file with no other name is refused, naming it: a link or a hard link could be a user's file, which the holder's
    line would replace. It is opened without following a link, so that none put there meanwhile is written through.
    """
    try:
        problem = _lock_problem(os.lstat(path))
    except FileNotFoundError:
        problem = None
    if problem is None:
        try:
            handle = open(path, "r+", encoding="utf-8", opener=lambda name, flags: os.open(
                name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NOCTTY, 0o666))
        except OSError as error:
            raise OSError(error.errno, f"{path}: cannot open the training lock ({error.strerror}); output_dir must "
                                       "be a folder this run can write") from None
        problem = _lock_problem(os.fstat(handle.fileno()))
        if problem is not None:
            handle.close()
    if problem is not None:
        raise FileExistsError(f"{path}: the training lock is {problem}, which titans_hf will not write into; remove "
                              "it or choose another output_dir")
    return handle


def _is_at(handle: Any, path: Path) -> bool:
    """Whether the open `handle` is the file at `path` (not one removed or replaced since it was opened)."""
    try:
        at_path = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(handle.fileno())
    return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)


def _release_lock(handle: Any) -> None:
    """Remove the run's lock file while still holding it, then release it (`_lock_output_dir` checks that the file
    it locked is still the one at the path, so a run starting meanwhile cannot hold a removed one). Whatever has
    taken its place at the path is left alone."""
    if _is_at(handle, Path(handle.name)):
        os.unlink(handle.name)
    handle.close()


def _unreadable(checkpoint: str, names: tuple[str, ...]) -> str:
    """The first of `names` in `checkpoint` that `torch.load` cannot read (weights only), else all of them."""
    for name in names:
        path = Path(checkpoint, name)
        try:
            if path.is_file():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # any failure to read is what is being looked for
            return str(path)
    return " / ".join(str(Path(checkpoint, name)) for name in names)
