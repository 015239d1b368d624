"""What ``jobgen validate`` checks in the files a spec names, beyond their existence: the data
and evaluation files can give a row, the prompts file is a file, and the model directory has
what [model.lora] and [train.pipeline] ask of it. Each problem is (key, message); the loader
names the file. Everything here reads names, sizes, the first bytes of small text files and
the safetensors headers: instant, without torch or datasets, and never blocking on a FIFO.
"""

from __future__ import annotations

import functools
import stat
from pathlib import Path

from jobgen.model.files import ModelInfo, PlanError, read_model
from jobgen.model.lora_targets import describe_adapted, expert_slot_names, moe_blocks, target_problems, weight_modules
from jobgen.model.mesh import context_parallel_model_refusal
from jobgen.model.pipeline_split import LAYERS_KEY, STAGES_KEY, PipelineSplitError, stage_layers
from jobgen.spec.data_files import data_path_problem, prompts_file_problem
from jobgen.spec.tables.model import LoraSpec
from jobgen.spec.tables.run import RunSpec

Problem = tuple[str, str]


def _kind(path: Path) -> str | None:
    """What ``path`` is when it is neither a regular file nor a directory (following links)."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def data_problems(run: RunSpec) -> list[Problem]:
    """A local data.path (or data.sources[i].path) or eval.path that cannot give a single row (an
    empty file, a directory of empty files or of no data files, an unsupported type, something that is no file), and a
    prompts file that gives no prompt. The job would fail the same way, only after its wait in
    the queue; what needs the rows or the tokenizer is checked in the trainer's first seconds."""
    problems: list[Problem] = []
    sources = [*(run.data.paths() if run.data else []), ("eval.path", run.eval.path if run.eval else None)]
    prompts = run.eval.prompts_file if run.eval else None
    for key, value in [*sources, ("eval.prompts_file", prompts)]:
        path = Path(value) if value else None
        if path is None or not (path.is_absolute() and path.exists()):
            continue  # a hub id, or a missing path that the loader reports
        kind = _kind(path)
        if kind is not None:  # reading a FIFO would wait for a writer forever
            problems.append((key, f"{path} is {kind}, not a regular file or directory"))
        elif key != "eval.prompts_file":
            problems.append((key, data_path_problem(path)))
        elif path.is_dir():
            problems.append((key, f"{path} is a directory: give a file of prompts"))
        else:
            problems.append((key, prompts_file_problem(path)))
    return [(key, message) for key, message in problems if message]


@functools.lru_cache(maxsize=8)
def _model(directory: str) -> ModelInfo | None:
    """The model's tensors and dimensions, once per process (a sweep validates every point)."""
    try:
        return read_model(directory)
    except PlanError:  # a hub id, or files `jobgen plan` and submit report themselves
        return None


def lora_adapted(run: RunSpec) -> str | None:
    """What [model.lora] will adapt in a local model, for validate to say ("q_proj, v_proj (4
    layers)"); None without LoRA or a model it can read."""
    model = run.model
    if model is None or model.lora is None or not Path(model.path).is_absolute():
        return None
    info = _model(model.path)
    if info is None:
        return None
    names = [t.name for t in info.tensors]
    moe_layers = len(moe_blocks(names)) if info.traits.experts else 0
    lora = model.lora
    return describe_adapted(
        lora.target_modules, weight_modules(info.tensors), moe_layers=moe_layers, target_experts=lora.target_experts
    )


def model_problems(run: RunSpec, world_sizes: list[int]) -> list[Problem]:
    """What [model.lora] and [train] ask of a local model that it does not have: an architecture
    train.parallelism cannot train (jobgen.model.parallelism's model refusals: a pipeline of a
    family its stages do not build, or of tied embeddings), LoRA targets that
    adapt none of its layers, a pipeline split that does not fit its decoder blocks in a world
    of one of ``world_sizes`` ranks. Every rank of every task would fail on them as it builds
    the model."""
    model = run.model
    if model is None or not run.job.kind.trains or not Path(model.path).is_absolute():
        return []
    pipeline = run.train.pipeline if run.train.strategy.pipelined else None
    experts_split = run.train.expert_parallel > 1
    split_rows = run.train.context_parallel > 1
    if model.lora is None and not run.train.strategy.refuses_models and not experts_split and not split_rows:
        return []  # nothing to check: no need to read the model
    info = _model(model.path)
    if info is None:
        return []
    problems: list[Problem] = []
    refusal = run.train.strategy.model_refusal(info.traits)
    if refusal is not None:
        return [("train.parallelism", f"{model.path}: {refusal}")]
    unsplit = context_parallel_model_refusal(run.train.context_parallel, info.traits)
    if unsplit is not None:
        return [("train.context_parallel", f"{model.path}: {unsplit}")]
    if experts_split:
        problems += _expert_parallel_problems(run.train.expert_parallel, info, model.path)
    if model.lora is not None:
        problems += _lora_problems(model.lora, info, model.path)
        if model.lora.target_experts and experts_split:
            problems.append(("model.lora.target_experts", "cannot be combined with train.expert_parallel yet"))
    for world in world_sizes if pipeline is not None else []:
        if run.train.world_problem(world):
            continue  # the loader reports the layout itself
        assert pipeline is not None
        try:
            stage_layers(info.num_layers, pipeline.stage_count(world), layers_per_stage=pipeline.layers_per_stage)
        except PipelineSplitError as exc:
            key = LAYERS_KEY if pipeline.layers_per_stage is not None else STAGES_KEY
            problems.append((key, f"in a world of {world} ranks: {exc} ({model.path})"))
            break
    return problems


def _lora_problems(lora: LoraSpec, info: ModelInfo, path: str) -> list[Problem]:
    """Targets that adapt nothing, or the experts without target_experts; target_experts on a
    model without experts."""
    if lora.target_experts and not info.traits.experts:
        return [("model.lora.target_experts", f"the model in {path} has no routed experts to adapt")]
    names = [t.name for t in info.tensors]
    slots = expert_slot_names(names) if info.traits.experts else set()
    found = target_problems(
        lora.target_modules, weight_modules(info.tensors), path, expert_slots=slots, target_experts=lora.target_experts
    )
    return [(f"model.lora.target_modules{suffix}", why) for suffix, why in found]


def _expert_parallel_problems(degree: int, info: ModelInfo, path: str) -> list[Problem]:
    """train.expert_parallel on a model without experts, or one whose experts it does not divide."""
    experts = info.traits.experts
    if not experts:
        return [("train.expert_parallel", f"{path}: the model has no routed experts to place on ranks")]
    if experts % degree:
        why = f"{path}: {degree} does not divide the {experts} experts of each of the model's MoE layers"
        return [("train.expert_parallel", why)]
    return []
