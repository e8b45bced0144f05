"""Find and kill rank processes that outlived their generation.

A rank process can survive its generation: its node froze (the agent could
not kill it), its agent's node was removed, or the supervisor itself died
(the agents died with it; the ranks run in their own sessions and go on).
Such a process is fenced (its checkpoint writes are refused by ``FENCE``,
its reports by generation), and this module kills it by pid as soon as its
host is reachable: before every launch and every ``reap_interval_s``.

A process belongs to a run when its environment has the run's
``SPIKEGUARD_FENCE_FILE`` (``RUN_DIR/FENCE``, an absolute path, so two runs
never match each other; their checkpoint directory may be one URL of an
object store) and a ``SPIKEGUARD_GENERATION``; reading
``/proc/PID/environ`` identifies it exactly, so a recycled pid is never
killed by mistake. Linux only (elsewhere nothing is found).
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

from spikeguard.workers import contract


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def find(fence_file: str, below_generation: int) -> list[dict[str, Any]]:
    """This host's processes of the run whose fence file is ``fence_file`` and whose
    generation is below ``below_generation``."""
    out = []
    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == me:
            continue
        env = _environ(pid)
        if env.get(contract.ENV_FENCE_FILE) != fence_file:
            continue
        try:
            gen = int(env.get(contract.ENV_GENERATION, ""))
        except ValueError:
            continue
        if gen < below_generation:
            out.append(
                {
                    "pid": pid,
                    "generation": gen,
                    "rank": env.get("RANK"),
                    "host": socket.gethostname(),
                    "state": _state(pid),
                }
            )
    return out


def kill_stale(fence_file: str, below_generation: int) -> list[dict[str, Any]]:
    """SIGKILL (works on stopped processes too) what :func:`find` returns; returns what was
    killed."""
    killed = []
    for proc in find(fence_file, below_generation):
        pid = proc["pid"]
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)  # the rank's own session: its children too
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        killed.append(proc)
    return killed


def reap(
    fence_file: str, below_generation: int, *, remote: bool = True, timeout_s: float = 20.0
) -> list[dict[str, Any]]:
    """Kill the run's stale processes on this host and, with Ray up, on every other live host.

    One Ray task per distinct host address (num_cpus=0, pinned to a node there); hosts that do
    not answer within ``timeout_s`` are skipped this time (they are tried again next sweep).
    """
    found = kill_stale(fence_file, below_generation)
    if not remote:
        return found
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            return found
        here = {ray.util.get_node_ip_address(), "127.0.0.1"}
        targets: dict[str, str] = {}
        for n in ray.nodes():
            addr = n.get("NodeManagerAddress")
            if n.get("Alive") and addr and addr not in here:
                targets.setdefault(addr, n["NodeID"])
        if not targets:
            return found
        task = ray.remote(num_cpus=0, max_retries=0)(kill_stale)
        refs = [
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False)
            ).remote(fence_file, below_generation)
            for nid in targets.values()
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                found.extend(ray.get(ref))
            except Exception:  # a host that died meanwhile: next sweep
                pass
    except Exception:  # reaping is best effort; fencing already protects the run
        pass
    return found
