"""A global, seeded sampler whose position in training can be saved and restored.

accelerate already shards every map-style loader across ranks (``BatchSamplerShard``), so the
sampler must yield the same global order on every rank: a rank-aware sampler such as
``DistributedSampler`` would be sharded twice. The order is a pure function of ``(seed, epoch)``,
which is all a checkpoint needs to store. Skipping the batches already consumed on resume is the
Trainer's job (``skip_first_batches``); doing it here too would skip them twice.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class ResumableSampler(Sampler[int]):
    """Every index once per epoch, in a permutation drawn from ``seed + epoch`` (or in order)."""

    def __init__(self, data_source: Sized, shuffle: bool = True, seed: int = 0):
        self.data_source = data_source
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._check_size()

    def _check_size(self) -> None:
        size, world_size = len(self.data_source), _world_size()
        if size == 0:
            raise ValueError("ResumableSampler got an empty dataset: there is nothing to train or evaluate on")
        if size < world_size:
            raise ValueError(
                f"ResumableSampler: the dataset has {size} rows, fewer than the {world_size} processes; "
                "some ranks would get no data"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        self._check_size()
        if not self.shuffle:
            return iter(range(len(self.data_source)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=generator).tolist())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle, "num_samples": len(self.data_source)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the order of a saved run; a dataset of another size would make that order meaningless."""
        missing = [key for key in ("epoch", "seed", "shuffle", "num_samples") if key not in state]
        if missing:
            raise ValueError(f"ResumableSampler state lacks {missing}")
        if state["num_samples"] != len(self.data_source):
            raise ValueError(
                f"ResumableSampler state was saved for {state['num_samples']} rows, "
                f"but the dataset has {len(self.data_source)}"
            )
        self.epoch, self.seed, self.shuffle = int(state["epoch"]), int(state["seed"]), bool(state["shuffle"])
