"""Load ``run.toml``, resolve its site profile, and report every problem at once.

Each problem names the file it comes from and the key path inside that file, so
``jobgen validate`` output reads like a compiler's::

    examples/run.toml: job.nodes: Input should be greater than or equal to 1
    site_configs/h100-ib.toml: network.ifname: String should match pattern ...

The site reference is either a name (``site = "local"``: ``local.toml`` in the first directory of
:func:`site_search_path` that has one), a path to a TOML file, or a table
``[site] profile = "local"`` whose other keys override the profile's.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jobgen.base.paths import SITE_CONFIGS_DIR, user_config_dir
from jobgen.program import placeholders
from jobgen.spec.data_files import hub_caches
from jobgen.spec.named_files import data_problems, model_problems
from jobgen.spec.node_shapes import place
from jobgen.spec.python_env import resolve_python
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.run_paths import absolute_path, absolute_paths, missing_paths, offline_hub_ids
from jobgen.spec.site_fit import site_problems
from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.site import SiteProfile
from jobgen.spec.tables.watchdogs import WatchdogSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Control characters but tab, as jobgen.spec.fields.no_control_chars refuses them.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True)
class SpecIssue:
    """One problem: which file, which key, what is wrong."""

    file: str
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: {self.key}" if self.key else self.file
        return f"{where}: {self.message}"


class SpecError(Exception):
    """All problems found in a spec and its site profile."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


def read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file; syntax errors become a SpecError naming the file and line."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise SpecError([SpecIssue(str(path), "", "file not found")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError([SpecIssue(str(path), "", f"invalid TOML: {exc}")]) from None
    except OSError as exc:
        raise SpecError([SpecIssue(str(path), "", f"cannot read: {exc.strerror}")]) from None


def key_path(loc: tuple[Any, ...]) -> str:
    """Pydantic's ``('job', 'exclude', 0)`` as ``job.exclude[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (the name)"
        else:
            text = str(part)
            if not re.fullmatch(r"[A-Za-z0-9_-]+", text):
                text = '"' + text.replace('"', '\\"') + '"'
            out += ("." if out else "") + text
    return out


def _message(error: Any) -> str:
    """Pydantic's message without its 'Value error, ' prefix."""
    return str(error["msg"]).removeprefix("Value error, ")


def site_search_path() -> list[Path]:
    """Where a profile name is looked up, first match wins: each directory of
    $JOBGEN_SITE_PATH, the user's own (``~/.config/jobgen/sites``, where ``jobgen site init``
    writes), then the profiles jobgen ships."""
    search = [Path(p).expanduser() for p in os.environ.get("JOBGEN_SITE_PATH", "").split(os.pathsep) if p]
    return [*search, user_config_dir() / "sites", SITE_CONFIGS_DIR]


def find_site_file(ref: str, base_dir: Path) -> Path:
    """A profile name resolves against :func:`site_search_path`; anything with a slash or a
    .toml suffix is a path relative to the run file."""
    if "/" in ref or ref.endswith(".toml"):
        path = Path(ref).expanduser()
        return path if path.is_absolute() else base_dir / path
    for directory in site_search_path():
        candidate = directory / f"{ref}.toml"
        if _readable_file(candidate):
            return candidate
    return SITE_CONFIGS_DIR / f"{ref}.toml"


def _readable_file(path: Path) -> bool:
    # A directory of the search path this user may not enter (a teammate's HOME, a config
    # directory of another account) is not an error: the next one is searched.
    try:
        return path.is_file() and os.access(path, os.R_OK)
    except OSError:
        return False


