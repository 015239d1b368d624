"""A sweep's points: ``[sweep]`` expanded into one validated run spec per point.

Each point is the file as written, ``[sweep]`` taken out, with the point's dotted keys set,
``job.name`` set to the point's name and ``job.runs_root`` to the sweep's ``points/``
(``runs_root/<job.name>/points``: jobgen.runs.sweep_files), validated exactly as ``jobgen
validate`` validates a run. Every
problem of every point is collected and raised as one :class:`~jobgen.spec.loader.SpecError`
whose issues name the point and the sweep key that caused them, e.g.::

    run.toml: sweep.grid."train.lr": point lr=fast, r=8: Input should be a valid number

A point's name is its run directory's name and says its overrides (``lr-0.0003_r-16``): it
comes from the overrides, not from the point's place in the list, so that a file edited and
submitted again finds its existing points under the same names.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from jobgen.launch.render import sbatch_directives
from jobgen.runs.sweep_files import POINTS_DIR
from jobgen.spec.fields import SafePath
from jobgen.spec.loader import SpecError, SpecIssue, key_path, read_toml, resolve
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.run import MAX_ARRAY
from jobgen.spec.tables.sweep import SEED_KEY, SweepSpec, related_keys

# A point's name is a job.name (jobgen.spec.fields.JobName): Slurm's %x, a file name, no commas.
MAX_NAME = 64
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# '_' joins the overrides and '-' a key to its value, so a value keeps neither ambiguous
# nor anything a file or job name cannot hold.
_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")
_HASH_CHARS = 8
# A hashed name keeps this much of the readable one: prefix, '-', 8 hex digits = 64.
_PREFIX = MAX_NAME - _HASH_CHARS - 1
# Directives that name the run directory: each point has its own, and the array's tasks
# get theirs from the point they run, not from the array's request.
_RUN_DIR_OPTIONS = ("--job-name", "--chdir", "--output", "--open-mode")


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep."""

    name: str  # the point's run directory name (and its job.name)
    overrides: dict[str, Any]  # dotted key -> value, in the order written (the seed last)
    spec: ResolvedSpec  # job.name = name, job.runs_root = the sweep's points/, sweep = None


@dataclass(frozen=True)
class Sweep:
    """A run.toml with ``[sweep]``, expanded and validated."""

    name: str  # the file's job.name: the Slurm array's name
    directory: Path  # runs_root/<job.name>: sweep.json, and points/ with one run directory per point
    settings: SweepSpec
    base: ResolvedSpec  # the file without [sweep], validated as a plain run
    points: list[SweepPoint]


@dataclass(frozen=True)
class _Draft:
    """A point before validation, with where its keys were written (for error messages)."""

    overrides: dict[str, Any]
    where: tuple[Any, ...]  # ("sweep", "grid") or ("sweep", "points", index)
    seeded: bool = False

    def location(self, key: str) -> tuple[Any, ...]:
        if self.seeded and key == SEED_KEY:
            return ("sweep", "seeds")
        return (*self.where, key)


def is_sweep(raw: dict[str, Any]) -> bool:
    """The parsed run.toml has a [sweep] table (an empty one too: that is an error to report)."""
    return "sweep" in raw


def load_sweep(spec_file: str | Path) -> Sweep:
    """Read, expand and validate a sweep file; raises SpecError listing every problem."""
    path = Path(spec_file)
    raw = read_toml(path)
    if not is_sweep(raw):
        raise SpecError([SpecIssue(str(path), "sweep", "not a sweep: the file has no [sweep] table")])
    return expand(raw, path)


