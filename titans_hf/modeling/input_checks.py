"""The checks a TitansQwen model's forward makes of its input before streaming it: plain functions, each refusing in
one line that names the argument and what is wrong, so that a bad input never reaches torch's own error (or, for a
NaN memory state, NaN logits without a word).

`refuse_output_attentions` and `cache_argument` read the arguments both model classes take; `check_inputs` (the ids or
embeddings, a packed batch), `token_mask` (the attention mask), `check_cache` (a stream to continue) and
`check_memory_states` (states given to start a stream from) are the decoder's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .cache_titans_qwen import TitansCache
from .configuration_titans_qwen import TitansQwenConfig
from .memory import MemoryState

# what a padding-free (packed) batch carries instead of an attention mask: several documents in one row
PACKED_BATCH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def refuse_output_attentions(output_attentions: bool | None, config: TitansQwenConfig) -> None:
    """Refuse `output_attentions=True` (by argument or, when not given, by the config), naming why."""
    if output_attentions if output_attentions is not None else config.output_attentions:
        raise ValueError("forward: output_attentions=True: TitansQwenForCausalLM attends chunk by chunk (each "
                         "chunk over itself, the previous chunk and the memory's prefix tokens; the memory carries "
                         "the rest), so it has no attention map over the input to return")


def refuse_output_attentions_at_load(kwargs: dict[str, Any], method: str) -> None:
    """Refuse `output_attentions=True` among a loading method's keyword arguments (`method` names it): it would
    reach the base's config alone, and the model would return no attentions without a word."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"{method}: output_attentions=True: TitansQwenForCausalLM attends chunk by chunk (each chunk "
                         "over itself, the previous chunk and the memory's prefix tokens; the memory carries the "
                         "rest), so it has no attention map over the input to return; load without it")


def cache_argument(cache: TitansCache | None, kwargs: dict[str, Any]) -> TitansCache | None:
    """The stream to continue: `cache`, or `past_key_values` (popped from `kwargs`), the name transformers gave the
    same argument before 5.24 and Qwen's own models still take; both at once is refused."""
    if "past_key_values" not in kwargs:
        return cache
    past_key_values = kwargs.pop("past_key_values")
    if cache is not None and past_key_values is not None and past_key_values is not cache:
        raise ValueError("forward: cache and past_key_values were both given; they are one argument (transformers "
                         "5.24 renamed past_key_values to cache): pass one of them")
    return cache if cache is not None else past_key_values


def check_cache(cache: Any, config: TitansQwenConfig) -> None:
    """Refuse a `cache` that is no `TitansCache`, or one a model of another update rule made (the memory states it
    holds mean something under that rule alone)."""
    if cache is None:
        return
    if not isinstance(cache, TitansCache):
        raise ValueError(f"forward: cache must be a TitansCache, got {type(cache).__name__}")
    rule = config.memory_config.update_rule
    if cache.update_rule != rule:
        raise ValueError(f"forward: cache holds the memory states of a model of update_rule={cache.update_rule!r}; "
                         f"this model's memory is update_rule={rule!r}, under which those states mean nothing: "
                         "continue a stream with the model that started it")


