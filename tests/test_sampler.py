"""ResumableSampler: a global order from (seed, epoch), sharded by accelerate, resumed by the Trainer."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from torch.utils.data import BatchSampler

from titans_hf.data.sampler import MAX_SEED, ChunkCurriculumSampler, ResumableSampler, check_sampler_state


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


def test_saved_states_are_checked_field_by_field():
    """What both samplers save passes the check as JSON gives it back, up to the largest seed torch takes; a field of
    the wrong type or range is named, with what it must be, before any order is drawn from it."""
    plain, curriculum = ResumableSampler(range(8), seed=MAX_SEED - 3), ChunkCurriculumSampler([1, 2, 3], [1, 3])
    plain.set_epoch(3)
    for sampler in (plain, curriculum):
        state = json.loads(json.dumps(sampler.state_dict()))
        check_sampler_state(state)
        check_sampler_state(state, type(sampler).STATE_KEYS)
        sampler.load_state_dict(state)
    assert list(plain) == torch.randperm(8, generator=torch.Generator().manual_seed(MAX_SEED)).tolist()

    state = plain.state_dict()
    for change, message in [({"seed": MAX_SEED + 1}, f"field 'seed' is {MAX_SEED + 1}, not an integer from 0 to "),
                            ({"seed": True}, "field 'seed' is True, not an integer"),
                            ({"epoch": 4}, f"fields 'seed' and 'epoch' sum to {MAX_SEED + 1}, beyond the largest"),
                            ({"shuffle": 1}, "field 'shuffle' is 1, not true or false"),
                            ({"seed": "7" * 200}, "field 'seed' is '" + "7" * 76 + "..., not an integer")]:
        with pytest.raises(ValueError) as raised:
            plain.load_state_dict({**state, **change})
        assert message in str(raised.value)
    assert plain.seed == MAX_SEED - 3 and plain.epoch == 3  # nothing taken from a refused state
    with pytest.raises(ValueError, match=r"field 'stages' is \[0, 3\], not a list of chunk counts >= 1"):
        curriculum.load_state_dict({**curriculum.state_dict(), "stages": [0, 3]})
    with pytest.raises(ValueError, match=r"the state lacks the field\(s\) \['num_rows'\]"):
        check_sampler_state({"seed": 0, "epoch": 0, "stages": [1], "epochs_per_stage": 1})
    with pytest.raises(ValueError, match="the state is a list, not a JSON object"):
        check_sampler_state([0, 1])


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="empty dataset"):
        ResumableSampler([])


def test_dataset_smaller_than_world_size_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="3 rows, fewer than the 4 processes"):
        ResumableSampler(range(3))
    assert len(ResumableSampler(range(4))) == 4
