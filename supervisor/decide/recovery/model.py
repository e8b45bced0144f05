"""The recovery machine's data: phases, settings, state, observations and effects.

Plain frozen dataclasses and small pure helpers; the transitions live in :mod:`.machine`.
Observations are what the controller tells the machine (a decision, an exit, the outcome of an
effect); effects are what the machine asks the controller to do. Fields marked
``journal=False`` only feed the events the machine writes (the event itself records them); the
journal keeps every other field of the observations that changed the state, which is what a
restarted supervisor replays (:func:`.machine.fold`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from typing import Any, Literal

from pydantic import BaseModel
from spikeguard.policies.schema import RecoverySettings, lr_factor_for
from spikeguard.workers.contract.plan import ResumePlan

from ..events import jsonable

EVENT_ONLY = {"journal": False}
"""Field metadata: feeds the machine's events only, never its state (not journaled twice)."""


class Phase(str, enum.Enum):
    """Where the run stands."""

    STARTING = "STARTING"
    """Nothing launched yet."""
    RUNNING = "RUNNING"
    """Training, no open incident."""
    KILLING = "KILLING"
    """An incident opened: every rank is being killed."""
    ROLLING_BACK = "ROLLING_BACK"
    """Choosing the checkpoint to resume from."""
    RESUMING = "RESUMING"
    """A restarted supervisor is choosing the checkpoint to resume the run from (no incident)."""
    RELAUNCHING = "RELAUNCHING"
    """A new generation is being launched."""
    PROBATION = "PROBATION"
    """The relaunched generation must train a window of steps without another incident."""
    HOLDING = "HOLDING"
    """The budget is spent and the policy says hold (or a human set a hold): ranks killed,
    waiting for a human (``spikeguard resume``)."""
    OPERATOR_RESUME = "OPERATOR_RESUME"
    """A human asked to resume a held or escalated run: the checkpoint they chose (or the newest
    healthy one) is being verified."""
    PREEMPTING = "PREEMPTING"
    """The supervisor was told to go (SIGTERM: pod eviction, spot reclaim, ``ray job stop``): the
    ranks are asked for an emergency checkpoint within a grace period."""
    PREEMPTED = "PREEMPTED"
    """The supervisor went away on purpose (exit 143); ``spikeguard submit`` on the same run
    directory resumes the run where it was."""
    ESCALATED = "ESCALATED"
    """Automatic recovery gave up; the job stopped (exit 3)."""
    COMPLETED = "COMPLETED"
    """Every rank finished training (exit 0)."""
    FAILED = "FAILED"
    """A crash no rule recovers, or launches that keep failing (exit 1)."""
    STOPPED = "STOPPED"
    """Stopped by a person or a policy ``stop`` rule (exit 5)."""


TERMINAL = frozenset({Phase.ESCALATED, Phase.COMPLETED, Phase.FAILED, Phase.STOPPED})
"""Phases that end the run: no observation changes them."""

EXITS = TERMINAL | {Phase.PREEMPTED}
"""Phases in which the supervisor process exits (a preempted run is resumed by the next one)."""

ACTIVE = (Phase.RUNNING, Phase.PROBATION)
"""Phases in which ranks train and report."""

RECUR_WINDOW_STEPS = 2
"""The recurrence window an older supervisor used (``recovery.recur_window_steps`` now): a
recover decision of the same rule within this many steps of the previous attempt's is a
recurrence (reports are asynchronous: a crashed rank's last reported step can lag a step)."""

LEGACY: dict[str, Any] = {
    "grade_baseline": "absolute",
    "recur_window_steps": RECUR_WINDOW_STEPS,
    "recur_tolerance": None,
    "rewarm_steps": 0,
    "probation_kinds": "incident",
    "lr_restore_steps": 0,
}
"""What each recovery setting added after the first journals means when a journaled ``settings``
object lacks it: what the older supervisor did (which the new defaults no longer are). Read by
:meth:`Settings.from_dict` for a missing key, and by :func:`state_digest`, which leaves a setting
at its legacy value out, so the digests of older journals stay valid."""

