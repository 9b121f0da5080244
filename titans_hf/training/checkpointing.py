"""Memory-only checkpoints: what a checkpoint holds, how it is written and read back (whole under FSDP too), and the
checks that refuse a checkpoint that is incomplete or a resume that would be another run.

A checkpoint of `TitansTrainer` is the Trainer's (optimizer, scheduler, RNG and trainer state) with the trainable
weights alone in place of the model's (`memory_model.safetensors` plus `memory_config.json`, the trainable base weights
and PEFT's adapter files when those train too), beside them the sampler's state, the memory states State Passing
carries from one micro-batch to the next, the tokenizer and the training arguments. The Trainer writes
`trainer_state.json` last: a checkpoint without it was cut short.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
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
from transformers import TrainingArguments
from transformers import trainer as hf_trainer  # the names of the Trainer's checkpoint files, read where used
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from titans_hf.files import atomic_write
from titans_hf.modeling.configuration_titans_qwen import read_memory_config
from titans_hf.modeling.memory import MemoryState
from titans_hf.modeling.memory_folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MEMORY_CONFIG_NAME,
    MEMORY_WEIGHTS_NAME,
    TRAINABLE_BASE_WEIGHTS_NAME,
    load_memory_weights,
)

logger = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "sampler_state.json"
PASSED_STATES_NAME = "passed_memory_states.safetensors"  # with several processes, one file each: _{rank} before .
TRAINING_ARGS_JSON_NAME = "training_args.json"
# Settings that make a resumed run another run when they change (the global batch among them).
RESUME_SETTINGS = (
    "learning_rate", "gradient_accumulation_steps", "per_device_train_batch_size", "world_size", "num_train_epochs",
    "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "seed", "data_seed", "bf16", "fp16",
    "curriculum_chunks", "curriculum_epochs_per_stage", "state_passing",
)


# ---- trainable weights and optimizer state, whole under FSDP ----


def trainable_parameter_names(model: nn.Module) -> set[str]:
    """The names of the parameters that train (`requires_grad`): what a checkpoint holds."""
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


# ---- the memory states of State Passing ----


def passed_states_name(args: TrainingArguments) -> str:
    """The file of this process's passed memory states in a checkpoint (one per process when there are several)."""
    stem, suffix = PASSED_STATES_NAME.split(".", 1)
    return f"{stem}_{args.process_index}.{suffix}" if args.world_size > 1 else PASSED_STATES_NAME


def save_passed_states(path: Path, states: dict[int, MemoryState]) -> None:
    """Write the memory states a micro-batch ended in (every layer's, flattened to `{layer}.{key}`) to `path`."""
    atomic_write(path, lambda temporary: save_file(
        {f"{layer}.{key}": value for layer, state in states.items() for key, value in state.state_dict().items()},
        temporary))


def load_passed_states(path: Path, fresh: dict[int, MemoryState]) -> dict[int, MemoryState]:
    """The memory states saved at `path` (`save_passed_states`), one per memory layer of `fresh` (the model's initial
    states). A ValueError naming `path` when the file is missing, is no safetensors file, or holds states that are not
    this memory's (`_passed_states_problem`)."""
    if not path.is_file():
        raise ValueError(f"{path} is missing, so the rows that State Passing starts from the memory states the "
                         "interrupted run's last micro-batch ended in would start fresh: another run, not this one "
                         "resumed (resume from a checkpoint that holds it; a checkpoint of a run without State "
                         "Passing resumes with state_passing 0)")
    try:
        flat = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error
    problem = _passed_states_problem(flat, fresh)
    if problem is not None:
        raise ValueError(f"{path}: not the passed memory states of this run ({problem})")
    return {layer: MemoryState.from_state_dict({key[len(f"{layer}."):]: tensor for key, tensor in flat.items()
                                                if key.startswith(f"{layer}.")})
            for layer in fresh}


def _passed_states_problem(flat: dict[str, torch.Tensor], fresh: dict[int, MemoryState]) -> str | None:
    """What makes `flat` (the tensors of a passed-states file, `{layer}.{key}`) other than the states of `fresh`'s
    memory layers, or None: other layers; per layer other keys (another memory depth) than `MemoryState.state_dict`
    gives; a tensor of another dtype, or of another shape past the batch axis (other heads, head dim, convolution);
    rows not the same number in every tensor; values that are not finite. The batch axis may hold any number of rows,
    and the axis of an update chunk's buffered tokens (empty in a fresh state) any number of tokens."""
    layers = sorted({key.split(".", 1)[0] for key in flat})
    if layers != sorted(str(layer) for layer in fresh):
        return f"it holds the states of memory layers {layers}, this model's memory layers are {sorted(fresh)}"
    rows = set()
    for layer, state in fresh.items():
        expected = state.state_dict()
        saved = {key[len(f"{layer}."):]: tensor for key, tensor in flat.items() if key.startswith(f"{layer}.")}
        if saved.keys() != expected.keys():
            return f"layer {layer}'s state holds {sorted(saved)}, this memory's {sorted(expected)}"
        for key, want in expected.items():
            got = saved[key]
            fits = got.dtype == want.dtype and got.dim() == want.dim() and all(
                size == wanted or wanted == 0 for size, wanted in zip(got.shape[1:], want.shape[1:]))
            if not fits:
                return (f"layer {layer}'s {key} is {got.dtype} of shape {tuple(got.shape)}, this memory's is "
                        f"{want.dtype} of shape (rows, {', '.join(map(str, want.shape[1:]))})")
            if got.is_floating_point() and not bool(torch.isfinite(got).all()):
                return f"layer {layer}'s {key} holds NaN or infinite values"
            if got.dim():
                rows.add(got.shape[0])
    if len(rows) != 1 or 0 in rows:
        return f"its tensors hold {sorted(rows)} rows, not one number of rows >= 1"
    return None


