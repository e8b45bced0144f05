"""The recovery machine's data: phases, settings, state, observations and effects.

Plain frozen dataclasses, no behaviour beyond small pure helpers; the
transitions live in :mod:`.recovery` (which re-exports every name here).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, Union

from spikeguard.workers.contract import ResumePlan

__all__ = [
    "RECUR_WINDOW_STEPS",
    "TERMINAL",
    "CheckpointChosen",
    "Effect",
    "Event",
    "Failed",
    "Finished",
    "Incident",
    "Kill",
    "Killed",
    "Launch",
    "LaunchFailed",
    "Launched",
    "Observation",
    "Phase",
    "Progress",
    "Recover",
    "Restarted",
    "ResumePlan",
    "SelectCheckpoint",
    "Settings",
    "Shutdown",
    "Start",
    "State",
    "StopRequested",
    "Transition",
    "backoff_delay",
    "lr_factor",
    "next_generation",
    "start_step",
]


class Phase(str, enum.Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    KILLING = "KILLING"
    ROLLING_BACK = "ROLLING_BACK"
    RESUMING = "RESUMING"
    """A restarted supervisor is choosing the checkpoint to resume the run from (no incident)."""
    RELAUNCHING = "RELAUNCHING"
    PROBATION = "PROBATION"
    HOLDING = "HOLDING"
    ESCALATED = "ESCALATED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


TERMINAL = frozenset({Phase.ESCALATED, Phase.COMPLETED, Phase.FAILED, Phase.STOPPED})

RECUR_WINDOW_STEPS = 2
"""A recover decision of the same rule within this many steps of the previous attempt's is a recurrence
(reports are asynchronous: a crashed rank's last reported step can lag by a step or so)."""

RelaunchCause = Literal["initial", "recovery", "launch_retry", "restart"]


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
    max_incidents: int = 10
    """Incidents allowed in one run; the next one escalates at once (a fault that recurs every
    N steps, N longer than probation, would otherwise open fresh incidents forever)."""
    on_exhausted: Literal["stop", "hold"] = "stop"
    """When the budget is spent: stop the job and page, or hold it (ranks killed, waiting for a human)."""

    @classmethod
    def from_policy(cls, rs: Any) -> Settings:
        """Build from a :class:`spikeguard.policies.RecoverySettings` (or anything with the same fields)."""
        names = [f.name for f in dataclasses.fields(cls)]
        kw = {n: getattr(rs, n) for n in names if hasattr(rs, n)}
        if "lr_factors" in kw:
            kw["lr_factors"] = tuple(kw["lr_factors"])
        return cls(**kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Settings:
        """From a journaled ``settings`` object (unknown keys ignored; None: the defaults)."""
        if not isinstance(d, dict):
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "lr_factors" in kw:
            kw["lr_factors"] = tuple(float(x) for x in kw["lr_factors"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lr_factors"] = list(self.lr_factors)
        return d


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
    """The generation running now (the last one launched)."""
    max_generation: int = 0
    """The highest generation number ever used; a new launch takes the next one."""
    lr_scale: float = 1.0
    incident: Incident | None = None
    incidents_seen: int = 0
    probation_from: int | None = None
    probation_until: int | None = None
    plan: ResumePlan | None = None
    """The plan of the current generation, or of the one being launched."""
    exit_code: int | None = None
    launch_failures: int = 0
    """Consecutive launch failures of the current launch request (reset by every new request)."""
    relaunch_cause: RelaunchCause | None = None
    """Why the pending launch happens (set from RELAUNCHING until the launch is done)."""
    resume_to: Phase | None = None
    """The phase to return to after a launch retry or a supervisor restart (RUNNING or PROBATION)."""


# ---- observations (inputs) ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Start:
    """A fresh supervisor begins the run: launch generation 1."""


@dataclasses.dataclass(frozen=True)
class Launched:
    generation: int
    ranks: tuple[dict[str, Any], ...] = ()
    """Per rank, what the launcher knows: pid, node_id, host, agent_pid (journaled for fencing/reaping)."""
    port: int | None = None
    backoff_s: float = 0.0
    """How long the supervisor waited before this launch."""


@dataclasses.dataclass(frozen=True)
class LaunchFailed:
    """A rank exited non-zero before its first heartbeat, or the launch itself could not be made."""

    reason: str
    retries_allowed: int
    rank: int | None = None
    exit_code: int | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


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
    forced: tuple[int, ...] = ()
    """Ranks that ignored SIGTERM for the whole grace period and were SIGKILLed."""
    unreachable: tuple[int, ...] = ()
    """Ranks whose agent could not be reached (node lost or frozen): fenced, reaped later by pid."""


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
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StopRequested:
    reason: str


@dataclasses.dataclass(frozen=True)
class Restarted:
    """A restarted supervisor took over a run whose state was folded from the journal."""

    settings: Settings
    """The policy's recovery settings (min_grade of a resume outside an incident)."""
    highest_generation: int = 0
    """The highest generation with traces on disk (plans, logs): a launch may have begun unjournaled."""


Observation = Union[
    Start,
    Launched,
    LaunchFailed,
    Recover,
    Killed,
    CheckpointChosen,
    Progress,
    Finished,
    Failed,
    StopRequested,
    Restarted,
]


# ---- effects (outputs) ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kill:
    reason: str


@dataclasses.dataclass(frozen=True)
class SelectCheckpoint:
    min_grade: int
    before_step: int | None
    min_steps_back: int


@dataclasses.dataclass(frozen=True)
class Launch:
    plan: ResumePlan
    backoff_attempt: int = 0
    """0: launch at once; n >= 1: wait :func:`backoff_delay` (n) first."""


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


# ---- small pure helpers ----------------------------------------------------------------------
def lr_factor(settings: Settings, attempt: int) -> float:
    """The factor for the ``attempt``-th recovery (0-based); the last factor repeats."""
    f = settings.lr_factors
    return f[min(attempt, len(f) - 1)]


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before relaunch ``attempt`` (1-based): base, 2 x base, 4 x base, ... capped at max_s."""
    if attempt <= 0 or base_s <= 0:
        return 0.0
    return float(min(max_s, base_s * 2.0 ** min(attempt - 1, 60)))


def next_generation(state: State) -> int:
    return max(state.generation, state.max_generation) + 1


def start_step(plan: ResumePlan | None) -> int:
    """The first training step of a generation launched with ``plan``."""
    if plan is None or plan.checkpoint_step is None:
        return 0
    return plan.checkpoint_step + 1
