"""The job's Python environment: python.kind = "auto" resolved from the interpreter that
loads the run (jobgen.spec.python_env), the site profile's python keys as the loader
validates and absolutizes them, what each kind renders, the missing-environment path of
the batch script run for real, and where a site profile name is looked up."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import check_shell, doctor_spec, jobgen, write_spec
from jobgen.base.exit_codes import ExitCode
from jobgen.base.paths import SITE_CONFIGS_DIR
from jobgen.launch.render import render
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import SpecError, available_sites, find_site_file, load_run, site_search_path
from jobgen.spec.python_env import conda_base_of, resolve_python
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.site import PythonSettings


@pytest.fixture(autouse=True)
def _no_conda_or_user_profiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # What the machine running the tests has must not decide them: no conda of its own, no
    # profiles in the person's ~/.config or $JOBGEN_SITE_PATH.
    monkeypatch.delenv("CONDA_EXE", raising=False)
    monkeypatch.delenv("JOBGEN_SITE_PATH", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


# ---------------------------------------------------------------- fake installations


def venv_at(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    return path


def conda_env_at(path: Path) -> Path:
    (path / "conda-meta").mkdir(parents=True)
    return path


def conda_base_at(path: Path) -> Path:
    """An installation that defines `conda activate` (etc/profile.d/conda.sh)."""
    (path / "etc" / "profile.d").mkdir(parents=True)
    (path / "etc" / "profile.d" / "conda.sh").write_text("conda() { :; }\n")
    (path / "bin").mkdir()
    (path / "bin" / "conda").write_text("#!/bin/sh\n")
    return path


# ---------------------------------------------------------------- 1. resolve_python


def test_auto_resolves_a_venv_from_its_pyvenv_cfg(tmp_path: Path):
    venv = venv_at(tmp_path / "venv")
    py = resolve_python(PythonSettings(), str(venv))
    assert py.kind == "venv" and py.venv == str(venv)
    assert py.conda_env is None and py.prefix is None
    assert py.interpreter == f"{venv}/bin/python" and py.activation_file == f"{venv}/bin/activate"


def test_auto_resolves_a_conda_env_under_its_base(tmp_path: Path):
    base = conda_base_at(tmp_path / "miniconda")
    env = conda_env_at(base / "envs" / "llm")
    py = resolve_python(PythonSettings(), str(env))
    assert py.kind == "conda" and py.conda_env == str(env) and py.conda_base == str(base)
    assert py.activation_file == f"{base}/etc/profile.d/conda.sh"
    assert py.interpreter == f"{env}/bin/python"


def test_auto_conda_exe_names_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The conda that is running ($CONDA_EXE = <base>/bin/conda) wins over the one the
    environment's path suggests."""
    base = conda_base_at(tmp_path / "miniconda")
    env = conda_env_at(base / "envs" / "llm")
    other = conda_base_at(tmp_path / "mambaforge")
    monkeypatch.setenv("CONDA_EXE", str(other / "bin" / "conda"))
    py = resolve_python(PythonSettings(), str(env))
    assert py.kind == "conda" and py.conda_env == str(env) and py.conda_base == str(other)
    # An environment outside any envs/ directory is found from $CONDA_EXE alone.
    loose = conda_env_at(tmp_path / "projects" / "env")
    assert resolve_python(PythonSettings(), str(loose)).conda_base == str(other)


def test_auto_conda_exe_without_conda_sh_falls_back_to_the_envs_parent(tmp_path: Path, monkeypatch):
    base = conda_base_at(tmp_path / "miniconda")
    env = conda_env_at(base / "envs" / "llm")
    (tmp_path / "stray" / "bin").mkdir(parents=True)
    monkeypatch.setenv("CONDA_EXE", str(tmp_path / "stray" / "bin" / "conda"))
    assert conda_base_of(env, os.environ["CONDA_EXE"]) == base
    assert resolve_python(PythonSettings(), str(env)).conda_base == str(base)


def test_auto_conda_base_installation_is_its_own_base(tmp_path: Path):
    base = conda_env_at(conda_base_at(tmp_path / "miniconda"))
    py = resolve_python(PythonSettings(), str(base))
    assert py.kind == "conda" and py.conda_env == str(base) and py.conda_base == str(base)


