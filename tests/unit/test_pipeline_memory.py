"""`jobgen plan` for train.parallelism = "pipeline": each pipeline position estimated from its
own blocks (jobgen/plan/pipeline.py), the schedules' pieces in flight, the replicas'
sharding, and the pipeline offered on Ethernet sites (jobgen/plan/suggestions.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fake_models import fake_model
from helpers import DATA, run_spec
from jobgen.model.files import ModelInfo, read_model
from jobgen.model.pipeline_split import SCHEDULES, stage_layers
from jobgen.plan.estimate import FRAGMENTATION_MARGIN, estimate
from jobgen.plan.inputs import PipelineInputs, PlanInputs
from jobgen.plan.memory_plan import plan_run
from jobgen.plan.pipeline import (
    Layout,
    embed_and_head_weights,
    estimate_pipeline,
    estimate_run,
    pipeline_problem,
    position_model,
    stage_pieces_in_flight,
)
from jobgen.spec.loader import load_run

STATES = ("parameters", "gradients", "optimizer_state")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelInfo:
    """The 374M Llama (24 blocks, untied) as safetensors headers."""
    return read_model(fake_model(tmp_path_factory.mktemp("pipe") / "m"))


def pipeline(world: int = 2, *, mbs: int = 4, accum: int = 1, device: str = "cpu", **keys) -> PlanInputs:
    return PlanInputs(
        device=device,
        parallelism="pipeline",
        world_size=world,
        micro_batch_size=mbs,
        seq_len=512,
        grad_accum=accum,
        pipeline=PipelineInputs(**keys),
    )


def states(components: dict[str, int]) -> int:
    return sum(components[name] for name in STATES)


# --------------------------------------------------------------------------- the estimate


def test_two_positions_split_the_blocks_and_the_embedding_and_head(model: ModelInfo):
    est = estimate_pipeline(model, pipeline(2))
    first, last = est.positions
    assert first.blocks == [range(0, 12)] and last.blocks == [range(12, 24)]
    assert (first.embedding, first.head, last.embedding, last.head) == (True, False, False, True)
    table = model.vocab_size * model.hidden_size
    block = model.block_numel
    # One pipeline: whole states of the position's own tensors, float32 on CPU.
    assert first.estimate.components["parameters"] == 4 * (12 * block + table)
    assert last.estimate.components["parameters"] == 4 * (12 * block + table + model.hidden_size)
    total = first.estimate.components["parameters"] + last.estimate.components["parameters"]
    assert total == 4 * model.param_count
    whole = states(estimate(model, replace(pipeline(1), parallelism="ddp", pipeline=None)).components)
    for position in est.positions:
        assert 0.49 * whole < states(position.estimate.components) < 0.51 * whole
    # Logits only where the loss is.
    assert first.estimate.components["logits"] == 0 and last.estimate.components["logits"] > 0
    # The rank's figures are the busiest position's.
    assert est.peak == max(p.estimate.peak for p in est.positions)


def test_the_split_is_the_trainers(model: ModelInfo):
    """stage_layers with the embedding and head weighted by their parameters, as
    trainer.parallel.pipeline_steps._embed_and_head_weights weighs them."""
    embed, head = embed_and_head_weights(model)
    block = model.block_numel  # Llama: q, k, v, o, three MLP matrices and two norms
    assert embed == pytest.approx(model.vocab_size * model.hidden_size / block)
    assert head == pytest.approx((model.vocab_size * model.hidden_size + model.hidden_size) / block)
    est = estimate_pipeline(model, pipeline(4, mbs=4))
    expected = stage_layers(24, 4, embed_weight=embed, head_weight=head)
    assert [p.blocks[0] for p in est.positions] == expected
    assert len(expected[0]) < len(expected[1])  # the embedding's stage takes fewer blocks
    given = estimate_pipeline(model, pipeline(2, layers_per_stage=(4, 20)))
    assert [p.blocks for p in given.positions] == [[range(0, 4)], [range(4, 24)]]


@pytest.mark.torch
def test_the_weights_equal_the_trainers_from_the_config(tmp_path: Path):
    from transformers import AutoConfig

    from trainer.parallel.pipeline_steps import _embed_and_head_weights

    directory = fake_model(tmp_path / "gqa", hidden=512, heads=8, kv=2, inter=1408, layers=6, vocab=5000)
    config = AutoConfig.from_pretrained(directory)
    assert embed_and_head_weights(read_model(directory)) == pytest.approx(_embed_and_head_weights(config))


def test_gpipe_holds_more_activations_than_1f1b_and_grows_with_the_pieces(model: ModelInfo):
    def activations(schedule: str, accum: int) -> list[int]:
        est = estimate_pipeline(model, pipeline(2, accum=accum, schedule=schedule))
        return [p.estimate.components["activations"] for p in est.positions]

    gpipe, one_f = activations("gpipe", 1), activations("1f1b", 1)
    assert all(g > o for g, o in zip(gpipe, one_f)), (gpipe, one_f)
    # Three times the pieces (grad_accum 3: all of a step's micro-batches in one schedule step):
    # gpipe holds them all, 1f1b still at most pp - position.
    gpipe3, one_f3 = activations("gpipe", 3), activations("1f1b", 3)
    assert all(g3 > 2 * g for g3, g in zip(gpipe3, gpipe)), (gpipe3, gpipe)
    assert one_f3 == one_f
    layout = estimate_pipeline(model, pipeline(2, accum=3)).layout
    assert layout.pieces == 12 and layout.rows == 1
    assert [stage_pieces_in_flight(layout, p) for p in (0, 1)] == [2, 1]
    # Logits: one piece's loss, plus the logits and log-softmax every other piece keeps under
    # gpipe (float32 on CPU: 8 bytes a logit of the 16 a whole loss holds); none under 1f1b.
    last = [estimate_pipeline(model, pipeline(2, schedule=s)).positions[1] for s in ("gpipe", "1f1b")]
    assert last[0].estimate.components["logits"] == last[1].estimate.components["logits"] * (1 + 3 / 2)


def test_fsdp_replicas_divide_the_states_and_ddp_does_not(model: ModelInfo):
    one = estimate_pipeline(model, pipeline(2))  # one pipeline: no replicas
    fsdp = estimate_pipeline(model, pipeline(4, size=2, data_parallel="fsdp"))
    ddp = estimate_pipeline(model, pipeline(4, size=2, data_parallel="ddp"))
    assert fsdp.layout.dp == ddp.layout.dp == 2
    for whole, sharded, replicated in zip(one.positions, fsdp.positions, ddp.positions):
        for name in STATES:
            assert sharded.estimate.components[name] == pytest.approx(whole.estimate.components[name] / 2, abs=1)
            assert replicated.estimate.components[name] == whole.estimate.components[name]
        # FSDP gathers the position's whole parameters and unsharded gradients for the step.
        gathered = 2 * whole.estimate.components["parameters"]
        assert sharded.estimate.components["buffers"] > gathered > replicated.estimate.components["buffers"]
    assert fsdp.peak < ddp.peak


def test_gpu_pipeline_counts_nccl_for_the_world_pipeline_and_replica_groups(model: ModelInfo):
    gpu = replace(pipeline(4, size=2), device="cuda", dtype="bfloat16")
    one_group = replace(pipeline(2), device="cuda", dtype="bfloat16")
    per_communicator = gpu.nccl.per_communicator
    assert estimate_pipeline(model, gpu).components["nccl_buffers"] == 3 * per_communicator
    assert estimate_pipeline(model, one_group).components["nccl_buffers"] == 2 * per_communicator  # world = pp


def test_the_multi_stage_schedules_hold_what_they_say(model: ModelInfo):
    for name in ("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev"):
        est = estimate_pipeline(model, pipeline(2, mbs=4, schedule=name))
        assert len(est.layout.ranges) == 4 and all(len(p.stages) == 2 for p in est.positions), name
        assert est.positions[0].embedding and est.positions[-1 if SCHEDULES[name].placement == "loop" else 0].head
        assert all(p.estimate.components["activations"] > 0 for p in est.positions)


@pytest.mark.torch
def test_pieces_in_flight_match_torchs_schedules():
    """The counts of stage_pieces_in_flight against torch 2.13's own action lists, which its
    runtime executes for the multi-stage schedules (and gpipe's, which runs as listed): a
    stage-piece is in flight from its forward to its full backward (or its weight gradient).
    1f1b is not compared: Schedule1F1B runs "1B1F" (a backward before each further forward),
    while its list, kept for export, puts the forward first."""
    from torch.distributed.pipelining import schedules as S

    def flat(actions):
        for a in actions:
            if a is not None:
                yield from (a.sub_actions or (a,))

    def most_in_flight(actions) -> int:
        live: set = set()
        top = 0
        for a in flat(actions):
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == S.FORWARD:
                live.add(key)
            elif a.computation_type in (S.FULL_BACKWARD, S.BACKWARD_WEIGHT):
                live.discard(key)
            top = max(top, len(live))
        return top

    def torch_order(name: str, pp: int, local: int, n: int) -> list[list]:
        cls = S.get_schedule_class(SCHEDULES[name].torch_name)
        schedule = cls.__new__(cls)
        schedule._n_microbatches, schedule._num_stages = n, pp * local
        if local == 1:
            return [schedule._get_pipeline_order()[r] for r in range(pp)]
        schedule.pp_group_size, schedule.n_local_stages, schedule.num_stages = pp, local, pp * local
        schedule._stages = [None] * local
        schedule.number_of_rounds = max(1, n // pp)
        schedule.microbatches_per_round = n // schedule.number_of_rounds
        return [schedule._calculate_single_rank_operations(r) for r in range(pp)]

    compared = [s for s in SCHEDULES if s != "1f1b"]
    for name, (pp, n) in [(s, c) for s in compared for c in ((2, 4), (2, 8), (4, 8), (4, 16), (3, 6))]:
        local = SCHEDULES[name].stages_per_rank or 2
        ranges = tuple(range(i, i + 1) for i in range(pp * local))
        layout = Layout(pp, 1, name, "fsdp", n, n, 1, ranges)
        torch_counts = [most_in_flight(actions) for actions in torch_order(name, pp, local, n)]
        assert [stage_pieces_in_flight(layout, p) for p in range(pp)] == torch_counts, (name, pp, n)


def test_estimate_refuses_a_pipeline_and_estimate_run_dispatches(model: ModelInfo):
    with pytest.raises(ValueError, match="per position"):
        estimate(model, pipeline(2))
    assert estimate_run(model, pipeline(2)).peak == estimate_pipeline(model, pipeline(2)).peak
    flat = replace(pipeline(2), parallelism="fsdp", pipeline=None)
    assert estimate_run(model, flat).peak == estimate(model, flat).peak


def test_layouts_the_trainer_refuses_are_problems(model: ModelInfo):
    assert pipeline_problem(model, pipeline(2)) is None
    assert "stages" in pipeline_problem(model, pipeline(2, stages=26, schedule="looped-bfs"))
    assert "micro_batch_size" in pipeline_problem(model, pipeline(2, microbatches=3))
    assert "optimizer_in_backward" in pipeline_problem(model, replace(pipeline(2), optimizer_in_backward=True))
    # Per-parameter clipping: the spec refuses it under a pipeline, so the plan never offers one to it.
    assert "per_parameter" in pipeline_problem(model, replace(pipeline(2), per_parameter_clip=True))


def test_a_tied_model_pipelines_with_a_copy_of_the_embedding_on_the_last_position(model: ModelInfo):
    """Once refused ("the model ties its input and output embeddings"): the last position now
    holds a copy of the embedding as its head (trainer.parallel.pipeline_steps.TiedCopies)."""
    embedding = next(t for t in model.parameters if t.name.endswith("embed_tokens.weight"))
    untied_head = next(t for t in model.parameters if t.name == "lm_head.weight")
    tied = replace(model, tie_word_embeddings=True, tensors=tuple(t for t in model.tensors if t is not untied_head))
    assert pipeline_problem(tied, pipeline(2)) is None
    last = position_model(tied, {23}, embedding=False, head=True)
    assert {t.name for t in last.parameters if not t.name.startswith("model.layers.")} == {
        "lm_head.weight",
        "model.norm.weight",
    }
    assert next(t for t in last.parameters if t.name == "lm_head.weight").shape == embedding.shape
    first = position_model(tied, {0}, embedding=True, head=False)
    assert {t.name for t in first.parameters if not t.name.startswith("model.layers.")} == {embedding.name}
    assert "each hold a copy" in estimate_pipeline(tied, pipeline(2)).notes[0]


# --------------------------------------------------------------------------- Ethernet suggestions


def two_nodes(tmp_path: Path, site: str, *, device_memory: str = "64GiB", **train) -> Path:
    slurm = {"device_memory": device_memory}
    return run_spec(
        tmp_path,
        "ether",
        site={"profile": site, "slurm": slurm},
        job={"time": "1h", "runs_root": str(tmp_path / "runs"), "nodes": 2, "procs_per_node": 2},
        model={"path": fake_model(tmp_path / "m")},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 4, "parallelism": "fsdp", **train},
    )


def test_ethernet_sites_are_offered_a_pipeline_and_infiniband_ones_are_not(tmp_path: Path):
    plan = plan_run(load_run(two_nodes(tmp_path / "socket", "local")))  # transport = "socket"
    assert plan.verdict == "fits"
    (offer,) = plan.network_suggestions
    assert offer.change == 'train.parallelism = "pipeline", train.pipeline.size = 2, train.grad_accum = 2'
    assert "only activations cross the network" in offer.cost and "bubble of about 11% of the step" in offer.cost
    assert offer.peak < plan.peak and offer.verdict == "fits"
    text = plan.format()
    assert "on Ethernet between nodes" in text and offer.change in text
    assert plan.to_json()["network_suggestions"][0]["change"] == offer.change
    ib = plan_run(load_run(two_nodes(tmp_path / "ib", "h100-ib")))
    assert ib.network_suggestions == [] and "pipeline" not in ib.format()


def test_ethernet_run_that_does_not_fit_with_fsdp_is_offered_the_pipeline(tmp_path: Path):
    plan = plan_run(load_run(two_nodes(tmp_path, "local", device_memory="6GiB")))
    assert plan.verdict == "does not fit", plan.format()
    offered = [s for s in plan.suggestions if s.change.startswith('train.parallelism = "pipeline"')]
    assert offered and offered[0].fits, plan.format()
    assert offered[0].change in "\n".join(plan.fit_advice())


def test_a_pipeline_that_does_not_fit_is_offered_only_what_a_pipeline_runs(tmp_path: Path):
    spec = run_spec(
        tmp_path,
        "pipe",
        site={"profile": "local", "slurm": {"device_memory": "3GiB"}},
        job={"time": "1h", "runs_root": str(tmp_path / "runs"), "nodes": 2, "procs_per_node": 2},
        model={"path": fake_model(tmp_path / "m")},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 4, "parallelism": "pipeline", "pipeline": {"schedule": "gpipe"}},
    )
    plan = plan_run(load_run(spec))
    assert plan.verdict == "does not fit" and len(plan.positions) == 4, plan.format()
    changes = [s.change for s in plan.suggestions]
    assert 'train.pipeline.schedule = "1f1b"' in changes, changes
    refused = ("optimizer_in_backward", "loss_chunk_tokens", "cpu_offload", "activation_offloading")
    assert not [c for c in changes if any(key in c for key in refused)], changes
    assert all("(without [train.pipeline])" in c for c in changes if "fsdp" in c), changes
    assert plan.network_suggestions == []  # already a pipeline


# --------------------------------------------------------------------------- unequal cards


def unequal_cards(tmp_path: Path, memory: list[str], **job) -> Path:
    """A pipeline of 2 positions over 2 GPU nodes of one rank each whose cards differ."""
    return run_spec(
        tmp_path,
        "cards",
        site={"profile": "h100-ib", "slurm": {"gpus_per_node": 1}},
        job={"time": "1h", "runs_root": str(tmp_path / "runs"), "nodes": 2, "procs_per_node": 1,
             "device_memory": memory, **job},
        model={"path": fake_model(tmp_path / "m")},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 4, "parallelism": "pipeline", "pipeline": {"size": 2}},
    )  # fmt: skip


def test_a_larger_card_gets_more_blocks_in_the_plan_and_the_trainer_alike(tmp_path: Path, model: ModelInfo):
    """24 and 80 GB cards: the 80 GB node's stage takes more of the 24 blocks, the plan's split
    is the one the trainer computes (the same stage_capacities and stage_layers), and the
    verdict is about the tightest position against its own card."""
    from jobgen.model.pipeline_split import NodeMemory, stage_capacities

    spec = load_run(unequal_cards(tmp_path / "a", ["24GB", "80GB"]))
    plan = plan_run(spec)
    first, last = (p.blocks[0] for p in plan.positions)
    assert len(last) > 2 * len(first), (first, last)
    # The trainer's split (trainer/parallel/pipeline_steps.py): its mesh, the nodes' memory, its weights.
    train = spec.run.train
    capacities = stage_capacities(
        train.mesh(2, 1), train.pipeline.schedule, 2, NodeMemory(spec.node_procs, spec.run.job.node_memory())
    )
    assert capacities == pytest.approx([0.3, 1.0])
    embed, head = embed_and_head_weights(model)
    assert [first, last] == stage_layers(24, 2, embed_weight=embed, head_weight=head, capacities=capacities)
    assert plan.position_budgets == [24 * 10**9, 80 * 10**9] and plan.tightest is not None
    chosen = plan.positions[plan.tightest]
    assert plan.peak == chosen.estimate.peak and plan.budget == plan.position_budgets[plan.tightest]
    # Its headroom too: the fragmentation margin is of the tightest position's peak, not the busiest's.
    busiest = max(plan.positions, key=lambda p: p.estimate.peak)
    assert busiest.position != plan.tightest, "the case needs a tightest position that is not the busiest"
    assert plan.headroom["fragmentation"] == int(FRAGMENTATION_MARGIN * chosen.estimate.peak), plan.headroom
    assert plan.reserve == sum(plan.headroom.values())
    assert "<- the tightest" in plan.format() and "job.device_memory: pipeline position" in plan.summary()
    # Equal cards split as without the key; the order of the entries is the nodes'.
    equal = plan_run(load_run(unequal_cards(tmp_path / "b", ["80GB", "80GB"])))
    assert [p.blocks for p in equal.positions] == [p.blocks for p in estimate_pipeline(model, pipeline(2)).positions]
    swapped = plan_run(load_run(unequal_cards(tmp_path / "c", ["80GB", "24GB"])))
    assert len(swapped.positions[0].blocks[0]) > len(swapped.positions[1].blocks[0])


def test_device_memory_needs_one_entry_per_node_and_every_node(tmp_path: Path):
    from helpers import spec_issues

    issues = spec_issues(unequal_cards(tmp_path / "a", ["24GB"]))
    assert "one entry per node" in issues["job"], issues
    issues = spec_issues(unequal_cards(tmp_path / "b", ["24GB", "80GB"], min_nodes=1))
    assert "job.min_nodes = 1" in issues["job"], issues
