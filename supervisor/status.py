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

from . import recovery as rc
from .collector import Collector
from .events import TERMINAL_KINDS


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
    last = next((e for e in reversed(events) if e.get("kind") in TERMINAL_KINDS), {})
    return (
        f"{state.phase.value.lower()} (exit code {state.exit_code}) at "
        f"{last.get('time', '?')}: {last.get('reason', '')}"
    )


def _finite(x: Any) -> Any:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def live_status(state: rc.State, collector: Collector) -> dict[str, Any]:
    """What ``status.json`` holds: :func:`run_view` and the current generation's ranks."""
    view = run_view(state)
    view["dropped"] = dict(collector.dropped)
    view["rank_dropped"] = collector.rank_dropped
    view["ranks"] = {
        r: {
            "step": v.step,
            "loss": _finite(v.loss),
            "grade": v.summary.get("grade"),
            "attn_entropy_min": _finite(v.summary.get("attn_entropy_min")),
            "attn_entropy_min_norm": _finite(v.summary.get("attn_entropy_min_norm")),
            "exit_code": v.exit_code,
        }
        for r, v in collector.ranks.items()
    }
    view["updated"] = time.time()  # wall clock: for humans only, never for a timeout
    return view