def test_auto_conda_env_without_any_conda_sh_has_no_base(tmp_path: Path):
    """envs/ under a directory that is no conda installation: `conda` on the nodes' PATH."""
    env = conda_env_at(tmp_path / "notconda" / "envs" / "llm")
    py = resolve_python(PythonSettings(), str(env))
    assert py.kind == "conda" and py.conda_env == str(env) and py.conda_base is None
    assert conda_base_of(env, None) is None
    # What the script can check then is the environment's own python.
    assert py.activation_file == f"{env}/bin/python"


def test_auto_plain_directory_is_a_prefix(tmp_path: Path):
    root = tmp_path / "opt" / "python3.11"
    (root / "bin").mkdir(parents=True)
    py = resolve_python(PythonSettings(), str(root))
    assert py.kind == "prefix" and py.prefix == str(root) and py.venv is None and py.conda_env is None
    assert py.activation_file == py.interpreter == f"{root}/bin/python"


def test_auto_venv_wins_over_conda_meta(tmp_path: Path):
    both = conda_env_at(venv_at(tmp_path / "both"))
    assert resolve_python(PythonSettings(), str(both)).kind == "venv"


@pytest.mark.parametrize("make", [venv_at, conda_env_at, lambda p: p], ids=["venv", "conda", "prefix"])
def test_auto_keeps_modules_and_container_mounts(tmp_path: Path, make):
    root = make(tmp_path / "env")
    root.mkdir(exist_ok=True)
    given = PythonSettings(modules=["gcc/12.2.0", "cuda/12.4.1"], container_mounts=["/fsx:/fsx"])
    py = resolve_python(given, str(root))
    assert py.kind != "auto"
    assert py.modules == ["gcc/12.2.0", "cuda/12.4.1"] and py.container_mounts == ["/fsx:/fsx"]


def test_auto_defaults_to_this_interpreter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    root = venv_at(tmp_path / "the-running-one")
    monkeypatch.setattr(sys, "prefix", str(root))
    assert resolve_python(PythonSettings()).venv == str(root)


@pytest.mark.parametrize(
    "given",
    [
        PythonSettings(kind="venv", venv="/shared/venv"),
        PythonSettings(kind="conda", conda_env="llm"),
        PythonSettings(kind="prefix", prefix="/opt/py"),
        PythonSettings(kind="modules", modules=["python/3.11"]),
        PythonSettings(kind="container", container_image="a#b", host_python="/shared/venv/bin/python3"),
        PythonSettings(kind="none"),
    ],
    ids=lambda p: p.kind,
)
def test_a_kind_other_than_auto_is_returned_unchanged(tmp_path: Path, given: PythonSettings):
    venv = venv_at(tmp_path / "venv")  # what "auto" would have found
    before = given.model_copy(deep=True)
    assert resolve_python(given, str(venv)) is given
    assert given == before


def test_a_container_sites_supervisor_runs_the_python_that_submitted(tmp_path: Path):
    """The supervisor runs on the batch host, outside the image: with this environment's Python,
    unless the profile names one; a host_python for another kind is refused."""
    venv = venv_at(tmp_path / "venv")
    (venv / "bin").mkdir()
    (venv / "bin" / "python3").write_text("")
    given = PythonSettings(kind="container", container_image="a#b")
    assert resolve_python(given, str(venv)).host_python == str(venv / "bin" / "python3")
    assert given.host_python is None  # a copy, not changed in place
    with pytest.raises(ValueError, match="host_python"):
        PythonSettings(kind="venv", venv="/v", host_python="/v/bin/python")


