"""The words and links a pager shows, from the one describer (:mod:`...observe.describe`).

A page's title is its incident's opening story line with where it stands (``[RECOVERING]``,
``[ESCALATED]``, ``[ACKNOWLEDGED]``); its text the latest story line; its links the runbook and
dashboard a policy's ``notify.slack`` names. Pure functions of the followed incident.
"""

from __future__ import annotations

from typing import Any

from ...decide.lifecycle import IncidentState, Outcome
from ...observe.describe import describe
from .follow import Followed


def status_of(f: Followed) -> str:
    """Where the page stands, in one word: RESOLVED, ESCALATED, HELD, ACKNOWLEDGED, FIRING
    (an alert) or the incident's state."""
    if f.over:
        return "STOPPED" if f.outcome is Outcome.STOPPED else "RESOLVED"
    if f.needs_human:
        return "ESCALATED" if f.state is IncidentState.ESCALATED else "HELD"
    if f.acknowledged is not None:
        return "ACKNOWLEDGED"
    return "FIRING" if f.alert else f.state.value


def headline(f: Followed, run: str, limit: int = 1024) -> str:
    """``[STATUS] run inc-001: <the opening story line>``, at most ``limit`` characters."""
    what = "" if f.alert else f" {f.id}"
    text = f"[{status_of(f)}] {run}{what}: {describe(f.opened)}"
    return clip(text, limit)


def latest(f: Followed, limit: int = 1024) -> str:
    """The latest story line of ``f`` (who acknowledged it, when they did)."""
    line = describe(f.last)
    if f.acknowledged is not None and f.last is not f.acknowledged:
        line += f" (acknowledged by {acknowledged_by(f)})"
    return clip(line, limit)


def acknowledged_by(f: Followed) -> str:
    """Who acknowledged ``f`` (and how), or ``—``."""
    ev = f.acknowledged or {}
    who = ev.get("who") or "—"
    via = ev.get("via")
    return f"{who} via {via}" if via else str(who)


def links(policy: Any) -> list[tuple[str, str]]:
    """``(text, url)`` of the runbook and the dashboard the policy's ``notify.slack`` names."""
    target = policy.notify.slack
    out = []
    if target.runbook_url:
        out.append(("Runbook", target.runbook_url))
    if target.dashboard_url:
        out.append(("Dashboard", target.dashboard_url))
    return out


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
