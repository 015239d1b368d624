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

from jobgen.model.files import _LAYER as BLOCK_NAME
from jobgen.model.files import TensorInfo

ALL_LINEAR = "all-linear"
# Routers pick experts (their outputs are logits over experts): LoRA's default leaves them, as
# trainer.model.architecture does for the built model.
ROUTERS = ("gate", "router", "shared_expert_gate")
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


def default_targets(modules: dict[str, int]) -> list[str]:
    """What LoRA adapts when ``target_modules`` is unset, as last names: every linear layer of
    the decoder blocks (attention and MLP projections, fused ones such as Phi-3's ``qkv_proj``
    and GPT-NeoX's ``query_key_value`` included), routers left out, and the experts of an MoE
    layer too: transformers holds them fused, as parameters no LoRA layer wraps."""
    leaves = {
        name.rsplit(".", 1)[-1]
        for name in adaptable(modules)
        if BLOCK_NAME.search(name + ".") and ".experts." not in name + "."
    }
    return sorted(leaves - set(ROUTERS))


def adapted(targets: list[str] | str | None, modules: dict[str, int]) -> list[str]:
    """The modules ``targets`` adapts in a model of ``modules``. "all-linear" is taken as the
    decoder blocks' 2-D weights (peft leaves out the output layer; embeddings are no linear
    layers); None as :func:`default_targets`."""
    if targets is None:
        targets = default_targets(modules)
    if is_all_linear(targets):
        return [name for name in adaptable(modules) if BLOCK_NAME.search(name + ".")]
    return [name for name in adaptable(modules) if matches(targets, name)]


def describe_adapted(targets: list[str] | str | None, modules: dict[str, int]) -> str:
    """What validate says LoRA will adapt: "q_proj, k_proj, v_proj, o_proj (8 layers)"."""
    hits = adapted(targets, modules)
    return f"{_leaf_names(hits)} ({len(hits)} layers)" if hits else "nothing"


def _leaf_names(names: Iterable[str]) -> str:
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    more = f" and {len(leaves) - _LISTED} more" if len(leaves) > _LISTED else ""
    return ", ".join(leaves[:_LISTED]) + more


def target_problems(targets: list[str] | str | None, modules: dict[str, int], model_dir: str) -> list[tuple[str, str]]:
    """(suffix of the key: "" or "[i]", why) for each target that adapts nothing in the model:
    a list entry that matches no module or only modules LoRA cannot adapt (a norm, a block),
    a regular expression that matches no adaptable module; the default when the model's blocks
    have no linear layer at all."""
    if targets is None:
        if default_targets(modules):
            return []
        return [("", f"the decoder blocks of the model in {model_dir} have no linear layer to adapt: name the layers")]
    if is_all_linear(targets):
        return []
    names = _leaf_names(adaptable(modules))
    entries = [("", targets)] if isinstance(targets, str) else [(f"[{i}]", t) for i, t in enumerate(targets)]
    problems = []
    for suffix, target in entries:
        hits = [name for name in modules if matches([target] if suffix else target, name)]
        if not hits:
            why = f"{target!r} matches no layer of the model in {model_dir}"
        elif not any(modules[name] == 2 for name in hits):
            why = f"{target!r} matches only {_leaf_names(hits)}, which LoRA cannot adapt (no linear layer)"
        else:
            continue
        problems.append((suffix, f"{why}; its linear layers are named {names}"))
    return problems