RelaunchCause = Literal["initial", "recovery", "launch_retry", "restart"]
NodeCause = Literal["lost", "unhealthy", "straggler"]
"""Why a node is kept out of the run: its agent was lost (the node died, was removed, froze), a
health check of its accelerators failed, or a straggler rule recovered an incident on it."""
GradeRule = Literal["absolute", "run baseline", "ungraded"]


class Settings(RecoverySettings):
    """The recovery settings the machine reads (a rule's effective settings): the policy's
    :class:`~spikeguard.policies.RecoverySettings` itself, whose fields define every setting
    once (name, type, default, meaning).

    Taken as given, not validated again: they come from a policy that was validated, or from
    the journal, which recorded them; and a caller may ask for what no policy can say (a budget
    of 0 attempts escalates at once). Unknown names are a ``TypeError``, as for a dataclass.
    """

    def __init__(self, /, **values: Any) -> None:
        unknown = sorted(set(values) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"Settings got unexpected fields {unknown}")
        if "lr_factors" in values:
            values["lr_factors"] = [float(f) for f in values["lr_factors"]]
        given = type(self).model_construct(**values)
        for slot in _MODEL_SLOTS:
            object.__setattr__(self, slot, getattr(given, slot))

    @classmethod
    def from_policy(cls, rs: Any) -> Settings:
        """From a :class:`spikeguard.policies.RecoverySettings` (or anything with these fields)."""
        return cls(**{n: getattr(rs, n) for n in cls.model_fields if hasattr(rs, n)})

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Settings:
        """From a journaled ``settings`` object (unknown keys ignored). A setting it lacks was
        added after that journal was written: it means what the older supervisor did
        (:data:`LEGACY`), not the new default; None: the defaults, with the same rule."""
        given = {k: v for k, v in d.items() if k in cls.model_fields} if isinstance(d, dict) else {}
        return cls(**{**LEGACY, **given})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, in the fields' order (how events and the journal record it)."""
        return {n: _plain_copy(getattr(self, n)) for n in type(self).model_fields}


_MODEL_SLOTS = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
"""What a pydantic model instance holds (what :meth:`pydantic.BaseModel.model_construct` sets)."""


