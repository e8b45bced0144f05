"""The journal's vocabulary: every event kind, every reason code, and what a kind means to a reader.

The journal (``RUN_DIR/journal.jsonl``) is an append-only table of events. Each has a ``kind``
(:class:`Kind`), a prose ``reason`` for humans, and, when the recovery machine wrote it, a
``code`` (:class:`Code`) for programs: ``status``, the console, Slack and the metrics read codes,
never prose. Everything a reader derives from the journal (the phase of an incident thread, the
story the console prints) is a fold over these events using the tables below, so the recovery
story is encoded once, in :mod:`.recovery`, and described once, here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any


class Kind(str, enum.Enum):
    """What an event records. The first group is the recovery story, the second bookkeeping."""

    LAUNCH = "launch"
    """A generation of ranks was started (initial, after a recovery, a launch failure, a
    restart)."""
    INCIDENT = "incident"
    """A rule decided to recover (or an incident escalated at once): the rule, signal, rank,
    step."""
    KILL = "kill"
    """Every rank of the generation was killed; the generation is fenced."""
    ROLLBACK = "rollback"
    """The checkpoint to resume from was chosen (or none qualified), with what was skipped and
    why."""
    LR_CUT = "lr_cut"
    """The learning-rate scale was multiplied by the attempt's factor."""
    OPTIMIZER_RESET = "optimizer_reset"
    """The next generation starts with fresh optimizer state."""
    PROBATION_START = "probation_start"
    """The relaunched generation must train this many steps without another recover decision."""
    PROBATION_PROGRESS = "probation_progress"
    """How far the probation window is (periodic; optional)."""
    PROBATION_PASSED = "probation_passed"
    """The window passed: the incident is resolved."""
    PROBATION_FAILED = "probation_failed"
    """Another recover decision inside the window: the attempt failed."""
    PROBATION_SUPERSEDED = "probation_superseded"
    """A fault of the other kind inside the window (a divergence in a crash's probation, a crash
    in a divergence's): the incident ends, and the fault opens its own incident."""
    ESCALATED = "escalated"
    """Automatic recovery gave up (budget spent, no healthy checkpoint, a recurring fault)."""
    COMPLETED = "completed"
    """Every rank finished training."""
    FAILED = "failed"
    """The job failed (a crash no rule recovers, launches that keep failing)."""
    STOPPED = "stopped"
    """Stopped by ``spikeguard stop``, Ctrl-C or a policy ``stop`` rule."""
    PREEMPTED = "preempted"
    """The supervisor was told to go (SIGTERM) and went, after an emergency checkpoint if the
    ranks made one in time; the next ``spikeguard submit`` resumes the run."""
    LAUNCH_FAILED = "launch_failed"
    """A launch did not come up (a rank died before its first message, placement failed)."""
    RESUME = "resume"
    """A restarted supervisor chose the checkpoint to resume a running generation from."""
    ALERT = "alert"
    """A notify (or checkpoint) rule fired or resolved, or an informational note."""
    FORENSICS = "forensics"
    """At an incident's kill, the ranks' recent batch ids were asked for and stored in the run
    directory (``path``), or no rank answered in time."""
    NODE_EXCLUDED = "node_excluded"
    """A node is kept out of the run's later placements (``node_id``, ``cause``: lost, unhealthy
    or straggler; ``excluded``: every node kept out so far), or a launch had to be placed on
    excluded nodes after all (code ``exclusion_unplaceable``)."""
    OPERATOR = "operator"
    """A human acted on the run (``spikeguard ack|hold|resume``, a Slack button): who
    (``who``, ``via``), why (``note``), the request's id (``request``), and what it did
    (``code``: acknowledged, hold set or released, a recovery held for a human, resumed, or
    refused with the reason)."""

    SUPERVISOR_START = "supervisor_start"
    """A supervisor took over an unfinished run directory."""
    REAPED = "reaped"
    """Rank processes of replaced generations were found and killed."""
    STANDBY = "standby"
    """The warm standby (job ``standby: true``): the next generation's processes were started,
    one died and is replaced, they were discarded (their generation will not come), or standby
    was given up for the run. A release shows in the ``launch`` event (``standby`` per rank)."""
    NOTIFY_THREAD = "notify_thread"
    """The Slack thread of an incident (channel and ts), so a restarted supervisor continues it."""
    NOTIFY_UNDELIVERED = "notify_undelivered"
    """A notification that could not be delivered, and why."""
    CHECKPOINT_DELETED = "checkpoint_deleted"
    """Retention deleted a checkpoint (or an unfinished save): its path, step, generation, kind,
    bytes and the reason (``spikeguard checkpoints RUN_DIR`` shows them)."""

    def __str__(self) -> str:
        return self.value


