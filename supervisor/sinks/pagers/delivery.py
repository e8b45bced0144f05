"""The pagers' delivery: one background queue per sink that POSTs JSON and never blocks the run.

A pager's :meth:`~..registry.Sink.handle` only builds :class:`Message` s and hands them to its
:class:`Outbox` (:meth:`Outbox.send` appends to a bounded queue and returns); one worker thread
POSTs them in order with :mod:`urllib` (no redirects followed: a pager endpoint that redirects
is misconfigured). A 429, a 5xx or a connection error (refused, reset, a timeout) is tried again
after an exponential backoff (``Retry-After`` honoured), up to :attr:`Retry.tries` attempts
within :attr:`Retry.give_up_after_s`; any other answer, or the last failure, gives the message
up. What is given up, dropped from a full queue, or still queued when the supervisor goes
(:meth:`Outbox.close`) is journaled as ``notify_undelivered`` (``sink``, ``incident``, ``what``,
``error``), with every known secret blanked out of the error: never silently lost, never a
routing key in the journal.

The decisions are small pure functions (:func:`verdict`, :func:`retry_after_s`,
:func:`backoff_s`); the effects are the worker's.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import logging
import math
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from http.client import HTTPException
from typing import Any, Literal

from spikeguard.workers.contract.secret_scan import redact

from ..registry import Record

log = logging.getLogger("spikeguard.pagers")

MAX_QUEUE = 1000
"""Messages a sink's queue holds; beyond it the oldest droppable one (a keep-alive) goes, else
the oldest, journaled as undelivered."""
MAX_ERROR_CHARS = 300
"""An error (a server's answer quoted) is cut to this many characters in the journal."""
SHUT_DOWN = "supervisor shut down before it could be delivered"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Retry:
    """How hard one message is tried."""

    tries: int = 6
    """Attempts at most (the first one included)."""
    backoff_s: float = 1.0
    """Wait after the first failure; doubles after each (with +-25 % jitter)."""
    backoff_max_s: float = 60.0
    """Upper bound of one wait (a longer ``Retry-After`` is capped here too)."""
    give_up_after_s: float = 300.0
    """From the first attempt: no attempt starts later than this (the message is given up)."""
    timeout_s: float = 10.0
    """HTTP timeout of one attempt (connect, and each read)."""

    def __post_init__(self) -> None:
        if self.tries < 1:
            raise ValueError(f"tries must be at least 1, got {self.tries!r}")
        for name in ("backoff_s", "backoff_max_s", "give_up_after_s", "timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """One HTTP POST a pager wants made."""

    what: str
    """What it is, for people (``inc-001 trigger``): the log line and the journal's ``what``;
    never a secret."""
    url: str
    """Where it goes."""
    document: Any
    """The JSON document it carries (serialized once, at :meth:`body`)."""
    incident: str | None = None
    """The incident it is about (the journal's ``incident`` when it is undelivered)."""
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Extra request headers."""
    sign: Callable[[bytes], Mapping[str, str]] | None = None
    """Headers computed from the body at each attempt (a signature with its timestamp)."""
    key: str | None = None
    """A newer message with the same key replaces this one while it is still queued (a
    keep-alive of one alert needs to go once, with its newest content)."""
    droppable: bool = False
    """The first to go when the queue is full (a keep-alive the next tick sends again)."""

    def body(self) -> bytes:
        """The JSON body."""
        return json.dumps(self.document, separators=(",", ":"), default=str).encode()


def http_url(value: Any) -> bool:
    """True for an ``http://`` or ``https://`` URL with a host (what a pager endpoint is)."""
    parsed = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    return bool(parsed and parsed.scheme in ("http", "https") and parsed.netloc)


Verdict = Literal["ok", "retry", "fail"]


def verdict(status: int | None) -> Verdict:
    """What an answer means: 2xx delivered; 429, 408 and 5xx (and no answer at all, ``None``:
    refused, reset, timed out) worth another attempt; any other status (a 400: the request is
    wrong, a 3xx: the URL is) a failure another attempt would repeat."""
    if status is None:
        return "retry"
    if 200 <= status < 300:
        return "ok"
    if status in (408, 429) or status >= 500:
        return "retry"
    return "fail"


def retry_after_s(value: str | None, now: float) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta seconds or an HTTP date, ``now``
    being the wall clock); None when absent or unreadable."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now
    return max(0.0, seconds) if math.isfinite(seconds) else None


def backoff_s(failures: int, retry: Retry, asked_s: float | None, jitter: float = 1.0) -> float:
    """The wait after ``failures`` failed attempts (1 after the first): what the server asked
    (``Retry-After``) if it did, else the exponential backoff times ``jitter``; at most
    :attr:`Retry.backoff_max_s`."""
    if asked_s is not None:
        return min(retry.backoff_max_s, asked_s)
    return min(retry.backoff_max_s, retry.backoff_s * 2 ** (failures - 1) * jitter)


@dataclasses.dataclass(frozen=True)
class Answer:
    """What one attempt got back."""

    status: int | None
    """The HTTP status; None when no answer came (the error says why)."""
    body: str = ""
    """The start of the answer's body (for an error message)."""
    retry_after: str | None = None
    """Its ``Retry-After`` header."""
    error: str = ""
    """Why there is no answer (``ConnectionRefusedError: …``)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx comes back as the answer, a failure


_OPENER = urllib.request.build_opener(_NoRedirect)


def post(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> Answer:
    """POST ``body`` (JSON) to ``url``; every outcome is an :class:`Answer`, nothing raises."""
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "spikeguard",
            **headers,
        },
    )
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return Answer(resp.status, resp.read(4096).decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        try:
            text = e.read(4096).decode("utf-8", "replace")
        except (OSError, HTTPException):
            text = ""
        return Answer(e.code, text, e.headers.get("Retry-After") if e.headers else None)
    except (OSError, HTTPException, ValueError) as e:  # URLError, refused, reset, timeout
        reason = getattr(e, "reason", None) or e
        return Answer(None, error=f"{type(reason).__name__}: {reason}")


@dataclasses.dataclass(eq=False)
class _Item:
    message: Message
    settled: bool = False
    """Delivered or journaled undelivered (never both, never twice)."""


class Outbox:
    """One sink's delivery queue and its worker thread (see the module docstring)."""

    def __init__(
        self,
        sink: str,
        journal: Record,
        *,
        retry: Retry | None = None,
        secrets: Iterable[str] = (),
        max_queue: int = MAX_QUEUE,
        on_delivered: Callable[[Message, Answer], None] | None = None,
    ) -> None:
        """Deliver for the sink named ``sink``, journaling what cannot be delivered with
        ``journal``; ``secrets``: values no error may quote (a routing key, a signing secret);
        ``on_delivered``: called (on the worker thread) with each delivered message."""
        self.sink, self.retry = sink, retry or Retry()
        self._journal, self._secrets = journal, tuple(s for s in secrets if s)
        self._max_queue, self._on_delivered = max_queue, on_delivered
        self._cv = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._dropped: list[_Item] = []
        self._busy: _Item | None = None
        self._closing = False
        self._abort = threading.Event()
        self.delivered = 0
        """Messages delivered so far."""
        self._worker = threading.Thread(target=self._run, name=f"spikeguard-{sink}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ the caller's side
    def send(self, message: Message) -> None:
        """Queue ``message``; returns at once (the worker delivers it)."""
        item = _Item(message)
        with self._cv:
            if not self._closing:
                self._enqueue(item)
                self._cv.notify_all()
                return
        self._undelivered(item, SHUT_DOWN)  # after close(): nobody will send it

    def _enqueue(self, item: _Item) -> None:
        key = item.message.key
        if key is not None:
            for i, queued in enumerate(self._queue):
                if queued.message.key == key:
                    self._queue[i] = item  # the newer content, in the older's place
                    return
        if len(self._queue) >= self._max_queue:
            victim = next((q for q in self._queue if q.message.droppable), self._queue[0])
            self._queue.remove(victim)
            self._dropped.append(victim)
        self._queue.append(item)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued was delivered or given up; False on timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._queue and self._busy is None and not self._dropped, timeout_s
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued within about ``timeout_s``, then journal what is left (the
        message in flight too) as undelivered."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self.flush(timeout_s)
        self._abort.set()  # cut the waits of the message in flight; the worker stops
        with self._cv:
            left = [*self._dropped, *self._queue]
            self._dropped, self._queue = [], deque()
            if self._busy is not None:
                left.insert(0, self._busy)
            self._cv.notify_all()
        for item in left:
            self._undelivered(item, SHUT_DOWN)
        self._worker.join(timeout=1.0)

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._dropped or self._abort.is_set())
                if self._abort.is_set():
                    return  # close() journals what is left
                dropped, self._dropped = self._dropped, []
                item = self._queue.popleft() if self._queue else None
                self._busy = item
            for d in dropped:
                self._undelivered(d, f"dropped: more than {self._max_queue} messages queued")
            if item is not None:
                try:
                    self._deliver(item)
                except Exception as e:  # never let one message stop the sender
                    log.exception("%s: delivering %s failed", self.sink, item.message.what)
                    self._undelivered(item, f"{type(e).__name__}: {e}")
            with self._cv:
                self._busy = None
                self._cv.notify_all()

    def _deliver(self, item: _Item) -> None:
        message, r = item.message, self.retry
        started, last = time.monotonic(), "not attempted"
        body = message.body()
        for attempt in range(1, r.tries + 1):
            if self._abort.is_set():
                self._undelivered(item, f"{SHUT_DOWN} (last: {last})")
                return
            headers = {**message.headers, **(message.sign(body) if message.sign else {})}
            answer = post(message.url, body, headers, r.timeout_s)
            outcome = verdict(answer.status)
            if outcome == "ok":
                self._delivered(item, answer)
                return
            last = _describe(answer)
            if outcome == "fail":
                self._undelivered(item, f"refused: {last}")
                return
            if attempt == r.tries:
                break
            asked = retry_after_s(answer.retry_after, time.time())
            wait = backoff_s(attempt, r, asked, 0.75 + random.random() * 0.5)
            if time.monotonic() + wait - started > r.give_up_after_s:
                self._undelivered(
                    item, f"gave up after {attempt} attempts in {r.give_up_after_s:g}s: {last}"
                )
                return
            log.info("%s: %s: %s; trying again in %.1fs", self.sink, message.what, last, wait)
            self._abort.wait(wait)
        self._undelivered(item, f"gave up after {r.tries} attempts: {last}")

    def _settle(self, item: _Item) -> bool:
        with self._cv:
            if item.settled:
                return False
            item.settled = True
            return True

    def _delivered(self, item: _Item, answer: Answer) -> None:
        if not self._settle(item):
            return
        self.delivered += 1
        if self._on_delivered is not None:
            try:
                self._on_delivered(item.message, answer)
            except Exception:
                log.exception("%s: after delivering %s", self.sink, item.message.what)

    def _undelivered(self, item: _Item, error: str) -> None:
        if not self._settle(item):
            return
        message = item.message
        error = redact(error, self._secrets)[:MAX_ERROR_CHARS]
        log.warning("%s: %s undelivered: %s", self.sink, message.what, error)
        event = {
            "kind": "notify_undelivered",
            "incident": message.incident,
            "sink": self.sink,
            "what": message.what,
            "error": error,
        }
        try:
            self._journal(event)
        except Exception:
            log.exception("%s: journaling an undelivered message failed", self.sink)


def _describe(answer: Answer) -> str:
    if answer.status is None:
        return f"no answer ({answer.error})"
    text = " ".join(answer.body.split())[:200]
    return f"HTTP {answer.status}" + (f": {text}" if text else "")