def expand(raw: dict[str, Any], spec_file: Path) -> Sweep:
    """The sweep of a parsed run document (``site`` and ``sweep`` included)."""
    label = str(spec_file)
    settings, issues = _settings(raw.get("sweep"), label)
    base_doc = {key: value for key, value in raw.items() if key != "sweep"}
    base: ResolvedSpec | None = None
    try:
        base = resolve(base_doc, spec_file=spec_file, base_dir=spec_file.absolute().parent)
    except SpecError as exc:
        issues.extend(exc.issues)
    if settings is not None and base is not None:
        issues.extend(_sweep_problems(settings, base, label))
    if issues:
        raise SpecError(issues)
    assert settings is not None and base is not None
    drafts = _drafts(settings, base.run.train.seed)
    overrides = [draft.overrides for draft in drafts]
    names, short = point_names(overrides), short_keys(overrides)
    points: list[SweepPoint] = []
    built: list[_Draft] = []
    for draft, name in zip(drafts, names):
        spec, found = _build(raw, draft, name, base.run_dir, spec_file, describe(draft.overrides, short))
        issues.extend(found)
        if spec is not None:
            points.append(SweepPoint(name=name, overrides=draft.overrides, spec=spec))
            built.append(draft)
    issues.extend(_duplicates(built, points, short, label))
    issues.extend(_allocations(base, built, points, short, label))
    issues.extend(_task_count([point.spec.run.job.array for point in points], label))
    if issues:
        raise SpecError(issues)
    return Sweep(name=base.run.job.name, directory=base.run_dir, settings=settings, base=base, points=points)


def allocation(spec: ResolvedSpec) -> list[str]:
    """What Slurm is asked for per task: the #SBATCH directives but those naming the run
    directory. Points with equal allocations can share one array."""
    return [str(d) for d in sbatch_directives(spec) if not str(d).startswith(_RUN_DIR_OPTIONS)]


# ---------------------------------------------------------------- naming


def short_keys(overrides: list[dict[str, Any]]) -> dict[str, str]:
    """Each swept key by its last part ('train.lr' -> 'lr'), or whole where two keys share it."""
    keys = list(dict.fromkeys(key for point in overrides for key in point))
    last = Counter(key.rsplit(".", 1)[-1] for key in keys)
    return {key: key.rsplit(".", 1)[-1] if last[key.rsplit(".", 1)[-1]] == 1 else key for key in keys}


def point_names(overrides: list[dict[str, Any]]) -> list[str]:
    """The points' names, in order: ``<short key>-<value>`` joined by '_' ('lr-0.0003_r-16'),
    'base' for no overrides. A name over 64 characters, or one that distinct points share
    (values that read the same: 'a/b' and 'a-b'), keeps 55 characters and gets 8 hex digits
    of the overrides' hash."""
    short = short_keys(overrides)
    names = [_readable_name(point, short) for point in overrides]
    names = [_hashed(name, point) if len(name) > MAX_NAME else name for name, point in zip(names, overrides)]
    owners: dict[str, set[str]] = defaultdict(set)
    for name, point in zip(names, overrides):
        owners[name].add(_canonical(point))
    return [_hashed(name, point) if len(owners[name]) > 1 else name for name, point in zip(names, overrides)]


def describe(overrides: dict[str, Any], short: dict[str, str]) -> str:
    """A point as error messages name it: 'lr=0.0003, r=16' (values exact, as JSON)."""
    if not overrides:
        return "base (no overrides)"
    return ", ".join(f"{short.get(key, key)}={_exact(value)}" for key, value in overrides.items())


def _exact(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, default=str)


def _readable_name(overrides: dict[str, Any], short: dict[str, str]) -> str:
    if not overrides:
        return "base"
    name = "_".join(f"{short[key]}-{_value_text(value)}" for key, value in overrides.items())
    # A key such as env._FOO would start the name with '_', which no job name may.
    return re.sub(r"^[^A-Za-z0-9]+", "", name) or "point"