class Reader(enum.Flag):
    """Who reads an event of a kind (:data:`READERS`)."""

    NONE = 0
    STORY = enum.auto()
    """A person following the run: the console prints it (and ``spikeguard demo``)."""
    THREAD = enum.auto()
    """The incident's Slack thread, when it names an incident (a launch only an open one's)."""
    RUN_END = enum.auto()
    """It tells how the run ended or went away: posted whatever the routes say."""
    TERMINAL = enum.auto()
    """It ends the run (``escalated`` with ``hold`` does not: it waits for a human)."""


_S, _T, _E, _X = Reader.STORY, Reader.THREAD, Reader.RUN_END, Reader.TERMINAL
READERS: dict[Kind, Reader] = {
    Kind.LAUNCH: _S | _T,
    Kind.INCIDENT: _S | _T,
    Kind.KILL: _S | _T,
    Kind.ROLLBACK: _S | _T,
    Kind.LR_CUT: _S | _T,
    Kind.OPTIMIZER_RESET: _S | _T,
    Kind.PROBATION_START: _S | _T,
    Kind.PROBATION_PROGRESS: _T,
    Kind.PROBATION_PASSED: _S | _T,
    Kind.PROBATION_FAILED: _S | _T,
    Kind.PROBATION_SUPERSEDED: _S | _T,
    Kind.ESCALATED: _S | _T | _X,
    Kind.COMPLETED: _S | _E | _X,
    Kind.FAILED: _S | _T | _E | _X,
    Kind.STOPPED: _S | _T | _E | _X,
    Kind.PREEMPTED: _S | _E,
    Kind.LAUNCH_FAILED: _S,
    Kind.RESUME: _S,
    Kind.ALERT: _S | _T,
    Kind.FORENSICS: _S | _T,
    Kind.OPERATOR: _S | _T,
    Kind.NODE_EXCLUDED: _S | _T,
}
"""Who reads each kind; a kind not listed is bookkeeping, read by ``spikeguard events`` only."""


def kinds_read_by(reader: Reader) -> frozenset[Kind]:
    """The kinds ``reader`` reads."""
    return frozenset(k for k, readers in READERS.items() if reader in readers)


TERMINAL_KINDS = kinds_read_by(Reader.TERMINAL)
"""Kinds that end a run (``escalated`` with ``hold`` does not end it: it waits for a human)."""
STORY_KINDS = kinds_read_by(Reader.STORY)
"""Kinds a person following the run wants to read (the console prints these)."""
THREAD_KINDS = kinds_read_by(Reader.THREAD)
"""Kinds that go into the thread of the incident they name (a launch only into an open one)."""
RUN_END_KINDS = kinds_read_by(Reader.RUN_END)
"""How a run ended (or went away resumably)."""


