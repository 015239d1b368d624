"""Which modules ``[model.lora] target_modules`` adapts, by peft's own rules, worked out from a
model directory's tensor names without torch (:mod:`jobgen.model.files` reads them).

peft (``check_target_module_exists``, 0.21) matches a module's full name (``model.layers.0.
self_attn.q_proj``) against the spec's targets: a list matches a module whose name equals an
entry or ends in ``.`` + the entry; a string is a regular expression the whole name must match,
except ``"all-linear"``, which is every linear layer but the output layer. A module LoRA can
adapt has a 2-D weight (linear, embedding, GPT-2's Conv1D); a norm or a whole block cannot.

``jobgen validate`` refuses targets that adapt nothing the model has (every array task would
fail the same way as it builds the model), naming the entry and the names the model does have.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from jobgen.model.files import TensorInfo
from jobgen.model.traits import BLOCK_INDEX as BLOCK_NAME

ALL_LINEAR = "all-linear"
# Routers pick experts (their outputs are logits over experts): LoRA's default leaves them, as
# trainer.model.architecture does for the built model.
ROUTERS = ("gate", "router", "shared_expert_gate")
# The names peft (0.21, transformers 5) takes as the routed experts of a mixture: its v4-to-v5
# conversion turns a target of one of these names (Mixtral's w1/w2/w3, the Qwen-MoE pattern's
# gate/up/down projections, which DeepSeek, OLMoE and Qwen3-MoE follow) into the experts' fused
# parameters, even where the name also belongs to a dense or shared-expert layer, and it adapts
# parameters only without dropout. On a model with experts, LoRA's default leaves every layer
# of these names (DeepSeek-V3's dense and shared MLPs with them), unless model.lora.target_experts.
EXPERT_NAMES = ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")
_EXPERT_SLOT = re.compile(r"\.experts\.\d+\.([^.]+)$")
_LISTED = 12  # names shown in a message


def is_all_linear(targets: list[str] | str) -> bool:
    return isinstance(targets, str) and targets.lower() == ALL_LINEAR


def weight_modules(tensors: Iterable[TensorInfo]) -> dict[str, int]:
    """Module name -> the number of dimensions of its weight, for every ``<module>.weight`` among
    a model's ``tensors`` (:attr:`jobgen.model.files.ModelInfo.tensors`)."""
    return {t.name.removesuffix(".weight"): len(t.shape) for t in tensors if t.name.endswith(".weight")}


