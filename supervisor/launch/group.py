"""The worker group: one :class:`RankAgent` Ray actor per rank, gang-scheduled.

All ranks are placed together with a placement group (all bundles or none),
so a job never half-starts. Each launch is a new *generation* with a fresh
``MASTER_PORT``; the agents stay up across generations (a relaunch takes
seconds), only the training processes are replaced. When an agent is lost
(its node removed, dead or frozen), the next launch rebuilds the whole group:
a new placement group and new agents, on the nodes that are alive then.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from spikeguard.workers import contract
from spikeguard.workers.contract.logs import logger

from .. import rundir
from . import reaper
from .agent import RankAgent
from .interface import (
    WAIT_REPORT_S,
    GroupSpec,
    KillReport,
    LaunchedRank,
    LaunchError,
    NodeInfo,
    Placement,
    RankKill,
    RankPoll,
    StandbyChange,
    WaitReport,
)
from .ray_init import ray_reachable
from .topology import Layout, rank_start, rank_variables

__all__ = ["GroupSpec", "LaunchError", "WorkerGroup", "python_cmd"]

log = logger(__name__)

STANDBY_MAX_FAILURES = 3
"""Standbys that die in a row (while waiting) before standby is given up for the run."""
ALL_GENERATIONS = 1 << 62
"""Above every generation number: :func:`.reaper.kill_stale` below it kills them all."""
NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node, its node id: what a placement's bundle label selector keeps
excluded nodes out by (``!in(id1,id2)``)."""