class Code(str, enum.Enum):
    """Why the recovery machine wrote an event: the ``code`` beside the prose ``reason``."""

    # launches
    INITIAL_LAUNCH = "initial_launch"
    RELAUNCH_AFTER_ROLLBACK = "relaunch_after_rollback"
    RELAUNCH_AFTER_LAUNCH_FAILURE = "relaunch_after_launch_failure"
    RELAUNCH_AFTER_RESTART = "relaunch_after_restart"
    LAUNCH_FAILED = "launch_failed"
    """A launch did not come up; it is retried (outside the incident budget)."""
    LAUNCH_RETRIES_SPENT = "launch_retries_spent"
    # an incident and its recovery steps
    RULE_FIRED = "rule_fired"
    """A recover rule opened an incident (or fired again after a failed probation)."""
    RANKS_KILLED = "ranks_killed"
    CHECKPOINT_CHOSEN = "checkpoint_chosen"
    NO_HEALTHY_CHECKPOINT = "no_healthy_checkpoint"
    RESTART_FROM_START = "restart_from_start"
    """A crash or hang with no checkpoint to go back to: the job starts over from step 0."""
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    """A checkpoint failed verification and the policy says not to fall back (escalates)."""
    LR_CUT = "lr_cut"
    OPTIMIZER_RESET = "optimizer_reset"
    PROBATION_WINDOW = "probation_window"
    PROBATION_PROGRESS = "probation_progress"
    RECOVER_IN_PROBATION = "recover_in_probation"
    OTHER_RULE_IN_PROBATION = "other_rule_in_probation"
    """Another rule of the same kind fired in probation: the next attempt, under its settings."""
    SAME_STEP_OTHER_VALUE = "same_step_other_value"
    """The same rule at the same step, measuring another value: a new attempt, not a
    deterministic fault (the sampling grid brought it to the same step)."""
    OTHER_KIND_IN_PROBATION = "other_kind_in_probation"
    """A fault of the other kind in probation: the incident is superseded by its own."""
    WINDOW_PASSED = "window_passed"
    FINISHED_IN_PROBATION = "finished_in_probation"
    # giving up
    BUDGET_SPENT = "budget_spent"
    RECURRING_FAULT = "recurring_fault"
    """The same rule at the same step on consecutive attempts: deterministic, fail fast."""
    TOO_MANY_INCIDENTS = "too_many_incidents"
    # the run ends
    ALL_RANKS_FINISHED = "all_ranks_finished"
    STOP_REQUESTED = "stop_requested"
    CRASH_WITHOUT_RULE = "crash_without_rule"
    # a restarted supervisor
    RESUME_FROM_CHECKPOINT = "resume_from_checkpoint"
    RESUME_FROM_START = "resume_from_start"
    RESUME_CHECKPOINT_GONE = "resume_checkpoint_gone"
    # preemption
    PREEMPTION = "preemption"
    """SIGTERM arrived: an emergency checkpoint was requested."""
    PREEMPTED_AFTER_CHECKPOINT = "preempted_after_checkpoint"
    PREEMPTED_WITHOUT_CHECKPOINT = "preempted_without_checkpoint"
    RESUME_AFTER_PREEMPTION = "resume_after_preemption"
    # notes
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    RULE_NOTIFY = "rule_notify"
    RULE_RESOLVED = "rule_resolved"
    TEARDOWN_EXIT = "teardown_exit"
    """A rank said ``done`` and then died in teardown: counted as finished."""
    LAYERS_CAPPED = "layers_capped"
    """Ranks sent more distinct layer names than the supervisor keeps (``MAX_LAYERS_PER_RANK``):
    the others are dropped from their reports (written by the tick reader, once a rank)."""
    # nodes kept out of the run (``node_excluded`` events)
    NODE_LOST = "node_lost"
    """A rank's agent was lost (its node died, was removed or froze): the node is excluded."""
    NODE_UNHEALTHY = "node_unhealthy"
    """A rank's accelerators failed a health check (a GPU off the bus, an uncorrectable ECC
    error): the node is excluded."""
    NODE_STRAGGLER = "node_straggler"
    """A straggler rule that names a rank recovered: the rank's node is excluded."""
    EXCLUSION_UNPLACEABLE = "exclusion_unplaceable"
    """No node outside the excluded ones fitted within the placement timeout: the launch was
    placed where it could, excluded nodes included (they stay excluded)."""
    # a human's hand (``operator`` events)
    ACKNOWLEDGED = "acknowledged"
    """Someone acknowledged the incident: its repeats stop, pagers get ``acknowledge``."""
    HOLD_SET = "hold_set"
    """Automatic recovery is paused: the next recover decision waits for a human."""
    HOLD_RELEASED = "hold_released"
    """The pause was lifted before any recovery waited on it."""
    RECOVERY_HELD = "recovery_held"
    """A recover decision came while on hold: the ranks were killed, the run waits for a human."""
    RESUME_ASKED = "resume_asked"
    """A human asked to resume a held or escalated run: its checkpoint is being verified."""
    OPERATOR_RESUMED = "operator_resumed"
    """A human resumed a held or escalated run, from the checkpoint and with the settings they
    chose."""
    OPERATOR_REFUSED = "operator_refused"
    """A human's request could not be honoured (why in ``reason``; what can be in the fields)."""
    OPERATOR_STOP = "operator_stop"
    """A human asked to stop the run (a Slack button; ``spikeguard stop`` writes STOP)."""
    BUTTON_REFUSED = "button_refused"
    """A Slack button press that was not carried out (written by the Slack sink, not the
    machine): a user not in ``SPIKEGUARD_SLACK_OPERATORS``, another run's button, a payload that
    is no press of spikeguard's buttons; who pressed and why in ``reason``."""
    # the warm standby (written by the controller, not the machine)
    STANDBY_STARTED = "standby_started"
    STANDBY_READY = "standby_ready"
    """Every rank's standby reported: a recovery now releases it."""
    STANDBY_LOST = "standby_lost"
    """A standby process died while waiting; it is replaced."""
    STANDBY_DISCARDED = "standby_discarded"
    """The standby's generation will not come (another one is next, the gang was rebuilt)."""
    STANDBY_DISABLED = "standby_disabled"
    """Standbys kept dying: the run goes on with cold launches."""

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class MachineEvent:
    """An event the recovery machine emits, before it is worded: what happened (``kind``,
    ``code``), the values the journal records (``fields``) and the values only its wording needs
    (``context``: a kill's generation, a ``min_grade``; never journaled). Its prose ``reason``
    comes from :mod:`..wording`, so a handler decides and the describer words."""

    kind: Kind
    code: Code
    incident: str | None
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """What the journaled event records beside kind, code, reason and incident (in this order)."""
    context: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """What the wording needs that the journaled event does not record."""


