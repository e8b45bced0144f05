"""An incident's life, told once: where each kind of journal event leaves the incident it names.

Every reader that follows incidents (the Slack thread's state, the metrics' ``outcome`` label,
``status``, the report) folds the journal through :data:`LIFECYCLE`, so they cannot disagree
about what ended an incident and how. The recovery machine writes the events
(:mod:`.recovery`); this table is how they read.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

from .events import Kind


class IncidentState(str, enum.Enum):
    """Where an incident stands, as its Slack thread and ``status`` show it."""

    RECOVERING = "RECOVERING"
    PROBATION = "PROBATION"
    RESOLVED = "RESOLVED"
    ESCALATED = "ESCALATED"


class Outcome(str, enum.Enum):
    """How an incident ended (the ``outcome`` label of the recoveries metric)."""

    RESOLVED = "resolved"
    """Its probation passed: spikeguard recovered the run by itself."""
    ESCALATED = "escalated"
    """Automatic recovery gave up: a human is needed."""
    FAILED = "failed"
    """The job failed during it (a crash no rule recovers, launches that kept failing)."""
    STOPPED = "stopped"
    """The run was stopped during it (``spikeguard stop``, Ctrl-C, a policy ``stop`` rule)."""
    SUPERSEDED = "superseded"
    """A fault of the other kind came in its probation and opened its own incident (a
    divergence after a crash's relaunch): this one's recovery worked, the new one carries on."""


@dataclasses.dataclass(frozen=True)
class Step:
    """What an event of one kind does to the incident it names."""

    state: IncidentState | None
    """The state it leads to; None: it leaves the state as it is."""
    outcome: Outcome | None = None
    """Set when it ends the incident."""


LIFECYCLE: dict[Kind, Step] = {
    Kind.INCIDENT: Step(IncidentState.RECOVERING),
    Kind.PROBATION_FAILED: Step(IncidentState.RECOVERING),
    Kind.PROBATION_START: Step(IncidentState.PROBATION),
    Kind.PROBATION_PASSED: Step(IncidentState.RESOLVED, Outcome.RESOLVED),
    # its relaunch trained on until another kind of fault, which is an incident of its own
    Kind.PROBATION_SUPERSEDED: Step(IncidentState.RESOLVED, Outcome.SUPERSEDED),
    Kind.ESCALATED: Step(IncidentState.ESCALATED, Outcome.ESCALATED),
    Kind.FAILED: Step(IncidentState.ESCALATED, Outcome.FAILED),
    # a stop ends the incident; its thread keeps its state, and says the run was stopped
    Kind.STOPPED: Step(None, Outcome.STOPPED),
}
"""Kinds that move an incident (every other kind leaves it as it is)."""
BY_CODE: dict[str, Step] = {
    # a recover decision while a human holds the run: the ranks are killed and a human has it
    "recovery_held": Step(IncidentState.ESCALATED),
    # a human resumed a held or escalated incident: it is being recovered again (below, fold
    # also forgets its escalated outcome: how it ends now is what counts)
    "operator_resumed": Step(IncidentState.RECOVERING),
}
"""``operator`` events that move an incident, by code (the kind alone does not say)."""
REOPENS = frozenset({"operator_resumed"})
"""Codes after which an incident that had ended is open again."""
INCIDENT_STATE: dict[Kind, IncidentState] = {
    kind: step.state for kind, step in LIFECYCLE.items() if step.state is not None
}
"""The incident state an event of this kind leads to (other kinds leave it as it is)."""
CONCLUDED = frozenset({IncidentState.RESOLVED, IncidentState.ESCALATED})
"""The states that end an incident (its thread's conclusion is broadcast)."""


def _step(kind: Any, code: Any = None) -> Step | None:
    if kind == Kind.OPERATOR:
        return BY_CODE.get(str(code))
    try:
        return LIFECYCLE.get(Kind(kind))
    except ValueError:
        return None


def leads_to(kind: Any, code: Any = None) -> IncidentState | None:
    """The incident state an event of ``kind`` (and ``code``, for an ``operator`` event) leads
    to; None when it leaves the state as it is, or is no kind at all."""
    step = _step(kind, code)
    return None if step is None else step.state


def outcome_of(kind: Any) -> Outcome | None:
    """How an event of ``kind`` ends the incident it names; None when it does not end it."""
    step = _step(kind)
    return None if step is None else step.outcome


def concludes(kind: Any) -> bool:
    """True when an event of this kind brings an incident to RESOLVED or ESCALATED."""
    return leads_to(kind) in CONCLUDED


@dataclasses.dataclass
class IncidentLife:
    """One incident, folded from its events."""

    id: str
    state: IncidentState = IncidentState.RECOVERING
    outcome: Outcome | None = None


def fold(events: Iterable[Mapping[str, Any]]) -> dict[str, IncidentLife]:
    """Every incident of a journal, by id, in the order they opened. An incident that opens
    again (a new ``incident`` event after it ended) starts over; its first ending counts."""
    lives: dict[str, IncidentLife] = {}
    for ev in events:
        inc, kind = ev.get("incident"), ev.get("kind")
        if not isinstance(inc, str):
            continue
        life = lives.get(inc)
        if kind == Kind.INCIDENT and (life is None or life.outcome is not None):
            life = lives[inc] = IncidentLife(inc)
        if life is None:
            continue
        step = _step(kind, ev.get("code"))
        if step is None:
            continue
        if kind == Kind.OPERATOR and ev.get("code") in REOPENS:
            life.outcome = None
        if step.state is not None:
            life.state = step.state
        if step.outcome is not None and life.outcome is None:
            life.outcome = step.outcome
    return lives
