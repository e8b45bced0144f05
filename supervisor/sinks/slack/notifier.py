"""Slack notifications: one thread per incident, never in the way of recovery.

* **Bot mode** (``SLACK_BOT_TOKEN``, slack-sdk ``WebClient``): each incident gets one root message
  (``[RECOVERING] S2 · run``), each recovery step a reply in its thread, the root is edited with
  ``chat.update`` when the state changes, the conclusion (RESOLVED / ESCALATED) is a reply with
  ``reply_broadcast``, and a chart of grade, attention entropy and loss is uploaded into the thread.
* **Webhook mode** (``SPIKEGUARD_SLACK_WEBHOOK_URL``, ``WebhookClient``): incoming webhooks cannot
  reply in threads, edit messages or upload files, so every event is a standalone message that
  names its incident, the conclusion repeats the whole story, and there is no chart.

:meth:`SlackNotifier.handle` only renders and enqueues; one background thread sends, paced to
``min_interval_s`` per channel, honouring 429 ``Retry-After`` (slack-sdk's opt-in
``RateLimitErrorRetryHandler``) and retrying 5xx / connection errors with backoff. What is given
up is journaled as ``notify_undelivered``; each thread root is journaled as ``notify_thread`` so a
restarted supervisor (:meth:`SlackNotifier.restore`) keeps posting into the same thread.

With ``SLACK_APP_TOKEN`` (bot mode) and a run directory, the notifier starts a
:class:`~.buttons.ButtonListener` and the roots carry the operator buttons; what a human did
(``operator`` events) is a reply in the incident's thread, and the root says who acknowledged or
holds it (an acknowledged incident's reminders, repeated alerts, are no longer posted). A refused
press is answered by an ephemeral message, sent through the same queue.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any

from slack_sdk.errors import SlackApiError, SlackRequestError
from spikeguard.workers.contract.secret_scan import redact

from ...decide.events import RUN_END_KINDS, THREAD_KINDS, Code
from ..charts import has_chart_data, render_incident_chart
from ..registry import BaseSink, routes_to
from .buttons import ButtonListener
from .client import web_client, webhook_client
from .render import (
    IncidentView,
    Links,
    SlackMessage,
    alert_message,
    parse_time,
    root_message,
    run_message,
    standalone_step_message,
    step_message,
)
from .settings import SlackSettings

log = logging.getLogger("spikeguard.slack")
Journal = Callable[[dict], Any]
RUN_OUTCOMES = RUN_END_KINDS
"""How a run ended (or went away resumably): posted whatever the routes say."""
RECOVERY_KINDS = THREAD_KINDS
"""Kinds that go into the thread of the incident they name (a launch or an operator event only
into one already followed)."""
ONLY_INTO_FOLLOWED = frozenset({"launch", "operator"})
"""Kinds that never open a thread: they only go into that of an incident already followed."""
TRANSIENT = {"internal_error", "fatal_error", "service_unavailable", "request_timeout"}
MAX_QUEUE = 2000


class _Failure(Exception):
    """A send that failed; ``retry`` when a later attempt (after backoff) may succeed."""

    def __init__(self, error: str, retry: bool = False) -> None:
        super().__init__(error)
        self.error, self.retry = error, retry


@dataclass
class _Thread:
    channel: str
    ts: str
    posted_version: int


@dataclass
class _Incident:
    view: IncidentView
    thread: _Thread | None = None


@dataclass
class _Op:
    kind: str  # post | root | reply | update | chart | ephemeral
    what: str
    ref: _Incident | None = None
    message: SlackMessage | None = None
    broadcast: bool = False
    version: int = 0
    droppable: bool = False
    force: bool = False
    to: tuple[str, str] | None = None  # an ephemeral's (channel, user)


class SlackNotifier(BaseSink):
    """Posts journal events to Slack from a background thread; see the module docstring."""

    def __init__(
        self,
        settings: SlackSettings,
        *,
        run: str,
        journal: Journal,
        run_dir_url: str | None = None,
        run_dir: Path | None = None,
    ) -> None:
        """``run_dir``: where button presses put their requests; with it and Socket Mode
        configured (:attr:`SlackSettings.buttons`) the buttons are on."""
        if settings.problems():
            raise ValueError("Slack notifier not configured: " + "; ".join(settings.problems()))
        self.settings, self.run, self._journal = settings, run, journal
        self._links = Links(run_dir_url, settings.dashboard_url, settings.runbook_url)
        self._cv = threading.Condition()
        self._queue: deque[_Op] = deque()
        self._overflow: list[_Op] = []
        self._incidents: dict[str, _Incident] = {}
        self._muted: set[str] = set()
        """Incidents whose severity the routes keep off Slack."""
        self._dedupe: dict[tuple, list[float]] = {}
        self._progress_at: dict[str, float] = {}
        self._busy = self._closing = False
        self._abort = threading.Event()
        self._last_write = 0.0  # monotonic time of the last call (worker thread only)
        bot = settings.mode == "bot"
        self._web = web_client(settings, self._abort) if bot else None
        self._hook = None if bot else webhook_client(settings, self._abort)
        self._worker = threading.Thread(
            target=self._run_worker, name="spikeguard-slack", daemon=True
        )
        self._worker.start()
        if settings.buttons_problem():
            log.warning("Slack: %s", settings.buttons_problem())
        self._buttons: ButtonListener | None = None
        if settings.buttons and run_dir is not None:
            self._buttons = ButtonListener(
                settings, run=run, run_dir=run_dir, record=self._safe_journal, tell=self.tell
            )
            self._buttons.start()

    # ----------------------------------------------------------------- caller side (fast)
    def handle(self, event: dict) -> None:
        """Render ``event`` and enqueue what it needs; never blocks on Slack and never raises."""
        try:
            with self._cv:
                if self._closing:
                    return
                for op in self._plan(event):
                    self._enqueue(op)
                self._cv.notify_all()
        except Exception:  # a notifier bug must not break a recovery step
            log.exception("slack notifier could not handle %s", event.get("kind"))

    def tell(self, channel: str, user: str, text: str) -> None:
        """Enqueue an ephemeral message to ``user`` in ``channel`` (a refused button press)."""
        msg = SlackMessage(text, [])  # an ephemeral is its text only
        with self._cv:
            if self._closing:
                return
            self._enqueue(_Op("ephemeral", f"ephemeral to {user}", None, msg, to=(channel, user)))
            self._cv.notify_all()

    def restore(self, events: list[dict]) -> None:
        """Rebuild threads, incident states and dedupe windows from past journal events.

        Events are replayed without sending anything; afterwards the root of every incident
        still open is refreshed once (``chat.update``) in case the previous process stopped
        between a state change and its update.
        """
        with self._cv:
            for ev in events:
                kind, inc = ev.get("kind"), ev.get("incident")
                if kind != "notify_thread" and not self._routed(ev):
                    continue
                if kind == "notify_thread" and inc and ev.get("channel") and ev.get("ts"):
                    ref = self._incident(ev)
                    ref.thread = _Thread(str(ev["channel"]), str(ev["ts"]), ref.view.version)
                elif kind == "alert":
                    self._dedupe_pass(ev)
                elif self._follows(ev):
                    self._incident(ev).view.apply(ev, buttons=self._buttons is not None)
                    if kind == "probation_progress":
                        self._progress_at[str(inc)] = parse_time(ev.get("time")) or time.time()
            for inc, ref in self._incidents.items():
                if ref.thread and not ref.view.concluded and self.settings.mode == "bot":
                    self._enqueue(
                        _Op(
                            "update",
                            f"{inc} root refresh",
                            ref,
                            self._root(ref.view),
                            version=ref.view.version,
                            force=True,
                        )
                    )
            self._cv.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything enqueued was sent or given up; False on timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._queue and not self._busy and not self._overflow, timeout_s
            )

    def close(self, timeout_s: float = 10.0, *, ended: bool = False) -> None:
        """Stop answering buttons; send what is queued within ``timeout_s``; journal the rest as
        undelivered."""
        if self._buttons is not None:
            self._buttons.close()
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self.flush(timeout_s)
        self._abort.set()  # cut the waits (backoff, Retry-After) of the message in flight
        with self._cv:
            left, self._queue = list(self._queue), deque()
            self._cv.notify_all()
        for op in left:
            self._undelivered(op, "supervisor shut down before it could be sent")
        self._worker.join(timeout=2.0)

    # ----------------------------------------------------------------- planning (under lock)
    def _incident(self, ev: Mapping[str, Any]) -> _Incident:
        """The incident of ``ev``; an id seen again after its conclusion (a restarted
        supervisor numbering from 1 again) is a new incident with a new thread."""
        inc = str(ev.get("incident"))
        old = self._incidents.get(inc)
        if old is None or (ev.get("kind") == "incident" and old.view.concluded):
            self._incidents[inc] = _Incident(IncidentView(run=self.run, incident=inc))
        return self._incidents[inc]

    def _root(self, view: IncidentView) -> SlackMessage:
        return root_message(
            view, self._links, self.settings.mention, buttons=self._buttons is not None
        )

    def _follows(self, ev: Mapping[str, Any]) -> bool:
        """Whether ``ev`` belongs in an incident's thread (a launch or a human's hand only in
        one already followed; a refused button press never: its presser was told)."""
        kind, inc = ev.get("kind"), ev.get("incident")
        if kind not in RECOVERY_KINDS or not inc:
            return False
        if kind == "operator" and ev.get("code") == Code.BUTTON_REFUSED:
            return False
        return kind not in ONLY_INTO_FOLLOWED or inc in self._incidents

    def _reminder_of_acknowledged(self, ev: Mapping[str, Any]) -> bool:
        """A reminder (a repeated alert) of an incident someone acknowledged: not posted."""
        ref = self._incidents.get(str(ev.get("incident")))
        return bool(ev.get("repeated")) and ref is not None and bool(ref.view.acknowledged_by)

    def _routed(self, ev: Mapping[str, Any]) -> bool:
        """Whether the policy's routes send this event's severity to Slack (an incident's
        later steps follow its first event)."""
        kind, inc = ev.get("kind"), ev.get("incident")
        if kind == "incident" and inc not in self._incidents:
            routed = routes_to(self.settings.severities, self.settings.rules, ev)
            if not routed:
                self._muted.add(str(inc))
            return routed
        if kind == "alert" and not (inc and inc in self._incidents):
            return routes_to(self.settings.severities, self.settings.rules, ev)
        return str(inc) not in self._muted or kind in RUN_OUTCOMES

    def _plan(self, ev: dict) -> list[_Op]:
        kind, inc, s = ev.get("kind"), ev.get("incident"), self.settings
        if not self._routed(ev):
            return []
        if kind == "alert" and (self._reminder_of_acknowledged(ev) or not self._dedupe_pass(ev)):
            return []
        if kind in ("completed", "preempted") or (
            kind in ("failed", "stopped") and inc not in self._incidents
        ):
            return [
                _Op("post", f"run {kind}", None, run_message(ev, self.run, self._links, s.mention))
            ]
        if kind == "alert" and not (inc and inc in self._incidents):
            repeats = int(self._dedupe[self._alert_key(ev)][1])
            return [
                _Op(
                    "post",
                    f"alert {ev.get('rule')}",
                    None,
                    alert_message(ev, self.run, self._links, s.mention, repeats),
                    droppable=True,
                )
            ]
        if not self._follows(ev):
            return []
        if kind == "probation_progress" and not self._progress_due(ev):
            return []
        ref = self._incident(ev)
        view = ref.view
        fresh = kind == "incident" and not view.fired
        before = view.state
        changed = view.apply(ev, buttons=self._buttons is not None)
        what = f"{inc} {kind}"
        if s.mode == "webhook":
            msg = (
                self._root(view)
                if fresh
                else standalone_step_message(ev, view, self._links, s.mention)
            )
            return [_Op("post", what, ref, msg)]
        if fresh:
            ops = [_Op("root", f"{inc} root", ref, self._root(view), version=view.version)]
            if s.chart and has_chart_data(view.context):
                ops.append(_Op("chart", f"{inc} chart", ref, droppable=True))
            return ops
        ops = [
            _Op(
                "reply",
                what,
                ref,
                step_message(ev, view, self._links, s.mention),
                broadcast=(view.concluded and view.state is not before) or kind == "stopped",
                droppable=kind == "probation_progress",
            )
        ]
        if changed:
            ops.append(
                _Op("update", f"{inc} root update", ref, self._root(view), version=view.version)
            )
        return ops

    @staticmethod
    def _alert_key(ev: Mapping[str, Any]) -> tuple:
        # a resolved alert is news of its own, not a repeat of the firing one
        keys = ("rule", "severity", "signal", "rank", "layer", "resolved")
        return tuple(bool(ev.get(k)) if k == "resolved" else ev.get(k) for k in keys)

    def _dedupe_pass(self, ev: Mapping[str, Any]) -> bool:
        """True when this alert should be sent; counts the repeats it suppresses. A reminder
        that a rule still holds (``repeated``, paced by the policy engine) always passes."""
        if ev.get("repeated"):
            return True
        now = parse_time(ev.get("time")) or time.time()
        entry = self._dedupe.get(self._alert_key(ev))
        if entry is not None and now - entry[0] < self.settings.repeat_interval_s:
            entry[2] += 1
            return False
        suppressed = entry[2] if entry else 0
        self._dedupe[self._alert_key(ev)] = [now, suppressed, 0]
        return True

    def _progress_due(self, ev: Mapping[str, Any]) -> bool:
        now, inc = parse_time(ev.get("time")) or time.time(), str(ev.get("incident"))
        last = self._progress_at.get(inc)
        if last is not None and now - last < self.settings.progress_interval_s:
            return False
        self._progress_at[inc] = now
        return True

    def _enqueue(self, op: _Op) -> None:
        if len(self._queue) >= MAX_QUEUE:
            victim = next((o for o in self._queue if o.droppable), self._queue[0])
            self._queue.remove(victim)
            self._overflow.append(victim)
        self._queue.append(op)

    # ----------------------------------------------------------------- background thread
    def _run_worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._overflow or self._closing)
                dropped, self._overflow = self._overflow, []
                if not self._queue and not dropped:
                    if self._closing:
                        return
                    continue
                op = self._queue.popleft() if self._queue else None
                self._busy = op is not None
            for d in dropped:
                self._undelivered(d, f"dropped: more than {MAX_QUEUE} messages queued")
            if op is None:
                continue
            try:
                self._execute(op)
            except _Failure as f:
                self._undelivered(op, f.error)
            except Exception as e:  # never let one bad message stop the sender
                log.error("slack send failed: %s", self._redact(traceback.format_exc()))
                self._undelivered(op, f"{type(e).__name__}: {e}")
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _execute(self, op: _Op) -> None:
        channel = str(self.settings.channel or "")
        if op.kind == "post":
            self._send(lambda: self._post(channel, op.message))  # type: ignore[arg-type]
        elif op.kind == "root":
            self._ensure_thread(op.ref, op.message, op.version)  # type: ignore[arg-type]
        elif op.kind == "reply":
            th = self._ensure_thread(op.ref)  # type: ignore[arg-type]
            self._send(
                lambda: self._post(
                    th.channel,
                    op.message,
                    th.ts,  # type: ignore[arg-type]
                    op.broadcast,
                )
            )
        elif op.kind == "update":
            with self._cv:
                if op.version < op.ref.view.version:  # type: ignore[union-attr]
                    return  # a newer update is queued behind this one
            th = self._ensure_thread(op.ref)  # type: ignore[arg-type]
            if op.version <= th.posted_version and not op.force:
                return  # the root already shows this state
            self._send(lambda: self._update(th, op.message))  # type: ignore[arg-type]
            th.posted_version = max(th.posted_version, op.version)
        elif op.kind == "chart":
            th = self._ensure_thread(op.ref)  # type: ignore[arg-type]
            view = op.ref.view  # type: ignore[union-attr]
            png = render_incident_chart(
                view.context or {},
                step=view.fired.get("step"),
                title=f"{view.incident} · {self.run}",
            )
            self._send(lambda: self._upload(th, png, view))
        elif op.kind == "ephemeral":
            channel, user = op.to  # type: ignore[misc]
            self._send(
                lambda: self._call(
                    lambda: self._web.chat_postEphemeral(  # type: ignore[union-attr]
                        channel=channel,
                        user=user,
                        text=op.message.text,  # type: ignore[union-attr]
                    )
                )
            )

    def _ensure_thread(
        self, ref: _Incident, message: SlackMessage | None = None, version: int = 0
    ) -> _Thread:
        """The incident's thread; posts its root first (``message`` or the current state)."""
        with self._cv:
            th = ref.thread
            if message is None:
                message, version = self._root(ref.view), ref.view.version
        if th is not None:
            return th
        try:
            channel, ts = self._send(lambda: self._post(str(self.settings.channel), message))
        except _Failure as f:
            raise _Failure(f"no thread: its root message could not be posted: {f.error}") from None
        th = ref.thread = _Thread(channel, ts, version)
        self._safe_journal(
            {"kind": "notify_thread", "incident": ref.view.incident, "channel": channel, "ts": ts}
        )
        return th

    def _send(self, attempt: Callable[[], Any]) -> Any:
        """Run ``attempt`` with pacing and retries; raise :class:`_Failure` when giving up."""
        s, last = self.settings, "not attempted"
        for n in range(s.max_retries + 1):
            if self._abort.is_set():
                raise _Failure(f"supervisor shut down before it could be sent (last: {last})")
            try:
                return attempt()
            except _Failure as f:
                if not f.retry:
                    raise
                last, backoff = f.error, min(s.backoff_max_s, s.backoff_s * 2**n)
                if n < s.max_retries:  # exponential backoff with +-25 % jitter
                    self._abort.wait(backoff * (0.75 + random.random() * 0.5))
        raise _Failure(f"gave up after {s.max_retries + 1} attempts: {last}")

    def _call(self, fn: Callable[[], Any]) -> Any:
        """One HTTP call, paced (one notifier posts to one channel), errors as :class:`_Failure`."""
        delay = self._last_write + self.settings.min_interval_s - time.monotonic()
        if delay > 0:
            self._abort.wait(delay)
        self._last_write = time.monotonic()
        try:
            return fn()
        except SlackApiError as e:
            r = e.response
            err = r.get("error") if isinstance(r.data, dict) else None
            detail = f"HTTP {r.status_code} {err or ''}".strip()[:300]
            if isinstance(r.data, dict) and r.data.get("needed"):
                detail += f" (needed: {r.data['needed']})"
            if r.status_code == 429:  # slack-sdk's handler already waited out max_retries 429s
                raise _Failure(
                    f"still rate limited after {self.settings.max_retries} waits: {detail}"
                ) from None
            if r.status_code >= 500 or err in TRANSIENT:
                raise _Failure(f"Slack error: {detail}", retry=True) from None
            raise _Failure(f"Slack refused: {detail}") from None
        except (OSError, HTTPException, SlackRequestError) as e:  # URLError, timeouts, resets
            code = getattr(e, "code", None)
            if isinstance(code, int) and 400 <= code < 500 and code != 429:
                raise _Failure(f"HTTP {code}: {e}") from None
            raise _Failure(f"network error: {type(e).__name__}: {e}", retry=True) from None

    def _post(
        self, channel: str, msg: SlackMessage, thread_ts: str | None = None, broadcast: bool = False
    ) -> tuple[str, str]:
        if self._hook is not None:
            r = self._call(
                lambda: self._hook.send(  # type: ignore[union-attr]
                    text=msg.text, blocks=msg.blocks, unfurl_links=False, unfurl_media=False
                )
            )
            if r.status_code == 429:
                raise _Failure(
                    f"webhook still rate limited after {self.settings.max_retries} waits"
                )
            if r.status_code >= 500:
                raise _Failure(f"webhook HTTP {r.status_code}: {r.body}", retry=True)
            if r.status_code != 200:
                raise _Failure(f"webhook refused: HTTP {r.status_code}: {r.body}")
            return channel, ""
        extra: dict[str, Any] = {"thread_ts": thread_ts} if thread_ts else {}
        if thread_ts and broadcast:
            extra["reply_broadcast"] = True
        r = self._call(
            lambda: self._web.chat_postMessage(  # type: ignore[union-attr]
                channel=channel,
                text=msg.text,
                blocks=msg.blocks,
                unfurl_links=False,
                unfurl_media=False,
                **extra,
            )
        )
        return str(r["channel"]), str(r["ts"])

    def _update(self, th: _Thread, msg: SlackMessage) -> None:
        self._call(
            lambda: self._web.chat_update(  # type: ignore[union-attr]
                channel=th.channel, ts=th.ts, text=msg.text, blocks=msg.blocks
            )
        )

    def _upload(self, th: _Thread, png: bytes, view: IncidentView) -> None:
        step = view.fired.get("step")
        alt = f"Grade, attention entropy and loss around step {step} for incident {view.incident}"
        self._call(
            lambda: self._web.files_upload_v2(  # type: ignore[union-attr]
                channel=th.channel,
                thread_ts=th.ts,
                file=png,
                title=f"{view.incident}: around step {step}",
                filename=f"spikeguard-{view.incident}.png",
                alt_txt=alt,
            )
        )

    def _redact(self, text: str) -> str:
        """``text`` without the token, the webhook URL or anything that looks like a secret:
        slack-sdk's errors can quote the URL they were given (``Invalid URL detected: …``)."""
        return redact(text, known=[self.settings.token or "", self.settings.webhook_url or ""])

    def _undelivered(self, op: _Op, error: str) -> None:
        error = self._redact(error)
        log.warning("slack: %s undelivered: %s", op.what, error)
        incident = op.ref.view.incident if op.ref else None
        self._safe_journal(
            {"kind": "notify_undelivered", "incident": incident, "what": op.what, "error": error}
        )

    def _safe_journal(self, event: dict) -> None:
        try:
            self._journal(event)
        except Exception:
            log.exception("journal call failed for %s", event.get("kind"))
