"""What a pager follows: the incidents and notify-rule alerts of a run, folded from its journal.

Pure bookkeeping, no I/O: :class:`Follow` takes each journaled event (:meth:`Follow.apply`) and
says what it changed for the pager (a :class:`Change`); the Alertmanager and PagerDuty sinks turn
changes into requests. Where an incident stands comes from the one lifecycle
(:func:`~spikeguard.supervisor.decide.lifecycle.leads_to` / ``outcome_of``), read event by event:

* RESOLVED, SUPERSEDED or STOPPED: the incident is **over** (its page is cleared);
* ESCALATED or FAILED, or an ``operator`` ``recovery_held`` event: a **human is needed** (the page
  stays, even after the run ends) until the incident ends otherwise (a resumed run whose
  probation passes) or opens again;
* an ``operator`` ``acknowledged`` event: someone has it (PagerDuty's ``acknowledge``; the
  repeats stop). One that names no incident acknowledges every open one.

A run that fails with no incident open (a crash no rule recovers) needs a human too: it is
followed as the run-level incident :data:`RUN_LEVEL`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from ...decide.events import Code, Kind
from ...decide.lifecycle import IncidentState, Outcome, leads_to, outcome_of

OVER = frozenset({Outcome.RESOLVED, Outcome.SUPERSEDED, Outcome.STOPPED})
"""Outcomes that end an incident's page: recovered by itself, superseded, stopped."""
NEEDS_HUMAN = frozenset({Outcome.ESCALATED, Outcome.FAILED})
"""Outcomes after which a human is needed: the page stays."""
RUN_LEVEL = "run"
"""The id a run-level page (a run that failed with no incident open) is followed under."""

What = Literal["opened", "step", "needs_human", "acknowledged", "over"]


@dataclasses.dataclass
class Followed:
    """One incident (or notify-rule alert) a pager follows."""

    id: str
    """The incident's id (``inc-001``), :data:`RUN_LEVEL`, or an alert's :func:`alert_id`."""
    opened: dict[str, Any]
    """The event that opened it (labels, severity, rule, rank, layer, its start time)."""
    last: dict[str, Any]
    """Its latest event (what it is doing now)."""
    routed: bool
    """Its opening event is routed to this sink (:func:`~..registry.wants`)."""
    state: IncidentState = IncidentState.RECOVERING
    """Where the incident stands (an alert: RECOVERING while it fires)."""
    outcome: Outcome | None = None
    """How its latest ending ended it; None while open."""
    needs_human: bool = False
    """Escalated, failed, or its recovery held for a human (and not over since)."""
    acknowledged: dict[str, Any] | None = None
    """The ``operator`` event that acknowledged it."""
    alert: bool = False
    """A notify-rule alert (no recovery behind it), not an incident."""
    live: bool = True
    """An alert this supervisor's engine fired (it will say when it resolves); False for one
    restored from a dead supervisor's journal."""

    @property
    def over(self) -> bool:
        """Its page is to be cleared."""
        return self.outcome in OVER


@dataclasses.dataclass(frozen=True)
class Change:
    """What an event did to one followed incident."""

    what: What
    followed: Followed
    event: Mapping[str, Any]


def alert_id(event: Mapping[str, Any]) -> str:
    """The identity of a notify-rule alert: its rule (or code) and rank, the policy engine's
    firing group, so a reminder and the resolution name the alert the firing opened."""
    name = event.get("rule") or event.get("code") or "alert"
    rank = event.get("rank")
    return f"alert/{name}" + ("" if rank is None else f"/rank-{rank}")


def is_rule_alert(event: Mapping[str, Any]) -> bool:
    """An ``alert`` a rule fired or resolved (not a supervisor's note)."""
    return event.get("kind") == Kind.ALERT.value and event.get("code") in (
        Code.RULE_NOTIFY.value,
        Code.RULE_RESOLVED.value,
    )


