"""Completions of a prompt scored from one memory state (DPO, GRPO): the prompt streams through the chunks and the
memory into a cache once, and every completion continues from it.

`TitansQwenForCausalLM.completion_log_probs` is the public entry, and its `forward` with `completion_ids` (what a
DDP or FSDP wrapper sees) calls `score_completions` here; TitansTrainer's DPO and GRPO losses
(`titans_hf.training.preference`) and TRL's trainers reach it through them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache_titans_qwen import TitansCache
from .outputs_titans_qwen import ChunkedLMHead, StreamRequest


def score_completions(model: nn.Module, prompt_ids: torch.LongTensor, prompt_attention_mask: Tensor | None,
                       completion_ids: torch.LongTensor, completion_mask: Tensor | None) -> Tensor:
    """`completion_log_probs`' work: the prompt into a cache, then every completion from it. Under checkpointing
    (a training call with `checkpoint_chunks` or gradient checkpointing) each row goes alone, its prompt up to its
    last chunk as a cache-less stream whose chunks are recomputed in backward (`prompt_cache`), so a long prompt
    holds one chunk's activations, not all of them."""
    if prompt_ids is None or prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"completion_log_probs: prompt_ids must be [batch, tokens >= 1], got "
                         f"{None if prompt_ids is None else tuple(prompt_ids.shape)}: the first completion "
                         "token is predicted from the prompt")
    if completion_ids.dim() != 3 or completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"completion_log_probs: completion_ids must be [batch {prompt_ids.shape[0]}, group, "
                         f"tokens], got {tuple(completion_ids.shape)}")
    if prompt_attention_mask is None:
        prompt_attention_mask = torch.ones_like(prompt_ids)
    if completion_mask is None:
        completion_mask = torch.ones_like(completion_ids)
    checkpointed = model.config.memory_config.checkpoint_chunks or model.model.gradient_checkpointing
    if not (model.training and torch.is_grad_enabled() and checkpointed):
        return score_from_cache(model, TitansCache(model.config), prompt_ids, prompt_attention_mask, completion_ids,
                                completion_mask)
    rows = []
    for row in range(prompt_ids.shape[0]):
        prompt = prompt_ids[row:row + 1, prompt_attention_mask[row].bool()]  # its tokens, without left padding
        if prompt.shape[1] == 0:
            raise ValueError(f"completion_log_probs: prompt row {row} has no token (attention mask all 0)")
        cache, tail = prompt_cache(model, prompt)
        rows.append(score_from_cache(model, cache, tail, torch.ones_like(tail), completion_ids[row:row + 1],
                                     completion_mask[row:row + 1]))
    return torch.cat(rows)


def prompt_cache(model: nn.Module, prompt: torch.LongTensor) -> tuple[TitansCache, torch.LongTensor]:
    """(a cache holding one row's stream after every chunk of `prompt` [1, tokens] but its last, the prompt's
    last chunk): the chunks before run as a cache-less stream, checkpointed chunk by chunk, and the cache is
    seeded with the memory states and the last of those chunks' keys (as `start_new_chunk` leaves them)."""
    chunk_size = model.config.memory_config.chunk_size
    head = (prompt.shape[1] - 1) // chunk_size * chunk_size
    cache = TitansCache(model.config)
    if head:
        end = model.model._stream_aligned_rows(prompt[:, :head], None, None, None, StreamRequest())
        cache.memory_states, cache.seen_tokens = end.states, head
        for index, (keys, values) in enumerate(end.previous.key_values if end.previous else []):
            cache.update(keys, values, index)  # at the positions before the next chunk's: nothing to move
    return cache, prompt[:, head:]


def score_from_cache(model: nn.Module, cache: TitansCache, prompt_ids: torch.LongTensor,
                     prompt_attention_mask: Tensor, completion_ids: torch.LongTensor, completion_mask: Tensor) -> Tensor:
    """The prompt (or its rest) into `cache`, then every completion from the state it leaves."""
    batch_size, group, length = completion_ids.shape
    last = model.model(input_ids=prompt_ids, attention_mask=prompt_attention_mask, cache=cache,
                       lm_head=ChunkedLMHead(model.lm_head, logits_to_keep=1)).lm_head_output.logits
    cache.batch_repeat_interleave(group)
    tokens, mask = completion_ids.flatten(0, 1), completion_mask.flatten(0, 1)
    attention_mask = torch.cat([prompt_attention_mask.repeat_interleave(group, 0),
                                mask.to(prompt_attention_mask)], 1)
    logits = model.model(input_ids=tokens, attention_mask=attention_mask, cache=cache,
                         lm_head=ChunkedLMHead(model.lm_head, logits_to_keep=length)).lm_head_output.logits
    logits = torch.cat([last.repeat_interleave(group, 0), logits[:, :-1]], dim=1)
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # not a view: FSDP2 hooks the outputs of a call for backward, and warns of views (in-place ops drop the hook)
    return log_probs.view(batch_size, group, length) * completion_mask
