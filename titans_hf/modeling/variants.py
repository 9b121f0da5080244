"""How a memory joins a decoder layer: one class per variant, chosen by `memory_config.variant` from a registry.

Every variant owns a `NeuralMemory`, built from the memory config's resolved settings (`TitansMemoryConfig` checks
them all, the settings each variant needs included), and the output projection `W_O` (zero at init, so an untrained
memory adds nothing) and implements `forward(layer, hidden, state, token_mask, num_prefix)`: run the decoder layer
(`layer`, a callable of the hidden states) with the memory read and written around it, and return the layer's output
and the memory's new state. A variant that puts tokens in front of each chunk returns them from `prefix_tokens`.

Adding a variant is a class here, a line in `MEMORY_VARIANTS` and its name in the config's `VARIANTS` (with the
checks of the settings it needs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init

from .memory import MemoryState, NeuralMemory

if TYPE_CHECKING:
    from .configuration_titans_qwen import TitansQwenConfig

DecoderLayer = Callable[[Tensor], Tensor]


class TitansMemoryBlock(nn.Module):
    """What every variant has: the memory of one layer and `W_O`, which maps its reads into the hidden size.

    Parameters are direct `nn.Parameter`s because transformers only initialises custom modules that own
    parameters themselves.
    """

    def __init__(self, config: TitansQwenConfig):
        super().__init__()
        memory_config, hidden = config.memory_config, config.text_config.hidden_size
        self.neural_memory = NeuralMemory(
            hidden_size=hidden,
            memory_num_heads=memory_config.memory_num_heads,
            memory_head_dim=memory_config.memory_head_dim,
            memory_depth=memory_config.memory_depth,
            memory_expansion=memory_config.memory_expansion,
            conv_kernel=memory_config.conv_kernel,
            conv_init=memory_config.conv_init,
            memory_chunk_size=memory_config.memory_chunk_size,
            memory_batch_size=memory_config.memory_batch_size,
            max_lr=memory_config.max_lr,
            theta_bias_init=memory_config.theta_bias_init,
            forget_bias_init=memory_config.forget_bias_init,
            memory_model=memory_config.memory_model,
            update_rule=memory_config.update_rule,
            max_memory_norm=memory_config.max_memory_norm,
        )
        inner = memory_config.memory_num_heads * memory_config.memory_head_dim
        self.output_weight = nn.Parameter(torch.zeros(hidden, inner))

    def initialize(self, std: float) -> None:
        """Initialise the block's own parameters (the NeuralMemory initialises itself)."""
        init.zeros_(self.output_weight)

    def prefix_tokens(self, state: MemoryState, batch_size: int) -> Tensor | None:
        """Tokens [B, P, hidden] this memory puts in front of each chunk, or None."""
        return None

    def project(self, read: Tensor, like: Tensor) -> Tensor:
        """W_O·read in `like`'s dtype (memory parameters may stay fp32 under a bf16 backbone)."""
        return F.linear(read.to(self.output_weight.dtype), self.output_weight).to(like.dtype)

    def forward(self, layer: DecoderLayer, hidden: Tensor, state: MemoryState, token_mask: Tensor | None,
                num_prefix: int) -> tuple[Tensor, MemoryState]:
        raise NotImplementedError


class MemoryAsGate(TitansMemoryBlock):
    """MAG: the memory reads the layer's input in parallel with the layer, and the layer's output gates what it
    returns, channel by channel: ``out = layer(h) + sigmoid(W_g rms(layer(h)) + b_g) * W_O read(h)``."""

    def __init__(self, config: TitansQwenConfig):
        super().__init__(config)
        hidden = config.text_config.hidden_size
        self.gate_weight = nn.Parameter(torch.zeros(hidden, hidden))
        self.gate_bias = nn.Parameter(torch.zeros(hidden))

    def initialize(self, std: float) -> None:
        super().initialize(std)
        init.normal_(self.gate_weight, std=std)
        init.zeros_(self.gate_bias)

    def forward(self, layer, hidden, state, token_mask, num_prefix):
        read, state = self.neural_memory(hidden, state, token_mask)
        output = layer(hidden)
        dtype = self.gate_weight.dtype
        normed = F.rms_norm(output.to(dtype), (output.shape[-1],))
        gate = torch.sigmoid(F.linear(normed, self.gate_weight, self.gate_bias))
        update = gate * F.linear(read.to(dtype), self.output_weight)
        return output + update.to(output.dtype), state


class MemoryAsLayer(TitansMemoryBlock):
    """MAL: the memory is a layer on the residual stream before the decoder layer: ``out = layer(h + W_O read(h))``."""

    def forward(self, layer, hidden, state, token_mask, num_prefix):
        read, state = self.neural_memory(hidden, state, token_mask)
        return layer(hidden + self.project(read, hidden)), state


class MemoryAsContext(TitansMemoryBlock):
    """MAC: each chunk starts with memory tokens, learned queries plus what the memory returns for them (a read of
    the current weights: the queries never write); the layer's outputs for the chunk's own tokens are written to
    the memory after it. The model adds `num_persistent_tokens` learned tokens in front; prefix positions carry no
    loss."""

    def __init__(self, config: TitansQwenConfig):
        super().__init__(config)
        self.memory_queries = nn.Parameter(torch.zeros(config.memory_config.num_memory_tokens,
                                                       config.text_config.hidden_size))

    def initialize(self, std: float) -> None:
        super().initialize(std)
        init.normal_(self.memory_queries, std=std)

    def prefix_tokens(self, state, batch_size):
        queries = self.memory_queries.unsqueeze(0).expand(batch_size, -1, -1)
        read = self.neural_memory.retrieve(self.memory_queries.unsqueeze(0), state)
        return queries + self.project(read, queries)

    def forward(self, layer, hidden, state, token_mask, num_prefix):
        output = layer(hidden)
        _, state = self.neural_memory(output[:, num_prefix:], state, token_mask)
        return output, state


MEMORY_VARIANTS: dict[str, type[TitansMemoryBlock]] = {
    "mag": MemoryAsGate,
    "mal": MemoryAsLayer,
    "mac": MemoryAsContext,
}


def memory_blocks(config: TitansQwenConfig) -> nn.ModuleDict:
    """One block of the configured variant per memory layer, keyed by the layer's index."""
    variant = MEMORY_VARIANTS[config.memory_config.variant]
    return nn.ModuleDict({str(layer): variant(config) for layer in config.memory_config.memory_layers})


def persistent_tokens(config: TitansQwenConfig) -> nn.Parameter | None:
    """The learned tokens in front of every chunk (`num_persistent_tokens`, mac), or None."""
    count = config.memory_config.num_persistent_tokens
    return nn.Parameter(torch.zeros(count, config.text_config.hidden_size)) if count else None
