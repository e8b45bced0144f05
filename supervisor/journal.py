"""The journal: an append-only, fsynced event log in the run directory.

It is the single source for ``spikeguard status``/``events``, for Slack and
for a restarted supervisor. One JSON object a line; each append is one unbuffered write,
fsynced before ``append`` returns, so an event that was acted upon is on disk. An append that
fails (a full disk) raises :class:`~.rundir.Unwritable` and leaves nothing of its event in the
file, nor takes its ``seq``: no fragment reaches the disk later (:class:`.rundir.LineFile`). A
torn last line (the supervisor died mid-write) is ignored on read and ended before the next
append. The file is private (0600) and never opened through a symlink.

Readers (:func:`read_journal`) take what a line holds as input: one that is not an event, or an
event whose common fields are odd (:func:`check_event`), is named with its line number, never a
``KeyError`` or a ``TypeError`` inside the reader.

Every event has ``seq``, ``kind`` (:class:`~.events.Kind`), ``time`` (ISO-8601 UTC), ``mono``
(seconds on the supervisor's monotonic clock since it started), ``run``, ``incident`` (or null)
and ``reason``, plus the kind's own fields. The recovery machine's events also have ``code``
(:class:`~.events.Code`); the first event of each of its transitions that changed its state
records the observations that caused it (``obs``) and a fingerprint of the state after it
(``state_digest``): replaying ``obs`` through the machine rebuilds that state (``fold``).

No secret is ever written: :meth:`Journal.append` is the one place every event passes, and it
redacts every string in it (nested ones too) with the one scanner
(:func:`~spikeguard.workers.contract.secret_scan.redact`): anything shaped like a credential,
and the values of the secrets the supervisor holds (:func:`~.redaction.held_secrets`).
A rank's log tail or an error text that quotes the Slack token or the webhook URL reads
``[redacted]``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.logs import logger
from spikeguard.workers.contract.messages import loads_text
from spikeguard.workers.contract.secret_scan import redact

from . import rundir
from .decide.events import Kind
from .redaction import held_secrets

log = logger(__name__)

JOURNAL_NAME = "journal.jsonl"
VERBATIM = frozenset({"kind", "obs", "state_digest"})
"""Fields written as they are: the kind, and what a restart replays (the recovery machine's
observations: rule names, numbers, checkpoint paths — a path that happened to look like a
token must still name the checkpoint after a restart)."""


class Journal:
    """Append-only event log. Thread-safe (the Slack sender journals from its own thread)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        run: str,
        secrets: Iterable[str] | None = None,
    ) -> None:
        """Open (or continue) ``RUN_DIR/journal.jsonl``. ``secrets``: the values to redact
        besides anything shaped like a credential (default: those this process's environment
        holds, :func:`~.redaction.held_secrets`)."""
        self.path = Path(run_dir) / JOURNAL_NAME
        self.run = run
        self.secrets = tuple(held_secrets(os.environ) if secrets is None else secrets)
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        rundir.private_dir(self.path.parent)
        # 0600, never through a symlink (UnsafePath), unbuffered: a failed append leaves nothing
        self._f = rundir.LineFile(self.path)
        read = read_journal(self.path)
        for problem in read.problems:
            log.warning(f"{self.path} {problem}")
        self._seq = max((e["seq"] for e in read.events if _is_int(e.get("seq"))), default=0)
        monos = [e["mono"] for e in read.events if _is_number(e.get("mono"))]
        self._mono_base = float(monos[-1]) if monos else 0.0

    def mono(self) -> float:
        """Seconds since this journal was first opened (continues across supervisor restarts)."""
        return self._mono_base + (time.monotonic() - self._t0)

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one event of ``kind`` (a :class:`~.events.Kind` value); returns it as written."""
        try:
            kind = Kind(kind).value
        except ValueError:
            raise ValueError(f"unknown journal kind {kind!r}") from None
        with self._lock:
            ev = {
                "seq": self._seq + 1,
                "kind": kind,
                "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                "mono": round(self.mono(), 3),
                "run": self.run,
                "incident": fields.pop("incident", None),
                "reason": fields.pop("reason", ""),
            }
            ev.update(fields)
            ev = {k: v if k in VERBATIM else self._redact(v) for k, v in ev.items()}
            line = (json.dumps(ev, default=str) + "\n").encode()
            try:  # one unbuffered write, fsynced; on failure truncated away (rundir.LineFile)
                self._f.append(line, fsync=True)
            except OSError as e:
                why = e.strerror or str(e)
                raise rundir.Unwritable(f"cannot append to {self.path} ({why})") from e
            self._seq += 1  # a failed append takes no number: the next event has it
            return ev

    def _redact(self, value: Any) -> Any:
        return redact_fields(value, self.secrets)

    def record(self, event: dict[str, Any]) -> dict[str, Any]:
        """Append an event given as a dict with a ``kind`` (what the recovery machine returns)."""
        fields = dict(event)
        return self.append(fields.pop("kind"), **fields)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def redact_fields(value: Any, secrets: Iterable[str] = ()) -> Any:
    """``value`` (an event, or any plain data) with every string in it redacted by
    :func:`~spikeguard.workers.contract.secret_scan.redact`, ``secrets`` being the known values;
    dicts and lists are walked (keys kept), other values returned as they are."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: redact_fields(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_fields(v, secrets) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class LineProblem:
    """What is wrong with one line of a journal (:func:`read_journal`)."""

    line: int
    """1-based."""
    problem: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.problem}"


