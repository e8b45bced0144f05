"""A local Slack-compatible HTTP server for tests (loopback, real HTTP, no mocks).

Serves ``auth.test``, ``chat.postMessage``, ``chat.update``, ``chat.postEphemeral``,
``files.getUploadURLExternal`` + the upload URL it hands out + ``files.completeUploadExternal``,
incoming webhooks, and Socket Mode: ``apps.connections.open`` (app token ``xapp-…`` only) hands out
the ``ws://`` URL of a websocket server (:class:`SocketModeServer`, the ``websockets`` package in
its own thread and event loop) that says ``hello``, pushes ``interactive`` envelopes
(:meth:`FakeSlack.press`: a button pressed) and records each ack with the time it took.

Records every request and validates it against Slack's Web API OpenAPI spec
(``../shared/reference/slack/``): known parameters, required ones, types (JSON or form encoding),
JSON-encoded fields that parse, the token in the ``Authorization`` header (an app token only for
``apps.connections.open``, else ``not_allowed_token_type``); and Block Kit limits (<= 50 blocks,
header <= 150 chars, section text <= 3000, <= 10 fields of <= 2000, buttons). Failures get
``invalid_arguments`` and land in :attr:`FakeSlack.violations`. The 2020 spec predates the v2
upload methods and Socket Mode: :data:`SUPPLEMENT` is transcribed from docs.slack.dev. (The spec
says GET for ``auth.test``; slack-sdk POSTs, as Slack accepts.) Faults:
:meth:`~FakeSlack.rate_limit` (429 + ``Retry-After``), :meth:`~FakeSlack.outage` (500s),
:meth:`~FakeSlack.force_error`, ``delay_s``; naturally: a wrong token (``invalid_auth``), a
channel the bot is not in (``not_in_channel``), a token without a scope (``missing_scope``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlsplit

SPEC_PATH = (
    Path(__file__).resolve().parents[1].parent
    / "shared/reference/slack/slack_web_openapi_v2_without_examples.json"
)
TOKEN = "xoxb-fake-0000-spikeguard"
APP_TOKEN = "xapp-1-A0APP-0000-spikeguard"
"""The app-level token of the fake's app (Socket Mode: ``apps.connections.open`` only)."""
ALL_SCOPES = ("chat:write", "files:write", "channels:read")
APP_SCOPES = ("connections:write",)
APP_ONLY = {"apps.connections.open"}
"""Methods only an app-level token may call (any other token: ``not_allowed_token_type``)."""
JSON_FIELDS = {"blocks", "attachments", "files"}  # JSON-encoded strings in form encoding
#: Not in the 2020 spec; transcribed from docs.slack.dev/reference/methods/<method>.
SUPPLEMENT = {
    "files.getUploadURLExternal": {
        "filename": ("string", True),
        "length": ("integer", True),
        "alt_txt": ("string", False),
        "snippet_type": ("string", False),
    },
    "files.completeUploadExternal": {
        "files": ("string", True),
        "channel_id": ("string", False),
        "channels": ("string", False),
        "thread_ts": ("string", False),
        "initial_comment": ("string", False),
        "blocks": ("string", False),
    },
    # docs.slack.dev/reference/methods/apps.connections.open: no arguments but the app token
    "apps.connections.open": {},
}
SCOPE_OF = {
    "chat.postMessage": "chat:write",
    "chat.update": "chat:write",
    "chat.postEphemeral": "chat:write",
    "apps.connections.open": "connections:write",
    "files.getUploadURLExternal": "files:write",
    "files.completeUploadExternal": "files:write",
}
BLOCK_TYPES = {
    "section",
    "header",
    "context",
    "divider",
    "image",
    "actions",
    "rich_text",
    "input",
    "file",
    "video",
    "markdown",
}