class WorkerGroup:
    """Starts, polls and kills the ranks of one run on Ray."""

    def __init__(self, spec: GroupSpec, *, run_id: str, run_dir: str) -> None:
        self.spec = spec
        self.run_id = run_id
        self.run_dir = os.path.abspath(run_dir)
        self._pg: Any = None
        self._agents: list[Any] = []
        self._nodes: list[NodeInfo] = []
        self._pending: dict[int, tuple[Any, float]] = {}  # rank -> (poll ref in flight, sent at)
        self._lost: dict[int, str] = {}  # rank -> why its agent is gone
        self._builds = 0
        self._generation: int | None = None
        self._standby_gen: int | None = None
        """The generation whose standby processes run on every rank (None: no standby)."""
        self._standby_dead: dict[int, tuple[int, str]] = {}
        """Ranks whose standby died while waiting: (exit code, log tail)."""
        self._standby_ready: set[int] = set()
        """Ranks whose standby has reported (waits for its release)."""
        self._standby_announced = False
        self._standby_failures = 0
        self._standby_off: str | None = None
        """Why standby was given up for the run (None: it is not)."""
        self._fence_file: str | None = None
        """The run's checkpoint directory, as its ranks got it: it tells their processes apart
        from every other process of the node (:mod:`.reaper`)."""
        self.on_wait: WaitReport | None = None
        """Told while a launch waits for its placement (set by the controller)."""
        self._avoid_tried: tuple[str, ...] = ()
        """The nodes the current gang was asked to avoid when it was placed."""
        self.placement: Placement | None = None
        """How the current gang was placed with respect to the nodes it was to avoid (None: no
        gang yet)."""
        self._working_dir = False
        """The job has a runtime-env working directory (Ray Jobs' ``--working-dir``): every node
        has its own copy, and each rank starts in its node's (see :func:`.topology.rank_start`)."""

    # -- the gang ----------------------------------------------------------------------------
    def _placed(self, bundle: dict[str, float]) -> bool:
        """Wait for the placement group to be placed, within ``placement_timeout_s``, telling
        :attr:`on_wait` how long it has waited (from the first second on) and when it is over;
        False when the time is up."""
        s, ready = self.spec, self._pg.ready()
        started = time.monotonic()
        what = f"{s.world_size} workers with {bundle} each ({s.strategy})"
        told = False
        try:
            while True:
                waited = time.monotonic() - started
                left = s.placement_timeout_s - waited
                if left <= 0:
                    return False
                done, _ = ray.wait([ready], timeout=min(WAIT_REPORT_S, left))
                if done:
                    ray.get(ready)
                    return True
                told = self._tell_wait(
                    {
                        "for": "placement",
                        "what": what,
                        "waited_s": round(time.monotonic() - started, 1),
                        "timeout_s": s.placement_timeout_s,
                    }
                )
        finally:
            if told:
                self._tell_wait(None)

    def _tell_wait(self, info: dict[str, Any] | None) -> bool:
        if self.on_wait is None:
            return False
        try:
            self.on_wait(info)
        except Exception as e:  # a view must never fail a launch
            log.warning("reporting the placement wait failed: %s", e)
        return True

    def _reserve(self, bundle: dict[str, float], avoid: tuple[str, ...]) -> bool:
        """Create the placement group, its bundles kept off the nodes ``avoid`` names (a label
        selector on Ray's node-id label), and wait for it; False (and no group) when it was not
        placed within ``placement_timeout_s``."""
        s = self.spec
        self._builds += 1
        selector = {}
        if avoid:
            selector["bundle_label_selector"] = [
                {NODE_ID_LABEL: f"!in({','.join(sorted(avoid))})"} for _ in range(s.world_size)
            ]
        self._pg = placement_group(
            [dict(bundle) for _ in range(s.world_size)],
            strategy=s.strategy,
            name=f"spikeguard-{self.run_id}-{self._builds}",
            **selector,
        )
        if self._placed(bundle):
            return True
        remove_placement_group(self._pg)
        self._pg = None
        return False

    def start(self, avoid: tuple[str, ...] = ()) -> None:
        """Reserve the gang and start one agent per rank (no training process yet), off the
        nodes ``avoid`` names when the cluster can place it elsewhere within the placement
        timeout; otherwise where it can (and :attr:`placement` says why)."""
        s = self.spec
        bundle: dict[str, float] = {"CPU": s.cpus_per_worker}
        if s.gpus_per_worker:
            bundle["GPU"] = s.gpus_per_worker
        self._avoid_tried, unavoided = tuple(sorted(avoid)), None
        placed = False
        if avoid:
            placed = self._reserve(bundle, self._avoid_tried)
            if not placed:
                unavoided = (
                    f"no placement of {s.world_size} workers with {bundle} each ({s.strategy}) "
                    f"off the {len(avoid)} excluded node(s) within {s.placement_timeout_s:.0f}s"
                )
                log.warning("%s: placing the gang where it fits, excluded nodes too", unavoided)
        if not placed and not self._reserve(bundle, ()):
            raise LaunchError(
                f"could not place {s.world_size} workers with {bundle} each ({s.strategy}) "
                f"within {s.placement_timeout_s:.0f}s (job placement.timeout_s): the cluster "
                "lacks the resources, or the nodes for this strategy"
            )
        self.placement = Placement(avoid=self._avoid_tried, unavoided=unavoided)
        actor_cls = ray.remote(RankAgent)
        # the agent takes its rank's GPUs from the bundle, so Ray assigns it device ids (and no
        # other run on the node gets them); the bundle's CPUs are left to the rank's process.
        # Named per run and rank, so the Ray dashboard says whose it is.
        self._agents = [
            actor_cls.options(
                name=f"spikeguard:{self.run_id}:b{self._builds}:rank{i}",
                num_cpus=0,
                num_gpus=s.gpus_per_worker,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                ),
            ).remote(i)
            for i in range(s.world_size)
        ]
        try:
            self._nodes = ray.get([a.node_info.remote() for a in self._agents], timeout=120)
        except (RayError, GetTimeoutError) as e:
            raise LaunchError(
                f"the rank agents did not start: {type(e).__name__}: {e}"[:500]
            ) from e
        self._pending, self._lost = {}, {}
        self._working_dir = _has_working_dir()

    def _healthy(self) -> bool:
        if self._lost or not self._agents:
            return False
        refs = [a.ping.remote() for a in self._agents]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
        if len(ready) < len(refs):
            return False
        try:
            ray.get(ready)
        except RayError:
            return False
        return True

    def rebuild(self, avoid: tuple[str, ...] = ()) -> None:
        """Drop the agents and the placement group; place a new gang on the nodes alive now
        (off the nodes ``avoid`` names, where it can)."""
        self._drop()
        self.start(avoid)

    def _must_move(self, avoid: tuple[str, ...]) -> bool:
        """The gang sits on a node it is now asked to avoid, and has not yet tried to avoid
        exactly these (a gang placed on them because nothing else fitted stays until the
        exclusions change or an agent is lost)."""
        if not avoid or tuple(sorted(avoid)) == self._avoid_tried:
            return False
        return any(n.node_id in avoid for n in self._nodes)

    def _drop(self) -> None:
        self._standby_gen, self._standby_dead = None, {}  # they go with their agents
        for a in self._agents:
            try:
                ray.kill(a, no_restart=True)
            except (RayError, ValueError):
                pass
        self._agents, self._pending, self._lost = [], {}, {}
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except RayError:
                pass
            self._pg = None

    def _pick_port(self) -> int:
        return int(ray.get(self._agents[0].free_port.remote(), timeout=30))

    # -- generations ---------------------------------------------------------------------------
    def _start_calls(
        self,
        method: str,
        generation: int,
        cmd: list[str],
        port: int,
        env: dict[str, str],
        plan_path: str | None,
        *,
        fence_file: str,
        ckpt_dir: str,
    ) -> list[Any]:
        """One ``agent.<method>`` call per rank (``start`` or ``start_standby``), each with its
        rank's environment and log file."""
        self._fence_file = fence_file
        envs = self._rank_envs(
            generation=generation,
            port=port,
            env=env,
            plan_path=plan_path,
            fence_file=fence_file,
            ckpt_dir=ckpt_dir,
        )
        here = os.getcwd()
        calls = []
        for agent, node, (rank_env, log) in zip(self._agents, self._nodes, envs):
            # each rank in its own node's copy of the job's working directory, if it has one
            rank_cmd, rank_cwd = rank_start(
                cmd, cwd=here, working_dir=self._working_dir, agent_cwd=node.cwd
            )
            calls.append(
                getattr(agent, method).remote(
                    generation=generation,
                    cmd=rank_cmd,
                    env=rank_env,
                    cwd=rank_cwd,
                    log_path=log,
                    pass_env=self.spec.pass_env,
                )
            )
        return calls

    def _rank_envs(
        self,
        *,
        generation: int,
        port: int,
        env: dict[str, str],
        plan_path: str | None,
        fence_file: str,
        ckpt_dir: str,
    ) -> list[tuple[dict[str, str], str]]:
        """Per rank: the environment of its process of ``generation`` and its log's path
        (created private first). Raises :class:`LaunchError` if a log cannot be created."""
        layout = Layout(
            run_id=self.run_id,
            generation=generation,
            master_addr=self._nodes[0].ip,
            master_port=port,
            gpus_per_worker=self.spec.gpus_per_worker,
            cpus_per_worker=self.spec.cpus_per_worker,
            omp_num_threads=env.get("OMP_NUM_THREADS"),
        )
        logs = os.path.join(self.run_dir, "logs")
        out = []
        for r, launcher in enumerate(rank_variables(self._nodes, layout)):
            rank_env = {**env, **launcher}
            rank_env.update(
                {
                    contract.ENV_CKPT_DIR: ckpt_dir,
                    contract.ENV_FENCE_FILE: fence_file,
                    "TORCHELASTIC_ERROR_FILE": os.path.join(
                        logs, f"gen{generation:03d}-rank{r}.error.json"
                    ),
                }
            )
            if plan_path:
                rank_env[contract.ENV_RESUME] = plan_path
            log = os.path.join(logs, f"gen{generation:03d}-rank{r}.log")
            try:  # private (0600 in a 0700 logs/) before the agent appends to it
                rundir.private_log(Path(log))
            except (OSError, rundir.UnsafePath) as e:
                raise LaunchError(f"cannot create the log of rank {r}: {e}"[:500]) from e
            out.append((rank_env, log))
        return out

    def _drain_pending(self) -> None:
        """A slow poll still in flight must drain the old generation, not the new one."""
        if self._pending:
            ray.wait(
                [ref for ref, _ in self._pending.values()],
                num_returns=len(self._pending),
                timeout=2.0,
            )
            self._pending = {}

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
        """Start generation ``generation``: the standby of that generation released if there is
        a live one (:meth:`standby`), otherwise fresh processes on a fresh master port.

        Rebuilds the gang first if an agent was lost, or if it sits on a node ``avoid`` names
        (the run's excluded nodes: :meth:`start` keeps the new gang off them where it can).
        Raises :class:`LaunchError` when the gang cannot be placed or started.
        """
        try:
            if not self._healthy() or self._must_move(avoid):
                self.rebuild(avoid)
            elif self.placement is not None and self.placement.avoid != tuple(sorted(avoid)):
                self.placement = Placement(avoid=tuple(sorted(avoid)))  # off them already
            released = self._release(generation, plan_path)
            if released is not None:
                self._drain_pending()
                self._pending, self._generation = {}, generation
                return released
            port = self._pick_port()
        except (RayError, GetTimeoutError) as e:
            raise LaunchError(
                f"preparing generation {generation} failed: {type(e).__name__}: {e}"[:500]
            ) from e
        self._drain_pending()
        calls = self._start_calls(
            "start", generation, cmd, port, env, plan_path, fence_file=fence_file, ckpt_dir=ckpt_dir
        )
        try:
            started = ray.get(calls, timeout=60)
        except (RayError, GetTimeoutError) as e:
            raise LaunchError(
                f"launching generation {generation} failed: {type(e).__name__}: {e}"[:500]
            ) from e
        self._pending, self._generation = {}, generation
        return list(started)

    # -- the warm standby ------------------------------------------------------------------------
    def standby(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        fence_file: str,
        ckpt_dir: str,
    ) -> StandbyChange | None:
        """Keep a standby of ``generation`` (the next one) ready on every rank: start it if there
        is none, replace it if one of its processes died, discard one of another generation.
        Returns what changed (for the journal), None when nothing did. Called by the controller
        while a generation trains; never raises (a standby is an optimisation)."""
        if self._lost or not self._agents or self._standby_off is not None:
            return None
        if self._standby_gen is not None and self._standby_gen != generation:
            old = self._standby_gen
            self._kill_standby()
            return StandbyChange(
                what="discarded",
                generation=old,
                reason=f"generation {generation} is the next one now",
            )
        if self._standby_gen is not None and self._standby_dead:
            rank, (code, tail) = min(self._standby_dead.items())
            self._kill_standby()
            self._standby_failures += 1
            if self._standby_failures >= STANDBY_MAX_FAILURES:
                self._standby_off = (
                    f"{self._standby_failures} standbys in a row died while waiting; "
                    f"the last: rank {rank} exited {code}"
                )
                return StandbyChange(
                    what="disabled",
                    generation=generation,
                    reason=self._standby_off,
                    rank=rank,
                    exit_code=code,
                    log_tail=tail,
                )
            return StandbyChange(
                what="lost",
                generation=generation,
                reason=f"rank {rank}'s standby exited {code} while waiting; replacing it",
                rank=rank,
                exit_code=code,
                log_tail=tail,
            )
        if self._standby_gen == generation:
            if self._standby_announced or len(self._standby_ready) < len(self._agents):
                return None
            self._standby_announced = True
            return StandbyChange(
                what="ready",
                generation=generation,
                reason=f"every rank's standby of generation {generation} waits for its release",
            )
        try:
            port = self._pick_port()
            calls = self._start_calls(
                "start_standby",
                generation,
                cmd,
                port,
                env,
                None,
                fence_file=fence_file,
                ckpt_dir=ckpt_dir,
            )
            started: list[LaunchedRank] = ray.get(calls, timeout=60)
        except (RayError, GetTimeoutError, LaunchError) as e:
            self._kill_standby()
            self._standby_failures += 1
            why = f"starting the standby failed: {type(e).__name__}: {e}"[:500]
            if self._standby_failures >= STANDBY_MAX_FAILURES:
                self._standby_off = why
            return StandbyChange(
                what="disabled" if self._standby_off else "lost",
                generation=generation,
                reason=why,
            )
        self._standby_gen, self._standby_dead = generation, {}
        self._standby_ready, self._standby_announced = set(), False
        return StandbyChange(
            what="started",
            generation=generation,
            reason=f"standby of generation {generation} started on port {port}",
            pids=tuple(r.pid for r in started),
            port=port,
        )

    def _release(self, generation: int, plan_path: str | None) -> list[LaunchedRank] | None:
        """Release the standby of ``generation`` on every rank; None (and any standby killed)
        when there is no complete, live one."""
        if self._standby_gen is None:
            return None
        if self._standby_gen != generation or self._standby_dead:
            self._kill_standby()
            return None
        refs = [a.release.remote(generation=generation, plan_path=plan_path) for a in self._agents]
        released = ray.get(refs, timeout=30)
        self._standby_gen = None
        if any(r is None for r in released):
            self._kill_standby()  # a partial gang cannot train: every rank starts cold
            self._kill_released(released)
            return None
        self._standby_failures = 0
        return list(released)

    def _kill_released(self, released: list[LaunchedRank | None]) -> None:
        refs = [a.kill.remote() for a, r in zip(self._agents, released) if r is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=15)

    def _kill_standby(self) -> None:
        """Kill every rank's standby (best effort; a standby also exits when fenced)."""
        self._standby_gen, self._standby_dead = None, {}
        refs = [a.kill_standby.remote() for r, a in enumerate(self._agents) if r not in self._lost]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=15)

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        """One poll result per rank that answered; a lost agent reads as exit code -9 with ``lost``.

        Never waits longer than ``timeout_s``: a slow agent's poll stays in flight and is collected
        by a later call; one silent for ``agent_timeout_s`` (frozen node) is declared lost.
        """
        now = time.monotonic()
        for r, a in enumerate(self._agents):
            if r not in self._pending and r not in self._lost:
                self._pending[r] = (a.poll.remote(), now)
        refs = [ref for ref, _ in self._pending.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
        out: list[RankPoll] = []
        for r, (ref, sent) in sorted(self._pending.items()):
            if ref in ready:
                del self._pending[r]
                try:
                    poll: RankPoll = ray.get(ref)
                except RayError as e:
                    out.append(self._mark_lost(r, f"{type(e).__name__}: {e}"))
                    continue
                out.append(poll)
                waiting = self._standby_gen is not None
                if (
                    waiting
                    and poll.standby_exit is not None
                    and poll.standby_generation == self._standby_gen
                ):
                    self._standby_dead[r] = (poll.standby_exit, poll.standby_tail)
                if waiting and poll.standby_ready and poll.standby_generation == self._standby_gen:
                    self._standby_ready.add(r)
            elif time.monotonic() - sent > self.spec.agent_timeout_s:
                del self._pending[r]
                out.append(
                    self._mark_lost(
                        r,
                        f"agent unresponsive for {self.spec.agent_timeout_s:.0f}s "
                        "(node frozen or partitioned)",
                    )
                )
        return out

    def _mark_lost(self, rank: int, why: str) -> RankPoll:
        """Remember that ``rank``'s agent is gone; its poll reads as the rank exiting with -9."""
        self._lost[rank] = why[:300]
        node = self._nodes[rank] if rank < len(self._nodes) else None
        return RankPoll(
            rank=rank,
            generation=self._generation,
            exit_code=-9,
            lost=self._lost[rank],
            node_id=node.node_id if node else None,
            host=node.host if node else None,
        )

    def kill(self, grace_s: float = 0.0) -> KillReport:
        """Kill every reachable rank's process tree (agents stay up).

        Ranks whose agent is lost or does not answer within ``grace_s + 15`` seconds are
        reported ``unreachable`` (fenced, reaped later by pid). When Ray itself is gone
        (:func:`.ray_init.ray_reachable`), the ranks on this node are killed by pid instead
        (:meth:`_kill_here`), the others reported unreachable.
        """
        t0 = time.monotonic()
        if self._agents and not ray_reachable():
            return self._kill_here(t0)
        refs = {
            r: a.kill.remote(grace_s) for r, a in enumerate(self._agents) if r not in self._lost
        }
        unreachable = set(self._lost)
        forced: list[int] = []
        ready: list[Any] = []
        if refs:
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=grace_s + 15.0)
        for r, ref in refs.items():
            if ref not in ready:
                unreachable.add(r)
                self._lost.setdefault(r, "agent did not answer the kill")
                continue
            try:
                res: RankKill = ray.get(ref)
            except RayError as e:
                unreachable.add(r)
                self._lost.setdefault(r, f"{type(e).__name__}: {e}"[:300])
                continue
            if res.forced:
                forced.append(r)
        return KillReport(
            duration_s=time.monotonic() - t0,
            forced=tuple(sorted(forced)),
            unreachable=tuple(sorted(unreachable)),
        )

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        """Send ``payload`` to every reachable rank (through its agent's report socket); returns
        how many ranks have it. Never waits longer than ``timeout_s``."""
        refs = [
            a.request.remote(payload) for r, a in enumerate(self._agents) if r not in self._lost
        ]
        if not refs:
            return 0
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        reached = 0
        for ref in ready:
            try:
                reached += 1 if ray.get(ref) else 0
            except RayError:
                continue
        return reached

    def _kill_local(self) -> list[dict[str, Any]]:
        """SIGKILL every process of this run on this node (ranks and standbys of any
        generation, told apart by their environment: :mod:`.reaper`); what was killed."""
        return reaper.kill_stale(self._fence_file, ALL_GENERATIONS) if self._fence_file else []

    def _kill_here(self, t0: float) -> KillReport:
        """Ray is gone: SIGKILL this run's rank processes on this node by pid (standbys too),
        found by their environment; ranks with none here are reported unreachable (fenced; the
        next supervisor reaps them)."""
        killed = self._kill_local()
        here = {int(p["rank"]) for p in killed if str(p.get("rank", "")).isdigit()}
        gone = set(range(len(self._agents))) - here
        for r in gone:
            self._lost.setdefault(r, "Ray is gone (its GCS does not answer)")
        return KillReport(duration_s=time.monotonic() - t0, unreachable=tuple(sorted(gone)))

    def shutdown(self) -> None:
        """Kill every rank and standby, drop the agents and the placement group. When Ray is
        gone, only what this node can do without it: its ranks killed by pid, nothing asked of
        Ray (a call needing the GCS would block 60 s, then end the process with exit 1)."""
        if not ray_reachable():
            if self._agents:
                killed = self._kill_local()
                log.warning(
                    "Ray is gone (its GCS does not answer: it got the same signal, or the "
                    "cluster's head went down): leaving without it; %d rank processes of this "
                    "run were still alive on this node, killed by pid",
                    len(killed),
                )
            self._agents, self._pending, self._pg = [], {}, None
            self._standby_gen, self._standby_dead = None, {}
            return
        if self._agents:
            try:
                self.kill()
                self._kill_standby()
            except RayError:
                pass
        self._drop()


def _has_working_dir() -> bool:
    """Whether this job runs with a runtime-env ``working_dir`` (Ray Jobs' ``--working-dir``, or
    one given to the driver's ``ray.init``): Ray then starts every worker of the job, the rank
    agents too, in its own node's copy of it."""
    try:
        return bool(ray.get_runtime_context().runtime_env.get("working_dir"))
    except (AttributeError, RuntimeError, RayError):
        return False


def python_cmd(script: str, args: list[str]) -> list[str]:
    """The command a rank runs: this interpreter on the script (or ``-m module``)."""
    if script.startswith("-m "):
        return [sys.executable, "-m", script[3:].strip(), *args]
    return [sys.executable, script, *args]
