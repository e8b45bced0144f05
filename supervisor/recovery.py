"""The recovery state machine: states are data, ``step()`` returns the next one.

No Ray, no I/O, no clocks. The controller feeds it one observation at a
time and carries out the effects it asks for; every transition also returns
the journal events that explain it (with a reason), so the journal is the
complete story of a run, and :func:`fold` rebuilds the state from it (what a
restarted supervisor does). The data types live in :mod:`.recovery_model`.

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
                                                        budget lasts, else ESCALATED;
                                                        the same rule at the same step
                                                        again: ESCALATED at once

Around it: a rank exiting non-zero before its first heartbeat is a *launch
failure* (``launch_failed``; relaunched with a fresh port, a new generation
and backoff, outside the incident budget, at most ``retries_allowed`` times
in a row); a restarted supervisor (:class:`Restarted`) finishes whatever step
the journal shows unfinished, or resumes a running generation from the newest
healthy checkpoint (``resume``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from spikeguard.workers.contract.exitcodes import ExitCode

from .recovery_model import *  # noqa: F403  (the public names of the machine)
from .recovery_model import (
    RECUR_WINDOW_STEPS,
    TERMINAL,
    CheckpointChosen,
    Event,
    Failed,
    Finished,
    Incident,
    Kill,
    Killed,
    Launch,
    Launched,
    LaunchFailed,
    Observation,
    Phase,
    Progress,
    Recover,
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
)

_replace = dataclasses.replace


def _ev(kind: str, reason: str, incident: Incident | None, **fields: Any) -> Event:
    return {"kind": kind, "reason": reason, "incident": incident.id if incident else None, **fields}


def plan_dict(plan: ResumePlan) -> dict[str, Any]:
    d = dataclasses.asdict(plan)
    d["skip_ranges"] = [list(r) for r in plan.skip_ranges]
    return d


def plan_from(d: Any) -> ResumePlan | None:
    if not isinstance(d, dict):
        return None
    names = {f.name for f in dataclasses.fields(ResumePlan)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["skip_ranges"] = tuple((int(a), int(b)) for a, b in kw.get("skip_ranges") or ())
    return ResumePlan(**kw)


def step(state: State, obs: Observation) -> Transition:
    """Return the next state, the effects to carry out and the events to journal."""
    p = state.phase
    if p in TERMINAL:
        return Transition(state)
    if isinstance(obs, StopRequested):
        return Transition(
            _replace(state, phase=Phase.STOPPED, exit_code=ExitCode.STOPPED),
            (Kill(obs.reason), Shutdown(ExitCode.STOPPED)),
            (_ev("stopped", obs.reason, state.incident),),
        )
    if isinstance(obs, Failed) and p is not Phase.KILLING:
        return Transition(
            _replace(state, phase=Phase.FAILED, exit_code=obs.exit_code),
            (Kill(obs.reason), Shutdown(obs.exit_code)),
            (_ev("failed", obs.reason, state.incident, exit_code=obs.exit_code, **obs.details),),
        )
    if isinstance(obs, Restarted):
        return _on_restart(state, obs)
    if p is Phase.STARTING and isinstance(obs, Start):
        plan = ResumePlan(generation=next_generation(state), lr_scale=state.lr_scale)
        return Transition(
            _replace(
                state,
                phase=Phase.RELAUNCHING,
                plan=plan,
                relaunch_cause="initial",
                resume_to=Phase.RUNNING,
                launch_failures=0,
            ),
            (Launch(plan),),
        )
    if p is Phase.STARTING and isinstance(obs, Launched):
        return _launched(
            _replace(state, plan=state.plan or ResumePlan(generation=obs.generation)),
            obs,
            "initial",
        )
    if p in (Phase.RUNNING, Phase.PROBATION) and isinstance(obs, Recover):
        return _on_recover(state, obs)
    if p in (Phase.RUNNING, Phase.PROBATION, Phase.RELAUNCHING) and isinstance(obs, LaunchFailed):
        return _on_launch_failed(state, obs)
    if (
        p is Phase.PROBATION
        and isinstance(obs, Progress)
        and obs.step >= (state.probation_until or 0)
    ):
        return _probation_passed(state, obs.step, "no second incident in the probation window")
    if p in (Phase.RUNNING, Phase.PROBATION) and isinstance(obs, Finished):
        events: tuple[Event, ...] = ()
        if p is Phase.PROBATION:
            events = _probation_passed(
                state,
                None,
                "training finished inside the probation window without a second incident",
            ).events
        return Transition(
            _replace(
                state,
                phase=Phase.COMPLETED,
                incident=None,
                exit_code=ExitCode.COMPLETED,
                probation_from=None,
                probation_until=None,
            ),
            (Shutdown(ExitCode.COMPLETED),),
            events + (_ev("completed", "all ranks finished", None, final_loss=obs.final_loss),),
        )
    if p is Phase.KILLING and isinstance(obs, Killed):
        inc = state.incident
        assert inc is not None
        s = inc.settings
        how = ""
        if obs.unreachable:
            how += f"; ranks {list(obs.unreachable)} unreachable (fenced, reaped by pid when reachable)"
        if obs.forced:
            how += f"; ranks {list(obs.forced)} ignored SIGTERM and were SIGKILLed"
        return Transition(
            _replace(state, phase=Phase.ROLLING_BACK),
            (SelectCheckpoint(s.min_grade, inc.step, s.min_steps_back),),
            (
                _ev(
                    "kill",
                    f"killed {len(obs.ranks)} ranks of generation {state.generation}{how}",
                    inc,
                    ranks=list(obs.ranks),
                    duration_s=round(obs.duration_s, 3),
                    forced=list(obs.forced),
                    unreachable=list(obs.unreachable),
                ),
            ),
        )
    if p is Phase.ROLLING_BACK and isinstance(obs, CheckpointChosen):
        return _on_checkpoint(state, obs)
    if p is Phase.RESUMING and isinstance(obs, CheckpointChosen):
        return _on_resume_checkpoint(state, obs)
    if p is Phase.RELAUNCHING and isinstance(obs, Launched):
        return _launched(state, obs, state.relaunch_cause or "recovery")
    return Transition(state)  # the observation does not apply in this phase


def _launched(state: State, obs: Launched, cause: str) -> Transition:
    plan = state.plan or ResumePlan(generation=obs.generation)
    inc = state.incident
    start = start_step(plan)
    fields = dict(
        generation=obs.generation,
        lr_scale=state.lr_scale,
        cause=cause,
        plan=plan_dict(plan),
        port=obs.port,
        backoff_s=round(obs.backoff_s, 3),
        pids=[r.get("pid") for r in obs.ranks],
        ranks=[dict(r) for r in obs.ranks],
    )
    st = _replace(
        state,
        generation=obs.generation,
        max_generation=max(state.max_generation, obs.generation),
        plan=plan,
        relaunch_cause=None,
        resume_to=None,
    )
    if cause == "recovery":
        assert inc is not None
        until = start + inc.settings.probation_steps
        st = _replace(st, phase=Phase.PROBATION, probation_from=start, probation_until=until)
        return Transition(
            st,
            events=(
                _ev("launch", f"relaunched from step {start}", inc, **fields),
                _ev(
                    "probation_start",
                    f"{until - start} steps must pass without another incident",
                    inc,
                    from_step=start,
                    until_step=until,
                ),
            ),
        )
    if cause == "initial":
        return Transition(
            _replace(st, phase=Phase.RUNNING),
            events=(_ev("launch", "initial launch", None, **fields),),
        )
    why = "after a launch failure" if cause == "launch_retry" else "after a supervisor restart"
    return Transition(
        _replace(st, phase=state.resume_to or Phase.RUNNING),
        events=(_ev("launch", f"relaunched from step {start} {why}", inc, **fields),),
    )


def _on_recover(state: State, obs: Recover) -> Transition:
    inc = state.incident
    events: list[Event] = []
    if state.phase is Phase.PROBATION and inc is not None:
        events.append(
            _ev("probation_failed", f"{obs.rule}: {obs.reason}", inc, step=obs.step, rule=obs.rule)
        )
        if obs.rule == inc.rule and abs(obs.step - inc.step) <= RECUR_WINDOW_STEPS:
            at = f"step {obs.step}" if obs.step == inc.step else f"steps {inc.step} and {obs.step}"
            why = (
                f"{obs.rule} recurred at {at} on consecutive attempts: the fault is deterministic "
                "at this step and another attempt would loop; failing fast"
            )
            return _give_up(state, inc, events, why, fail_fast=True)
        if inc.attempts >= inc.settings.max_attempts:
            return _give_up(
                state, inc, events, f"recovery budget of {inc.settings.max_attempts} attempts spent"
            )
        inc = _replace(inc, rule=obs.rule, reason=obs.reason, step=obs.step)
    else:
        n = state.incidents_seen + 1
        inc = Incident(
            id=f"inc-{n:03d}",
            rule=obs.rule,
            reason=obs.reason,
            step=obs.step,
            settings=obs.settings,
        )
        state = _replace(state, incidents_seen=n)
        if n > inc.settings.max_incidents:
            events.append(
                _ev(
                    "incident",
                    obs.reason,
                    inc,
                    rule=obs.rule,
                    step=obs.step,
                    settings=inc.settings.to_dict(),
                    **obs.details,
                )
            )
            return _give_up(
                state,
                inc,
                events,
                f"this run has had {n} incidents, more than max_incidents "
                f"{inc.settings.max_incidents}: recovering again would not make it healthy",
            )
        if inc.settings.max_attempts < 1:
            events.append(
                _ev(
                    "incident",
                    obs.reason,
                    inc,
                    rule=obs.rule,
                    step=obs.step,
                    settings=inc.settings.to_dict(),
                    **obs.details,
                )
            )
            return _give_up(
                state, inc, events, f"recovery budget of {inc.settings.max_attempts} attempts spent"
            )
    events.append(
        _ev(
            "incident",
            obs.reason,
            inc,
            rule=obs.rule,
            step=obs.step,
            attempt=inc.attempts + 1,
            settings=inc.settings.to_dict(),
            **obs.details,
        )
    )
    st = _replace(state, phase=Phase.KILLING, incident=inc)
    return Transition(st, (Kill(f"incident {inc.id}: {obs.rule}"),), tuple(events))


def _give_up(
    state: State, inc: Incident, events: list[Event], why: str, fail_fast: bool = False
) -> Transition:
    extra = {"fail_fast": True} if fail_fast else {}
    if inc.settings.on_exhausted == "hold":
        events.append(_ev("escalated", f"{why}; holding for a human", inc, hold=True, **extra))
        return Transition(
            _replace(state, phase=Phase.HOLDING, incident=inc),
            (Kill(f"{why}; holding"),),
            tuple(events),
        )
    events.append(_ev("escalated", why, inc, hold=False, **extra))
    return Transition(
        _replace(state, phase=Phase.ESCALATED, incident=inc, exit_code=ExitCode.ESCALATED),
        (Kill(why), Shutdown(ExitCode.ESCALATED)),
        tuple(events),
    )


def _on_launch_failed(state: State, obs: LaunchFailed) -> Transition:
    n = state.launch_failures + 1
    failed_gen = (
        state.plan.generation
        if state.phase is Phase.RELAUNCHING and state.plan
        else state.generation
    )
    fields = dict(
        generation=failed_gen,
        rank=obs.rank,
        exit_code=obs.exit_code,
        failures=n,
        retries_allowed=obs.retries_allowed,
        **obs.details,
    )
    if n > obs.retries_allowed:
        why = f"{n} consecutive launch failures (at most {obs.retries_allowed} retried); the last: {obs.reason}"
        return Transition(
            _replace(
                state,
                phase=Phase.FAILED,
                exit_code=ExitCode.FAILED,
                launch_failures=n,
                max_generation=max(state.max_generation, failed_gen),
            ),
            (Kill(why), Shutdown(ExitCode.FAILED)),
            (
                _ev("launch_failed", obs.reason, state.incident, gave_up=True, **fields),
                _ev(
                    "failed",
                    why,
                    state.incident,
                    exit_code=ExitCode.FAILED,
                    rank_exit_code=obs.exit_code,
                ),
            ),
        )
    relaunching = state.phase is Phase.RELAUNCHING
    st = _replace(state, max_generation=max(state.max_generation, failed_gen))
    plan = _replace(
        state.plan or ResumePlan(lr_scale=state.lr_scale), generation=next_generation(st)
    )
    st = _replace(
        st,
        phase=Phase.RELAUNCHING,
        plan=plan,
        launch_failures=n,
        relaunch_cause=state.relaunch_cause if relaunching else "launch_retry",
        resume_to=state.resume_to if relaunching else state.phase,
    )
    return Transition(
        st,
        (Kill(f"launch failure: {obs.reason}"), Launch(plan, backoff_attempt=n)),
        (
            _ev(
                "launch_failed",
                f"{obs.reason}; retrying with a fresh port as generation "
                f"{plan.generation} (retry {n} of {obs.retries_allowed}, outside the incident budget)",
                state.incident,
                plan=plan_dict(plan),
                **fields,
            ),
        ),
    )


def _on_checkpoint(state: State, obs: CheckpointChosen) -> Transition:
    inc = state.incident
    assert inc is not None
    s = inc.settings
    skipped = [{"path": p, "reason": r} for p, r in obs.skipped]
    if obs.path is None:
        why = (
            f"no checkpoint graded >= S{s.min_grade} at least {s.min_steps_back} steps before "
            f"step {inc.step} verifies"
        )
        events = (
            _ev("rollback", why, inc, checkpoint_step=None, checkpoint_path=None, skipped=skipped),
            _ev("escalated", why, inc, hold=False),
        )
        return Transition(
            _replace(state, phase=Phase.ESCALATED, exit_code=ExitCode.ESCALATED),
            (Shutdown(ExitCode.ESCALATED),),
            events,
        )
    factor = lr_factor(s, inc.attempts)
    scale = state.lr_scale * factor
    skip: tuple[tuple[int, int], ...] = ()
    if s.skip_window > 0:
        skip = ((max(inc.step - s.skip_window + 1, (obs.step or 0) + 1), inc.step),)
    plan = ResumePlan(
        checkpoint=obs.path,
        checkpoint_step=obs.step,
        sha256=obs.sha256,
        lr_scale=scale,
        reset_optimizer=s.reset_optimizer,
        skip_ranges=skip,
        generation=next_generation(state),
    )
    inc = _replace(inc, attempts=inc.attempts + 1)
    events: list[Event] = [
        _ev(
            "rollback",
            f"newest checkpoint graded S{obs.grade} >= S{s.min_grade} before step {inc.step}",
            inc,
            checkpoint_step=obs.step,
            checkpoint_path=obs.path,
            grade=obs.grade,
            skipped=skipped,
            skip_ranges=[list(r) for r in skip],
            attempt=inc.attempts,
            plan=plan_dict(plan),
        ),
        _ev(
            "lr_cut",
            f"LR x{factor:g} on attempt {inc.attempts} (scale now {scale:.4g})",
            inc,
            factor=factor,
            lr_scale=scale,
        ),
    ]
    if s.reset_optimizer:
        events.append(_ev("optimizer_reset", "optimizer moments may carry the instability", inc))
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
    return Transition(st, (Launch(plan, backoff_attempt=inc.attempts),), tuple(events))


def _probation_passed(state: State, at_step: int | None, why: str) -> Transition:
    inc = state.incident
    ev = _ev("probation_passed", why, inc, step=at_step, lr_scale=state.lr_scale)
    st = _replace(
        state, phase=Phase.RUNNING, incident=None, probation_from=None, probation_until=None
    )
    return Transition(st, events=(ev,))


# ---- a restarted supervisor ------------------------------------------------------------------
def _on_restart(state: State, obs: Restarted) -> Transition:
    st = _replace(state, max_generation=max(state.max_generation, obs.highest_generation))
    p, inc = st.phase, st.incident
    if p is Phase.STARTING:
        return step(st, Start())
    if p in (Phase.RUNNING, Phase.PROBATION, Phase.RESUMING):
        back = st.resume_to if p is Phase.RESUMING else p
        s = inc.settings if inc is not None else obs.settings
        return Transition(
            _replace(st, phase=Phase.RESUMING, resume_to=back or Phase.RUNNING),
            (SelectCheckpoint(s.min_grade, None, 0),),
        )
    if p is Phase.KILLING and inc is not None:
        return Transition(st, (Kill(f"supervisor restart: finishing the kill of {inc.id}"),))
    if p is Phase.ROLLING_BACK and inc is not None:
        s = inc.settings
        return Transition(st, (SelectCheckpoint(s.min_grade, inc.step, s.min_steps_back),))
    if p is Phase.RELAUNCHING and st.plan is not None:
        plan = st.plan
        if (
            plan.generation <= st.max_generation
        ):  # that launch may have begun: never reuse its number
            plan = _replace(plan, generation=st.max_generation + 1)
        return Transition(_replace(st, plan=plan), (Launch(plan),))
    return Transition(st)  # HOLDING: the ranks are dead, a human decides


def _on_resume_checkpoint(state: State, obs: CheckpointChosen) -> Transition:
    old, inc = state.plan, state.incident
    gen = next_generation(state)
    skipped = [{"path": p, "reason": r} for p, r in obs.skipped]
    back = (state.resume_to or Phase.RUNNING).value
    if obs.path is None:
        if old is not None and old.checkpoint is not None:
            why = (
                f"supervisor restart: no healthy checkpoint to resume from (this generation resumed from "
                f"{old.checkpoint}, which no longer verifies)"
            )
            return Transition(
                _replace(state, phase=Phase.ESCALATED, exit_code=ExitCode.ESCALATED),
                (Shutdown(ExitCode.ESCALATED),),
                (
                    _ev(
                        "resume",
                        why,
                        inc,
                        checkpoint_step=None,
                        checkpoint_path=None,
                        skipped=skipped,
                        resume_to=back,
                    ),
                    _ev("escalated", why, inc, hold=False),
                ),
            )
        plan = ResumePlan(
            lr_scale=state.lr_scale, skip_ranges=old.skip_ranges if old else (), generation=gen
        )
        why = (
            "supervisor restart: no checkpoint yet on this run's lineage; starting over from step 0"
        )
    else:
        reset = bool(old is not None and old.reset_optimizer and old.checkpoint == obs.path)
        skips = tuple(r for r in (old.skip_ranges if old else ()) if r[1] > (obs.step or 0))
        plan = ResumePlan(
            checkpoint=obs.path,
            checkpoint_step=obs.step,
            sha256=obs.sha256,
            lr_scale=state.lr_scale,
            reset_optimizer=reset,
            skip_ranges=skips,
            generation=gen,
        )
        why = (
            f"supervisor restart: resuming from the newest healthy checkpoint (step {obs.step}, S{obs.grade}) "
            f"with LR scale {state.lr_scale:.4g}"
        )
    ev = _ev(
        "resume",
        why,
        inc,
        checkpoint_step=obs.step,
        checkpoint_path=obs.path,
        grade=obs.grade,
        skipped=skipped,
        lr_scale=state.lr_scale,
        resume_to=back,
        plan=plan_dict(plan),
    )
    st = _replace(
        state, phase=Phase.RELAUNCHING, plan=plan, relaunch_cause="restart", launch_failures=0
    )
    return Transition(st, (Launch(plan),), (ev,))


# ---- the journal -> state fold -----------------------------------------------------------------
def fold(events: Iterable[dict[str, Any]]) -> State:
    """The machine's state after the journaled ``events`` (what a restarted supervisor starts from).

    Pure. The first event of every transition carries what the next state needs, so a journal cut
    anywhere (the supervisor died between two appends) folds to a state the machine can continue from.
    """
    s = State()
    for ev in events:
        k, inc = ev.get("kind"), s.incident
        if k == "launch":
            gen = int(ev.get("generation") or 0)
            plan = plan_from(ev.get("plan")) or s.plan or ResumePlan(generation=gen)
            cause = ev.get("cause") or ("initial" if s.phase is Phase.STARTING else "recovery")
            s = _replace(
                s,
                generation=gen,
                max_generation=max(s.max_generation, gen),
                plan=plan,
                lr_scale=float(ev.get("lr_scale", s.lr_scale)),
                relaunch_cause=None,
                resume_to=None,
                phase=(
                    Phase.RUNNING
                    if cause == "initial"
                    else Phase.PROBATION
                    if cause == "recovery"
                    else s.resume_to or Phase.RUNNING
                ),
            )
            if cause == "recovery" and inc is not None:
                start = start_step(plan)
                s = _replace(
                    s, probation_from=start, probation_until=start + inc.settings.probation_steps
                )
        elif k == "incident":
            num = str(ev.get("incident") or "inc-0").rpartition("-")[2]
            n = int(num) if num.isdigit() else s.incidents_seen + 1
            new = Incident(
                id=str(ev.get("incident")),
                rule=str(ev.get("rule")),
                reason=str(ev.get("reason", "")),
                step=int(ev.get("step") or 0),
                settings=Settings.from_dict(ev.get("settings")),
                attempts=max(int(ev.get("attempt") or 1) - 1, 0),
            )
            s = _replace(
                s, phase=Phase.KILLING, incident=new, incidents_seen=max(s.incidents_seen, n)
            )
        elif k == "kill" and s.phase is Phase.KILLING:
            s = _replace(s, phase=Phase.ROLLING_BACK)
        elif k == "rollback" and ev.get("checkpoint_path") and inc is not None:
            plan = plan_from(ev.get("plan"))
            s = _replace(
                s,
                phase=Phase.RELAUNCHING,
                incident=_replace(inc, attempts=inc.attempts + 1),
                plan=plan or s.plan,
                lr_scale=plan.lr_scale if plan else s.lr_scale,
                launch_failures=0,
                relaunch_cause="recovery",
                resume_to=None,
            )
        elif k == "lr_cut":
            s = _replace(s, lr_scale=float(ev.get("lr_scale", s.lr_scale)))
        elif k == "probation_start":
            s = _replace(
                s,
                phase=Phase.PROBATION,
                probation_from=ev.get("from_step"),
                probation_until=ev.get("until_step"),
            )
        elif k == "probation_passed":
            s = _replace(
                s, phase=Phase.RUNNING, incident=None, probation_from=None, probation_until=None
            )
        elif k == "escalated":
            s = (
                _replace(s, phase=Phase.HOLDING)
                if ev.get("hold")
                else _replace(s, phase=Phase.ESCALATED, exit_code=ExitCode.ESCALATED)
            )
        elif k == "completed":
            s = _replace(s, phase=Phase.COMPLETED, incident=None, exit_code=ExitCode.COMPLETED)
        elif k == "failed":
            s = _replace(s, phase=Phase.FAILED, exit_code=int(ev.get("exit_code") or 1))
        elif k == "stopped":
            s = _replace(s, phase=Phase.STOPPED, exit_code=ExitCode.STOPPED)
        elif k == "launch_failed":
            s = _fold_launch_failed(s, ev)
        elif k == "resume":
            plan = plan_from(ev.get("plan"))
            if plan is not None:
                s = _replace(
                    s,
                    phase=Phase.RELAUNCHING,
                    plan=plan,
                    relaunch_cause="restart",
                    launch_failures=0,
                    resume_to=Phase(ev.get("resume_to") or "RUNNING"),
                )
    return s


def _fold_launch_failed(s: State, ev: dict[str, Any]) -> State:
    failed_gen = int(ev.get("generation") or 0)
    s = _replace(
        s,
        launch_failures=int(ev.get("failures") or s.launch_failures + 1),
        max_generation=max(s.max_generation, failed_gen),
    )
    plan = plan_from(ev.get("plan"))
    if ev.get("gave_up") or plan is None:
        return s  # ``failed`` follows
    relaunching = s.phase is Phase.RELAUNCHING
    return _replace(
        s,
        phase=Phase.RELAUNCHING,
        plan=plan,
        relaunch_cause=s.relaunch_cause if relaunching else "launch_retry",
        resume_to=s.resume_to if relaunching else s.phase,
    )


def lineage(events: Iterable[dict[str, Any]]) -> list[tuple[int, int | None]]:
    """(generation, step it branched from) for every journaled launch, oldest first."""
    out: list[tuple[int, int | None]] = []
    for ev in events:
        if ev.get("kind") == "launch":
            plan = plan_from(ev.get("plan"))
            out.append((int(ev.get("generation") or 0), plan.checkpoint_step if plan else None))
    return out
