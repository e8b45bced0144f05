"""The recovery state machine: states are data, ``step()`` returns the next one.

No Ray, no I/O, no clocks. The controller feeds it one observation at a
time and carries out the effects it asks for; every transition also returns
the journal events that explain it (with a reason), so the journal is the
complete story of a run.

The recovery sequence, numbered as the code below is::

    1. RUNNING      a ``recover`` decision arrives   -> incident; KILLING
    2. KILLING      all ranks are dead               -> kill; ROLLING_BACK
    3. ROLLING_BACK a checkpoint was chosen          -> rollback, lr_cut,
                                                        optimizer_reset; RELAUNCHING
                    none is healthy                  -> escalated; ESCALATED
    4. RELAUNCHING  the new generation is up         -> launch, probation_start; PROBATION
    5. PROBATION    training passed the window       -> probation_passed; RUNNING
                    another ``recover`` decision     -> probation_failed; back to 1
                                                        (KILLING) while the attempt
                                                        budget lasts, else ESCALATED
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, Union

from spikeguard.workers.contract import ResumePlan


class Phase(str, enum.Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    KILLING = "KILLING"
    ROLLING_BACK = "ROLLING_BACK"
    RELAUNCHING = "RELAUNCHING"
    PROBATION = "PROBATION"
    HOLDING = "HOLDING"
    ESCALATED = "ESCALATED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


TERMINAL = frozenset({Phase.ESCALATED, Phase.COMPLETED, Phase.FAILED, Phase.STOPPED})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """The recovery settings the machine needs (a rule's effective settings)."""

    min_grade: int = 4
    """Roll back only to checkpoints graded at least this (S4)."""
    min_steps_back: int = 0
    """The checkpoint must be at least this many steps before the incident."""
    lr_factors: tuple[float, ...] = (0.5,)
    """LR factor per attempt (the last one repeats); the scale compounds."""
    reset_optimizer: bool = True
    """Start the optimizer fresh after a rollback."""
    skip_window: int = 0
    """Skip the batches of this many steps up to the incident (0: none)."""
    probation_steps: int = 1000
    """Steps after the resume that must pass without another recover decision."""
    max_attempts: int = 3
    """Recoveries allowed for one incident before it escalates."""
    on_exhausted: Literal["stop", "hold"] = "stop"
    """When the budget is spent: stop the job and page, or hold it (ranks killed, waiting for a human)."""

    @classmethod
    def from_policy(cls, rs: Any) -> "Settings":
        """Build from a :class:`spikeguard.policies.RecoverySettings` (or anything with the same fields)."""
        names = [f.name for f in dataclasses.fields(cls)]
        kw = {n: getattr(rs, n) for n in names if hasattr(rs, n)}
        if "lr_factors" in kw:
            kw["lr_factors"] = tuple(kw["lr_factors"])
        return cls(**kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Incident:
    id: str
    rule: str
    reason: str
    step: int
    settings: Settings
    attempts: int = 0
    """Recoveries already started for this incident."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class State:
    phase: Phase = Phase.STARTING
    generation: int = 0
    lr_scale: float = 1.0
    incident: Incident | None = None
    incidents_seen: int = 0
    probation_from: int | None = None
    probation_until: int | None = None
    plan: ResumePlan | None = None
    exit_code: int | None = None


# ---- observations (inputs) ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Launched:
    generation: int


@dataclasses.dataclass(frozen=True)
class Recover:
    rule: str
    reason: str
    step: int
    settings: Settings
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Killed:
    ranks: tuple[int, ...]
    duration_s: float


@dataclasses.dataclass(frozen=True)
class CheckpointChosen:
    """The controller's answer to :class:`SelectCheckpoint` (``path`` None: nothing healthy)."""

    path: str | None
    step: int | None = None
    sha256: str | None = None
    grade: int | None = None
    skipped: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Progress:
    step: int
    """The slowest rank's latest step in the current generation."""


@dataclasses.dataclass(frozen=True)
class Finished:
    final_loss: float | None


@dataclasses.dataclass(frozen=True)
class Failed:
    reason: str
    exit_code: int


@dataclasses.dataclass(frozen=True)
class StopRequested:
    reason: str


Observation = Union[Launched, Recover, Killed, CheckpointChosen, Progress, Finished, Failed, StopRequested]


# ---- effects (outputs) ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kill:
    reason: str


@dataclasses.dataclass(frozen=True)
class SelectCheckpoint:
    min_grade: int
    before_step: int
    min_steps_back: int


@dataclasses.dataclass(frozen=True)
class Launch:
    plan: ResumePlan


@dataclasses.dataclass(frozen=True)
class Shutdown:
    exit_code: int


Effect = Union[Kill, SelectCheckpoint, Launch, Shutdown]
Event = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Transition:
    state: State
    effects: tuple[Effect, ...] = ()
    events: tuple[Event, ...] = ()


def lr_factor(settings: Settings, attempt: int) -> float:
    """The factor for the ``attempt``-th recovery (0-based); the last factor repeats."""
    f = settings.lr_factors
    return f[min(attempt, len(f) - 1)]


def _ev(kind: str, reason: str, incident: Incident | None, **fields: Any) -> Event:
    return {"kind": kind, "reason": reason, "incident": incident.id if incident else None, **fields}


def step(state: State, obs: Observation) -> Transition:
    """Return the next state, the effects to carry out and the events to journal."""
    p = state.phase
    if p in TERMINAL:
        return Transition(state)
    if isinstance(obs, StopRequested):
        return Transition(dataclasses.replace(state, phase=Phase.STOPPED, exit_code=5),
                          (Kill(obs.reason), Shutdown(5)), (_ev("stopped", obs.reason, state.incident),))
    if isinstance(obs, Failed) and p is not Phase.KILLING:
        return Transition(dataclasses.replace(state, phase=Phase.FAILED, exit_code=obs.exit_code),
                          (Kill(obs.reason), Shutdown(obs.exit_code)),
                          (_ev("failed", obs.reason, state.incident, exit_code=obs.exit_code),))
    if p is Phase.STARTING and isinstance(obs, Launched):
        return Transition(dataclasses.replace(state, phase=Phase.RUNNING, generation=obs.generation),
                          events=(_ev("launch", "initial launch", None, generation=obs.generation,
                                      lr_scale=state.lr_scale),))
    if p in (Phase.RUNNING, Phase.PROBATION) and isinstance(obs, Recover):
        return _on_recover(state, obs)
    if p is Phase.PROBATION and isinstance(obs, Progress) and obs.step >= (state.probation_until or 0):
        return _probation_passed(state, obs.step, "no second incident in the probation window")
    if p in (Phase.RUNNING, Phase.PROBATION) and isinstance(obs, Finished):
        events: tuple[Event, ...] = ()
        if p is Phase.PROBATION:
            events = _probation_passed(state, None, "training finished inside the probation window "
                                       "without a second incident").events
        return Transition(dataclasses.replace(state, phase=Phase.COMPLETED, incident=None, exit_code=0),
                          (Shutdown(0),), events + (_ev("completed", "all ranks finished", None,
                                                        final_loss=obs.final_loss),))
    if p is Phase.KILLING and isinstance(obs, Killed):
        inc = state.incident
        assert inc is not None
        s = inc.settings
        return Transition(dataclasses.replace(state, phase=Phase.ROLLING_BACK),
                          (SelectCheckpoint(s.min_grade, inc.step, s.min_steps_back),),
                          (_ev("kill", f"killed {len(obs.ranks)} ranks of generation {state.generation}", inc,
                               ranks=list(obs.ranks), duration_s=round(obs.duration_s, 3)),))
    if p is Phase.ROLLING_BACK and isinstance(obs, CheckpointChosen):
        return _on_checkpoint(state, obs)
    if p is Phase.RELAUNCHING and isinstance(obs, Launched):
        assert state.plan is not None and state.incident is not None
        start = (state.plan.checkpoint_step or -1) + 1
        until = start + state.incident.settings.probation_steps
        st = dataclasses.replace(state, phase=Phase.PROBATION, generation=obs.generation,
                                 probation_from=start, probation_until=until)
        return Transition(st, events=(
            _ev("launch", f"relaunched from step {start}", state.incident, generation=obs.generation,
                lr_scale=state.lr_scale),
            _ev("probation_start", f"{until - start} steps must pass without another incident",
                state.incident, from_step=start, until_step=until)))
    return Transition(state)  # the observation does not apply in this phase


def _on_recover(state: State, obs: Recover) -> Transition:
    inc = state.incident
    events: list[Event] = []
    if state.phase is Phase.PROBATION and inc is not None:
        events.append(_ev("probation_failed", f"{obs.rule}: {obs.reason}", inc, step=obs.step, rule=obs.rule))
        if inc.attempts >= inc.settings.max_attempts:
            return _exhausted(state, inc, events)
        inc = dataclasses.replace(inc, rule=obs.rule, reason=obs.reason, step=obs.step)
    else:
        n = state.incidents_seen + 1
        inc = Incident(id=f"inc-{n:03d}", rule=obs.rule, reason=obs.reason, step=obs.step,
                       settings=obs.settings)
        state = dataclasses.replace(state, incidents_seen=n)
        if inc.settings.max_attempts < 1:
            events.append(_ev("incident", obs.reason, inc, rule=obs.rule, step=obs.step, **obs.details))
            return _exhausted(state, inc, events)
    events.append(_ev("incident", obs.reason, inc, rule=obs.rule, step=obs.step, attempt=inc.attempts + 1,
                      **obs.details))
    st = dataclasses.replace(state, phase=Phase.KILLING, incident=inc)
    return Transition(st, (Kill(f"incident {inc.id}: {obs.rule}"),), tuple(events))


def _exhausted(state: State, inc: Incident, events: list[Event]) -> Transition:
    budget = inc.settings.max_attempts
    if inc.settings.on_exhausted == "hold":
        events.append(_ev("escalated", f"recovery budget of {budget} attempts spent; holding for a human",
                          inc, hold=True))
        return Transition(dataclasses.replace(state, phase=Phase.HOLDING, incident=inc),
                          (Kill("budget exhausted; holding"),), tuple(events))
    events.append(_ev("escalated", f"recovery budget of {budget} attempts spent", inc, hold=False))
    return Transition(dataclasses.replace(state, phase=Phase.ESCALATED, incident=inc, exit_code=3),
                      (Kill("budget exhausted"), Shutdown(3)), tuple(events))


def _on_checkpoint(state: State, obs: CheckpointChosen) -> Transition:
    inc = state.incident
    assert inc is not None
    s = inc.settings
    skipped = [{"path": p, "reason": r} for p, r in obs.skipped]
    if obs.path is None:
        why = (f"no checkpoint graded >= S{s.min_grade} at least {s.min_steps_back} steps before "
               f"step {inc.step} verifies")
        events = (_ev("rollback", why, inc, checkpoint_step=None, checkpoint_path=None, skipped=skipped),
                  _ev("escalated", why, inc, hold=False))
        return Transition(dataclasses.replace(state, phase=Phase.ESCALATED, exit_code=3),
                          (Shutdown(3),), events)
    factor = lr_factor(s, inc.attempts)
    scale = state.lr_scale * factor
    skip: tuple[tuple[int, int], ...] = ()
    if s.skip_window > 0:
        skip = ((max(inc.step - s.skip_window + 1, (obs.step or 0) + 1), inc.step),)
    plan = ResumePlan(checkpoint=obs.path, checkpoint_step=obs.step, sha256=obs.sha256, lr_scale=scale,
                      reset_optimizer=s.reset_optimizer, skip_ranges=skip, generation=state.generation + 1)
    inc = dataclasses.replace(inc, attempts=inc.attempts + 1)
    events: list[Event] = [
        _ev("rollback", f"newest checkpoint graded S{obs.grade} >= S{s.min_grade} before step {inc.step}",
            inc, checkpoint_step=obs.step, checkpoint_path=obs.path, grade=obs.grade, skipped=skipped,
            skip_ranges=[list(r) for r in skip]),
        _ev("lr_cut", f"LR x{factor:g} on attempt {inc.attempts} (scale now {scale:.4g})", inc,
            factor=factor, lr_scale=scale),
    ]
    if s.reset_optimizer:
        events.append(_ev("optimizer_reset", "optimizer moments may carry the instability", inc))
    st = dataclasses.replace(state, phase=Phase.RELAUNCHING, incident=inc, lr_scale=scale, plan=plan)
    return Transition(st, (Launch(plan),), tuple(events))


def _probation_passed(state: State, at_step: int | None, why: str) -> Transition:
    inc = state.incident
    ev = _ev("probation_passed", why, inc, step=at_step, lr_scale=state.lr_scale)
    st = dataclasses.replace(state, phase=Phase.RUNNING, incident=None, probation_from=None,
                             probation_until=None)
    return Transition(st, events=(ev,))
