"""What ``status`` shows: the run as the recovery machine's state says, the ranks as the
supervisor last saw them.

One function, :func:`run_view`, turns a machine state into the run-level fields. The live
supervisor applies it to its own state and writes ``status.json`` (with the ranks' latest
views); ``spikeguard status`` applies it to the state folded from the journal, so it tells the
truth also about a run whose supervisor is dead (``status.json`` then only adds how the ranks
looked last).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from ..decide import recovery as rc
from ..decide.events import TERMINAL_KINDS
from ..intake.collector import Collector, rates


def run_view(state: rc.State) -> dict[str, Any]:
    """The run-level fields of a machine state."""
    inc = state.incident
    return {
        "phase": state.phase.value,
        "generation": state.generation,
        "lr_scale": state.lr_scale,
        "incident": inc.id if inc else None,
        "attempt": inc.attempts if inc else None,
        "probation_from": state.probation_from,
        "probation_until": state.probation_until,
        "exit_code": state.exit_code,
        "launch_failures": state.launch_failures,
        "incidents": state.incidents_seen,
    }


def journal_view(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """:func:`run_view` of the state the journal folds to, plus its size and its last event."""
    evs = list(events)
    view = run_view(rc.fold(evs))
    last = evs[-1] if evs else None
    view["events"] = len(evs)
    view["last_event"] = (
        None
        if last is None
        else {k: last.get(k) for k in ("seq", "kind", "time", "reason", "incident")}
    )
    return view


def finished(events: list[dict[str, Any]]) -> str | None:
    """How the run ended, when its journal folds to a terminal phase (``completed (exit code 0)
    at TIME: REASON``); None for a run that has not ended (or a journal that does not fold)."""
    try:
        state = rc.fold(events)
    except (ValueError, TypeError, KeyError):
        return None
    if state.phase not in rc.TERMINAL:
        return None
    last: dict[str, Any] = next(
        (e for e in reversed(events) if e.get("kind") in TERMINAL_KINDS), {}
    )
    return (
        f"{state.phase.value.lower()} (exit code {state.exit_code}) at "
        f"{last.get('time', '?')}: {last.get('reason', '')}"
    )


def _finite(x: Any) -> Any:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def live_status(state: rc.State, collector: Collector) -> dict[str, Any]:
    """What ``status.json`` holds: :func:`run_view`, the current generation's ranks (each with
    its heartbeat age and steps/s) and the run's ``throughput`` (:func:`throughput`), all
    measured at the collector's latest time."""
    view = run_view(state)
    view["dropped"] = dict(collector.dropped)
    view["rank_dropped"] = collector.rank_dropped
    now = collector.now
    ranks: dict[int, dict[str, Any]] = {}
    for r, v in collector.ranks.items():
        steps_s, tokens_s = rates(v, now) if now is not None else (None, None)
        ranks[r] = {
            "step": v.step,
            "loss": _finite(v.loss),
            "grade": v.summary.get("grade"),
            "attn_entropy_min": _finite(v.summary.get("attn_entropy_min")),
            "attn_entropy_min_norm": _finite(v.summary.get("attn_entropy_min_norm")),
            "exit_code": v.exit_code,
            "heartbeat_age_s": (None if now is None else round(collector.heartbeat_age(v, now), 3)),
            "steps_per_s": steps_s,
            "tokens_per_s": tokens_s,
            "total_steps": v.total_steps,
        }
    view["ranks"] = ranks
    view["throughput"] = throughput(ranks.values())
    view["updated"] = time.time()  # wall clock: for humans only, never for a timeout
    return view


def throughput(ranks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run's progress from its ranks' status entries: the slowest rank's step and steps/s
    (data-parallel ranks move together, the slowest sets the pace), the tokens/s of all ranks
    that report tokens, and the ETA when a rank said how many steps it trains."""
    entries = [r for r in ranks if isinstance(r.get("step"), int)]
    if not entries:
        return {"min_step": None, "max_step": None, "steps_per_s": None, "tokens_per_s": None}
    slowest = min(entries, key=lambda r: r["step"])
    paces = [r["steps_per_s"] for r in entries if _number(r.get("steps_per_s"))]
    tokens = [r["tokens_per_s"] for r in entries if _number(r.get("tokens_per_s"))]
    totals = [r["total_steps"] for r in entries if isinstance(r.get("total_steps"), int)]
    out: dict[str, Any] = {
        "min_step": slowest["step"],
        "max_step": max(r["step"] for r in entries),
        "steps_per_s": min(paces) if paces else None,
        "tokens_per_s": sum(tokens) if tokens else None,
    }
    if totals:
        last = max(totals) - 1
        out["last_step"] = last
        pace = out["steps_per_s"]
        if pace:
            out["eta_s"] = max(0.0, (last - slowest["step"]) / pace)
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
