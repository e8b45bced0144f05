"""Which nodes a run should leave out: pure, no Ray, no NVML, no I/O.

Three things make a rank's node suspect (:class:`~.recovery.NodeSuspect`), and the recovery
machine excludes a suspect node from every later placement of the run (``node_excluded``):

* **lost**: the rank's agent is gone (its node died, was removed, froze): an ``exit`` message
  with ``lost`` (:func:`suspects_of`);
* **straggler**: a recover decision of a rule on a straggler signal (:data:`STRAGGLER_SIGNALS`)
  that names a rank: only when the rule recovers, never for a notify (:func:`suspects_of`); a
  recover decision on an accelerator signal (``gpu_*``) makes the node **unhealthy** the same
  way;
* **unhealthy**: the rank's accelerators failed a health check (:func:`health_failure`: a GPU
  fallen off the bus, an uncorrectable ECC error), read by its agent from NVML and carried by
  its poll (:func:`health_suspects`). Throttling and XID errors are signals, not failures.

The controller hands these to the machine before the decisions of the same message, so the
relaunch that a recovery starts at once already avoids the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from spikeguard.workers.contract.signals import AGENT_SIGNALS

from . import recovery as rc

STRAGGLER_SIGNALS = frozenset({"step_time"})
"""Signals whose recover decision blames the rank it names, and so that rank's node (a rule on
a rank's step time is a straggler rule)."""

GPU_SIGNALS = tuple(AGENT_SIGNALS)
"""The accelerator signals a rank agent reports from NVML (see
:func:`spikeguard.supervisor.launch.nvml.signals_of`) that policies read (declared in
``workers/contract/signals.py``); none on a machine without NVML."""
MACHINE_SIGNALS = STRAGGLER_SIGNALS | frozenset(GPU_SIGNALS)
"""Signals of the machine a rank runs on, not of the model it trains: a recovery a rule on one of
them decides is a fault of the process's kind (a crash, a hang), not a numerical one. It restarts
from the newest checkpoint that verifies, whatever its grade (the model was healthy), with the
rule's LR and optimizer settings; its relaunch leaves the rank's node out."""


def suspects_of(
    msg: Mapping[str, Any], decisions: Iterable[Any], generation: int
) -> list[rc.NodeSuspect]:
    """The nodes an accepted message of ``generation`` and the engine's decisions on it make
    suspect: a lost agent's rank; the rank a recovering straggler rule names."""
    out: list[rc.NodeSuspect] = []
    rank = msg.get("rank")
    if msg.get("type") == "exit" and msg.get("lost") and isinstance(rank, int):
        out.append(rc.NodeSuspect(rank, generation, "lost", f"agent lost: {msg['lost']}"))
    for d in decisions:
        if d.action != "recover" or d.resolved or d.rank is None:
            continue
        if d.signal in MACHINE_SIGNALS:
            why = f"policy rule {d.rule}: {d.reason}"
            kind = "straggler" if d.signal in STRAGGLER_SIGNALS else "unhealthy"
            out.append(rc.NodeSuspect(int(d.rank), generation, kind, why))
    return out


def health_failure(signals: Mapping[str, Any] | None) -> str | None:
    """Why a rank's accelerator signals fail its health check, or None (no signals: no NVML, no
    verdict)."""
    if not signals:
        return None
    if signals.get("gpu_lost"):
        return "a GPU fell off the bus (NVML: GPU is lost)"
    ecc = signals.get("gpu_ecc_errors") or 0
    if ecc > 0:
        return f"{ecc} uncorrectable ECC error{'s' if ecc != 1 else ''} (NVML)"
    return None


def health_suspects(polls: Iterable[Any], generation: int) -> list[rc.NodeSuspect]:
    """The ranks of ``generation`` whose latest poll carries accelerator signals that fail the
    health check (polls: :class:`~spikeguard.supervisor.launch.interface.RankPoll`)."""
    out = []
    for p in polls:
        why = health_failure(getattr(p, "health", None))
        if why is not None and p.generation == generation:
            out.append(rc.NodeSuspect(p.rank, generation, "unhealthy", why))
    return out
