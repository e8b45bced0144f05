"""The warm standby's socket, hardened: only the process it serves may report on it, and what
arrived before the release never becomes the next generation's.

The attack: a compromised process of the old generation (the same user, its own session, as
every rank's process is started in one) connects to the standby's report socket and plants a
``report`` of the next generation with a NaN loss; after the release the agent used to hand it
over as generation 2's, and the engine recovered generation 2 for a loss it never had.

Real processes and real Unix sockets: the peer check (``SO_PEERCRED``) of
:func:`~spikeguard.workers.channel.peer_problem` against processes of this and of another
session (and, as root, of another uid); the report channel refusing a server that is not the
expected one; and a rank agent (the real :class:`RankAgent`, only its Ray placement facts
stubbed) with a standby of tests/scripts/toy_rank.py and a planting process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SCRIPTS
from spikeguard.supervisor.launch.agent import RankAgent
from spikeguard.supervisor.launch.interface import NodeInfo
from spikeguard.workers import contract
from spikeguard.workers.channel import SocketChannel, peer_problem

DEADLINE_S = 120.0
"""A generous bound for anything polled (a loaded machine is slow, never this slow)."""
STEPS = 6

CONNECT = """
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
if len(sys.argv) > 2:
    os.setuid(int(sys.argv[2]))
s.connect(sys.argv[1])
s.recv(1)  # until the server closes: the peer stays alive while it is looked at
"""
CONNECT_FROM_CHILD = """
import subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[2], sys.argv[1]], check=True)
"""


def wait_until(what: str, done: Callable[[], object]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, f"{what}: not within {DEADLINE_S} s"
        time.sleep(0.02)


@pytest.fixture
def server() -> Iterator[tuple[socket.socket, str]]:
    """A listening Unix socket in a directory anyone may reach (a test connects as nobody)."""
    d = tempfile.mkdtemp(prefix="sg-peer-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(4)
    srv.settimeout(DEADLINE_S)
    try:
        yield srv, path
    finally:
        srv.close()
        os.unlink(path)
        os.rmdir(d)


def _connect_from(srv: socket.socket, argv: list[str]) -> tuple[subprocess.Popen, socket.socket]:
    """Start ``argv`` in a session of its own (as the agent starts a rank) and accept the
    connection it makes."""
    proc = subprocess.Popen(argv, start_new_session=True)
    conn, _ = srv.accept()
    return proc, conn


def test_the_peer_check_takes_the_served_session_and_refuses_any_other(server) -> None:
    srv, path = server
    connect = [sys.executable, "-c", textwrap.dedent(CONNECT), path]
    rank, conn = _connect_from(srv, connect)
    try:
        assert peer_problem(conn, session=rank.pid) is None
        assert peer_problem(conn, pid=rank.pid) is None
        assert peer_problem(conn, pid=os.getpid()) == (
            f"peer pid {rank.pid} is not the expected process {os.getpid()}"
        )
        # a process of another session (an old generation's rank) is not the served one's
        other, other_conn = _connect_from(srv, connect)
        try:
            problem = peer_problem(other_conn, session=rank.pid)
            assert problem == (
                f"peer pid {other.pid} (session {other.pid}) is neither process {rank.pid} "
                "nor in its session"
            )
        finally:
            other_conn.close()
            assert other.wait(DEADLINE_S) == 0
    finally:
        conn.close()
        assert rank.wait(DEADLINE_S) == 0
    # the served process's own child (a wrapper's child, a forked helper) is in its session
    wrapper = [sys.executable, "-c", CONNECT_FROM_CHILD, path, textwrap.dedent(CONNECT)]
    leader, child_conn = _connect_from(srv, wrapper)
    try:
        assert peer_problem(child_conn, session=leader.pid) is None
        assert peer_problem(child_conn, pid=leader.pid) is not None  # not the leader itself
    finally:
        child_conn.close()
        assert leader.wait(DEADLINE_S) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")
def test_the_peer_check_refuses_another_uid(server) -> None:
    srv, path = server
    nobody = 65534
    proc, conn = _connect_from(srv, [sys.executable, "-c", CONNECT, path, str(nobody)])
    try:
        assert peer_problem(conn, session=proc.pid) == (
            f"peer pid {proc.pid} runs as uid {nobody}, not {os.geteuid()}"
        )
    finally:
        conn.close()
        assert proc.wait(DEADLINE_S) == 0


def test_a_channel_refuses_a_server_that_is_not_the_expected_process(server) -> None:
    """A standby knows its agent's pid: a server with another pid (something posing as the
    agent, to hand the standby a release and a plan of its own) gets no line, and none of its
    requests is read."""
    srv, path = server
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    channel = SocketChannel(f"unix://{path}", server_pid=bystander.pid)
    try:
        channel.send({"type": "hello", "step": 0})
        conn, _ = srv.accept()
        conn.settimeout(DEADLINE_S)
        try:  # the channel may have hung up already
            conn.sendall(b'{"type": "release", "generation": 2, "plan": "/tmp/forged.json"}\n')
            got = conn.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            got = b""
        assert got == b""  # closed without a byte
        conn.close()
        wait_until("the refusal", lambda: channel.refused_peer is not None)
        assert channel.refused_peer == (
            f"peer pid {os.getpid()} is not the expected process {bystander.pid}"
        )
        assert channel.poll_requests() == [] and channel.sent == 0 and channel.dropped >= 1
    finally:
        channel.close(timeout=1.0)
        bystander.communicate(timeout=DEADLINE_S)
    # the expected server (this process) gets the lines
    good = SocketChannel(f"unix://{path}", server_pid=os.getpid())
    try:
        good.send({"type": "hello", "step": 0})
        conn, _ = srv.accept()
        conn.settimeout(DEADLINE_S)
        assert json.loads(conn.recv(65536).splitlines()[0])["type"] == "hello"
        conn.close()
        assert good.refused_peer is None
    finally:
        good.close(timeout=1.0)


class _LocalAgent(RankAgent):
    """The real rank agent, outside Ray: only where it runs is made up."""

    def node_info(self) -> NodeInfo:
        return NodeInfo(node_id="local", ip="127.0.0.1", host=socket.gethostname(), pid=os.getpid())


PLANT = """
import json, socket, sys
line = {"v": 1, "type": "report", "run": "toy", "gen": 2, "rank": 0, "step": 3, "t": 0,
        "loss": float("nan"), "planted": True}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.settimeout(60)  # an agent that keeps the connection: "open" after a minute
