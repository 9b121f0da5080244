"""The training samplers: global, seeded, and resumable from a saved state.

accelerate already shards every map-style loader across ranks (``BatchSamplerShard``), so a
sampler must yield the same global order on every rank: a rank-aware sampler such as
``DistributedSampler`` would be sharded twice. The order is a pure function of ``(seed, epoch)``,
which is all a checkpoint needs to store. Skipping the batches already consumed on resume is the
Trainer's job (``skip_first_batches``); doing it here too would skip them twice.

- `ResumableSampler`: every row once per epoch, in a seeded permutation.
- `ChunkCurriculumSampler`: a length curriculum, rows of at most a few chunks first, then longer ones.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Iterator, Sized

import datasets
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from tqdm.auto import tqdm


# The largest seed `torch.Generator.manual_seed` takes; a sampler seeds it with seed + epoch.
MAX_SEED = 2**64 - 1


def _is_count(value: Any, minimum: int = 0) -> bool:
    """Whether `value` is an int (not a bool) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# The fields of a saved sampler state (`state_dict()`), each with the test its value must pass and what it asks for.
STATE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda value: _is_count(value) and value <= MAX_SEED, f"an integer from 0 to {MAX_SEED}"),
    "epoch": (lambda value: _is_count(value) and value <= MAX_SEED, f"an integer from 0 to {MAX_SEED}"),
    "shuffle": (lambda value: isinstance(value, bool), "true or false"),
    "num_samples": (_is_count, "a number of rows"),
    "num_rows": (_is_count, "a number of rows"),
    "stages": (lambda value: isinstance(value, list) and len(value) > 0 and all(_is_count(cap, 1) for cap in value),
               "a list of chunk counts >= 1"),
    "epochs_per_stage": (lambda value: _is_count(value, 1), "an integer >= 1"),
    "group_size": (lambda value: value is None or _is_count(value, 1), "an integer >= 1 or null"),
}


def check_sampler_state(state: Any, required: Sequence[str] | None = None) -> None:
    """A ValueError naming the field of `state` (a sampler's `state_dict()` read back from a file) that is missing,
    or whose value is of the wrong type or out of range (a seed and an epoch whose sum `torch.Generator` cannot
    take among them). `required`: the fields that must be there; None: those of either sampler."""
    if not isinstance(state, dict):
        raise ValueError(f"the state is a {type(state).__name__}, not a JSON object of the sampler's fields")
    options = [required] if required is not None else [ResumableSampler.STATE_KEYS, ChunkCurriculumSampler.STATE_KEYS]
    if not any(all(name in state for name in fields) for fields in options):
        missing = min(([name for name in fields if name not in state] for fields in options), key=len)
        raise ValueError(f"the state lacks the field(s) {missing}")
    for name, (valid, wanted) in STATE_FIELDS.items():
        if name in state and not valid(state[name]):
            shown = repr(state[name])
            raise ValueError(f"field {name!r} is {shown if len(shown) <= 80 else shown[:77] + '...'}, not {wanted}")
    if "seed" in state and "epoch" in state and state["seed"] + state["epoch"] > MAX_SEED:
        raise ValueError(f"fields 'seed' and 'epoch' sum to {state['seed'] + state['epoch']}, beyond the largest seed "
                         f"{MAX_SEED}")


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class ResumableSampler(Sampler[int]):
    """Every index once per epoch, in a permutation drawn from ``seed + epoch`` (or in order)."""

    STATE_KEYS = ("epoch", "seed", "shuffle", "num_samples")  # the fields of `state_dict()`

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
        """Restore the order of a saved run; a field of the wrong type or range (`check_sampler_state`), and a
        dataset of another size, which would make that order meaningless, are ValueErrors."""
        check_sampler_state(state, self.STATE_KEYS)
        if state["num_samples"] != len(self.data_source):
            raise ValueError(
                f"ResumableSampler state was saved for {state['num_samples']} rows, "
                f"but the dataset has {len(self.data_source)}"
            )
        self.epoch, self.seed, self.shuffle = state["epoch"], state["seed"], state["shuffle"]


