"""``train.parallelism = "pipeline"`` and ``[train.pipeline]`` as the loader checks them: every
layout a task may get is checked before anything is queued, each refusal names the key that
fixes it; the global batch counts pipelines, not ranks."""

from __future__ import annotations

import pytest

from helpers import DATA, run_spec, spec_issues
from jobgen.spec.global_batch import grad_accum_for, shape_for
from jobgen.spec.loader import load_run
from jobgen.spec.tables.pipeline import PipelineSpec
from jobgen.spec.tables.train import TrainSpec


def spec(tmp_path, *, job=None, train=None, extra=None):
    job = {"time": "1h", "procs_per_node": 2, "nodes": 2, **(job or {})}
    train = {"micro_batch_size": 4, "parallelism": "pipeline", **(train or {})}
    return run_spec(
        tmp_path, "pp", job=job, model={"path": "org/m"}, data={"path": str(DATA)}, train=train, **(extra or {})
    )


@pytest.mark.parametrize(
    "job, train, key, words",
    [
        pytest.param({}, {"pipeline": {"size": 3}}, "train.pipeline.size", "must divide the world size 4", id="size"),
        pytest.param(
            {}, {"pipeline": {"microbatches": 3}}, "train.pipeline.microbatches", "must divide", id="microbatches"
        ),
        pytest.param(
            {},
            {"micro_batch_size": 2, "pipeline": {"schedule": "1f1b"}},
            "train.pipeline.schedule",
            "at least as many micro-batches as stages",
            id="1f1b-too-few-microbatches",
        ),
        pytest.param(
            {},
            {"pipeline": {"schedule": "gpipe", "stages": 8}},
            "train.pipeline.schedule",
            "one stage per pipeline rank",
            id="gpipe-one-stage-per-rank",
        ),
        pytest.param(
            {},
            {"pipeline": {"layers_per_stage": [1, 1, 1]}},
            "train.pipeline.layers_per_stage",
            "3 entries for 4 stages",
            id="layers-per-stage",
        ),
        pytest.param(
            {"nodes": 3, "min_nodes": 2},
            {"global_batch_size": 8, "pipeline": {"size": 4}},
            "train.pipeline.size",
            "on 3 node(s)",
            id="a-smaller-world-breaks-the-pipeline",
        ),
        pytest.param({}, {"parallelism": "fsdp", "pipeline": {}}, "train", "only used with", id="table-without"),
        pytest.param({}, {"loss_chunk_tokens": 64}, "train", "train.loss_chunk_tokens cannot", id="chunked-loss"),
        pytest.param({}, {"optimizer_in_backward": True, "grad_clip": 0}, "train", "cannot be combined", id="oib"),
        pytest.param(
            {}, {"grad_clip_mode": "per_parameter"}, "train", "grad_clip_mode = 'per_parameter'", id="per-parameter"
        ),
    ],
)
def test_a_layout_that_cannot_run_is_refused_with_its_key(tmp_path, job, train, key, words):
    issues = spec_issues(spec(tmp_path, job=job, train=train))
    assert key in issues and words in issues[key], issues


def test_eval_is_taken_with_a_pipeline(tmp_path):
    """Once refused ("[eval] cannot be combined with train.parallelism = 'pipeline' yet"); the
    stages now evaluate one after the other (trainer/parallel/pipeline_forward.py)."""
    run = load_run(spec(tmp_path, extra={"eval": {"every_steps": 10, "split": 0.1}})).run
    assert run.train.parallelism == "pipeline" and run.eval is not None


def test_defaults_one_pipeline_over_the_world(tmp_path):
    train = load_run(spec(tmp_path)).run.train
    assert train.pipeline == PipelineSpec()
    assert train.pipeline.stage_count(4) == 4 and train.pipeline.microbatch_count(4) == 4
    assert train.ranks_per_replica(4) == 4 and train.data_parallel_size(4) == 1


def test_schedules_with_two_stages_per_rank_default_to_two():
    pipeline = PipelineSpec(schedule="interleaved-1f1b", size=2)
    assert pipeline.stage_count(4) == 4 and pipeline.world_problem(4, 4) is None


def test_the_global_batch_counts_pipelines_not_ranks():
    train = TrainSpec(parallelism="pipeline", micro_batch_size=2, global_batch_size=8, pipeline={"size": 2})
    assert grad_accum_for(train, 4) == 2  # 2 pipelines x 2 rows x 2 micro-steps
    assert shape_for(train, 4).global_batch == 8
    assert shape_for(TrainSpec(global_batch_size=8, micro_batch_size=2), 4).grad_accum == 1
