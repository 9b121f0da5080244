"""A TitansQwen with its memory switched off, on the policy's own weights: the reference model TRL's DPO and GRPO
score against (`TitansQwenForCausalLM.memory_off_reference()`), so that no second copy of the base loads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from .memory_folder import is_memory_name
from .outputs_titans_qwen import TitansCausalLMOutput


class MemoryOffDecoder(nn.Module):
    """The policy's decoder (`TitansQwenModel`) with its memory switched off, as code that reaches for
    `base_model` calls it (TRL's fused LM head): the base chunk by chunk. Every other attribute is the decoder's. A
    view, made on each access: it owns no parameters and is no submodule of the reference."""

    def __init__(self, decoder: PreTrainedModel):
        """`decoder`: the policy's `TitansQwenModel`."""
        super().__init__()
        self.__dict__["decoder"] = decoder  # not registered as a submodule

    def __getattr__(self, name: str) -> Any:
        decoder = self.__dict__.get("decoder")
        if decoder is None:
            raise AttributeError(name)
        return getattr(decoder, name)

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        with self.decoder.memory_disabled():
            return self.decoder(*args, **kwargs)


class TitansMemoryOffReference(nn.Module):
    """The frozen base run chunk by chunk (the memory switched off) as a reference model for TRL's DPO / GRPO, on
    the policy's own weights: no second copy loads. It owns no parameters and no submodules; calls run without
    gradients. Made by `TitansQwenForCausalLM.memory_off_reference()`."""

    def __init__(self, model: PreTrainedModel):
        """`model`: the policy, a `TitansQwenForCausalLM`."""
        super().__init__()
        self.__dict__["policy"] = model  # not registered: the reference holds nothing to train, cast or shard
        self.config = model.config

    @property
    def base_model(self) -> MemoryOffDecoder:
        return MemoryOffDecoder(self.policy.model)

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    def get_output_embeddings(self) -> nn.Module:
        return self.policy.get_output_embeddings()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """The weights it computes with: the policy's base (what TRL hashes to key its cached reference scores)."""
        return {name: tensor for name, tensor in self.policy.state_dict(*args, **kwargs).items()
                if not is_memory_name(name)}

    def forward(self, *args: Any, **kwargs: Any) -> TitansCausalLMOutput:
        with torch.no_grad(), self.policy.memory_disabled():
            return self.policy(*args, **kwargs)


__all__ = ["MemoryOffDecoder", "TitansMemoryOffReference"]
