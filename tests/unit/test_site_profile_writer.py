"""The site profile `jobgen site init` writes (jobgen.sites.profile_writer) and where it goes
(jobgen.sites.config_dir): TOML that SiteProfile accepts, with what Slurm says of the chosen
partition's nodes, for a uniform cluster and an unequal one (the dev cluster's 3 and 1 GPUs)."""

from __future__ import annotations

import copy
import os
import stat
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
from click.testing import CliRunner

from jobgen.sites.config_dir import ProfileExists, profile_path, user_sites_dir, write_profile
from jobgen.sites.inventory import Inventory, Node, NoSuchPartition, Partition
from jobgen.sites.profile_writer import ProfileChoices, ProfileError, profile_text, toml_string
from jobgen.spec.tables.site import PythonSettings, SiteProfile, SlurmSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEBUG = Partition("debug", default=True, max_time=86400, nodes="node[1-2]", state="UP")
SHORT = Partition("short", default=False, max_time=300, nodes="node[1-2]", state="UP")
# The dev cluster of `jobgen cluster up --gpus 3,1`: unequal machines.
DEV = Inventory(
    (DEBUG, SHORT),
    (
        Node("node1", 4, 4096, gpus=3, gpu_type=None, features=(), partitions=("debug", "short")),
        Node("node2", 4, 4096, gpus=1, gpu_type=None, features=(), partitions=("debug", "short")),
    ),
    "22.05.8",
)
# Four 8xH100 nodes, one of them with cores kept for Slurm's daemons; a CPU partition with no default.
H100 = Inventory(
    (
        Partition("gpu", default=False, max_time=2 * 86400, nodes="gpu[1-4]", state="UP"),
        Partition("cpu", default=False, max_time=None, nodes="cpu1", state="UP"),
        Partition("old", default=False, max_time=3600, nodes="", state="DOWN", hidden=True),
    ),
    (
        *(Node(f"gpu{i}", 96, 1031000, 8, "h100", ("h100", "ib"), ("gpu",)) for i in (1, 2, 3, 4)),
        Node("cpu1", 64, 515000, 0, None, (), ("cpu",)),
    ),
    "23.11.4",
)


def profile(inventory: Inventory = DEV, name: str = "devtest", **choices: Any) -> str:
    return profile_text(inventory, name, ProfileChoices(**choices), written_on="2026-12-06", host="login1")


def accepted(text: str) -> dict[str, Any]:
    """The profile as TOML, after SiteProfile accepted it: all of it once site.py has
    slurm.node_shapes and python.kind = "auto"; until then, all but those."""
    data = tomllib.loads(text)
    checked = copy.deepcopy(data)
    if "node_shapes" not in SlurmSettings.model_fields:
        del checked["slurm"]["node_shapes"]
    if "auto" not in get_args(PythonSettings.model_fields["kind"].annotation):
        del checked["python"]
    SiteProfile.model_validate(checked)
    return data


def test_unequal_nodes_the_dev_cluster():
    text = profile()
    data = accepted(text)
    assert data["name"] == "devtest"
    slurm = data["slurm"]
    assert (slurm["partition"], slurm["gpus_per_node"], slurm["cpus_per_node"], slurm["mem"]) == ("debug", 3, 4, "0")
    assert slurm["gres_name"] == "gpu"
    assert slurm["node_shapes"] == [
        {"nodes": "node1", "gpus": 3, "cpus": 4, "memory": "4096M"},
        {"nodes": "node2", "gpus": 1, "cpus": 4, "memory": "4096M"},
    ]
    assert "differ in GPUs: 3 (node1), 1 (node2)" in text
    assert data["network"] == {"transport": "socket", "resolve_head_ip": True}  # ifname: commented out
    assert "# ifname = " in text and "jobgen doctor --site devtest" in text
    assert data["paths"] == {"runs_root": "~/jobgen-runs"} and data["python"] == {"kind": "auto"}
    assert data["env"] == {}
    for key in ("account", "qos", "reservation"):
        assert key not in slurm and f"# {key} = " in text


