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
from collections.abc import Iterable, Sequence
from typing import Any

from ..decide import recovery as rc
from ..decide.events import TERMINAL_KINDS
from ..intake.collector import Collector, rates
from .metrics import step_ratios


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
        "excluded_nodes": [
            {"node_id": e.node_id, "cause": e.cause, "rank": e.rank, "reason": e.reason}
            for e in state.excluded
        ],
    }


def fold_journal(
    events: Sequence[dict[str, Any]], lines: Sequence[int] | None = None
) -> tuple[rc.State, str | None]:
    """The state ``events`` fold to (:func:`~..decide.recovery.fold`) and None; or, when one of
    them cannot be replayed (an unknown observation type - a newer spikeguard's, a hand edit -
    or one the machine cannot take), the state of the events before it and what is wrong with
    which line (``lines``: each event's line number, :attr:`~..journal.JournalRead.lines`).

    A journal is input: whatever it holds, this never raises. The first event that breaks the
    fold is found by bisection (a prefix that folds ends before it), so the rule of replaying
    stays the machine's, in one place."""
    state, error = _try_fold(events)
    if state is not None:
        return state, None
    good, bad = 0, len(events)  # events[:good] fold, events[:bad] do not (error: why not)
    while bad - good > 1:
        mid = (good + bad) // 2
        folded, failed = _try_fold(events[:mid])
        if folded is None:
            bad, error = mid, failed
        else:
            good, state = mid, folded
    ev = events[bad - 1]
    where = f"line {lines[bad - 1]}" if lines is not None else f"event {bad}"
    seq = f" (seq {ev.get('seq')!r})" if "seq" in ev else ""
    problem = f"{where}{seq} cannot be replayed ({type(error).__name__}: {error})"[:500]
    return state if state is not None else rc.State(), problem


def _try_fold(events: Sequence[dict[str, Any]]) -> tuple[rc.State | None, Exception | None]:
    try:
        return rc.fold(events), None
    except Exception as e:  # a journal is input: any failure of the fold is a line to name
        return None, e


def journal_view(
    events: Iterable[dict[str, Any]], lines: Sequence[int] | None = None
) -> dict[str, Any]:
    """:func:`run_view` of the state the journal folds to, plus its size and its last event;
    ``replay_problem`` when a line cannot be replayed (:func:`fold_journal`: the state is then
    the one before it)."""
    evs = list(events)
    state, problem = fold_journal(evs, lines)
    view = run_view(state)
    if state.hold is not None:
        view["hold"] = state.hold
    if state.incident is not None and state.incident.acknowledged_by is not None:
        view["acknowledged_by"] = state.incident.acknowledged_by
    if problem is not None:
        view["replay_problem"] = problem
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
    state, problem = fold_journal(events)
    if problem is not None:
        return None
    if state.phase not in rc.TERMINAL:
        return None
    last: dict[str, Any] = next(
        (
            e
            for e in reversed(events)
            if isinstance(e.get("kind"), str) and e["kind"] in TERMINAL_KINDS
        ),
        {},
    )
    return (
        f"{state.phase.value.lower()} (exit code {state.exit_code}) at "
        f"{last.get('time', '?')}: {last.get('reason', '')}"
    )


def _finite(x: Any) -> Any:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def live_status(
    state: rc.State, collector: Collector, *, waiting: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What ``status.json`` holds: :func:`run_view`, the current generation's ranks (each with
    its heartbeat age and steps/s, and its step time: the latest ``step_time``, the median of
    its recent ones, ``step_time_median``, and that median's ratio to the median of its peers',
    ``step_ratio``, :func:`~.metrics.step_ratios`; None where the rank measured none) and the
    run's ``throughput`` (:func:`throughput`), all measured at the collector's latest time;
    ``waiting``: what a launch waits for now (its placement: ``for``, ``what``, ``waited_s``,
    ``timeout_s``), None when nothing."""
    view = run_view(state)
    view["waiting"] = dict(waiting) if waiting else None
    view["dropped"] = dict(collector.dropped)
    view["rank_dropped"] = collector.rank_dropped
    now = collector.now
    ranks: dict[int, dict[str, Any]] = {}
    ratios = step_ratios(collector)
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
            "step_time": _finite(v.step_time),
            "step_time_median": _finite(v.step_time_median()),
            "step_ratio": ratios.get(r),
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


def seconds_text(x: float) -> str:
    """A step time as the views write it: ``52.3 ms`` below a second, ``2.5 s`` from one."""
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def ratio_text(x: float) -> str:
    """A ratio to the peers' median as the views write it: ``x2.00`` (``x1.5e+04`` from a
    thousand)."""
    return f"x{x:.2f}" if abs(x) < 1000 else f"x{x:.3g}"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
