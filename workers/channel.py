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

Over a Unix socket each end checks who is at the other (:func:`peer_problem`, from the kernel's
``SO_PEERCRED``): the rank's agent accepts lines only from the process it started (or one of
its session), and the rank talks only to a server of its own uid; a standby, which knows its
agent's pid, only to that agent. Another process of the same user (a compromised rank of an
older generation) can then neither plant lines in a socket that is not its own nor pose as the
agent. A TCP channel has no such check (nothing in the kernel says who the peer is): it is for
a rank and agent the job trusts to share a network.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import queue
import socket
import struct
import threading
import time
import weakref
from typing import Any

from .contract import logs
from .encode import Unencodable, encode_line

_STOP = object()
MAX_REQUEST_BYTES = 1 << 16
_HEADER = ("v", "run", "gen", "rank", "step", "t")
"""The fields of a message a ``dropped`` note sent before it repeats."""
EXIT_FLUSH_S = 2.0
"""How long a process that exits on its own waits for its queued reports to be sent."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel recorded it at connect."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid (Linux)."""


def peer_of(sock: socket.socket) -> Peer | None:
    """The peer of the connected Unix socket ``sock`` (``SO_PEERCRED``), or None where the
    platform has no ``SO_PEERCRED`` (then no one can be checked) or ``sock`` is not a Unix
    socket. Raises ``OSError`` when the kernel cannot say (a socket already reset)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or sock.family != socket.AF_UNIX:
        return None
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    return Peer(pid=pid, uid=uid, gid=gid)


def peer_problem(
    sock: socket.socket, *, pid: int | None = None, session: int | None = None
) -> str | None:
    """Why the process at the other end of the Unix socket ``sock`` is not the expected one, or
    None when it is.

    Its uid must be this process's effective uid. With ``pid``, it must be that process (a
    standby's agent). With ``session``, that process or one in the session it leads (a rank
    started in a new session: its wrapper's child, its own forked helpers), never a process
    of another session (a rank of an older generation leads its own). A platform without
    ``SO_PEERCRED`` (not Linux) checks nothing: None.
    """
    try:
        peer = peer_of(sock)
    except OSError as e:
        return f"the kernel cannot say who the peer is: {e}"
    if peer is None:
        return None
    if peer.uid != os.geteuid():
        return f"peer pid {peer.pid} runs as uid {peer.uid}, not {os.geteuid()}"
    if (pid is not None or session is not None) and peer.pid <= 0:
        return "the peer's pid is unknown here (another pid namespace)"
    if pid is not None and peer.pid != pid:
        return f"peer pid {peer.pid} is not the expected process {pid}"
    if session is not None and peer.pid != session:
        try:
            sid = os.getsid(peer.pid)
        except OSError as e:  # gone already, or not ours to look at
            return f"peer pid {peer.pid}: its session is unknown ({e})"
        if sid != session:
            return (
                f"peer pid {peer.pid} (session {sid}) is neither process {session} nor in "
                "its session"
            )
    return None


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
    than buffered without bound. Over a Unix socket the server must run as this process's uid
    and, with ``server_pid``, be that process (:func:`peer_problem`); another one is treated
    as unreachable (nothing is sent to it, no request read from it) and said once.
    """

    def __init__(self, address: str, *, maxsize: int = 1024, server_pid: int | None = None) -> None:
        self._address = address
        self._server_pid = server_pid
        self._sock: socket.socket | None = None
        self._next_try = 0.0
        self._backoff = 0.05
        self.refused_peer: str | None = None
        """Why the last server this channel connected to was refused (None: none was)."""
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
                problem = peer_problem(s, pid=self._server_pid)
                if problem is not None:
                    s.close()
                    if self.refused_peer is None:  # the logger only now: the agent imports
                        # this module for peer_problem, and must keep its own logging
                        logs.logger(__name__).warning(
                            f"report socket {self._address} refused: {problem}"
                        )
                    self.refused_peer = problem
                    raise ConnectionRefusedError(problem)
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


def open_channel(
    spec: str | None, *, maxsize: int = 1024, server_pid: int | None = None
) -> Channel | NullChannel:
    """Open the channel named by ``spec`` (see the module docstring). ``server_pid``: the pid
    a ``unix://`` server must have, where it is known (a standby's agent)."""
    if spec is None or spec in ("", "off", "none"):
        return NullChannel()
    if spec.startswith("jsonl://"):
        return JsonlChannel(spec[len("jsonl://") :], maxsize=maxsize)
    if spec.startswith(("tcp://", "unix://")):
        return SocketChannel(spec, maxsize=maxsize, server_pid=server_pid)
    raise ValueError(
        f"unknown report destination {spec!r}: expected 'off', 'jsonl:///path', "
        "'tcp://host:port' or 'unix:///path'"
    )