def matches(targets: list[str] | str, module: str) -> bool:
    """Whether peft's rule matches ``module`` (a full module name) to ``targets``."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def adaptable(modules: dict[str, int]) -> list[str]:
    """The modules LoRA can adapt: those with a 2-D weight."""
    return sorted(name for name, dims in modules.items() if dims == 2)


def default_targets(modules: dict[str, int], *, experts: bool = False) -> list[str]:
    """What LoRA adapts when ``target_modules`` is unset, as last names: every linear layer of
    the decoder blocks (attention and MLP projections, fused ones such as Phi-3's ``qkv_proj``
    and GPT-NeoX's ``query_key_value`` included), routers left out, and the experts of an MoE
    layer too: transformers holds them fused, as parameters no LoRA layer wraps. On a model
    with experts (``experts``), no layer of a name peft takes as theirs (:data:`EXPERT_NAMES`)."""
    leaves = {
        name.rsplit(".", 1)[-1]
        for name in adaptable(modules)
        if BLOCK_NAME.search(name + ".") and ".experts." not in name + "." and not _in_router(name)
    }
    return sorted(leaves - set(ROUTERS) - (set(EXPERT_NAMES) if experts else set()))


def _in_router(name: str) -> bool:
    """Whether a module is a router or inside one (Granite's ``router.layer``, as its files name it)."""
    return any(part in ROUTERS for part in name.split(".")[:-1])


def moe_blocks(names: Iterable[str]) -> list[str]:
    """The modules that route tokens to experts, from a model's tensor names: each holds a
    router (``mlp.gate``, Granite's ``block_sparse_moe.router.layer``). Only meaningful for a
    model with experts (a dense model has no router)."""
    blocks = set()
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[1:-1], 1):
            if part in ROUTERS and BLOCK_NAME.search(".".join(parts[:i]) + "."):
                blocks.add(".".join(parts[:i]))
    return sorted(blocks)


def expert_slot_names(names: Iterable[str]) -> set[str]:
    """The names of the per-expert layers a checkpoint holds (``experts.0.gate_proj``: gate_proj),
    which peft turns into the fused experts' parameters when a target names them."""
    return {m.group(1) for name in names if (m := _EXPERT_SLOT.search(name.removesuffix(".weight")))}


def adapted(targets: list[str] | str | None, modules: dict[str, int], *, experts: bool = False) -> list[str]:
    """The modules ``targets`` adapts in a model of ``modules`` (with routed experts:
    ``experts``). "all-linear" is taken as the decoder blocks' 2-D weights (peft leaves out the
    output layer; embeddings are no linear layers); None as :func:`default_targets`."""
    if targets is None:
        targets = default_targets(modules, experts=experts)
    if is_all_linear(targets):
        return [name for name in adaptable(modules) if BLOCK_NAME.search(name + ".")]
    return [name for name in adaptable(modules) if matches(targets, name)]


def describe_adapted(
    targets: list[str] | str | None, modules: dict[str, int], *, moe_layers: int = 0, target_experts: bool = False
) -> str:
    """What validate says LoRA will adapt: "q_proj, k_proj, v_proj, o_proj (8 layers)", and on a
    model with ``moe_layers`` layers of routed experts whether it adapts them."""
    hits = [name for name in adapted(targets, modules, experts=moe_layers > 0) if ".experts." not in name + "."]
    said = f"{_leaf_names(hits)} ({len(hits)} layers)" if hits else "nothing"
    layers = f"{moe_layers} MoE layer{'s' if moe_layers != 1 else ''}"
    if moe_layers and target_experts:
        return f"{said}, and the routed experts of {layers} (their fused weights)"
    if moe_layers:
        return f"{said}; not the routed experts of its {layers} (model.lora.target_experts)"
    return said


def _leaf_names(names: Iterable[str]) -> str:
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    more = f" and {len(leaves) - _LISTED} more" if len(leaves) > _LISTED else ""
    return ", ".join(leaves[:_LISTED]) + more


def target_problems(
    targets: list[str] | str | None,
    modules: dict[str, int],
    model_dir: str,
    *,
    expert_slots: Iterable[str] = (),
    target_experts: bool = False,
) -> list[tuple[str, str]]:
    """(suffix of the key: "" or "[i]", why) for each target that adapts nothing in the model:
    a list entry that matches no module or only modules LoRA cannot adapt (a norm, a block),
    a regular expression that matches no adaptable module; the default when the model's blocks
    have no linear layer at all. Without ``target_experts``, also each target that peft would
    take as the routed experts' fused parameters (it names one of ``expert_slots``, the
    checkpoint's per-expert layers: :func:`expert_slot_names`)."""
    if targets is None:
        if default_targets(modules, experts=bool(expert_slots)):
            return []
        return [("", f"the decoder blocks of the model in {model_dir} have no linear layer to adapt: name the layers")]
    slots = set() if target_experts else set(expert_slots)
    if is_all_linear(targets):
        return [("", _reaches_experts(targets, sorted(slots)))] if slots else []
    names = _leaf_names(adaptable(modules))
    entries = [("", targets)] if isinstance(targets, str) else [(f"[{i}]", t) for i, t in enumerate(targets)]
    problems = []
    for suffix, target in entries:
        hits = [name for name in modules if matches([target] if suffix else target, name)]
        reached = sorted(slots & {name.rsplit(".", 1)[-1] for name in hits})
        if suffix and target.rsplit(".", 1)[-1] in slots:
            reached = [target.rsplit(".", 1)[-1]]  # peft's conversion matches the name itself
        if reached:
            problems.append((suffix, _reaches_experts(target, reached)))
            continue
        if not hits:
            why = f"{target!r} matches no layer of the model in {model_dir}"
        elif not any(modules[name] == 2 for name in hits):
            why = f"{target!r} matches only {_leaf_names(hits)}, which LoRA cannot adapt (no linear layer)"
        else:
            continue
        problems.append((suffix, f"{why}; its linear layers are named {names}"))
    return problems


def _reaches_experts(target: str, slots: list[str]) -> str:
    return (
        f"{target!r} names {', '.join(slots)}, which peft adapts as the routed experts' fused parameters "
        "(on every layer of that name, dense and shared-expert MLPs too): set model.lora.target_experts = true to "
        "adapt the experts (their LoRA has no dropout), or leave target_modules unset for the layers outside them"
    )