def test_the_header_names_every_partition_its_max_time_and_the_choice():
    header = [line for line in profile().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    assert "written by `jobgen site init devtest` on 2026-12-06" in text
    assert "from Slurm 22.05.8 on host login1" in text
    assert any("debug" in h and "MaxTime 1-00:00:00" in h and "2 node(s)" in h and "default" in h for h in header)
    assert any("short" in h and "MaxTime 00:05:00" in h and "default" not in h for h in header)
    assert "--partition PARTITION" in text
    assert "this profile's" in next(h for h in header if "debug" in h)


def test_a_uniform_cluster_and_its_typed_gres():
    text = profile(H100, "h100", partition="gpu")
    slurm = accepted(text)["slurm"]
    assert (slurm["partition"], slurm["gpus_per_node"], slurm["gres_name"], slurm["cpus_per_node"]) == (
        "gpu",
        8,
        "gpu:h100",
        96,
    )
    assert slurm["node_shapes"] == [{"nodes": "gpu1,gpu2,gpu3,gpu4", "gpus": 8, "cpus": 96, "memory": "1031000M"}]
    assert "differ" not in text
    assert "MaxTime UNLIMITED" in text and "MaxTime 2-00:00:00" in text and "state DOWN" in text


def test_reserved_cores_lower_the_cpus_asked_for():
    nodes = (*H100.nodes[:3], Node("gpu4", 96, 1031000, 8, "h100", (), ("gpu",), usable_cpus=92))
    text = profile(Inventory(H100.partitions, nodes, "23.11.4"), "h100", partition="gpu")
    slurm = accepted(text)["slurm"]
    assert slurm["cpus_per_node"] == 92 and "(of CPUTot 96" in text
    assert [s["cpus"] for s in slurm["node_shapes"]] == [96, 92]


def test_a_cpu_partition():
    slurm = accepted(profile(H100, "cpus", partition="cpu"))["slurm"]
    assert (slurm["gpus_per_node"], slurm["gres_name"], slurm["cpus_per_node"]) == (0, "gpu", 64)


def test_the_choices_become_keys():
    choices = dict(
        partition="short",
        runs_root="/shared/runs",
        ifname="ib0",
        transport="ib",
        account="llm",
        qos="high",
        reservation="maint",
        gres_name="gpu:fake",
    )
    data = accepted(profile(**choices))
    slurm = data["slurm"]
    assert (slurm["partition"], slurm["account"], slurm["qos"], slurm["reservation"]) == (
        "short",
        "llm",
        "high",
        "maint",
    )
    assert slurm["gres_name"] == "gpu:fake"
    assert data["network"] == {"ifname": "ib0", "transport": "ib", "resolve_head_ip": True}
    assert data["paths"]["runs_root"] == "/shared/runs"


def test_a_choice_the_spec_refuses_is_named_by_its_key():
    with pytest.raises(ProfileError, match=r"slurm\.account: 'my account' is not a Slurm name"):
        profile(account="my account")
    with pytest.raises(ProfileError, match=r"paths\.runs_root"):
        profile(runs_root="/shared/$USER")


@pytest.mark.parametrize("bad", ['gpu"; rm', "my part"])
def test_a_partition_name_slurm_gives_that_the_spec_refuses(bad):
    inventory = Inventory(
        (Partition(bad, True, None, "n1", "UP"),), (Node("n1", 4, 4096, 0, None, (), (bad,)),), "23.11.4"
    )
    with pytest.raises(ProfileError, match=r"partition name from Slurm: .* is not a Slurm name"):
        profile(inventory)


def test_a_node_name_slurm_gives_that_the_spec_refuses():
    inventory = Inventory((DEBUG,), (Node("node'1", 4, 4096, 0, None, (), ("debug",)),), "23.11.4")
    with pytest.raises(ProfileError, match=r"node name from Slurm \(partition 'debug'\): .* is not a Slurm name"):
        profile(inventory)


def test_no_such_partition_and_an_empty_one():
    with pytest.raises(NoSuchPartition, match="its partitions: debug, short"):
        profile(partition="gpu")
    with pytest.raises(NoSuchPartition, match="choose one with --partition: gpu, cpu, old"):
        profile(H100)
    with pytest.raises(ProfileError, match="partition 'old' has no nodes"):
        profile(H100, partition="old")
    with pytest.raises(ProfileError, match="site name"):
        profile(name="../etc")


@pytest.mark.parametrize("value", ['a"b', "back\\slash", "new\nline", "tab\there", "caf\u00e9 \U0001f600", "\x7f"])
def test_toml_strings_read_back_as_written(value):
    assert tomllib.loads(f"key = {toml_string(value)}")["key"] == value


# ---------------------------------------------------------------- the user's sites directory


@pytest.fixture()
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    old = os.umask(0o022)
    yield tmp_path / "config"
    os.umask(old)


def test_the_loader_finds_what_site_init_writes(config_home: Path):
    from jobgen.spec.loader import find_site_file

    path = write_profile("devtest", profile())
    assert find_site_file("devtest", Path("/nonexistent")) == path


def test_write_profile_is_private_and_refuses_to_overwrite(config_home: Path):
    path = write_profile("devtest", "first\n")
    assert path == config_home / "jobgen" / "sites" / "devtest.toml" == profile_path("devtest")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(ProfileExists, match=r"devtest\.toml exists; .*--force"):
        write_profile("devtest", "second\n")
    assert path.read_text() == "first\n"
    write_profile("devtest", "second\n", force=True)
    assert path.read_text() == "second\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["devtest.toml"]  # no temporary left


def test_the_sites_directory_without_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert user_sites_dir() == tmp_path / ".config" / "jobgen" / "sites"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert user_sites_dir() == tmp_path / "xdg" / "jobgen" / "sites"
    with pytest.raises(ProfileError, match="site name"):
        profile_path("../../x")


# ---------------------------------------------------------------- the command


@pytest.fixture()
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("jobgen.sites.inventory.read_inventory", lambda: DEV)


def test_site_init_writes_then_refuses_without_force(config_home: Path, fake_slurm: None):
    from jobgen.cli.main import main

    result = CliRunner().invoke(main, ["site", "init", "devtest", "--partition", "short"])
    assert result.exit_code == 0, result.output
    path = config_home / "jobgen" / "sites" / "devtest.toml"
    assert f"wrote {path}" in result.output and "jobgen doctor --site devtest" in result.output
    assert 'site = "devtest"' in result.output and "jobgen validate run.toml" in result.output
    assert accepted(path.read_text())["slurm"]["partition"] == "short"
    again = CliRunner().invoke(main, ["site", "init", "devtest"])
    assert again.exit_code == 1 and "--force" in again.output


def test_site_init_print_and_errors_in_one_line(config_home: Path, fake_slurm: None):
    from jobgen.cli.main import main

    result = CliRunner().invoke(main, ["site", "init", "devtest", "--print"])
    assert result.exit_code == 0 and accepted(result.output)["slurm"]["partition"] == "debug"
    assert not (config_home / "jobgen").exists()
    result = CliRunner().invoke(main, ["site", "init", "devtest", "--partition", "gpu"])
    assert result.exit_code == 1 and "no partition 'gpu'" in result.output and "Traceback" not in result.output


def test_site_init_without_slurm(monkeypatch: pytest.MonkeyPatch):
    from jobgen.cli.main import main
    from jobgen.slurm import client

    def unreachable() -> list[dict[str, str]]:
        raise client.SlurmUnavailable(["scontrol"], 1, "Unable to contact slurm controller")

    monkeypatch.setattr(client, "partitions", unreachable)
    monkeypatch.setattr(client, "version", lambda: (23, 11, 4))
    result = CliRunner().invoke(main, ["site", "init", "devtest", "--print"])
    assert result.exit_code == 1 and "Slurm does not answer" in result.output
    assert "jobgen cluster up" in result.output
