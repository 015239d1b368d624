"""NCCL's communicator buffers on each GPU, for ``jobgen plan``.

NCCL allocates these itself (cudaMalloc or cuMem, not through torch's caching allocator), so
``torch.cuda.max_memory_allocated`` never shows them; they live as long as the process group.
Per rank::

    sum over communicators of more than one rank of
        channels x peers x (Simple + LL + LL128 buffer)

- Simple: ``NCCL_BUFFSIZE``, 4 MiB by default. NCCL's user guide (Environment Variables,
  NCCL_BUFFSIZE: "Default is 4194304 (4 MB)") and ``DEFAULT_BUFFSIZE (1 << 22)`` in NCCL's
  ``src/init.cc``.
- LL: ``DEFAULT_LL_BUFFSIZE`` in ``src/init.cc``, NCCL_LL_LINES_PER_THREAD x
  NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine) = 8 x 512 x 8 x 16 = 512 KiB;
  ``NCCL_LL_BUFFSIZE`` overrides it.
- LL128: ``DEFAULT_LL128_BUFFSIZE``, NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x
  NCCL_STEPS x 8 bytes = 120 x 640 x 8 x 8 = 4.69 MiB (the constants of
  ``src/include/device.h``); ``NCCL_LL128_BUFFSIZE`` overrides it.
- peers: 2 per channel, a ring's previous and next rank (a tree's parent and child share
  the channel's connections in this count).
- channels: :data:`CHANNELS` by the site's ``network.transport``; ``NCCL_MAX_NCHANNELS``
  ("limits the number of channels NCCL can use", NCCL's environment variables) caps it.
  NCCL's channel count follows the node's topology; 32 is what NVLink/NVSwitch nodes with
  InfiniBand get, an Ethernet-only cluster is assumed to use fewer (an assumption, not
  a measurement: NCCL_DEBUG=INFO prints "Channel xx/NN" with the real count).
- communicators: one per process group that runs collectives. DDP and FSDP: the world's.
  HSDP (FSDP2 on a 2-D mesh): the world's, the shard group's (within a node) and the
  replicate group's (across nodes).

Every protocol's buffer on every channel: what a communicator holds once it has run all
three protocols, a figure to reserve rather than a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jobgen.base.sizes import MIB

DEFAULT_BUFFSIZE = 4 * MIB
DEFAULT_LL_BUFFSIZE = 8 * 512 * 8 * 16  # 512 KiB
DEFAULT_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # 4.69 MiB
PEERS_PER_CHANNEL = 2
# Channels NCCL opens per communicator, by network.transport (see the module docstring).
CHANNELS = {"ib": 32, "socket": 8}


@dataclass(frozen=True)
class NcclSettings:
    """What sizes NCCL's buffers: the site's transport and the NCCL variables of the job."""

    transport: str = "socket"
    buffsize: int = DEFAULT_BUFFSIZE
    ll_buffsize: int = DEFAULT_LL_BUFFSIZE
    ll128_buffsize: int = DEFAULT_LL128_BUFFSIZE
    max_channels: int | None = None

    @property
    def channels(self) -> int:
        default = CHANNELS.get(self.transport, CHANNELS["socket"])
        return min(default, self.max_channels) if self.max_channels else default

    @property
    def per_communicator(self) -> int:
        """Bytes one communicator of more than one rank holds on each of its GPUs."""
        return self.channels * PEERS_PER_CHANNEL * (self.buffsize + self.ll_buffsize + self.ll128_buffsize)


def _int(env: Mapping[str, str], name: str) -> int | None:
    """A positive integer variable; None when unset or not a number (NCCL ignores those too)."""
    try:
        value = int(str(env.get(name, "")).strip(), 0)
    except ValueError:
        return None
    return value if value > 0 else None


def settings_from(transport: str, env: Mapping[str, str]) -> NcclSettings:
    """The settings a job gets: ``env`` is what it exports (the site's [env] and
    [network.env], then the run's [env], which wins)."""
    return NcclSettings(
        transport=transport,
        buffsize=_int(env, "NCCL_BUFFSIZE") or DEFAULT_BUFFSIZE,
        ll_buffsize=_int(env, "NCCL_LL_BUFFSIZE") or DEFAULT_LL_BUFFSIZE,
        ll128_buffsize=_int(env, "NCCL_LL128_BUFFSIZE") or DEFAULT_LL128_BUFFSIZE,
        max_channels=_int(env, "NCCL_MAX_NCHANNELS"),
    )


def communicator_sizes(world_size: int, shard: int, hierarchical: bool) -> list[int]:
    """The ranks of each communicator a rank belongs to: the world's, and for HSDP its shard
    group's and its replicate group's."""
    sizes = [world_size]
    if hierarchical:
        sizes += [shard, world_size // max(1, shard)]
    return sizes


def buffer_bytes(settings: NcclSettings, world_size: int, shard: int, hierarchical: bool) -> int:
    """NCCL's buffers on one GPU: each communicator of more than one rank holds
    :attr:`NcclSettings.per_communicator`; one of a single rank connects to no peer."""
    members = communicator_sizes(world_size, shard, hierarchical)
    return sum(settings.per_communicator for size in members if size > 1)