def load_spec(path: Path = SPEC_PATH) -> dict[str, dict[str, tuple[str, bool]]]:
    """method -> {param: (type, required)} from the OpenAPI spec, plus :data:`SUPPLEMENT`."""
    spec = json.loads(path.read_text())
    out = {
        p.lstrip("/"): {
            q["name"]: (q.get("type", "string"), bool(q.get("required")))
            for q in op.get("parameters", [])
        }
        for p, ops in spec["paths"].items()
        for op in ops.values()
    }
    return {**out, **SUPPLEMENT}


def _text_obj(
    obj: Any, where: str, limit: int, kinds: tuple[str, ...] = ("mrkdwn", "plain_text")
) -> list[str]:
    if not isinstance(obj, dict) or obj.get("type") not in kinds:
        return [f"{where}: text object of type {kinds} expected, got {obj!r:.80}"]
    text = obj.get("text")
    if not isinstance(text, str) or not text:
        return [f"{where}: empty or missing text"]
    return [f"{where}: {len(text)} chars > {limit}"] if len(text) > limit else []


def block_kit_problems(blocks: Any) -> list[str]:
    """Block Kit structure and limits that Slack enforces with ``invalid_blocks``."""
    if not isinstance(blocks, list):
        return [f"blocks must be a JSON array, got {type(blocks).__name__}"]
    out = [f"{len(blocks)} blocks > 50"] if len(blocks) > 50 else []
    for i, b in enumerate(blocks):
        w = f"blocks[{i}]"
        if not isinstance(b, dict) or b.get("type") not in BLOCK_TYPES:
            out.append(f"{w}: unknown block {b!r:.80}")
            continue
        if len(str(b.get("block_id", ""))) > 255:
            out.append(f"{w}: block_id > 255 chars")
        t = b["type"]
        if t == "header":
            out += _text_obj(b.get("text"), f"{w}.text", 150, ("plain_text",))
        elif t == "section":
            if "text" not in b and "fields" not in b:
                out.append(f"{w}: section needs text or fields")
            if "text" in b:
                out += _text_obj(b["text"], f"{w}.text", 3000)
            fields = b.get("fields", [])
            if "fields" in b and (not isinstance(fields, list) or not 0 < len(fields) <= 10):
                out.append(f"{w}.fields: 1..10 items expected")
            for j, f in enumerate(fields if isinstance(fields, list) else []):
                out += _text_obj(f, f"{w}.fields[{j}]", 2000)
        elif t == "context":
            els = b.get("elements")
            if not isinstance(els, list) or not 0 < len(els) <= 10:
                out.append(f"{w}.elements: 1..10 items expected")
            for j, e in enumerate(els if isinstance(els, list) else []):
                if not (isinstance(e, dict) and e.get("type") == "image"):
                    out += _text_obj(e, f"{w}.elements[{j}]", 3000)
        elif t == "image" and not (b.get("image_url") and b.get("alt_text")):
            out.append(f"{w}: image needs image_url and alt_text")
        elif t == "actions":
            els = b.get("elements")
            if not isinstance(els, list) or not 0 < len(els) <= 25:
                out.append(f"{w}.elements: 1..25 items expected")
            for j, e in enumerate(els if isinstance(els, list) else []):
                out += _button_problems(e, f"{w}.elements[{j}]")
    return out


def _button_problems(e: Any, where: str) -> list[str]:
    """A ``button`` element as Block Kit takes it (text <= 75, action_id <= 255, value <= 2000,
    style primary/danger, a complete confirm dialog); other interactive elements pass."""
    if not isinstance(e, dict) or e.get("type") != "button":
        return [] if isinstance(e, dict) and e.get("type") else [f"{where}: unknown element"]
    out = _text_obj(e.get("text"), f"{where}.text", 75, ("plain_text",))
    if not isinstance(e.get("action_id", ""), str) or len(e.get("action_id", "")) > 255:
        out.append(f"{where}.action_id: a string <= 255 chars expected")
    if not isinstance(e.get("value", ""), str) or len(e.get("value", "")) > 2000:
        out.append(f"{where}.value: a string <= 2000 chars expected")
    if e.get("style") not in (None, "primary", "danger"):
        out.append(f"{where}.style: primary or danger expected, got {e.get('style')!r}")
    confirm = e.get("confirm")
    if confirm is not None:
        out += _text_obj(confirm.get("title"), f"{where}.confirm.title", 100, ("plain_text",))
        out += _text_obj(confirm.get("text"), f"{where}.confirm.text", 300)
        out += _text_obj(confirm.get("confirm"), f"{where}.confirm.confirm", 30, ("plain_text",))
        out += _text_obj(confirm.get("deny"), f"{where}.confirm.deny", 30, ("plain_text",))
    return out