def available_sites() -> list[str]:
    """Every profile name a run can use, from every directory of the search path."""
    names: set[str] = set()
    for directory in site_search_path():
        try:
            names.update(p.stem for p in directory.glob("*.toml"))
        except OSError:
            continue
    return sorted(names)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _leaf_paths(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths: set[tuple[str, ...]] = set()
    for key, value in tree.items():
        here = (*prefix, key)
        if isinstance(value, dict) and value:
            paths |= _leaf_paths(value, here)
        else:
            paths.add(here)
    return paths


def load_run(spec_file: str | Path) -> ResolvedSpec:
    """Load and validate a run.toml; raises SpecError listing every problem."""
    spec_path = Path(spec_file)
    # Absolute: a path relative to the caller's cwd means nothing to the job (its cwd is
    # --chdir) nor to sbatch (a relative --output is taken relative to --chdir).
    return resolve(read_toml(spec_path), spec_file=spec_path, base_dir=spec_path.absolute().parent)


def resolve(raw: dict[str, Any], *, spec_file: Path | None, base_dir: Path) -> ResolvedSpec:
    """Validate a parsed run document (``site`` key included) against its site profile."""
    run_label = str(spec_file) if spec_file else "<run>"
    raw = dict(raw)
    site_ref, overrides, issues = _site_reference(raw.pop("site", "local"), run_label)
    site: SiteProfile | None = None
    site_path: Path | None = None
    if site_ref is not None:
        site, site_path, site_issues = _load_site(site_ref, overrides, base_dir, run_label)
        issues.extend(site_issues)

    run: RunSpec | None = None
    try:
        run = absolute_paths(RunSpec.model_validate(raw), base_dir)
    except ValidationError as exc:
        issues.extend(SpecIssue(run_label, key_path(e["loc"]), _message(e)) for e in exc.errors())
    issues.extend(SpecIssue(run_label, key, message) for key, message in missing_paths(raw, base_dir))
    if run is not None:
        issues.extend(SpecIssue(run_label, key, message) for key, message in data_problems(run))
        issues.extend(_check_env_placeholders(run, run_label))
    if run is not None and site is not None:
        run = _placed(run, site)
        issues.extend(_cross_check(run, site, run_label))
        issues.extend(SpecIssue(run_label, key, message) for key, message in offline_hub_ids(raw, base_dir, site))
        worlds = [run.job.world_size(site.slurm.default_procs_per_node, n) for n in run.job.node_counts]
        issues.extend(SpecIssue(run_label, key, message) for key, message in model_problems(run, worlds))
        issues.extend(_check_run_dir(run, site, run_label, site_path, overrides))
        issues.extend(_check_script_paths(run, site, run_label, site_path, overrides))
        try:
            run = run.model_copy(update={"watchdogs": _merge_watchdogs(site, site_path, run, base_dir)})
        except ValidationError as exc:
            issues.extend(SpecIssue(run_label, "watchdogs." + key_path(e["loc"]), _message(e)) for e in exc.errors())

    if issues:
        raise SpecError(issues)
    assert run is not None and site is not None and site_path is not None
    return ResolvedSpec(run=run, site=site, spec_file=str(spec_file) if spec_file else None, site_file=str(site_path))


def _site_reference(site_ref: Any, run_label: str) -> tuple[str | None, dict[str, Any], list[SpecIssue]]:
    """The run's ``site``: (the profile it names, the [site] table's overrides of it, what is
    wrong with it); the profile is None when there is none to load."""
    issues: list[SpecIssue] = []
    overrides: dict[str, Any] = {}
    if isinstance(site_ref, dict):
        overrides = dict(site_ref)
        site_ref = overrides.pop("profile", None)
        if not isinstance(site_ref, str):
            issues.append(
                SpecIssue(run_label, "site.profile", "a [site] table needs 'profile' (a profile name or path)")
            )
    elif not isinstance(site_ref, str):
        issues.append(SpecIssue(run_label, "site", "must be a profile name, a path, or a [site] table"))
    return (site_ref if isinstance(site_ref, str) else None), overrides, issues


def _load_site(
    site_ref: str, overrides: dict[str, Any], base_dir: Path, run_label: str
) -> tuple[SiteProfile | None, Path, list[SpecIssue]]:
    """(the validated profile, None if it has problems; its file; the problems)."""
    site_path = find_site_file(site_ref, base_dir)
    if not site_path.is_file():
        if site_path.name != f"{site_ref}.toml":  # a path, not a name
            message = f"no site profile file {site_path}"
        else:
            message = (
                f"no site profile '{site_ref}' (looked in {', '.join(str(d) for d in site_search_path())}; "
                f"profiles there: {', '.join(available_sites())}; `jobgen site init {site_ref}` writes one from "
                "your cluster)"
            )
        issue = SpecIssue(run_label, "site", message)
        return None, site_path, [issue]
    try:
        site_doc = read_toml(site_path)
    except SpecError as exc:
        return None, site_path, list(exc.issues)
    site, site_issues = _validate_site(site_doc, overrides, site_path, run_label, base_dir)
    return site, site_path, list(site_issues)


_SITE_PATH_KEYS = [
    ("python", "venv"),
    ("python", "module_venv"),
    ("python", "conda_base"),
    ("python", "prefix"),
    ("paths", "runs_root"),
    ("paths", "hf_home"),
    ("paths", "data_cache"),
]


def _validate_site(
    doc: dict[str, Any], overrides: dict[str, Any], site_path: Path, run_label: str, run_dir: Path
) -> tuple[SiteProfile | None, list[SpecIssue]]:
    merged = _deep_merge(doc, overrides)
    overridden = _leaf_paths(overrides)
    try:
        site = SiteProfile.model_validate(merged)
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            # An error on a table the run overrode part of (a validator of the whole table) is the run's too.
            from_run = any(loc[: len(o)] == o or o[: len(loc)] == loc for o in overridden)
            if from_run:
                issues.append(SpecIssue(run_label, "site." + key_path(err["loc"]), _message(err)))
            else:
                issues.append(SpecIssue(str(site_path), key_path(err["loc"]), _message(err)))
        return None, issues
    # A relative path is relative to the file that wrote it, not to the caller's cwd.
    for table, key in _SITE_PATH_KEYS:
        section = getattr(site, table)
        value = getattr(section, key)
        if value is not None:
            base = run_dir if (table, key) in overridden else site_path.parent
            setattr(section, key, absolute_path(value, base))
    env = site.python.conda_env
    if env is not None and "/" in env:  # a prefix, not a name
        base = run_dir if ("python", "conda_env") in overridden else site_path.parent
        site.python.conda_env = absolute_path(env, base)
    # kind = "auto": the environment running this, recorded as what it is (jobgen.spec.python_env).
    try:
        site.python = resolve_python(site.python)
    except ValidationError as exc:  # its path cannot go into a batch script (a space, a quote)
        words = _message(exc.errors()[0])
        message = f"kind = 'auto': the environment running jobgen ({sys.prefix}) cannot be used: {words}"
        return None, [SpecIssue(str(site_path), "python", message + "; set [python] kind and its path")]
    if site.python.kind == "container" and site.paths.hf_home is None:
        # The image's home is not this one (podman's is the image's /root): the Hugging Face cache
        # validate looked in is named, exported as HF_HOME and mounted at its path.
        site.paths.hf_home = str(hub_caches(site.env.get("HF_HOME"), dict(os.environ))[0])
    return site, []


def _watchdog_overrides(settings: WatchdogSettings, base: Path) -> dict[str, Any]:
    """The keys a file really set (not the defaults), its relative paths made absolute."""
    given = settings.model_dump(exclude_unset=True)
    if given.get("home"):
        given["home"] = absolute_path(given["home"], base)
    if given.get("disk", {}).get("paths"):
        given["disk"]["paths"] = [absolute_path(p, base) for p in given["disk"]["paths"]]
    for table, key in (("email", "password_file"), ("webhook", "url_file")):
        if (given.get(table) or {}).get(key):
            given[table][key] = absolute_path(given[table][key], base)
    return given


def _merge_watchdogs(site: SiteProfile, site_path: Path | None, run: RunSpec, base_dir: Path) -> WatchdogSettings:
    """The run's [watchdogs] over the site's, key by key; stored whole in the run so the
    checks read one table from spec.json."""
    site_base = site_path.parent if site_path is not None else base_dir
    merged = _deep_merge(_watchdog_overrides(site.watchdogs, site_base), _watchdog_overrides(run.watchdogs, base_dir))
    return WatchdogSettings.model_validate(merged)


def _check_run_dir(
    run: RunSpec, site: SiteProfile, run_label: str, site_path: Path | None, overrides: dict[str, Any]
) -> list[SpecIssue]:
    """The run directory as resolved (a relative runs_root joins the directory of the file
    that set it, ``~`` the user's home), checked for what no script can carry: the runs_root
    key as typed is validated, but the directory it is joined to is anyone's. Spaces, quotes,
    '#' and '%' are fine: render quotes #SBATCH values and escapes Slurm's %-patterns."""
    run_dir = str(Path(run.job.runs_root or site.paths.runs_root) / run.job.name)
    if run.job.runs_root:
        file, key = run_label, "job.runs_root"
    elif ("paths", "runs_root") in _leaf_paths(overrides):
        file, key = run_label, "site.paths.runs_root"
    else:
        file, key = str(site_path), "paths.runs_root"
    if _CONTROL.search(run_dir):
        # sbatch reads the script line by line; no quoting carries a newline into --chdir.
        return [
            SpecIssue(
                file,
                key,
                f"the run directory {run_dir!r} has a control character (newline, ...); #SBATCH lines cannot hold it",
            )
        ]
    if "\\" in run_dir:
        return [
            SpecIssue(
                file,
                key,
                f"the run directory {run_dir!r} has a backslash, which turns off Slurm's "
                "%x and %j in --output (every task would write the same log file)",
            )
        ]
    return []


def _check_script_paths(
    run: RunSpec, site: SiteProfile, run_label: str, site_path: Path | None, overrides: dict[str, Any]
) -> list[SpecIssue]:
    """Paths the batch script holds, as resolved: the key as typed is validated (SafePath),
    but the directory it is joined to (run.toml's, the site file's) may hold anything, and a
    newline in a quoted word still ends the here-document it sits in (what follows would run
    as commands). Such a path is refused with its key, like the run directory."""
    issues = []
    command = run.command
    for key in ("workdir", "script"):
        value = getattr(command, key) if command is not None else None
        if value and _CONTROL.search(value):
            issues.append(SpecIssue(run_label, f"command.{key}", f"{value!r} has a control character (newline, ...)"))
    overridden = _leaf_paths(overrides)
    for table, key in _SITE_PATH_KEYS:
        value = getattr(getattr(site, table), key)
        if value and _CONTROL.search(value):
            file, name = (
                (run_label, f"site.{table}.{key}") if (table, key) in overridden else (str(site_path), f"{table}.{key}")
            )
            issues.append(SpecIssue(file, name, f"{value!r} has a control character (newline, ...)"))
    return issues


def _check_env_placeholders(run: RunSpec, run_label: str) -> list[SpecIssue]:
    """[env] values of a command program are expanded per task (jobgen.program.placeholders); those
    of the bundled programs reach the job as written, braces and all."""
    if not run.job.kind.planned:
        return []
    issues = []
    for name, value in run.env.items():
        try:
            placeholders.check(value, placeholders.IN_ENV, "env")
        except placeholders.PlaceholderError as exc:
            issues.append(SpecIssue(run_label, key_path(("env", name)), str(exc)))
    return issues


def _placed(run: RunSpec, site: SiteProfile) -> RunSpec:
    """Unequal nodes on a GPU site with no job.nodelist: the nodes the site's node_shapes give
    them (jobgen.spec.node_shapes), written into the run's nodelist (spec.json records them)."""
    job = run.job
    if job.nodelist or not job.unequal_nodes or not site.slurm.gpus_per_node or not site.slurm.node_shapes:
        return run
    chosen = place(job.node_procs(site.slurm.default_procs_per_node), site.slurm.node_shapes)
    if chosen is None:
        return run
    return run.model_copy(update={"job": job.model_copy(update={"nodelist": [",".join(chosen)]})})


def _cross_check(run: RunSpec, site: SiteProfile, run_label: str) -> list[SpecIssue]:
    """The run against its site (jobgen.spec.site_fit), each problem named by its key."""
    return [SpecIssue(run_label, key, message) for key, message in site_problems(run, site)]
