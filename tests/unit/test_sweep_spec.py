"""Sweeps, the spec side: [sweep] expanded into validated points, each problem named by the
point and the sweep key that caused it, and point names that say the overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import write_spec
from jobgen.spec.loader import SpecError, load_run
from jobgen.sweep.points import allocation, describe, is_sweep, load_sweep, point_names, short_keys

BASE = """
    site = "local"
    [job]
    name = "sft"
    time = "1h"
    runs_root = "runs"
    [model]
    path = "model"
    [data]
    path = "data.jsonl"
"""

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    return tmp_path


def sweep_file(directory: Path, sweep: str, base: str = BASE) -> Path:
    return write_spec(directory, base + sweep)


def issues_of(path: Path) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_sweep(path)
    return {issue.key: issue.message for issue in info.value.issues}


GRID = """
    [sweep]
    max_parallel = 2
    [sweep.grid]
    "train.lr" = [1e-4, 3e-4]
    "model.lora.r" = [8, 16]
"""


def test_a_grid_is_the_cross_product_in_the_order_written(workdir):
    sweep = load_sweep(sweep_file(workdir, GRID))
    assert sweep.name == "sft" and sweep.directory == workdir / "runs" / "sft"
    assert sweep.settings.max_parallel == 2 and sweep.settings.seeds is None
    assert sweep.base.run.job.name == "sft" and sweep.base.run.sweep is None
    assert [p.name for p in sweep.points] == ["lr-0.0001_r-8", "lr-0.0001_r-16", "lr-0.0003_r-8", "lr-0.0003_r-16"]
    assert sweep.points[1].overrides == {"train.lr": 1e-4, "model.lora.r": 16}
    assert list(sweep.points[1].overrides) == ["train.lr", "model.lora.r"]
    for point in sweep.points:
        run = point.spec.run
        assert run.train.lr == point.overrides["train.lr"] and run.model.lora.r == point.overrides["model.lora.r"]
        assert run.job.name == point.name and run.sweep is None
        assert point.spec.run_dir == workdir / "runs" / "sft" / "points" / point.name
        assert allocation(point.spec) == allocation(sweep.base)


def test_the_file_with_a_sweep_still_validates_as_a_run(workdir):
    path = sweep_file(workdir, GRID)
    spec = load_run(path)
    assert spec.run.sweep is not None and list(spec.run.sweep.grid) == ["train.lr", "model.lora.r"]
    assert is_sweep({"sweep": {}}) and not is_sweep({"job": {}})


def test_seeds_repeat_each_point_with_the_seed_last(workdir):
    base = BASE.replace('path = "data.jsonl"', 'path = "data.jsonl"\n    [train]\n    seed = 0')
    sweep = load_sweep(sweep_file(workdir, '[sweep]\nseeds = 2\n[sweep.grid]\n"train.lr" = [3e-4]\n', base))
    assert [p.name for p in sweep.points] == ["lr-0.0003_seed-0", "lr-0.0003_seed-1"]
    assert [p.spec.run.train.seed for p in sweep.points] == [0, 1]
    assert list(sweep.points[1].overrides) == ["train.lr", "train.seed"]


def test_seeds_start_at_the_default_seed(workdir):
    sweep = load_sweep(sweep_file(workdir, '[sweep]\nseeds = 2\npoints = [{ "train.lr" = 1e-3 }]\n'))
    assert [p.overrides["train.seed"] for p in sweep.points] == [1234, 1235]


def test_grid_points_come_before_explicit_points(workdir):
    sweep = load_sweep(
        sweep_file(
            workdir,
            """
            [sweep]
            points = [{ "train.lr" = 1e-3, "data.max_length" = 256 }, {}]
            [sweep.grid]
            "train.lr" = [1e-4]
            """,
        )
    )
    assert [p.name for p in sweep.points] == ["lr-0.0001", "lr-0.001_max_length-256", "base"]
    assert sweep.points[1].spec.run.data.max_length == 256
    assert sweep.points[2].overrides == {} and sweep.points[2].spec.run.train.lr == sweep.base.run.train.lr


def test_names_are_deterministic_valid_job_names(workdir):
    overrides = [
        {"train.lr": 3e-4, "model.lora.r": 16},
        {"train.lr": 1.2345678e-4, "data.format": "chat", "env.MY_VAR": "a b/c"},
        {"model.lora.target_modules": ["q_proj", "v_proj"], "data.packing": True},
        {"train.lr": 1e6},
    ]
    names = point_names(overrides)
    assert names == point_names(overrides)
    assert names[0] == "lr-0.0003_r-16"
    assert names[1] == "lr-0.00012345678_format-chat_MY_VAR-a-b-c"  # every digit: 'g' would drop some
    assert names[2].startswith("target_modules-") and names[2].endswith("_packing-true")
    assert names[3] == "lr-1e06"
    assert point_names([{"data.path": "/data/sets/mix-a.jsonl"}]) == ["path-mix-a.jsonl"]  # an absolute path: its name
    assert all(JOB_NAME.match(name) for name in names)
    # A point's name depends on its own overrides, not on its place or on which other points there are.
    assert point_names([overrides[0]]) == [names[0]]


def test_keys_sharing_their_last_part_are_named_in_full():
    overrides = [{"train.seed": 1, "data.seed": 2}]
    assert short_keys(overrides) == {"train.seed": "train.seed", "data.seed": "data.seed"}
    assert point_names(overrides) == ["train.seed-1_data.seed-2"]
    assert describe({"train.lr": 3e-4, "data.format": "chat"}, short_keys([{"train.lr": 1, "data.format": 1}])) == (
        'lr=0.0003, format="chat"'
    )


def test_a_long_name_keeps_a_prefix_and_gets_a_hash():
    long = {"env.SOME_LONG_VARIABLE_NAME": "x" * 40, "env.ANOTHER_LONG_NAME": "y" * 30}
    [name] = point_names([long])
    assert len(name) <= 64 and JOB_NAME.match(name)
    assert re.fullmatch(r"SOME_LONG_VARIABLE_NAME-x+-[0-9a-f]{8}", name), name
    assert point_names([long]) == [name]
    assert point_names([{**long, "env.ANOTHER_LONG_NAME": "z" * 30}]) != [name]


def test_distinct_points_that_read_the_same_get_a_hash():
    names = point_names([{"data.path": "a/b.jsonl"}, {"data.path": "a-b.jsonl"}, {"data.path": "c.jsonl"}])
    assert names[0] != names[1] and all(re.fullmatch(r"path-a-b.jsonl-[0-9a-f]{8}", n) for n in names[:2])
    assert names[2] == "path-c.jsonl"


def test_an_unknown_key_names_the_point_and_the_key(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\n[sweep.grid]\n"train.lrr" = [1e-4]\n'))
    assert list(found) == ['sweep.grid."train.lrr"']
    assert found['sweep.grid."train.lrr"'].startswith("point lrr=0.0001: ")
    assert "Extra inputs" in found['sweep.grid."train.lrr"']


def test_a_wrong_type_names_every_point_it_spoils(workdir):
    path = sweep_file(workdir, '[sweep]\n[sweep.grid]\n"train.lr" = ["fast", 1e-4]\n"model.lora.r" = [8, 16]\n')
    with pytest.raises(SpecError) as info:
        load_sweep(path)
    issues = info.value.issues
    assert [i.key for i in issues] == ['sweep.grid."train.lr"'] * 2
    assert issues[0].message.startswith('point lr="fast", r=8: ') and issues[1].message.startswith(
        'point lr="fast", r=16: '
    )
    assert all("valid number" in i.message and i.file == str(path) for i in issues)


def test_an_explicit_point_is_named_by_its_index(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{ "train.lr" = 1e-3 }, { "train.lr" = "fast" }]\n'))
    assert list(found) == ['sweep.points[1]."train.lr"'] and found['sweep.points[1]."train.lr"'].startswith(
        'point lr="fast": '
    )


def test_a_key_whose_parent_is_no_table(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{ "data.path.x" = 1 }]\n'))
    message = found['sweep.points[0]."data.path.x"']
    assert message == 'point x=1: cannot set data.path.x: data.path is "data.jsonl", not a table'


def test_two_points_that_resolve_to_one_run(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{ "train.lr" = 1e-3 }, { "train.lr" = 0.001 }]\n'))
    assert "the same run as point lr=0.001 (lr-0.001)" in found["sweep.points[1]"]
    # A point that sets a key to the file's own value is the file's run.
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{}, { "data.max_length" = 1024 }]\n'))
    assert "the same run as point base" in found["sweep.points[1]"]


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("site", '"local"', "site profile"),
        ("site.slurm.partition", '"gpu"', "site profile"),
        ("sweep.max_parallel", "3", "cannot change the sweep"),
        ("job.name", '"other"', "names the sweep"),
        ("job.runs_root", '"elsewhere"', "runs_root/<job.name>/points/<point>"),
        ("job", "{}", "may not set job.name"),
    ],
)
def test_keys_a_sweep_may_not_set(workdir, key, value, why):
    found = issues_of(sweep_file(workdir, f'[sweep]\n[sweep.grid]\n"{key}" = [{value}]\n'))
    quoted = f'"{key}"' if "." in key else key
    assert why in found[f"sweep.grid.{quoted}"]
    found = issues_of(sweep_file(workdir, f'[sweep]\npoints = [{{ "{key}" = {value} }}]\n'))
    assert why in found[f"sweep.points[0].{quoted}"]


def test_a_sweep_without_points(workdir):
    found = issues_of(sweep_file(workdir, "[sweep]\nmax_parallel = 2\n"))
    assert "at least one point" in found["sweep"]
    assert "at least one" in issues_of(sweep_file(workdir, '[sweep.grid]\n"train.lr" = []\n'))['sweep.grid."train.lr"']


def test_bad_sweep_settings(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\nmax_parallel = 0\nseeds = 0\nfoo = 1\npoints = [{ "a..b" = 1 }]\n'))
    assert set(found) == {"sweep.max_parallel", "sweep.seeds", "sweep.foo", 'sweep.points[0]."a..b"'}
    assert "not a dotted key" in found['sweep.points[0]."a..b"']


def test_seeds_and_a_swept_seed(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\nseeds = 2\n[sweep.grid]\n"train.seed" = [1, 2]\n'))
    assert "not both" in found["sweep"]


def test_overlapping_keys(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{ "model.lora" = { r = 4 }, "model.lora.r" = 8 }]\n'))
    assert "sweep.points[0] sets both model.lora and model.lora.r" in found["sweep"]


def test_a_point_must_ask_slurm_for_what_the_file_asks(workdir):
    found = issues_of(sweep_file(workdir, '[sweep]\n[sweep.grid]\n"job.nodes" = [1, 2]\n'))
    message = found['sweep.grid."job.nodes"']
    assert message.startswith("point nodes=2: one Slurm array asks the same of every task, and job.nodes")
    assert "--nodes=2 instead of --nodes=1" in message
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{ "job.time" = "2h", "train.lr" = 1e-3 }]\n'))
    assert (
        "job.time changes the request (--time=02:00:00 instead of --time=01:00:00)"
        in found['sweep.points[0]."job.time"']
    )


def test_allocation_leaves_out_the_run_directory(workdir):
    sweep = load_sweep(sweep_file(workdir, '[sweep]\npoints = [{ "job.array" = 3 }]\n'))
    spec = sweep.points[0].spec
    assert allocation(spec) == allocation(sweep.base)
    assert not any(d.startswith(("--job-name", "--chdir", "--output", "--open-mode")) for d in allocation(spec))
    assert "--nodes=1" in allocation(spec)
    nodes = load_run(write_spec(workdir, BASE.replace('time = "1h"', 'time = "1h"\n    nodes = 2'), "two.toml"))
    assert allocation(nodes) != allocation(spec)


def test_too_many_points_are_refused_before_expanding(workdir):
    values = list(range(1, 101))
    body = f'[sweep]\n[sweep.grid]\n"train.seed" = {values}\n"data.max_length" = {[8 + v for v in values]}\n'
    found = issues_of(sweep_file(workdir, body))
    assert "10000 points" in found["sweep"]


def test_more_array_tasks_than_one_array_holds_are_refused_at_validate(workdir):
    from click.testing import CliRunner

    from jobgen.cli.main import main

    # 1000 points of 2 tasks each: refused by jobgen validate, the key named, not first by sbatch.
    body = f'[sweep]\n[sweep.grid]\n"train.seed" = {list(range(1000))}\n'
    path = sweep_file(workdir, body, BASE.replace('time = "1h"', 'time = "1h"\n    array = 2'))
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "job.array: 1000 points need 2000 array tasks (job.array = 2 each)" in result.stderr, result.stderr
    # job.array set by the points: counted once they are built.
    found = issues_of(sweep_file(workdir, '[sweep]\npoints = [{ "job.array" = 600 }, { "job.array" = 401 }]\n'))
    assert "2 points need 1001 array tasks" in found["job.array"], found


def test_a_file_without_sweep(workdir):
    assert "no [sweep] table" in issues_of(write_spec(workdir, BASE))["sweep"]


def test_the_sweep_directory_must_be_a_plain_path(workdir):
    """A point's job.runs_root is the sweep's directory, validated (SafePath) like any runs_root,
    and again when spec.json is read: a space in the directory run.toml sits in is refused once."""
    spaced = workdir / "my dir"
    (spaced / "model").mkdir(parents=True)
    (spaced / "data.jsonl").write_text((workdir / "data.jsonl").read_text())
    found = issues_of(sweep_file(spaced, '[sweep]\n[sweep.grid]\n"train.lr" = [1e-4, 3e-4]\n'))
    assert list(found) == ["job.runs_root"] and "must be a plain path" in found["job.runs_root"]
