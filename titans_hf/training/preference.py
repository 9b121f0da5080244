"""The losses of dpo and grpo rows (a prompt and a group of completions each): DPO against the model with its memory
switched off, and GRPO on stored rewards, every prompt streamed through the memory once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule


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
