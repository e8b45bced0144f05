"""The reaper: finds a run's rank processes of replaced generations by their environment and kills
them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import alive
from spikeguard.supervisor.launch import reaper


def spawn(fence_file: str, gen: int) -> subprocess.Popen:
    env = dict(
        os.environ, SPIKEGUARD_FENCE_FILE=fence_file, SPIKEGUARD_GENERATION=str(gen), RANK="1"
    )
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env=env, start_new_session=True
    )


def test_stale_generations_of_this_run_are_killed_even_when_stopped(tmp_path):
    mine, other = str(tmp_path / "run" / "FENCE"), str(tmp_path / "other" / "FENCE")
    old, stopped, current, foreign = spawn(mine, 1), spawn(mine, 2), spawn(mine, 3), spawn(other, 1)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.5)  # let the interpreters exec (their environ is readable at once anyway)
        found = {p["pid"]: p for p in reaper.find(mine, 3)}
        assert set(found) == {old.pid, stopped.pid}
        assert found[stopped.pid]["state"] == "T" and found[old.pid]["generation"] == 1
        assert found[old.pid]["rank"] == "1"
        killed = reaper.reap(mine, 3, remote=False)
        assert {p["pid"] for p in killed} == {old.pid, stopped.pid}
        for p in (old, stopped):
            p.wait(5)
        assert p.returncode == -signal.SIGKILL
        assert alive(current.pid) and alive(
            foreign.pid
        )  # this generation, and another run, untouched
        assert reaper.reap(mine, 3, remote=False) == []
    finally:
        for p in (old, stopped, current, foreign):
            p.kill()
            p.wait(5)