@dataclasses.dataclass(frozen=True)
class JournalRead:
    """A journal as read: its events, the line each came from, what is odd about which line."""

    events: list[dict[str, Any]]
    lines: list[int]
    """The 1-based line number of each of ``events``."""
    problems: list[LineProblem]

    def line_of(self, index: int) -> int:
        """The line number of ``events[index]``."""
        return self.lines[index]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_event(ev: dict[str, Any]) -> list[str]:
    """What is odd about the fields every event has (``seq``, ``kind``, ``time``, ``mono``,
    ``obs``) in ``ev``; an empty list when nothing is. Readers still get such an event (``events``
    prints it as it is); each says what it found, so a hand-edited or foreign journal is never a
    ``KeyError`` or ``TypeError`` deep inside one of them."""
    out = []
    kind = ev.get("kind")
    if not isinstance(kind, str):
        out.append(f"kind is {kind!r}, not a string")
    elif kind not in _KINDS:
        out.append(f"unknown kind {kind!r}")
    if "seq" not in ev:
        out.append("no seq")
    elif not _is_int(ev["seq"]):
        out.append(f"seq is {ev['seq']!r}, not an integer")
    if "time" in ev and not isinstance(ev["time"], str):
        out.append(f"time is {ev['time']!r}, not a string")
    if "mono" in ev and not _is_number(ev["mono"]):
        out.append(f"mono is {ev['mono']!r}, not a number")
    if "obs" in ev and not isinstance(ev["obs"], list):
        out.append(f"obs is {type(ev['obs']).__name__}, not a list")
    return out


_KINDS = frozenset(k.value for k in Kind)


def read_journal(path: str | os.PathLike[str]) -> JournalRead:
    """Read ``path`` (a journal, or the run directory holding one): every line that is a JSON
    object with a ``kind`` is an event; what is wrong with any line is a :class:`LineProblem`
    (a line that is not an event is skipped; a torn last line - the supervisor died mid-write -
    is ignored, and said so). Never raises on what the file holds."""
    p = Path(path)
    if p.is_dir():
        p = p / JOURNAL_NAME
    events: list[dict[str, Any]] = []
    lines: list[int] = []
    problems: list[LineProblem] = []
    if not p.exists():
        return JournalRead(events, lines, problems)
    with open(p, "rb") as f:
        data = f.read()
    raw_lines = data.split(b"\n")
    torn = raw_lines[-1] != b""  # the file does not end with a newline
    if not torn:
        raw_lines.pop()
    for n, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            ev = loads_text(raw)
        except ValueError:
            last = n == len(raw_lines)
            what = "cut short (a write that did not finish): ignored" if last and torn else None
            problems.append(LineProblem(n, what or "not JSON: skipped"))
            continue
        if not isinstance(ev, dict):
            problems.append(LineProblem(n, f"a JSON {type(ev).__name__}, not an event: skipped"))
            continue
        if "kind" not in ev:
            problems.append(LineProblem(n, "no kind: not an event, skipped"))
            continue
        problems.extend(LineProblem(n, what) for what in check_event(ev))
        events.append(ev)
        lines.append(n)
    return JournalRead(events, lines, problems)


def iter_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The events of :func:`read_events`, one at a time."""
    yield from read_events(path)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of the journal at ``path`` (:func:`read_journal`); what is wrong with which
    line is logged (a warning each), for the readers that show none of it themselves."""
    read = read_journal(path)
    for problem in read.problems:
        log.warning(f"{path} (journal) {problem}")
    return read.events