def test_auto_in_a_directory_jobgen_cannot_write_is_a_spec_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The interpreter that loads the run lives where no batch script can name it (a space in
    its path): `jobgen validate` names the problem, as for a venv key with a space."""
    root = venv_at(tmp_path / "my envs" / "venv")
    monkeypatch.setattr(sys, "prefix", str(root))
    spec_file = doctor_spec(tmp_path / "run", site="local")
    with pytest.raises(SpecError) as info:
        load_run(spec_file)
    assert any("python" in i.key or "python" in i.message for i in info.value.issues), info.value


# ---------------------------------------------------------------- 2. auto in a loaded run


def site_profile(directory: Path, body: str = "", name: str = "mysite", filename: str | None = None) -> Path:
    """A site profile ``directory/<filename or name.toml>``: ``name``, then ``body``."""
    directory.mkdir(parents=True, exist_ok=True)
    return write_spec(directory, f'name = "{name}"\n' + body, name=filename or f"{name}.toml")


def this_interpreter() -> dict[str, str | None]:
    """What the running interpreter is, found here without jobgen: (kind, its path key)."""
    root = Path(sys.prefix)
    if (root / "pyvenv.cfg").is_file():
        return {"kind": "venv", "venv": sys.prefix}
    if (root / "conda-meta").is_dir():
        return {"kind": "conda", "conda_env": sys.prefix}
    return {"kind": "prefix", "prefix": sys.prefix}


@pytest.mark.parametrize("python_table", ["", '[python]\nkind = "auto"\n'], ids=["no-table", "auto"])
def test_loaded_run_records_the_kind_it_resolved_to(tmp_path: Path, python_table: str):
    from jobgen.runs.materialize import materialize
    from jobgen.spec.spec_json import read_spec

    site_profile(tmp_path, python_table)
    spec_file = doctor_spec(tmp_path, site="mysite.toml")
    spec = load_run(spec_file)
    expected = this_interpreter()
    python = spec.site.python
    assert python.kind != "auto"
    assert python.model_dump(include=set(expected)) == expected
    assert (Path(sys.prefix) / "pyvenv.cfg").is_file(), "the tests run in a venv (.venv)"
    assert python.kind == "venv" and python.venv == sys.prefix

    # spec.json holds the concrete kind, and reads back as it whoever reads it later.
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    written = json.loads((run.path / "spec.json").read_text())
    assert written["site"]["python"]["kind"] == "venv" and written["site"]["python"]["venv"] == sys.prefix
    assert ResolvedSpec.from_json(spec.to_json()).site.python == python
    elsewhere = tmp_path / "another-prefix"
    elsewhere.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "prefix", str(elsewhere))
        again = read_spec(run.path / "spec.json")
    assert again.site.python == python


def test_explicit_kind_is_not_replaced_by_the_running_one(tmp_path: Path):
    site_profile(tmp_path, '[python]\nkind = "prefix"\nprefix = "/opt/py"\n')
    spec = load_run(doctor_spec(tmp_path, site="mysite.toml"))
    assert spec.site.python.kind == "prefix" and spec.site.python.prefix == "/opt/py"
    assert spec.site.python.venv is None


@pytest.mark.parametrize(
    ("table", "key"),
    [('venv = "/shared/venv"', "venv"), ('conda_env = "llm"', "conda_env"), ('prefix = "/opt/py"', "prefix")],
    ids=["venv", "conda_env", "prefix"],
)
def test_a_path_key_without_kind_is_not_silently_dropped(tmp_path: Path, table: str, key: str):
    """A profile written when kind defaulted to 'venv' (``[python] venv = "/shared/venv"``), or
    one that names a conda environment or prefix but forgot kind: either that environment is
    activated or the profile is refused naming the key, never the submitter's environment."""
    site_profile(tmp_path, f"[python]\n{table}\n")
    try:
        spec = load_run(doctor_spec(tmp_path, site="mysite.toml"))
    except SpecError as exc:
        assert any(key in i.key or key in i.message for i in exc.issues), exc
        return
    given = table.split('"')[1]
    assert getattr(spec.site.python, key) == given, spec.site.python


# ---------------------------------------------------------------- 3. validation errors


def issues(path: Path) -> list[tuple[str, str, str]]:
    with pytest.raises(SpecError) as info:
        load_run(path)
    return [(i.file, i.key, i.message) for i in info.value.issues]