# ---- checks: complete checkpoints, resumes that are the same run ----


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """What makes `folder` an incomplete checkpoint (a save that was cut short), or None when it is complete.

    The Trainer writes `trainer_state.json` last, after the weights, optimizer, scheduler and RNG state: a folder
    whose state file parses and whose memory weights open is complete.
    """
    folder = Path(folder)
    state_path, weights_path = folder / hf_trainer.TRAINER_STATE_NAME, folder / MEMORY_WEIGHTS_NAME
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


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str:
    """The newest complete checkpoint-N folder of `output_dir` (saying which incomplete ones it passed over)."""
    run_dir = Path(output_dir)
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


def refuse_earlier_checkpoints(output_dir: str | os.PathLike) -> None:
    """A fresh run would replace the checkpoint-N folders of an earlier run in output_dir as it reaches each
    step: refuse it, naming them, unless it resumes (every rank checks)."""
    earlier = sorted(path.name for path in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if path.is_dir())
    if earlier:
        raise ValueError(f"output_dir {output_dir} holds checkpoints of an earlier run ({', '.join(earlier[:3])}"
                         f"{', ...' if len(earlier) > 3 else ''}), which this fresh run would replace: resume it "
                         "(resume_from_checkpoint, --resume_from_checkpoint last) or choose another output_dir")


def check_resume(checkpoint: Path, args: TrainingArguments, model: nn.Module, train_dataset: Any,
                 main_process: bool) -> None:
    """Refuse a resume that would silently be another run, naming the file or setting: a missing optimizer
    or scheduler state (a fresh optimizer and schedule), memory settings or a base that differ from the
    checkpoint's (memory_config.json), a global_step in trainer_state.json that this run cannot have reached;
    warn (on the main process) when the RNG state is missing (the run is then no longer reproducible). `model` is
    the unwrapped model, `train_dataset` the run's rows."""
    for name in (hf_trainer.OPTIMIZER_NAME, hf_trainer.SCHEDULER_NAME):
        if not (checkpoint / name).is_file():
            raise ValueError(f"cannot resume from {checkpoint}: {checkpoint / name} is missing, so the optimizer "
                             "and learning-rate schedule would start afresh: another run, not this one resumed")
    rng = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    if not (checkpoint / rng).is_file() and main_process:
        logger.warning("%s is missing: the resumed run draws other random numbers than the interrupted one "
                       "would have (dropout, sampling), so it is not reproducible", checkpoint / rng)
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
    check_global_step(checkpoint, args, train_dataset)


def check_global_step(checkpoint: Path, args: TrainingArguments, train_dataset: Any) -> None:
    """Refuse a checkpoint whose trainer_state.json records a global_step that is no step count, that is not the
    step its checkpoint-N folder names, or that lies beyond the steps this run has."""
    path = checkpoint / hf_trainer.TRAINER_STATE_NAME
    state = json.loads(path.read_text(encoding="utf-8"))
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"cannot resume from {checkpoint}: {path} records global_step {step!r}, not a step count")
    number = checkpoint.name.rsplit("-", 1)[-1]
    if checkpoint.name.startswith(PREFIX_CHECKPOINT_DIR) and number.isdigit() and int(number) != step:
        raise ValueError(f"cannot resume from {checkpoint}: {path} records global_step {step}, but the folder is "
                         f"the checkpoint of step {number}")
    limit = args.max_steps if args.max_steps > 0 else None
    if limit is None and hasattr(train_dataset, "__len__"):
        batches = math.ceil(len(train_dataset) / (args.per_device_train_batch_size * args.world_size))
        limit = math.ceil(batches / args.gradient_accumulation_steps) * math.ceil(args.num_train_epochs)
    if limit is not None and step > limit:
        raise ValueError(f"cannot resume from {checkpoint}: {path} records global_step {step}, beyond the {limit} "
                         "steps this run has (max_steps, or what its data and epochs allow)")


def warn_about_changed_arguments(checkpoint: Path, args: TrainingArguments, main_process: bool) -> None:
    """Resuming with other settings is another run: name every setting of `RESUME_SETTINGS` that changed (on the
    main process)."""
    path = checkpoint / TRAINING_ARGS_JSON_NAME
    if not path.is_file():
        logger.warning("%s is missing: cannot tell whether this run's settings equal the checkpoint's", path)
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    current = {**json.loads(args.to_json_string()), "world_size": args.world_size}
    changed = [f"{name} {saved.get(name)!r} -> {current.get(name)!r}" for name in RESUME_SETTINGS
               if saved.get(name) != current.get(name)]
    if changed and main_process:
        logger.warning("resuming %s with changed settings, so the run will not be the one that was "
                       "interrupted: %s", checkpoint, "; ".join(changed))


def unreadable_file(checkpoint: str, names: tuple[str, ...]) -> str:
    """The first of `names` in `checkpoint` that `torch.load` cannot read (weights only), else all of them."""
    for name in names:
        path = Path(checkpoint, name)
        try:
            if path.is_file():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # any failure to read is what is being looked for
            return str(path)
    return " / ".join(str(Path(checkpoint, name)) for name in names)