def _plain_copy(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Incident:
    """An open incident: what fired, and how many recoveries it has spent."""

    id: str
    """``inc-001``, ``inc-002``, … in the order the run opened them."""
    rule: str
    reason: str
    step: int
    """The step the rule fired at (the latest attempt's, after a failed probation)."""
    settings: Settings
    attempts: int = 0
    """Recoveries already started for this incident."""
    fault: bool = False
    """A crash or a hang, not a numerical instability: it rolls back to the newest checkpoint
    that verifies (whatever its grade) at or before the furthest step any rank reached, from the
    job's start when there is none, and waits a backoff before each relaunch."""
    furthest_step: int | None = None
    """The furthest step any rank had reported when the incident (or attempt) opened."""
    batch_ids: str | None = None
    """The file holding the ranks' recent batch ids, asked for at this attempt's kill (None: no
    rank answered)."""
    value: float | str | None = None
    """What the rule measured at the latest attempt (a non-finite value as its string; None:
    nothing measured, a crash or a hang): a recurrence needs the same value again."""
    lr_scale_before: float | None = None
    """The run's LR scale when the incident opened, kept when its settings give the cut back
    (``lr_restore_steps``): what the scale returns to once its probation passes."""
    acknowledged_by: str | None = None
    """Who acknowledged it (``spikeguard ack``, a Slack button): its repeats stop."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exclusion:
    """A node kept out of every later placement of the run (:attr:`State.excluded`)."""

    node_id: str
    """Ray's id of the node."""
    cause: NodeCause
    reason: str
    """What was seen there, in words."""
    rank: int
    """The rank that ran there when it was excluded."""
    generation: int
    """The generation that rank belonged to."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeAsked:
    """A human's resume while its checkpoint is verified (:attr:`State.resume_asked`)."""

    who: str
    via: str
    note: str = ""
    request: str = ""
    checkpoint: str | None = None
    lr_scale: float | None = None
    lr_factor: float | None = None
    reset_optimizer: bool = False
    skip_steps: tuple[int, int] | None = None
    back_to: Phase = Phase.HOLDING
    """Where the run returns when the resume cannot be honoured (HOLDING or ESCALATED)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class State:
    """Everything the machine knows; rebuilt after a restart by replaying the journal."""

    phase: Phase = Phase.STARTING
    generation: int = 0
    """The generation running now (the last one launched)."""
    max_generation: int = 0
    """The highest generation number ever used; a new launch takes the next one."""
    lr_scale: float = 1.0
    """The compounded LR scale every generation is launched with."""
    incident: Incident | None = None
    incidents_seen: int = 0
    """Incidents opened in this run (ids are numbered from it)."""
    probation_from: int | None = None
    probation_until: int | None = None
    plan: ResumePlan | None = None
    """The plan of the current generation, or of the one being launched."""
    lineage: tuple[tuple[int, int | None], ...] = ()
    """(generation, step it branched from) of every launch, oldest first: a checkpoint counts
    for rollback only if it lies on the path the current generation descends from."""
    exit_code: int | None = None
    launch_retries: int = 3
    """Launch failures retried in a row before the job fails (the job's setting)."""
    launch_failures: int = 0
    """Consecutive launch failures of the current launch request (reset by every new request)."""
    relaunch_cause: RelaunchCause | None = None
    """Why the pending launch happens (set from RELAUNCHING until the launch is done)."""
    resume_to: Phase | None = None
    """The phase to return to after a launch retry or a supervisor restart (RUNNING/PROBATION)."""
    preempted_from: Phase | None = None
    """The phase a preemption interrupted (PREEMPTING, PREEMPTED): where a resume goes back to."""
    resume_settings: Settings | None = None
    """The recovery settings a restarted supervisor resumes under (RESUMING: the incident's, else
    the policy's): what happens when nothing is left to resume from. Cleared by the resume, so
    the digests of every other phase are those an older supervisor journaled."""
    requests_sent: int = 0
    """Requests sent to the ranks so far (each request's id is its number)."""
    probation_reported: int = 0
    """Tenths of the probation window already reported (``probation_progress``)."""
    hold: str | None = None
    """Who paused automatic recovery (``spikeguard hold``): the next recover decision kills the
    ranks and waits for a human instead of rolling back."""
    resume_asked: ResumeAsked | None = None
    """A human's resume waiting for its checkpoint's verification (OPERATOR_RESUME)."""
    nodes: tuple[str, ...] = ()
    """The node id of each rank of the current generation ("" where unknown): how a rank named by
    a decision becomes the node to exclude."""
    excluded: tuple[Exclusion, ...] = ()
    """Nodes kept out of every later placement for the rest of the run, oldest first (a
    relaunch places without them when the cluster has room elsewhere: :attr:`Launch.avoid`)."""
    unjournaled: tuple[Observation, ...] = ()
    """Observations that changed the state without an event yet; the next event records them."""


def state_digest(state: State) -> str:
    """A short, stable fingerprint of ``state`` (journaled beside the observations, so a replay
    of the journal can prove it rebuilt exactly the live state).

    Fields at their default value are left out, recursively: a field added later with a
    default that keeps the old behaviour leaves the digests of older journals valid.
    """
    compact = _non_default(dataclasses.replace(state, unjournaled=()))
    text = json.dumps(compact, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _non_default(value: Any) -> Any:
    fields = _fields_and_defaults(value)
    if fields is not None:
        out = {}
        for name, default in fields:
            v = getattr(value, name)
            if default is not dataclasses.MISSING and v == default:
                continue
            out[name] = _non_default(v)
        return out
    if isinstance(value, (tuple, list)):
        return [_non_default(v) for v in value]
    return value


def _fields_and_defaults(value: Any) -> list[tuple[str, Any]] | None:
    """(name, default) of each field of a record (a dataclass or, like :class:`Settings`, a
    pydantic model; ``MISSING``: none), or None for a plain value. A setting added later
    (:data:`LEGACY`) is compared with its legacy value, not its default: that is the value every
    older journal's settings have."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, f.default) for f in dataclasses.fields(value)]
    if isinstance(value, Settings):
        return [(n, LEGACY.get(n, f.default)) for n, f in type(value).model_fields.items()]
    if isinstance(value, BaseModel):
        return [(n, f.default) for n, f in type(value).model_fields.items()]
    return None


# ---- observations (inputs) ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Start:
    """A fresh supervisor begins the run: launch generation 1."""

    launch_retries: int = 3
    """Launch failures retried in a row before the job fails."""


@dataclasses.dataclass(frozen=True)
class Launched:
    """A generation is up (every rank's process started)."""

    generation: int
    ranks: tuple[dict[str, Any], ...] = dataclasses.field(default=(), metadata=EVENT_ONLY)
    """Per rank: pid, node_id, host, agent_pid (journaled in the event for fencing/reaping)."""
    port: int | None = None
    backoff_s: float = 0.0
    """How long the supervisor waited before this launch."""
    nodes: tuple[str, ...] = ()
    """The node id of each rank ("" where unknown): journaled, so a rank a later decision names
    maps to its node after a restart too (:attr:`State.nodes`)."""
    unavoided: str | None = dataclasses.field(default=None, metadata=EVENT_ONLY)
    """Why the launch was placed on excluded nodes after all (no other node fitted within the
    placement timeout); None: it avoided them, or there were none."""


@dataclasses.dataclass(frozen=True)
class LaunchFailed:
    """The launch itself could not be made (placement, agents), or a rank died before its first
    message."""

    reason: str
    rank: int | None = None
    exit_code: int | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict, metadata=EVENT_ONLY)


@dataclasses.dataclass(frozen=True)
class RankExited:
    """A rank's process of ``generation`` ended, after the policy engine saw its exit."""

    rank: int
    generation: int
    code: int
    """The exit code (negative: killed by that signal)."""
    first: bool = False
    """It never sent a message: a launch failure, not a crash."""
    teardown_code: int | None = None
    """It said ``done`` and then died with this code in teardown: finished all the same."""
    details: dict[str, Any] = dataclasses.field(default_factory=dict, metadata=EVENT_ONLY)
    """log_tail, lost, host: for the events."""


@dataclasses.dataclass(frozen=True)
class NodeSuspect:
    """A rank's node should not host the run again: its agent was lost, its accelerators failed a
    health check, or a straggler rule that names it recovered (:mod:`..health`)."""

    rank: int
    generation: int
    """The generation of the rank (a suspect of a replaced generation is ignored)."""
    cause: NodeCause
    reason: str


@dataclasses.dataclass(frozen=True)
class Recover:
    """A policy rule decided to recover."""

    rule: str
    reason: str
    step: int
    settings: Settings
    details: dict[str, Any] = dataclasses.field(default_factory=dict, metadata=EVENT_ONLY)
    fault: bool = False
    """It fired on a rank's exit or silence (a crash or a hang), not on a training signal."""
    furthest_step: int | None = None
    """The furthest step any rank of the generation had reported."""
    value: float | str | None = None
    """What the rule measured (a non-finite value as its string, as the journal writes it);
    taken from ``details["value"]`` when not given. Journaled: a recurrence is judged on it."""

    def __post_init__(self) -> None:
        value = self.details.get("value") if self.value is None else self.value
        object.__setattr__(self, "value", jsonable(value))


@dataclasses.dataclass(frozen=True)
class CheckpointWanted:
    """A policy rule with ``action: checkpoint`` fired: the ranks should save at the next step."""

    reason: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict, metadata=EVENT_ONLY)
    """rule, action, severity, signal, value, rank, layer, step."""


@dataclasses.dataclass(frozen=True)
class Preempt:
    """The supervisor must go (SIGTERM): save what can be saved, then stop resumably."""

    reason: str


@dataclasses.dataclass(frozen=True)
class CheckpointSaved:
    """A rank published a checkpoint answering request ``request_id``."""

    request_id: int
    path: str
    step: int


@dataclasses.dataclass(frozen=True)
class GraceExpired:
    """No checkpoint answered request ``request_id`` within the controller's grace period."""

    request_id: int


@dataclasses.dataclass(frozen=True)
class Notify:
    """A policy rule decided to notify (or to checkpoint), or it stopped holding (``resolved``)."""

    reason: str
    resolved: bool = False
    details: dict[str, Any] = dataclasses.field(default_factory=dict, metadata=EVENT_ONLY)
    """rule, action, severity, signal, value, rank, layer, step."""


@dataclasses.dataclass(frozen=True)
class Killed:
    """Every rank of the generation is dead (or unreachable and fenced)."""

    ranks: tuple[int, ...]
    duration_s: float
    forced: tuple[int, ...] = ()
    """Ranks that ignored SIGTERM for the whole grace period and were SIGKILLed."""
    unreachable: tuple[int, ...] = ()
    """Ranks whose agent could not be reached (node lost or frozen): fenced, reaped by pid."""
    batch_ids: str | None = None
    """Where the ranks' recent batch ids were stored before the kill (asked for by
    :attr:`Kill.batch_ids_for`); None when not asked, or when no rank answered in time."""


@dataclasses.dataclass(frozen=True)
class CheckpointChosen:
    """The controller's answer to :class:`SelectCheckpoint` (``path`` None: nothing healthy)."""

    path: str | None
    step: int | None = None
    sha256: str | None = None
    grade: int | None = None
    skipped: tuple[tuple[str, str], ...] = ()
    """(path, why) of every newer checkpoint passed over."""
    corrupt: str | None = None
    """The checkpoint whose failed verification ended the search (``fallback_on_corrupt``
    False), if that is why nothing was chosen."""
    grade_rule: GradeRule | None = dataclasses.field(default=None, metadata=EVENT_ONLY)
    """Which bar the grade had to meet: ``"absolute"`` (``min_grade``), ``"run baseline"`` (the
    run's own healthy baseline, nothing meeting ``min_grade``), ``"ungraded"`` (no checkpoint of
    the run is graded: any qualifies); None: any grade."""
    grade_bar: int | None = dataclasses.field(default=None, metadata=EVENT_ONLY)
    """The grade the choice had to meet (``min_grade``, or the run's baseline)."""
    baseline_of: int | None = dataclasses.field(default=None, metadata=EVENT_ONLY)
    """How many graded checkpoints the run's baseline is the median of (None: not computed)."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far the current generation has trained."""

    step: int
    """The slowest rank's latest step in the current generation."""


@dataclasses.dataclass(frozen=True)
class Finished:
    """Every rank of the current generation exited 0."""

    final_loss: float | None


@dataclasses.dataclass(frozen=True)
class StopRequested:
    """A person (``spikeguard stop``, Ctrl-C) or a policy ``stop`` rule asked to stop."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Restarted:
    """A restarted supervisor took over a run whose state was folded from the journal."""

    settings: Settings
    """The policy's recovery settings (min_grade of a resume outside an incident)."""
    highest_generation: int = 0
    """The highest generation with traces on disk (plans, logs): a launch may have begun
    unjournaled, and its number must never be reused."""
    launch_retries: int = 3
    """The (restarted) job's launch retries."""


@dataclasses.dataclass(frozen=True)
class Operator:
    """A human's request (``spikeguard ack|hold|resume``, a Slack button), taken from the run
    directory's inbox (:mod:`spikeguard.supervisor.intake.operator`)."""

    action: str
    """ack, hold, resume or stop."""
    who: str
    via: str
    """cli or slack."""
    note: str = ""
    request: str = ""
    """The request's id (its writer finds the answer by it)."""
    incident: str | None = None
    """The incident it is about (None: the run's current one)."""
    checkpoint: str | None = None
    """resume: the checkpoint to resume from (None: the newest healthy one)."""
    lr_scale: float | None = None
    """resume: the run's LR scale from now on."""
    lr_factor: float | None = None
    """resume: multiply the run's LR scale by this (ignored with ``lr_scale``)."""
    reset_optimizer: bool = False
    skip_steps: tuple[int, int] | None = None
    """resume: skip the batches of these steps (inclusive)."""


Observation = (
    Start
    | CheckpointWanted
    | Preempt
    | CheckpointSaved
    | GraceExpired
    | Launched
    | LaunchFailed
    | RankExited
    | Recover
    | Notify
    | Killed
    | CheckpointChosen
    | Progress
    | Finished
    | StopRequested
    | Restarted
    | Operator
    | NodeSuspect
)
OBSERVATIONS: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Observation)}
"""Every observation type by name (how the journal names them)."""


