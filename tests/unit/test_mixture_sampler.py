"""trainer.data.sampler's mixture: slots drawn by share (exact to a few slots in any window),
every source gone through before a row repeats, the same order on any world size that keeps the
global batch, exact resume, and a resume with other sources refused; mixture_shares turns
weights (shares of tokens) and epochs (passes in the run) into shares of rows."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from trainer.data.sampler import (
    MixtureError,
    MixtureSampler,
    MixtureSource,
    ResumableSampler,
    ResumeMismatch,
    mixture_shares,
)

SOURCES = [
    MixtureSource("a", 37, Fraction(1, 2)),
    MixtureSource("b", 200, Fraction(3, 10)),
    MixtureSource("c", 5, Fraction(1, 5)),
]


def global_order(world_size: int, steps: int, *, micro: int, accum: int, state=None) -> list[tuple[int, int]]:
    """The run's rows in order, as every rank of ``world_size`` takes them, step by step."""
    samplers = [
        MixtureSampler(SOURCES, world_size=world_size, rank=r, micro_batch_size=micro, seed=7, grad_accum=accum)
        for r in range(world_size)
    ]
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(state)
    order = []
    for _ in range(steps):
        step = []
        for _micro in range(accum):
            for sampler in samplers:
                step += sampler.next_batch()
        order.append(sorted(step))  # a step's rows; within it the token-summed loss ignores order
    states = {repr(s.state_dict()) for s in samplers}
    assert len(states) == 1, states  # every rank holds the same state
    return order


def test_every_window_holds_each_source_in_its_share():
    sampler = MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=1000, seed=3)
    counts = Counter(s for s, _row in sampler.next_batch())
    assert counts == {0: pytest.approx(500, abs=3), 1: pytest.approx(300, abs=3), 2: pytest.approx(200, abs=3)}
    small = MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=10, seed=3)
    for _ in range(50):  # any 10 slots: within one or two of the share
        tens = Counter(s for s, _row in small.next_batch())
        assert abs(tens[0] - 5) <= 2 and abs(tens[1] - 3) <= 2 and abs(tens[2] - 2) <= 2, tens


def test_each_source_goes_through_all_its_rows_before_one_repeats():
    sampler = MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=1, seed=1)
    drawn: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(2000):
        ((source, row),) = sampler.next_batch()
        drawn[source].append(row)
    for source, rows in drawn.items():
        n = SOURCES[source].num_rows
        epochs = [rows[k : k + n] for k in range(0, len(rows) - n + 1, n)]
        assert epochs and all(sorted(e) == list(range(n)) for e in epochs), source
        assert epochs[0] != epochs[1]  # each epoch its own order


def test_two_ranks_and_one_with_the_same_global_batch_draw_the_same_order():
    two = global_order(2, 30, micro=2, accum=1)
    one = global_order(1, 30, micro=2, accum=2)
    assert two == one


def test_a_resumed_sampler_continues_exactly_on_another_world_size():
    whole = global_order(2, 40, micro=2, accum=2)
    first = MixtureSampler(SOURCES, world_size=2, rank=1, micro_batch_size=2, seed=7, grad_accum=2)
    for _ in range(20 * 2):
        first.next_batch()
    state = first.state_dict()
    assert sum(state["drawn"]) == state["offset"] == 20 * 8
    assert global_order(1, 20, micro=4, accum=2, state=state) == whole[20:]


def test_another_mixture_or_seed_cannot_continue_the_order():
    state = MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=1, seed=7).state_dict()
    changed = [*SOURCES[:2], MixtureSource("c", 6, Fraction(1, 5))]
    with pytest.raises(ResumeMismatch, match=r"c \(5 rows, share 1/5\).*c \(6 rows"):
        MixtureSampler(changed, world_size=1, rank=0, micro_batch_size=1, seed=7).load_state_dict(state)
    with pytest.raises(ResumeMismatch, match="seed"):
        MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=1, seed=8).load_state_dict(state)
    one = ResumableSampler(40, world_size=1, rank=0, micro_batch_size=1, seed=7)
    with pytest.raises(ResumeMismatch, match="one data source"):
        MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=1, seed=7).load_state_dict(one.state_dict())
    with pytest.raises(ResumeMismatch, match="a mixture"):
        one.load_state_dict(state)


def test_the_seed_decides_the_order():
    def first(seed):
        return MixtureSampler(SOURCES, world_size=1, rank=0, micro_batch_size=50, seed=seed).next_batch()

    assert first(1) == first(1) and first(1) != first(2)


def test_weights_are_shares_of_tokens():
    # a: 100 rows of 10 tokens, b: 100 rows of 40 tokens; equal weights: equal tokens, 4x the rows of a.
    shares = mixture_shares([("a", 1.0, None), ("b", 1.0, None)], [100, 100], [1000, 4000], 10_000)
    assert shares == [Fraction(4, 5), Fraction(1, 5)]
    assert sum(mixture_shares([("a", 2.0, None), ("b", 1.0, None)], [10, 20], [100, 100], 999)) == 1


def test_epochs_are_passes_in_the_run_and_weights_share_the_rest():
    # The run draws 1000 rows; c: 2 epochs of 100 rows = 200 rows; a and b share 800 by tokens.
    shares = mixture_shares(
        [("a", 1.0, None), ("b", 3.0, None), ("c", None, 2.0)], [50, 50, 100], [500, 500, 999], 1000
    )
    assert shares[2] == Fraction(1, 5) and shares[0] == Fraction(1, 5) and shares[1] == Fraction(3, 5)
    only_epochs = mixture_shares([("a", None, 1.0), ("b", None, 3.0)], [100, 100], [1, 1], 10)
    assert only_epochs == [Fraction(1, 4), Fraction(3, 4)]
    with pytest.raises(MixtureError, match=r"epochs of c ask for 2000 rows, and the run draws 1000"):
        mixture_shares([("a", 1.0, None), ("c", None, 20.0)], [50, 100], [500, 999], 1000)


def test_a_checkpoints_mixture_position_is_checked_before_it_is_used():
    from trainer.checkpoints.state_files import trainer_state_problem

    sampler = MixtureSampler(SOURCES, world_size=2, rank=0, micro_batch_size=2, seed=7)
    sampler.next_batch()
    position = {**sampler.state_dict(), "tokens_drawn": [10, 20, 30], "eval_split": [None, {"share": 0.1}, None]}
    assert trainer_state_problem({"step": 1, "sampler": position}, partial=True) is None
    damaged = {
        "sources": [["a", 37]],
        "drawn": [1, 2],
        "tokens_drawn": [1, -2, 3],
        "offset": "4",
        "eval_split": {"share": 0.1},
    }
    for key, value in damaged.items():
        problem = trainer_state_problem({"step": 1, "sampler": {**position, key: value}}, partial=True)
        assert problem is not None and problem.startswith(f"sampler.{key}"), (key, problem)
