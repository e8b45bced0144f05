"""The describer: the prose ``reason`` of every event the recovery machine journals. Pure.

The machine's handlers decide and return typed :class:`~.events.MachineEvent` values; this module
words them, one function per (kind, code) in :data:`WORDING`, and :func:`to_record` turns an event
into the dict the journal records. Keeping the prose here keeps the handlers about the rules, and
gives every text one home: a kill's reason that repeats an event's (a stop, a failure, giving up)
is worded by the same function (:func:`kill_reason`), never copied.

The texts are part of the journal (humans and the console read them; programs read ``code``):
change one and the recorded runs in ``tests/data`` still replay (digests cover the state, not the
prose), but the journals written from then on read differently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .events import Code, Kind, MachineEvent

Values = Mapping[str, Any]
Wording = Callable[[Values, Values], str]
"""Words an event from its journaled ``fields`` and its unjournaled ``context``."""


# ---- why automatic recovery gives up (the escalated event, and the event that led to it) -------
def _too_many_incidents(f: Values, c: Values) -> str:
    return (
        f"this run has had {c['incidents']} incidents, more than max_incidents "
        f"{c['max_incidents']}: recovering again would not make it healthy"
    )


def _budget_spent(f: Values, c: Values) -> str:
    return f"recovery budget of {c['max_attempts']} attempts spent"


def _corrupt_checkpoint(f: Values, c: Values) -> str:
    return (
        f"checkpoint {c['corrupt']} failed verification and the policy does not fall back "
        "to older ones (recovery.fallback_on_corrupt: false)"
    )


def _no_healthy_checkpoint(f: Values, c: Values) -> str:
    if c.get("baseline") is not None:
        return (
            f"no checkpoint graded >= S{c['min_grade']}, nor >= S{c['baseline']} (this run's "
            f"baseline, the median of {c['baseline_of']} graded checkpoints), at least "
            f"{c['min_steps_back']} steps before step {c['step']} verifies"
        )
    return (
        f"no checkpoint graded >= S{c['min_grade']} at least {c['min_steps_back']} steps before "
        f"step {c['step']} verifies"
    )


def _recurring_fault(f: Values, c: Values) -> str:
    first, step = c["first_step"], c["step"]
    at = f"step {step}" if step == first else f"steps {first} and {step}"
    return (
        f"{c['rule']} recurred at {at} on consecutive attempts: the fault is deterministic "
        "at this step and another attempt would loop; failing fast"
    )


def _resume_checkpoint_gone(f: Values, c: Values) -> str:
    return (
        "supervisor restart: no healthy checkpoint to resume from (this generation "
        f"resumed from {c['checkpoint']}, which no longer verifies)"
    )


GIVING_UP: dict[Code, Wording] = {
    Code.TOO_MANY_INCIDENTS: _too_many_incidents,
    Code.BUDGET_SPENT: _budget_spent,
    Code.CORRUPT_CHECKPOINT: _corrupt_checkpoint,
    Code.NO_HEALTHY_CHECKPOINT: _no_healthy_checkpoint,
    Code.RECURRING_FAULT: _recurring_fault,
    Code.RESUME_CHECKPOINT_GONE: _resume_checkpoint_gone,
}
"""Why the machine escalates, by the escalated event's code."""


def _escalated(code: Code) -> Wording:
    """The escalated event: why it gives up, and whether it holds for a human."""

    def word(f: Values, c: Values) -> str:
        why = GIVING_UP[code](f, c)
        return f"{why}; holding for a human" if f["hold"] else why

    return word


# ---- the recovery sequence ---------------------------------------------------------------------
def _given(f: Values, c: Values) -> str:
    """A text that came with the observation (a policy rule's reason, a stop request's)."""
    given: str = c["reason"]
    return given


def _ranks_killed(f: Values, c: Values) -> str:
    how = ""
    if f["unreachable"]:
        how += f"; ranks {f['unreachable']} unreachable (fenced, reaped by pid when reachable)"
    if f["forced"]:
        how += f"; ranks {f['forced']} ignored SIGTERM and were SIGKILLed"
    return f"killed {len(f['ranks'])} ranks of generation {c['generation']}{how}"


