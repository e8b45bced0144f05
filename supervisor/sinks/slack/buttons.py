"""The root message's buttons, answered over Socket Mode: a press becomes an operator request.

With ``SLACK_APP_TOKEN`` (an app-level ``xapp-…`` token with ``connections:write``) the Slack sink
starts a :class:`ButtonListener`: slack-sdk's built-in Socket Mode client (no public URL needed),
its ``apps.connections.open`` through the same Web API base as the notifier
(``SPIKEGUARD_SLACK_API_URL``). Each ``interactive`` envelope is acked at once, before anything
else (Slack shows the presser an error after 3 s), then :func:`decide` (pure) reads the press:

* a press of one of :data:`~.render.BUTTONS`, for this run, by a user listed in
  ``SPIKEGUARD_SLACK_OPERATORS``: :class:`Accepted`, an
  :class:`~...intake.operator.OperatorRequest` (``via="slack"``, ``who="U123 (alice)"``, the
  button's incident; Resume with ``lr_factor`` :data:`~.render.RESUME_LR_FACTOR`), which
  :meth:`ButtonListener.carry_out` puts in ``RUN_DIR/operator/`` like ``spikeguard ack|hold|
  resume`` does. The controller takes it at its next tick, and the journal's ``operator``
  answer (acknowledged, hold set, resumed, or refused and why) shows in the incident's thread.
* anything else (another user, another run's button, an unknown button, a payload that is not a
  press spikeguard's buttons make, however malformed or large): :class:`Refused`, said to the
  presser in an ephemeral message and journaled as an ``operator`` event of code
  ``button_refused`` (when the payload names a user); nothing is written, nothing raises.

Socket Mode hands each envelope to one of the app's open connections: give each supervisor that
runs at the same time its own Slack app, or a press may reach a supervisor of another run (it is
refused there, saying which run the button belongs to).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slack_sdk.errors import SlackApiError

from ...decide.events import Code, Kind
from ...intake.operator import OperatorRequest, ResumeChoice, write_request
from .client import RedactingFilter, web_client
from .render import BUTTONS, RESUME_LR_FACTOR, VALUE_MAX, Button
from .settings import USER_ID, SlackSettings

log = logging.getLogger("spikeguard.slack")
BY_ACTION_ID: dict[str, Button] = {b.action_id: b for b in BUTTONS}
"""The buttons by the ``action_id`` a press names."""
CHANNEL_ID = re.compile(r"[CGD][A-Z0-9]{2,30}")
"""What a Slack channel ID looks like (a public, private or direct channel)."""
INCIDENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""What an incident id in a button's value may look like (``inc-001``)."""
NAME_MAX = 80
"""A presser's Slack name is cut to this many characters (it is only shown)."""
PERMANENT = frozenset(
    {
        "invalid_auth",
        "not_authed",
        "not_allowed_token_type",
        "missing_scope",
        "account_inactive",
        "token_revoked",
        "token_expired",
    }
)
"""``apps.connections.open`` errors no retry cures: the buttons stay unanswered, said once."""
RETRY_MAX_S = 60.0
"""The longest wait between two attempts to open the Socket Mode connection."""


@dataclasses.dataclass(frozen=True)
class Presser:
    """Who pressed, and where an answer to them goes."""

    user: str
    """Their Slack user ID (``U0123ABCD``)."""
    who: str
    """How requests and the journal name them: ``U0123ABCD (alice)``."""
    channel: str | None
    """The channel of the message they pressed on (None: not named, or not an ID)."""


@dataclasses.dataclass(frozen=True)
class Accepted:
    """A press to carry out: the request to write."""

    request: OperatorRequest
    presser: Presser


@dataclasses.dataclass(frozen=True)
class Refused:
    """A press not to carry out, and why (said to the presser, journaled)."""

    reason: str
    presser: Presser | None
    """None when the payload names no user (nobody to tell, nothing to journal)."""
    action: str | None = None
    """The action of the button pressed, when it is one of ours."""
    incident: str | None = None
    """The incident its value named, when it names one."""


