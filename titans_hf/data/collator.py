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