# -- events the controller's upkeep writes (the machine writes the story's) ----------------------
STANDBY_CODES: dict[str, Code] = {
    "started": Code.STANDBY_STARTED,
    "ready": Code.STANDBY_READY,
    "lost": Code.STANDBY_LOST,
    "discarded": Code.STANDBY_DISCARDED,
    "disabled": Code.STANDBY_DISABLED,
}
"""The code of a ``standby`` event, by what happened (``launch.interface.StandbyChange.what``)."""


def standby_event(change: Any, incident: str | None) -> dict[str, Any]:
    """The ``standby`` event for a :class:`~..launch.interface.StandbyChange`."""
    ev: dict[str, Any] = {
        "kind": Kind.STANDBY.value,
        "code": STANDBY_CODES[change.what].value,
        "incident": incident,
        "reason": change.reason,
        "generation": change.generation,
    }
    if change.pids:
        ev.update(pids=list(change.pids), port=change.port)
    if change.rank is not None:
        ev.update(rank=change.rank, exit_code=change.exit_code, log_tail=change.log_tail)
    return ev


def layers_capped_event(capped: list[Any], limit: int) -> dict[str, Any]:
    """The ``alert`` (code ``layers_capped``) for ranks whose layer names passed the cap, from
    the collector's :class:`~..intake.collector.CappedRank` records (rank, generation, step,
    stripped); each rank is journaled once a run."""
    ranks = sorted({c.rank for c in capped})
    first = min(capped, key=lambda c: (c.step, c.rank))
    shown = ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )
    who = f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
    return {
        "kind": Kind.ALERT.value,
        "code": Code.LAYERS_CAPPED.value,
        "incident": None,
        "reason": f"{who} reported more than {limit} distinct layer names: the supervisor keeps "
        f"the first {limit} of each rank and drops the others from its reports "
        f"({first.stripped} dropped from rank {first.rank}'s report of step {first.step})",
        "severity": "warn",
        "rule": None,
        "rank": ranks[0] if len(ranks) == 1 else None,
        "ranks": ranks,
        "layer": None,
        "step": first.step,
        "generation": first.generation,
        "limit": limit,
    }


def jsonable(x: Any) -> Any:
    """``x``, with a non-finite float as its string (the journal is strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def checkpoint_deleted_event(verdict: Any, incident: str | None) -> dict[str, Any]:
    """The ``checkpoint_deleted`` event for a retention verdict that was carried out."""
    return {
        "kind": Kind.CHECKPOINT_DELETED.value,
        "incident": incident,
        "reason": verdict.reason,
        "path": verdict.path,
        "step": verdict.step,
        "generation": verdict.generation,
        "checkpoint_kind": verdict.kind,
        "complete": verdict.complete,
        "grade": verdict.grade,
        "loss": jsonable(verdict.loss),
        "ranks": verdict.ranks,
        "bytes": verdict.size,
    }


def reaped_event(found: list[dict[str, Any]], why: str, incident: str | None) -> dict[str, Any]:
    """The ``reaped`` event: rank processes of replaced generations found and killed by pid."""
    gens = sorted({p["generation"] for p in found})
    return {
        "kind": Kind.REAPED.value,
        "incident": incident,
        "reason": f"killed {len(found)} {why} (generations {gens}) by pid",
        "processes": found,
    }


def supervisor_start_event(
    *, phase: str, generation: int, lr_scale: float, incident: str | None, pid: int, host: str
) -> dict[str, Any]:
    """The ``supervisor_start`` event of a supervisor taking over an unfinished journal."""
    return {
        "kind": Kind.SUPERVISOR_START.value,
        "incident": incident,
        "reason": f"restarted on an unfinished journal: phase {phase}, "
        f"generation {generation}, LR scale {lr_scale:.4g}, "
        f"{incident or 'no open incident'}",
        "resumed": True,
        "phase": phase,
        "generation": generation,
        "pid": pid,
        "host": host,
    }


def operator_refused_event(request: str, why: str, state: Any) -> dict[str, Any]:
    """The answer to a file in the operator inbox that is not a request (no action to name)."""
    inc = getattr(state, "incident", None)
    return {
        "kind": Kind.OPERATOR.value,
        "code": Code.OPERATOR_REFUSED.value,
        "incident": inc.id if inc is not None else None,
        "reason": f"an operator request was refused: {why}",
        "request": request,
        "action": None,
        "who": None,
        "via": None,
    }