class Follow:
    """The incidents and notify-rule alerts of a run, as a pager follows them."""

    def __init__(self, routed: Any) -> None:
        """``routed(event) -> bool``: whether an opening event goes to this sink."""
        self._routed = routed
        self.followed: dict[str, Followed] = {}
        """By id, in the order they opened."""

    def open_ones(self) -> list[Followed]:
        """Those whose page is up (not over)."""
        return [f for f in self.followed.values() if f.outcome not in OVER]

    def apply(self, event: Mapping[str, Any]) -> list[Change]:
        """Fold ``event`` in; what it changed (empty for an event of nothing followed)."""
        ev = dict(event)
        kind, inc = ev.get("kind"), ev.get("incident")
        if is_rule_alert(ev) and not isinstance(inc, str):
            return self._alert(ev)
        if kind == Kind.OPERATOR.value:
            return self._operator(ev)
        if not isinstance(inc, str):
            if kind == Kind.FAILED.value:  # a crash no rule recovers: the run needs a human
                return self._run_level(ev)
            return []
        f = self.followed.get(inc)
        if kind == Kind.INCIDENT.value and (f is None or f.outcome is not None):
            f = self.followed[inc] = Followed(inc, ev, ev, routed=bool(self._routed(ev)))
            return [Change("opened", f, ev)]
        if f is None:
            return []
        f.last = ev
        state, outcome = leads_to(kind), outcome_of(kind)
        if state is not None:
            f.state = state
        if outcome is None:
            return [Change("step", f, ev)]
        f.outcome = outcome
        if outcome in OVER:
            f.needs_human = False
            return [Change("over", f, ev)]
        f.needs_human = True
        return [Change("needs_human", f, ev)]

    def _alert(self, ev: dict[str, Any]) -> list[Change]:
        key = alert_id(ev)
        f = self.followed.get(key)
        if ev.get("resolved"):
            if f is None or f.over:
                return []
            f.last, f.outcome, f.state = ev, Outcome.RESOLVED, IncidentState.RESOLVED
            return [Change("over", f, ev)]
        if f is None or f.over:
            f = self.followed[key] = Followed(
                key, ev, ev, routed=bool(self._routed(ev)), alert=True
            )
            return [Change("opened", f, ev)]
        f.last, f.live = ev, True
        return [Change("step", f, ev)]

    def _operator(self, ev: dict[str, Any]) -> list[Change]:
        inc, code = ev.get("incident"), ev.get("code")
        if isinstance(inc, str):
            targets = [self.followed[inc]] if inc in self.followed else []
        else:
            targets = [f for f in self.open_ones() if not f.alert]
        out: list[Change] = []
        for f in targets:
            if f.over:
                continue
            f.last = ev
            if code == Code.ACKNOWLEDGED.value:
                if f.acknowledged is None:
                    f.acknowledged = ev
                    out.append(Change("acknowledged", f, ev))
            elif code == Code.RECOVERY_HELD.value:
                f.needs_human = True
                out.append(Change("needs_human", f, ev))
            elif code == Code.OPERATOR_RESUMED.value:
                f.needs_human, f.outcome = False, None  # a human took it: it goes on
                out.append(Change("step", f, ev))
            else:
                out.append(Change("step", f, ev))
        if not out and code == Code.RECOVERY_HELD.value and not isinstance(inc, str):
            return self._run_level(ev)
        return out

    def _run_level(self, ev: dict[str, Any]) -> list[Change]:
        f = self.followed.get(RUN_LEVEL)
        if f is None or f.over:
            f = self.followed[RUN_LEVEL] = Followed(RUN_LEVEL, ev, ev, routed=False)
        f.last, f.needs_human = ev, True
        if ev.get("kind") == Kind.FAILED.value:
            f.outcome, f.state = Outcome.FAILED, IncidentState.ESCALATED
        return [Change("needs_human", f, ev)]
