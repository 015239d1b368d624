"""Expert parallelism (``train.expert_parallel = K``): each MoE layer's routed experts live on K
ranks, E / K each, and the tokens travel to them and back (all-to-all dispatch and combine).

    ep = ExpertParallel.for_world(train, env)     # None when K is 1
    ep.install(model)                             # before the blocks' fully_shard (FSDP2)

The layout, as torchtitan lays it out (torchtitan/distributed/expert_parallel.py): the world is
a 2-D mesh ``(edp, ep)``; the K consecutive ranks of an ``ep`` group hold different experts,
and the ``edp = world / K`` ranks that hold the same experts shard them further with FSDP2.
Every expert weight is a DTensor over that mesh (``Shard(0)`` on ``ep``, FSDP's shard on
``edp``) whose global shape is the whole layer's, so a checkpoint holds every expert once
under the names the model has, whatever K wrote it: a run resumes from K = 2 to K = 1 (or
any other world) as it resumes across world sizes. Every other parameter is FSDP-sharded over
the whole world as without expert parallelism.

The dispatch is the model's own: the MoE block's router runs on this rank's tokens as before
(its auxiliary loss, when the model computes one, is unchanged), then the experts module's
forward is replaced by one that sends each (token, chosen expert) pair to the rank holding
that expert, runs the library's experts forward there on the tokens received (each row with
its one expert, weight 1: the same function of the same weights as without expert
parallelism), sends the outputs back and sums them with the router's weights. Dropless: an
expert takes every token sent to it (no capacity, no token dropped); the rows each rank's
experts computed are counted, and every step's metrics line says the busiest rank's against the
mean (:meth:`ExpertParallel.load_report`: the imbalance a capacity factor would have to cover).

Gradients: an expert's gradient is the sum over its ``ep`` group's tokens (the all-to-all's
backward), and FSDP averages it over ``edp``: scaled by 1 / K on its way to the weights, it is
the average over the whole world every other parameter gets. (FSDP2's own divide factor would
do the same with a pre-multiplied sum, which gloo lacks.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from jobgen.spec.tables.run import TrainSpec
from trainer.distributed import DistEnv
from trainer.model.architecture import routed_experts
from trainer.model.errors import ModelError

log = logging.getLogger("trainer.parallel.expert_parallel")

MESH_DIMS = ("edp", "ep")


class ExpertParallelError(ModelError):
    """The model's experts cannot be split as train.expert_parallel asks; the message says why.
    A ModelError: every later task would fail the same way, so the run stops."""


@dataclass
class ExpertParallel:
    """This rank's place in the ``(edp, ep)`` mesh and the experts modules it installed on."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims MESH_DIMS
    degree: int
    world: int
    received: int = 0  # rows (token, expert) this rank's experts computed since the last report

    @classmethod
    def for_world(cls, train: TrainSpec, env: DistEnv) -> ExpertParallel | None:
        degree = train.expert_parallel
        if degree == 1:
            return None
        if env.world_size % degree:
            raise ExpertParallelError(
                f"this task's world: train.expert_parallel = {degree} must divide the world size {env.world_size}"
            )
        from torch.distributed.device_mesh import init_device_mesh

        shape = (env.world_size // degree, degree)
        mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=MESH_DIMS)
        log.info("expert parallel: each MoE layer's experts over %d ranks, each share over %d", degree, shape[0])
        return cls(mesh, degree, env.world_size)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ep")  # type: ignore[attr-defined]

    def install(self, model: torch.nn.Module, fsdp_kwargs: dict[str, object]) -> int:
        """Split every experts module of ``model`` (on the meta device or not) over the ``ep``
        ranks, shard each share over ``edp`` with FSDP2 and route its forward through the
        all-to-all. Returns the experts modules installed on; ExpertParallelError when the
        model has none or a layer's experts do not divide by the degree."""
        from torch.distributed.fsdp import fully_shard

        found = routed_experts(model)
        if not found:
            raise ExpertParallelError(
                f"train.expert_parallel = {self.degree}: the model has no routed experts to place on ranks"
            )
        for name, module in found:
            experts = next(p for p in module.parameters(recurse=False) if p.ndim == 3).shape[0]
            if experts % self.degree:
                raise ExpertParallelError(
                    f"{name} holds {experts} experts, which train.expert_parallel = {self.degree} does not divide"
                )
            self._distribute(module)
            _route(module, name, self, experts // self.degree)
            fully_shard(module, mesh=self.mesh["edp"], **fsdp_kwargs)  # type: ignore[index]
        model.expert_parallel_state = self  # what the step runner reports the load from
        return len(found)

    def load_report(self) -> dict[str, float]:
        """The step's rows computed by the busiest rank's experts and by a rank on average (two
        small all-reduces over the world, with expert parallelism only): their ratio is the
        routing's imbalance, which a capacity factor would have to cover. Dropless: no row is
        ever dropped."""
        counts = torch.tensor([float(self.received), float(self.received)], dtype=torch.float64)
        self.received = 0
        most = counts[:1].clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        dist.all_reduce(counts[1:], op=dist.ReduceOp.SUM)
        mean = float(counts[1]) / self.world
        return {
            "expert_rows_max": float(most),
            "expert_rows_mean": round(mean, 2),
            "expert_load_imbalance": round(float(most) / mean, 4) if mean else 1.0,
        }

    def _distribute(self, module: torch.nn.Module) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        ep_mesh = self.mesh["ep"]  # type: ignore[index]
        for pname, param in list(module.named_parameters(recurse=False)):
            # Shard(0) splits locally (no communication), on the meta device too.
            shared = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            module.register_parameter(pname, torch.nn.Parameter(shared, requires_grad=param.requires_grad))

    def dispatch(self, module, name, forward, hidden, top_k_index, top_k_weights, local_experts: int) -> torch.Tensor:
        """The experts' output for this rank's ``hidden`` [tokens, hidden] routed to
        ``top_k_index`` with ``top_k_weights`` [tokens, k], computed on the ranks that hold the
        experts. ``forward``: the library's experts forward, run on the local experts."""
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
        destination = torch.div(expert, local_experts, rounding_mode="floor")
        order = torch.argsort(expert, stable=True)  # by rank, then expert: the order each rank computes in
        send = torch.bincount(destination, minlength=self.degree)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        send_sizes, received_sizes = send.tolist(), received.tolist()
        rows = hidden[token[order]]
        inbound = _all_to_all(rows, received_sizes, send_sizes, self.group)
        local = (expert[order] % local_experts).contiguous()
        local_in = torch.empty(sum(received_sizes), dtype=local.dtype, device=local.device)
        dist.all_to_all_single(local_in, local, received_sizes, send_sizes, group=self.group)
        self.received += int(local_in.numel())
        ones = torch.ones(local_in.numel(), 1, dtype=hidden.dtype, device=hidden.device)
        computed = _on_local_experts(module, forward, inbound, local_in[:, None], ones, local_experts, self.degree)
        outbound = _all_to_all(computed, send_sizes, received_sizes, self.group)
        weights = top_k_weights.reshape(-1)[order].to(outbound.dtype)
        out = torch.zeros_like(hidden)
        return out.index_add(0, token[order], (outbound * weights[:, None]).to(hidden.dtype))


def _all_to_all(rows: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    """Rows to the ranks of ``group`` (``input_sizes[r]`` to rank r), differentiable: the
    backward sends the gradients back the same way."""
    from torch.distributed.nn.functional import all_to_all_single

    output = rows.new_empty((sum(output_sizes), *rows.shape[1:]))
    return all_to_all_single(output, rows.contiguous(), output_sizes, input_sizes, group=group)


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is scaled (the experts' 1 / K: see the module docstring)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _on_local_experts(module, forward, rows, index, weights, local_experts: int, ep_degree: int) -> torch.Tensor:
    """The library's experts forward on this rank's experts: its parameters seen as their local
    shares (``to_local``, differentiable), its expert count as theirs."""
    from torch.nn.utils.stateless import _reparametrize_module

    scale = 1.0 / ep_degree
    local = {name: _ScaleGrad.apply(p.to_local(), scale) for name, p in module.named_parameters(recurse=False)}
    total = module.num_experts
    module.num_experts = local_experts
    try:
        with _reparametrize_module(module, local):
            return forward(rows, index, weights)
    finally:
        module.num_experts = total


def _route(module: torch.nn.Module, name: str, ep: ExpertParallel, local_experts: int) -> None:
    """Replace ``module``'s forward (on the instance: FSDP2's hooks still run around it) with
    the dispatch through the all-to-all."""
    library_forward = module.forward  # the class's, bound: it runs inside the dispatch, without hooks

    def forward(hidden_states, top_k_index=None, top_k_weights=None):
        return ep.dispatch(module, name, library_forward, hidden_states, top_k_index, top_k_weights, local_experts)

    module.forward = forward  # type: ignore[method-assign]


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm of ``params`` whose shards lie on different meshes (the experts'
    ``(edp, ep)``, the rest's world), clipped to ``max_norm``: every rank holds a disjoint piece
    of every gradient, so the squares of the local pieces summed over the world are the square
    of the norm. torch's clip_grad_norm_ stacks the per-parameter norms, which it cannot do for
    DTensors of two meshes."""
    with torch.no_grad():
        grads = [p.grad for p in params if p.grad is not None]
        pieces = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        squares = torch.zeros((), dtype=torch.float64, device=pieces[0].device if pieces else None)
        for piece in pieces:
            squares += piece.double().pow(2).sum()
        dist.all_reduce(squares)
        total = squares.sqrt().float()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for piece in pieces:
            piece.mul_(coefficient.to(piece.dtype))
    return total