try:
    s.sendall((json.dumps(line) + "\\n").encode())
    print("closed" if s.recv(1) == b"" else "answered", flush=True)
except TimeoutError:
    print("open", flush=True)
except OSError as e:
    print("closed", e, flush=True)
"""


def _lines(agent: RankAgent) -> Iterator[dict]:
    for line in agent.poll().lines:
        yield json.loads(line)


def test_a_planted_line_and_a_standby_s_early_lines_never_become_the_next_generation_s(
    tmp_path: Path,
) -> None:
    fence = tmp_path / "FENCE"
    fence.write_text("1")  # generation 1 trains while the standby of 2 waits
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        contract.ENV_GENERATION: "2",
        contract.ENV_CKPT_DIR: str(tmp_path / "checkpoints"),
        contract.ENV_FENCE_FILE: str(fence),
    }
    agent = _LocalAgent(0)
    cmd = [sys.executable, str(SCRIPTS / "toy_rank.py"), "--steps", str(STEPS)]
    launched = agent.start_standby(
        generation=2, cmd=cmd, env=env, cwd=str(tmp_path), log_path=str(tmp_path / "s.log")
    )
    standby = agent._standby
    assert standby is not None
    try:
        wait_until("the standby's hello", lambda: agent.poll().standby_ready)
        # an old generation's process (its own session, the same uid) plants a NaN loss
        plant = subprocess.run(
            [sys.executable, "-c", PLANT, launched.report[len("unix://") :]],
            start_new_session=True,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
        assert plant.stdout.startswith("closed"), plant
        assert standby.refused == 1 and "nor in its session" in (standby.last_refusal or "")
        plan = tmp_path / "gen002.json"
        plan.write_text(contract.ResumePlan(generation=2, lr_scale=0.5).to_json())
        fence.write_text("2")  # the supervisor fences before it releases
        assert agent.release(generation=2, plan_path=str(plan)) is not None
        got: list[dict] = []

        def finished() -> bool:  # exited, and its connection read to the end
            got.extend(_lines(agent))
            return standby.exit_code() is not None and not standby.conns

        wait_until("the released standby's run", finished)
        got.extend(_lines(agent))
        assert standby.exit_code() == 0, standby.tail()
    finally:
        agent.kill_standby()
        agent.kill()
    assert not any(m.get("planted") for m in got)
    # nothing from before the release: its own hello was the waiting standby's, not gen 2's
    assert "hello" not in {m["type"] for m in got}
    types = [m["type"] for m in got]
    resumed = got[types.index("resumed")]
    assert resumed["gen"] == 2 and resumed["lr_scale"] == 0.5
    beats = [m for m in got if m["type"] in ("heartbeat", "report")]
    assert all(types.index("resumed") < got.index(m) for m in beats)
    assert [m["step"] for m in beats] == list(range(STEPS))
    assert all(m["gen"] == 2 and m["loss"] == m["loss"] for m in beats)  # never a NaN
