"""The ``[watchdogs]`` table: which checks run how often, their thresholds, who hears about it.

It may sit in a site profile (team-wide defaults: the CPU partition, the mail
relay, the webhook) and in ``run.toml`` (per-run thresholds); the run's keys win,
key by key. The effective table is stored in the run's ``spec.json``, which is
where every check reads it, so secrets are never copied into a job file: email
passwords and webhook URLs are read from a file or an environment variable when a
message is sent.

The field descriptions are the reference documentation (``jobgen schema``).

This module owns the table's schema and its threshold syntax (``parse_threshold``).
It is part of the run.toml schema, so it lives in ``jobgen/`` beside ``spec.py`` and
``site.py``; the checks in ``watchdogs/`` read it from here (dependencies point one
way: watchdogs uses jobgen, never the reverse).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from jobgen.spec.fields import Duration, EnvName, SafePath, SlurmName, SpecModel, matching

WebhookUrl = matching(r"^https?://\S+$", "a webhook URL", "an http:// or https:// URL without spaces")

_THRESHOLD = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def parse_threshold(text: str, *, binary: bool = True) -> tuple[float, bool]:
    """``'20%'`` → (20.0, True); ``'500G'`` → (500 * 2**30, False); ``'100000'`` → (100000, False).
    Byte amounts use binary units (``G`` = GiB, as ``df -h`` shows); counts use 1000s."""
    match = _THRESHOLD.match(text)
    if not match:
        raise ValueError(f"'{text}' is not an amount: use a percentage ('20%') or a size ('500G', '100000')")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    if unit == "%":
        if number > 100:
            raise ValueError(f"'{text}': a percentage must be at most 100")
        return number, True
    letter = unit[:1] if unit not in ("", "B") else ""
    scale = _UNITS[letter] if binary else 1000 ** (" KMGTP".index(letter) if letter else 0)
    return number * scale, False


def _valid_threshold(text: str) -> str:
    parse_threshold(text)
    return text


Threshold = Annotated[str, AfterValidator(_valid_threshold)]


def _at_least_a_minute(seconds: int) -> int:
    if seconds < 60:
        raise ValueError("must be at least 1m: Slurm's scheduler and time limits work in minutes")
    return seconds


Interval = Annotated[Duration, AfterValidator(_at_least_a_minute)]


class DiskCheck(SpecModel):
    """Free space and free inodes where the run writes, plus a forecast of when it fills."""

    enabled: bool = Field(True, description="Run this check.")
    every: Interval = Field("1h", description="How often the scheduler runs it (at least 1m).")
    paths: list[SafePath] = Field(
        default_factory=list,
        description="Filesystems to watch besides the run directory's own (e.g. the data cache, HF_HOME).",
    )
    min_free: Threshold = Field(
        "20%",
        description=(
            "Alert when free space drops below this: a percentage of the filesystem ('20%') or a size ('500G'). "
            "Parallel filesystems often misbehave well before 100 %, hence 20 % by default."
        ),
    )
    min_free_inodes: Threshold = Field(
        "10%", description="Alert when free inodes drop below this: a percentage ('10%') or a count ('100000')."
    )
    forecast: Duration = Field(
        "12h",
        description=(
            "Alert when, at the run's observed checkpoint size and save frequency, the run directory's "
            "filesystem will not hold the next checkpoints within this time. '0s' disables the forecast."
        ),
    )


class RunningCheck(SpecModel):
    """The run has a job running or pending, or has finished."""

    enabled: bool = Field(True, description="Run this check.")
    every: Interval = Field("10m", description="How often the scheduler runs it (at least 1m).")


class HangCheck(SpecModel):
    """A RUNNING job whose log and metrics stopped moving."""

    enabled: bool = Field(True, description="Run this check.")
    every: Interval = Field("10m", description="How often the scheduler runs it (at least 1m).")
    stale_after: Duration = Field(
        "30m",
        description=(
            "Alert when neither metrics.jsonl nor the job's log has changed for this long while the job is "
            "RUNNING. Keep it above the slowest step plus the slowest checkpoint save."
        ),
    )
    stack_dump: bool = Field(
        True, description="Before alerting, dump every rank's Python stack with py-spy into <run>/hangs/."
    )


class MemoryCheck(SpecModel):
    """Host memory of the nodes the run is on."""

    enabled: bool = Field(True, description="Run this check.")
    every: Interval = Field("10m", description="How often the scheduler runs it (at least 1m).")
    max_percent: float = Field(
        90.0, gt=0, le=100, description="Alert when a node's used memory is above this percentage."
    )


class EmailSettings(SpecModel):
    """Alerts by email through an SMTP relay."""

    to: list[str] = Field(min_length=1, description="Recipients.")
    sender: str = Field("jobgen-watchdog@localhost", description="From address.")
    host: str = Field("localhost", description="SMTP server.")
    port: int = Field(25, ge=1, le=65535, description="SMTP port (25, 587 with starttls, 465 with ssl).")
    security: Literal["none", "starttls", "ssl"] = Field("none", description="Transport security.")
    username: str | None = Field(None, description="Login name, when the relay needs one.")
    password_file: SafePath | None = Field(
        None, description="File holding the password (keep it mode 0600); read when a message is sent."
    )
    password_env: EnvName | None = Field(
        None, description="Environment variable holding the password, read when a message is sent."
    )

    @model_validator(mode="after")
    def _one_password_source(self) -> EmailSettings:
        if self.password_file and self.password_env:
            raise ValueError("give password_file or password_env, not both")
        if (self.password_file or self.password_env) and not self.username:
            raise ValueError("a password needs a username")
        return self


class WebhookSettings(SpecModel):
    """Alerts as a Slack-compatible JSON POST (``{"text": ...}``)."""

    url: WebhookUrl | None = Field(
        None,
        description="Webhook URL. Slack URLs are secrets: prefer url_file or url_env on shared filesystems.",
    )
    url_file: SafePath | None = Field(None, description="File holding the URL; read when a message is sent.")
    url_env: EnvName | None = Field(None, description="Environment variable holding the URL.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> WebhookSettings:
        given = [k for k in ("url", "url_file", "url_env") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of url, url_file, url_env")
        return self


class WatchdogSettings(SpecModel):
    """Scheduled checks that run as small Slurm jobs and tell a person before the run dies."""

    home: SafePath | None = Field(
        None,
        description=(
            "Directory of the scheduler: cron.<interval>/ job files, logs, alert state. Must be on a filesystem "
            "every node sees. Default <runs_root>/.watchdogs."
        ),
    )
    partition: SlurmName | None = Field(
        None, description="Partition for the scheduler jobs (a CPU partition); default the site's partition."
    )
    account: SlurmName | None = Field(None, description="Account for the scheduler jobs; default the site's.")
    time: Duration = Field("10m", description="Time limit of each scheduler job; every check of one tick must fit.")
    reminder: Duration = Field(
        "6h", description="While a condition lasts, repeat the alert at most this often (one alert, then reminders)."
    )
    log_retention: Duration = Field(
        "7d", description="Scheduler logs older than this are deleted, so they do not eat inodes."
    )
    disk: DiskCheck = Field(default_factory=DiskCheck, description="Free space and inodes.")
    running: RunningCheck = Field(default_factory=RunningCheck, description="The run is queued or running.")
    hang: HangCheck = Field(default_factory=HangCheck, description="The run makes progress.")
    memory: MemoryCheck = Field(default_factory=MemoryCheck, description="Node memory.")
    email: EmailSettings | None = Field(None, description="Send alerts by email; omit for none.")
    webhook: WebhookSettings | None = Field(
        None, description="POST alerts to a Slack-compatible webhook; omit for none."
    )

    def check(self, name: str) -> DiskCheck | RunningCheck | HangCheck | MemoryCheck:
        return getattr(self, name)