class ChunkCurriculumSampler(Sampler[int]):
    """Epoch-staged length curriculum, deterministic in (seed, epoch).

    RMT/ARMT learned BABILong only when trained on one segment first, then more. Epoch `e` is in
    stage `s = min(e // epochs_per_stage, last)` and draws from the rows of at most `stages[s]`
    chunks, reshuffled and cycled until the epoch holds `len(chunk_counts)` indices. A fixed epoch
    length keeps the Trainer's step arithmetic (steps per epoch, batches to skip on resume) valid,
    and an order that depends only on (seed, epoch) makes resume exact. Like `ResumableSampler` it
    is global: accelerate shards it across ranks.

    With `group_size` (the rows of one training step on all ranks), the epoch's rows are grouped by
    chunk count: consecutive runs of `group_size` indices hold rows of one length wherever the
    counts allow, and these groups come in a seeded random order, a last partial group staying
    last. A batch is padded to its longest row, so a step of rows of 4 chunks then costs 4 chunks
    of work, not the 32 of the longest row drawn beside them.
    """

    # the fields of `state_dict()` a saved state must hold (`group_size` may be missing: null)
    STATE_KEYS = ("seed", "epoch", "stages", "epochs_per_stage", "num_rows")

    def __init__(
        self,
        chunk_counts: Sequence[int],
        stages: Sequence[int],
        epochs_per_stage: int = 1,
        seed: int = 0,
        group_size: int | None = None,
    ):
        if not chunk_counts:
            raise ValueError("chunk_counts is empty: the curriculum needs at least one training row")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size={group_size} must be a positive number of rows or None")
        counts = torch.as_tensor(list(chunk_counts), dtype=torch.long)
        self.chunk_counts = counts
        self.group_size = group_size
        self.pools = [torch.nonzero(counts <= cap).flatten() for cap in stages]
        for cap, pool in zip(stages, self.pools):
            if len(pool) == 0:
                raise ValueError(
                    f"curriculum stage of <= {cap} chunks has no training row (shortest row has {int(counts.min())} chunks)"
                )
        self.num_rows = len(counts)
        self.stages = list(stages)
        self.epochs_per_stage = epochs_per_stage
        self.seed = seed
        self.epoch = 0

    def stage(self, epoch: int) -> int:
        return min(epoch // self.epochs_per_stage, len(self.stages) - 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_rows

    def __iter__(self):
        pool = self.pools[self.stage(self.epoch)]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        rounds = math.ceil(self.num_rows / len(pool))
        order = torch.cat([pool[torch.randperm(len(pool), generator=generator)] for _ in range(rounds)])
        order = order[: self.num_rows]
        if self.group_size is not None:
            # a stable sort keeps the shuffled order within a length; whole groups are then shuffled
            order = order[torch.sort(self.chunk_counts[order], stable=True).indices]
            whole = self.num_rows // self.group_size * self.group_size
            groups = order[:whole].view(-1, self.group_size)
            order = torch.cat([groups[torch.randperm(len(groups), generator=generator)].flatten(), order[whole:]])
        return iter(order.tolist())

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "stages": self.stages,
            "epochs_per_stage": self.epochs_per_stage,
            "num_rows": self.num_rows,
            "group_size": self.group_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the order of a saved run; a field of the wrong type or range (`check_sampler_state`), and another
        curriculum, which would not replay the same rows, are ValueErrors."""
        check_sampler_state(state, self.STATE_KEYS)
        saved = (state["stages"], state["epochs_per_stage"], state["num_rows"], state.get("group_size"))
        if saved != (self.stages, self.epochs_per_stage, self.num_rows, self.group_size):
            raise ValueError(
                f"checkpoint curriculum (stages, epochs per stage, rows, group size) {saved} differs from "
                f"{(self.stages, self.epochs_per_stage, self.num_rows, self.group_size)}: resuming would not replay "
                "the same data"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]


def count_chunks(dataset, chunk_size: int) -> list[int]:
    """Chunks each row occupies once padded to a multiple of `chunk_size` (real tokens only)."""
    if isinstance(dataset, datasets.Dataset):
        # numpy format: a 32k-token mask is one array, not 32k Python ints
        masks = (
            mask
            for batch in dataset.select_columns(["attention_mask"]).with_format("numpy").iter(batch_size=64)
            for mask in batch["attention_mask"]
        )
    else:
        masks = (dataset[i]["attention_mask"] for i in range(len(dataset)))
    return [
        max(1, math.ceil(int(np.asarray(mask).sum()) / chunk_size))
        for mask in tqdm(masks, total=len(dataset), desc="Counting chunks per row", leave=False)
    ]