def _restart_from_start(f: Values, c: Values) -> str:
    return (
        f"no checkpoint on this run's lineage at or before step {c['step']}"
        " verifies: a crash, a hang or a slow or failing node starts over from step 0"
    )


def _checkpoint_chosen(f: Values, c: Values) -> str:
    if c["fault"]:
        return f"newest checkpoint that verifies (any grade) at or before step {c['step']}"
    if f.get("grade_rule") == "ungraded":
        return (
            f"newest checkpoint before step {c['step']}: no checkpoint of this run is graded "
            "(its probes found no blocks), so the grade cannot judge"
        )
    if f.get("grade_rule") == "run baseline":
        return (
            f"newest checkpoint graded S{f['grade']} >= S{f['grade_bar']} before step "
            f"{c['step']}: none reaches S{c['min_grade']}, so healthy is this run's own baseline "
            f"(the median grade of its {f['baseline_of']} graded checkpoints)"
        )
    return f"newest checkpoint graded S{f['grade']} >= S{c['min_grade']} before step {c['step']}"


def _lr_cut(f: Values, c: Values) -> str:
    return f"LR x{f['factor']:g} on attempt {c['attempt']} (scale now {f['lr_scale']:.4g})"


def _relaunched(after: str) -> Wording:
    def word(f: Values, c: Values) -> str:
        return f"relaunched from step {c['start_step']}{after}"

    return word


def _probation_window(f: Values, c: Values) -> str:
    return f"{f['until_step'] - f['from_step']} steps must pass without another incident"


def _probation_progress(f: Values, c: Values) -> str:
    return (
        f"probation {c['tenths'] * 10}% done: step {f['step']} of "
        f"{f['from_step']}..{f['until_step']}"
    )


def _recover_in_probation(then: str = "") -> Wording:
    """The rule that fired in probation and its reason, then ``then`` (``{rule}``: its name)."""

    def word(f: Values, c: Values) -> str:
        return f"{f['rule']}: {c['reason']}" + then.format(rule=f["rule"])

    return word


def _same_step_other_value(f: Values, c: Values) -> str:
    return (
        f"{f['rule']}: {c['reason']}; at step {f['step']} (the last attempt fired at "
        f"{c['first_step']}) it measured {_value(f.get('value'))}, the last attempt "
        f"{_value(c['first_value'])}: not the same fault, so a new attempt, not a fail-fast"
    )


