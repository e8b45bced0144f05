"""The rank agent: one Ray actor per rank, owning that rank's training process.

The agent runs the user's torchrun-style entrypoint as a subprocess in its
own session (so the whole process tree can be SIGKILLed, also while it is
hung inside a collective), serves the rank's report socket and buffers what
arrives until the supervisor polls. It knows nothing of policies or
recovery: it only starts, reports and kills.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

from spikeguard.workers import contract

from .types import LaunchedRank, NodeInfo, RankKill, RankPoll

MAX_BUFFERED_LINES = 20000
MAX_LINE_BYTES = 1 << 20
LOG_TAIL_BYTES = 4096
OUTPUT_BYTES_PER_POLL = 64 * 1024
"""At most this much of a rank's new output travels with one poll (to the driver's stdout)."""


class RankAgent:
    """Plain class; the supervisor wraps it with ``ray.remote`` (see :mod:`.group`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._lines: list[bytes] = []
        self._overflow = 0
        self._oversize = 0
        self._last_rx = time.monotonic()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None
        self._log_tail: str | None = None
        self._generation = -1
        self._sockdir = tempfile.mkdtemp(prefix="sg-")
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        """The current generation's connections to its rank (requests go back on them)."""
        self._requests: list[bytes] = []
        """Requests sent to the current generation, re-sent on every new connection."""
        self._log: Any = None
        self._out_offset = 0
        self._out_partial = b""

    # -- placement facts ------------------------------------------------------------------
    def node_info(self) -> NodeInfo:
        """Where this agent (and so its rank) runs."""
        import ray

        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            host=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    # -- the report socket ------------------------------------------------------------------
    def _serve(self, path: str) -> None:
        if self._server is not None:
            self._server.close()
        if os.path.exists(path):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(8)
        self._server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with self._lock:
                current = srv is self._server
                if current:
                    self._conns.add(conn)
                pending = list(self._requests) if current else []
            for line in pending:  # a rank that (re)connects gets what it may have missed
                _send(conn, line)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        skipping = False  # inside a line longer than MAX_LINE_BYTES: discard up to its newline
        with conn:
            while True:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    with self._lock:
                        self._conns.discard(conn)
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                oversize = 0
                if skipping and lines:
                    lines, skipping = lines[1:], False  # the tail of the oversize line
                big = [ln for ln in lines if len(ln) > MAX_LINE_BYTES]
                if big:
                    lines = [ln for ln in lines if len(ln) <= MAX_LINE_BYTES]
                    oversize += len(big)
                if (
                    len(buf) > MAX_LINE_BYTES
                ):  # a line without end: drop it rather than grow forever
                    buf, oversize, skipping = b"", oversize + (0 if skipping else 1), True
                with self._lock:
                    self._last_rx = time.monotonic()
                    self._oversize += oversize
                    room = MAX_BUFFERED_LINES - len(self._lines)
                    self._lines.extend(lines[: max(room, 0)])
                    self._overflow += max(len(lines) - max(room, 0), 0)

    def request(self, payload: dict[str, Any]) -> bool:
        """Send ``payload`` (one JSON line) to the rank; True when its process is alive to get it
        (now, or when it connects: requests are re-sent on every new connection)."""
        line = (json.dumps(payload, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._requests.append(line)
            conns = list(self._conns)
        for conn in conns:
            _send(conn, line)
        return self._proc is not None and self._proc.poll() is None

    # -- process lifecycle ------------------------------------------------------------------
    def start(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: str,
        pass_env: tuple[str, ...] = (),
    ) -> LaunchedRank:
        """Start generation ``generation`` of this rank (``env`` holds its torchrun variables;
        ``pass_env`` names the agent's variables the rank gets although they look secret)."""
        if self._proc is not None and self._proc.poll() is None:
            self.kill()
        sock = os.path.join(self._sockdir, f"r{self.rank}-g{generation}.sock")
        with self._lock:
            self._conns.clear()
            self._requests.clear()
        self._serve(sock)
        with self._lock:
            self._lines.clear()
            self._overflow = 0
            self._last_rx = time.monotonic()
        from .environment import rank_environment

        # never the supervisor's secrets: the rank runs the user's script and its libraries
        report = {contract.ENV_REPORT: f"unix://{sock}"}
        full_env = rank_environment(os.environ, env, report, passed=pass_env)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        if self._log is not None:
            self._log.close()
        self._log = open(log_path, "ab")
        self._log_path, self._log_tail = log_path, None
        self._out_offset, self._out_partial = self._log.tell(), b""
        self._generation = generation
        self._proc = subprocess.Popen(
            cmd,
            env=full_env,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        node = self.node_info()
        return LaunchedRank(
            rank=self.rank,
            pid=self._proc.pid,
            generation=generation,
            report=f"unix://{sock}",
            port=int(env.get("MASTER_PORT", 0)),
            node_id=node.node_id,
            host=node.host,
            ip=node.ip,
            agent_pid=node.pid,
            gpu_ids=node.gpu_ids,
        )

    def poll(self) -> RankPoll:
        """Drain buffered report lines; exit code (and the log's tail) if the process ended."""
        with self._lock:
            lines, self._lines = self._lines, []
            overflow, self._overflow = self._overflow, 0
            oversize, self._oversize = self._oversize, 0
            age = time.monotonic() - self._last_rx
        code = None if self._proc is None else self._proc.poll()
        output, skipped = self._new_output()
        return RankPoll(
            rank=self.rank,
            generation=self._generation,
            lines=tuple(lines),
            overflow=overflow,
            oversize=oversize,
            exit_code=code,
            rx_age_s=age,
            pid=None if self._proc is None else self._proc.pid,
            log_tail=self._tail() if code is not None else "",
            output=output,
            output_skipped=skipped,
        )

    def _new_output(self) -> tuple[tuple[str, ...], int]:
        """The rank's output written since the last poll, as whole lines, at most
        :data:`OUTPUT_BYTES_PER_POLL` of it; the number of bytes skipped beyond that (the full
        log stays in ``RUN_DIR/logs``)."""
        if not self._log_path:
            return (), 0
        try:
            with open(self._log_path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                available = end - self._out_offset
                skipped = max(available - OUTPUT_BYTES_PER_POLL, 0)
                f.seek(self._out_offset + skipped)
                data = f.read(available - skipped)
        except OSError:
            return (), 0
        self._out_offset = end  # read or skipped, it is consumed
        if skipped:
            self._out_partial = b""  # the unfinished line was in the skipped part
        data = self._out_partial + data
        complete, newline, rest = data.rpartition(b"\n")
        if not newline:  # no line finished yet
            self._out_partial = data[-OUTPUT_BYTES_PER_POLL:]
            return (), skipped
        self._out_partial = rest[-OUTPUT_BYTES_PER_POLL:]
        return tuple(complete.decode("utf-8", "replace").split("\n")), skipped

    def _tail(self) -> str:
        """The last few KiB of this generation's log (read once, after the process ended)."""
        if self._log_tail is None and self._log_path:
            try:
                if self._log is not None:
                    self._log.flush()
                with open(self._log_path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(f.tell() - LOG_TAIL_BYTES, 0))
                    self._log_tail = f.read().decode("utf-8", "replace")
            except OSError as e:
                self._log_tail = f"(log {self._log_path} unreadable: {e})"
        return self._log_tail or ""

    def kill(self, grace_s: float = 0.0) -> RankKill:
        """SIGKILL the rank's whole process group (after SIGTERM and ``grace_s`` if > 0).

        Works while the rank is hung inside a collective or stopped (SIGSTOP). The result says
        whether SIGTERM was ignored for the whole grace period (``forced``) and whether the
        process is still there 10 s after SIGKILL (``alive``: stuck in the kernel).
        """
        t0 = time.monotonic()
        p = self._proc
        if p is None or p.poll() is not None:
            return RankKill(rank=self.rank, pid=None if p is None else p.pid)
        forced = alive = False
        if grace_s > 0:
            _signal_group(p.pid, signal.SIGTERM)
            # a stopped process can only act on SIGTERM once it runs again
            _signal_group(p.pid, signal.SIGCONT)
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                forced = True
        # the whole group: also any child left behind after the leader exited
        _signal_group(p.pid, signal.SIGKILL)
        try:
            p.wait(10.0)
        except subprocess.TimeoutExpired:
            alive = True
        return RankKill(
            rank=self.rank,
            duration_s=time.monotonic() - t0,
            forced=forced,
            alive=alive,
            pid=p.pid,
        )

    def ping(self) -> int:
        return self.rank


def _send(conn: socket.socket, line: bytes) -> None:
    """Best effort: a rank that is gone or not reading loses the request (it is re-sent if it
    reconnects)."""
    try:
        conn.sendall(line)
    except OSError:
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