@pytest.mark.parametrize(
    ("table", "needed"),
    [
        ('kind = "conda"\nconda_base = "/opt/conda"', "conda_env"),
        ('kind = "prefix"', "prefix"),
        ('kind = "venv"', "venv"),
    ],
    ids=["conda", "prefix", "venv"],
)
def test_kind_without_its_key_names_the_site_file_and_key(tmp_path: Path, table: str, needed: str):
    site = site_profile(tmp_path / "sites", f"[python]\n{table}\n")
    found = issues(doctor_spec(tmp_path, site=str(site)))
    assert len(found) == 1, found
    file, key, message = found[0]
    assert file == str(site)
    assert key == "python"
    assert f"needs '{needed}'" in message


def test_kind_without_its_key_set_by_the_run_names_the_run_file(tmp_path: Path):
    site_profile(tmp_path)
    spec_file = doctor_spec(tmp_path, site={"profile": "mysite.toml", "python": {"kind": "conda"}})
    ((file, key, message),) = issues(spec_file)
    assert file == str(spec_file) and key == "site.python" and "needs 'conda_env'" in message


# ---------------------------------------------------------------- 4. relative paths


def test_relative_python_paths_are_relative_to_the_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    profiles = tmp_path / "config" / "profiles"
    site_profile(
        profiles,
        '[python]\nkind = "conda"\nconda_env = "../envs/llm"\nconda_base = "../../miniconda"\n',
        name="conda-path",
    )
    site_profile(profiles, '[python]\nkind = "conda"\nconda_env = "llm"\nconda_base = "base"\n', name="conda-name")
    site_profile(profiles, '[python]\nkind = "prefix"\nprefix = "../opt/py"\n', name="prefix")
    run_dir = tmp_path / "project"
    monkeypatch.chdir(tmp_path)  # neither the caller's cwd ...
    by_path = load_run(doctor_spec(run_dir, site=str(profiles / "conda-path.toml"), filename="a.toml"))
    by_name = load_run(doctor_spec(run_dir, site=str(profiles / "conda-name.toml"), filename="b.toml"))
    prefix = load_run(doctor_spec(run_dir, site=str(profiles / "prefix.toml"), filename="c.toml"))
    # ... nor the run file's directory: the profile's.
    assert by_path.site.python.conda_env == str(tmp_path / "config" / "envs" / "llm")
    assert by_path.site.python.conda_base == str(tmp_path / "miniconda")
    assert by_name.site.python.conda_env == "llm"
    assert by_name.site.python.conda_base == str(profiles / "base")
    assert prefix.site.python.prefix == str(tmp_path / "config" / "opt" / "py")


def test_relative_python_paths_set_by_the_run_are_relative_to_the_run_file(tmp_path: Path):
    site_profile(tmp_path / "profiles", '[python]\nkind = "conda"\nconda_env = "llm"\n')
    overrides = {"profile": "../profiles/mysite.toml", "python": {"conda_env": "./envs/x", "conda_base": "conda"}}
    spec = load_run(doctor_spec(tmp_path / "project", site=overrides))
    assert spec.site.python.conda_env == str(tmp_path / "project" / "envs" / "x")
    assert spec.site.python.conda_base == str(tmp_path / "project" / "conda")


# ---------------------------------------------------------------- 5. what each kind renders


def rendered(tmp_path: Path, python_table: str) -> str:
    site_profile(tmp_path, python_table)
    text = render(load_run(doctor_spec(tmp_path, site="mysite.toml")))
    check_shell(text, tmp_path, "job.sbatch")
    return text


def test_conda_with_base_sources_its_conda_sh_after_checking_it(tmp_path: Path):
    base, env = tmp_path / "miniconda", tmp_path / "miniconda" / "envs" / "llm"
    text = rendered(tmp_path, f'[python]\nkind = "conda"\nconda_env = "{env}"\nconda_base = "{base}"\n')
    conda_sh = f"{base}/etc/profile.d/conda.sh"
    check = f"[[ -e {conda_sh} ]] || python_env_missing {conda_sh}"
    source = f"source {conda_sh}"
    activate = f"conda activate {env}"
    assert check in text and source in text and activate in text
    assert text.index(check) < text.index(source) < text.index(activate)
    assert "conda shell.bash hook" not in text
    assert "python_env_missing() {" in text


