"""The ``webhook`` sink: one signed JSON document per story event, on when
``SPIKEGUARD_WEBHOOK_URL`` is set (signed with ``SPIKEGUARD_WEBHOOK_SECRET`` when that is set).

What is sent: each journal event of the story (the kinds whose readers include the story, and
``operator`` events) of an incident the routes send here (:func:`~..registry.wants` of its
opening event), each alert the routes send here, each ``operator`` event that names no incident,
and every event that tells how the run ended (completed, failed, stopped, preempted) whatever the
routes say. The body is ``{"run": RUN, "event": <the event as journaled>, "text": <its story
line>}``.

Headers: ``X-Spikeguard-Timestamp`` (Unix seconds at the attempt), ``X-Spikeguard-Signature:
sha256=HEX``, HEX being the HMAC-SHA256, keyed with the secret, of ``TIMESTAMP + "." + BODY``
(the raw body bytes), and ``X-Spikeguard-Delivery`` (``RUN:SEQ``: the same on a retry, so a
receiver can drop a duplicate). A receiver verifies it like :func:`verify_signature`: recompute
the HMAC over the raw body it received, compare in constant time (``hmac.compare_digest``), and
refuse a timestamp more than a few minutes from its own clock (a replayed request). Without a
secret the documents go unsigned, said once in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from spikeguard.workers.contract.logs import logger

from ...decide.events import RUN_END_KINDS, STORY_KINDS, Kind
from ...observe.describe import describe
from ..registry import BaseSink, Record, SinkContext, register, wants
from .delivery import Message, Outbox, Retry, http_url

log = logger(__name__)

NAME = "webhook"
SIGNATURE = "X-Spikeguard-Signature"
TIMESTAMP = "X-Spikeguard-Timestamp"
DELIVERY = "X-Spikeguard-Delivery"
TOLERANCE_S = 300.0
"""How far from its own clock a receiver should accept a timestamp (:func:`verify_signature`)."""
SENT_KINDS = frozenset(k.value for k in STORY_KINDS | RUN_END_KINDS) | {Kind.OPERATOR.value}
RUN_ENDS = frozenset(k.value for k in RUN_END_KINDS)


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=HEX``: the HMAC-SHA256 of ``timestamp.body`` keyed with ``secret``."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify_signature(
    secret: str,
    timestamp: str,
    body: bytes,
    signed: str,
    *,
    now: float | None = None,
    tolerance_s: float = TOLERANCE_S,
) -> bool:
    """What a receiver checks: ``signed`` (the signature header) is the HMAC of the raw
    ``body`` with ``timestamp`` (compared in constant time), and ``timestamp`` is within
    ``tolerance_s`` of ``now`` (the receiver's clock)."""
    try:
        sent = float(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, timestamp, body), signed)


def sent(
    event: Mapping[str, Any], routed: Mapping[str, bool], wanted: Callable[[Any], bool]
) -> bool:
    """Whether ``event`` is sent: a story or operator event of a routed incident, a routed
    alert, an operator event of no incident, or how the run ended. ``routed``: each incident's
    routing (from its opening event); ``wanted``: the routes, for an alert."""
    kind, inc = event.get("kind"), event.get("incident")
    if kind in RUN_ENDS:
        return True
    if kind not in SENT_KINDS:
        return False
    if isinstance(inc, str) and inc in routed:
        return routed[inc]
    if kind == Kind.ALERT.value:
        return bool(wanted(event))
    return kind == Kind.OPERATOR.value and not isinstance(inc, str)


class WebhookSink(BaseSink):
    """Posts a run's story to a webhook (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        secret: str | None,
        run: str,
        policy: Any,
        journal: Record,
        wall: Callable[[], float] = time.time,
        retry: Retry | None = None,
    ) -> None:
        """Post to ``url``, signing with ``secret`` (None: unsigned)."""
        self.url, self.run, self.policy = url, run, policy
        self._secret, self._wall = secret or None, wall
        self._routed: dict[str, bool] = {}
        """Each incident's routing, from its opening event (a reopened one is routed again)."""
        if self._secret is None:
            log.warning(
                "webhook: SPIKEGUARD_WEBHOOK_SECRET is not set: its documents are sent unsigned"
            )
        self.outbox = Outbox(NAME, journal, retry=retry, secrets=(url, secret or ""))

    def handle(self, event: dict[str, Any]) -> None:
        """Queue ``event``'s document if it is sent; returns at once."""
        self._follow(event)  # the controller guards every sink's handle
        if sent(event, self._routed, lambda ev: wants(self.policy, NAME, ev)):
            self.outbox.send(self._message(event))

    def restore(self, events: list[dict[str, Any]]) -> None:
        """Which incidents a dead supervisor's journal routed here (nothing is sent again)."""
        for ev in events:
            self._follow(ev)

    def close(self, timeout_s: float = 10.0, *, ended: bool = False) -> None:
        """Deliver what is queued within ``timeout_s`` (the rest is journaled undelivered)."""
        self.outbox.close(timeout_s)

    def _follow(self, event: Mapping[str, Any]) -> None:
        inc = event.get("incident")
        if event.get("kind") == Kind.INCIDENT.value and isinstance(inc, str):
            self._routed[inc] = wants(self.policy, NAME, event)

    def _message(self, event: Mapping[str, Any]) -> Message:
        inc = event.get("incident")
        doc = {"run": self.run, "event": dict(event), "text": describe(event)}
        return Message(
            what=f"{event.get('kind')} #{event.get('seq', '—')}",
            url=self.url,
            document=doc,
            incident=inc if isinstance(inc, str) else None,
            headers={DELIVERY: f"{self.run}:{event.get('seq', '')}"},
            sign=self._sign,
        )

    def _sign(self, body: bytes) -> dict[str, str]:
        if self._secret is None:
            return {}
        stamp = str(int(self._wall()))
        return {TIMESTAMP: stamp, SIGNATURE: signature(self._secret, stamp, body)}


@register(NAME)
def webhook_sink(ctx: SinkContext) -> WebhookSink | None:
    """A :class:`WebhookSink` when ``SPIKEGUARD_WEBHOOK_URL`` is set."""
    url = (os.environ.get("SPIKEGUARD_WEBHOOK_URL") or "").strip()
    if not url:
        return None
    if not http_url(url):
        log.warning("SPIKEGUARD_WEBHOOK_URL is not an http(s) URL; not posting the story")
        return None
    return WebhookSink(
        url,
        secret=os.environ.get("SPIKEGUARD_WEBHOOK_SECRET") or None,
        run=ctx.run_id,
        policy=ctx.policy,
        journal=ctx.record,
    )
