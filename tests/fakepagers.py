"""Local pager servers for the tests, on 127.0.0.1 with a free port, each in its own thread.

* :class:`Receiver`: records every POST (path, headers, raw body, JSON) and answers 200; it can
  be told to answer a status N times (``fail``, with a ``Retry-After``) or to hold each request
  until released (``hang``): a pager that is down or stuck.
* :class:`PagerDutyServer`: PagerDuty's Events API v2 ``/v2/enqueue``, checking each event
  against the Events v2 schema (:func:`events_v2_errors`: required fields, enums, lengths, a
  32-character routing key, a ``dedup_key`` for acknowledge and resolve) and answering like
  PagerDuty: 202 ``{"status": "success", "message": "Event processed", "dedup_key": …}`` or 400
  ``{"status": "invalid event", "message": "Event object is invalid", "errors": [...]}``. It
  keeps each alert's state by ``dedup_key`` the way PagerDuty does.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import secrets
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclasses.dataclass(frozen=True)
class Request:
    """One request a server got."""

    path: str
    headers: dict[str, str]
    body: bytes
    status: int
    """What it was answered."""

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """An HTTP server that records what is POSTed to it (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._lock = threading.Condition()
        self._failures: list[tuple[int, str | None]] = []
        self._hang = threading.Event()
        self._released = threading.Event()
        self.hung = 0
        """Requests being held right now."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                if outer._hang.is_set():
                    with outer._lock:
                        outer.hung += 1
                        outer._lock.notify_all()
                    outer._released.wait(120)
                    with outer._lock:
                        outer.hung -= 1
                status, answer, headers = outer._answer(self.path, body)
                with outer._lock:
                    outer.requests.append(
                        Request(self.path, dict(self.headers.items()), body, status)
                    )
                    outer._lock.notify_all()
                data = json.dumps(answer).encode() if answer is not None else b""
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (its timeout)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- controls
    def fail(self, status: int, times: int, retry_after: str | None = None) -> None:
        """Answer the next ``times`` requests with ``status`` (and ``Retry-After``)."""
        with self._lock:
            self._failures.extend([(status, retry_after)] * times)

    def hang(self) -> None:
        """Hold every request from now on until :meth:`release`."""
        self._released.clear()
        self._hang.set()

    def release(self) -> None:
        """Let held requests (and later ones) through."""
        self._hang.clear()
        self._released.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    # ----------------------------------------------------------------- reading
    def wait_for(self, check: Callable[[list[Request]], bool], timeout_s: float = 60.0) -> bool:
        """Wait (polled on each request) until ``check(requests)`` holds; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not check(list(self.requests)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.5))
            return True

    def wait_hung(self, n: int = 1, timeout_s: float = 60.0) -> bool:
        """Wait until ``n`` requests are being held."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.hung < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.5))
            return True

    def delivered(self) -> list[Request]:
        """The requests answered 2xx."""
        with self._lock:
            return [r for r in self.requests if 200 <= r.status < 300]

    def _answer(self, path: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        with self._lock:
            if self._failures:
                status, retry_after = self._failures.pop(0)
                return (
                    status,
                    {"error": f"told to answer {status}"},
                    ({"Retry-After": retry_after} if retry_after else {}),
                )
            return self.accept(path, body)

    def accept(self, path: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        """The answer to a request that is not told to fail: 200."""
        return 200, None, {}


# ---- PagerDuty Events API v2 -----------------------------------------------------------------
ACTIONS = ("trigger", "acknowledge", "resolve")
SEVERITIES = ("critical", "error", "warning", "info")
TOP_KEYS = {"routing_key", "event_action", "dedup_key", "payload", "images", "links", "client"}
TOP_KEYS |= {"client_url"}
PAYLOAD_KEYS = {"summary", "source", "severity", "timestamp", "component", "group", "class"}
PAYLOAD_KEYS |= {"custom_details"}


def _string(errors: list[str], obj: dict, key: str, *, required: bool, max_len: int = 0) -> None:
    if key not in obj:
        if required:
            errors.append(f"'{key}' is missing or blank")
        return
    v = obj[key]
    if not isinstance(v, str) or (required and not v.strip()):
        errors.append(f"'{key}' must be a non-blank string")
    elif max_len and len(v) > max_len:
        errors.append(f"'{key}' is longer than {max_len} characters")


def events_v2_errors(event: Any) -> list[str]:
    """What is wrong with ``event`` as an Events API v2 alert event (empty: valid)."""
    if not isinstance(event, dict):
        return ["Event object must be a JSON object"]
    errors = [f"unknown field '{k}'" for k in event if k not in TOP_KEYS]
    key = event.get("routing_key")
    if not isinstance(key, str) or len(key) != 32:
        errors.append("Length of 'routing_key' is incorrect (should be 32 characters)")
    action = event.get("event_action")
    if action not in ACTIONS:
        errors.append("'event_action' must be one of trigger, acknowledge, resolve")
    _string(errors, event, "dedup_key", required=action in ("acknowledge", "resolve"), max_len=255)
    for name in ("client", "client_url"):
        _string(errors, event, name, required=False)
    for name, need in (("links", "href"), ("images", "src")):
        items = event.get(name, [])
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get(need), str) for i in items
        ):
            errors.append(f"'{name}' must be a list of objects each with '{need}'")
    if action != "trigger":
        return errors
    payload = event.get("payload")
    if not isinstance(payload, dict):
        return [*errors, "'payload' is missing or not an object"]
    errors += [f"unknown field 'payload.{k}'" for k in payload if k not in PAYLOAD_KEYS]
    _string(errors, payload, "summary", required=True, max_len=1024)
    _string(errors, payload, "source", required=True)
    if payload.get("severity") not in SEVERITIES:
        errors.append("'payload.severity' must be one of critical, error, warning, info")
    for name in ("component", "group", "class"):
        _string(errors, payload, name, required=False)
    if "timestamp" in payload:
        try:
            _dt.datetime.fromisoformat(str(payload["timestamp"]).replace("Z", "+00:00"))
        except ValueError:
            errors.append("'payload.timestamp' is not an ISO 8601 time")
    if "custom_details" in payload and not isinstance(payload["custom_details"], dict):
        errors.append("'payload.custom_details' must be an object")
    return errors


class PagerDutyServer(Receiver):
    """Events API v2 at ``/v2/enqueue`` (see the module docstring); ``alerts``: each
    ``dedup_key``'s state (triggered, acknowledged, resolved) as PagerDuty would have it."""

    def __init__(self) -> None:
        self.alerts: dict[str, str] = {}
        self.invalid: list[tuple[Any, list[str]]] = []
        super().__init__()

    def accept(self, path: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        if path != "/v2/enqueue":
            return 404, {"status": "not found"}, {}
        try:
            event = json.loads(body)
        except ValueError:
            event = None
        errors = events_v2_errors(event)
        if errors:
            self.invalid.append((event, errors))
            answer = {"status": "invalid event", "message": "Event object is invalid"}
            return 400, {**answer, "errors": errors}, {}
        key = event.get("dedup_key") or secrets.token_hex(16)
        action, state = event["event_action"], self.alerts.get(key)
        if action == "trigger" and state in (None, "resolved"):
            self.alerts[key] = "triggered"
        elif action == "acknowledge" and state == "triggered":
            self.alerts[key] = "acknowledged"
        elif action == "resolve" and state in ("triggered", "acknowledged"):
            self.alerts[key] = "resolved"
        answer = {"status": "success", "message": "Event processed", "dedup_key": key}
        return 202, answer, {}

    def events(self) -> list[dict[str, Any]]:
        """The events accepted (202), in order."""
        return [r.json for r in self.delivered()]
