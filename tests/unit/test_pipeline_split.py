"""How jobgen splits a model into pipeline stages and places stages on ranks
(jobgen/model/pipeline_split.py): balanced by parameters with the embedding and the output layer
counted as blocks, smaller devices getting fewer blocks, explicit counts checked, and every
schedule's rules on stages and micro-batches refused with the train.pipeline key to change."""

from __future__ import annotations

import itertools

import pytest

from jobgen.model.pipeline_split import (
    SCHEDULES,
    PipelineSplitError,
    schedule_problem,
    stage_indices,
    stage_layers,
)


def counts(ranges: list[range]) -> list[int]:
    return [len(r) for r in ranges]


def test_ranges_are_contiguous_and_cover_every_block():
    ranges = stage_layers(32, 4)
    assert ranges[0].start == 0 and ranges[-1].stop == 32
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    assert all(len(r) >= 1 for r in ranges)


def test_balanced_split_counts_embedding_and_head_as_blocks():
    # 34 block-equivalents over 4 stages: loads 9, 9, 8, 8 (torchtitan's split for weights 1).
    assert counts(stage_layers(32, 4)) == [8, 9, 8, 7]
    assert counts(stage_layers(4, 2)) == [2, 2]
    assert counts(stage_layers(8, 2, embed_weight=0.0, head_weight=0.0)) == [4, 4]
    # A heavy output layer (large vocabulary) pushes blocks off the last stage.
    assert counts(stage_layers(16, 4, embed_weight=1.0, head_weight=4.0)) == [5, 5, 5, 1]
    # One stage holds everything.
    assert stage_layers(3, 1) == [range(0, 3)]