def _value_text(value: Any) -> str:
    """A value as it reads in a name: compact, and exact for numbers and booleans."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = format(value, "g")  # 3e-4 -> 0.0003, 1e-5 -> 1e-05
        if float(text) != value:  # more than 6 significant digits: all of them
            text = repr(value)
        return text.replace("+", "")  # 1e+06: '+' is no job-name character; 1e06 reads the same
    if isinstance(value, (list, dict)):
        return _digest(value)
    text = str(value)
    if text.startswith("/"):  # an absolute path says itself by its last part: /data/mix-a.jsonl -> mix-a.jsonl
        text = text.rstrip("/").rsplit("/", 1)[-1] or text
    return _UNSAFE.sub("-", text)


def overrides_key(overrides: dict[str, Any]) -> str:
    """What makes two points the same point, whatever their names: their overrides, as
    canonical JSON (sweep.json keeps them; a re-submission matches points by this)."""
    return _canonical(overrides)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()[:_HASH_CHARS]


def _hashed(name: str, overrides: dict[str, Any]) -> str:
    prefix = name[:_PREFIX].rstrip("._-")
    return f"{prefix}-{_digest(overrides)}" if prefix else _digest(overrides)


# ---------------------------------------------------------------- expansion


def _settings(table: Any, label: str) -> tuple[SweepSpec | None, list[SpecIssue]]:
    """The [sweep] table validated, its problems keyed as in the file (sweep.grid."train.lr")."""
    try:
        return SweepSpec.model_validate(table), []
    except ValidationError as exc:
        issues = []
        for error in exc.errors():
            # A bad key is reported on the key itself, not on pydantic's '[key]' entry of it.
            loc = tuple(part for part in error["loc"] if part != "[key]")
            message = str(error["msg"]).removeprefix("Value error, ")
            issues.append(SpecIssue(label, key_path(("sweep", *loc)), message))
        return None, issues


def _sweep_problems(settings: SweepSpec, base: ResolvedSpec, label: str) -> list[SpecIssue]:
    """What the sweep as a whole cannot do, checked before any point is built."""
    issues = []
    if settings.size > MAX_ARRAY:
        issues.append(
            SpecIssue(
                label,
                "sweep",
                f"{settings.size} points: one Slurm array holds at most {MAX_ARRAY} tasks (Slurm's default "
                "MaxArraySize); split the sweep into several files",
            )
        )
    elif not any(related_keys(key, "job.array") for key in settings.keys):  # else counted once built
        issues += _task_count([base.run.job.array] * settings.size, label)
    directory = str(base.run_dir)
    try:
        TypeAdapter(SafePath).validate_python(directory)
    except ValidationError:
        # Each point's job.runs_root is this directory, and spec.json is validated again when read.
        where = (label, "job.runs_root") if base.run.job.runs_root else (str(base.site_file), "paths.runs_root")
        issues.append(
            SpecIssue(
                *where,
                f"a sweep's points live under {directory!r}, which must be a plain path "
                "(letters, digits and _./~+@:=,-): set job.runs_root to one",
            )
        )
    return issues


def _drafts(settings: SweepSpec, base_seed: int) -> list[_Draft]:
    """The points in order: the grid's cross product (first key slowest), then the explicit
    points, each repeated once per seed with train.seed last."""
    drafts = []
    if settings.grid:
        keys = list(settings.grid)
        for values in itertools.product(*settings.grid.values()):
            drafts.append(_Draft(dict(zip(keys, values)), ("sweep", "grid")))
    drafts += [_Draft(dict(point), ("sweep", "points", index)) for index, point in enumerate(settings.points)]
    if settings.seeds:
        drafts = [
            replace(draft, overrides={**draft.overrides, SEED_KEY: base_seed + offset}, seeded=True)
            for draft in drafts
            for offset in range(settings.seeds)
        ]
    return drafts


def _set(doc: dict[str, Any], key: str, value: Any) -> str | None:
    """Set a dotted key, making the tables on its way; the problem, if one is not a table."""
    parts = key.split(".")
    node = doc
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return f"cannot set {key}: {'.'.join(parts[: depth + 1])} is {_exact(child)}, not a table"
        node = child
    node[parts[-1]] = copy.deepcopy(value)
    return None


def _build(
    raw: dict[str, Any], draft: _Draft, name: str, directory: Path, spec_file: Path, desc: str
) -> tuple[ResolvedSpec | None, list[SpecIssue]]:
    """One point's spec, or its problems keyed by the sweep key that caused them."""
    label = str(spec_file)
    doc = copy.deepcopy({key: value for key, value in raw.items() if key != "sweep"})
    issues = []
    for key, value in draft.overrides.items():
        problem = _set(doc, key, value)
        if problem:
            issues.append(SpecIssue(label, key_path(draft.location(key)), f"point {desc}: {problem}"))
    if issues:
        return None, issues
    # A valid base has a [job] table. points/: no point's name can be one of the sweep's files.
    doc["job"] = {**doc["job"], "name": name, "runs_root": str(directory / POINTS_DIR)}
    try:
        return resolve(doc, spec_file=spec_file, base_dir=spec_file.absolute().parent), []
    except SpecError as exc:
        return None, [_relabel(issue, draft, desc) for issue in exc.issues]


