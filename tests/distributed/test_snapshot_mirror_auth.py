"""The snapshot mirror's authentication between two ranks on two "nodes" over real gloo (issue
45, trainer.checkpoints.snapshot_peers): the launch's key reaches both ranks through a file of
the user's own (gone once they connected), the job's payloads are kept, a rank that signs with
another key has its payload refused on the other end, an announced size of 10**11 bytes is
refused before the receiver allocates (under an address-space limit) and the sender is told so,
the exchange after a refusal works again (the two ends stay in step), and where the ranks do
not share the key's directory the mirror is off on both. One process of each rank, restore
and damaged files: tests/unit/test_snapshot_trust.py."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from helpers import REPO, VENV_BIN

pytestmark = pytest.mark.torch

WORKER = textwrap.dedent(
    """
    import json, os, resource, sys
    from pathlib import Path
    rank = int(os.environ["RANK"])
    os.environ["SLURMD_NODENAME"] = f"node{rank + 1}"
    shared, out = Path(sys.argv[1]), Path(sys.argv[2])
    os.environ["XDG_STATE_HOME"] = str(shared)
    import torch, torch.distributed as dist
    from trainer.checkpoints import snapshot_peers
    from trainer.checkpoints.snapshot_peers import SnapshotPeers, SnapshotRefused, key_directory
    from trainer.distributed import init_distributed

    env = init_distributed(60, 2, use_gpu=False)
    result = {}

    def exchange(peers, data, step):
        try:
            return sorted((s, b.decode()) for s, b in peers.exchange(data, step))
        except SnapshotRefused as exc:
            return f"refused: {exc}"

    peers = SnapshotPeers.connect(env, 60)
    result["connected"] = peers is not None
    result["key_files_left"] = sorted(p.name for p in key_directory().iterdir())
    result["key_directory_mode"] = oct(key_directory().stat().st_mode & 0o777)
    result["job's own"] = exchange(peers, f"rank {rank} at 2".encode(), 2)

    real = peers._key
    if rank == 1:
        peers._key = bytes(32)  # signs with a key that is not the launch's
    result["another key"] = exchange(peers, f"rank {rank} at 4".encode(), 4)
    peers._key = real

    if rank == 0:  # receives a claim of 10**11 bytes, with at most 512 MiB more to map
        with open("/proc/self/status") as fh:
            mapped = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (512 << 20), resource.RLIM_INFINITY))
        result["oversized"] = exchange(peers, b"rank 0 at 6", 6)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    else:  # rank 1 speaks the protocol by hand: its header claims 10**11 bytes
        header = torch.zeros(6, dtype=torch.int64)
        works = [dist.isend(torch.tensor([10**11, 6, 0, 0, 0, 0]), dst=0, group=peers.group),
                 dist.irecv(header, src=0, group=peers.group)]
        [w.wait() for w in works]
        verdict = torch.zeros(1, dtype=torch.int64)
        works = [dist.isend(torch.tensor([1]), dst=0, group=peers.group),
                 dist.irecv(verdict, src=0, group=peers.group)]
        [w.wait() for w in works]
        dist.irecv(torch.empty(int(header[0]), dtype=torch.uint8), src=0, group=peers.group).wait()
        result["oversized"] = f"told {int(verdict[0])}"
    result["after the refusals"] = exchange(peers, f"rank {rank} at 8".encode(), 8)

    # Each rank with a state directory of its own (a home its node does not share): no mirror.
    snapshot_peers.KEY_WAIT_SECONDS = 1.0
    os.environ["XDG_STATE_HOME"] = str(shared / f"rank{rank}")
    result["unshared"] = SnapshotPeers.connect(env, 60) is not None
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(240)
def test_the_mirror_keeps_only_what_the_launchs_key_signed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank, other in ((0, 1), (1, 0)):
        got = ranks[rank]
        assert got["connected"] and got["key_files_left"] == [] and got["key_directory_mode"] == "0o700", got
        assert got["job's own"] == [[other, f"rank {other} at 2"]], got
        assert got["another key"].startswith("refused: snapshot of step 4 not kept: from rank"), got
        assert "its tag is not the job's" in got["another key"], got
        assert got["after the refusals"] == [[other, f"rank {other} at 8"]], got
        assert got["unshared"] is False, got
    assert "it announced 100000000000 bytes" in ranks[0]["oversized"], ranks[0]
    assert ranks[1]["oversized"] == "told 0"
    assert "could not read the key rank 0 wrote" in proc.stdout + proc.stderr
