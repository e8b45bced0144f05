"""A human's hand on the run: what the machine does with an :class:`Operator` request.

Pure, like the rest of the machine; registered into its table by :mod:`.machine`. One small
decision per action, each returning the ``operator`` event that says what it did (or why it
could not), worded by :mod:`..wording`::

    ack     an incident (the named one, else the current one) -> acknowledged; its repeats stop
    hold    a live run                     -> hold_set; the next recover decision kills the
                                              ranks and waits (recovery_held, HOLDING)
    resume  HOLDING or ESCALATED           -> OPERATOR_RESUME: the chosen checkpoint (or the
                                              newest healthy one) is verified, then
                                              operator_resumed and a relaunch (the incident's
                                              probation), or operator_refused and back
            a training run with a hold set -> hold_released
    stop    a live run                     -> operator_stop, then stopped (exit 5)

Anything else is refused with the reason (the run is as it was).
"""

from __future__ import annotations

from typing import Any

from spikeguard.workers.contract.exitcodes import ExitCode

from ..events import Code, Kind
from .machine import (
    LIVE,
    _carried,
    _chosen,
    _ev,
    _on,
    _on_restart,
    _plan,
    _replace,
    _rollback_select,
    _Skip,
    _Step,
    resume_choice,
    stop,
)
from .model import (
    TERMINAL,
    CheckpointChosen,
    Launch,
    Operator,
    Phase,
    ResumeAsked,
    SelectCheckpoint,
    Settings,
    Shutdown,
    State,
    StopRequested,
)

RESUMABLE = (Phase.HOLDING, Phase.ESCALATED)
"""Where ``resume`` with a checkpoint choice applies: the run waits for a human, or gave up."""


def _who(obs: Operator) -> dict[str, Any]:
    """The fields every ``operator`` event records: who, from where, why, which request."""
    return {"who": obs.who, "via": obs.via, "note": obs.note, "request": obs.request}


def _refuse(state: State, obs: Operator, why: str, **fields: Any) -> _Step:
    """The request cannot be honoured: say why (the state is as it was)."""
    ev = _ev(
        Kind.OPERATOR,
        Code.OPERATOR_REFUSED,
        state.incident,
        {"why": why},
        action=obs.action,
        **_who(obs),
        **fields,
    )
    return _Step(state, events=(ev,))


@_on((*LIVE, *TERMINAL), Operator)
def operator(state: State, obs: Operator) -> _Step:
    """A human's request, by action."""
    act = _ACTIONS.get(obs.action)
    if act is None:
        return _refuse(state, obs, f"unknown action {obs.action!r}")
    return act(state, obs)


def _ack(state: State, obs: Operator) -> _Step:
    """Acknowledge the named incident (else the current one): it is someone's now."""
    inc = state.incident
    target = obs.incident or (inc.id if inc else None)
    if target is None:
        return _refuse(state, obs, "there is no incident to acknowledge")
    if not _opened(state, target):
        return _refuse(state, obs, f"this run has no incident {target}")
    ev = _ev(Kind.OPERATOR, Code.ACKNOWLEDGED, None, action="ack", **_who(obs))
    ev = _replace(ev, incident=target)
    if inc is not None and inc.id == target:
        state = _replace(state, incident=_replace(inc, acknowledged_by=obs.who))
    return _Step(state, events=(ev,))


def _opened(state: State, incident: str) -> bool:
    """``incident`` is one this run opened (``inc-001`` .. ``inc-<incidents_seen>``)."""
    prefix, _, number = incident.partition("-")
    return prefix == "inc" and number.isdigit() and 1 <= int(number) <= state.incidents_seen


def _hold(state: State, obs: Operator) -> _Step:
    """Pause automatic recovery: the next recover decision waits for a human."""
    if state.phase in TERMINAL:
        return _refuse(state, obs, f"the run has ended ({state.phase.value})")
    if state.phase is Phase.HOLDING:
        return _refuse(state, obs, "the run is already held, waiting for spikeguard resume")
    if state.hold is not None:
        return _refuse(state, obs, f"recovery is already on hold (by {state.hold})")
    ev = _ev(Kind.OPERATOR, Code.HOLD_SET, state.incident, action="hold", **_who(obs))
    return _Step(_replace(state, hold=obs.who), events=(ev,))


def _resume(state: State, obs: Operator) -> _Step:
    """Resume a held or escalated run (verify the choice first), or lift a hold on a run that
    still trains."""
    chose = obs.checkpoint is not None or obs.lr_scale is not None or obs.lr_factor is not None
    chose = chose or obs.reset_optimizer or obs.skip_steps is not None
    if state.phase not in RESUMABLE:
        if state.hold is not None and not chose:
            ev = _ev(
                Kind.OPERATOR, Code.HOLD_RELEASED, state.incident, action="resume", **_who(obs)
            )
            return _Step(_replace(state, hold=None), events=(ev,))
        if state.phase in TERMINAL:
            return _refuse(state, obs, f"the run has ended ({state.phase.value})")
        return _refuse(
            state,
            obs,
            f"the run is {state.phase.value}, not held or escalated: there is nothing to resume",
        )
    asked = ResumeAsked(
        who=obs.who,
        via=obs.via,
        note=obs.note,
        request=obs.request,
        lr_scale=obs.lr_scale,
        lr_factor=obs.lr_factor,
        checkpoint=obs.checkpoint,
        reset_optimizer=obs.reset_optimizer,
        skip_steps=obs.skip_steps,
        back_to=state.phase,
    )
    st = _replace(state, phase=Phase.OPERATOR_RESUME, resume_asked=asked, exit_code=None)
    ev = _ev(
        Kind.OPERATOR,
        Code.RESUME_ASKED,
        state.incident,
        action="resume",
        **_who(obs),
        checkpoint=obs.checkpoint,
    )
    return _Step(st, (_select(st, obs.checkpoint),), (ev,))