def _under(issue_key: str, key: str) -> bool:
    """The loader's issue key is the override's key, lies under it, or is a table holding it."""
    if not issue_key:
        return False
    return (
        issue_key == key
        or issue_key.startswith((key + ".", key + "["))
        or key.startswith(issue_key + ".")
        or key.startswith(issue_key + "[")
    )


def _relabel(issue: SpecIssue, draft: _Draft, desc: str) -> SpecIssue:
    """A loader issue of a point, keyed by the sweep key that set it (else by the point),
    its message naming the point. The base file is valid, so the point's keys caused it."""
    causes = [key for key in draft.overrides if _under(issue.key, key)]
    cause = causes[0] if len(causes) == 1 else None
    where = key_path(draft.location(cause)) if cause else key_path(draft.where)
    inner = f"{issue.key}: " if issue.key and issue.key != cause else ""
    return SpecIssue(issue.file, where, f"point {desc}: {inner}{issue.message}")


# ---------------------------------------------------------------- across points


def _duplicates(drafts: list[_Draft], points: list[SweepPoint], short: dict[str, str], label: str) -> list[SpecIssue]:
    """Two points that resolve to one run (the same value written twice, a key set to the
    file's own value) would train the same thing twice."""
    seen: dict[str, tuple[_Draft, SweepPoint]] = {}
    issues = []
    for draft, point in zip(drafts, points):
        run = point.spec.run.model_dump(mode="json")
        run["job"].pop("name")
        fingerprint = _canonical(run)
        if fingerprint not in seen:
            seen[fingerprint] = (draft, point)
            continue
        first, other = seen[fingerprint]
        issues.append(
            SpecIssue(
                label,
                key_path(draft.where),
                f"point {describe(draft.overrides, short)}: the same run as point "
                f"{describe(first.overrides, short)} ({other.name}); give each point a different run",
            )
        )
    return issues


def _allocations(
    base: ResolvedSpec, drafts: list[_Draft], points: list[SweepPoint], short: dict[str, str], label: str
) -> list[SpecIssue]:
    """Points must ask Slurm for what the file asks: one array has one request for all its tasks."""
    wanted = allocation(base)
    base_job = base.run.job.model_dump(mode="json")
    issues = []
    for draft, point in zip(drafts, points):
        got = allocation(point.spec)
        if got == wanted:
            continue
        job = point.spec.run.job.model_dump(mode="json")
        # Only job.* reaches the directives (the site's part cannot be swept).
        keys = [k for k in draft.overrides if k.startswith("job.") and _lookup(job, k) != _lookup(base_job, k)]
        added = " ".join(d for d in got if d not in wanted) or "nothing"
        dropped = " ".join(d for d in wanted if d not in got) or "nothing"
        where = draft.location(keys[0]) if len(keys) == 1 else draft.where
        issues.append(
            SpecIssue(
                label,
                key_path(where),
                f"point {describe(draft.overrides, short)}: one Slurm array asks the same of every task, and "
                f"{', '.join(keys) or 'this point'} changes the request ({added} instead of {dropped}): "
                "sweep it in a run.toml of its own",
            )
        )
    return issues


def _task_count(arrays: list[int], label: str) -> list[SpecIssue]:
    """The array gives each point its job.array tasks (``arrays``): more than one array holds
    is refused at validate, not only when sbatch would refuse it."""
    if sum(arrays) <= MAX_ARRAY:
        return []
    each = f"job.array = {arrays[0]} each" if len(set(arrays)) == 1 else "job.array of each"
    return [
        SpecIssue(
            label,
            "job.array",
            f"{len(arrays)} points need {sum(arrays)} array tasks ({each}); one Slurm array holds at most "
            f"{MAX_ARRAY} (Slurm's default MaxArraySize): lower job.array or split the sweep into several files",
        )
    ]


def _lookup(table: dict[str, Any], job_key: str) -> Any:
    """The value of 'job.x.y' in a dumped [job] table (None where it has none)."""
    node: Any = table
    for part in job_key.split(".")[1:]:
        node = node.get(part) if isinstance(node, dict) else None
    return node
