"""The rank agent: one Ray actor per rank, owning that rank's training process.

The agent runs the user's torchrun-style entrypoint as a subprocess in its
own session (so the whole process tree can be SIGKILLed, also while it is
hung inside a collective), serves the rank's report socket and buffers what
arrives until the supervisor polls. The socket takes lines only from the
process it serves (or one of its session: ``SO_PEERCRED``); another process
of the same user, a rank of another generation, is refused at connect. A
standby's lines from before its release are discarded at the release: nothing
the generation it becomes said came before it became it. It knows nothing of
policies or recovery: it only starts, reports and kills.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from spikeguard.workers import contract
from spikeguard.workers.channel import peer_problem

from .. import rundir
from .interface import LaunchedRank, NodeInfo, RankKill, RankPoll
from .nvml import HealthMonitor

MAX_BUFFERED_LINES = 20000
MAX_LINE_BYTES = 1 << 20
LOG_TAIL_BYTES = 4096
OUTPUT_BYTES_PER_POLL = 64 * 1024
"""At most this much of a rank's new output travels with one poll (to the driver's stdout)."""
START_WAIT_S = 60.0
"""How long a connection waits for the process to be started before the peer check (the
socket is served just before the process starts)."""

log = logging.getLogger(__name__)


class _Process:
    """One training process of this rank and everything that belongs to it: its report socket,
    the connections on it, the requests sent to it, the lines it reported, its log."""

    def __init__(self, *, rank: int, generation: int, sock: str) -> None:
        self.rank = rank
        self.generation = generation
        self.sock = sock
        self.lock = threading.Lock()
        self.lines: list[bytes] = []
        self.overflow = 0
        self.oversize = 0
        self.last_rx = time.monotonic()
        self.proc: subprocess.Popen[bytes] | None = None
        self.server: socket.socket | None = None
        self.conns: set[socket.socket] = set()
        self.requests: list[bytes] = []
        """Requests sent to this process, re-sent on every new connection."""
        self.log: Any = None
        self.log_path: str | None = None
        self.log_tail: str | None = None
        self.out_offset = 0
        self.out_partial = b""
        self.closed = False
        self.heard = False
        """Something arrived from the process (a standby that said hello is ready)."""
        self.port = 0
        """The MASTER_PORT it was started with."""
        self.started = threading.Event()
        """Set once :attr:`proc` is known (a connection's peer is checked against its pid)."""
        self.refused = 0
        """Connections from another process refused (see :meth:`_peer_problem`)."""
        self.last_refusal: str | None = None
        """Why the latest of them was refused."""
        self.epoch = 0
        """How many times what had arrived was discarded (:meth:`discard_arrived`)."""

    # -- the report socket ------------------------------------------------------------------
    def serve(self) -> None:
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.sock)
        srv.listen(8)
        self.server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            problem = self._peer_problem(conn)
            if problem is not None:  # never read from, never sent a request
                with self.lock:
                    self.refused += 1
                    self.last_refusal, first = problem, self.refused == 1
                if first:  # said once: a process retrying in a loop must not flood the log
                    log.warning(f"rank {self.rank} socket {self.sock}: refused {problem}")
                conn.close()
                continue
            with self.lock:
                if self.closed:
                    conn.close()
                    return
                self.conns.add(conn)
                pending = list(self.requests)
            for line in pending:  # a rank that (re)connects gets what it may have missed
                _send(conn, line)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _peer_problem(self, conn: socket.socket) -> str | None:
        """Why the process at the other end of ``conn`` may not report here, or None: it must
        run as this agent's uid and be the process served, or one of the session it leads (it
        was started in its own)."""
        self.started.wait(START_WAIT_S)
        if self.proc is None:
            return "no process was started for this socket"
        return peer_problem(conn, session=self.proc.pid)

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        skipping = False  # inside a line longer than MAX_LINE_BYTES: discard up to its newline
        epoch = self.epoch
        with conn:
            while True:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    with self.lock:
                        self.conns.discard(conn)
                    return
                with self.lock:
                    if self.epoch != epoch:  # a line begun before the discard goes with it
                        epoch, skipping, buf = self.epoch, skipping or bool(buf), b""
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
                with self.lock:
                    self.last_rx = time.monotonic()
                    self.heard = self.heard or bool(lines)
                    self.oversize += oversize
                    room = MAX_BUFFERED_LINES - len(self.lines)
                    self.lines.extend(lines[: max(room, 0)])
                    self.overflow += max(len(lines) - max(room, 0), 0)

    def discard_arrived(self) -> int:
        """Drop every line (and partial line) that has arrived so far, with its counts: a
        standby's, at its release. Returns how many lines were dropped."""
        with self.lock:
            dropped = len(self.lines)
            self.lines, self.overflow, self.oversize = [], 0, 0
            self.epoch += 1
        return dropped

    def request(self, payload: dict[str, Any]) -> bool:
        """Send ``payload`` (one JSON line) now and on every later connection; True when the
        process is alive to get it."""
        line = (json.dumps(payload, separators=(",", ":")) + "\n").encode()
        with self.lock:
            self.requests.append(line)
            conns = list(self.conns)
        for conn in conns:
            _send(conn, line)
        return self.alive()

    # -- the process ------------------------------------------------------------------------
    def start(self, cmd: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self.log = rundir.open_append(Path(log_path))  # 0600, never through a symlink
        self.log_path = log_path
        self.out_offset = self.log.tell()
        try:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            self.started.set()  # a connection waiting for the peer check goes on either way

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def drain(self) -> tuple[list[bytes], int, int, float]:
        """The buffered lines, the overflow and oversize counts since the last drain, and the
        seconds since anything arrived."""
        with self.lock:
            lines, self.lines = self.lines, []
            overflow, self.overflow = self.overflow, 0
            oversize, self.oversize = self.oversize, 0
            return lines, overflow, oversize, time.monotonic() - self.last_rx

    def new_output(self) -> tuple[tuple[str, ...], int]:
        """The process's output written since the last call, as whole lines, at most
        :data:`OUTPUT_BYTES_PER_POLL` of it; the number of bytes skipped beyond that (the full
        log stays in ``RUN_DIR/logs``)."""
        if not self.log_path:
            return (), 0
        try:
            with open(self.log_path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                available = end - self.out_offset
                skipped = max(available - OUTPUT_BYTES_PER_POLL, 0)
                f.seek(self.out_offset + skipped)
                data = f.read(available - skipped)
        except OSError:
            return (), 0
        self.out_offset = end  # read or skipped, it is consumed
        if skipped:
            self.out_partial = b""  # the unfinished line was in the skipped part
        data = self.out_partial + data
        complete, newline, rest = data.rpartition(b"\n")
        if not newline:  # no line finished yet
            self.out_partial = data[-OUTPUT_BYTES_PER_POLL:]
            return (), skipped
        self.out_partial = rest[-OUTPUT_BYTES_PER_POLL:]
        return tuple(complete.decode("utf-8", "replace").split("\n")), skipped

    def tail(self) -> str:
        """The last few KiB of the log (read once, after the process ended)."""
        if self.log_tail is None and self.log_path:
            try:
                if self.log is not None:
                    self.log.flush()
                with open(self.log_path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(f.tell() - LOG_TAIL_BYTES, 0))
                    self.log_tail = f.read().decode("utf-8", "replace")
            except OSError as e:
                self.log_tail = f"(log {self.log_path} unreadable: {e})"
        return self.log_tail or ""

    def kill(self, grace_s: float = 0.0) -> RankKill:
        """SIGKILL the process's whole group (after SIGTERM and ``grace_s`` if > 0); see
        :meth:`RankAgent.kill`."""
        t0 = time.monotonic()
        p = self.proc
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

    def close(self) -> None:
        """Stop serving its socket (its connections close as the process goes)."""
        with self.lock:
            self.closed = True
            conns, self.conns = list(self.conns), set()
        if self.server is not None:
            self.server.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RankAgent:
    """Plain class; the supervisor wraps it with ``ray.remote`` (see :mod:`.group`).

    It runs one generation's process of its rank at a time (the active one), and optionally a
    **standby**: the next generation's process, started ahead of need, which runs the user's
    script up to ``resume()`` (interpreter, imports, process group, model) and waits there. A
    recovery then releases it (:meth:`release`) instead of starting a cold process.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._cwd = os.getcwd()
        """Where Ray started this agent: with a runtime-env ``working_dir`` (Ray Jobs'
        ``--working-dir``), its node's own copy of it, which the rank starts in."""
        self._sockdir = tempfile.mkdtemp(prefix="sg-")
        self._active: _Process | None = None
        self._standby: _Process | None = None
        self._mutex = threading.Lock()  # start / release / kill of the processes
        self._health: HealthMonitor | None = None
        """Reads the rank's GPUs from NVML every few seconds (None: no GPUs, or no NVML)."""
        self._health_watched = False

    # -- placement facts ------------------------------------------------------------------
    def node_info(self) -> NodeInfo:
        """Where this agent (and so its rank) runs."""
        import ray

        gpus = tuple(str(g) for g in ray.get_gpu_ids())
        self.watch_gpus(gpus)
        return NodeInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ray.util.get_node_ip_address(),
            host=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=gpus,
            cwd=self._cwd,
        )

    def watch_gpus(self, gpus: tuple[str, ...], nvml: Any = None) -> None:
        """Start reading the health of the rank's ``gpus`` from NVML (once; nothing without
        GPUs or NVML). ``nvml``: the binding (None: ``pynvml``; a test passes a fake)."""
        if self._health_watched:
            return
        self._health_watched = True
        self._health = HealthMonitor.start(gpus, nvml)

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def request(self, payload: dict[str, Any]) -> bool:
        """Send ``payload`` (one JSON line) to the active process; True when it is alive to get
        it (now, or when it connects: requests are re-sent on every new connection)."""
        p = self._active
        return p.request(payload) if p is not None else False

    # -- process lifecycle ------------------------------------------------------------------
    def _new_process(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: str,
        pass_env: tuple[str, ...],
        standby: bool,
    ) -> _Process:
        tag = "s" if standby else "g"
        sock = os.path.join(self._sockdir, f"r{self.rank}-{tag}{generation}.sock")
        proc = _Process(rank=self.rank, generation=generation, sock=sock)
        proc.serve()
        from .environment import rank_environment

        # never the supervisor's secrets: the rank runs the user's script and its libraries
        extra = {contract.ENV_REPORT: f"unix://{sock}"}
        if standby:
            extra[contract.ENV_STANDBY] = str(os.getpid())  # its parent: gone, it exits
        full_env = rank_environment(os.environ, env, extra, passed=pass_env)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        proc.port = int(env.get("MASTER_PORT", 0))
        proc.start(cmd, full_env, cwd, log_path)
        return proc

    def _launched(self, p: _Process, *, standby: bool) -> LaunchedRank:
        node = self.node_info()
        assert p.proc is not None
        return LaunchedRank(
            rank=self.rank,
            pid=p.proc.pid,
            generation=p.generation,
            report=f"unix://{p.sock}",
            port=p.port,
            node_id=node.node_id,
            host=node.host,
            ip=node.ip,
            agent_pid=node.pid,
            gpu_ids=node.gpu_ids,
            standby=standby,
        )

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
        spec = dict(generation=generation, cmd=cmd, env=env, cwd=cwd, log_path=log_path)
        with self._mutex:
            self._retire_active()
            self._active = self._new_process(**spec, pass_env=pass_env, standby=False)
            return self._launched(self._active, standby=False)

    def start_standby(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: str,
        pass_env: tuple[str, ...] = (),
    ) -> LaunchedRank:
        """Start a standby process for ``generation`` (replacing any standby there was): it
        runs up to ``resume()`` and waits for :meth:`release`."""
        spec = dict(generation=generation, cmd=cmd, env=env, cwd=cwd, log_path=log_path)
        with self._mutex:
            self._kill_standby()
            self._standby = self._new_process(**spec, pass_env=pass_env, standby=True)
            return self._launched(self._standby, standby=True)

    def release(self, *, generation: int, plan_path: str | None) -> LaunchedRank | None:
        """Make the standby of ``generation`` the active process and hand it its plan; None
        (and the standby killed) when there is no live standby of that generation."""
        with self._mutex:
            p = self._standby
            if p is None or p.generation != generation or not p.alive():
                self._kill_standby()
                return None
            self._retire_active()
            self._standby, self._active = None, p
            p.discard_arrived()  # what it got while it waited is not the new generation's
            p.request({"type": "release", "generation": generation, "plan": plan_path})
            return self._launched(p, standby=True)

    def kill_standby(self) -> RankKill:
        """Kill the standby process, if any."""
        with self._mutex:
            return self._kill_standby()

    def _kill_standby(self) -> RankKill:
        p, self._standby = self._standby, None
        if p is None:
            return RankKill(rank=self.rank)
        res = p.kill()
        p.close()
        return res

    def _retire_active(self) -> None:
        p = self._active
        if p is not None:
            if p.alive():
                p.kill()
            p.close()

    def poll(self) -> RankPoll:
        """Drain the active process's buffered report lines; its exit code (and its log's tail)
        once it ended; the standby's state."""
        p, sb = self._active, self._standby
        standby_exit = None if sb is None else sb.exit_code()
        standby = {
            "standby_generation": None if sb is None else sb.generation,
            "standby_ready": sb is not None and sb.heard and standby_exit is None,
            "standby_exit": standby_exit,
            "standby_tail": sb.tail() if sb is not None and standby_exit is not None else "",
        }
        health = self._health.take() if self._health is not None else None
        if p is None:
            return RankPoll(rank=self.rank, generation=-1, health=health, **standby)
        lines, overflow, oversize, age = p.drain()
        code = p.exit_code()
        output, skipped = p.new_output()
        return RankPoll(
            rank=self.rank,
            generation=p.generation,
            lines=tuple(lines),
            overflow=overflow,
            oversize=oversize,
            exit_code=code,
            rx_age_s=age,
            pid=None if p.proc is None else p.proc.pid,
            log_tail=p.tail() if code is not None else "",
            output=output,
            output_skipped=skipped,
            health=health,
            **standby,
        )

    def kill(self, grace_s: float = 0.0) -> RankKill:
        """SIGKILL the active process's whole group (after SIGTERM and ``grace_s`` if > 0).

        Works while the rank is hung inside a collective or stopped (SIGSTOP). The result says
        whether SIGTERM was ignored for the whole grace period (``forced``) and whether the
        process is still there 10 s after SIGKILL (``alive``: stuck in the kernel). A standby
        is left alone (:meth:`kill_standby`).
        """
        p = self._active
        if p is None:
            return RankKill(rank=self.rank)
        return p.kill(grace_s)

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
