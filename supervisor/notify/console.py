"""Console output: the story as it is journaled, and a live per-rank view.

:class:`ConsoleNotifier` prints one line per story event (:data:`~..events.STORY_KINDS`) with
:func:`.describe.describe`, redacted like the journal (no token or webhook URL ever reaches a
terminal or a log collector); :class:`LiveView` and ``spikeguard status`` print
:func:`render_status` of the status dict (``status.json``, :func:`..status.live_status`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

from spikeguard.workers.contract.secrets import redact
from spikeguard.workers.contract.signals import grade_text

from ..events import STORY_KINDS
from ..secrets import held_secrets
from ..status import live_status
from .describe import describe


class ConsoleNotifier:
    """Prints every story event as it is journaled (alerts only of the ``severities`` the
    policy's ``notify.routes`` send to the console)."""

    def __init__(
        self,
        out: TextIO | None = None,
        severities: tuple[str, ...] = ("info", "warn", "page"),
        *,
        secrets: Iterable[str] | None = None,
    ) -> None:
        """Print to ``out`` (stdout) the alerts of ``severities`` and every other story event.
        ``secrets``: values to redact besides anything shaped like a credential (default: those
        this process's environment holds)."""
        self.out = out or sys.stdout
        self.severities = severities
        self.secrets = tuple(held_secrets(os.environ) if secrets is None else secrets)

    def handle(self, ev: dict[str, Any]) -> None:
        """Print ``ev`` if a person following the run wants to read it."""
        if ev.get("kind") not in STORY_KINDS:
            return
        if ev.get("kind") == "alert" and str(ev.get("severity") or "warn") not in self.severities:
            return
        line = redact(describe(ev), self.secrets)
        print(f"[spikeguard {ev['mono']:8.1f}s] {line}", file=self.out, flush=True)


class LiveView:
    """Prints the per-rank grade, entropy, loss and the recovery state every few seconds."""

    def __init__(self, *, every_s: float = 5.0, out: TextIO | None = None) -> None:
        self.every_s = every_s
        self.out = out or sys.stderr
        self._last = 0.0

    def __call__(self, ctl: Any) -> None:
        """Print the controller's status (what ``status.json`` holds), at most every ``every_s``."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        print(render_status(live_status(ctl.state, ctl.collector)), file=self.out, flush=True)


def render_status(s: dict[str, Any]) -> str:
    """The live view / ``spikeguard status`` text for a status dict."""
    head = f"{s['phase']:<12} gen {s['generation']}  LR x{s['lr_scale']:.3g}"
    if s.get("probation_until"):
        head += f"  probation until step {s['probation_until']}"
    parts = []
    for r, v in sorted(s.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
        grade, loss = grade_text(v.get("grade")), v.get("loss")
        # the normalised entropy (0..1): what the policies compare, not nats
        ent = v.get("attn_entropy_min_norm")
        parts.append(f"r{r}: step {v.get('step')} {grade} H_min/max {_f(ent)} loss {_f(loss)}")
    return head + ("  |  " + "  |  ".join(parts) if parts else "")


def _f(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else str(x)
