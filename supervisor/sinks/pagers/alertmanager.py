"""The ``alertmanager`` sink: incidents as Prometheus Alertmanager alerts, on when
``SPIKEGUARD_ALERTMANAGER_URL`` is set (Alertmanager's base URL; alerts go to ``/api/v2/alerts``).

An incident the routes send here is one alert, ``alertname=SpikeguardIncident``; a notify rule's
alert is ``alertname=SpikeguardAlert``. Labels (strings, only those the event has): ``run``,
``rule``, ``severity``, ``rank``, ``layer``, ``incident`` — fixed at the opening, so every post is
the same alert to Alertmanager. Annotations: ``summary`` (where it stands and its opening story
line), ``description`` (the latest story line), ``status``, ``runbook_url`` and ``dashboard_url``
(the policy's ``notify.slack`` links), ``run_dir``, ``acknowledged_by``.

Alertmanager drops an alert whose ``endsAt`` passes, so each post says ``endsAt = now +
ttl_intervals × repost_s`` and :meth:`AlertmanagerSink.tick` re-posts every firing alert each
``repost_s`` (a keep-alive: repeating a notification is Alertmanager's own ``repeat_interval``).
An incident that ends RESOLVED, SUPERSEDED or STOPPED, and a notify rule that no longer holds, is
posted with ``endsAt = now``. One that escalates, fails or is held for a human stays firing: while
the supervisor waits, by the keep-alive; when the run ends, with ``endsAt = now + unattended_s``
(Alertmanager keeps paging its receivers until then, or until someone silences it) — ending it
at once would resolve an escalation before Alertmanager's ``group_wait`` let anyone hear of it.
Everything else still firing at the run's end is ended. A restarted supervisor
(:meth:`AlertmanagerSink.restore`) posts again what is still open.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.logs import logger

from ..registry import BaseSink, Record, SinkContext, register, wants
from .delivery import Message, Outbox, Retry, http_url
from .follow import Change, Follow, Followed
from .story import acknowledged_by, headline, latest, links, status_of

log = logger(__name__)

NAME = "alertmanager"
ALERTS = "/api/v2/alerts"
REPOST_S = 60.0
"""How often a firing alert is posted again (its keep-alive)."""
TTL_INTERVALS = 5
"""A post keeps its alert alive this many re-post intervals."""
UNATTENDED_S = 12 * 3600.0
"""How long an incident that needs a human stays firing after its run ended."""
LABELS = ("run", "rule", "severity", "rank", "layer", "incident")


def rfc3339(seconds: float) -> str:
    """``seconds`` (epoch) as Alertmanager's RFC 3339 UTC time."""
    t = _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(value: Any) -> float | None:
    """Epoch seconds of a journal ``time`` (ISO 8601); None when it is not one."""
    if not isinstance(value, str):
        return None
    try:
        t = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)).timestamp()


def labels_of(f: Followed, run: str) -> dict[str, str]:
    """The alert's identity: from its opening event, strings, only those present."""
    opened = f.opened
    values = {
        "run": run,
        "rule": opened.get("rule"),
        "severity": opened.get("severity"),
        "rank": opened.get("rank"),
        "layer": opened.get("layer"),
        "incident": None if f.alert else f.id,
    }
    out = {"alertname": "SpikeguardAlert" if f.alert else "SpikeguardIncident"}
    out.update({k: str(values[k]) for k in LABELS if values[k] is not None and values[k] != ""})
    return out


def alert_document(
    f: Followed, *, run: str, policy: Any, run_dir: Path | None, now: float, ends: float
) -> dict[str, Any]:
    """The posted alert for ``f`` as it stands, ending at ``ends`` (epoch seconds)."""
    notes: dict[str, str] = {
        "summary": headline(f, run),
        "description": latest(f),
        "status": status_of(f),
    }
    for text, url in links(policy):
        notes[f"{text.lower()}_url"] = url
    if run_dir is not None:
        notes["run_dir"] = str(run_dir)
    if f.acknowledged is not None:
        notes["acknowledged_by"] = acknowledged_by(f)
    starts = parse_time(f.opened.get("time")) or now
    doc: dict[str, Any] = {
        "labels": labels_of(f, run),
        "annotations": notes,
        "startsAt": rfc3339(min(starts, ends)),
        "endsAt": rfc3339(ends),
    }
    dashboard = policy.notify.slack.dashboard_url
    if dashboard:
        doc["generatorURL"] = dashboard
    return doc


