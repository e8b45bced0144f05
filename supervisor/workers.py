"""The worker group: one :class:`RankAgent` Ray actor per rank, gang-scheduled.

All ranks are placed together with a placement group (all bundles or none),
so a job never half-starts. Each launch is a new *generation* with a fresh
``MASTER_PORT``; the agents stay up across generations (a relaunch takes
seconds), only the training processes are replaced.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spikeguard.workers import contract

from .agent import RankAgent


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSpec:
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


class LaunchError(RuntimeError):
    pass


class WorkerGroup:
    """Starts, polls and kills the ranks of one run on Ray."""

    def __init__(self, spec: GroupSpec, *, run_id: str, run_dir: str) -> None:
        self.spec = spec
        self.run_id = run_id
        self.run_dir = os.path.abspath(run_dir)
        self._pg: Any = None
        self._agents: list[Any] = []
        self._nodes: list[dict[str, Any]] = []

    def start(self) -> None:
        """Reserve the gang and start one agent per rank (no training process yet)."""
        s = self.spec
        bundle: dict[str, float] = {"CPU": s.cpus_per_worker}
        if s.gpus_per_worker:
            bundle["GPU"] = s.gpus_per_worker
        self._pg = placement_group([dict(bundle) for _ in range(s.world_size)], strategy=s.strategy,
                                   name=f"spikeguard-{self.run_id}")
        try:
            ray.get(self._pg.ready(), timeout=s.placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self._pg)
            raise LaunchError(f"could not place {s.world_size} workers with {bundle} each within "
                              f"{s.placement_timeout_s:.0f}s: the cluster lacks resources") from None
        actor_cls = ray.remote(RankAgent)
        self._agents = [
            actor_cls.options(
                num_cpus=0, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                                     placement_group_bundle_index=i),
            ).remote(i)
            for i in range(s.world_size)
        ]
        self._nodes = ray.get([a.node_info.remote() for a in self._agents], timeout=120)

    def launch(self, *, generation: int, cmd: list[str], env: dict[str, str], plan_path: str | None,
               fence_file: str, ckpt_dir: str) -> list[dict[str, Any]]:
        """Start generation ``generation``: a fresh master port, torchrun env per rank."""
        master_ip = self._nodes[0]["ip"]
        port = ray.get(self._agents[0].free_port.remote(), timeout=30)
        by_node: dict[str, list[int]] = {}
        for r, n in enumerate(self._nodes):
            by_node.setdefault(n["node_id"], []).append(r)
        calls = []
        for r, agent in enumerate(self._agents):
            peers = by_node[self._nodes[r]["node_id"]]
            rank_env = dict(env)
            rank_env.update({
                "RANK": str(r), "LOCAL_RANK": str(peers.index(r)), "WORLD_SIZE": str(self.spec.world_size),
                "LOCAL_WORLD_SIZE": str(len(peers)), "MASTER_ADDR": master_ip, "MASTER_PORT": str(port),
                contract.ENV_RUN_ID: self.run_id, contract.ENV_GENERATION: str(generation),
                contract.ENV_CKPT_DIR: ckpt_dir, contract.ENV_FENCE_FILE: fence_file,
            })
            if plan_path:
                rank_env[contract.ENV_RESUME] = plan_path
            log = os.path.join(self.run_dir, "logs", f"gen{generation:03d}-rank{r}.log")
            calls.append(agent.start.remote(generation=generation, cmd=cmd, env=rank_env,
                                            cwd=os.getcwd(), log_path=log))
        try:
            return ray.get(calls, timeout=60)
        except (RayActorError, GetTimeoutError) as e:
            raise LaunchError(f"launching generation {generation} failed: {e}") from e

    def poll(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """One poll result per reachable rank; an unreachable agent reads as exit code -9 (lost)."""
        refs = [a.poll.remote() for a in self._agents]
        out = []
        for r, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except (RayActorError, GetTimeoutError) as e:
                out.append({"rank": r, "generation": None, "lines": [], "overflow": 0, "exit": -9,
                            "rx_age_s": None, "pid": None, "lost": f"{type(e).__name__}: {e}"[:300]})
        return out

    def kill(self, grace_s: float = 0.0) -> float:
        """Kill every rank's process tree; returns the wall time it took (agents stay up)."""
        t0 = time.monotonic()
        refs = [a.kill.remote(grace_s) for a in self._agents]
        for ref in refs:
            try:
                ray.get(ref, timeout=grace_s + 30)
            except (RayActorError, GetTimeoutError):
                pass
        return time.monotonic() - t0

    def shutdown(self) -> None:
        if self._agents:
            self.kill()
        for a in self._agents:
            try:
                ray.kill(a)
            except (RayActorError, ValueError):
                pass
        self._agents = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def python_cmd(script: str, args: list[str]) -> list[str]:
    """The command a rank runs: this interpreter on the script (or ``-m module``)."""
    if script.startswith("-m "):
        return [sys.executable, "-m", script[3:].strip(), *args]
    return [sys.executable, script, *args]
