"""The report channel: rank -> supervisor, never blocking the training step.

``send()`` encodes the message in the caller's thread (:mod:`.encode`: a message
that cannot be encoded is refused there, so ``send()`` says so), puts the line on a
bounded queue and returns at once; a daemon thread only writes bytes, and survives
anything that goes wrong while it does. When the queue is full the message is
dropped and counted (back-pressure must never slow training); the count is
sent as a ``dropped`` message once the writer catches up. When the process exits on its own
(the script returns, raises or calls ``sys.exit``: a crash, not a kill) what is still queued is
sent first, for at most :data:`EXIT_FLUSH_S`: the supervisor learns the last step the rank did.

Over a socket the channel also carries the supervisor's requests back (a checkpoint now, for a
policy rule or before a preemption): a reader thread puts them on a queue that
:meth:`Channel.poll_requests` drains without blocking (``Session.step`` does, every step).

Destinations (see :mod:`spikeguard.workers.contract`):

* ``off``                   — nothing is sent (the default without a supervisor)
* ``jsonl:///path/file``    — appended to a local JSONL file
* ``tcp://host:port``       — newline-delimited JSON to the rank's agent
* ``unix:///path/sock``     — the same over a Unix socket
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import socket
import threading
import time
import weakref
from typing import Any

from .encode import Unencodable, encode_line

_STOP = object()
MAX_REQUEST_BYTES = 1 << 16
_HEADER = ("v", "run", "gen", "rank", "step", "t")
"""The fields of a message a ``dropped`` note sent before it repeats."""
EXIT_FLUSH_S = 2.0
"""How long a process that exits on its own waits for its queued reports to be sent."""


class Channel:
    """Base channel: a bounded queue drained by one daemon thread."""

    def __init__(self, *, maxsize: int = 1024) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self.dropped = 0
        """Messages lost to a full queue or an unreachable agent (the supervisor is told)."""
        self.dropped_unencodable = 0
        """Messages refused by :meth:`send` because they cannot be encoded."""
        self.last_unencodable: str | None = None
        """Why the last of those was refused."""
        self.writer_errors = 0
        """Unexpected errors the writer thread survived (each cost one message)."""
        self.sent = 0
        self._reported_dropped = 0
        self._requests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="spikeguard-channel", daemon=True)
        self._thread.start()
        atexit.register(_flush_at_exit, weakref.ref(self))

    # -- called from the training thread -------------------------------------------------
    def send(self, msg: dict[str, Any]) -> bool:
        """Encode ``msg`` and enqueue it. Never blocks, never raises.

        Returns False, and counts it, when ``msg`` cannot be encoded (``dropped_unencodable``,
        the reason in ``last_unencodable``; see :mod:`.encode`) or the queue is full
        (``dropped``, which the supervisor is told of).
        """
        try:
            header, line = _encode(msg)
        except Unencodable as e:
            self.dropped_unencodable += 1
            self.last_unencodable = e.reason
            return False
        try:
            self._q.put_nowait((header, line))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def poll_requests(self) -> list[dict[str, Any]]:
        """The supervisor's requests received since the last call (never blocks)."""
        out = []
        while not self._requests.empty():
            out.append(self._requests.get_nowait())
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (up to ``timeout`` seconds) and stop the writer."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))

    # -- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                self._shutdown()
                return
            try:  # the writer outlives any one message, whatever goes wrong
                header, line = item
                if self.dropped != self._reported_dropped:
                    note = dict(header, type="dropped", count=self.dropped)
                    if self._write_line(_encode(note)[1]):
                        self._reported_dropped = note["count"]
                if self._write_line(line):
                    self.sent += 1
            except Exception:
                self.writer_errors += 1

    def _write_line(self, line: bytes) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _shutdown(self) -> None:
        pass


def _flush_at_exit(ref: weakref.ref[Channel]) -> None:
    """At interpreter exit: send what a still-open channel has queued (bounded), then stop."""
    channel = ref()
    if channel is not None and channel._thread.is_alive():
        channel.close(EXIT_FLUSH_S)


def _encode(msg: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The header a ``dropped`` note repeats, and the line; :class:`Unencodable` if impossible."""
    if not isinstance(msg, dict):
        raise Unencodable(f"a message is a dict, not a {type(msg).__qualname__}")
    data, line = encode_line(msg)
    return {k: data.get(k) for k in _HEADER}, line


class NullChannel:
    """Reports nothing. Same interface, no thread."""

    dropped = 0
    dropped_unencodable = 0
    last_unencodable: str | None = None
    writer_errors = 0
    sent = 0

    def send(self, msg: dict[str, Any]) -> bool:
        """Accept ``msg`` and discard it."""
        return True

    def poll_requests(self) -> list[dict[str, Any]]:
        return []

    def close(self, timeout: float = 5.0) -> None:
        pass


class JsonlChannel(Channel):
    """Appends one JSON object a line to a local file (flushed per line, not fsynced)."""

    def __init__(self, path: str, *, maxsize: int = 1024) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f = open(path, "ab", buffering=0)
        super().__init__(maxsize=maxsize)

    def _write_line(self, line: bytes) -> bool:
        try:
            self._f.write(line)
            return True
        except OSError:
            return False

    def _shutdown(self) -> None:
        self._f.close()


class SocketChannel(Channel):
    """Newline-delimited JSON over TCP or a Unix socket, reconnecting with backoff.

    While the agent is unreachable, messages are dropped and counted rather
    than buffered without bound.
    """

    def __init__(self, address: str, *, maxsize: int = 1024) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self._next_try = 0.0
        self._backoff = 0.05
        super().__init__(maxsize=maxsize)

    def _connect(self) -> socket.socket | None:
        now = time.monotonic()
        if now < self._next_try:
            return None
        try:
            if self._address.startswith("unix://"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5.0)
                s.connect(self._address[len("unix://") :])
            else:
                host, _, port = self._address[len("tcp://") :].rpartition(":")
                s = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
            self._backoff = 0.05
            return s
        except OSError:
            self._next_try = now + self._backoff
            self._backoff = min(self._backoff * 2, 2.0)
            return None

    def _write_line(self, line: bytes) -> bool:
        if self._sock is None:
            self._sock = self._connect()
            if self._sock is None:
                self.dropped += 1
                return False
            reader = threading.Thread(
                target=self._read_requests,
                args=(self._sock,),
                name="spikeguard-requests",
                daemon=True,
            )
            reader.start()
        try:
            self._sock.sendall(line)
            return True
        except OSError:
            self._sock.close()
            self._sock = None
            self.dropped += 1
            return False

    def _read_requests(self, sock: socket.socket) -> None:
        """Read the supervisor's requests (JSON lines) from ``sock`` until it closes."""
        buf = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            if len(buf) > MAX_REQUEST_BYTES:
                buf = b""  # not a request: nothing the supervisor sends is this long
            for line in lines:
                try:
                    req = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(req, dict) and isinstance(req.get("type"), str):
                    self._requests.put(req)

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass


def open_channel(spec: str | None, *, maxsize: int = 1024) -> Channel | NullChannel:
    """Open the channel named by ``spec`` (see the module docstring)."""
    if spec is None or spec in ("", "off", "none"):
        return NullChannel()
    if spec.startswith("jsonl://"):
        return JsonlChannel(spec[len("jsonl://") :], maxsize=maxsize)
    if spec.startswith(("tcp://", "unix://")):
        return SocketChannel(spec, maxsize=maxsize)
    raise ValueError(
        f"unknown report destination {spec!r}: expected 'off', 'jsonl:///path', "
        "'tcp://host:port' or 'unix:///path'"
    )
