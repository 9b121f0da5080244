"""TRL's SFT, DPO and GRPO trainers for a TitansQwen memory (the `trl` extra: `pip install titans_hf[trl]`).

The plain `trl.SFTTrainer`, `trl.DPOTrainer` and `trl.GRPOTrainer` already train exactly the memory of a TitansQwen
with a frozen base: TRL scores tokens through `model.base_model` and the LM head (its fused head), and a TitansQwen's
`base_model` is its decoder (`TitansQwenModel`), the chunk loop with the memory; generation is the model's own
`generate`. These subclasses add what TRL cannot know about a memory:

- resuming: a TitansQwen's checkpoints hold the memory alone, which the Trainer's loader does not recognise;
- the rows of a `titans_tokens` dpo store, already in TRL's tokenized columns, which `trl.DPOTrainer` would try to
  tokenize again;
- `torch_compile`: the chunk step compiled (`compile_chunks`), not the whole forward (`CompiledChunks`);
- a step whose loss or gradients are not finite stops the run before anything is saved from it (`FiniteSteps`);
- the reference of DPO (`ref_model=None`) and of GRPO (`beta > 0`): the same model with its memory switched off
  (`TitansQwenForCausalLM.memory_off_reference()`: the frozen base read chunk by chunk, on the policy's own weights)
  instead of a second copy of the base loaded from `config.name_or_path`. Memory off rather than the memory at its
  initial weights: it is the ablation every evaluation reports (the log-ratio measures what the memory adds over the
  base), it exists for every variant and needs no copy of anything; for the default MAG memory, whose output
  projection starts at zero, the two are the same model at the start of training.
"""

from __future__ import annotations

import os

import trl
from torch import nn
from trl.trainer.utils import add_fused_lm_head

from titans_hf.modeling import TitansQwenForCausalLM

from .checkpointing import load_memory_checkpoint
from .trainer import CompiledChunks, FiniteSteps


# the columns of a tokenized DPO row, as TRL 1.16's collator reads them (and a titans_tokens dpo store yields them)
TOKENIZED_DPO_COLUMNS = {"prompt_ids", "chosen_ids", "rejected_ids"}


class MemoryCheckpoints:
    """Trainer hooks that load the memory-only checkpoints a TitansQwen writes (`memory_model.safetensors`)."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        load_memory_checkpoint(model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)


def _memory_off_reference(model: nn.Module, sync_ref_model: bool):
    """The memory-off reference of a TitansQwen policy, or None for any other model (TRL's own reference)."""
    if not isinstance(model, TitansQwenForCausalLM):
        return None
    if sync_ref_model:
        raise ValueError("sync_ref_model=True: the reference of a TitansQwen is its own base with the memory switched "
                         "off, there is nothing to synchronise; set sync_ref_model=False")
    return model.memory_off_reference()


class TitansSFTTrainer(MemoryCheckpoints, FiniteSteps, CompiledChunks, trl.SFTTrainer):
    """`trl.SFTTrainer` that resumes from a memory's checkpoints and stops at a step that is not finite;
    `torch_compile` compiles its chunk step."""


class TitansDPOTrainer(MemoryCheckpoints, FiniteSteps, CompiledChunks, trl.DPOTrainer):
    """`trl.DPOTrainer` that resumes from a memory's checkpoints and whose default reference (`ref_model=None`) is
    the policy with its memory switched off: no second model loads."""

    def __init__(self, model: nn.Module | str | os.PathLike, ref_model: nn.Module | None = None,
                 args: trl.DPOConfig | None = None, **kwargs):
        if ref_model is None:
            ref_model = _memory_off_reference(model, args is not None and args.sync_ref_model)
        super().__init__(model, ref_model, args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args: trl.DPOConfig, dataset_name: str):
        """TRL's preparation (prompt extraction, EOS, tokenization) for text rows; rows already in TRL's tokenized
        columns (`prompt_ids`, `chosen_ids`, `rejected_ids`: a `titans_tokens` dpo store) go to its collator as they
        are, less those whose prompt alone fills `max_length`, as TRL drops them."""
        columns = set(next(iter(dataset)))
        if not TOKENIZED_DPO_COLUMNS <= columns:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if args.max_length is not None and args.truncation_mode == "keep_start":
            dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < args.max_length)
        return dataset


class TitansGRPOTrainer(MemoryCheckpoints, FiniteSteps, CompiledChunks, trl.GRPOTrainer):
    """`trl.GRPOTrainer` that resumes from a memory's checkpoints and, with `beta > 0`, scores the KL term against the
    policy with its memory switched off (TRL 1.16 takes no `ref_model`: the base it loads is dropped again)."""

    def __init__(self, model: nn.Module | str | os.PathLike, reward_funcs, args: trl.GRPOConfig | None = None,
                 **kwargs):
        super().__init__(model, reward_funcs, args, **kwargs)
        if self.ref_model is not None:
            reference = _memory_off_reference(self.accelerator.unwrap_model(self.model), self.args.sync_ref_model)
            if reference is not None:
                add_fused_lm_head(reference, temperature=self.temperature,
                                  cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
                self.ref_model = reference


__all__ = ["TitansDPOTrainer", "TitansGRPOTrainer", "TitansSFTTrainer"]