class AlertmanagerSink(BaseSink):
    """Posts a run's incidents to Alertmanager (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        run: str,
        policy: Any,
        journal: Record,
        run_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        repost_s: float = REPOST_S,
        ttl_intervals: int = TTL_INTERVALS,
        unattended_s: float = UNATTENDED_S,
        retry: Retry | None = None,
    ) -> None:
        """Post to the Alertmanager at ``url`` (its base) for the run ``run`` under ``policy``;
        ``journal`` records what cannot be delivered; ``clock`` paces the keep-alives, ``wall``
        dates the alerts."""
        if repost_s <= 0 or ttl_intervals < 2:
            raise ValueError("repost_s must be > 0 and ttl_intervals at least 2")
        self.url = url.rstrip("/") + ALERTS
        self.run, self.policy, self.run_dir = run, policy, run_dir
        self._clock, self._wall = clock, wall
        self.repost_s, self.ttl_s, self.unattended_s = (
            repost_s,
            repost_s * ttl_intervals,
            unattended_s,
        )
        self.follow = Follow(lambda ev: wants(policy, NAME, ev))
        self.firing: dict[str, Followed] = {}
        """What Alertmanager has firing, by id."""
        self._reposted = clock()
        self.outbox = Outbox(NAME, journal, retry=retry)

    # ------------------------------------------------------------------ the sink
    def handle(self, event: dict[str, Any]) -> None:
        """Queue what ``event`` changes in Alertmanager; returns at once."""
        for change in self.follow.apply(event):  # the controller guards every sink's handle
            self._act(change)

    def restore(self, events: list[dict[str, Any]]) -> None:
        """Fold a dead supervisor's journal without posting; then post again each incident it
        left firing (a notify rule's alert is left to expire, unless this supervisor's engine
        fires it again; it is ended at the run's end all the same)."""
        for ev in events:
            for change in self.follow.apply(ev):
                f = change.followed
                if f.over:
                    self.firing.pop(f.id, None)
                elif f.routed:
                    self.firing[f.id] = f
                if f.alert:
                    f.live = False
        for f in self.firing.values():
            if not f.alert:
                self._post(f, self._wall() + self.ttl_s)

    def tick(self, ctl: Any) -> None:
        """Every ``repost_s``: post each firing alert again (its keep-alive)."""
        now = self._clock()
        if now - self._reposted < self.repost_s:
            return
        self._reposted = now
        for f in self.firing.values():
            if self._kept_alive(f):
                self._post(f, self._wall() + self.ttl_s, keepalive=True)

    def close(self, timeout_s: float = 10.0, *, ended: bool = False) -> None:
        """At the run's end: end what is firing, but keep an incident that needs a human firing
        for ``unattended_s``; then deliver within ``timeout_s``."""
        if ended:
            now = self._wall()
            for f in self.firing.values():
                self._post(f, now + self.unattended_s if f.needs_human else now)
            self.firing.clear()
        self.outbox.close(timeout_s)

    # ------------------------------------------------------------------ decisions
    def _kept_alive(self, f: Followed) -> bool:
        """An incident, always; a notify rule's alert while this engine will say when it
        resolves (it fired it, and the policy sends resolved messages)."""
        return not f.alert or (f.live and self.policy.notify.send_resolved)

    def _act(self, change: Change) -> None:
        f = change.followed
        if change.what == "opened":
            if f.routed:
                self.firing[f.id] = f
                self._post(f, self._wall() + self.ttl_s)
        elif change.what == "over":
            if self.firing.pop(f.id, None) is not None:
                self._post(f, self._wall())
        elif f.id in self.firing:  # a step, a human needed, an acknowledgement: new words
            self._post(f, self._wall() + self.ttl_s)

    # ------------------------------------------------------------------ effects
    def _post(self, f: Followed, ends: float, *, keepalive: bool = False) -> None:
        now = self._wall()
        doc = alert_document(
            f, run=self.run, policy=self.policy, run_dir=self.run_dir, now=now, ends=ends
        )
        what = f"{f.id} " + ("resolved" if ends <= now else "keep-alive" if keepalive else "firing")
        self.outbox.send(
            Message(
                what=what,
                url=self.url,
                document=[doc],
                incident=None if f.alert else f.id,
                # a keep-alive still queued is replaced by the next one (Alertmanager down)
                key=f"{f.id} keep-alive" if keepalive else None,
                droppable=keepalive,
            )
        )


@register(NAME)
def alertmanager_sink(ctx: SinkContext) -> AlertmanagerSink | None:
    """An :class:`AlertmanagerSink` when ``SPIKEGUARD_ALERTMANAGER_URL`` is set."""
    url = (os.environ.get("SPIKEGUARD_ALERTMANAGER_URL") or "").strip()
    if not url:
        return None
    if not http_url(url):
        log.warning("SPIKEGUARD_ALERTMANAGER_URL is not an http(s) URL; not posting alerts")
        return None
    return AlertmanagerSink(
        url,
        run=ctx.run_id,
        policy=ctx.policy,
        journal=ctx.record,
        run_dir=ctx.run_dir,
        clock=ctx.clock,
    )
