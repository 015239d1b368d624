"""Activation offloading: tensors kept for backward wait in pinned host memory.

``[model] activation_offloading = true`` (with ``gradient_checkpointing``) wraps each
micro-batch's forward and backward in :func:`offload_activations`. While it is open,
every tensor autograd saves for backward goes through ``saved_tensors_hooks``:

pack (forward)
    Small tensors (under ``min_bytes``), tensors not on a CUDA device, and parameters
    (or views and casts of them) are kept as they are. Any other tensor is copied to a
    pinned host buffer on a side stream (``d2h``) that first waits for the compute
    stream, so the copy reads finished data. ``record_stream(d2h)`` tells the caching
    allocator that the side stream uses the GPU memory: when the compute stream frees
    the tensor, its block is not handed out again before the copy has finished. The
    packed form holds the host buffer and the copy's event. The same tensor saved
    twice and not modified in between (one input fed to two layers) is copied once.

unpack (backward)
    The tensor is copied back to the GPU on a second side stream (``h2d``), which
    first waits for the D2H event; the compute stream waits for the H2D copy before
    using the result, and ``record_stream`` marks the result as used by the compute
    stream. Unpacking one tensor also starts the copy back of the tensor packed just
    before it (backward runs in reverse), so that copy overlaps this block's
    recomputation. Pinned buffers are returned to PyTorch's pinned-memory cache, which
    waits for the copies that used them.

With non-reentrant checkpointing the saved tensors are, essentially, each block's
input (``torch.utils.checkpoint`` saves its inputs through these hooks; the block's
own intermediates go through checkpoint's hooks and are recomputed). On a CPU run
offloading has nothing to move: :func:`offload_activations` logs that once and
returns a null context.

The transfers are behind a small interface (:class:`CudaTransfer`); tests run the
same bookkeeping with :class:`CopyTransfer` (a plain copy on the CPU), which checks
that gradients come out identical and that parameters are never moved.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

log = logging.getLogger("trainer.memory.activation_offload")

MIN_OFFLOAD_BYTES = 1 << 20  # smaller tensors are not worth a transfer


def _is_parameter_like(tensor: torch.Tensor) -> bool:
    """A parameter, a view of one (``weight.t()`` saved by ``linear``), or its cast under
    autocast: resident anyway, so moving it would only cost a copy."""
    if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
        return True
    node = tensor.grad_fn
    for _ in range(3):  # ToCopyBackward0 / TBackward0 / ... down to the parameter's AccumulateGrad
        if node is None:
            return False
        variable = getattr(node, "variable", None)
        if variable is not None:
            return isinstance(variable, torch.nn.Parameter)
        if type(node).__name__ not in ("ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0"):
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


@dataclass(eq=False)
class _Packed:
    """One offloaded tensor: the host copy and what the transfer needs to bring it back."""

    key: int
    host: torch.Tensor
    device: torch.device
    ready: Any = None  # the transfer's marker that the host copy is complete


@dataclass
class _Fetched:
    tensor: torch.Tensor
    ready: Any = None


class CudaTransfer:
    """Device -> pinned host and back on two side streams, with events and record_stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compute = torch.cuda.current_stream(self.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.d2h.wait_stream(compute)  # the tensor's producer has run
        with torch.cuda.stream(self.d2h):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        tensor.record_stream(self.d2h)  # its memory is not reused before the copy has finished
        return host, done

    def start_fetch(self, packed: _Packed) -> _Fetched:
        """Start the copy back on the H2D stream (used for prefetching)."""
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(packed.ready)  # the D2H copy has finished
            tensor = packed.host.to(packed.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        return _Fetched(tensor, done)

    def finish_fetch(self, fetched: _Fetched) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(fetched.ready)
        fetched.tensor.record_stream(compute)  # allocated on h2d, used and freed on the compute stream
        return fetched.tensor

    def fetch_now(self, packed: _Packed) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(packed.ready)
        return packed.host.to(packed.device, non_blocking=True)


class CopyTransfer:
    """The same protocol as a plain synchronous copy to the CPU: for tests of the hooks'
    bookkeeping on machines without a GPU (``device`` names what counts as offloadable)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.moved = 0  # tensors copied out
        self.fetched = 0  # tensors copied back

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.moved += 1
        return tensor.detach().to("cpu", copy=True), None

    def start_fetch(self, packed: _Packed) -> _Fetched:
        return _Fetched(packed.host.to(packed.device, copy=True))

    def finish_fetch(self, fetched: _Fetched) -> torch.Tensor:
        self.fetched += 1
        return fetched.tensor

    def fetch_now(self, packed: _Packed) -> torch.Tensor:
        self.fetched += 1
        return packed.host.to(packed.device, copy=True)


@dataclass
class ActivationOffloader:
    """The pack and unpack hooks and their state for one forward + backward."""

    transfer: CudaTransfer | CopyTransfer
    min_bytes: int = MIN_OFFLOAD_BYTES
    prefetch: int = 1
    _next_key: int = 0
    _live: dict[int, _Packed] = field(default_factory=dict)  # packed, not yet unpacked
    _prefetched: dict[int, _Fetched] = field(default_factory=dict)
    _seen: Any = field(default_factory=WeakTensorKeyDictionary)  # tensor -> (its _Packed, version)

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == self.transfer.device.type
            and tensor.layout == torch.strided
            and not tensor.is_sparse
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            and not _is_parameter_like(tensor)
        )

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self._offloadable(tensor):
            return tensor
        known = self._seen.get(tensor)
        if known is not None and known[1] == tensor._version:
            return known[0]  # saved again, unchanged since: one host copy serves both
        host, ready = self.transfer.to_host(tensor)
        packed = _Packed(self._next_key, host, tensor.device, ready)
        self._next_key += 1
        self._live[packed.key] = packed
        self._seen[tensor] = (packed, tensor._version)
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        fetched = self._prefetched.pop(packed.key, None)
        tensor = self.transfer.finish_fetch(fetched) if fetched is not None else self.transfer.fetch_now(packed)
        self._live.pop(packed.key, None)
        # Backward unpacks in about the reverse order of packing: start bringing back the
        # tensor(s) packed just before this one.
        for key in range(packed.key - 1, packed.key - 1 - self.prefetch, -1):
            earlier = self._live.get(key)
            if earlier is not None and key not in self._prefetched:
                self._prefetched[key] = self.transfer.start_fetch(earlier)
        return tensor

    def clear(self) -> None:
        self._live.clear()
        self._prefetched.clear()
        self._seen = WeakTensorKeyDictionary()

    @contextlib.contextmanager
    def hooks(self):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self.clear()


_logged_noop = False


def make_offloader(device: torch.device, enabled: bool) -> ActivationOffloader | None:
    """The trainer's offloader: one per job on a CUDA device when enabled, else None (with one
    log line on CPU, where there is nothing to offload)."""
    global _logged_noop
    if not enabled:
        return None
    if device.type != "cuda":
        if not _logged_noop:
            log.info("activation offloading: no-op on %s (nothing to move to host memory)", device.type)
            _logged_noop = True
        return None
    return ActivationOffloader(CudaTransfer(device))


def offload_activations(offloader: ActivationOffloader | None):
    """The context to open around one micro-batch's forward and backward."""
    return offloader.hooks() if offloader is not None else contextlib.nullcontext()
