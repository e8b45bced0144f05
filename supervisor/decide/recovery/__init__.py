"""The recovery machine: states as data, one pure ``step()`` per observation, no Ray, no I/O.

* :mod:`.model`    phases, settings (the policy's), the state, observations (inputs) and effects
  (outputs)
* :mod:`.machine`  the table of handlers (and of restarts), ``step()`` and ``fold()`` (replaying the
  journal)
* :mod:`.hands`    what a human's request does (ack, hold, resume, stop), registered into the table
* :mod:`.codec`    observations to and from the journal's JSON
"""

from .machine import HANDLERS, RESTART, fold, step

# isort: off
from . import hands  # noqa: F401 (registers the handlers of a human's requests into HANDLERS)

# isort: on
from .model import (
    ACTIVE,
    EXITS,
    RECUR_WINDOW_STEPS,
    TERMINAL,
    CheckpointChosen,
    CheckpointSaved,
    CheckpointWanted,
    Effect,
    Event,
    Finished,
    GraceExpired,
    Incident,
    Kill,
    Killed,
    Launch,
    Launched,
    LaunchFailed,
    Notify,
    Observation,
    Operator,
    Phase,
    Preempt,
    Progress,
    RankExited,
    Recover,
    RequestCheckpoint,
    Restarted,
    ResumeAsked,
    ResumePlan,
    SelectCheckpoint,
    Settings,
    Shutdown,
    Start,
    State,
    StopRequested,
    Transition,
    backoff_delay,
    lr_factor,
    next_generation,
    start_step,
    state_digest,
)

__all__ = [
    "ACTIVE",
    "EXITS",
    "HANDLERS",
    "RECUR_WINDOW_STEPS",
    "RESTART",
    "TERMINAL",
    "CheckpointChosen",
    "CheckpointSaved",
    "CheckpointWanted",
    "Effect",
    "Event",
    "Finished",
    "GraceExpired",
    "Incident",
    "Kill",
    "Killed",
    "Launch",
    "LaunchFailed",
    "Launched",
    "Notify",
    "Observation",
    "Operator",
    "Phase",
    "Preempt",
    "Progress",
    "RankExited",
    "Recover",
    "RequestCheckpoint",
    "Restarted",
    "ResumeAsked",
    "ResumePlan",
    "SelectCheckpoint",
    "Settings",
    "Shutdown",
    "Start",
    "State",
    "StopRequested",
    "Transition",
    "backoff_delay",
    "fold",
    "lr_factor",
    "next_generation",
    "start_step",
    "state_digest",
    "step",
]
