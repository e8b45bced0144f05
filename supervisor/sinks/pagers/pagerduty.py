"""The ``pagerduty`` sink: PagerDuty's Events API v2, on when ``SPIKEGUARD_PAGERDUTY_ROUTING_KEY``
is set (``SPIKEGUARD_PAGERDUTY_URL``: another base than https://events.pagerduty.com, a gateway).

One PagerDuty alert per incident, under the ``dedup_key`` ``spikeguard/RUN/INCIDENT`` (the same
after a supervisor restart, so a re-sent trigger lands on the same alert):

* ``trigger`` when an incident the routes send here opens (a page, by default), and whenever an
  incident escalates, fails or has its recovery held for a human, whatever its severity (a human
  is needed; only a rule whose own ``notify:`` leaves pagerduty out is kept off). A notify rule's
  alert routed here is a trigger too (``spikeguard/RUN/alert/RULE[/rank-N]``), resolved when the
  rule no longer holds. A run that fails with no incident open triggers ``spikeguard/RUN/run``.
* the trigger is sent again, with where the incident stands now, every ``repeat_intervals
  .pagerduty`` (else ``repeat_interval``) while it is open and nobody acknowledged it;
* ``acknowledge`` when someone acknowledges the incident in spikeguard (an ``operator`` event);
* ``resolve`` when it ends RESOLVED, SUPERSEDED or STOPPED: an escalated or failed incident stays
  open in PagerDuty for the human who takes it. At the run's end what is still open and needs no
  human (a notify rule's alert) is resolved.

Severities: page → critical, warn → warning, info → info; an incident that needs a human →
critical. The routing key is a secret: it is in each request's body and nowhere else (not in
the journal, the logs, nor an undelivered message's error).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.logs import logger

from ..registry import (
    BaseSink,
    Record,
    SinkContext,
    register,
    repeat_interval_s,
    rule_routes,
    severity_of,
    wants,
)
from .delivery import Message, Outbox, Retry, http_url
from .follow import RUN_LEVEL, Change, Follow, Followed
from .story import acknowledged_by, headline, latest, links, status_of

log = logger(__name__)

NAME = "pagerduty"
DEFAULT_URL = "https://events.pagerduty.com"
ENQUEUE = "/v2/enqueue"
SEVERITY = {"page": "critical", "warn": "warning", "info": "info"}
"""PagerDuty's severity of each policy severity."""
NEEDS_HUMAN_SEVERITY = "critical"
"""An escalation, a failure, a recovery held for a human."""
MAX_SUMMARY = 1024
MAX_DEDUP_KEY = 255


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagerDutySettings:
    """How to reach PagerDuty. Build it with :meth:`from_env`."""

    routing_key: str = dataclasses.field(repr=False)
    """The integration's routing key, only ever from ``SPIKEGUARD_PAGERDUTY_ROUTING_KEY``."""
    url: str = DEFAULT_URL + ENQUEUE
    """The enqueue endpoint (``SPIKEGUARD_PAGERDUTY_URL`` + ``/v2/enqueue``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PagerDutySettings | None:
        """The settings the environment gives; None when no routing key is set. A URL that is
        not http(s) is refused (ValueError)."""
        env = os.environ if environ is None else environ
        key = (env.get("SPIKEGUARD_PAGERDUTY_ROUTING_KEY") or "").strip()
        if not key:
            return None
        base = (env.get("SPIKEGUARD_PAGERDUTY_URL") or DEFAULT_URL).strip()
        if not http_url(base):
            raise ValueError("SPIKEGUARD_PAGERDUTY_URL must be an http(s) URL")
        base = base.rstrip("/")
        return cls(routing_key=key, url=base if base.endswith(ENQUEUE) else base + ENQUEUE)


def dedup_key(run: str, followed_id: str) -> str:
    """``spikeguard/RUN/ID``; a longer one than PagerDuty takes (255) ends in a digest."""
    key = f"spikeguard/{run}/{followed_id}"
    if len(key) <= MAX_DEDUP_KEY:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return key[: MAX_DEDUP_KEY - 17] + "~" + digest


def pd_severity(f: Followed) -> str:
    """PagerDuty's severity for ``f`` now (critical once a human is needed)."""
    if f.needs_human:
        return NEEDS_HUMAN_SEVERITY
    return SEVERITY[severity_of(f.opened)]