def _get(obj: Any, *keys: str) -> Any:
    """``obj[k1][k2]…`` when every level is a mapping, else None."""
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def presser(payload: Any) -> Presser | None:
    """Who pressed (from ``user`` and ``channel``/``container``); None when no valid user ID."""
    user = _get(payload, "user", "id")
    if not isinstance(user, str) or not USER_ID.fullmatch(user):
        return None
    name = _get(payload, "user", "username") or _get(payload, "user", "name")
    name = re.sub(r"[^\w.@-]", "", name)[:NAME_MAX] if isinstance(name, str) else ""
    channel = _get(payload, "channel", "id") or _get(payload, "container", "channel_id")
    ok = isinstance(channel, str) and CHANNEL_ID.fullmatch(channel)
    return Presser(user, f"{user} ({name})" if name else user, channel if ok else None)


def button_target(value: Any) -> tuple[str, str] | None:
    """The (run, incident) a button's value names (:func:`~.render.button_value`); None when it
    is not such a value."""
    if not isinstance(value, str) or len(value) > VALUE_MAX:
        return None
    try:
        data = json.loads(value)
    except ValueError:
        return None
    if not isinstance(data, dict) or set(data) != {"run", "incident"}:
        return None
    run, incident = data["run"], data["incident"]
    if not (isinstance(run, str) and isinstance(incident, str)):
        return None
    return (run, incident) if INCIDENT_ID.fullmatch(incident) else None


def decide(payload: Any, *, run: str, operators: tuple[str, ...]) -> Accepted | Refused:
    """What a ``block_actions`` payload asks, and whether to do it (pure: no I/O)."""
    who = presser(payload)
    if _get(payload, "type") != "block_actions":
        kind = _get(payload, "type")
        return Refused(f"not a button press (type {str(kind)[:40]!r})", who)
    if who is None:
        return Refused("the press names no Slack user", None)
    actions = _get(payload, "actions")
    if not isinstance(actions, list) or len(actions) != 1:
        n = len(actions) if isinstance(actions, list) else 0
        return Refused(f"a press of one button expected, got {n} actions", who)
    button = BY_ACTION_ID.get(str(_get(actions[0], "action_id")))
    if button is None:
        return Refused(f"unknown button {str(_get(actions[0], 'action_id'))[:60]!r}", who)
    target = button_target(_get(actions[0], "value"))
    if target is None:
        return Refused("the button's value is not one spikeguard wrote", who, button.action)
    their_run, incident = target
    if their_run != run:
        why = f"the button is of run {their_run[:200]!r}; this supervisor runs {run!r}"
        return Refused(why, who, button.action, incident)
    if who.user not in operators:
        why = (
            f"{who.who} is not in SPIKEGUARD_SLACK_OPERATORS"
            if operators
            else "SPIKEGUARD_SLACK_OPERATORS is empty: nobody may press the buttons"
        )
        return Refused(why, who, button.action, incident)
    resume = ResumeChoice(lr_factor=RESUME_LR_FACTOR) if button.action == "resume" else None
    request = OperatorRequest(
        action=button.action, who=who.who, via="slack", incident=incident, resume=resume
    )
    return Accepted(request, who)


def refused_event(refused: Refused) -> dict[str, Any]:
    """The journal's ``operator`` event (code ``button_refused``) of a refused press."""
    return {
        "kind": Kind.OPERATOR.value,
        "code": Code.BUTTON_REFUSED.value,
        "incident": refused.incident,
        "reason": refused.reason,
        "action": refused.action,
        "who": refused.presser.who if refused.presser else None,
        "via": "slack",
        "request": None,
    }


def refused_text(refused: Refused) -> str:
    """What the presser is told (ephemeral: only they see it)."""
    return f":no_entry: spikeguard did not act on your press: {refused.reason}."


Tell = Callable[[str, str, str], None]
"""Sends ``text`` to user ``user`` in channel ``channel`` as an ephemeral message."""
Record = Callable[[dict[str, Any]], Any]
"""Journals an event."""


