"""trainer.data.sampler: deterministic order, disjoint and complete ranks, exact resume at any offset."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("numpy")  # the [train] extra; the sampler needs nothing else

from trainer.data.sampler import ResumableSampler, epoch_permutation

N, WORLD, MBS, SEED = 23, 3, 2, 7  # global batch 6: 3 batches per epoch, a ragged tail of 5


def samplers(num_rows=N, world=WORLD, mbs=MBS, seed=SEED):
    return [ResumableSampler(num_rows, world_size=world, rank=r, micro_batch_size=mbs, seed=seed) for r in range(world)]


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_same_seed_same_order_other_seed_or_epoch_other_order():
    a, b = samplers()[0], samplers()[0]
    assert take(a, 10) == take(b, 10)
    assert list(epoch_permutation(N, SEED, 0)) != list(epoch_permutation(N, SEED + 1, 0))
    assert list(epoch_permutation(N, SEED, 0)) != list(epoch_permutation(N, SEED, 1))
    assert sorted(epoch_permutation(N, SEED, 3)) == list(range(N))


def test_ranks_are_disjoint_and_cover_the_epoch_without_its_tail():
    ranks = samplers()
    for epoch in range(3):
        served = [row for _ in range(3) for s in ranks for row in s.next_batch()]
        perm = list(epoch_permutation(N, SEED, epoch))
        assert len(served) == len(set(served)) == 18
        assert served == perm[:18]  # batch-major, rank-minor slices of the permutation
        assert all(s.state_dict()["epoch"] == epoch + 1 and s.state_dict()["offset"] == 0 for s in ranks)


def test_global_batch_is_consecutive_rows_sliced_by_rank():
    ranks = samplers()
    perm = list(epoch_permutation(N, SEED, 0))
    batches = [s.next_batch() for s in ranks]
    assert batches == [perm[0:2], perm[2:4], perm[4:6]]


def test_state_is_identical_on_every_rank_and_json_serialisable():
    ranks = samplers()
    for _ in range(5):
        for s in ranks:
            s.next_batch()
        states = [s.state_dict() for s in ranks]
        assert all(st == states[0] for st in states)
        assert json.loads(json.dumps(states[0])) == states[0]
        assert set(states[0]) == {"epoch", "offset", "num_rows", "seed"}


@pytest.mark.parametrize("rank", range(WORLD))
def test_resume_at_every_offset_reproduces_the_rest(rank):
    total = 12  # four epochs of batches
    reference = take(samplers()[rank], total)
    for k in range(total + 1):
        first = samplers()[rank]
        take(first, k)
        resumed = samplers()[rank]
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert take(resumed, total - k) == reference[k:], f"resume after {k} batches"


def test_resume_with_another_world_size_serves_exactly_the_unseen_rows():
    before = samplers()
    seen = [row for s in before for row in s.next_batch()]  # one global batch of 6
    state = before[0].state_dict()
    after = samplers(world=2, mbs=4)  # global batch 8: 17 rows left hold 2 batches
    for s in after:
        s.load_state_dict(state)
    rest = [row for _ in range(2) for s in after for row in s.next_batch()]
    perm = list(epoch_permutation(N, SEED, 0))
    assert rest == perm[6:22]
    assert not set(rest) & set(seen)
    assert after[0].state_dict()["epoch"] == 1  # one row left: the tail is dropped


def test_state_of_other_data_or_seed_is_rejected():
    state = samplers()[0].state_dict()
    with pytest.raises(ValueError, match="had 23 rows, this run has 24"):
        samplers(num_rows=24)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        samplers(seed=8)[0].load_state_dict(state)


def test_too_few_rows_for_one_global_batch():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        ResumableSampler(5, world_size=3, rank=0, micro_batch_size=2, seed=0)


def test_next_batch_never_ends_and_repeats_across_epochs():
    a, b = samplers()[1], samplers()[1]
    assert take(a, 20) == take(b, 20)
    assert a.state_dict() == b.state_dict() and a.state_dict()["epoch"] == 6


def step_rows(ranks, grad_accum):
    """The rows of one optimizer step over every rank and micro-step, as a set."""
    return frozenset(row for _ in range(grad_accum) for s in ranks for row in s.next_batch())


def world(size: int, global_batch: int, num_rows: int = 29):
    accum = global_batch // size
    return [
        ResumableSampler(num_rows, world_size=size, rank=r, micro_batch_size=1, seed=SEED, grad_accum=accum)
        for r in range(size)
    ], accum


def test_a_kept_global_batch_serves_the_same_steps_on_every_world_size_epoch_ends_included():
    # Global batch 12 over 29 rows: two steps an epoch and a tail of 5, on 4, 2 then 3 ranks
    # (grad_accum 3, 6, 4). Cut by the micro-step (4, 2 or 3 rows) the tail would differ.
    reference, accum = world(4, 12)
    expected = [step_rows(reference, accum) for _ in range(9)]
    served, state = [], None
    for size, steps in ((4, 3), (2, 3), (3, 3)):
        ranks, accum = world(size, 12)
        for s in ranks:
            if state is not None:
                s.load_state_dict(json.loads(json.dumps(state)))
        served += [step_rows(ranks, accum) for _ in range(steps)]
        state = ranks[0].state_dict()
    assert served == expected
    assert all(len(rows) == 12 for rows in served)  # no row twice in a step