def _value(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _kind_of(fault: Any) -> str:
    return "a crash, a hang or a slow or failing node" if fault else "a numerical fault"


def _other_kind_in_probation(f: Values, c: Values) -> str:
    return (
        f"{f['rule']} ({_kind_of(f['fault'])}) at step {f['step']}, in the probation of "
        f"{c['incident_rule']} ({_kind_of(c['incident_fault'])}): {c['reason']}; it opens "
        "its own incident, recovered with its own rule's settings"
    )


def _probation_passed(text: str) -> Wording:
    """A probation that passed (``text``), and the LR cut it gives back, if any."""

    def word(f: Values, c: Values) -> str:
        if "lr_restored_from" not in f:
            return text
        return (
            f"{text}; the LR scale returns from {f['lr_restored_from']:.4g} to "
            f"{f['lr_scale']:.4g} over {f['lr_restore_steps']} steps from step "
            f"{f['lr_restore_from_step']}"
        )

    return word


def _optimizer_reset(f: Values, c: Values) -> str:
    text = "optimizer moments may carry the instability"
    if f.get("rewarm_steps"):
        return f"{text}; the LR re-warms over the first {f['rewarm_steps']} steps"
    return text


def _teardown_exit(f: Values, c: Values) -> str:
    return (
        f"rank {f['rank']} finished training, then exited with code {c['teardown_code']} "
        "during teardown; counted as finished"
    )


def _crash_without_rule(f: Values, c: Values) -> str:
    return (
        f"rank {f['rank']} exited with code {f['rank_exit_code']} and no policy rule recovers "
        "crashes"
    )


def _preemption(f: Values, c: Values) -> str:
    return f"{c['reason']}: asking the ranks for an emergency checkpoint"


def _preempted_after_checkpoint(f: Values, c: Values) -> str:
    return (
        f"preempted after an emergency checkpoint at step {f['checkpoint_step']}: "
        "the next submit of the job resumes from it"
    )


def _preempted_without_checkpoint(f: Values, c: Values) -> str:
    """Not training (nothing to save): the preemption's own reason; else the grace ran out, and
    the text names where the resume starts (the newest usable checkpoint, or step 0)."""
    given: str | None = c.get("reason")
    if given is not None:
        return given
    head = "preempted: no emergency checkpoint within the grace period"
    if f.get("resume_checkpoint") is None:
        return f"{head}; no checkpoint on this run's lineage yet: the next submit starts at step 0"
    return (
        f"{head}; the next submit resumes from the newest usable checkpoint, "
        f"step {f['resume_step']}"
    )


def _launch_retries_spent(f: Values, c: Values) -> str:
    return (
        f"{c['failures']} consecutive launch failures (at most {c['retries']} retried); "
        f"the last: {c['reason']}"
    )


def _launch_failed(f: Values, c: Values) -> str:
    return (
        f"{c['reason']}; retrying with a fresh port as generation {c['generation']} "
        f"(retry {f['failures']} of {f['retries_allowed']}, outside the incident budget)"
    )


def _resume_from_checkpoint(f: Values, c: Values) -> str:
    return (
        "supervisor restart: resuming from the newest healthy checkpoint "
        f"(step {f['checkpoint_step']}, S{f['grade']}) with LR scale {f['lr_scale']:.4g}"
    )


def _resume_after_preemption(f: Values, c: Values) -> str:
    return (
        "resuming a preempted run from its newest checkpoint "
        f"(step {f['checkpoint_step']}, S{f['grade']}) with LR scale {f['lr_scale']:.4g}"
    )


# ---- a human's hand (``operator`` events) -------------------------------------------------------
def _by(f: Values) -> str:
    """``by alice@host (cli): why`` for an operator event."""
    why = f": {f['note']}" if f.get("note") else ""
    return f"by {f['who']} ({f['via']}){why}"


def _acknowledged(f: Values, c: Values) -> str:
    return f"acknowledged {_by(f)}; its reminders stop"


def _hold_set(f: Values, c: Values) -> str:
    return (
        f"automatic recovery put on hold {_by(f)}: the next recover decision kills the ranks "
        "and waits for spikeguard resume"
    )


def _hold_released(f: Values, c: Values) -> str:
    return f"hold lifted {_by(f)}: automatic recovery is back on"


def _recovery_held(f: Values, c: Values) -> str:
    return (
        f"{c['rule']} fired while recovery is on hold (set by {f['who']}): the ranks are killed "
        "and the run waits for a human (spikeguard resume RUN_DIR)"
    )


def _operator_resumed(f: Values, c: Values) -> str:
    where = (
        f"from the checkpoint of step {f['checkpoint_step']}"
        if f.get("checkpoint_path")
        else "from step 0"
    )
    what = [f"LR scale {f['lr_scale']:.4g}"]
    if f["lr_scale"] != f["lr_scale_before"]:
        what[0] += f" (was {f['lr_scale_before']:.4g})"
    if f.get("reset_optimizer"):
        what.append("optimizer reset")
    if f.get("skip_ranges"):
        what.append("skipping steps " + ", ".join(f"{a}-{b}" for a, b in f["skip_ranges"]))
    return f"resumed {_by(f)} {where}, {', '.join(what)}"


def _resume_asked(f: Values, c: Values) -> str:
    which = f.get("checkpoint") or "the newest healthy checkpoint"
    return f"resume asked {_by(f)}: verifying {which}"


def _operator_refused(f: Values, c: Values) -> str:
    return f"{f['action']} {_by(f)} refused: {c['why']}"


def _operator_stop(f: Values, c: Values) -> str:
    return f"stop asked {_by(f)}"


def _node_excluded(what: str) -> Wording:
    def word(f: Values, c: Values) -> str:
        return (
            f"node {f['node_id'][:12]} (rank {f['rank']}, generation {f['generation']}) {what}: "
            f"{c['reason']}; later launches are placed without it"
        )

    return word


def _exclusion_unplaceable(f: Values, c: Values) -> str:
    return (
        f"generation {f['generation']} could not be placed without the excluded nodes "
        f"({len(f['excluded'])}): {c['why']}; placed where it could, on them too"
    )


def _fixed(text: str) -> Wording:
    def word(f: Values, c: Values) -> str:
        return text

    return word


WORDING: dict[tuple[Kind, Code], Wording] = {
    (Kind.INCIDENT, Code.RULE_FIRED): _given,
    (Kind.KILL, Code.RANKS_KILLED): _ranks_killed,
    (Kind.ROLLBACK, Code.RESTART_FROM_START): _restart_from_start,
    (Kind.ROLLBACK, Code.CHECKPOINT_CHOSEN): _checkpoint_chosen,
    (Kind.ROLLBACK, Code.CORRUPT_CHECKPOINT): _corrupt_checkpoint,
    (Kind.ROLLBACK, Code.NO_HEALTHY_CHECKPOINT): _no_healthy_checkpoint,
    (Kind.LR_CUT, Code.LR_CUT): _lr_cut,
    (Kind.OPTIMIZER_RESET, Code.OPTIMIZER_RESET): _optimizer_reset,
    (Kind.LAUNCH, Code.INITIAL_LAUNCH): _fixed("initial launch"),
    (Kind.LAUNCH, Code.RELAUNCH_AFTER_ROLLBACK): _relaunched(""),
    (Kind.LAUNCH, Code.RELAUNCH_AFTER_LAUNCH_FAILURE): _relaunched(" after a launch failure"),
    (Kind.LAUNCH, Code.RELAUNCH_AFTER_RESTART): _relaunched(" after a supervisor restart"),
    (Kind.PROBATION_START, Code.PROBATION_WINDOW): _probation_window,
    (Kind.PROBATION_PROGRESS, Code.PROBATION_PROGRESS): _probation_progress,
    (Kind.PROBATION_PASSED, Code.WINDOW_PASSED): _probation_passed(
        "no second incident in the probation window"
    ),
    (Kind.PROBATION_PASSED, Code.FINISHED_IN_PROBATION): _probation_passed(
        "training finished inside the probation window without a second incident"
    ),
    (Kind.PROBATION_FAILED, Code.RECOVER_IN_PROBATION): _recover_in_probation(),
    (Kind.PROBATION_FAILED, Code.OTHER_RULE_IN_PROBATION): _recover_in_probation(
        "; the next attempt uses {rule}'s recovery settings"
    ),
    (Kind.PROBATION_FAILED, Code.SAME_STEP_OTHER_VALUE): _same_step_other_value,
    (Kind.PROBATION_SUPERSEDED, Code.OTHER_KIND_IN_PROBATION): _other_kind_in_probation,
    (Kind.COMPLETED, Code.ALL_RANKS_FINISHED): _fixed("all ranks finished"),
    (Kind.STOPPED, Code.STOP_REQUESTED): _given,
    (Kind.ALERT, Code.TEARDOWN_EXIT): _teardown_exit,
    (Kind.ALERT, Code.RULE_NOTIFY): _given,
    (Kind.ALERT, Code.RULE_RESOLVED): _given,
    (Kind.ALERT, Code.CHECKPOINT_REQUESTED): _given,
    (Kind.ALERT, Code.PREEMPTION): _preemption,
    (Kind.FAILED, Code.CRASH_WITHOUT_RULE): _crash_without_rule,
    (Kind.FAILED, Code.LAUNCH_RETRIES_SPENT): _launch_retries_spent,
    (Kind.PREEMPTED, Code.PREEMPTED_AFTER_CHECKPOINT): _preempted_after_checkpoint,
    (Kind.PREEMPTED, Code.PREEMPTED_WITHOUT_CHECKPOINT): _preempted_without_checkpoint,
    (Kind.LAUNCH_FAILED, Code.LAUNCH_RETRIES_SPENT): _given,
    (Kind.LAUNCH_FAILED, Code.LAUNCH_FAILED): _launch_failed,
    (Kind.RESUME, Code.RESUME_FROM_START): _fixed(
        "supervisor restart: no checkpoint yet on this run's lineage; starting over from step 0"
    ),
    (Kind.RESUME, Code.RESUME_FROM_CHECKPOINT): _resume_from_checkpoint,
    (Kind.RESUME, Code.RESUME_AFTER_PREEMPTION): _resume_after_preemption,
    (Kind.RESUME, Code.RESUME_CHECKPOINT_GONE): _resume_checkpoint_gone,
    **{(Kind.ESCALATED, code): _escalated(code) for code in GIVING_UP},
    (Kind.OPERATOR, Code.ACKNOWLEDGED): _acknowledged,
    (Kind.OPERATOR, Code.HOLD_SET): _hold_set,
    (Kind.OPERATOR, Code.HOLD_RELEASED): _hold_released,
    (Kind.OPERATOR, Code.RECOVERY_HELD): _recovery_held,
    (Kind.OPERATOR, Code.RESUME_ASKED): _resume_asked,
    (Kind.OPERATOR, Code.OPERATOR_RESUMED): _operator_resumed,
    (Kind.OPERATOR, Code.OPERATOR_REFUSED): _operator_refused,
    (Kind.OPERATOR, Code.OPERATOR_STOP): _operator_stop,
    (Kind.NODE_EXCLUDED, Code.NODE_LOST): _node_excluded("was lost"),
    (Kind.NODE_EXCLUDED, Code.NODE_UNHEALTHY): _node_excluded("failed a health check"),
    (Kind.NODE_EXCLUDED, Code.NODE_STRAGGLER): _node_excluded("straggled"),
    (Kind.NODE_EXCLUDED, Code.EXCLUSION_UNPLACEABLE): _exclusion_unplaceable,
}
"""The prose of every event the machine journals, by (kind, code)."""


def describe(event: MachineEvent) -> str:
    """The event's prose ``reason``."""
    return WORDING[(event.kind, event.code)](event.fields, event.context)


def to_record(event: MachineEvent) -> dict[str, Any]:
    """The dict the journal records for ``event`` (kind, code, reason, incident, its fields)."""
    return {
        "kind": event.kind.value,
        "code": event.code.value,
        "reason": describe(event),
        "incident": event.incident,
        **event.fields,
    }


def kill_reason(event: MachineEvent) -> str:
    """Why the ranks are killed when the machine ends the run with ``event`` (a stop, a failure,
    a preemption, giving up): the event's own text (a hold: the reason, then "holding")."""
    if event.kind is Kind.ESCALATED:
        why = GIVING_UP[event.code](event.fields, event.context)
        return f"{why}; holding" if event.fields["hold"] else why
    return describe(event)


# ---- texts of effects and observations that no event repeats -----------------------------------
def kill_for_incident(incident: str, rule: str) -> str:
    """A :class:`~.recovery.model.Kill`'s reason when an incident kills the generation."""
    return f"incident {incident}: {rule}"


def kill_after_launch_failure(reason: str) -> str:
    """The kill of what a failed launch left running."""
    return f"launch failure: {reason}"


def kill_on_preemption() -> str:
    """The kill of a preemption whose grace period ran out (before the checkpoint to resume from
    is chosen, so nothing is written after the choice)."""
    return "preempted: no emergency checkpoint within the grace period"


def kill_on_restart(incident: str) -> str:
    """A restarted supervisor finishing the kill the journal shows unfinished."""
    return f"supervisor restart: finishing the kill of {incident}"


def checkpoint_request(rule: Any) -> str:
    """Why a ``checkpoint`` rule asks the ranks for a checkpoint."""
    return f"policy: {rule}"


def exit_before_heartbeat(rank: int, code: int, lost: Any) -> str:
    """A rank that died before its first message (the launch failure's reason)."""
    why = f"rank {rank} exited with code {code} before its first heartbeat"
    return f"{why} (agent lost: {lost})" if lost else why
