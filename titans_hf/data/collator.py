"""Batch rows so that every rank runs the same number of chunks.

The model processes a sequence chunk by chunk, and under DDP/FSDP every chunk issues collectives:
a rank that runs fewer chunks than another leaves it waiting until the watchdog kills the job
(the NCCL timeouts of the seed pipeline). So either rows already share one length, or they are
padded to a multiple of the chunk size with the chunk count agreed across ranks.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist


def _agreed_chunk_count(num_chunks: int) -> int:
    """The largest chunk count of any rank (all_reduce MAX), or the local one outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return num_chunks
    if torch.utils.data.get_worker_info() is not None:
        raise RuntimeError(
            "TitansDataCollator with chunk_size must run in the main process to agree chunk counts "
            "across ranks; set dataloader_num_workers=0"
        )
    backend = str(dist.get_backend())
    if "gloo" in backend or backend == "mpi":
        device = torch.device("cpu")
    else:  # nccl and other accelerator backends reduce accelerator tensors only
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    count = torch.tensor([num_chunks], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


class TitansDataCollator:
    """Stack rows into ``input_ids``, ``attention_mask``, ``labels`` LongTensors of shape [B, L].

    ``chunk_size=None``: rows must already share one length (fixed-length BABILong rows).
    ``chunk_size`` set: right-pad to ``ceil(longest / chunk_size) * chunk_size`` tokens, the
    chunk count being the maximum over ranks when ``torch.distributed`` is initialised.
    Padding is ``pad_token_id`` in inputs, 0 in the mask and ``label_pad_token_id`` in labels.
    """

    def __init__(self, pad_token_id: int, chunk_size: int | None = None, label_pad_token_id: int = -100):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens or None")
        self.pad_token_id = pad_token_id
        self.chunk_size = chunk_size
        self.label_pad_token_id = label_pad_token_id

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("TitansDataCollator got an empty batch")
        for index, feature in enumerate(features):
            missing = [key for key in ("input_ids", "labels") if key not in feature]
            if missing:
                raise ValueError(f"TitansDataCollator: row {index} of the batch lacks {missing}")
        lengths = [len(feature["input_ids"]) for feature in features]
        if self.chunk_size is None:
            if len(set(lengths)) > 1:
                raise ValueError(
                    f"TitansDataCollator without chunk_size needs rows of one length, got lengths {sorted(set(lengths))}; "
                    "pad rows to max_length or set chunk_size"
                )
            target_length = lengths[0]
        else:
            num_chunks = _agreed_chunk_count(math.ceil(max(lengths) / self.chunk_size))
            target_length = num_chunks * self.chunk_size

        batch = {
            "input_ids": torch.full((len(features), target_length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(features), target_length), dtype=torch.long),
            "labels": torch.full((len(features), target_length), self.label_pad_token_id, dtype=torch.long),
        }
        for row, (feature, length) in enumerate(zip(features, lengths)):
            if len(feature["labels"]) != length:
                raise ValueError(f"TitansDataCollator: row {row} has {length} input_ids but {len(feature['labels'])} labels")
            batch["input_ids"][row, :length] = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            batch["labels"][row, :length] = torch.as_tensor(feature["labels"], dtype=torch.long)
            mask = feature.get("attention_mask")
            batch["attention_mask"][row, :length] = 1 if mask is None else torch.as_tensor(mask, dtype=torch.long)
        return batch


class CompletionsCollator:
    """Batch dpo rows (`prompt_ids`, `chosen_ids`, `rejected_ids`) or grpo rows (`prompt_ids`, `completion_ids`,
    `completion_mask`, `rewards`) as one prompt and a group of completions per row, for a loss that reads each
    prompt once and scores every completion from the memory state it leaves (DPO: the group is chosen, rejected).

    Returns `prompt_ids` / `prompt_attention_mask` [B, P], left-padded (a row's chunks start at its first token, so
    left padding changes nothing), `completion_ids` / `completion_mask` [B, G, A], right-padded, and for grpo rows
    `rewards` [B, G] (float32). With `chunk_size`, P is a whole number of chunks and P and A are the largest of any
    rank, so that every rank runs the same chunks. All rows of a batch need the same group size."""

    def __init__(self, pad_token_id: int, chunk_size: int | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens or None")
        self.pad_token_id, self.chunk_size = pad_token_id, chunk_size

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("CompletionsCollator got an empty batch")
        grpo = "completion_ids" in features[0]
        needed = ("prompt_ids", "completion_ids", "completion_mask", "rewards") if grpo else (
            "prompt_ids", "chosen_ids", "rejected_ids")
        groups = []
        for index, feature in enumerate(features):
            missing = [key for key in needed if key not in feature]
            if missing:
                raise ValueError(f"CompletionsCollator: row {index} of the batch lacks {missing} (dpo rows: prompt_ids, "
                                 "chosen_ids, rejected_ids; grpo rows: prompt_ids, completion_ids, completion_mask, "
                                 "rewards)")
            if len(feature["prompt_ids"]) == 0:
                raise ValueError(f"CompletionsCollator: row {index} has no prompt; its first answer token would have "
                                 "nothing to be predicted from")
            if grpo:
                completions = [list(ids) for ids in feature["completion_ids"]]
                masks = [list(mask) for mask in feature["completion_mask"]]
                if len(masks) != len(completions) or len(feature["rewards"]) != len(completions) or any(
                        len(m) != len(c) for m, c in zip(masks, completions)):
                    raise ValueError(f"CompletionsCollator: row {index}: completion_ids, completion_mask and rewards "
                                     "do not match one another")
            else:
                completions = [list(feature["chosen_ids"]), list(feature["rejected_ids"])]
                masks = [[1] * len(ids) for ids in completions]
            groups.append((completions, masks))
        sizes = sorted({len(completions) for completions, _ in groups})
        if len(sizes) > 1:
            raise ValueError(f"CompletionsCollator: groups of {sizes} completions in one batch; batch groups of one "
                             "size (e.g. per_device_train_batch_size=1)")
        prompt_length = max(len(feature["prompt_ids"]) for feature in features)
        answer_length = max(1, max(len(ids) for completions, _ in groups for ids in completions))
        if self.chunk_size is not None:
            prompt_length = _agreed_chunk_count(math.ceil(prompt_length / self.chunk_size)) * self.chunk_size
            answer_length = _agreed_chunk_count(answer_length)  # the MAX over ranks of any count
        batch_size, group = len(features), sizes[0]
        batch = {
            "prompt_ids": torch.full((batch_size, prompt_length), self.pad_token_id, dtype=torch.long),
            "prompt_attention_mask": torch.zeros((batch_size, prompt_length), dtype=torch.long),
            "completion_ids": torch.full((batch_size, group, answer_length), self.pad_token_id, dtype=torch.long),
            "completion_mask": torch.zeros((batch_size, group, answer_length), dtype=torch.long),
        }
        for row, (feature, (completions, masks)) in enumerate(zip(features, groups)):
            prompt = torch.as_tensor(feature["prompt_ids"], dtype=torch.long)
            batch["prompt_ids"][row, prompt_length - len(prompt):] = prompt
            batch["prompt_attention_mask"][row, prompt_length - len(prompt):] = 1
            for index, (ids, mask) in enumerate(zip(completions, masks)):
                batch["completion_ids"][row, index, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
                batch["completion_mask"][row, index, :len(ids)] = torch.as_tensor(mask, dtype=torch.long)
        if grpo:
            batch["rewards"] = torch.tensor([list(feature["rewards"]) for feature in features], dtype=torch.float32)
        return batch
