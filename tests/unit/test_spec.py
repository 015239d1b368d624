"""Validation: every problem named by file and key, all reported at once."""

from pathlib import Path

import pytest

from helpers import REPO, jobgen, write_spec
from jobgen.base.paths import EXAMPLES_DIR
from jobgen.spec.loader import SpecError, load_run

GOOD = """
    site = "local"
    [job]
    name = "sft"
    nodes = 2
    procs_per_node = 2
    time = "2h"
    [model]
    path = "model"
    [data]
    path = "data.jsonl"
"""


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    return tmp_path


def issues_of(path: Path) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_run(path)
    return {f"{Path(i.file).name}:{i.key}": i.message for i in info.value.issues}


def test_good_spec_resolves_paths_and_derives_world_size(workdir):
    spec = load_run(write_spec(workdir, GOOD))
    assert spec.world_size == 4
    assert spec.run.model.path == str((workdir / "model").resolve())
    assert spec.run.data.path == str((workdir / "data.jsonl").resolve())
    assert spec.site.python.venv == str(REPO / ".venv")  # relative to the site file
    assert spec.run.job.time == 7200 and spec.run.job.exit_grace == 300


def test_unknown_key_is_an_error_naming_file_and_key(workdir):
    found = issues_of(write_spec(workdir, GOOD.replace('time = "2h"', 'time = "2h"\n    tiem = "3h"')))
    assert "run.toml:job.tiem" in found
    assert "Extra inputs" in found["run.toml:job.tiem"]


def test_unknown_table_is_an_error(workdir):
    found = issues_of(write_spec(workdir, GOOD + "\n[trian]\nlr = 1e-4\n"))
    assert "run.toml:trian" in found


def test_bad_duration(workdir):
    found = issues_of(write_spec(workdir, GOOD.replace('"2h"', '"2 hours"')))
    assert "cannot read '2 hours'" in found["run.toml:job.time"]


def test_exit_grace_longer_than_time(workdir):
    found = issues_of(write_spec(workdir, GOOD.replace('time = "2h"', 'time = "5m"\n    exit_grace = "10m"')))
    assert "must be shorter than time" in found["run.toml:job.exit_grace"]


def test_missing_model_path_and_data_path(workdir):
    body = GOOD.replace('path = "model"', 'path = "./no-such-model"').replace('"data.jsonl"', '"/no/such/data.jsonl"')
    found = issues_of(write_spec(workdir, body))
    assert "does not exist" in found["run.toml:model.path"]
    assert "does not exist" in found["run.toml:data.path"]


def test_hub_ids_are_not_local_paths(workdir):
    spec = load_run(write_spec(workdir, GOOD.replace('path = "model"', 'path = "org/tiny-llama"')))
    assert spec.run.model.path == "org/tiny-llama"


@pytest.mark.parametrize("missing", ["data/instruction.jsonl", "data/train.parquet", "d/rows.csv", "x/y.json"])
def test_a_missing_data_file_with_a_slash_is_a_missing_path_not_a_hub_id(workdir, missing, monkeypatch):
    """Issue 46: 'data/instruction.jsonl' (a typo of a local file) passed validate as the hub
    dataset 'instruction.jsonl' of a user 'data' and failed at run time under a traceback."""
    found = issues_of(write_spec(workdir, GOOD.replace('"data.jsonl"', f'"{missing}"')))
    assert f"'{missing}' does not exist (resolved to {workdir / missing})" in found["run.toml:data.path"]
    body = GOOD + f'    [eval]\n    path = "{missing}"\n'
    assert "does not exist" in issues_of(write_spec(workdir, body))["run.toml:eval.path"]
    monkeypatch.setenv("HF_HOME", str(workdir / "hf"))
    (workdir / "hf" / "hub" / "datasets--org--instructions").mkdir(parents=True)  # downloaded before
    hub = load_run(write_spec(workdir, GOOD.replace('"data.jsonl"', '"org/instructions"')))
    assert hub.run.data.path == "org/instructions"  # a hub dataset's id stays one


def test_offline_a_hub_id_the_cache_does_not_hold_is_a_missing_path(workdir, monkeypatch):
    """Issue 46: with HF_HUB_OFFLINE set (the dev cluster's profile sets it), a data path that is
    neither on disk nor in the Hugging Face cache passed validate as a hub id and failed at run
    time (exit 18, under a torchrun traceback): the nodes cannot download it."""
    monkeypatch.setenv("HF_HOME", str(workdir / "hf"))
    for key, body in (
        ("data.path", GOOD.replace('"data.jsonl"', '"org/instructions"')),
        ("eval.path", GOOD + '    [eval]\n    path = "org/held-out"\n'),
    ):
        message = issues_of(write_spec(workdir, body))[f"run.toml:{key}"]
        assert "does not exist" in message and "HF_HUB_OFFLINE=1" in message and str(workdir / "hf") in message
    # The datasets library's own cache counts too; a site that may download takes the id as it is.
    (workdir / "hf" / "datasets" / "org___instructions").mkdir(parents=True)
    assert load_run(write_spec(workdir, GOOD.replace('"data.jsonl"', '"org/instructions"'))).run.data.path
    online = GOOD.replace('site = "local"', '[site]\n    profile = "local"\n    env.HF_HUB_OFFLINE = "0"')
    assert load_run(write_spec(workdir, online.replace('"data.jsonl"', '"org/elsewhere"'))).run.data.path


