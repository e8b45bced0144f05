"""The journal: an append-only, fsynced event log in the run directory.

It is the single source for ``spikeguard status``/``events``, for Slack and
for a restarted supervisor. One JSON object a line; each append is flushed
and fsynced before ``append`` returns, so an event that was acted upon is on
disk. A torn last line (the supervisor died mid-write) is ignored on read. The file is private
(0600) and never opened through a symlink (:func:`.rundir.open_append`).

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

import datetime as _dt
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.secret_scan import redact

from . import rundir
from .decide.events import Kind
from .redaction import held_secrets

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
        self._f = rundir.open_append(self.path)  # 0600, never through a symlink (UnsafePath)
        existing = read_events(self.path)
        self._seq = existing[-1]["seq"] if existing else 0
        self._mono_base = existing[-1].get("mono", 0.0) if existing else 0.0
        if self._f.tell() > 0:
            with open(self.path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":  # end a torn line so the next event starts clean
                    self._f.write(b"\n")

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
            self._seq += 1
            ev = {
                "seq": self._seq,
                "kind": kind,
                "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                "mono": round(self.mono(), 3),
                "run": self.run,
                "incident": fields.pop("incident", None),
                "reason": fields.pop("reason", ""),
            }
            ev.update(fields)
            ev = {k: v if k in VERBATIM else self._redact(v) for k, v in ev.items()}
            self._f.write((json.dumps(ev, default=str) + "\n").encode())
            self._f.flush()
            os.fsync(self._f.fileno())
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


def iter_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / JOURNAL_NAME
    if not p.exists():
        return
    with open(p, "rb") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a torn last line from a crash mid-append
            if isinstance(ev, dict) and "kind" in ev:
                yield ev


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_events(path))