def pages_human(policy: Any, f: Followed) -> bool:
    """Whether a human being needed for ``f`` pages PagerDuty: unless its rule's own
    ``notify:`` leaves pagerduty out."""
    return rule_routes(policy, NAME).get(str(f.opened.get("rule")), True)


def _iso(value: Any, wall: float) -> str:
    if isinstance(value, str) and value:
        return value
    return _dt.datetime.fromtimestamp(wall, _dt.timezone.utc).isoformat(timespec="milliseconds")


def trigger_document(
    f: Followed,
    *,
    routing_key: str,
    run: str,
    policy: Any,
    source: str,
    run_dir: Path | None,
    wall: float,
) -> dict[str, Any]:
    """The Events v2 ``trigger`` for ``f`` as it stands now."""
    opened = f.opened
    rank, layer = opened.get("rank"), opened.get("layer")
    details = {
        "run": run,
        "incident": None if f.alert or f.id == RUN_LEVEL else f.id,
        "status": status_of(f),
        "latest": latest(f),
        "rule": opened.get("rule"),
        "signal": opened.get("signal"),
        "value": opened.get("value"),
        "rank": rank,
        "layer": layer,
        "step": opened.get("step"),
        "severity": opened.get("severity"),
        "acknowledged_by": acknowledged_by(f) if f.acknowledged else None,
        "run_dir": str(run_dir) if run_dir else None,
    }
    payload: dict[str, Any] = {
        "summary": headline(f, run, MAX_SUMMARY),
        "source": source,
        "severity": pd_severity(f),
        "timestamp": _iso(opened.get("time"), wall),
        "group": run,
        "class": str(opened.get("rule") or opened.get("kind") or "incident"),
        "custom_details": {k: v for k, v in details.items() if v is not None},
    }
    component = layer or (f"rank {rank}" if rank is not None else None)
    if component:
        payload["component"] = str(component)
    doc: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "trigger",
        "dedup_key": dedup_key(run, f.id),
        "payload": payload,
        "client": "spikeguard",
    }
    hrefs = links(policy)
    if hrefs:
        doc["links"] = [{"href": url, "text": text} for text, url in hrefs]
        doc["client_url"] = dict(hrefs).get("Dashboard", hrefs[0][1])
    return doc