def _select(state: State, exact: str | None) -> SelectCheckpoint:
    """The human's checkpoint (verified, on the lineage), or the one a rollback of the held
    incident would take (the newest healthy), or, without one, the newest that verifies."""
    if exact is not None:
        return SelectCheckpoint(None, None, 0, state.lineage, True, exact=exact)
    if state.incident is not None:
        return _rollback_select(state, state.incident)
    return resume_choice(state, Settings())


@_on([Phase.OPERATOR_RESUME], CheckpointChosen)
def resumed(state: State, obs: CheckpointChosen) -> _Step:
    """The checkpoint of a human's resume verified: relaunch from it with their settings (the
    incident's probation follows, with its budget as it was: one more failure gives the run
    back to a human). Nothing verified: refuse, and wait (or stay escalated) as before."""
    asked = state.resume_asked
    assert asked is not None, "OPERATOR_RESUME always has the request"
    inc = state.incident
    if obs.path is None:
        back = _replace(state, phase=asked.back_to, resume_asked=None)
        why = "no checkpoint of this run verifies" if not obs.skipped else "it does not verify"
        code = ExitCode.ESCALATED if asked.back_to is Phase.ESCALATED else None
        back = _replace(back, exit_code=code)
        fields = {"skipped": [{"path": p, "reason": r} for p, r in obs.skipped]}
        refused = _ev(
            Kind.OPERATOR,
            Code.OPERATOR_REFUSED,
            inc,
            {"why": f"cannot resume: {why}"},
            action="resume",
            **_who_asked(asked),
            **fields,
        )
        effects = (Shutdown(ExitCode.ESCALATED),) if code is not None else ()
        return _Step(back, effects, (refused,))
    scale = state.lr_scale
    if asked.lr_scale is not None:
        scale = asked.lr_scale
    elif asked.lr_factor is not None:
        scale = state.lr_scale * asked.lr_factor
    skip = _carried(state.plan, after=obs.step or 0)
    if asked.skip_steps is not None:
        skip = _Skip((*skip.ranges, asked.skip_steps), skip.batches, skip.window)
    plan = _plan(state, obs, lr_scale=scale, reset_optimizer=asked.reset_optimizer, skip=skip)
    ev = _ev(
        Kind.OPERATOR,
        Code.OPERATOR_RESUMED,
        inc,
        action="resume",
        **_who_asked(asked),
        **_chosen(obs),
        lr_scale=scale,
        lr_scale_before=state.lr_scale,
        reset_optimizer=asked.reset_optimizer,
        skip_ranges=[list(r) for r in plan.skip_ranges],
        plan=plan.to_dict(),
    )
    st = _replace(
        state,
        phase=Phase.RELAUNCHING,
        plan=plan,
        lr_scale=scale,
        hold=None,
        resume_asked=None,
        exit_code=None,
        launch_failures=0,
        relaunch_cause="recovery" if inc is not None else "restart",
        resume_to=None if inc is not None else Phase.RUNNING,
    )
    return _Step(st, (Launch(plan),), (ev,))


def _who_asked(asked: ResumeAsked) -> dict[str, Any]:
    return {"who": asked.who, "via": asked.via, "note": asked.note, "request": asked.request}


@_on_restart(Phase.OPERATOR_RESUME)
def _restart_operator_resume(st: State, obs: Any) -> _Step:
    """A supervisor died while a human's checkpoint was verified: verify it again."""
    asked = st.resume_asked
    if asked is None:
        return _Step(_replace(st, phase=Phase.HOLDING))
    return _Step(st, (_select(st, asked.checkpoint),))


def _stop(state: State, obs: Operator) -> _Step:
    """A human's stop (a Slack button): said as theirs, then the stop itself."""
    if state.phase in TERMINAL:
        return _refuse(state, obs, f"the run has ended ({state.phase.value})")
    why = f"stopped by {obs.who} via {obs.via}" + (f": {obs.note}" if obs.note else "")
    asked = _ev(Kind.OPERATOR, Code.OPERATOR_STOP, state.incident, action="stop", **_who(obs))
    done = stop(state, StopRequested(why))
    return _replace(done, events=(asked, *done.events))


_ACTIONS = {"ack": _ack, "hold": _hold, "resume": _resume, "stop": _stop}
"""Each action's decision."""
