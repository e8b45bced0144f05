"""SIGTERM delivered to the supervisor alone (``kill PID``, ``ray job stop``) and to its whole
process group (Slurm, systemd's control-group stop, ``timeout``): either way ``spikeguard
submit`` on an embedded Ray exits 143 (preempted), its journal names the checkpoint the resume
starts from, no rank process of the run is left behind, and a resubmit resumes from it.

Sent to the group, the embedded Ray's GCS and raylet die with the supervisor: a call that needs
the GCS (removing the placement group) used to block until Ray's GCS client gave up after 60 s
and ended the process with exit 1, so a batch system retrying on 143 gave up. The ranks wait
before step 70 until the test lets them go after the SIGTERM: the preemption finds them training
however fast the machine is.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import assert_journal_replays, events
from spikeguard.supervisor.launch import reaper
from test_preempt_semantics import asked, held_job, submit, wait_for, wait_held

pytestmark = pytest.mark.slow


def leftovers(run_dir: Path) -> list[dict]:
    """Processes of this run still alive on this machine (ranks and standbys)."""
    return reaper.find(str(run_dir / "FENCE"), 1 << 62)


@pytest.mark.parametrize("delivery", ["supervisor", "process group"])
def test_sigterm_exits_143_and_names_the_checkpoint_to_resume_from(tmp_path, delivery):
    job, go = held_job(tmp_path, hold_at=70, grace=20)
    run_dir, log = tmp_path / "run", tmp_path / "supervisor.log"
    sup = submit(job, log)  # a session of its own: its process group is its and its Ray's
    wait_held(sup, run_dir, 70, log)
    if delivery == "supervisor":
        sup.send_signal(signal.SIGTERM)
    else:
        os.killpg(sup.pid, signal.SIGTERM)
    wait_for(lambda: asked(run_dir), 120, "the emergency checkpoint request")
    go.touch()
    assert sup.wait(180) == 143, log.read_text()[-3000:]

    pre = events(run_dir)[-1]
    assert pre["kind"] == "preempted" and pre["exit_code"] == 143, pre
    # the emergency checkpoint, or (its agents gone with Ray) the newest one on disk: named
    assert pre["resume_step"] is not None and pre["resume_step"] >= 50, pre
    assert Path(pre["resume_checkpoint"]).exists(), pre
    end = time.monotonic() + 60
    while leftovers(run_dir):
        assert time.monotonic() < end, leftovers(run_dir)
        time.sleep(0.2)

    again = submit(job, log)  # the batch system's retry: the same job, the same run dir
    assert again.wait(240) == 0, log.read_text()[-3000:]
    evs = events(run_dir)
    resume = next(e for e in evs if e["kind"] == "resume")
    assert resume["checkpoint_step"] == pre["resume_step"], resume
    assert evs[-1]["kind"] == "completed"
    assert_journal_replays(run_dir / "journal.jsonl")