class PagerDutySink(BaseSink):
    """Sends a run's incidents to PagerDuty (see the module docstring)."""

    def __init__(
        self,
        settings: PagerDutySettings,
        *,
        run: str,
        policy: Any,
        journal: Record,
        run_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        retry: Retry | None = None,
        source: str | None = None,
    ) -> None:
        """Page for the run ``run`` under ``policy`` (routes, repeat intervals, links);
        ``journal`` records what cannot be delivered; ``clock`` paces the repeats."""
        self.settings, self.run, self.policy = settings, run, policy
        self.run_dir, self._clock, self._wall = run_dir, clock, wall
        self.source = source or f"{socket.gethostname()}/{run}"
        self.repeat_s = repeat_interval_s(policy.notify, NAME)
        self.follow = Follow(lambda ev: wants(policy, NAME, ev))
        self._triggered: dict[str, float] = {}
        """Ids with an open PagerDuty alert, and when their trigger was last sent."""
        self.outbox = Outbox(NAME, journal, retry=retry, secrets=(settings.routing_key,))

    # ------------------------------------------------------------------ the sink
    def handle(self, event: dict[str, Any]) -> None:
        """Queue what ``event`` asks of PagerDuty; returns at once."""
        for change in self.follow.apply(event):  # the controller guards every sink's handle
            self._act(change)

    def restore(self, events: list[dict[str, Any]]) -> None:
        """Fold a dead supervisor's journal without sending; then trigger again each incident
        still open that was paged and nobody acknowledged (the same ``dedup_key``: PagerDuty
        keeps one alert), in case the dead one's trigger never got out."""
        for ev in events:
            for change in self.follow.apply(ev):
                f = change.followed
                if f.over:
                    self._triggered.pop(f.id, None)
                elif self._pages(change):
                    self._triggered[f.id] = self._clock()
                if f.alert:
                    f.live = False
        for fid in list(self._triggered):
            f = self.follow.followed[fid]
            if not f.alert and f.acknowledged is None:
                self._trigger(f)

    def tick(self, ctl: Any) -> None:
        """Send the trigger again of each open, unacknowledged incident whose repeat is due."""
        now = self._clock()
        for fid, sent in list(self._triggered.items()):
            f = self.follow.followed.get(fid)
            if f is None or f.over or f.acknowledged is not None:
                continue
            if now - sent >= self.repeat_s:
                self._trigger(f)

    def close(self, timeout_s: float = 10.0, *, ended: bool = False) -> None:
        """At the run's end, resolve what is open and needs no human; then deliver what is
        queued within ``timeout_s`` (the rest is journaled undelivered)."""
        if ended:
            for fid in list(self._triggered):
                f = self.follow.followed[fid]
                if not f.needs_human:
                    self._send("resolve", f)
                    self._triggered.pop(fid, None)
        self.outbox.close(timeout_s)

    # ------------------------------------------------------------------ decisions
    def _pages(self, change: Change) -> bool:
        """Whether ``change`` (an opening, a human being needed) triggers."""
        f = change.followed
        if change.what == "opened":
            return f.routed
        if change.what == "needs_human":
            return f.routed or pages_human(self.policy, f)
        return False

    def _act(self, change: Change) -> None:
        f = change.followed
        if change.what in ("opened", "needs_human"):
            if self._pages(change) or (change.what == "needs_human" and f.id in self._triggered):
                self._trigger(f)
        elif change.what == "acknowledged" and f.id in self._triggered:
            self._send("acknowledge", f)
        elif change.what == "over" and f.id in self._triggered:
            self._triggered.pop(f.id)
            self._send("resolve", f)

    # ------------------------------------------------------------------ effects
    def _trigger(self, f: Followed) -> None:
        self._triggered[f.id] = self._clock()
        doc = trigger_document(
            f,
            routing_key=self.settings.routing_key,
            run=self.run,
            policy=self.policy,
            source=self.source,
            run_dir=self.run_dir,
            wall=self._wall(),
        )
        self.outbox.send(self._message("trigger", f, doc))

    def _send(self, action: str, f: Followed) -> None:
        doc = {
            "routing_key": self.settings.routing_key,
            "event_action": action,
            "dedup_key": dedup_key(self.run, f.id),
        }
        self.outbox.send(self._message(action, f, doc))

    def _message(self, action: str, f: Followed, doc: dict[str, Any]) -> Message:
        incident = None if f.alert or f.id == RUN_LEVEL else f.id
        return Message(
            what=f"{f.id} {action}", url=self.settings.url, document=doc, incident=incident
        )


@register(NAME)
def pagerduty_sink(ctx: SinkContext) -> PagerDutySink | None:
    """A :class:`PagerDutySink` when ``SPIKEGUARD_PAGERDUTY_ROUTING_KEY`` is set."""
    try:
        settings = PagerDutySettings.from_env()
    except ValueError as e:
        log.warning("PagerDuty is configured but not usable (%s); not paging it", e)
        return None
    if settings is None:
        return None
    return PagerDutySink(
        settings,
        run=ctx.run_id,
        policy=ctx.policy,
        journal=ctx.record,
        run_dir=ctx.run_dir,
        clock=ctx.clock,
    )