def test_conda_by_name_without_base_uses_the_hook_and_checks_nothing(tmp_path: Path):
    text = rendered(tmp_path, '[python]\nkind = "conda"\nconda_env = "llm"\n')
    hook = 'eval "$(conda shell.bash hook)"'
    assert hook in text and "conda activate llm" in text
    assert text.index(hook) < text.index("conda activate llm")
    assert "etc/profile.d/conda.sh" not in text
    assert "python_env_missing" not in text


def test_conda_by_path_without_base_checks_its_python(tmp_path: Path):
    env = tmp_path / "envs" / "llm"
    text = rendered(tmp_path, f'[python]\nkind = "conda"\nconda_env = "{env}"\n')
    check = f"[[ -e {env}/bin/python ]] || python_env_missing {env}/bin/python"
    assert 'eval "$(conda shell.bash hook)"' in text and check in text
    assert text.index(check) < text.index(f"conda activate {env}")


def test_prefix_goes_first_on_path_after_checking_its_python(tmp_path: Path):
    prefix = tmp_path / "opt" / "py"
    text = rendered(tmp_path, f'[python]\nkind = "prefix"\nprefix = "{prefix}"\n')
    check = f"[[ -e {prefix}/bin/python ]] || python_env_missing {prefix}/bin/python"
    export = f'export PATH={prefix}/bin"${{PATH:+:$PATH}}"'
    assert check in text and export in text
    assert text.index(check) < text.index(export)
    assert "conda activate" not in text and "/bin/activate" not in text


def test_venv_with_modules_loads_them_first(tmp_path: Path):
    venv = tmp_path / "venv"
    text = rendered(tmp_path, f'[python]\nkind = "venv"\nvenv = "{venv}"\nmodules = ["gcc/12.2.0", "cuda/12.4.1"]\n')
    places = [
        text.index("module purge"),
        text.index("module load gcc/12.2.0"),
        text.index("module load cuda/12.4.1"),
        text.index(f"[[ -e {venv}/bin/activate ]] || python_env_missing {venv}/bin/activate"),
        text.index(f"source {venv}/bin/activate"),
    ]
    assert places == sorted(places), places


def test_prefix_with_modules_loads_them_first(tmp_path: Path):
    prefix = tmp_path / "opt" / "py"
    text = rendered(tmp_path, f'[python]\nkind = "prefix"\nprefix = "{prefix}"\nmodules = ["cuda/12.4.1"]\n')
    assert text.index("module load cuda/12.4.1") < text.index(f"export PATH={prefix}/bin")


def test_none_checks_nothing(tmp_path: Path):
    text = rendered(tmp_path, '[python]\nkind = "none"\n')
    assert "python_env_missing" not in text
    assert "/bin/activate" not in text and "conda activate" not in text and "module load" not in text


def test_auto_renders_the_running_venv(tmp_path: Path):
    text = rendered(tmp_path, "")
    assert f"[[ -e {sys.prefix}/bin/activate ]] || python_env_missing {sys.prefix}/bin/activate" in text
    assert f"source {sys.prefix}/bin/activate" in text


# ---------------------------------------------------------------- 6. a missing environment, run for real