class ButtonListener:
    """Answers the buttons of one run over Socket Mode (see the module docstring)."""

    def __init__(
        self, settings: SlackSettings, *, run: str, run_dir: Path, record: Record, tell: Tell
    ) -> None:
        if not settings.buttons:
            raise ValueError(settings.buttons_problem() or "SLACK_APP_TOKEN is not set")
        self.settings, self.run, self.run_dir = settings, run, Path(run_dir)
        self._record, self._tell = record, tell
        self._closed = threading.Event()
        self._client: Any = None
        self._thread: threading.Thread | None = None
        self.connected = threading.Event()
        """Set once the Socket Mode connection is open (the first time)."""
        self._log = logging.getLogger("spikeguard.slack.socket_mode")
        """slack-sdk's Socket Mode client logs here: warnings and up, secrets redacted."""
        self._log.setLevel(logging.WARNING)
        redacting = RedactingFilter()
        redacting.known.update(v for v in (settings.app_token, settings.token) if v)
        self._log.addFilter(redacting)

    def start(self) -> None:
        """Open the connection in the background (retried with backoff until :meth:`close`)."""
        problem = self.settings.operators_problem()
        if problem:
            log.warning("Slack buttons: %s", problem)
        from slack_sdk.socket_mode.builtin import SocketModeClient

        self._client = SocketModeClient(
            app_token=str(self.settings.app_token),
            web_client=web_client(self.settings, self._closed),
            logger=self._log,
            concurrency=2,
        )
        self._client.message_listeners.append(self._on_message)
        self._thread = threading.Thread(
            target=self._connect, name="spikeguard-slack-buttons", daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float = 0.5) -> None:
        """Stop answering at once (a press from now on goes unanswered), and close the
        connection in the background: slack-sdk's close waits out its socket's receive timeout
        (about 3 s), which a supervisor on its way out need not wait for (``timeout_s`` at most).
        """
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._client is not None:
            closer = threading.Thread(
                target=self._close_client, name="spikeguard-slack-buttons-close", daemon=True
            )
            closer.start()
            closer.join(timeout=timeout_s)

    def _close_client(self) -> None:
        try:
            self._client.close()
        except Exception:
            log.exception("Slack buttons: closing the Socket Mode client failed")

    def _connect(self) -> None:
        wait = 1.0
        while not self._closed.is_set():
            try:
                self._client.wss_uri = None  # a URL's ticket opens one connection: a fresh one
                self._client.connect()
            except SlackApiError as e:
                error = str(e.response.get("error") or f"HTTP {e.response.status_code}")
                if error in PERMANENT:
                    log.warning(
                        "Slack buttons: apps.connections.open refused the app token (%s): "
                        "no button press will be answered",
                        error,
                    )
                    return
                log.warning("Slack buttons: cannot connect yet (%s); retrying", error)
            except Exception as e:  # a network error: retried
                log.warning("Slack buttons: cannot connect yet (%s); retrying", type(e).__name__)
            else:
                self.connected.set()
                return
            self._closed.wait(wait)
            wait = min(RETRY_MAX_S, wait * 2)

    def _on_message(self, client: Any, message: Any, raw: Any = None) -> None:
        """One message from Slack: an envelope is acked first (Slack's 3 s), whatever it holds
        (slack-sdk's own request listeners never see one whose payload is not an object), then
        an ``interactive`` one is read as a press and carried out."""
        if self._closed.is_set():
            return  # closing: nobody would carry it out (Slack tells the presser it failed)
        if not isinstance(message, dict) or not isinstance(message.get("envelope_id"), str):
            return  # hello, disconnect: the client's own business
        client.send_socket_mode_response({"envelope_id": message["envelope_id"]})
        if message.get("type") != "interactive":
            return
        payload = message.get("payload")
        self.carry_out(decide(payload, run=self.run, operators=self.settings.operators))

    def carry_out(self, outcome: Accepted | Refused) -> None:
        """Write an accepted press's request; tell and journal a refused one. Never raises."""
        try:
            if isinstance(outcome, Accepted):
                try:
                    req = write_request(self.run_dir, outcome.request)
                except (OSError, ValueError) as e:
                    why = f"the request could not be written to the run directory: {e}"
                    r = outcome.request
                    outcome = Refused(why[:300], outcome.presser, r.action, r.incident)
                else:
                    log.info(
                        "Slack buttons: %s pressed %s on %s (request %s)",
                        req.who,
                        req.action,
                        req.incident,
                        req.id,
                    )
                    return
            log.info("Slack buttons: a press was refused: %s", outcome.reason)
            if outcome.presser is None:
                return
            self._record(refused_event(outcome))
            if outcome.presser.channel:
                self._tell(outcome.presser.channel, outcome.presser.user, refused_text(outcome))
        except Exception:  # a listener bug must not take the connection down
            log.exception("Slack buttons: could not carry out a press")
