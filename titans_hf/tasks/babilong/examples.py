"""BABILong rows as training examples: the prompt, the answer as the only labelled tokens, the seeded split."""

from __future__ import annotations

from typing import Any

import torch

from titans_hf.data.tokenizers import plain_backend_tokenizer, resolve_pad_token_id

PROMPT_TEMPLATE = "{input}\n\nQuestion: {question}\nAnswer:"


def build_example(
    row: dict[str, str],
    tokenizer,
    max_length: int,
    answer_reserve_tokens: int,
    pad_to_max_length: bool = True,
    truncate_answers: bool = False,
    prompt_template: str = PROMPT_TEMPLATE,
    answer_end: str = "",
) -> dict[str, Any]:
    """Tokenise one row for training: prompt, then the answer (`" {target}{answer_end}"`) as the only labelled
    tokens.

    The prompt is ``prompt_template`` filled with the row's ``input`` and ``question`` (BABILong's by default; a
    task of its own words, as the needle's passkey prompt, passes its own, with ``{input}`` first).

    The prompt is cut to ``max_length - answer_reserve_tokens`` by dropping the *start* of the
    haystack: the question and "Answer:" always survive, and the latest facts (those that decide
    a "where is" answer) stay. Rows are right-padded to exactly ``max_length`` so every rank runs
    the same number of chunks; ``pad_to_max_length=False`` leaves them unpadded for a collator that
    pads to a multiple of the chunk size (length curricula).

    An answer longer than the room left after the prompt is a ValueError giving its token count, unless
    ``truncate_answers``: then it is cut to fit, and ``answer_tokens_cut`` (0 otherwise) says by how many tokens,
    for the caller to count.
    """
    if not tokenizer.is_fast:
        raise ValueError("build_example needs a fast tokenizer (it locates the question by character offsets)")
    if not 1 <= answer_reserve_tokens < max_length:
        raise ValueError(
            f"answer_reserve_tokens={answer_reserve_tokens} must be >= 1 and below max_length={max_length}"
        )
    prompt = prompt_template.format(input=row["input"], question=row["question"])
    backend = plain_backend_tokenizer(tokenizer)  # whatever truncation earlier calls left set
    encoding = backend.encode(prompt, add_special_tokens=True)
    ids, special = encoding.ids, encoding.special_tokens_mask
    num_prefix = next((i for i, is_special in enumerate(special) if not is_special), len(ids))
    # The first token touching the text after `input` starts the tail that must survive.
    tail_start = None
    for char in range(len(row["input"]), len(prompt)):
        tail_start = encoding.char_to_token(char)
        if tail_start is not None:
            break
    prompt_budget = max_length - answer_reserve_tokens
    keep = prompt_budget - num_prefix - (len(ids) - tail_start)
    if keep < 0:
        raise ValueError(
            f"question {row['question']!r} needs {len(ids) - tail_start + num_prefix} tokens, more than "
            f"max_length - answer_reserve_tokens = {prompt_budget}"
        )
    if tail_start - num_prefix > keep:
        ids = ids[:num_prefix] + ids[tail_start - keep : tail_start] + ids[tail_start:]
    answer_ids = backend.encode(" " + row["target"] + answer_end, add_special_tokens=False).ids
    room = max_length - len(ids)
    if len(answer_ids) > room and not truncate_answers:
        raise ValueError(
            f"answer {row['target']!r} is {len(answer_ids)} tokens but only {room} fit after the prompt "
            f"(max_length={max_length}, answer_reserve_tokens={answer_reserve_tokens}): raise answer_reserve_tokens "
            f"to at least {len(answer_ids)}, or cut such answers with truncate_answers=True"
        )
    answer_tokens_cut = max(0, len(answer_ids) - room)
    answer_ids = answer_ids[:room]
    prompt_length = len(ids)
    input_ids = ids + answer_ids
    labels = [-100] * prompt_length + answer_ids
    attention_mask = [1] * len(input_ids)
    if pad_to_max_length:
        padding = max_length - len(input_ids)
        input_ids = input_ids + [resolve_pad_token_id(tokenizer)] * padding
        labels = labels + [-100] * padding
        attention_mask = attention_mask + [0] * padding
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "target": row["target"],
        "prompt_length": prompt_length,
        "answer_tokens_cut": answer_tokens_cut,
    }


def train_eval_split(num_rows: int, train_ratio: float = 0.9, seed: int = 0) -> tuple[list[int], list[int]]:
    """Row indices of a seeded train/eval split, as ``torch.utils.data.random_split`` draws it."""
    if not 0 < train_ratio < 1:
        raise ValueError(f"train_ratio={train_ratio} must lie strictly between 0 and 1")
    train_size = int(num_rows * train_ratio)
    if train_size == 0 or train_size == num_rows:
        raise ValueError(f"train_ratio={train_ratio} of {num_rows} rows leaves an empty train or eval split")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[:train_size], order[train_size:]
