"""A standby rank process against the agent's own process handling (no Ray): it runs the script up
to ``resume()``, says hello and waits; a release for its generation brings the plan and it trains;
anything else leaves it waiting; a FENCE past its generation or the loss of its agent makes it exit.

The process is tests/scripts/toy_rank.py (world size 1), served by the agent's ``_Process`` (the
same socket, request and buffering code a rank agent uses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS
from spikeguard.supervisor.launch.agent import _Process
from spikeguard.workers import contract
from spikeguard.workers.standby import EXIT_FENCED, EXIT_ORPHANED

pytestmark = pytest.mark.slow
STEPS = 12


def standby_env(tmp_path: Path, *, generation: int, agent_pid: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        contract.ENV_GENERATION: str(generation),
        contract.ENV_STANDBY: str(agent_pid),
        contract.ENV_CKPT_DIR: str(tmp_path / "checkpoints"),
        contract.ENV_FENCE_FILE: str(tmp_path / "FENCE"),
        "PYTHONUNBUFFERED": "1",
    }


def start(tmp_path: Path, generation: int = 2) -> _Process:
    (tmp_path / "FENCE").write_text("1")  # generation 1 trains while the standby waits
    p = _Process(rank=0, generation=generation, sock=str(tmp_path / "s.sock"))
    p.serve()
    env = standby_env(tmp_path, generation=generation, agent_pid=os.getpid())
    env[contract.ENV_REPORT] = f"unix://{p.sock}"
    cmd = [sys.executable, str(SCRIPTS / "toy_rank.py"), "--steps", str(STEPS)]
    p.start(cmd, env, str(tmp_path), str(tmp_path / "standby.log"))
    end = time.monotonic() + 120
    while not p.heard:
        assert p.alive(), p.tail()
        assert time.monotonic() < end, "the standby never said hello"
        time.sleep(0.05)
    return p


def messages(p: _Process) -> list[dict]:
    return [json.loads(line) for line in p.drain()[0]]


def test_a_standby_waits_after_hello_and_a_release_brings_its_plan(tmp_path):
    p = start(tmp_path)
    time.sleep(1.5)  # a standby that did not wait would have trained all 12 steps by now
    waiting = messages(p)
    assert [m["type"] for m in waiting] == ["hello"] and p.alive()
    plan = contract.ResumePlan(generation=2, lr_scale=0.5, reset_optimizer=True)
    path = tmp_path / "gen002.json"
    path.write_text(plan.to_json())
    (tmp_path / "FENCE").write_text("2")  # the supervisor fences before it releases
    assert p.request({"type": "release", "generation": 2, "plan": str(path)})
    assert p.proc is not None and p.proc.wait(60) == 0, p.tail()
    got = messages(p)
    resumed = next(m for m in got if m["type"] == "resumed")
    assert resumed["gen"] == 2 and resumed["lr_scale"] == 0.5
    assert resumed["standby_wait_s"] >= 1.5
    beats = [m for m in got if m["type"] in ("heartbeat", "report")]
    assert [m["step"] for m in beats] == list(range(STEPS))
    assert all(m["gen"] == 2 for m in beats)


def test_a_release_for_another_generation_is_ignored_and_a_later_fence_ends_the_standby(tmp_path):
    p = start(tmp_path, generation=2)
    assert p.request({"type": "release", "generation": 3, "plan": None})
    assert p.request({"type": "checkpoint", "id": 1, "reason": "not for a standby"})
    time.sleep(1.5)
    assert p.alive() and [m["type"] for m in messages(p)] == ["hello"]
    (tmp_path / "FENCE").write_text("3")  # generation 3 came instead: 2 will never be
    assert p.proc is not None and p.proc.wait(30) == EXIT_FENCED
    assert messages(p) == []  # not a step, not a checkpoint
    assert "was fenced (current generation 3)" in p.tail()
    assert not list(tmp_path.glob("checkpoints/*"))


def test_a_standby_whose_agent_is_gone_exits(tmp_path):
    """The agent (here a stand-in process) starts the standby and dies: the standby notices that
    its parent is no longer the agent and exits, so none outlives its supervisor."""
    (tmp_path / "FENCE").write_text("1")
    log = tmp_path / "orphan.log"
    env = standby_env(tmp_path, generation=2, agent_pid=0)
    env[contract.ENV_REPORT] = f"jsonl://{tmp_path / 'orphan.jsonl'}"
    launcher = (
        "import os, subprocess, sys\n"
        "env = dict(os.environ, SPIKEGUARD_STANDBY=str(os.getpid()))\n"
        f"p = subprocess.Popen([sys.executable, {str(SCRIPTS / 'toy_rank.py')!r}], env=env,\n"
        f"    stdout=open({str(log)!r}, 'wb'), stderr=subprocess.STDOUT, start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher], env=env, capture_output=True, timeout=60, check=True
    )
    pid = int(out.stdout.split()[0])
    end = time.monotonic() + 120
    while _alive(pid):
        assert time.monotonic() < end, "the orphaned standby is still there"
        time.sleep(0.1)
    assert "its agent is gone: exiting" in log.read_text()
    sent = tmp_path / "orphan.jsonl"
    lines = sent.read_text().splitlines() if sent.exists() else []
    assert {json.loads(line)["type"] for line in lines} <= {"hello"}  # it never trained
    assert f"(exit {EXIT_ORPHANED})" in log.read_text()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False
