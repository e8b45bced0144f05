"""Console output: the story as it is journaled, and a live per-rank view.

:class:`ConsoleNotifier` prints one line per story event (:data:`~..events.STORY_KINDS`) with
:func:`.describe.describe`, redacted like the journal (no token or webhook URL ever reaches a
terminal or a log collector); :class:`LiveView` and ``spikeguard status`` print
:func:`render_status` of the status dict (``status.json``, :func:`..status.live_status`): per
rank its grade, entropy, loss, heartbeat and step time (its recent median and its ratio to its
peers', a straggler's marked), so a slow rank is visible before any rule fires.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from spikeguard.workers.contract.secret_scan import redact
from spikeguard.workers.contract.signals import grade_text

from ..decide.events import STORY_KINDS
from ..observe.describe import describe, duration_text
from ..observe.metrics import is_slow
from ..observe.status import live_status, ratio_text, seconds_text
from ..redaction import held_secrets
from .registry import BaseSink, SinkContext, register, routes_to


def say(text: str, out: TextIO) -> None:
    """Print ``text`` to ``out``, flushed. When the reader of ``out`` has gone (a closed pipe:
    ``spikeguard submit job.yaml | head``), ``out`` is pointed at ``/dev/null`` (:func:`silence`)
    and the run goes on: nobody reads the console any more, the journal has the story."""
    try:
        print(text, file=out, flush=True)
    except BrokenPipeError:
        silence(out)


def silence(out: TextIO) -> None:
    """Point ``out``'s file descriptor at ``/dev/null``, so that what is still written to it
    (what its buffer holds, flushed at exit) never fails again on a closed pipe; nothing for a
    stream that is not a file (a test's capture)."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class ConsoleNotifier(BaseSink):
    """Prints every story event as it is journaled (alerts only of the ``severities`` the
    policy's ``notify.routes`` send to the console)."""

    def __init__(
        self,
        out: TextIO | None = None,
        severities: tuple[str, ...] = ("info", "warn", "page"),
        *,
        rules: Mapping[str, bool] | None = None,
        secrets: Iterable[str] | None = None,
    ) -> None:
        """Print to ``out`` (stdout) the alerts of ``severities`` (and of the ``rules`` that
        name the console, :func:`~.registry.routes_to`) and every other story event.
        ``secrets``: values to redact besides anything shaped like a credential (default: those
        this process's environment holds)."""
        self.out = out or sys.stdout
        self.severities, self.rules = severities, dict(rules or {})
        self.secrets = tuple(held_secrets(os.environ) if secrets is None else secrets)

    def handle(self, ev: dict[str, Any]) -> None:
        """Print ``ev`` if a person following the run wants to read it."""
        if ev.get("kind") not in STORY_KINDS:
            return
        if ev.get("kind") == "alert" and not routes_to(self.severities, self.rules, ev):
            return
        line = redact(describe(ev), self.secrets)
        say(f"[spikeguard {ev['mono']:8.1f}s] {line}", self.out)


@register("console")
def console_sink(ctx: SinkContext) -> ConsoleNotifier:
    """The story on the supervisor's stdout, alerts of the severities routed to ``console``."""
    return ConsoleNotifier(severities=ctx.severities, rules=ctx.rules)


class LiveView:
    """Prints the per-rank grade, entropy, loss, step time and the recovery state every few
    seconds (a slow rank's ratio in bold red on a terminal)."""

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
        status = getattr(ctl, "status", None)
        view = status() if callable(status) else live_status(ctl.state, ctl.collector)
        say(render_status(view, color=is_terminal(self.out)), self.out)


def is_terminal(out: TextIO) -> bool:
    """Whether ``out`` is a terminal (where a highlight may be an ANSI color), not a log or a
    pipe."""
    try:
        return bool(out.isatty())
    except (AttributeError, OSError, ValueError):
        return False


WORST_K = 5
"""How many ranks the live view lists when there are more (the worst ones)."""


def render_status(s: dict[str, Any], *, worst: int = WORST_K, color: bool = False) -> str:
    """The live view / ``spikeguard status`` text for a status dict: the run's state, its
    progress (the slowest rank's step, steps/s, tokens/s, ETA), the silent and the slow ranks,
    then every rank when there are at most ``worst`` of them, else the ``worst`` worst
    (:func:`badness`) — a few lines whatever the world size. When any rank measures its step
    time, each rank's line has a ``step time`` column (its recent median and its ratio to its
    peers', marked ``SLOW`` from :data:`~..observe.metrics.STRAGGLER_RATIO`, in bold red with
    ``color``; ``—`` for a rank that measures none)."""
    head = f"{s['phase']:<12} gen {s['generation']}  LR x{s['lr_scale']:.3g}"
    if s.get("probation_until"):
        head += f"  probation until step {s['probation_until']}"
    waiting = waiting_text(s.get("waiting"))
    if waiting:
        head += "\n  " + waiting
    ranks = sorted(s.get("ranks", {}).items(), key=lambda kv: int(kv[0]))
    if not ranks:
        return head
    lines = [head, "  " + _progress(s.get("throughput") or {}, ranks)]
    silent = _silent(ranks)
    if silent:
        lines.append("  " + silent)
    slow = _slow(ranks, color)
    if slow:
        lines.append("  " + slow)
    shown = ranks
    if len(ranks) > worst:
        shown = sorted(ranks, key=lambda kv: badness(int(kv[0]), kv[1]))[:worst]
        lines.append(f"  worst {worst} of {len(ranks)} ranks (grade, H_min/max, heartbeat):")
    timed = any(_finite_number(v.get("step_time_median")) for _, v in ranks)
    for r, v in shown:
        line = _rank_line(int(r), v)
        if timed and (v.get("step") is not None or v.get("exit_code") is not None):
            line += "  " + step_time_text(v, color)
        lines.append("    " + line)
    return "\n".join(lines)


def step_time_text(v: dict[str, Any], color: bool = False) -> str:
    """A rank's step-time column: ``step time 52.3 ms x1.00``, its recent median and its ratio
    to its peers' (``x2.00 SLOW`` from :data:`~..observe.metrics.STRAGGLER_RATIO`, in bold red
    with ``color``); ``step time —`` when it measures none (or status.json holds no number)."""
    median, ratio = v.get("step_time_median"), v.get("step_ratio")
    if not _finite_number(median) or median < 0:
        return "step time —"
    text = f"step time {seconds_text(median)}"
    if _finite_number(ratio):
        text += " " + marked_ratio(ratio, color)
    return text


def marked_ratio(ratio: float, color: bool = False, *, mark: bool = True) -> str:
    """``x1.00``; at or above :data:`~..observe.metrics.STRAGGLER_RATIO` highlighted: ``x2.00
    SLOW`` (without ``mark``, ``x2.00``), in bold red with ``color``."""
    text = ratio_text(ratio)
    if not is_slow(ratio):
        return text
    if mark:
        text += " SLOW"
    return f"\033[1;31m{text}\033[0m" if color else text


SLOW_SHOWN = 3
"""How many slow ranks the ``slow`` line names (the slowest; the others are counted)."""


def _slow(ranks: list[tuple[Any, dict[str, Any]]], color: bool) -> str:
    """``slow (step time / peers' median): r17 x2.00 (105 ms)`` for the ranks whose step time
    is at least :data:`~..observe.metrics.STRAGGLER_RATIO` times their peers' (the
    :data:`SLOW_SHOWN` slowest), whatever their grades, so a straggler shows among thousands of
    ranks before any rule fires; ``""`` for none."""
    slow = sorted(
        ((-v["step_ratio"], int(r), v) for r, v in ranks if is_slow(v.get("step_ratio"))),
        key=lambda t: t[:2],
    )
    if not slow:
        return ""
    named = []
    for _, r, v in slow[:SLOW_SHOWN]:
        median = v.get("step_time_median")
        took = f" ({seconds_text(median)})" if _finite_number(median) and median >= 0 else ""
        named.append(f"r{r} {marked_ratio(v['step_ratio'], color, mark=False)}{took}")
    more = f" and {len(slow) - SLOW_SHOWN} more" if len(slow) > SLOW_SHOWN else ""
    return f"slow (step time / peers' median): {', '.join(named)}{more}"


def waiting_text(w: Any) -> str:
    """``waiting for placement of 2 workers with {'CPU': 1.0} each (PACK): 12s of 120s`` for
    what a launch waits for (``status.json``'s ``waiting``); empty when nothing (or not a
    mapping: status.json is input too)."""
    if not isinstance(w, dict):
        return ""
    waited, limit = w.get("waited_s"), w.get("timeout_s")
    took = ""
    if isinstance(waited, (int, float)) and math.isfinite(waited):
        took = f": {duration_text(waited)}"
        if isinstance(limit, (int, float)) and math.isfinite(limit):
            took += f" of {duration_text(limit)}, then the launch fails and is retried"
    return f"waiting for {w.get('for', 'resources')} of {w.get('what', '?')}{took}"


def badness(rank: int, v: dict[str, Any]) -> tuple[Any, ...]:
    """Sort key, worst rank first: a crashed rank, a non-finite loss, the lowest grade, the
    lowest normalised min-head entropy, the oldest heartbeat, then the rank number."""
    code = v.get("exit_code")
    loss = v.get("loss")
    grade = v.get("grade")
    ent = v.get("attn_entropy_min_norm")
    age = v.get("heartbeat_age_s")
    return (
        0 if isinstance(code, int) and code != 0 else 1,
        0 if loss is not None and not _finite_number(loss) else 1,
        grade if _finite_number(grade) else 8,
        ent if _finite_number(ent) else 2.0,
        -age if _finite_number(age) else 0.0,
        rank,
    )


def _progress(t: dict[str, Any], ranks: list[tuple[Any, dict[str, Any]]]) -> str:
    parts = [f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"]
    lo, hi = t.get("min_step"), t.get("max_step")
    if lo is not None:
        steps = f"step {lo}" if lo == hi else f"steps {lo}..{hi}"
        if len(ranks) > 1 and lo != hi:
            slowest = min(
                (kv for kv in ranks if isinstance(kv[1].get("step"), int)),
                key=lambda kv: (kv[1]["step"], int(kv[0])),
            )
            steps += f" (slowest r{slowest[0]})"
        parts.append(steps)
    if _finite_number(t.get("steps_per_s")):
        parts.append(f"{t['steps_per_s']:.3g} steps/s")
    if _finite_number(t.get("tokens_per_s")):
        parts.append(f"{_si(t['tokens_per_s'])} tokens/s")
    if _finite_number(t.get("eta_s")):
        parts.append(f"ETA {duration_text(t['eta_s'])} to step {t.get('last_step')}")
    return " · ".join(parts)


SILENT_S = 5.0
"""A running rank whose last message is older than this is named on its own line."""


def _silent(ranks: list[tuple[Any, dict[str, Any]]]) -> str:
    """``silent: r50 12 s, r7 6 s`` for the running ranks quiet longer than :data:`SILENT_S`
    (the three quietest), whatever their grades; ``""`` for none."""
    quiet = [
        (v["heartbeat_age_s"], int(r))
        for r, v in ranks
        if v.get("exit_code") is None
        and v.get("step") is not None
        and _finite_number(v.get("heartbeat_age_s"))
        and v["heartbeat_age_s"] >= SILENT_S
    ]
    if not quiet:
        return ""
    quiet.sort(reverse=True)
    named = ", ".join(f"r{r} {age:.0f} s" for age, r in quiet[:3])
    more = f" and {len(quiet) - 3} more" if len(quiet) > 3 else ""
    return f"silent: {named}{more}"


def _rank_line(r: int, v: dict[str, Any]) -> str:
    if v.get("step") is None and v.get("exit_code") is None:
        age = v.get("heartbeat_age_s")
        since = f" ({age:.1f} s since its launch)" if _finite_number(age) else ""
        return f"r{r:<4} no message yet{since}"
    line = (
        f"r{r:<4} step {v.get('step')}  {grade_text(v.get('grade'))}  "
        # the normalised entropy (0..1): what the policies compare, not nats
        f"H_min/max {_f(v.get('attn_entropy_min_norm'))}  loss {_f(v.get('loss'))}"
    )
    if v.get("exit_code") is not None:
        line += f"  exited {v['exit_code']}"
    elif _finite_number(v.get("heartbeat_age_s")):
        line += f"  heartbeat {v['heartbeat_age_s']:.1f} s ago"
    return line


def _finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _si(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _f(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else str(x)
