"""The job's Python environment as jobgen can see it before anything is queued: whether its
interpreter is here, whether it imports what the program needs (each module named with the
jobgen extra that installs it), which torch it has and what that torch's torchrun honours.

One probe: the environment's own python runs :data:`PROBE` (no module is imported, so it takes
a fraction of a second even with torch installed) and answers in one JSON line. Where the site
says only the nodes know the environment (modules, a conda environment by name, a container),
nothing is probed and validate says so.

Used by ``jobgen validate`` and by submit's checks (jobgen.launch.submit), before a run
directory is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jobgen.base.paths import CHECKOUT
from jobgen.launch.preflight import Finding
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.site import PythonSettings

PROBE_TIMEOUT_SECONDS = 60
# Finds modules and reads files only: importing torch would take seconds.
PROBE = r"""
import importlib.metadata as metadata, importlib.util, json, sys
from pathlib import Path

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False

torch = importlib.util.find_spec("torch") if found("torch") else None
api = Path(torch.origin).parent / "distributed" / "launcher" / "api.py" if torch and torch.origin else None
try:
    shutdown_env = api is not None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in api.read_text(errors="replace")
except OSError:
    shutdown_env = False
print(json.dumps({
    "python": sys.executable,
    "python_version": "%d.%d.%d" % sys.version_info[:3],
    "missing": [name for name in sys.argv[1:] if not found(name)],
    "torch": version("torch"),
    "jobgen": version("jobgen"),
    "shutdown_timeout_env": shutdown_env,
}))
"""


@dataclass(frozen=True)
class EnvironmentFacts:
    """What the probe found in the environment's python."""

    python: str
    python_version: str
    missing: tuple[str, ...]
    torch: str | None
    jobgen: str | None
    shutdown_timeout_env: bool  # torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (newer torch)


class ProbeFailed(RuntimeError):
    """The environment's python could not answer (missing, broken, too slow)."""


def required_imports(spec: ResolvedSpec) -> list[tuple[str, str]]:
    """(extra, module) for everything the run imports in its environment: the program's own,
    [model.lora]'s peft, and the trackers of train.report_to."""
    run = spec.run
    needed = list(run.job.kind.imports)
    if run.job.kind.trains and run.model is not None and run.model.lora is not None:
        needed.append(("lora", "peft"))
    if run.job.kind.trains:
        needed += [("track", tracker) for tracker in run.train.report_to]
    return needed


def probe(interpreter: str, modules: list[str]) -> EnvironmentFacts:
    """Run :data:`PROBE` in ``interpreter`` (ProbeFailed when it cannot)."""
    env = dict(os.environ)
    if CHECKOUT is not None:  # the job puts the checkout on PYTHONPATH (_python_env.j2): so does the probe
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(
            [interpreter, "-c", PROBE, *modules],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_SECONDS,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProbeFailed(f"{interpreter} did not run: {exc}") from None
    lines = proc.stdout.strip().splitlines()
    try:
        facts = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        return EnvironmentFacts(
            python=str(facts["python"]),
            python_version=str(facts["python_version"]),
            missing=tuple(str(m) for m in facts["missing"]),
            torch=facts["torch"],
            jobgen=facts["jobgen"],
            shutdown_timeout_env=bool(facts["shutdown_timeout_env"]),
        )
    except (TypeError, KeyError, ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        raise ProbeFailed(f"{interpreter} exited {proc.returncode}: {last}") from None


def environment_findings(spec: ResolvedSpec) -> list[Finding]:
    """What validate and submit say of the job's environment: an error for each module the
    run needs that it lacks (naming the extra), a warning where the interpreter is not here,
    and what its torch means for a stop."""
    py = spec.site.python
    interpreter = py.interpreter
    if interpreter is None:
        words = f"python.kind = '{py.kind}': the environment is known only on the nodes, and not checked here"
        return [Finding("info", "site.python", words)]
    needed = required_imports(spec)
    if not Path(interpreter).exists():
        return [
            Finding(
                "warning",
                "site.python",
                f"{interpreter} is not on this machine: every node must have it (a task that does not find it "
                "stops the run, naming it)",
            )
        ]
    try:
        facts = probe(interpreter, sorted({module for _, module in needed}))
    except ProbeFailed as exc:
        return [Finding("error", "site.python", f"the job's environment does not answer: {exc}")]
    return _facts_findings(spec, facts, needed)


def _facts_findings(spec: ResolvedSpec, facts: EnvironmentFacts, needed: list[tuple[str, str]]) -> list[Finding]:
    findings = []
    prefix = str(Path(facts.python).parent.parent)
    for extra in dict.fromkeys(extra for extra, module in needed if module in facts.missing):
        modules = ", ".join(module for e, module in needed if e == extra and module in facts.missing)
        findings.append(
            Finding(
                "error",
                "site.python",
                f"the job's environment ({prefix}) lacks {modules}: pip install 'jobgen[{extra}]' into it",
            )
        )
    grace = spec.run.job.exit_grace
    if facts.torch and not facts.shutdown_timeout_env and grace > 30:
        findings.append(
            Finding(
                "info",
                "job.exit_grace",
                f"torch {facts.torch} in {prefix}: its torchrun gives the ranks 30 s after a SIGTERM (preemption, "
                f"scancel), not exit_grace ({grace} s); the lead-time signal before a time limit is not affected",
            )
        )
    return findings


# What a served model's job imports in its environment (jobgen.serve.node starts `transformers
# serve` or vLLM, both FastAPI apps under uvicorn), by the extra that installs each.
SERVE_IMPORTS = (("train", "torch"), ("train", "transformers"), ("serve", "fastapi"), ("serve", "uvicorn"))


def serve_environment_problem(python: PythonSettings, *, here: bool) -> str | None:
    """Why the environment a serve job runs in cannot serve (``here``: this interpreter, for
    ``--local``), in one line naming the extra; None when it can or cannot be asked."""
    interpreter = sys.executable if here else python.interpreter
    if interpreter is None or not Path(interpreter).exists():
        return None
    try:
        facts = probe(interpreter, sorted({module for _, module in SERVE_IMPORTS}))
    except ProbeFailed as exc:
        return f"the serve job's environment does not answer: {exc}"
    missing = [(extra, module) for extra, module in SERVE_IMPORTS if module in facts.missing]
    if not missing:
        return None
    extras = ",".join(dict.fromkeys(extra for extra, _ in missing))
    modules = ", ".join(module for _, module in missing)
    prefix = Path(facts.python).parent.parent
    return f"the serve job's environment ({prefix}) lacks {modules}: pip install 'jobgen[{extras}]' into it"
