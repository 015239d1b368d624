"""Unequal nodes placed from the site's node_shapes (jobgen.spec.node_shapes): a run with
``procs_per_node = [3, 1]`` on a GPU site whose profile describes its nodes needs no
``job.nodelist``; the nodes chosen have exactly each entry's GPUs, in Slurm's order."""

from __future__ import annotations

from pathlib import Path

from helpers import DATA, run_spec, spec_issues
from jobgen.spec.loader import load_run
from jobgen.spec.node_shapes import expand_hostlist, place
from jobgen.spec.tables.site import NodeShape


def shape(nodes: str, gpus: int) -> NodeShape:
    return NodeShape(nodes=nodes, gpus=gpus, cpus=4)


def test_hostlists_are_expanded_as_slurm_writes_them():
    assert expand_hostlist("node1,node2") == ["node1", "node2"]
    assert expand_hostlist("gpu[01-03,07]") == ["gpu01", "gpu02", "gpu03", "gpu07"]
    assert expand_hostlist("a[1-2],b5") == ["a1", "a2", "b5"]
    assert expand_hostlist("rack[1-2]-gpu[1-2]") is None  # two groups: only scontrol reads it


def test_each_entry_gets_the_next_node_with_exactly_its_gpus():
    shapes = [shape("node1", 3), shape("node2", 1), shape("node3", 2)]
    assert place((3, 1), shapes) == ["node1", "node2"]
    assert place((3, 2), shapes) == ["node1", "node3"]
    assert place((1, 3), shapes) is None  # entry N runs on node N of Slurm's order: node1 comes first
    assert place((3, 3), shapes) is None
    many = [shape("gpu[01-16]", 8), shape("gpu[17-18]", 4)]
    assert place((8, 8, 4), many) == ["gpu01", "gpu02", "gpu17"]
    assert place((2, 1), [shape("n10", 1), shape("n2", 2)]) == ["n2", "n10"]  # natural order


def site_with_shapes(tmp_path: Path) -> str:
    """A profile as `jobgen site init` writes it for nodes of 3 and 1 GPUs."""
    profile = tmp_path / "shapes-site.toml"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(
        'name = "shapes"\n[slurm]\ngpus_per_node = 3\ncpus_per_node = 4\ngpu_compute = false\n'
        '[[slurm.node_shapes]]\nnodes = "node1"\ngpus = 3\ncpus = 4\n'
        '[[slurm.node_shapes]]\nnodes = "node2"\ngpus = 1\ncpus = 4\n'
    )
    return str(profile)


def spec(tmp_path: Path, procs: list[int], site: str | dict[str, object]) -> Path:
    job = {"time": "1h", "nodes": 2, "procs_per_node": procs, "runs_root": str(tmp_path / "runs")}
    return run_spec(tmp_path, "uneq", site=site, job=job, model={"path": "org/m"}, data={"path": str(DATA)}, train={})


def test_a_profile_that_describes_its_nodes_places_3_and_1_without_a_nodelist(tmp_path: Path):
    loaded = load_run(spec(tmp_path, [3, 1], site_with_shapes(tmp_path)))
    assert loaded.run.job.nodelist == ["node1,node2"]
    issues = spec_issues(spec(tmp_path / "back", [1, 3], site_with_shapes(tmp_path)))
    assert "job.nodelist" in issues and "slurm.node_shapes has no such nodes" in issues["job.nodelist"], issues
    # Without node_shapes the nodes must still be named.
    issues = spec_issues(spec(tmp_path / "bare", [3, 1], {"profile": "local-gpu", "slurm": {"cpus_per_node": 4}}))
    assert "job.nodelist" in issues and "node_shapes" not in issues["job.nodelist"], issues
