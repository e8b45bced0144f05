"""The recovery state machine: a table ``{(phase, observation type): handler}``.

No Ray, no I/O, no clocks. The controller feeds it one observation at a time and carries out the
effects it asks for; every transition also returns the journal events that explain it, each with
a reason code (:class:`~spikeguard.supervisor.decide.events.Code`) beside the prose. Handlers
return typed events (:class:`~spikeguard.supervisor.decide.events.MachineEvent`) and never word
them: :mod:`spikeguard.supervisor.decide.wording` holds every text, and :func:`step` turns the
events into the journal's dicts. The
first event of a transition that changed the state also records the observations that caused
it, so rebuilding the state after a restart is replaying :func:`step` over the journal
(:func:`fold`): there is no second implementation of the rules.

The recovery sequence; the handlers below carry these numbers::

    1. RUNNING       a recover decision                -> incident; KILLING
    2. KILLING       every rank is dead                 -> kill; ROLLING_BACK
    3. ROLLING_BACK  a checkpoint was chosen            -> rollback, lr_cut, optimizer_reset
                        (healthy: min_grade, else the      (with an LR re-warm-up);
                        run's own baseline)                RELAUNCHING
                     none qualifies                     -> rollback, escalated; ESCALATED
    4. RELAUNCHING   the new generation is up           -> launch, probation_start; PROBATION
    5. PROBATION     training passed the window         -> probation_passed (an LR cut given
                                                           back, lr_restore_steps); RUNNING
                     a fault of the other kind          -> probation_superseded, incident (its
                                                           own, with its rule's settings); 2
                     another recover decision           -> probation_failed, incident; back to 2
                                                           (KILLING) while the attempt budget
                                                           lasts, else escalated; the same rule
                                                           at the same step measuring the same
                                                           again: escalated at once (a
                                                           deterministic fault)

Around it:

* **start**: generation 1 is launched (STARTING -> RELAUNCHING -> RUNNING).
* **launch failure**: the launch could not be made, or a rank died before its first message ->
  ``launch_failed``, relaunched as a new generation (fresh port, backoff) outside the incident
  budget, at most ``launch_retries`` times in a row; then ``failed``.
* **crash without a rule**: a rank exited non-zero and no rule recovered it -> ``failed``.
* **finish**: every rank exited 0 -> (``probation_passed``,) ``completed``.
* **stop**: a stop request -> ``stopped``.
* **notify**: a notify rule fired or resolved -> ``alert`` (no state change).
* **restart**: a restarted supervisor (:class:`Restarted`) finishes whatever step the journal shows
  unfinished, or resumes a running generation from the newest healthy checkpoint (``resume``);
  what it does in each phase is the table :data:`RESTART`.
* **escalation**: more than ``max_incidents`` incidents in a run, a spent attempt budget, a
  recurring fault, nothing to roll back to, or a restart whose checkpoint is gone escalate
  (``_escalate``, the one way to give up): the job stops (exit 3), or with ``on_exhausted: hold``
  it holds (ranks killed, waiting for a human).

Every launch's :class:`ResumePlan` is built by ``_plan``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from spikeguard.workers.contract.exitcodes import ExitCode

from .. import wording
from ..events import Code, Kind, MachineEvent
from . import codec
from .model import (
    ACTIVE,
    TERMINAL,
    CheckpointChosen,
    CheckpointSaved,
    CheckpointWanted,
    Effect,
    Exclusion,
    Finished,
    GraceExpired,
    Incident,
    Kill,
    Killed,
    Launch,
    Launched,
    LaunchFailed,
    NodeSuspect,
    Notify,
    Observation,
    Phase,
    Preempt,
    Progress,
    RankExited,
    Recover,
    RelaunchCause,
    RequestCheckpoint,
    Restarted,
    ResumePlan,
    SelectCheckpoint,
    Settings,
    Shutdown,
    Start,
    State,
    StopRequested,
    Transition,
    lr_factor,
    next_generation,
    start_step,
    state_digest,
)

_replace = dataclasses.replace


@dataclasses.dataclass(frozen=True)
class _Step:
    """What a handler returns: a :class:`Transition` whose events are still typed (worded by
    :mod:`..wording` when :func:`step` journals them)."""

    state: State
    effects: tuple[Effect, ...] = ()
    events: tuple[MachineEvent, ...] = ()


Handler = Callable[[State, Any], _Step]
HANDLERS: dict[tuple[Phase, type], Handler] = {}
"""The machine: which handler answers which observation in which phase (anything else is
ignored: the observation does not apply in that phase)."""

LIVE = tuple(p for p in Phase if p not in TERMINAL)


def _on(phases: Iterable[Phase], obs_type: type) -> Callable[[Handler], Handler]:
    """Register the decorated handler for ``obs_type`` in each of ``phases``."""

    def register(fn: Handler) -> Handler:
        for phase in phases:
            if (phase, obs_type) in HANDLERS:
                raise ValueError(f"two handlers for {obs_type.__name__} in {phase.value}")
            HANDLERS[(phase, obs_type)] = fn
        return fn

    return register


def step(state: State, obs: Observation) -> Transition:
    """Return the next state, the effects to carry out and the events to journal."""
    handler = HANDLERS.get((state.phase, type(obs)))
    if handler is None:
        return Transition(state)
    return _journaled(state, obs, _avoiding(handler(state, obs)))


def _avoiding(done: _Step) -> _Step:
    """Every launch the transition asks for keeps off the nodes its state excludes (the one
    place a launch learns them: :attr:`Launch.avoid`)."""
    avoid = tuple(e.node_id for e in done.state.excluded)
    if not avoid or not any(isinstance(e, Launch) for e in done.effects):
        return done
    effects = tuple(_replace(e, avoid=avoid) if isinstance(e, Launch) else e for e in done.effects)
    return _replace(done, effects=effects)


def _journaled(before: State, obs: Observation, done: _Step) -> Transition:
    """Attach the causing observations to the transition's first event (when the state changed).

    An observation that changed the state without an event (the start, a restart choosing what
    to redo) waits in ``State.unjournaled`` and is recorded with the next event.
    """
    t = Transition(done.state, done.effects, tuple(wording.to_record(e) for e in done.events))
    changed = t.state != before
    caused = (*before.unjournaled, obs) if changed else before.unjournaled
    if not caused:
        return t
    if not t.events:
        return _replace(t, state=_replace(t.state, unjournaled=caused))
    state = _replace(t.state, unjournaled=())
    first = {
        **t.events[0],
        "obs": [codec.encode(o) for o in caused],
        "state_digest": state_digest(state),
    }
    return Transition(state, t.effects, (first, *t.events[1:]))


def fold(events: Iterable[dict[str, Any]]) -> State:
    """The machine's state after the journaled ``events``: :func:`step` replayed over the
    observations they record (what a restarted supervisor starts from).

    Pure. A journal cut anywhere (the supervisor died between two appends) folds to a state the
    machine can continue from: the first event of each transition carries its observations.
    """
    state = State()
    for ev in events:
        for data in ev.get("obs") or ():
            state = step(state, codec.decode(data)).state
    return state


def _ev(
    kind: Kind,
    code: Code,
    incident: Incident | None,
    context: Mapping[str, Any] | None = None,
    /,
    **fields: Any,
) -> MachineEvent:
    """An event of ``incident`` recording ``fields``; ``context``: what only its wording needs."""
    return MachineEvent(kind, code, incident.id if incident else None, fields, context or {})


# ---- start ---------------------------------------------------------------------------------------
@_on([Phase.STARTING], Start)
def start(state: State, obs: Start) -> _Step:
    """Launch generation 1."""
    plan = _plan(state)
    st = _replace(
        state,
        phase=Phase.RELAUNCHING,
        plan=plan,
        relaunch_cause="initial",
        resume_to=Phase.RUNNING,
        launch_failures=0,
        launch_retries=obs.launch_retries,
    )
    return _Step(st, (Launch(plan),))


@_on([Phase.STARTING], Launched)
def started(state: State, obs: Launched) -> _Step:
    """Generation 1 is up (a launch made without a :class:`Start`)."""
    plan = state.plan or _plan(state, generation=obs.generation)
    return _launched(_replace(state, plan=plan), obs, "initial")


# ---- 1. RUNNING: a recover decision opens an incident ----------------------------------------
@_on([Phase.RUNNING], Recover)
def stage1_incident(state: State, obs: Recover) -> _Step:
    """1. A recover decision: open an incident and kill every rank (or escalate at once when the
    run has had too many incidents)."""
    n = state.incidents_seen + 1
    inc = Incident(
        id=f"inc-{n:03d}",
        rule=obs.rule,
        reason=obs.reason,
        step=obs.step,
        settings=obs.settings,
        fault=obs.fault,
        furthest_step=obs.furthest_step,
        value=_measured(obs),
        lr_scale_before=state.lr_scale if obs.settings.lr_restore_steps > 0 else None,
    )
    state = _replace(state, incidents_seen=n)
    settings = inc.settings
    if state.hold is not None:
        return _held(state, inc, [_incident_event(inc, obs, attempt=None)])
    if n > settings.max_incidents or settings.max_attempts < 1:
        opened = _incident_event(inc, obs, attempt=None)
        if n > settings.max_incidents:
            too_many = {"incidents": n, "max_incidents": settings.max_incidents}
            return _escalate(state, inc, [opened], Code.TOO_MANY_INCIDENTS, too_many, settings)
        spent = {"max_attempts": settings.max_attempts}
        return _escalate(state, inc, [opened], Code.BUDGET_SPENT, spent, settings)
    return _kill_for(state, inc, obs, [])


def _incident_event(inc: Incident, obs: Recover, attempt: int | None) -> MachineEvent:
    """The ``incident`` event: the rule that fired, with what it saw (``attempt`` None: the
    incident escalates before any attempt)."""
    numbered = {} if attempt is None else {"attempt": attempt}
    return _ev(
        Kind.INCIDENT,
        Code.RULE_FIRED,
        inc,
        {"reason": obs.reason},
        rule=obs.rule,
        step=obs.step,
        **numbered,
        settings=inc.settings.to_dict(),
        **obs.details,
    )


def _kill_for(state: State, inc: Incident, obs: Recover, events: list[MachineEvent]) -> _Step:
    """Journal the incident (attempt ``inc.attempts + 1``) and ask for every rank to be killed."""
    attempt = inc.attempts + 1
    events.append(_incident_event(inc, obs, attempt=attempt))
    st = _replace(state, phase=Phase.KILLING, incident=inc)
    kill = Kill(wording.kill_for_incident(inc.id, obs.rule), batch_ids_for=(inc.id, attempt))
    return _Step(st, (kill,), tuple(events))


# ---- 2. KILLING: every rank is dead --------------------------------------------------------------
@_on([Phase.KILLING], Killed)
def stage2_killed(state: State, obs: Killed) -> _Step:
    """2. The generation is dead: choose the checkpoint to roll back to."""
    inc = state.incident
    assert inc is not None, "KILLING always has an incident"
    event = _ev(
        Kind.KILL,
        Code.RANKS_KILLED,
        inc,
        {"generation": state.generation},
        ranks=list(obs.ranks),
        duration_s=round(obs.duration_s, 3),
        forced=list(obs.forced),
        unreachable=list(obs.unreachable),
    )
    inc = _replace(inc, batch_ids=obs.batch_ids)
    st = _replace(state, phase=Phase.ROLLING_BACK, incident=inc)
    return _Step(st, (_rollback_select(state, inc),), (event,))


def _rollback_select(state: State, inc: Incident) -> SelectCheckpoint:
    """Which checkpoint an incident rolls back to. A numerical incident: the newest graded at
    least ``min_grade`` (or, ``grade_baseline: run`` and none is, the run's own healthy
    baseline), ``min_steps_back`` before the incident. A crash or a hang: the newest that
    verifies, whatever its grade, at or before the furthest step any rank reached."""
    s = inc.settings
    if inc.fault:
        furthest = max(inc.step, inc.furthest_step or inc.step)
        return SelectCheckpoint(None, furthest, 0, state.lineage, s.fallback_on_corrupt)
    return SelectCheckpoint(
        s.min_grade,
        inc.step,
        s.min_steps_back,
        state.lineage,
        s.fallback_on_corrupt,
        grade_baseline=s.grade_baseline,
    )


# ---- 3. ROLLING_BACK: a checkpoint was chosen (or none qualifies) -----------------------------
@_on([Phase.ROLLING_BACK], CheckpointChosen)
def stage3_rollback(state: State, obs: CheckpointChosen) -> _Step:
    """3. Roll back to the chosen checkpoint, cut the LR, reset the optimizer and relaunch. With
    no checkpoint: a crash or a hang starts over from step 0; a numerical incident escalates."""
    inc = state.incident
    assert inc is not None, "ROLLING_BACK always has an incident"
    if obs.path is None and not (inc.fault and obs.corrupt is None):
        return _no_checkpoint(state, inc, obs)
    s = inc.settings
    factor = lr_factor(s, inc.attempts)
    scale = state.lr_scale * factor
    skip = _skip_window(inc, obs.step)
    plan = _plan(state, obs, lr_scale=scale, reset_optimizer=s.reset_optimizer, skip=skip)
    plan = _replace(plan, **_rewarm(s), **_restore(inc, plan))
    inc = _replace(inc, attempts=inc.attempts + 1)
    if obs.path is None:
        code = Code.RESTART_FROM_START
        before: dict[str, Any] = {"step": inc.furthest_step or inc.step}
    else:
        code = Code.CHECKPOINT_CHOSEN
        furthest = max(inc.step, inc.furthest_step or inc.step)
        before = {"fault": bool(inc.fault), "step": furthest if inc.fault else inc.step}
        before["min_grade"] = s.min_grade
    events: list[MachineEvent] = [
        _ev(
            Kind.ROLLBACK,
            code,
            inc,
            before,
            **_chosen(obs),
            **({} if inc.fault else _grade_rule(obs, s)),
            skip_ranges=[list(r) for r in plan.skip_ranges],
            **_skip_batches_fields(plan),
            attempt=inc.attempts,
            plan=plan.to_dict(),
        ),
        _ev(
            Kind.LR_CUT,
            Code.LR_CUT,
            inc,
            {"attempt": inc.attempts},
            factor=factor,
            lr_scale=scale,
        ),
    ]
    if s.reset_optimizer:
        rewarm = {"rewarm_steps": plan.rewarm_steps} if plan.rewarm_steps else {}
        events.append(_ev(Kind.OPTIMIZER_RESET, Code.OPTIMIZER_RESET, inc, **rewarm))
    st = _replace(
        state,
        phase=Phase.RELAUNCHING,
        incident=inc,
        lr_scale=scale,
        plan=plan,
        launch_failures=0,
        relaunch_cause="recovery",
        resume_to=None,
    )
    # a crash loop waits longer each time; a numerical incident relaunches at once
    backoff = inc.attempts if inc.fault else 0
    return _Step(st, (Launch(plan, backoff_attempt=backoff),), tuple(events))


def _skip_window(inc: Incident, checkpoint_step: int | None) -> _Skip:
    """What the relaunch skips of the incident's window (``skip_window`` steps up to it): a step
    range after the checkpoint, or (``skip_by: batch_ids``, with the ranks' batch ids on file)
    the window whose recorded batches are skipped by id wherever they come again."""
    s = inc.settings
    if s.skip_window <= 0:
        return _Skip()
    if s.skip_by == "batch_ids" and inc.batch_ids is not None:
        return _Skip(batches=inc.batch_ids, window=(max(inc.step - s.skip_window + 1, 0), inc.step))
    first = 0 if checkpoint_step is None else checkpoint_step + 1  # never the checkpoint's data
    return _Skip(ranges=((max(inc.step - s.skip_window + 1, first), inc.step),))


def _skip_batches_fields(plan: ResumePlan) -> dict[str, Any]:
    """The rollback event's account of batches skipped by id (nothing when none are)."""
    if plan.skip_batches_steps is None:
        return {}
    return {
        "skip_batches": plan.skip_batches,
        "skip_batches_steps": list(plan.skip_batches_steps),
    }


def _no_checkpoint(state: State, inc: Incident, obs: CheckpointChosen) -> _Step:
    """Nothing to roll back to (or, with ``fallback_on_corrupt`` off, a corrupt one): escalate
    (or hold, ``on_exhausted: hold``)."""
    s = inc.settings
    if obs.corrupt is not None:
        code = Code.CORRUPT_CHECKPOINT
        why: dict[str, Any] = {"corrupt": obs.corrupt}
    else:
        code = Code.NO_HEALTHY_CHECKPOINT
        why = {"min_grade": s.min_grade, "min_steps_back": s.min_steps_back, "step": inc.step}
        if obs.grade_rule == "run baseline":
            why.update(baseline=obs.grade_bar, baseline_of=obs.baseline_of)
    rollback = _none_chosen(Kind.ROLLBACK, code, why, inc, obs)
    return _escalate(state, inc, [rollback], code, why, s)


def _none_chosen(
    kind: Kind,
    code: Code,
    why: Mapping[str, Any],
    inc: Incident | None,
    obs: CheckpointChosen,
    **fields: Any,
) -> MachineEvent:
    """The rollback or resume event that found nothing to go back to (what it passed over);
    ``why``: the values its wording needs (the escalation's)."""
    return _ev(
        kind,
        code,
        inc,
        why,
        checkpoint_step=None,
        checkpoint_path=None,
        skipped=_skipped(obs),
        **fields,
    )


def _chosen(obs: CheckpointChosen) -> dict[str, Any]:
    """The fields of a rollback or resume event that say which checkpoint was chosen."""
    return dict(
        checkpoint_step=obs.step,
        checkpoint_path=obs.path,
        grade=obs.grade,
        skipped=_skipped(obs),
    )


def _skipped(obs: CheckpointChosen) -> list[dict[str, str]]:
    """The newer checkpoints the choice passed over, and why (as events record them)."""
    return [{"path": p, "reason": r} for p, r in obs.skipped]


def _grade_rule(obs: CheckpointChosen, s: Settings) -> dict[str, Any]:
    """Which rule judged the rollback target healthy (a numerical incident's rollback event):
    ``absolute`` with the bar (``min_grade``), ``run baseline`` with the bar and how many
    graded checkpoints it is the median of, or ``ungraded`` (no bar: nothing was graded)."""
    rule = obs.grade_rule or "absolute"
    bar = obs.grade_bar if obs.grade_bar is not None or rule == "ungraded" else s.min_grade
    fields: dict[str, Any] = {"grade_rule": rule, "grade_bar": bar}
    if rule == "run baseline":
        fields["baseline_of"] = obs.baseline_of
    return fields


def _rewarm(s: Settings) -> dict[str, Any]:
    """The plan's LR re-warm-up: after an optimizer reset, over ``rewarm_steps`` steps."""
    return {"rewarm_steps": s.rewarm_steps} if s.reset_optimizer and s.rewarm_steps > 0 else {}


def _restore(inc: Incident, plan: ResumePlan) -> dict[str, Any]:
    """The plan's giving back of the LR cut (``lr_restore_steps``), committed at launch: from
    the end of probation, back to the scale before the incident. Nothing when the cut is
    permanent, or there is nothing to give back."""
    s, before = inc.settings, inc.lr_scale_before
    if s.lr_restore_steps <= 0 or before is None or before <= plan.lr_scale:
        return {}
    return {
        "lr_restore_from": plan.start_step + s.probation_steps,
        "lr_restore_steps": s.lr_restore_steps,
        "lr_restore_to": before,
    }


# ---- 4. RELAUNCHING: the new generation is up
# -----------------------------------------------------
@_on([Phase.RELAUNCHING], Launched)
def stage4_launched(state: State, obs: Launched) -> _Step:
    """4. The new generation is up: probation after a recovery, else back where it was."""
    return _launched(state, obs, state.relaunch_cause or "recovery")


_LAUNCH_CODES = {
    "initial": Code.INITIAL_LAUNCH,
    "recovery": Code.RELAUNCH_AFTER_ROLLBACK,
    "launch_retry": Code.RELAUNCH_AFTER_LAUNCH_FAILURE,
    "restart": Code.RELAUNCH_AFTER_RESTART,
}


def _launched(state: State, obs: Launched, cause: RelaunchCause) -> _Step:
    plan = state.plan or _plan(state, generation=obs.generation)
    inc = state.incident
    start_at = start_step(plan)
    fields: dict[str, Any] = dict(
        generation=obs.generation,
        lr_scale=state.lr_scale,
        cause=cause,
        plan=plan.to_dict(),
        port=obs.port,
        backoff_s=round(obs.backoff_s, 3),
        pids=[r.get("pid") for r in obs.ranks],
        ranks=[dict(r) for r in obs.ranks],
    )
    if state.excluded:
        fields["excluded_nodes"] = [e.node_id for e in state.excluded]
    st = _replace(
        state,
        generation=obs.generation,
        max_generation=max(state.max_generation, obs.generation),
        plan=plan,
        lineage=(*state.lineage, (obs.generation, plan.checkpoint_step)),
        relaunch_cause=None,
        resume_to=None,
        nodes=obs.nodes,
    )
    code = _LAUNCH_CODES[cause]
    at = {"start_step": start_at}
    done = _launched_phase(state, st, obs, cause, _ev(Kind.LAUNCH, code, inc, at, **fields))
    if obs.unavoided is None:
        return done
    unplaced = _ev(
        Kind.NODE_EXCLUDED,
        Code.EXCLUSION_UNPLACEABLE,
        inc,
        {"why": obs.unavoided},
        generation=obs.generation,
        excluded=[e.node_id for e in state.excluded],
        placed_on=sorted({n for n in obs.nodes if n}),
    )
    return _replace(done, events=(*done.events, unplaced))


def _launched_phase(
    state: State, st: State, obs: Launched, cause: RelaunchCause, launch: MachineEvent
) -> _Step:
    """Where a launch leaves the run: probation after a recovery, else RUNNING (or the phase a
    retry or a restart returns to), with its ``launch`` event first."""
    inc = state.incident
    start_at = start_step(st.plan)
    if cause == "recovery":
        assert inc is not None, "a recovery relaunch always has an incident"
        until = start_at + inc.settings.probation_steps
        st = _replace(
            st,
            phase=Phase.PROBATION,
            probation_from=start_at,
            probation_until=until,
            probation_reported=0,
        )
        return _Step(
            st,
            events=(
                launch,
                _ev(
                    Kind.PROBATION_START,
                    Code.PROBATION_WINDOW,
                    inc,
                    from_step=start_at,
                    until_step=until,
                ),
            ),
        )
    if cause == "initial":
        return _Step(_replace(st, phase=Phase.RUNNING), events=(launch,))
    return _Step(_replace(st, phase=state.resume_to or Phase.RUNNING), events=(launch,))


# ---- 5. PROBATION: the window passes, or another recover decision fails it ---------------------
@_on([Phase.PROBATION], Progress)
def stage5_progress(state: State, obs: Progress) -> _Step:
    """5. Training reached the end of the probation window: the incident is resolved (on the
    way, each tenth of the window is reported)."""
    start, until = state.probation_from or 0, state.probation_until or 0
    if obs.step < until:
        tenths = (obs.step - start) * 10 // max(until - start, 1)
        if tenths <= state.probation_reported:
            return _Step(state)
        event = _ev(
            Kind.PROBATION_PROGRESS,
            Code.PROBATION_PROGRESS,
            state.incident,
            {"tenths": tenths},
            step=obs.step,
            from_step=start,
            until_step=until,
        )
        return _Step(_replace(state, probation_reported=tenths), events=(event,))
    return _probation_passed(state, obs.step, Code.WINDOW_PASSED)


def _probation_passed(state: State, at_step: int | None, code: Code) -> _Step:
    """The incident is resolved; an LR cut its plan gives back is the run's scale from now on
    (a later incident cuts from there)."""
    plan = state.plan
    restored: dict[str, Any] = {}
    scale = state.lr_scale
    if plan is not None and plan.lr_restore_to is not None:
        restored = {
            "lr_restored_from": state.lr_scale,
            "lr_restore_steps": plan.lr_restore_steps,
            "lr_restore_from_step": plan.lr_restore_from,
        }
        scale = plan.lr_restore_to
    ev = _ev(Kind.PROBATION_PASSED, code, state.incident, step=at_step, lr_scale=scale, **restored)
    st = _replace(
        state,
        phase=Phase.RUNNING,
        incident=None,
        probation_from=None,
        probation_until=None,
        lr_scale=scale,
    )
    return _Step(st, events=(ev,))


@_on([Phase.PROBATION], Recover)
def stage5_probation_failed(state: State, obs: Recover) -> _Step:
    """5. Another recover decision inside the window. A fault of the other kind (numerical
    against a crash or a hang; ``probation_kinds: own``) supersedes the incident: it opens its
    own, with its rule's settings and budget. Otherwise the attempt failed: back to 2 while the
    budget lasts (under the firing rule's settings, ``probation_kinds: own``); a recurrence of
    the same rule at the same step, measuring the same, fails fast."""
    inc = state.incident
    if inc is None:  # a probation without an incident cannot be failed: a new incident
        return stage1_incident(_replace(state, phase=Phase.RUNNING), obs)
    own = inc.settings.probation_kinds == "own"
    if own and obs.fault != inc.fault:
        return _superseded(state, inc, obs)
    recurrence = _recurrence(inc, obs)
    code = Code.RECOVER_IN_PROBATION
    if recurrence is _Recurrence.OTHER_VALUE:
        code = Code.SAME_STEP_OTHER_VALUE
    elif own and obs.rule != inc.rule:
        code = Code.OTHER_RULE_IN_PROBATION
    given = {"reason": obs.reason, "first_step": inc.step, "first_value": inc.value}
    measured = {} if obs.fault else {"value": _measured(obs)}
    failed = _ev(Kind.PROBATION_FAILED, code, inc, given, step=obs.step, rule=obs.rule, **measured)
    events = [failed]
    if state.hold is not None:
        return _held(state, inc, events)
    if recurrence is _Recurrence.SAME:
        recurred = {"rule": obs.rule, "first_step": inc.step, "step": obs.step}
        code = Code.RECURRING_FAULT
        return _escalate(state, inc, events, code, recurred, inc.settings, fail_fast=True)
    settings = obs.settings if own else inc.settings
    if inc.attempts >= settings.max_attempts:
        spent = {"max_attempts": settings.max_attempts}
        return _escalate(state, inc, events, Code.BUDGET_SPENT, spent, settings)
    inc = _replace(
        inc,
        rule=obs.rule,
        reason=obs.reason,
        step=obs.step,
        fault=obs.fault,
        furthest_step=obs.furthest_step,
        value=_measured(obs),
        settings=settings,
    )
    return _kill_for(state, inc, obs, events)


def _superseded(state: State, inc: Incident, obs: Recover) -> _Step:
    """A fault of the other kind in ``inc``'s probation: ``inc`` ends (superseded), and the
    fault opens its own incident (stage 1), recovered with its own rule's settings: a
    divergence in a crash's probation gets its LR cut and optimizer reset, never the crash's x1."""
    ended = _ev(
        Kind.PROBATION_SUPERSEDED,
        Code.OTHER_KIND_IN_PROBATION,
        inc,
        {"reason": obs.reason, "incident_rule": inc.rule, "incident_fault": inc.fault},
        step=obs.step,
        rule=obs.rule,
        fault=obs.fault,
        lr_scale=state.lr_scale,
    )
    running = _replace(
        state, phase=Phase.RUNNING, incident=None, probation_from=None, probation_until=None
    )
    opened = stage1_incident(running, obs)
    return _replace(opened, events=(ended, *opened.events))


class _Recurrence(enum.Enum):
    """Whether a recover decision in probation repeats the previous attempt's."""

    NO = "no"
    """Another rule, or another step: an attempt like any other."""
    SAME = "same"
    """The same rule at the same step (within ``recur_window_steps``), measuring the same: the
    fault is deterministic there."""
    OTHER_VALUE = "other_value"
    """The same rule at the same step, but the rank measured something else: the sampling grid
    brought it to the same step (a windowed rule refilled after the rollback), not the fault."""


def _recurrence(inc: Incident, obs: Recover) -> _Recurrence:
    """Is ``obs`` the same fault as ``inc``'s latest attempt? The same rule within the
    incident's ``recur_window_steps``, and (with ``recur_tolerance`` set) the same measured
    value (:func:`_same_value`)."""
    s = inc.settings
    if obs.rule != inc.rule or abs(obs.step - inc.step) > s.recur_window_steps:
        return _Recurrence.NO
    if s.recur_tolerance is None or _same_value(inc.value, _measured(obs), s.recur_tolerance):
        return _Recurrence.SAME
    return _Recurrence.OTHER_VALUE


def _measured(obs: Recover) -> float | str | None:
    """What the rule measured: nothing for a crash or a hang (whatever a rule reports there)."""
    return None if obs.fault else obs.value


def _same_value(a: Any, b: Any, tolerance: float) -> bool:
    """Two measurements of the same fault: both absent, both non-finite, or finite and equal
    within ``tolerance`` (relative to the larger)."""
    x, y = _number(a), _number(b)
    if x is None or y is None:
        return bool(a == b)  # both absent, or the same value that is no number
    if not (math.isfinite(x) and math.isfinite(y)):
        return not math.isfinite(x) and not math.isfinite(y)
    return abs(x - y) <= tolerance * max(abs(x), abs(y))


def _number(v: Any) -> float | None:
    """A measured value as a float (a journaled ``"nan"``, ``"inf"`` too); None: not a number."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


# ---- nodes kept out of the run -------------------------------------------------------------
_NODE_CODES = {
    "lost": Code.NODE_LOST,
    "unhealthy": Code.NODE_UNHEALTHY,
    "straggler": Code.NODE_STRAGGLER,
}
"""The ``node_excluded`` event's code, by why the node is excluded."""


@_on(LIVE, NodeSuspect)
def node_suspect(state: State, obs: NodeSuspect) -> _Step:
    """A rank's node should not host the run again: exclude it for the rest of the run (every
    later launch avoids it, :func:`_avoiding`). Nothing happens for a rank of another
    generation, one whose node is unknown, or a node already excluded."""
    if obs.generation != state.generation or not 0 <= obs.rank < len(state.nodes):
        return _Step(state)
    node = state.nodes[obs.rank]
    if not node or any(e.node_id == node for e in state.excluded):
        return _Step(state)
    ex = Exclusion(
        node_id=node, cause=obs.cause, reason=obs.reason, rank=obs.rank, generation=obs.generation
    )
    st = _replace(state, excluded=(*state.excluded, ex))
    event = _ev(
        Kind.NODE_EXCLUDED,
        _NODE_CODES[obs.cause],
        state.incident,
        {"reason": obs.reason},
        node_id=node,
        cause=obs.cause,
        rank=obs.rank,
        generation=obs.generation,
        excluded=[e.node_id for e in st.excluded],
    )
    return _Step(st, events=(event,))


# ---- the run ends --------------------------------------------------------------------------------
@_on((*ACTIVE, Phase.PREEMPTING), Finished)
def finished(state: State, obs: Finished) -> _Step:
    """Every rank finished: the run is complete (a probation in progress passes)."""
    events: tuple[MachineEvent, ...] = ()
    if state.phase is Phase.PROBATION:
        events = _probation_passed(state, None, Code.FINISHED_IN_PROBATION).events
    st = _replace(
        state,
        phase=Phase.COMPLETED,
        incident=None,
        exit_code=ExitCode.COMPLETED,
        probation_from=None,
        probation_until=None,
    )
    done = _ev(Kind.COMPLETED, Code.ALL_RANKS_FINISHED, None, final_loss=obs.final_loss)
    return _Step(st, (Shutdown(ExitCode.COMPLETED),), (*events, done))


@_on(LIVE, StopRequested)
def stop(state: State, obs: StopRequested) -> _Step:
    """A person or a policy rule asked to stop: kill the ranks and stop (exit 5)."""
    st = _replace(state, phase=Phase.STOPPED, exit_code=ExitCode.STOPPED)
    event = _ev(Kind.STOPPED, Code.STOP_REQUESTED, state.incident, {"reason": obs.reason})
    return _Step(st, (Kill(wording.kill_reason(event)), Shutdown(ExitCode.STOPPED)), (event,))


@_on(ACTIVE, RankExited)
def rank_exited(state: State, obs: RankExited) -> _Step:
    """A rank's process ended (after the policy engine saw it): before its first message that
    is a launch failure; non-zero with no rule recovering it, the job failed; a crash in teardown
    after ``done`` is noted and counted as finished."""
    if obs.generation != state.generation:
        return _Step(state)  # a generation already replaced (a rule recovered it)
    if obs.teardown_code is not None:
        note = _ev(
            Kind.ALERT,
            Code.TEARDOWN_EXIT,
            None,
            {"teardown_code": obs.teardown_code},
            severity="info",
            rule=None,
            rank=obs.rank,
            layer=None,
            step=obs.details.get("step"),
        )
        return _Step(state, events=(note,))
    if obs.code == 0:
        return _Step(state)
    lost = obs.details.get("lost")
    if obs.first:
        failure = LaunchFailed(
            wording.exit_before_heartbeat(obs.rank, obs.code, lost),
            rank=obs.rank,
            exit_code=obs.code,
            details={"log_tail": obs.details.get("log_tail", "")},
        )
        return launch_failed(state, failure)
    details = {"rank": obs.rank, "rank_exit_code": obs.code}
    details["log_tail"] = obs.details.get("log_tail", "")
    if lost:
        details["lost"] = lost
    st = _replace(state, phase=Phase.FAILED, exit_code=ExitCode.FAILED)
    event = _ev(
        Kind.FAILED,
        Code.CRASH_WITHOUT_RULE,
        state.incident,
        exit_code=ExitCode.FAILED,
        **details,
    )
    return _Step(st, (Kill(wording.kill_reason(event)), Shutdown(ExitCode.FAILED)), (event,))


@_on(LIVE, Notify)
def notify(state: State, obs: Notify) -> _Step:
    """A notify (or checkpoint) rule fired or resolved: an alert for the notifiers."""
    code = Code.RULE_RESOLVED if obs.resolved else Code.RULE_NOTIFY
    given = {"reason": obs.reason}
    event = _ev(Kind.ALERT, code, None, given, resolved=obs.resolved, **obs.details)
    return _Step(state, events=(event,))


# ---- requests to the ranks: a checkpoint now, and preemption ----------------------------------
@_on(ACTIVE, CheckpointWanted)
def checkpoint_wanted(state: State, obs: CheckpointWanted) -> _Step:
    """A ``checkpoint`` rule fired: ask the ranks to save at their next step boundary."""
    n = state.requests_sent + 1
    event = _ev(
        Kind.ALERT,
        Code.CHECKPOINT_REQUESTED,
        None,
        {"reason": obs.reason},
        resolved=False,
        request_id=n,
        **obs.details,
    )
    request = RequestCheckpoint(n, wording.checkpoint_request(obs.details.get("rule")))
    return _Step(_replace(state, requests_sent=n), (request,), (event,))


@_on(LIVE, Preempt)
def preempt(state: State, obs: Preempt) -> _Step:
    """The supervisor must go. Training ranks are asked for an emergency checkpoint first (the
    controller waits its grace period for it); in any other phase there is nothing to save.

    What a preemption of training ends in, never neither: the ranks finish in the grace period
    (every rank exits 0: :func:`finished`, completed wins), or their emergency checkpoint comes
    (:func:`preempt_saved`), or the grace expires and the event names the newest usable
    checkpoint, the one the resume will start from (:func:`preempt_expired`)."""
    if state.phase in (Phase.PREEMPTING, Phase.PREEMPTED):
        return _Step(state)
    if state.phase not in ACTIVE:
        st = _replace(state, preempted_from=state.phase)
        return _preempted(st, reason=obs.reason)
    n = state.requests_sent + 1
    event = _ev(
        Kind.ALERT,
        Code.PREEMPTION,
        state.incident,
        {"reason": obs.reason},
        severity="info",
        rule=None,
        request_id=n,
    )
    st = _replace(state, phase=Phase.PREEMPTING, preempted_from=state.phase, requests_sent=n)
    return _Step(st, (RequestCheckpoint(n, obs.reason, wait=True),), (event,))


@_on([Phase.PREEMPTING], CheckpointSaved)
def preempt_saved(state: State, obs: CheckpointSaved) -> _Step:
    """The emergency checkpoint is durable: stop, resumably; the resume starts from it."""
    if obs.request_id != state.requests_sent:
        return _Step(state)  # an answer to an older request
    return _preempted(state, saved=obs)


@_on([Phase.PREEMPTING], GraceExpired)
def preempt_expired(state: State, obs: GraceExpired) -> _Step:
    """No emergency checkpoint in time: kill the ranks, then choose the checkpoint the resume
    will start from (:func:`preempt_named`). Killed first, so nothing lands on disk between the
    choice and the resume (a fenced rank cannot publish either)."""
    if obs.request_id != state.requests_sent:
        return _Step(state)
    settings = state.incident.settings if state.incident is not None else Settings()
    kill = Kill(wording.kill_on_preemption())
    return _Step(state, (kill, resume_choice(state, settings)))


@_on([Phase.PREEMPTING], CheckpointChosen)
def preempt_named(state: State, obs: CheckpointChosen) -> _Step:
    """The newest usable checkpoint after the grace expired (None: the run has none yet, the
    resume starts from step 0): stop, resumably, naming it. The ranks are dead already."""
    return _preempted(state, resume=obs, killed=True)


def resume_choice(state: State, settings: Settings) -> SelectCheckpoint:
    """The checkpoint a resume of ``state`` chooses: the newest one on its lineage that verifies;
    after a preemption of any grade, else of ``settings.min_grade`` (or the run's baseline).
    The one rule for a restarted supervisor and for the name a preemption journals."""
    min_grade = None if state.preempted_from is not None else settings.min_grade
    return SelectCheckpoint(
        min_grade, None, 0, state.lineage, grade_baseline=settings.grade_baseline
    )


def _preempted(
    state: State,
    *,
    saved: CheckpointSaved | None = None,
    resume: CheckpointChosen | None = None,
    reason: str | None = None,
    killed: bool = False,
) -> _Step:
    """Stop, resumably: after the emergency checkpoint ``saved``; or without one, naming the
    checkpoint the resume starts from (``resume``, chosen when the grace expired); or, when
    nothing was training, for the preemption's own ``reason`` (the resume then finishes the
    step it interrupted). ``killed``: the ranks are dead already."""
    code = Code.PREEMPTED_AFTER_CHECKPOINT if saved else Code.PREEMPTED_WITHOUT_CHECKPOINT
    named: dict[str, Any] = {}
    if saved is not None:
        named = {"resume_checkpoint": saved.path, "resume_step": saved.step}
    elif resume is not None:
        named = {"resume_checkpoint": resume.path, "resume_step": resume.step}
        if resume.skipped:
            named["resume_skipped"] = [list(s) for s in resume.skipped]
    event = _ev(
        Kind.PREEMPTED,
        code,
        state.incident,
        {"reason": reason},
        checkpoint_path=saved.path if saved else None,
        checkpoint_step=saved.step if saved else None,
        interrupted=(state.preempted_from or state.phase).value,
        exit_code=ExitCode.PREEMPTED,
        **named,
    )
    st = _replace(state, phase=Phase.PREEMPTED, exit_code=ExitCode.PREEMPTED)
    shutdown = Shutdown(ExitCode.PREEMPTED)
    effects = (shutdown,) if killed else (Kill(wording.kill_reason(event)), shutdown)
    return _Step(st, effects, (event,))


# ---- launch failures ---------------------------------------------------------------------------
@_on((Phase.RUNNING, Phase.PROBATION, Phase.RELAUNCHING), LaunchFailed)
def launch_failed(state: State, obs: LaunchFailed) -> _Step:
    """A launch did not come up: relaunch as a new generation (fresh port, backoff), outside the
    incident budget, at most ``launch_retries`` times in a row; then the job fails."""
    n = state.launch_failures + 1
    retries = state.launch_retries
    relaunching = state.phase is Phase.RELAUNCHING
    failed_gen = state.plan.generation if relaunching and state.plan else state.generation
    fields = dict(
        generation=failed_gen,
        rank=obs.rank,
        exit_code=obs.exit_code,
        failures=n,
        retries_allowed=retries,
        **obs.details,
    )
    if n > retries:
        st = _replace(
            state,
            phase=Phase.FAILED,
            exit_code=ExitCode.FAILED,
            launch_failures=n,
            max_generation=max(state.max_generation, failed_gen),
        )
        last = _ev(
            Kind.LAUNCH_FAILED,
            Code.LAUNCH_RETRIES_SPENT,
            state.incident,
            {"reason": obs.reason},
            gave_up=True,
            **fields,
        )
        failed = _ev(
            Kind.FAILED,
            Code.LAUNCH_RETRIES_SPENT,
            state.incident,
            {"failures": n, "retries": retries, "reason": obs.reason},
            exit_code=ExitCode.FAILED,
            rank_exit_code=obs.exit_code,
        )
        effects = (Kill(wording.kill_reason(failed)), Shutdown(ExitCode.FAILED))
        return _Step(st, effects, (last, failed))
    st = _replace(state, max_generation=max(state.max_generation, failed_gen))
    plan = _replace(state.plan, generation=next_generation(st)) if state.plan else _plan(st)
    st = _replace(
        st,
        phase=Phase.RELAUNCHING,
        plan=plan,
        launch_failures=n,
        relaunch_cause=state.relaunch_cause if relaunching else "launch_retry",
        resume_to=state.resume_to if relaunching else state.phase,
    )
    event = _ev(
        Kind.LAUNCH_FAILED,
        Code.LAUNCH_FAILED,
        state.incident,
        {"reason": obs.reason, "generation": plan.generation},
        plan=plan.to_dict(),
        **fields,
    )
    kill = Kill(wording.kill_after_launch_failure(obs.reason))
    return _Step(st, (kill, Launch(plan, backoff_attempt=n)), (event,))


# ---- a restarted supervisor ----------------------------------------------------------------------
RESTART: dict[Phase, Handler] = {}
"""What a restarted supervisor does in each phase the journal folded to (after a preemption:
the phase it interrupted); the other half of the machine's table, for :class:`Restarted`."""


def _on_restart(*phases: Phase) -> Callable[[Handler], Handler]:
    """Register the decorated function as the restart's answer in each of ``phases``."""

    def register(fn: Handler) -> Handler:
        for phase in phases:
            if phase in RESTART:
                raise ValueError(f"two restart answers in {phase.value}")
            RESTART[phase] = fn
        return fn

    return register


@_on(LIVE, Restarted)
def restarted(state: State, obs: Restarted) -> _Step:
    """Finish what the journal shows unfinished: an interrupted kill, the checkpoint choice, the
    relaunch with the journaled plan; a running generation is resumed from a checkpoint (its
    agents died with the old supervisor). A preempted run goes back to the phase the preemption
    interrupted, and resumes from its newest checkpoint whatever its grade (the emergency one,
    if the ranks made it in time). What each phase does is :data:`RESTART`."""
    st = _replace(
        state,
        max_generation=max(state.max_generation, obs.highest_generation),
        launch_retries=obs.launch_retries,
    )
    if st.phase in (Phase.PREEMPTING, Phase.PREEMPTED):
        interrupted = st.preempted_from or Phase.RUNNING
        keep = interrupted in ACTIVE  # marks the resume "after preemption"
        st = _replace(
            st,
            phase=interrupted,
            exit_code=None,
            preempted_from=st.preempted_from if keep else None,
        )
    return RESTART[st.phase](st, obs)


@_on_restart(Phase.STARTING)
def _restart_start(st: State, obs: Restarted) -> _Step:
    """Nothing was launched yet: start."""
    return start(st, Start(obs.launch_retries))


@_on_restart(Phase.RUNNING, Phase.PROBATION, Phase.RESUMING)
def _restart_resume(st: State, obs: Restarted) -> _Step:
    """The generation's agents died with the old supervisor: choose the checkpoint to resume
    from (any grade after a preemption; else the incident's, or the policy's, ``min_grade``)."""
    back = st.resume_to if st.phase is Phase.RESUMING else st.phase
    s = st.incident.settings if st.incident is not None else obs.settings
    st = _replace(st, phase=Phase.RESUMING, resume_to=back or Phase.RUNNING, resume_settings=s)
    return _Step(st, (resume_choice(st, s),))


@_on_restart(Phase.KILLING)
def _restart_kill(st: State, obs: Restarted) -> _Step:
    """Finish the interrupted kill."""
    if st.incident is None:
        return _Step(st)
    return _Step(st, (Kill(wording.kill_on_restart(st.incident.id)),))


@_on_restart(Phase.ROLLING_BACK)
def _restart_rollback(st: State, obs: Restarted) -> _Step:
    """Choose the incident's checkpoint again."""
    if st.incident is None:
        return _Step(st)
    return _Step(st, (_rollback_select(st, st.incident),))


@_on_restart(Phase.RELAUNCHING)
def _restart_relaunch(st: State, obs: Restarted) -> _Step:
    """Launch with the journaled plan, under a new number when that launch may have begun."""
    if st.plan is None:
        return _Step(st)
    plan = st.plan
    if plan.generation <= st.max_generation:
        plan = _replace(plan, generation=st.max_generation + 1)
    return _Step(_replace(st, plan=plan), (Launch(plan),))


@_on_restart(Phase.HOLDING)
def _restart_holding(st: State, obs: Restarted) -> _Step:
    """The ranks are dead and a human decides: nothing to do."""
    return _Step(st)


@_on([Phase.RESUMING], CheckpointChosen)
def resume(state: State, obs: CheckpointChosen) -> _Step:
    """The checkpoint a restarted supervisor resumes the run from (the newest healthy one on the
    lineage, with the journaled LR scale; none yet: from step 0). The generation's checkpoint
    gone: escalate (or hold, ``on_exhausted: hold``)."""
    old, inc = state.plan, state.incident
    settings = state.resume_settings if state.resume_settings is not None else Settings()
    state = _replace(state, resume_settings=None)
    back = (state.resume_to or Phase.RUNNING).value
    if obs.path is None:
        if old is not None and old.checkpoint is not None:
            code = Code.RESUME_CHECKPOINT_GONE
            why = {"checkpoint": old.checkpoint}
            gone = _none_chosen(Kind.RESUME, code, why, inc, obs, resume_to=back)
            return _escalate(state, inc, [gone], code, why, settings)
        plan = _plan(state, skip=_carried(old, after=None))
        plan = _replace(plan, **_carried_lr(old, False, state))
        code = Code.RESUME_FROM_START
    else:
        reset = bool(old is not None and old.reset_optimizer and old.checkpoint == obs.path)
        plan = _plan(state, obs, reset_optimizer=reset, skip=_carried(old, after=obs.step or 0))
        plan = _replace(plan, **_carried_lr(old, reset, state))
        code = Code.RESUME_FROM_CHECKPOINT
        if state.preempted_from is not None:
            code = Code.RESUME_AFTER_PREEMPTION
    event = _ev(
        Kind.RESUME,
        code,
        inc,
        **_chosen(obs),
        lr_scale=state.lr_scale,
        resume_to=back,
        plan=plan.to_dict(),
    )
    st = _replace(
        state,
        phase=Phase.RELAUNCHING,
        plan=plan,
        relaunch_cause="restart",
        launch_failures=0,
        preempted_from=None,
    )
    return _Step(st, (Launch(plan),), (event,))


# ---- escalation: the one way automatic recovery gives up ---------------------------------------
def _escalate(
    state: State,
    inc: Incident | None,
    events: list[MachineEvent],
    code: Code,
    why: Mapping[str, Any],
    settings: Settings,
    *,
    fail_fast: bool = False,
) -> _Step:
    """Give up: stop the job (exit 3), or hold it for a human (``settings.on_exhausted: hold``).
    Ranks still training are killed either way; after a kill or a restart there are none.
    ``code`` says why (``why``: the values its wording needs)."""
    extra = {"fail_fast": True} if fail_fast else {}
    training = state.phase in ACTIVE
    hold = settings.on_exhausted == "hold"
    escalated = _ev(Kind.ESCALATED, code, inc, why, hold=hold, **extra)
    events.append(escalated)
    kill = (Kill(wording.kill_reason(escalated)),) if training else ()
    if hold:
        st = _replace(state, phase=Phase.HOLDING, incident=inc)
        return _Step(st, kill, tuple(events))
    st = _replace(state, phase=Phase.ESCALATED, incident=inc, exit_code=ExitCode.ESCALATED)
    return _Step(st, (*kill, Shutdown(ExitCode.ESCALATED)), tuple(events))


def _held(state: State, inc: Incident, events: list[MachineEvent]) -> _Step:
    """A recover decision while a human holds the run (``spikeguard hold``): kill the ranks and
    wait for them (HOLDING) instead of rolling back; the incident stays open."""
    assert state.hold is not None
    held = _ev(Kind.OPERATOR, Code.RECOVERY_HELD, inc, {"rule": inc.rule}, who=state.hold)
    st = _replace(state, phase=Phase.HOLDING, incident=inc)
    return _Step(st, (Kill(wording.kill_reason(held)),), (*events, held))


# ---- the resume plan: built in one place -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Skip:
    """What a launch skips (see :class:`ResumePlan`): step ranges, and the batches recorded for
    a window of steps, by id."""

    ranges: tuple[tuple[int, int], ...] = ()
    batches: str | None = None
    window: tuple[int, int] | None = None


def _carried(old: ResumePlan | None, after: int | None) -> _Skip:
    """What the generation's plan skipped and a resume still has ahead of it: the ranges ending
    after step ``after`` (None: every range), and the batches by id (wherever they come again)."""
    if old is None:
        return _Skip()
    ranges = tuple(r for r in old.skip_ranges if after is None or r[1] > after)
    return _Skip(ranges, old.skip_batches, old.skip_batches_steps)


def _carried_lr(old: ResumePlan | None, reset: bool, state: State) -> dict[str, Any]:
    """What a resume keeps of the generation's LR plan: its re-warm-up when it resets the
    optimizer again, and (in probation) the cut it gives back when the probation ends."""
    if old is None:
        return {}
    kept: dict[str, Any] = {"rewarm_steps": old.rewarm_steps} if reset else {}
    if state.resume_to is Phase.PROBATION:
        kept.update(
            lr_restore_from=old.lr_restore_from,
            lr_restore_steps=old.lr_restore_steps,
            lr_restore_to=old.lr_restore_to,
        )
    return kept


def _plan(
    state: State,
    chosen: CheckpointChosen | None = None,
    *,
    lr_scale: float | None = None,
    reset_optimizer: bool = False,
    skip: _Skip = _Skip(),
    generation: int | None = None,
) -> ResumePlan:
    """The plan of the next launch: from ``chosen`` (None: from step 0), with the run's LR scale
    (or ``lr_scale``), skipping ``skip``, as ``generation`` (None: the next number)."""
    return ResumePlan(
        checkpoint=chosen.path if chosen else None,
        checkpoint_step=chosen.step if chosen else None,
        sha256=chosen.sha256 if chosen else None,
        lr_scale=state.lr_scale if lr_scale is None else lr_scale,
        reset_optimizer=reset_optimizer,
        skip_ranges=skip.ranges,
        skip_batches=skip.batches,
        skip_batches_steps=skip.window,
        generation=next_generation(state) if generation is None else generation,
    )