def restarts_inside_rows(position_ids: Tensor, attention_mask: Tensor | None) -> bool:
    """Whether positions fall back to an earlier value between two real tokens of a row (documents packed)."""
    real = torch.ones_like(position_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    restarts = (position_ids[:, 1:] <= position_ids[:, :-1]) & real[:, 1:] & real[:, :-1]
    return bool(restarts.any())


def token_mask(attention_mask: Tensor | None, batch_size: int, length: int, device: torch.device) -> Tensor | None:
    """The attention mask's last `length` columns (this call's) on `device`, checked; None when it masks nothing."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] < length:
        raise ValueError(f"forward: attention_mask must be [batch, >= {length}] (2D, 1 = token, 0 = padding), "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -length:].to(device)
    return None if bool(mask.all()) else mask  # the common case: skip every masking path


def check_inputs(config: TitansQwenConfig, input_ids: Tensor | None, inputs_embeds: Tensor | None,
                 position_ids: Tensor | None, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> None:
    """Refuse, naming what is wrong, a packed (padding-free) batch, both or neither of input_ids and
    inputs_embeds, and ids or embeddings of the wrong shape or kind."""
    packed = [key for key in PACKED_BATCH_KWARGS if kwargs.get(key) is not None]
    if packed or (position_ids is not None and restarts_inside_rows(position_ids, attention_mask)):
        raise ValueError("TitansQwenForCausalLM reads each row as one stream through its memory: packed / "
                         f"padding-free batches (position_ids restarting inside a row{', ' if packed else ''}"
                         f"{', '.join(packed)}) are not supported; use padding (e.g. TRL's padding_free=False, "
                         "packing=False)")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("forward: pass exactly one of input_ids and inputs_embeds")
    hidden_size = config.text_config.hidden_size
    if input_ids is not None:
        check_input_ids(input_ids, config.text_config.vocab_size)
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0
                                      or inputs_embeds.shape[2] != hidden_size
                                      or not inputs_embeds.is_floating_point()):
        raise ValueError(f"forward: inputs_embeds must be a [batch, tokens >= 1, {hidden_size}] float tensor, got "
                         f"{inputs_embeds.dtype} {tuple(inputs_embeds.shape)}")


def check_input_ids(input_ids: Tensor | None, vocab_size: int) -> None:
    """Refuse, naming what is wrong, input_ids that are not a [batch, tokens >= 1] tensor of integer ids below
    `vocab_size` (torch would say "index out of range in self", or assert on the device)."""
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("forward: input_ids must be a [batch, tokens >= 1] LongTensor")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"forward: input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"forward: input_ids hold the id {low if low < 0 else high}, outside the vocabulary of "
                         f"{vocab_size} tokens (ids 0..{vocab_size - 1}): they come from another tokenizer")


def check_memory_states(memory_states: Any, memory: nn.ModuleDict, chunk_size: int, batch_size: int,
                        cached: bool) -> None:
    """Refuse given memory states that cannot start this stream, in one line naming the layer, the field and
    what was expected: a dict {memory layer: MemoryState} whose states are what the memory blocks `memory` make
    for `batch_size` rows (`NeuralMemory.state_problem`: shapes, dtypes, finite values), at a chunk boundary (a
    multiple of `chunk_size`), and never beside a cache (`cached`), which holds its own."""
    if cached:
        raise ValueError("forward: memory_states start a stream without a cache; a cache holds its own states")
    layers = sorted(int(layer) for layer in memory)
    if not isinstance(memory_states, dict) or set(memory_states) != set(layers):
        got = (f"a dict with keys {sorted(memory_states, key=repr)}" if isinstance(memory_states, dict)
               else f"a {type(memory_states).__name__}")
        raise ValueError(f"forward: memory_states must be a dict with one MemoryState per memory layer {layers} "
                         f"(e.g. an output's memory_states, or init_memory_states(batch_size)), got {got}")
    for layer in layers:
        state, where = memory_states[layer], f"memory_states[{layer}]"
        if not isinstance(state, MemoryState):
            hint = " (MemoryState.from_state_dict makes one of a state_dict)" if isinstance(state, dict) else ""
            raise ValueError(f"forward: {where} must be a MemoryState, got a {type(state).__name__}{hint}")
        tail = state.conv_tail
        if isinstance(tail, Tensor) and tail.dim() == 3 and tail.shape[0] != batch_size:
            raise ValueError(f"forward: memory_states must hold {batch_size} rows each (one per input row); "
                             f"{where} holds {tail.shape[0]}")
        problem = memory[str(layer)].neural_memory.state_problem(state, batch_size)
        if problem is not None:
            raise ValueError(f"forward: {where}.{problem}")
        if state.position % chunk_size:
            raise ValueError(f"forward: {where}.position is {state.position}: memory_states must be at a chunk "
                             f"boundary (a multiple of chunk_size {chunk_size})")