def compositions(total: int, parts: int):
    """Every way to give ``parts`` stages at least one of ``total`` blocks."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize(
    ("layers", "stages", "embed", "head", "capacities"),
    [
        (10, 3, 1.0, 1.0, None),
        (12, 4, 0.5, 2.5, None),
        (9, 3, 2.0, 0.3, [2.0, 1.0, 1.0]),
        (11, 4, 1.0, 1.0, [3, 3, 3, 1]),
    ],
)
def test_the_split_minimises_the_largest_load(layers, stages, embed, head, capacities):
    caps = capacities or [1.0] * stages
    extras = [0.0] * stages
    extras[0] += embed
    extras[-1] += head

    def worst(split):
        return max((n + e) / c for n, e, c in zip(split, extras, caps))

    got = counts(stage_layers(layers, stages, embed_weight=embed, head_weight=head, capacities=capacities))
    best = min(worst(split) for split in compositions(layers, stages))
    assert worst(got) == pytest.approx(best), (got, best)


def test_a_smaller_device_gets_fewer_blocks():
    # Three GPUs of 24 GiB and one of 12 GiB.
    split = counts(stage_layers(32, 4, capacities=[24, 24, 24, 12]))
    assert sum(split) == 32
    assert split[3] < min(split[:3]), split
    assert split == [9, 10, 10, 3], split
    # Equal capacities are the default split.
    assert stage_layers(32, 4, capacities=[24, 24, 24, 24]) == stage_layers(32, 4)


def test_explicit_layers_per_stage_are_used_as_given():
    assert stage_layers(8, 3, layers_per_stage=[1, 5, 2]) == [range(0, 1), range(1, 6), range(6, 8)]


@pytest.mark.parametrize(
    ("args", "keys", "words"),
    [
        ((4, 5), {}, ["train.pipeline.stages", "4 decoder blocks"]),
        ((4, 0), {}, ["train.pipeline.stages"]),
        ((8, 3), {"layers_per_stage": [4, 4]}, ["train.pipeline.layers_per_stage", "train.pipeline.stages"]),
        ((8, 2), {"layers_per_stage": [4, 3]}, ["train.pipeline.layers_per_stage", "sums to 7", "8 decoder blocks"]),
        ((8, 2), {"layers_per_stage": [8, 0]}, ["train.pipeline.layers_per_stage", "at least one block"]),
        ((8, 2), {"capacities": [24.0]}, ["train.pipeline.stages"]),
        ((8, 2), {"capacities": [24.0, 0.0]}, ["train.pipeline.stages"]),
    ],
)
def test_impossible_splits_name_the_key(args, keys, words):
    with pytest.raises(PipelineSplitError) as info:
        stage_layers(*args, **keys)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_schedules_map_to_torch_names():
    assert {name: s.torch_name for name, s in SCHEDULES.items()} == {
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved-1f1b": "Interleaved1F1B",
        "looped-bfs": "LoopedBFS",
        "interleaved-zero-bubble": "InterleavedZeroBubble",
        "zbv-zero-bubble": "ZBVZeroBubble",
        "dualpipev": "DualPipeV",
    }


def test_loop_and_v_placement():
    assert [stage_indices("1f1b", r, 4, 4) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_indices("interleaved-1f1b", r, 2, 6) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_indices("looped-bfs", r, 2, 2) for r in range(2)] == [[0], [1]]
    assert [stage_indices("zbv-zero-bubble", r, 2, 4) for r in range(2)] == [[0, 3], [1, 2]]
    assert [stage_indices("dualpipev", r, 4, 8) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # Every stage on exactly one rank.
    for name in SCHEDULES:
        stages = 8 if SCHEDULES[name].stages_per_rank != 1 else 4
        held = sorted(s for r in range(4) for s in stage_indices(name, r, 4, stages))
        assert held == list(range(stages)), name


@pytest.mark.parametrize(
    ("name", "pp", "stages", "words"),
    [
        ("1f1b", 2, 4, ["train.pipeline.schedule = '1f1b'", "one stage per pipeline rank", "train.pipeline.stages"]),
        ("gpipe", 4, 2, ["train.pipeline.stages must be 4"]),
        ("interleaved-1f1b", 2, 3, ["multiple of the 2 pipeline ranks", "train.pipeline.stages"]),
        ("looped-bfs", 4, 2, ["train.pipeline.stages"]),
        ("zbv-zero-bubble", 2, 2, ["2 stages per pipeline rank", "train.pipeline.stages must be 4"]),
        ("dualpipev", 2, 6, ["train.pipeline.stages must be 4"]),
        ("pipedream", 2, 2, ["train.pipeline.schedule", "unknown schedule 'pipedream'"]),
    ],
)
def test_stage_counts_a_schedule_cannot_place(name, pp, stages, words):
    with pytest.raises(PipelineSplitError) as info:
        stage_indices(name, 0, pp, stages)
    problem = schedule_problem(name, pp, stages, 64)
    for word in words:
        assert word in str(info.value), str(info.value)
        assert problem is not None and word in problem, problem


@pytest.mark.parametrize(
    ("name", "pp", "stages", "ok", "bad"),
    [
        ("gpipe", 4, 4, [1, 3], []),
        ("1f1b", 4, 4, [4, 5, 8], [1, 3]),
        ("looped-bfs", 2, 4, [1, 3], []),
        # rounds = max(1, mb // pp); mb must be a multiple of it.
        ("interleaved-1f1b", 4, 8, [3, 4, 5, 8, 10, 12], [9, 11, 13]),
        ("interleaved-zero-bubble", 2, 4, [2, 4, 6, 8], [5, 7]),
        ("zbv-zero-bubble", 2, 4, [4, 5], [2, 3]),
        ("dualpipev", 4, 8, [8, 9], [7]),
    ],
)
def test_microbatch_rules(name, pp, stages, ok, bad):
    for microbatches in ok:
        assert schedule_problem(name, pp, stages, microbatches) is None, (name, microbatches)
    for microbatches in bad:
        problem = schedule_problem(name, pp, stages, microbatches)
        assert problem is not None and "train.pipeline.microbatches" in problem, (name, microbatches, problem)
        assert f"train.pipeline.schedule = '{name}'" in problem, problem
    assert "train.pipeline.microbatches" in (schedule_problem(name, pp, stages, 0) or "")
