"""ResumableSampler: a global order from (seed, epoch), sharded by accelerate, resumed by the Trainer."""

from __future__ import annotations

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from torch.utils.data import BatchSampler

from titans_hf.data.sampler import ResumableSampler


def rank_batches(sampler, rank: int, batch_size: int, world_size: int = 2, even_batches: bool = True):
    """The batches accelerate's prepare_data_loader hands to one rank (it wraps the loader's batch sampler)."""
    shard = BatchSamplerShard(
        BatchSampler(sampler, batch_size, drop_last=False), world_size, rank, even_batches=even_batches
    )
    return list(shard)


def test_order_is_the_seeded_permutation_of_seed_plus_epoch():
    sampler = ResumableSampler(range(10), shuffle=True, seed=7)
    reference_0 = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    reference_1 = torch.randperm(10, generator=torch.Generator().manual_seed(8)).tolist()
    assert list(sampler) == reference_0
    assert list(sampler) == reference_0  # iterating twice does not advance anything
    sampler.set_epoch(1)
    assert list(sampler) == reference_1
    assert reference_0 != reference_1 and sorted(reference_1) == list(range(10))
    assert len(sampler) == 10


def test_no_shuffle_is_in_order_every_epoch():
    sampler = ResumableSampler(range(5), shuffle=False, seed=3)
    sampler.set_epoch(4)
    assert list(sampler) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("epoch", [0, 1])
def test_two_ranks_cover_every_index_once_per_epoch(epoch):
    # Each process builds its own sampler; only a global order makes the shards disjoint.
    samplers = [ResumableSampler(range(24), seed=5) for _ in range(2)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    batches = [rank_batches(samplers[rank], rank, batch_size=3) for rank in range(2)]
    assert [len(b) for b in batches] == [4, 4]
    seen = [i for rank_batches_ in batches for batch in rank_batches_ for i in batch]
    assert sorted(seen) == list(range(24))
    # Rank 0 takes global batches 0, 2, 4, 6 of the permutation; rank 1 the odd ones.
    order = torch.randperm(24, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
    assert batches[0][1] == order[6:9] and batches[1][0] == order[3:6]


def test_uneven_dataset_is_covered_once_without_even_batches():
    samplers = [ResumableSampler(range(25), seed=1) for _ in range(2)]
    seen = [i for rank in range(2) for batch in rank_batches(samplers[rank], rank, 4, even_batches=False) for i in batch]
    assert sorted(seen) == list(range(25))


def test_resume_replays_the_epoch_and_leaves_skipping_to_the_trainer():
    original = ResumableSampler(range(24), seed=11)
    original.set_epoch(1)
    full = rank_batches(original, rank=1, batch_size=3)
    state = original.state_dict()
    assert state == {"epoch": 1, "seed": 11, "shuffle": True, "num_samples": 24}

    resumed = ResumableSampler(range(24), seed=0)  # fresh run, defaults; the checkpoint decides
    resumed.load_state_dict(state)
    assert list(resumed) == list(original)  # the sampler itself skips nothing
    consumed = 2  # batches this rank had finished before the checkpoint
    shard = BatchSamplerShard(BatchSampler(resumed, 3, drop_last=False), 2, 1)
    assert list(SkipBatchSampler(shard, skip_batches=consumed)) == full[consumed:]


def test_state_of_another_dataset_is_refused():
    sampler = ResumableSampler(range(8))
    with pytest.raises(ValueError, match="saved for 9 rows, but the dataset has 8"):
        sampler.load_state_dict({"epoch": 0, "seed": 0, "shuffle": True, "num_samples": 9})
    with pytest.raises(ValueError, match="lacks"):
        sampler.load_state_dict({"epoch": 0})


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="empty dataset"):
        ResumableSampler([])


def test_dataset_smaller_than_world_size_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="3 rows, fewer than the 4 processes"):
        ResumableSampler(range(3))
    assert len(ResumableSampler(range(4))) == 4
