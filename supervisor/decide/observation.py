"""What an accepted message means to the recovery machine: pure, no Ray, no I/O.

The policy engine turns a message into decisions; :func:`observation_of` turns one decision into
the machine's observation (with what its events should say: the rank's values, the chart's
recent samples, an exit's code and log tail); :func:`observations_of` adds what the message
itself tells the machine (a checkpoint a request waited for, a rank's exit). The controller
hands each to the machine in that order and decides nothing itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import recovery as rc
from .events import jsonable
from .health import MACHINE_SIGNALS

FAULTS = frozenset({"exit", "hang"})
"""Message types that are faults of the process (a crash, a hang), not a training signal. A
recover decision on one, or on a signal of the machine (:data:`~.health.MACHINE_SIGNALS`: a
straggler), is a fault: its rollback takes the newest checkpoint that verifies, of any grade."""
CHART_KEYS = ("step", "grade", "attn_entropy_min", "loss", "max_logit")
"""The samples an incident's chart shows, most recent 60 of the rank that fired."""
CHART_SAMPLES = 60


def observation_of(
    decision: Any,
    msg: dict[str, Any],
    *,
    views: Mapping[int, Any],
    history: Iterable[dict[str, Any]],
    nodes: tuple[str, ...] = (),
) -> rc.Observation:
    """The machine's observation for an engine ``decision`` on ``msg``.

    ``views``: the collector's per-rank views (loss, grad norm, summary grade, step);
    ``history``: the collector's recent samples, for the chart; ``nodes``: the Ray node id of
    each rank of the generation (:attr:`~.recovery.State.nodes`), so that what the decision says
    of a rank names its node too. A recover decision carries its rule's recovery settings
    (``decision.recovery``: the policy's, with the rule's overrides)."""
    d = decision
    details: dict[str, Any] = {
        "action": d.action,
        "severity": d.severity,
        "signal": d.signal,
        "value": jsonable(d.value),
        "rank": d.rank,
        "layer": d.layer,
    }
    if isinstance(d.rank, int) and 0 <= d.rank < len(nodes) and nodes[d.rank]:
        details["node_id"] = nodes[d.rank]
    if d.action == "stop":
        return rc.StopRequested(f"policy rule {d.rule}: {d.reason}")
    if d.action == "checkpoint" and not d.resolved:
        details.update(rule=d.rule, step=d.step)
        return rc.CheckpointWanted(d.reason, details=details)
    if d.action != "recover":  # notify (or a checkpoint rule that resolved): an alert
        details.update(rule=d.rule, step=d.step, repeated=bool(d.repeated))
        return rc.Notify(d.reason, resolved=bool(d.resolved), details=details)
    view = views.get(d.rank) if d.rank is not None else None
    details.update(
        loss=jsonable(view.loss if view else msg.get("loss")),
        grad_norm=jsonable(view.grad_norm if view else msg.get("grad_norm")),
        grade=view.summary.get("grade") if view else None,
        context=chart_context(history, d.rank),
    )
    if msg["type"] == "exit":
        details.update(exit_code=msg.get("code"), log_tail=msg.get("log_tail", ""))
        if msg.get("lost"):
            details["lost"] = msg["lost"]
    elif msg["type"] == "hang":
        details.update(
            first_heartbeat=bool(msg.get("first")),
            heartbeat_age_s=msg.get("age_s"),
            timeout_s=msg.get("timeout_s"),
        )
    steps = [v.step for v in views.values() if v.step is not None]
    return rc.Recover(
        d.rule,
        d.reason,
        d.step,
        rc.Settings.from_policy(d.recovery),
        details=details,
        fault=msg["type"] in FAULTS or d.signal in MACHINE_SIGNALS,
        furthest_step=max(steps) if steps else None,
    )


def chart_context(history: Iterable[dict[str, Any]], rank: int | None) -> dict[str, list[Any]]:
    """The recent samples of the rank that fired (rank 0 for run-wide rules), for the chart."""
    want = 0 if rank is None else rank
    everything = list(history)
    hist = [h for h in everything if h["rank"] == want] or everything
    return {
        k + ("s" if k == "step" else ""): [jsonable(h.get(k)) for h in hist[-CHART_SAMPLES:]]
        for k in CHART_KEYS
    }


def observations_of(msg: dict[str, Any], generation: int) -> list[rc.Observation]:
    """What ``msg`` itself tells the machine, after the engine's decisions on it: a published
    checkpoint answers the requests it names; an exit is a rank that ended."""
    if msg["type"] == "checkpoint":
        return [
            rc.CheckpointSaved(request_id, str(msg.get("path")), msg["step"])
            for request_id in msg.get("requests") or ()
        ]
    if msg["type"] == "exit":
        keys = ("step", "log_tail", "lost", "host")
        return [
            rc.RankExited(
                rank=msg["rank"],
                generation=generation,
                code=msg["code"],
                first=bool(msg.get("first")),
                teardown_code=msg.get("teardown_code"),
                details={k: msg[k] for k in keys if k in msg},
            )
        ]
    return []
