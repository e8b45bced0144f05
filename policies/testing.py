"""Builders for synthetic message streams: test a policy without training anything.

Each builder returns one message in the shape ``workers/contract.py`` documents (plus the
supervisor's ``exit`` and ``hang``). ``at`` defaults to the step (one second per step), which
keeps time-based durations easy to reason about in tests::

    from spikeguard.policies import load_policy, replay
    from spikeguard.policies.testing import heartbeat, report

    msgs = [heartbeat(0, s, loss=2.0) for s in range(100)] + [heartbeat(0, 100, loss=float("nan"))]
    assert [d.rule for d in replay(load_policy("default"), msgs)] == ["non-finite"]
"""

from __future__ import annotations

from typing import Any

from spikeguard.workers.contract.messages import FORMAT_VERSION
from spikeguard.workers.contract.signals import summarize


def _base(kind: str, rank: int, step: int, gen: int, at: float | None) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "type": kind,
        "run": "test",
        "gen": gen,
        "rank": rank,
        "step": step,
        "t": 1.7e9 + step,
        "at": float(max(step, 0)) if at is None else at,
    }


def hello(
    rank: int = 0, *, world_size: int = 1, step: int = 0, gen: int = 0, at: float | None = None
) -> dict[str, Any]:
    return {
        **_base("hello", rank, step, gen, at),
        "world_size": world_size,
        "pid": 1000 + rank,
        "host": "test",
        "sample_every": 1,
    }


def heartbeat(
    rank: int,
    step: int,
    *,
    loss: float | None = 2.0,
    grad_norm: float | None = 1.0,
    lr: float | None = 1e-3,
    step_time: float | None = None,
    gen: int = 0,
    at: float | None = None,
) -> dict[str, Any]:
    """A heartbeat; ``step_time`` (seconds the rank computed in the step) only when given, as
    the SDK leaves it out when it does not measure it."""
    out = {
        **_base("heartbeat", rank, step, gen, at),
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
    }
    if step_time is not None:
        out["step_time"] = step_time
    return out


def report(
    rank: int,
    step: int,
    layers: dict[str, dict[str, float]] | None = None,
    *,
    summary: dict[str, Any] | None = None,
    loss: float | None = 2.0,
    grad_norm: float | None = 1.0,
    lr: float | None = 1e-3,
    step_time: float | None = None,
    gen: int = 0,
    at: float | None = None,
    **signals: float,
) -> dict[str, Any]:
    """A sampled report. ``report(0, 500, grade=6)`` puts the keyword signals on one layer
    ``blocks.0``; pass ``layers`` for several. The summary is aggregated as the SDK does;
    ``step_time`` as for :func:`heartbeat`."""
    if layers is None:
        layers = {"blocks.0": dict(signals)}
    if summary is None:
        summary = summarize(layers)
    out = {
        **_base("report", rank, step, gen, at),
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "layers": layers,
        "summary": summary,
    }
    if step_time is not None:
        out["step_time"] = step_time
    return out


def exit_(
    rank: int, code: int, *, step: int = -1, gen: int = 0, at: float | None = None
) -> dict[str, Any]:
    """The supervisor's ``exit`` message (``step`` -1: the rank never reported one)."""
    return {**_base("exit", rank, step, gen, at), "code": code}


def hang(
    rank: int, age_s: float, *, step: int = -1, gen: int = 0, at: float | None = None
) -> dict[str, Any]:
    """The supervisor's ``hang`` message."""
    return {**_base("hang", rank, step, gen, at), "age_s": age_s}


def done(rank: int, step: int, *, gen: int = 0, at: float | None = None) -> dict[str, Any]:
    return _base("done", rank, step, gen, at)


def checkpoint(
    rank: int, step: int, *, gen: int = 0, grade: int | None = 6, at: float | None = None
) -> dict[str, Any]:
    """A rank's ``checkpoint`` message: it published a checkpoint of ``step``."""
    return {
        **_base("checkpoint", rank, step, gen, at),
        "path": f"ckpt-step{step:08d}-gen{gen:03d}-rank{rank}.pt",
        "grade": grade,
    }