def _type_problem(name: str, value: Any, typ: str, is_json: bool) -> str | None:
    if name in JSON_FIELDS:
        if is_json and isinstance(value, (list, dict)):
            return None
        if not isinstance(value, str):
            return f"{name}: JSON-encoded string expected, got {type(value).__name__}"
        try:
            json.loads(value)
        except ValueError as e:
            return f"{name}: does not parse as JSON ({e})"
        return None
    ok = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,)}[typ]
    if is_json:
        good = isinstance(value, ok) and not (typ != "boolean" and isinstance(value, bool))
    else:
        pattern = {
            "string": r"(?s).*",
            "integer": r"-?\d+",
            "number": r"-?\d+(\.\d+)?",
            "boolean": r"true|false|1|0",
        }[typ]
        good = isinstance(value, str) and re.fullmatch(pattern, value) is not None
    return None if good else f"{name}: {typ} expected, got {value!r:.60}"


@dataclass
class Call:
    """One recorded HTTP request (``at``: monotonic arrival) and what the fake answered."""

    method: str
    params: dict[str, Any]
    headers: dict[str, str]
    status: int = 200
    response: Any = None
    at: float = field(default_factory=time.monotonic)

    @property
    def ok(self) -> bool:
        """True when Slack would have accepted it."""
        return self.status == 200 and (not isinstance(self.response, dict) or self.response["ok"])


@dataclass
class Envelope:
    """One envelope pushed over Socket Mode, and its ack (``at``/``acked_at``: monotonic)."""

    envelope_id: str
    body: Any
    at: float = field(default_factory=time.monotonic)
    acked_at: float | None = None
    ack: dict[str, Any] | None = None

    @property
    def ack_s(self) -> float | None:
        """Seconds from the push to the ack (None: not acked yet)."""
        return None if self.acked_at is None else self.acked_at - self.at