def test_missing_venv_stops_the_run_naming_its_activate_script(tmp_path: Path):
    """`jobgen submit --local` runs the batch script on this machine: the venv the site names
    is not there, so the task ends before the program, and the run is stopped naming the file
    (before, `source` failed under set -e: a shell error, no failed marker, no reason)."""
    missing = tmp_path / "nowhere" / "venv"
    spec_file = doctor_spec(tmp_path, site={"profile": "local", "python": {"kind": "venv", "venv": str(missing)}})
    # No Slurm, whatever this machine has: a slurm.conf another process is bringing up (munge
    # not yet there) makes `jobgen status` fail on `scontrol show config` (a SlurmError, not
    # "unavailable"), which is not what this test is about.
    no_slurm = {"SLURM_CONF": str(tmp_path / "no-slurm.conf")}
    proc = jobgen("submit", "--local", str(spec_file), cwd=tmp_path, env=no_slurm, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.LAUNCH_ERROR, out
    # submit said so first: the interpreter is not on this machine, and the task will stop.
    assert f"{missing}/bin/python is not on this machine" in out, out

    run = RunDir(tmp_path / "runs" / "doc")
    activate = f"{missing}/bin/activate"
    failure = run.failure()
    assert failure is not None, out
    assert failure["exit_code"] == ExitCode.LAUNCH_ERROR
    assert f"{activate} is missing" in failure["reason"] and "Python environment" in failure["reason"]
    assert "[python]" in failure["fix"]

    # The program never started: no rendezvous, no doctor report, no repro record.
    assert "rendezvous at" not in out and "program exited" not in out and "RESULT" not in out, out
    assert not (run.path / "doctor.json").exists()
    assert not any((run.path / "repro").iterdir())

    shown = json.loads(jobgen("status", str(run.path), "--json", env=no_slurm, check=True).stdout)
    assert shown["state"] == "failed"
    (task,) = shown["tasks"]
    assert task["jobgen_exit"] == ExitCode.LAUNCH_ERROR and activate in task["exit_reason"]
    assert any(activate in note for note in shown["notes"]), shown["notes"]


# ---------------------------------------------------------------- 7. where a profile is found


def test_user_profile_is_found_by_name(tmp_path: Path):
    user = site_profile(tmp_path / "xdg-config" / "jobgen" / "sites", name="team")
    assert site_search_path()[-2:] == [tmp_path / "xdg-config" / "jobgen" / "sites", SITE_CONFIGS_DIR]
    assert find_site_file("team", tmp_path) == user
    spec = load_run(doctor_spec(tmp_path / "run", site="team"))
    assert spec.site.name == "team" and spec.site_file == str(user)


def test_default_user_directory_is_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    user = site_profile(tmp_path / "home" / ".config" / "jobgen" / "sites", name="team")
    assert find_site_file("team", tmp_path) == user


def test_jobgen_site_path_wins_over_the_user_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site_profile(tmp_path / "xdg-config" / "jobgen" / "sites", name="team")
    first, second = tmp_path / "a", tmp_path / "b"
    wins = site_profile(second, "[slurm]\ncpus_per_node = 7\n", name="team")
    site_profile(first, name="other")
    monkeypatch.setenv("JOBGEN_SITE_PATH", os.pathsep.join([str(first), "", str(second)]))
    assert site_search_path()[:2] == [first, second]
    assert find_site_file("team", tmp_path) == wins
    assert load_run(doctor_spec(tmp_path / "run", site="team")).site.slurm.cpus_per_node == 7
    # Earlier directories of $JOBGEN_SITE_PATH win over later ones.
    site_profile(first, name="team", filename="team.toml")
    assert find_site_file("team", tmp_path) == first / "team.toml"


def test_user_profile_shadows_a_bundled_one(tmp_path: Path):
    assert (SITE_CONFIGS_DIR / "local.toml").is_file()
    assert find_site_file("local", tmp_path) == SITE_CONFIGS_DIR / "local.toml"
    user = site_profile(tmp_path / "xdg-config" / "jobgen" / "sites", "[slurm]\ncpus_per_node = 5\n", name="local")
    assert find_site_file("local", tmp_path) == user
    spec = load_run(doctor_spec(tmp_path / "run"))
    assert spec.site_file == str(user) and spec.site.slurm.cpus_per_node == 5


def test_available_sites_lists_every_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site_profile(tmp_path / "xdg-config" / "jobgen" / "sites", name="mine")
    site_profile(tmp_path / "shared", name="team")
    site_profile(tmp_path / "shared", name="local")  # a bundled name: listed once
    monkeypatch.setenv("JOBGEN_SITE_PATH", str(tmp_path / "shared"))
    names = available_sites()
    bundled = {p.stem for p in SITE_CONFIGS_DIR.glob("*.toml")}
    assert set(names) == bundled | {"mine", "team"}
    assert names == sorted(names) and names.count("local") == 1


def block_directory(monkeypatch: pytest.MonkeyPatch, blocked: Path) -> None:
    """``blocked`` as a directory this user may not enter (the tests run as root, whom chmod
    does not stop): stat, glob and access of what is in it fail with EACCES."""
    import pathlib

    def inside(path: object) -> bool:
        return Path(os.fspath(path)).is_relative_to(blocked)  # type: ignore[arg-type]

    real_is_file, real_glob, real_access = pathlib.Path.is_file, pathlib.Path.glob, os.access

    def is_file(self: Path) -> bool:
        if inside(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    def glob(self: Path, pattern: str):
        if inside(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_glob(self, pattern)

    def access(path, mode, **kwargs) -> bool:
        return False if inside(path) else real_access(path, mode, **kwargs)

    monkeypatch.setattr(pathlib.Path, "is_file", is_file)
    monkeypatch.setattr(pathlib.Path, "glob", glob)
    monkeypatch.setattr(os, "access", access)


def test_unreadable_search_directory_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    closed, open_ = tmp_path / "closed", tmp_path / "open"
    site_profile(closed, name="team")
    found = site_profile(open_, name="team")
    site_profile(closed, name="only-closed")
    monkeypatch.setenv("JOBGEN_SITE_PATH", os.pathsep.join([str(closed), str(open_)]))
    assert find_site_file("team", tmp_path) == closed / "team.toml"  # before it is closed
    block_directory(monkeypatch, closed)
    assert find_site_file("team", tmp_path) == found
    names = available_sites()
    assert "team" in names and "local" in names and "only-closed" not in names
    assert load_run(doctor_spec(tmp_path / "run", site="team")).site_file == str(found)
    # The user's own directory closed too: the bundled profile of that name.
    site_profile(tmp_path / "xdg-config" / "jobgen" / "sites", name="local")
    block_directory(monkeypatch, tmp_path / "xdg-config")
    assert find_site_file("local", tmp_path) == SITE_CONFIGS_DIR / "local.toml"


def test_a_file_that_cannot_be_read_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    first, second = tmp_path / "first", tmp_path / "second"
    site_profile(first, name="team")
    found = site_profile(second, name="team")
    monkeypatch.setenv("JOBGEN_SITE_PATH", os.pathsep.join([str(first), str(second)]))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if Path(p).parent == first else real_access(p, m, **k))
    assert find_site_file("team", tmp_path) == found


def test_unknown_name_says_where_it_looked_and_how_to_make_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    shared = tmp_path / "shared"
    site_profile(shared, name="team")
    monkeypatch.setenv("JOBGEN_SITE_PATH", str(shared))
    ((file, key, message),) = issues(doctor_spec(tmp_path / "run", site="nosuch"))
    assert key == "site" and file.endswith("run.toml")
    assert "no site profile 'nosuch'" in message
    for directory in (shared, tmp_path / "xdg-config" / "jobgen" / "sites", SITE_CONFIGS_DIR):
        assert str(directory) in message, message
    assert "`jobgen site init nosuch`" in message
    assert "team" in message and "local" in message  # the profiles that are there


@pytest.mark.parametrize("ref", ["profiles/gone.toml", "gone.toml", "./gone"])
def test_missing_profile_path_names_the_file(tmp_path: Path, ref: str):
    ((_, key, message),) = issues(doctor_spec(tmp_path / "run", site=ref))
    assert key == "site"
    assert message == f"no site profile file {tmp_path / 'run' / ref}"
    assert "jobgen site init" not in message


def test_validate_cli_names_the_missing_profile(tmp_path: Path):
    proc = jobgen("validate", str(doctor_spec(tmp_path / "run", site="nosuch")), env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert "no site profile 'nosuch'" in proc.stdout + proc.stderr


def test_auto_with_a_path_key_is_refused_naming_both(tmp_path: Path):
    site_profile(tmp_path, '[python]\nkind = "auto"\nvenv = "/shared/venv"\n')
    with pytest.raises(SpecError) as info:
        load_run(doctor_spec(tmp_path, site="mysite.toml"))
    assert any("kind = 'auto'" in i.message and "'venv'" in i.message for i in info.value.issues), info.value
