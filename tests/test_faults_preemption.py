"""Preemption on real Ray + gloo: SIGTERM to `spikeguard submit` asks the ranks for an emergency
checkpoint, stops as `preempted` (exit 143), and a re-submit of the same job resumes from it.

Also the request channel on its own: a policy `checkpoint` rule makes the ranks save at their
next step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, events, launch_of, reports
from spikeguard.workers.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow

POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"

JOB = """\
name: toy
entrypoint: {script}
args: ["--steps", "160", "--step-sleep", "0.05", "--ckpt-every", "50"]
workers: 2
policy: {policy}
run_dir: {run_dir}
timeouts: {{heartbeat_s: 30, first_heartbeat_s: 120, preempt_grace_s: 20, reap_interval_s: 2}}
ray: {{num_cpus: 4, object_store_mb: 80, dashboard: false}}  # a Ray start ~3 CPU-s cheaper
"""


def submit(job: Path, log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(job), "--quiet"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )


def wait_for(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigterm_saves_an_emergency_checkpoint_and_a_resubmit_resumes_from_it(tmp_path):
    run_dir = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(script=SCRIPTS / "toy_rank.py", policy=POLICY, run_dir=run_dir))
    log = tmp_path / "supervisor.log"

    first = submit(job, log)
    # training is past the regular checkpoint at 50, between two checkpoints
    wait_for(
        lambda: any(m.get("step", 0) >= 70 for m in reports(run_dir) if m["type"] == "heartbeat"),
        180,
        "step 70",
    )
    seen = max(m["step"] for m in reports(run_dir) if m["type"] in ("heartbeat", "report"))
    first.send_signal(signal.SIGTERM)
    assert first.wait(90) == 143, log.read_text()[-3000:]

    evs = events(run_dir)
    kinds = [e["kind"] for e in evs]
    assert kinds[-1] == "preempted", kinds
    pre = evs[-1]
    assert pre["code"] == "preempted_after_checkpoint" and pre["interrupted"] == "RUNNING"
    emergency = pre["checkpoint_step"]
    # saved at the next step boundary after the request, not at the regular every-50 schedule
    assert emergency >= seen and emergency % 50 != 0
    saved = {i.step: i for i in list_checkpoints(run_dir / "checkpoints")}
    assert emergency in saved and saved[emergency].generation == 1
    ask = next(e for e in evs if e["kind"] == "alert" and e.get("code") == "preemption")
    answer = next(
        m for m in reports(run_dir) if m["type"] == "checkpoint" and m["step"] == emergency
    )
    assert answer["requests"] == [ask["request_id"]]
    assert not any(e["kind"] in ("stopped", "completed", "failed") for e in evs)

    second = submit(job, log)
    assert second.wait(240) == 0, log.read_text()[-3000:]
    evs = events(run_dir)
    tail = [e["kind"] for e in evs[len(kinds) :]]
    assert tail[0] == "supervisor_start" and tail[-1] == "completed", tail
    resume = next(e for e in evs if e["kind"] == "resume")
    assert resume["code"] == "resume_after_preemption"
    assert resume["checkpoint_step"] == emergency  # nothing lost beyond the emergency checkpoint
    gen2 = launch_of(evs, 2)
    assert gen2["plan"]["checkpoint_step"] == emergency and gen2["lr_scale"] == 1.0
    first_step = min(
        m["step"]
        for m in reports(run_dir)
        if m["gen"] == 2 and m["type"] in ("heartbeat", "report")  # a sampled step is a report
    )
    assert first_step == emergency + 1
    # the journal tells both halves, and a third submit says the run is finished
    third = submit(job, log)
    assert third.wait(60) == 0 and events(run_dir) == evs


def test_a_checkpoint_rule_makes_the_ranks_save_at_their_next_step(ray_local, tmp_path):
    from conftest import toy_job
    from spikeguard.supervisor.runner import run_job

    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nname: ck\nwarm_in: 0 steps\nrules:\n"
        "  - {name: save-now, when: loss > 0, ranks: all, warm_in: 33 steps, action: checkpoint}\n"
    )
    # paced (~170 steps of margin, 20 ms each) so that the request reaches the ranks before they
    # finish even on a loaded machine: unpaced, the 27 steps after the warm-in took 0.5 s
    job = toy_job(
        tmp_path, policy=policy, steps=200, extra_args=["--ckpt-every", "0", "--step-sleep", "0.02"]
    )
    assert run_job(job, live=False) == 0
    run_dir = Path(job.run_dir)
    evs = events(run_dir)
    ask = next(e for e in evs if e["kind"] == "alert" and e.get("code") == "checkpoint_requested")
    assert ask["rule"] == "save-now" and ask["request_id"] == 1
    saved = [m for m in reports(run_dir) if m["type"] == "checkpoint"]
    assert len(saved) == 1 and saved[0]["requests"] == [1] and saved[0]["step"] >= 33
    (info,) = list_checkpoints(run_dir / "checkpoints")
    assert info.step == saved[0]["step"]
