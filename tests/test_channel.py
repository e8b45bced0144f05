"""The report channel: what it cannot encode is refused in send(), never in the writer thread.

A real SocketChannel writes to a real Unix socket served by the test; a message that cannot be
encoded is dropped, counted and refused (send() returns False) while later messages still arrive.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spikeguard.workers as sgw
import torch
from spikeguard.workers.channel import JsonlChannel, SocketChannel


class Agent:
    """A Unix socket server that collects the lines it receives."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.lines: list[dict[str, Any]] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        self._srv.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._srv.accept()
        buf = b""
        with conn:
            while chunk := conn.recv(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.lines.append(json.loads(line))

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.lines) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.lines

    def close(self) -> None:
        self._srv.close()


def msg(step: int, **kw: Any) -> dict[str, Any]:
    return {"v": 1, "type": "heartbeat", "run": "r", "gen": 1, "rank": 0, "step": step, **kw}


class Opaque:
    """Neither a number, a string, a container nor an array."""


def _cycle() -> dict[str, Any]:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


UNENCODABLE = {
    "object": Opaque(),
    "big tensor": torch.ones(1000),
    "big array": np.zeros((10, 10)),
    "cycle": _cycle(),
    "deep": _nested(100),
    "huge int": 10**5000,
    "oversize": "x" * (2 << 20),
}


@pytest.fixture
def agent(tmp_path):
    a = Agent(tmp_path / "agent.sock")
    yield a
    a.close()


@pytest.mark.parametrize("what", sorted(UNENCODABLE))
def test_an_unencodable_message_is_refused_and_later_ones_still_arrive(agent, what):
    ch = SocketChannel(f"unix://{agent.path}")
    try:
        assert ch.send(msg(0)) is True
        assert ch.send(msg(1, extra={"bad": UNENCODABLE[what]})) is False
        assert ch.dropped_unencodable == 1
        assert ch.send(msg(2)) is True
        assert [m["step"] for m in agent.wait_for(2)] == [0, 2]
    finally:
        ch.close()
    assert ch.writer_errors == 0 and ch.dropped == 0


def test_odd_values_are_converted_not_dropped(agent):
    ch = SocketChannel(f"unix://{agent.path}")
    extra = {
        "pair": torch.tensor([1.0, 2.0]),  # a tensor of size 2 killed the writer thread
        "scalar": torch.tensor(3.0),
        "np": np.float32(0.5),
        "arr": np.arange(3),
        (1, 2): "tuple key",
        7: "int key",
        "set": {4},
        "tuple": (5, 6),
        "nan": float("nan"),
    }
    try:
        assert ch.send(msg(0, extra=extra)) is True
        assert ch.send(msg(1)) is True
        got = agent.wait_for(2)
    finally:
        ch.close()
    assert [m["step"] for m in got] == [0, 1]
    out = got[0]["extra"]
    assert out["pair"] == [1.0, 2.0] and out["scalar"] == 3.0 and out["np"] == 0.5
    assert out["arr"] == [0, 1, 2] and out["set"] == [4] and out["tuple"] == [5, 6]
    assert out["(1, 2)"] == "tuple key" and out["7"] == "int key"
    assert out["nan"] != out["nan"]


def test_the_writer_thread_survives_an_error_while_writing(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    ch = JsonlChannel(str(out))
    real = ch._write_line
    calls = []

    def flaky(line: bytes) -> bool:
        calls.append(line)
        if len(calls) == 1:
            raise RuntimeError("a bug in the transport")
        return real(line)

    monkeypatch.setattr(ch, "_write_line", flaky)
    ch.send(msg(0))
    ch.send(msg(1))
    ch.close()
    assert ch.writer_errors == 1
    assert [json.loads(x)["step"] for x in out.read_text().splitlines()] == [1]


def test_session_step_never_raises_on_an_odd_extra(tmp_path):
    out = tmp_path / "r.jsonl"
    sg = sgw.attach(torch.nn.Linear(2, 2), report=f"jsonl://{out}", sample_every=10**9)
    sg.step(step=0, loss=1.0, extra={"obj": Opaque()})
    sg.step(step=1, loss=1.0, extra={"pair": torch.ones(2), ("a", 1): {2}})
    sg.step(step=2, loss=1.0)
    sg.close()
    msgs = [json.loads(x) for x in out.read_text().splitlines()]
    beats = [m for m in msgs if m["type"] in ("heartbeat", "report")]  # step 0 is sampled
    # the unencodable extra is left out, not the heartbeat: a script passing a bad `extra` on
    # every step must not look hung to the supervisor
    assert [m["step"] for m in beats] == [0, 1, 2]
    assert "extra" not in beats[0] and "Opaque" in beats[0]["extra_dropped"]
    assert beats[1]["extra"] == {"pair": [1.0, 1.0], "('a', 1)": [2]}


EXITING_RANK = """
import sys
from spikeguard.workers.channel import open_channel
ch = open_channel("jsonl://" + sys.argv[1])
for step in range(400):
    ch.send({"v": 1, "run": "r", "gen": 1, "rank": 0, "step": step, "t": 0.0,
             "type": "heartbeat", "loss": 1.0})
sys.exit(3)  # a crash in the script: an exception or sys.exit, no sg.close()
"""


def test_what_a_crashing_rank_queued_is_still_sent_at_exit(tmp_path):
    """A rank that dies by an exception or ``sys.exit`` (not a kill) still delivers the reports
    it queued: the supervisor learns the last step it really did, not one a scheduler's delay
    left in the queue (and it does not say ``done``: it did not finish)."""
    out = tmp_path / "reports.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", EXITING_RANK, str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(400))
    assert not any(m["type"] == "done" for m in lines)
