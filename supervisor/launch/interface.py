"""What crosses the seam between the launcher (Ray) and the controller: plain, typed records.

The controller never sees a Ray object or an untyped dict: a launch returns one
:class:`LaunchedRank` per rank, a poll one :class:`RankPoll` per rank that answered, a kill one
:class:`KillReport`. No Ray here, so the controller and the tests import these without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol


class LaunchError(RuntimeError):
    """A generation could not be launched (placement, agents, the start calls).

    The controller turns it into a launch failure, which is retried outside the incident budget.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """The gang of ranks to place and run."""

    world_size: int
    """Number of ranks."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per rank in the placement group."""
    gpus_per_worker: float = 0.0
    """GPUs reserved per rank."""
    strategy: str = "PACK"
    """Placement group strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the gang to be placed before failing the launch."""
    agent_timeout_s: float = 30.0
    """An agent that has not answered a poll for this long is lost (its node is frozen or gone)."""
    pass_env: tuple[str, ...] = ()
    """Variables of the supervisor's environment the ranks get although they look secret."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """Where a rank agent runs."""

    node_id: str
    ip: str
    host: str
    pid: int
    """The agent's own process."""
    gpu_ids: tuple[str, ...] = ()
    """The GPUs Ray assigned the agent (its rank's reservation), as device ids."""
    cwd: str = ""
    """The agent's working directory on its node: under Ray Jobs' ``--working-dir``, that node's
    own copy of the job's working directory (where Ray starts every worker of the job)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchedRank:
    """One rank of a generation that was started."""

    rank: int
    pid: int
    """The training process (the leader of its own session)."""
    generation: int
    report: str
    """The address the rank reports to (its agent's socket)."""
    port: int
    """The generation's MASTER_PORT."""
    node_id: str | None = None
    host: str | None = None
    ip: str | None = None
    agent_pid: int | None = None
    gpu_ids: tuple[str, ...] = ()
    """The GPUs Ray assigned this rank (device ids on its node)."""
    standby: bool = False
    """A standby process: started ahead of need (or, in a launch, released from standby)."""

    def to_dict(self) -> dict[str, Any]:
        """For the journal's ``launch`` event (what fencing and reaping need later)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankPoll:
    """What one rank's agent had for the supervisor since the last poll."""

    rank: int
    generation: int | None
    """The generation of the process the agent runs (None before the first launch)."""
    lines: tuple[bytes, ...] = ()
    """Report lines received, oldest first (each one JSON message, unvalidated)."""
    overflow: int = 0
    """Lines the agent dropped because its buffer was full."""
    oversize: int = 0
    """Lines the agent dropped because they were longer than its limit."""
    exit_code: int | None = None
    """The process's exit code once it ended (negative: killed by that signal)."""
    rx_age_s: float | None = None
    """Seconds since the agent last received anything from the rank."""
    pid: int | None = None
    log_tail: str = ""
    """The end of the rank's log, once it exited."""
    lost: str | None = None
    """Why the agent itself is gone (node removed, frozen, partitioned): reads as exit -9."""
    node_id: str | None = None
    host: str | None = None
    output: tuple[str, ...] = ()
    """The rank's output (stdout and stderr) since the last poll, as whole lines (bounded)."""
    output_skipped: int = 0
    """Bytes of output beyond the bound, left out of ``output`` (the full log is in
    RUN_DIR/logs)."""
    standby_generation: int | None = None
    """The generation of the rank's standby process, if it has one."""
    standby_ready: bool = False
    """The standby process has reported (it is waiting for its release)."""
    standby_exit: int | None = None
    """The standby's exit code once it ended (it should never end by itself)."""
    standby_tail: str = ""
    """The end of the standby's log, once it ended."""
    health: dict[str, Any] | None = None
    """The rank's accelerator signals, read from NVML every few seconds by its agent
    (:func:`.nvml.signals_of`: ``gpu_ecc_errors``, ``gpu_xid``, ``gpu_throttle`` and its flags,
    ``gpu_lost``);
    None without GPUs or NVML."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StandbyChange:
    """What happened to the warm standby (see :meth:`~.group.WorkerGroup.standby`)."""

    what: str
    """``started``, ``ready`` (every rank's standby reported: it waits for its release),
    ``lost`` (a standby process died, or starting one failed: replaced next time),
    ``discarded`` (its generation will not come) or ``disabled`` (given up for the run)."""
    generation: int
    reason: str
    rank: int | None = None
    exit_code: int | None = None
    log_tail: str = ""
    pids: tuple[int, ...] = ()
    port: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankKill:
    """One agent's answer to a kill."""

    rank: int
    duration_s: float = 0.0
    forced: bool = False
    """SIGTERM was sent and ignored for the whole grace period: SIGKILLed."""
    alive: bool = False
    """Still there 10 s after SIGKILL (stuck in the kernel)."""
    pid: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillReport:
    """The outcome of killing a whole generation."""

    duration_s: float
    forced: tuple[int, ...] = ()
    """Ranks that ignored SIGTERM for the grace period and were SIGKILLed."""
    unreachable: tuple[int, ...] = ()
    """Ranks whose agent could not be reached (node lost or frozen): fenced, reaped later by pid."""


WAIT_REPORT_S = 1.0
"""How often a launch that waits (for its placement) says so (:data:`WaitReport`)."""

WaitReport = Callable[[dict[str, Any] | None], None]
"""Told while a launch waits for something outside the run (the cluster placing its gang):
``{"for": "placement", "what": "2 workers with {'CPU': 1.0} each (PACK)", "waited_s": 12.0,
"timeout_s": 120.0}`` about every :data:`WAIT_REPORT_S`, then None when the wait is over. The
controller shows it in the live view and ``status.json``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """How the latest gang was placed with respect to the nodes it was asked to avoid."""

    avoid: tuple[str, ...] = ()
    """The node ids the launch was asked to keep off."""
    unavoided: str | None = None
    """Why it was placed without avoiding them (no other node fitted within the placement
    timeout); None: it avoided them (or had none to avoid)."""


class Group(Protocol):
    """What the controller needs from a launcher (Ray's :class:`~.group.WorkerGroup`, or a fake)."""

    def launch(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        plan_path: str | None,
        fence_file: str,
        ckpt_dir: str,
        avoid: tuple[str, ...] = (),
    ) -> list[LaunchedRank]:
        """Start every rank of ``generation``, off the nodes ``avoid`` names where the cluster
        has room elsewhere (what it did: ``placement``, a :class:`Placement`, where the group
        has one); raise :class:`LaunchError` if it cannot."""
        ...

    def poll(self) -> list[RankPoll]:
        """One result per rank that answered; never blocks long."""
        ...

    def kill(self, grace_s: float = 0.0) -> KillReport:
        """Kill every reachable rank's process tree."""
        ...

    def request(self, payload: dict[str, Any]) -> int:
        """Send ``payload`` to every rank of the current generation (the rank's SDK reads it at its
        next step); returns how many ranks it reached."""
        ...

    def standby(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        fence_file: str,
        ckpt_dir: str,
    ) -> StandbyChange | None:
        """Keep the standby of ``generation`` ready (only called with the job's ``standby``);
        what changed, for the journal."""
        ...
