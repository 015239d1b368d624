"""Alerts that a person can live with: on a change of state, then at most once per
reminder interval, and one "resolved" when the condition clears.

Each (target, check) has a small state file under ``<home>/state/``; the decision is
a pure function of the previous state, the new result and the clock
(:func:`decide`), so it is unit-tested without a cluster. Every message is appended
to the run's ``logs/watchdog.log`` and the home's ``watchdog.log``, then sent by
email (SMTP) and to a Slack-compatible webhook when configured. Secrets (SMTP
password, webhook URL) are read from their file or variable at send time, never
stored in a job file, and never quoted in an error: the logs a failure lands in are
read by the team, and urllib, http.client and SMTP servers quote what they were
given, so a failure names the file or variable instead. A message an external
channel failed to take is sent again at the next run instead of waiting for the
reminder interval. :func:`run_alerts` reads the state files back for ``jobgen status``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from jobgen.base.atomic import write_json_atomic
from jobgen.base.durations import format_human
from jobgen.base.lease import exclusive
from jobgen.spec.resolved import ResolvedSpec
from jobgen.spec.tables.watchdogs import EmailSettings, WebhookSettings
from watchdogs.target import CheckResult, Target, watchdog_home

ALERT, REMINDER, RESOLVED = "ALERT", "REMINDER", "RESOLVED"


@dataclass
class AlertState:
    status: str  # "ok" or "alert"
    since: float  # when the current status began
    last_sent: float | None = None  # last alert or reminder
    summary: str = ""
    undelivered: bool = False  # an external channel failed last time: try again next run
    runs: int = 0  # consecutive runs in this status

    @classmethod
    def from_json(cls, data: dict) -> AlertState:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def decide(
    prev: AlertState | None, alert: bool, summary: str, now: float, reminder: float
) -> tuple[str | None, AlertState]:
    """The message to send (if any) and the new state."""
    if alert:
        if prev is None or prev.status != "alert":
            return ALERT, AlertState("alert", now, now, summary, runs=1)
        state = AlertState("alert", prev.since, prev.last_sent, summary, prev.undelivered, prev.runs + 1)
        if prev.undelivered or prev.last_sent is None or now - prev.last_sent >= reminder:
            state.last_sent = now
            return REMINDER, state
        return None, state
    if prev is not None and prev.status == "alert":
        return RESOLVED, AlertState("ok", now, prev.last_sent, summary, runs=1)
    runs = prev.runs + 1 if prev is not None else 1
    return None, AlertState("ok", prev.since if prev else now, prev.last_sent if prev else None, summary, runs=runs)


def state_key(result: CheckResult) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{result.target}.{result.check}")[:200]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One writer of a state file at a time: a check run by hand while the scheduler runs it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path):
        yield


def message(kind: str, result: CheckResult, prev: AlertState | None, now: float) -> tuple[str, str]:
    """(subject, body)."""
    if kind == RESOLVED:
        lasted = f" after {format_human(round(now - prev.since))}" if prev else ""
        subject = f"[jobgen watchdog] RESOLVED {result.check} {result.target}{lasted}: {result.summary}"
    else:
        since = (
            f" (since {time.strftime('%Y-%m-%d %H:%M', time.localtime(prev.since))})"
            if kind == REMINDER and prev
            else ""
        )
        subject = f"[jobgen watchdog] {kind} {result.check} {result.target}: {result.summary}{since}"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now))
    body = "\n".join([subject, *result.details, f"checked on {result.host} at {stamp}"])
    return subject, body


class DeliveryError(RuntimeError):
    """A channel's failure, worded so that it never quotes the channel's secret."""


# A webhook URL urllib can take: printable ASCII, no spaces (no control characters
# for http.client to quote back).
_URL = re.compile(r"^https?://[!-~]+$")


def _secret(path: str | None, env: str | None, what: str) -> str | None:
    if path:
        try:
            value = Path(path).read_text().strip()
        except UnicodeDecodeError:  # its message quotes bytes of the file
            raise DeliveryError(f"{what} file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise DeliveryError(f"{type(exc).__name__}: {what} file {path}: {exc.strerror}") from None
        if not value:
            raise DeliveryError(f"{what} file {path} is empty")
        return value
    if env:
        value = os.environ.get(env)
        if value is None:
            raise DeliveryError(f"{what}: environment variable {env} is not set")
        return value
    return None


def _where(path: str | None, env: str | None) -> str:
    return f"file {path}" if path else f"environment variable {env}" if env else "[watchdogs.webhook] url"


def _redacted(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        for form in {secret, repr(secret)[1:-1]} if secret else ():
            text = text.replace(form, "<secret>")
    return text


def _describe(exc: BaseException, secrets: Iterable[str]) -> str:
    """A failure for the logs: what the other side or the OS said, never an exception's
    own message that may quote what it was given (a URL, a password's characters)."""
    import smtplib
    import urllib.error

    if isinstance(exc, urllib.error.HTTPError):
        detail = f"HTTP {exc.code} {exc.reason}"
    elif isinstance(exc, urllib.error.URLError):
        reason = exc.reason
        detail = (reason.strerror or str(reason)) if isinstance(reason, OSError) else str(reason)
    elif isinstance(exc, smtplib.SMTPResponseException):
        detail = f"{exc.smtp_code} {exc.smtp_error.decode(errors='replace')}"
    elif isinstance(exc, (OSError, smtplib.SMTPException)):
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    else:  # ValueError, http.client.InvalidURL, UnicodeError, ...: they quote their input
        return f"{type(exc).__name__}: its message is not shown (it may quote the secret)"
    return f"{type(exc).__name__}: {_redacted(detail, secrets)}"


def send_email(settings: EmailSettings, subject: str, body: str) -> None:
    # Imported here: jobgen status reads the alerts of this module at every call, and sends none.
    import base64
    import smtplib
    import ssl
    from email.message import EmailMessage

    password = _secret(settings.password_file, settings.password_env, "email password")
    msg = EmailMessage()
    msg["Subject"], msg["From"], msg["To"] = subject[:900], settings.sender, ", ".join(settings.to)
    msg.set_content(body)
    cls = smtplib.SMTP_SSL if settings.security == "ssl" else smtplib.SMTP
    # What a server may echo of a login: the password, and AUTH PLAIN / LOGIN's base64 of it.
    secrets = (
        [
            password,
            *(base64.b64encode(f"{prefix}{password}".encode()).decode() for prefix in ("", f"\0{settings.username}\0")),
        ]
        if password
        else []
    )
    try:
        with cls(settings.host, settings.port, timeout=20) as smtp:
            if settings.security == "starttls":
                smtp.starttls(context=ssl.create_default_context())
            if settings.username:
                smtp.login(settings.username, password or "")
            smtp.send_message(msg)
    except Exception as exc:  # noqa: BLE001 - reworded so that the password never reaches a log
        raise DeliveryError(_describe(exc, secrets)) from None


def send_webhook(settings: WebhookSettings, text: str) -> None:
    url = settings.url or _secret(settings.url_file, settings.url_env, "webhook url")
    where = _where(settings.url_file, settings.url_env)
    if not _URL.match(url):
        raise DeliveryError(
            f"the webhook url in {where} is not an http(s):// URL of printable characters (not shown: it is a secret)"
        )
    import urllib.request

    try:
        request = urllib.request.Request(
            url, data=json.dumps({"text": text}).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=20) as response:
            if response.status >= 300:
                raise DeliveryError(f"webhook answered HTTP {response.status}")
    except DeliveryError:
        raise
    except Exception as exc:  # noqa: BLE001 - reworded so that the URL never reaches a log
        raise DeliveryError(f"{_describe(exc, [url])}; url from {where}") from None


def _failure(exc: Exception) -> str:
    # A DeliveryError is worded for the logs already; anything else is a jobgen bug.
    return str(exc) if isinstance(exc, DeliveryError) else f"{type(exc).__name__}: {exc}"


def append_line(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(text.rstrip("\n") + "\n")


def send(kind: str, result: CheckResult, target: Target, prev: AlertState | None, now: float) -> list[str]:
    """Log everywhere, then try each external channel; returns the failures."""
    settings = target.settings
    subject, body = message(kind, result, prev, now)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
    logged = f"{stamp} {body}".replace("\n", "\n    ")
    if target.home is not None:
        append_line(target.home / "watchdog.log", logged)
    if target.run is not None:
        append_line(target.run.logs / "watchdog.log", logged)
    failures = []
    if settings.email is not None:
        try:
            send_email(settings.email, subject, body)
        except Exception as exc:  # noqa: BLE001 - any failure of a channel is reported, none stops the others
            failures.append(f"email: {_failure(exc)}")
    if settings.webhook is not None:
        try:
            send_webhook(settings.webhook, body)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"webhook: {_failure(exc)}")
    for failure in failures:
        note = f"{stamp} could not deliver {kind} {result.check} {result.target}: {failure}"
        if target.home is not None:
            append_line(target.home / "watchdog.log", note)
    return failures


def deliver(result: CheckResult, target: Target, now: float | None = None) -> str | None:
    """Record the result and send what the state change calls for; returns the kind sent."""
    home = target.home
    if home is None:
        raise RuntimeError("--notify needs a watchdog home: give --run or --home")
    now = time.time() if now is None else now
    path = home / "state" / f"{state_key(result)}.json"
    with locked(path.with_suffix(".lock")):
        prev = AlertState.from_json(json.loads(path.read_text())) if path.is_file() else None
        kind, state = decide(prev, result.alert, result.summary, now, target.settings.reminder)
        if kind is not None:
            state.undelivered = bool(send(kind, result, target, prev, now)) and kind != RESOLVED
        write_json_atomic(
            path,
            {
                **asdict(state),
                "check": result.check,
                "target": result.target,
                "last_run": now,
                "last_alert": result.alert,
            },
        )
    return kind


def active_alerts(home: Path, target: str) -> list[str]:
    """The conditions currently alerting for ``target`` (a run's name), for ``jobgen status``."""
    out = []
    for path in sorted((home / "state").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("target") == target and data.get("status") == "alert":
            since = time.strftime("%Y-%m-%d %H:%M", time.localtime(data.get("since", 0)))
            out.append(f"{data.get('check')}: {data.get('summary')} (since {since})")
    return out


def run_alerts(spec: ResolvedSpec) -> list[str]:
    """The run's active alerts from its watchdog home, if it has one yet: what ``jobgen/cli/main.py``
    hands to ``jobgen.report.status.run_status`` (jobgen itself does not import watchdogs)."""
    home = watchdog_home(spec)
    return active_alerts(home, spec.run.job.name) if home.is_dir() else []