class SocketModeServer:
    """Slack's Socket Mode side: a websocket server on loopback (``websockets``, in its own thread
    and event loop). A connection must come with a ticket :meth:`issue` handed out (as the URL of
    ``apps.connections.open`` does), is greeted with ``hello``, and every message it sends back is
    an ack (``{"envelope_id": …}``) of an envelope :meth:`push` sent, else a violation."""

    def __init__(self, violations: list[str] | None = None) -> None:
        self.envelopes: dict[str, Envelope] = {}
        self.violations = [] if violations is None else violations
        """What a client did that Slack would not take (the fake's own list, when given)."""
        self.connects = 0
        """Connections accepted (a reconnect counts again)."""
        self._tickets: set[str] = set()
        self._open: list[Any] = []
        self._cv = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Future[None] | None = None
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="fakeslack-ws", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake Socket Mode server did not start")

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from websockets.asyncio.server import serve

        self._stop = self._loop.create_future()
        async with serve(self._session, "127.0.0.1", 0, ping_interval=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop

    async def _session(self, ws: Any) -> None:
        ticket = parse_qs(urlsplit(ws.request.path).query).get("ticket", [""])[0]
        with self._cv:
            known = ticket in self._tickets
            self._tickets.discard(ticket)  # a ticket opens one connection
        if not known:
            with self._cv:
                self.violations.append(f"websocket connection with unknown ticket {ticket!r}")
            await ws.close(1008, "invalid ticket")
            return
        hello = {
            "type": "hello",
            "num_connections": 1,
            "debug_info": {"host": "fakeslack", "approximate_connection_time": 18060},
            "connection_info": {"app_id": "A0APP"},
        }
        await ws.send(json.dumps(hello))
        with self._cv:
            self._open.append(ws)
            self.connects += 1
            self._cv.notify_all()
        try:
            async for raw in ws:
                self._received(raw)
        except Exception:  # a dropped connection: the client reconnects through a new ticket
            pass
        finally:
            with self._cv:
                self._open.remove(ws)
                self._cv.notify_all()

    def _received(self, raw: Any) -> None:
        now = time.monotonic()
        try:
            msg = json.loads(raw)
        except (TypeError, ValueError):
            msg = None
        with self._cv:
            env = self.envelopes.get(msg.get("envelope_id")) if isinstance(msg, dict) else None
            if env is None:
                self.violations.append(f"not an ack of a pushed envelope: {str(raw)[:200]!r}")
            elif env.ack is not None:
                self.violations.append(f"envelope {env.envelope_id} acked twice")
            else:
                env.ack, env.acked_at = msg, now
            self._cv.notify_all()

    def issue(self) -> str:
        """A fresh ticket and the URL that uses it (what ``apps.connections.open`` returns)."""
        ticket = secrets.token_hex(8)
        with self._cv:
            self._tickets.add(ticket)
        return f"ws://127.0.0.1:{self.port}/link/?ticket={ticket}&app_id=A0APP"

    def wait_connected(self, timeout_s: float = 10.0) -> bool:
        """Wait until a client is connected; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._open), timeout_s)

    def push(self, body: Any, envelope_id: str | None = None) -> Envelope:
        """Send ``body`` (a dict is sent as JSON with ``envelope_id`` set, a str as it is) to the
        newest connection; returns the envelope, whose ack is recorded when it comes."""
        if not self.wait_connected():
            raise TimeoutError("no Socket Mode client connected")
        eid = envelope_id or secrets.token_hex(8)
        if isinstance(body, dict):
            body = {"envelope_id": eid, **body}
        text = body if isinstance(body, str) else json.dumps(body)
        env = Envelope(eid, body)
        with self._cv:
            self.envelopes[eid] = env
            ws = self._open[-1]
        env.at = time.monotonic()
        asyncio.run_coroutine_threadsafe(ws.send(text), self._loop).result(10)
        return env

    def disconnect(self, reason: str = "refresh_requested") -> None:
        """Ask the client to reconnect, as Slack does now and then (``type: disconnect``)."""
        with self._cv:
            ws = self._open[-1]
        msg = json.dumps({"type": "disconnect", "reason": reason, "debug_info": {"host": "fake"}})
        asyncio.run_coroutine_threadsafe(ws.send(msg), self._loop).result(10)

    def wait_ack(self, env: Envelope, timeout_s: float = 10.0) -> bool:
        """Wait until ``env`` is acked; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: env.ack is not None, timeout_s)

    def close(self) -> None:
        """Stop the server and its loop."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(
                lambda: self._stop.done() or self._stop.set_result(None)
            )
        self._thread.join(5)


class FakeSlack:
    """The server; use as a context manager. See the module docstring."""

    def __init__(self, *, scopes: tuple[str, ...] = ALL_SCOPES, delay_s: float = 0.0) -> None:
        self.spec = load_spec()
        self.tokens = {TOKEN: set(scopes), APP_TOKEN: set(APP_SCOPES)}
        self.channels = {"C0ALERTS": ("ml-alerts", True), "C0OUTSIDE": ("elsewhere", False)}
        self.delay_s = delay_s
        self.calls: list[Call] = []
        self.violations: list[str] = []
        self.messages: list[dict[str, Any]] = []  # channel, ts, text, blocks, thread_ts, updates
        self.files: dict[str, dict[str, Any]] = {}
        self.webhook_posts: list[dict[str, Any]] = []
        self.ephemerals: list[dict[str, Any]] = []  # channel, user, text, blocks, thread_ts
        self._socket: SocketModeServer | None = None
        self._lock, self._ts = threading.Lock(), itertools.count(1)
        self._rate_limit: list[Any] = [0, 1, None]  # calls left, Retry-After, methods
        self._outage_until, self._forced = 0.0, {}  # type: tuple[float, dict[str, dict]]
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                fake._serve(self)

            do_GET, log_message = do_POST, lambda *a: None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.api_url = f"http://127.0.0.1:{self.port}/api/"
        self.webhook_url = f"http://127.0.0.1:{self.port}/services/T0TEST/B0HOOK/abc123"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    def __enter__(self) -> FakeSlack:
        return self._thread.start() or self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown(), self._server.server_close()
        if self._socket is not None:
            self._socket.close()

    # ------------------------------------------------------------------ fault injection
    def rate_limit(self, calls: int, retry_after: int = 1, methods: set[str] | None = None) -> None:
        """Answer the next ``calls`` API calls (of ``methods``) with 429 + ``Retry-After``."""
        self._rate_limit = [calls, retry_after, methods]

    def outage(self, seconds: float | None) -> None:
        """Answer HTTP 500 for ``seconds`` (None: until ``outage(0)``)."""
        self._outage_until = time.monotonic() + (1e9 if seconds is None else seconds)

    def force_error(self, method: str, error: str, **extra: Any) -> None:
        """Answer ``method`` with ``{"ok": false, "error": error, **extra}`` from now on."""
        self._forced[method] = {"ok": False, "error": error, **extra}

    # ------------------------------------------------------------------ Socket Mode
    @property
    def socket_mode(self) -> SocketModeServer:
        """The websocket side, started on first use (``apps.connections.open`` starts it)."""
        with self._lock:
            if self._socket is None:
                self._socket = SocketModeServer(self.violations)
            return self._socket

    def press(
        self,
        action_id: str,
        value: str,
        user: str = "U0ALICE",
        username: str = "alice",
        *,
        channel: str = "C0ALERTS",
        message_ts: str | None = None,
        timeout_s: float = 10.0,
    ) -> Envelope:
        """Press a button: push the ``block_actions`` envelope Slack sends when ``user`` clicks
        the button ``action_id`` carrying ``value`` (on message ``message_ts``); returns once
        the client acked it (its :attr:`Envelope.ack_s` says how fast), TimeoutError if not."""
        ts = message_ts or "1700000001.000100"
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": username, "name": username, "team_id": "T0TEST"},
            "api_app_id": "A0APP",
            "team": {"id": "T0TEST", "domain": "fake"},
            "container": {"type": "message", "message_ts": ts, "channel_id": channel},
            "trigger_id": "1.2.3",
            "channel": {"id": channel, "name": self.channels.get(channel, ("?",))[0]},
            "message": {"type": "message", "ts": ts, "text": ""},
            "response_url": f"{self.api_url[:-4]}actions/T0TEST/1/abc",
            "actions": [
                {
                    "type": "button",
                    "action_id": action_id,
                    "block_id": "spikeguard_operator",
                    "value": value,
                    "action_ts": f"{time.time():.6f}",
                }
            ],
        }
        return self.push_interactive(payload, timeout_s=timeout_s)

    def push_interactive(self, payload: Any, *, timeout_s: float = 10.0) -> Envelope:
        """Push an ``interactive`` envelope carrying ``payload`` (any JSON, hostile included) and
        wait for its ack; TimeoutError when none came."""
        body = {"type": "interactive", "payload": payload, "accepts_response_payload": False}
        env = self.socket_mode.push(body)
        if not self.socket_mode.wait_ack(env, timeout_s):
            raise TimeoutError(f"envelope {env.envelope_id} was not acked in {timeout_s} s")
        return env

    # ------------------------------------------------------------------ inspection
    def ok_calls(self, method: str) -> list[Call]:
        """Accepted calls of ``method``, in order."""
        return [c for c in self.calls if c.method == method and c.ok]

    def replies(self, thread_ts: str) -> list[dict[str, Any]]:
        """Messages posted in the thread of root ``thread_ts``, in order."""
        return [m for m in self.messages if m.get("thread_ts") == thread_ts]

    def roots(self) -> list[dict[str, Any]]:
        """Top-level messages, in order."""
        return [m for m in self.messages if not m["thread_ts"]]

    # ------------------------------------------------------------------ HTTP
    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        headers = {k.lower(): v for k, v in h.headers.items()}
        time.sleep(self.delay_s)
        if url.path.startswith("/upload/"):
            fid = url.path.rsplit("/", 1)[-1]
            call = Call("upload", {"file_id": fid, "bytes": len(body)}, headers)
            with self._lock:
                self.calls.append(call)
                if fid in self.files:
                    self.files[fid]["data"] = body
            return self._reply(h, call, 200 if fid in self.files else 404, f"OK - {len(body)}")
        is_json = headers.get("content-type", "").startswith("application/json")
        hook = url.path.startswith("/services/")
        method = "webhook" if hook else url.path.removeprefix("/api/")
        try:
            params: dict[str, Any] = dict(parse_qsl(url.query))
            params.update(
                json.loads(body or b"{}")
                if is_json
                else parse_qsl(body.decode(), keep_blank_values=True)
            )
            problems = (
                self._webhook_problems(params, is_json)
                if hook
                else self._validate(method, params, headers, is_json)
            )
        except (ValueError, TypeError) as e:
            params, problems = {}, [f"body does not parse: {e}"]
        call = Call(method, params, headers)
        with self._lock:
            self.calls.append(call)
            self.violations += [f"{method}: {p}" for p in problems]
            n, after, methods = self._rate_limit
            limited = n > 0 and (methods is None or method in methods)
            self._rate_limit[0] -= int(limited)
        if time.monotonic() < self._outage_until:  # checked after recording, like a real proxy
            return self._reply(h, call, 500, "internal_error (fake outage)")
        if limited:
            return self._reply(
                h,
                call,
                429,
                "rate_limited" if hook else {"ok": False, "error": "ratelimited"},
                {"Retry-After": str(after)},
            )
        if hook:
            if not problems:
                self.webhook_posts.append(params)
            return self._reply(
                h, call, 400 if problems else 200, "invalid_blocks" if problems else "ok"
            )
        if problems:
            return self._reply(
                h,
                call,
                200,
                {
                    "ok": False,
                    "error": "invalid_arguments",
                    "response_metadata": {"messages": problems},
                },
            )
        self._reply(h, call, 200, self._forced.get(method) or self._method(method, params, headers))

    def _reply(
        self,
        h: BaseHTTPRequestHandler,
        call: Call,
        status: int,
        payload: Any,
        headers: dict[str, str] | None = None,
    ) -> None:
        call.status, call.response = status, payload
        raw = (json.dumps(payload) if isinstance(payload, dict) else str(payload)).encode()
        h.send_response(status)
        h.send_header(
            "Content-Type",
            "application/json; charset=utf-8"
            if isinstance(payload, dict)
            else "text/plain; charset=utf-8",
        )
        scopes = self.tokens.get(_bearer(call.headers) or "")
        if scopes is not None:
            h.send_header("x-oauth-scopes", ",".join(sorted(scopes)))
        for k, v in {**(headers or {}), "Content-Length": str(len(raw))}.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(raw)

    @staticmethod
    def _webhook_problems(params: dict[str, Any], is_json: bool) -> list[str]:
        out = [] if is_json else ["webhook body must be JSON"]
        out += [] if params.get("text") or params.get("blocks") else ["needs text or blocks"]
        out += block_kit_problems(params["blocks"]) if "blocks" in params else []
        return out + [
            f"unknown webhook field {u!r}"
            for u in sorted(
                set(params)
                - {"text", "blocks", "attachments", "unfurl_links", "unfurl_media", "mrkdwn"}
            )
        ]

    def _validate(
        self, method: str, params: dict[str, Any], headers: dict[str, str], is_json: bool
    ) -> list[str]:
        schema = self.spec.get(method)
        if schema is None:
            return [f"unknown method {method!r} (not in the OpenAPI spec)"]
        out = [] if _bearer(headers) else ["token missing from the Authorization header"]
        for name, value in params.items():
            if name == "token":
                out.append("token sent as a parameter; expected in the Authorization header")
            elif name not in schema:
                out.append(f"unknown parameter {name!r}")
            else:
                problem = _type_problem(name, value, schema[name][0], is_json)
                out += [problem] if problem else []
        out += [
            f"required parameter {n!r} missing"
            for n, (_, req) in schema.items()
            if req and n != "token" and n not in params
        ]
        blocks = params.get("blocks")
        if blocks is not None and method in ("chat.postMessage", "chat.update"):
            try:
                out += block_kit_problems(json.loads(blocks) if isinstance(blocks, str) else blocks)
            except ValueError:
                pass  # already reported by the type check
        return out

    def _channel(self, ref: Any, by_id_only: bool = False) -> tuple[str | None, str | None]:
        """(channel id, error) for a channel reference as Slack resolves it."""
        ref = str(ref or "")
        for cid, (name, member) in self.channels.items():
            if ref == cid or (not by_id_only and ref.lstrip("#") == name):
                return cid, None if member else "not_in_channel"
        return None, "channel_not_found"

    def _method(self, method: str, p: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        scopes = self.tokens.get(_bearer(headers) or "")
        need = SCOPE_OF.get(method)
        if scopes is None:
            return {"ok": False, "error": "invalid_auth"}
        app_token = (_bearer(headers) or "").startswith("xapp-")
        if app_token != (method in APP_ONLY) and method != "auth.test":
            return {"ok": False, "error": "not_allowed_token_type"}
        if need and need not in scopes:
            return {
                "ok": False,
                "error": "missing_scope",
                "needed": need,
                "provided": ",".join(sorted(scopes)),
            }
        if method == "auth.test":
            return {
                "ok": True,
                "url": "https://fake.slack.com/",
                "team": "Fake Team",
                "user": "spikeguard",
                "team_id": "T0TEST",
                "user_id": "U0BOT",
                "bot_id": "B0BOT",
            }
        if method not in SCOPE_OF:
            return {"ok": False, "error": "not_implemented_by_fakeslack"}
        if method == "apps.connections.open":
            return {"ok": True, "url": self.socket_mode.issue()}
        if method == "files.getUploadURLExternal":
            fid = f"F{len(self.files) + 1:08d}"
            self.files[fid] = {
                "filename": p["filename"],
                "length": int(p["length"]),
                "alt_txt": p.get("alt_txt"),
                "data": None,
            }
            return {"ok": True, "file_id": fid, "upload_url": f"{self.api_url[:-4]}upload/{fid}"}
        cid, err = self._channel(
            p.get("channel_id") if "files." in method else p.get("channel"),
            by_id_only=method not in ("chat.postMessage", "chat.postEphemeral"),
        )
        if err:
            return {"ok": False, "error": err}
        with self._lock:
            return self._write(method, cid, p)

    def _write(self, method: str, cid: str | None, p: dict[str, Any]) -> dict[str, Any]:
        thread = p.get("thread_ts")
        if thread and not any(
            m["ts"] == thread and m["channel"] == cid and not m["thread_ts"] for m in self.messages
        ):
            self.violations.append(f"{method}: thread_ts {thread} is no root message in {cid}")
            return {"ok": False, "error": "thread_not_found"}
        blocks = p.get("blocks")
        blocks = json.loads(blocks) if isinstance(blocks, str) else blocks
        if method == "chat.postMessage":
            if not p.get("text") and not blocks and not p.get("attachments"):
                return {"ok": False, "error": "no_text"}
            ts = f"{1700000000 + next(self._ts)}.000100"
            self.messages.append(
                {
                    "channel": cid,
                    "ts": ts,
                    "text": p.get("text"),
                    "blocks": blocks,
                    "thread_ts": thread,
                    "updates": [],
                    "reply_broadcast": p.get("reply_broadcast") in (True, "true", "1"),
                }
            )
            return {"ok": True, "channel": cid, "ts": ts, "message": {"text": p.get("text")}}
        if method == "chat.postEphemeral":
            if not p.get("text") and not blocks:
                return {"ok": False, "error": "no_text"}
            self.ephemerals.append(
                {
                    "channel": cid,
                    "user": p.get("user"),
                    "text": p.get("text"),
                    "blocks": blocks,
                    "thread_ts": thread,
                }
            )
            return {"ok": True, "message_ts": f"{1700000000 + next(self._ts)}.000200"}
        if method == "chat.update":
            for m in self.messages:
                if m["channel"] == cid and m["ts"] == p["ts"]:
                    m["updates"].append({"text": p.get("text"), "blocks": blocks})
                    m["text"], m["blocks"] = p.get("text"), blocks
                    return {"ok": True, "channel": cid, "ts": m["ts"], "text": p.get("text")}
            return {"ok": False, "error": "message_not_found"}
        items = json.loads(p["files"]) if isinstance(p["files"], str) else p["files"]
        for it in items:
            f = self.files.get(it.get("id"))
            if f is None or f["data"] is None or len(f["data"]) != f["length"]:
                self.violations.append(
                    f"{method}: file {it.get('id')} not uploaded or wrong length"
                )
                return {"ok": False, "error": "file_not_found"}
            f.update(title=it.get("title"), channel=cid, thread_ts=thread)
        return {"ok": True, "files": [{"id": it["id"], "title": it.get("title")} for it in items]}


def _bearer(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    return auth[7:] if auth.startswith("Bearer ") and len(auth) > 7 else None


def incident_events(
    run: str = "gpt-1b",
    incident: str = "inc-001",
    *,
    t0: int = 0,
    conclusion: str = "probation_passed",
    severity: str = "page",
) -> list[dict]:
    """A journal's worth of one incident, shaped like the supervisor's events (for tests)."""
    ctx = {
        "steps": list(range(1180, 1240)),
        "grade": [6] * 50 + [2] * 10,
        "max_logit": [30.0] * 60,
        "attn_entropy_min": [2.1] * 50 + [0.15] * 10,
        "loss": [2.4] * 50 + [7.9] * 10,
    }
    steps: list[tuple[str, str, dict[str, Any]]] = [
        (
            "incident",
            "attention entropy of blocks.7.attn fell below 0.3",
            dict(
                rule="entropy-collapse",
                action="recover",
                severity=severity,
                signal="attn_entropy_min",
                value=0.15,
                rank=3,
                layer="blocks.7.attn",
                step=1230,
                loss=7.9,
                grad_norm=412.0,
                grade=2,
                attempt=1,
                context=ctx,
            ),
        ),
        ("kill", "killed 4 ranks of generation 0", dict(ranks=[0, 1, 2, 3], duration_s=1.42)),
        (
            "rollback",
            "newest checkpoint graded S6 >= S5 before step 1230",
            dict(
                checkpoint_step=1100,
                checkpoint_path="ckpt/step-1100",
                grade=6,
                skipped=[{"path": "ckpt/step-1200", "reason": "graded S3 < S5"}],
            ),
        ),
        ("lr_cut", "LR x0.5 on attempt 1 (scale now 0.5)", dict(factor=0.5, lr_scale=0.5)),
        ("optimizer_reset", "optimizer moments may carry the instability", {}),
        ("launch", "relaunched from step 1101", dict(generation=1, lr_scale=0.5)),
        (
            "probation_start",
            "299 steps must pass without another incident",
            dict(from_step=1101, until_step=1400),
        ),
        (conclusion, "no second incident in the probation window", dict(step=1400))
        if conclusion == "probation_passed"
        else (conclusion, "recovery budget of 2 attempts spent", dict(hold=False)),
    ]
    return [
        {
            "seq": i + 1,
            "kind": k,
            "time": f"2024-05-01T03:{(t0 + 2 * i) // 60:02d}:{(t0 + 2 * i) % 60:02d}+00:00",
            "mono": float(t0 + 2 * i),
            "run": run,
            "incident": incident,
            "reason": why,
            **f,
        }
        for i, (k, why, f) in enumerate(steps)
    ]