@pytest.mark.parametrize(
    "key, line",
    [
        ("job.name", 'name = "x; touch /tmp/pwned"'),
        ("job.name", 'name = "$(reboot)"'),
        ("job.partition", 'partition = "debug --uid=0"'),
        ("job.exclude[0]", 'exclude = ["node1`id`"]'),
        ("job.runs_root", 'runs_root = "/tmp/a b"'),
    ],
)
def test_unsafe_strings_are_rejected(workdir, key, line):
    body = (
        GOOD.replace('name = "sft"', line)
        if key == "job.name"
        else GOOD.replace('name = "sft"', 'name = "sft"\n    ' + line)
    )
    found = issues_of(write_spec(workdir, body))
    assert f"run.toml:{key}" in found


def test_all_errors_reported_at_once(workdir):
    body = """
        site = { profile = "local", network = { ifname = "eth0;id" } }
        [job]
        name = "bad name"
        nodes = 0
        time = "30"
        [model]
        path = "/nope"
        [data]
        path = "data.jsonl"
        format = "template"
        [env]
        "1BAD" = "x"
    """
    found = issues_of(write_spec(workdir, body))
    for key in (
        "run.toml:site.network.ifname",
        "run.toml:job.name",
        "run.toml:job.nodes",
        "run.toml:job.time",
        "run.toml:model.path",
        "run.toml:data.template",
    ):
        assert key in found, (key, found)
    assert any(k.startswith("run.toml:env.") for k in found)


def test_error_in_site_profile_names_the_profile_file(workdir):
    (workdir / "mysite.toml").write_text('name = "mysite"\n[slurm]\ngpus_per_node = -1\n[network]\ntransprot = "ib"\n')
    found = issues_of(write_spec(workdir, GOOD.replace('site = "local"', 'site = "mysite.toml"')))
    assert "mysite.toml:slurm.gpus_per_node" in found
    assert "mysite.toml:network.transprot" in found


def test_site_override_wins_and_errors_name_the_run_file(workdir):
    body = GOOD.replace(
        'site = "local"', '[site]\n    profile = "local"\n    slurm.cpus_per_node = 8\n    network.debug = true'
    )
    spec = load_run(write_spec(workdir, body))
    assert spec.site.slurm.cpus_per_node == 8 and spec.site.network.debug
    assert spec.site.network.ifname == "eth0"  # untouched profile keys stay
    bad = body.replace("slurm.cpus_per_node = 8", 'slurm.cpus_per_node = "many"')
    found = issues_of(write_spec(workdir, bad))
    assert "run.toml:site.slurm.cpus_per_node" in found


def test_job_keys_override_site_keys(workdir):
    body = GOOD.replace("nodes = 2", 'nodes = 2\n    partition = "short"\n    runs_root = "runs"')
    spec = load_run(write_spec(workdir, body))
    assert spec.partition == "short"
    assert spec.run_dir == workdir / "runs" / "sft"


def test_unknown_site_lists_bundled_profiles(workdir):
    found = issues_of(write_spec(workdir, GOOD.replace('"local"', '"nosuchsite"')))
    assert "h100-ib" in found["run.toml:site"] and "local" in found["run.toml:site"]


def test_toml_syntax_error_names_the_file(workdir):
    found = issues_of(write_spec(workdir, "[job\nname = 1\n"))
    assert any("invalid TOML" in m for m in found.values())


def test_procs_per_node_above_gpus(workdir):
    body = GOOD.replace('site = "local"', 'site = "h100-ib"').replace("procs_per_node = 2", "procs_per_node = 9")
    found = issues_of(write_spec(workdir, body))
    assert "8 GPUs per node" in found["run.toml:job.procs_per_node"]


def test_train_program_needs_model_and_data(workdir):
    found = issues_of(write_spec(workdir, 'site = "local"\n[job]\nname = "x"\ntime = "1h"\n'))
    assert any("[model]" in m and "[data]" in m for m in found.values())


def test_resolved_spec_round_trips_through_json(workdir):
    from jobgen.spec.resolved import ResolvedSpec

    spec = load_run(write_spec(workdir, GOOD))
    again = ResolvedSpec.from_json(spec.to_json())
    assert again.run == spec.run and again.site == spec.site


def test_every_bundled_site_profile_and_example_validates(tmp_path):
    import shutil

    from jobgen.spec.loader import available_sites, find_site_file, read_toml
    from jobgen.spec.tables.site import SiteProfile

    assert {"local", "h100-ib", "cloud-ethernet", "consumer-nfs"} <= set(available_sites())
    for name in available_sites():
        SiteProfile.model_validate(read_toml(find_site_file(name, REPO)))
    # The examples as a user has them after `jobgen make-tiny-model examples/tiny-model`.
    examples = tmp_path / "examples"
    shutil.copytree(EXAMPLES_DIR, examples, ignore=shutil.ignore_patterns("tiny-model"))
    (examples / "tiny-model").mkdir()
    found = sorted(examples.glob("*.toml"))
    assert {p.name for p in found} >= {"doctor.toml", "sft.toml"}
    for example in found:
        load_run(example)