# ---- effects (outputs) -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kill:
    """Fence the generation and kill every rank; answer with :class:`Killed`."""

    reason: str
    batch_ids_for: tuple[str, int] | None = None
    """(incident id, attempt): first ask the ranks for their recent batch ids and wait a short,
    bounded time for them (the incident's forensics, and what a relaunch may skip); None: kill
    at once (a stop, a failure, an escalation: the journal then ends with that event)."""


@dataclasses.dataclass(frozen=True)
class SelectCheckpoint:
    """Choose the newest qualifying checkpoint; answer with :class:`CheckpointChosen`."""

    min_grade: int | None
    """None: any grade, ungraded included (crashes, hangs, resumes)."""
    before_step: int | None
    min_steps_back: int
    lineage: tuple[tuple[int, int | None], ...] = ()
    """Only checkpoints on this lineage qualify (see :attr:`State.lineage`)."""
    fallback_on_corrupt: bool = True
    """A checkpoint failing verification falls back to older ones (False: nothing is chosen)."""
    grade_baseline: Literal["run", "absolute"] = "run"
    """'run': when nothing meets ``min_grade``, a checkpoint at the run's own healthy baseline
    (the median grade of its graded checkpoints before ``before_step``, capped at ``min_grade``)
    qualifies; 'absolute': ``min_grade`` only (see ``recovery.grade_baseline``)."""
    exact: str | None = None
    """A human's choice: this checkpoint (its path) and no other, if it is on the lineage and
    verifies (the other bars do not apply)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """Launch ``plan.generation`` with ``plan``; answer with :class:`Launched` or
    :class:`LaunchFailed`."""

    plan: ResumePlan
    backoff_attempt: int = 0
    """0: launch at once; n >= 1: wait :func:`backoff_delay` (n) first."""
    avoid: tuple[str, ...] = ()
    """Node ids to keep the gang off (:attr:`State.excluded`, filled in by
    :func:`.machine.step` for every launch); where no other node fits, it is placed anyway and
    :attr:`Launched.unavoided` says so."""


@dataclasses.dataclass(frozen=True)
class RequestCheckpoint:
    """Ask every rank to save a checkpoint at its next step boundary (request ``request_id``).

    ``wait``: answer with :class:`CheckpointSaved` or, after the grace period,
    :class:`GraceExpired`."""

    request_id: int
    reason: str
    wait: bool = False


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """The run is over: stop accepting reports; the process exits with ``exit_code``."""

    exit_code: int


Effect = Kill | SelectCheckpoint | Launch | RequestCheckpoint | Shutdown
Event = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Transition:
    """What one observation did: the next state, what to carry out, and what to journal."""

    state: State
    effects: tuple[Effect, ...] = ()
    events: tuple[Event, ...] = ()


# ---- small pure helpers ------------------------------------------------------------------------
def lr_factor(settings: Settings, attempt: int) -> float:
    """The factor for the ``attempt``-th recovery (0-based); the last factor repeats."""
    return lr_factor_for(settings.lr_factors, attempt)


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before relaunch ``attempt`` (1-based): base, 2 x base, 4 x base, ...
    capped at ``max_s``."""
    if attempt <= 0 or base_s <= 0:
        return 0.0
    return float(min(max_s, base_s * 2.0 ** min(attempt - 1, 60)))


def next_generation(state: State) -> int:
    """The number the next launch takes."""
    return max(state.generation, state.max_generation) + 1


def start_step(plan: ResumePlan | None) -> int:
    """The first training step of a generation launched with ``plan``."""
    return 0 if plan is None else plan.start_step