def test_validate_cli_exit_code_and_output(workdir):
    path = write_spec(workdir, GOOD.replace('"2h"', '"2 hours"'))
    proc = jobgen("validate", str(path))
    assert proc.returncode == 2
    assert f"{path}: job.time:" in proc.stderr
    assert jobgen("validate", str(write_spec(workdir, GOOD, "ok.toml"))).returncode == 0


def test_schema_has_descriptions_for_every_field():
    import json

    schema = json.loads(jobgen("schema", check=True).stdout)
    assert schema["properties"]["site"]["anyOf"][0] == {"type": "string"}
    missing = [
        f"{model}.{field}"
        for model, body in schema["$defs"].items()
        for field, prop in body.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert not missing, missing


# --- validate says ok only when render and the job can use the spec (issue 9, defects 8 and 9) -------------


def template_spec(template: str) -> str:
    """GOOD with a template data format (``template`` as it stands in the TOML string)."""
    return GOOD.replace(
        'path = "data.jsonl"', f'path = "data.jsonl"\n    format = "template"\n    template = "{template}"'
    )


def test_jinja_syntax_error_in_data_template_is_a_validate_error(workdir):
    found = issues_of(write_spec(workdir, template_spec("### Input: {{ input }\\n### Label: {{ output }}")))
    assert "Jinja syntax error" in found["run.toml:data.template"], found
    assert "line 1" in found["run.toml:data.template"]


def test_data_template_must_use_the_response_column(workdir):
    body = template_spec("### Input: {{ input }}\\n### Label: {{ label }}")
    found = issues_of(write_spec(workdir, body))
    assert "never uses the response column 'output'" in found["run.toml:data.response_column"], found
    spec = load_run(
        write_spec(workdir, body.replace('format = "template"', 'format = "template"\n    response_column = "label"'))
    )
    assert spec.run.data.response_column == "label"


@pytest.mark.parametrize(
    "entry, why",
    [
        ("--comment=a\\nb", "control character"),
        ("--comment=a\\rb", "control character"),
        ("-p debug", "not one long option"),
        ("--", "not one long option"),
        ("--gres gpu:1", "give each option its own entry"),
    ],
)
def test_extra_sbatch_entries_are_checked_one_by_one(workdir, entry, why):
    site = f'site = {{ profile = "local", slurm.extra_sbatch = ["--gpu-bind=none", "{entry}"] }}'
    found = issues_of(write_spec(workdir, GOOD.replace('site = "local"', site)))
    assert why in found.get("run.toml:site.slurm.extra_sbatch[1]", ""), found


@pytest.mark.parametrize("dirname, why", [("a\nb", "control character"), ("a\\b", "backslash")])
def test_run_dir_sbatch_cannot_use_is_a_validate_error(workdir, dirname, why):
    """A relative runs_root is joined to the run.toml's directory: the result is checked,
    not just what the user typed. Spaces, quotes, '#' and '%' are fine (test_render)."""
    here = workdir / dirname
    (here / "model").mkdir(parents=True)
    (here / "data.jsonl").write_text("{}\n")
    found = issues_of(write_spec(here, GOOD.replace('time = "2h"', 'time = "2h"\n    runs_root = "runs"')))
    assert why in found.get("run.toml:job.runs_root", ""), found


def test_site_runs_root_under_an_odd_home_names_the_site_key(workdir, monkeypatch):
    home = workdir / "home\\me"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    found = issues_of(write_spec(workdir, GOOD))  # local.toml: runs_root = "~/jobgen-runs"
    assert "backslash" in found.get("local.toml:paths.runs_root", ""), found
    site = 'site = { profile = "local", paths.runs_root = "~/runs" }'
    found = issues_of(write_spec(workdir, GOOD.replace('site = "local"', site)))
    assert "backslash" in found.get("run.toml:site.paths.runs_root", ""), found


def test_relative_paths_are_absolute_when_run_toml_is_given_relative(workdir, monkeypatch):
    """`jobgen submit run.toml` from the run's own directory: sbatch takes a relative --output
    relative to --chdir, and the job's cwd is not the submitter's."""
    (workdir / "mysite.toml").write_text('name = "mysite"\n[python]\nkind = "venv"\nvenv = "venv"\n')
    body = GOOD.replace('site = "local"', 'site = "mysite.toml"')
    body = body.replace('time = "2h"', 'time = "2h"\n    runs_root = "runs"')
    write_spec(workdir, body)
    monkeypatch.chdir(workdir)
    spec = load_run("run.toml")
    assert str(spec.run_dir) == str(workdir / "runs" / "sft") and spec.site.python.venv == str(workdir / "venv")
    assert spec.spec_file == "run.toml"  # shown as the user gave it
