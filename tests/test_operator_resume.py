"""A human's hand on a real run: a policy that holds stops after its budget and waits;
``spikeguard resume RUN_DIR --lr-scale 0.25`` makes it go on from a healthy checkpoint and
complete, the journal says who did it, and the journal folds back to the run's state (what a
restarted supervisor replays). An escalated run whose supervisor has exited is supervised again
by ``resume`` itself, from the job the run recorded.

Real parts: ``spikeguard submit`` and ``spikeguard resume`` as processes, an embedded Ray, two
gloo ranks of tests/scripts/toy_rank.py, checkpoints on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, events
from spikeguard.supervisor.decide import recovery as rc

POLICY = """\
version: 1
name: toy-hold
warm_in: 0 steps
rules:
  - name: non-finite-loss
    when: loss is nonfinite
    action: recover
recovery:
  min_grade: S0
  min_steps_back: 5
  lr_factors: [0.5]
  reset_optimizer: true
  probation_steps: 15
  max_attempts: 1
  on_exhausted: {on_exhausted}
"""

# generation 1 diverges at step 30, generation 2 again 5 steps after its start: the one attempt
# fails its probation and the budget is spent; a third generation (the human's) trains cleanly
JOB = """\
name: toy
entrypoint: {script}
args: ["--steps", "60", "--ckpt-every", "10", "--step-sleep", "0.05"]
workers: 2
policy: {policy}
run_dir: {run_dir}
env: {{SG_FAULT: "0:30:nan:1,0:+5:nan:2"}}
timeouts: {{heartbeat_s: 60, first_heartbeat_s: 180, restart_backoff_s: 0.2, reap_interval_s: 2}}
ray: {{num_cpus: 4, object_store_mb: 80, dashboard: false}}
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "spikeguard.supervisor.cli", *args]


def job_files(tmp_path: Path, on_exhausted: str) -> tuple[Path, Path]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(on_exhausted=on_exhausted))
    run_dir = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(script=SCRIPTS / "toy_rank.py", policy=policy, run_dir=run_dir))
    return job, run_dir


def wait_for(run_dir: Path, predicate, timeout_s: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        evs = events(run_dir) if (run_dir / "journal.jsonl").exists() else []
        if predicate(evs):
            return evs
        if proc.poll() is not None and not predicate(evs):
            break
        time.sleep(0.5)
    raise AssertionError(f"not seen in time; supervisor log:\n{log.read_text()[-4000:]}")


def operator_env() -> dict[str, str]:
    return dict(os.environ, SPIKEGUARD_OPERATOR="oncall-alice")


def assert_resumed_and_completed(run_dir: Path) -> list[dict]:
    evs = events(run_dir)
    resumed = [e for e in evs if e["kind"] == "operator" and e["code"] == "operator_resumed"]
    assert len(resumed) == 1, [e["kind"] for e in evs]
    (ev,) = resumed
    assert ev["who"] == "oncall-alice" and ev["via"] == "cli" and ev["note"] == "lr too high"
    assert ev["lr_scale"] == 0.25 and ev["checkpoint_path"]
    # the human's generation was launched with the human's settings, from a healthy checkpoint
    launches = [e for e in evs if e["kind"] == "launch"]
    assert launches[-1]["generation"] == 3 and launches[-1]["lr_scale"] == 0.25
    assert launches[-1]["plan"]["checkpoint"] == ev["checkpoint_path"]
    assert ev["checkpoint_step"] < 30  # before the first divergence
    assert evs[-1]["kind"] == "completed", [e["kind"] for e in evs][-8:]
    # the journal folds back to the end state, the operator's action included
    state = rc.fold(evs)
    assert state.phase is rc.Phase.COMPLETED and state.lr_scale == 0.25
    return evs


@pytest.mark.slow
def test_a_held_run_waits_then_resume_with_a_lower_lr_completes_it(tmp_path):
    job, run_dir = job_files(tmp_path, "hold")
    log = tmp_path / "supervisor.log"
    with open(log, "ab") as out:
        sup = subprocess.Popen(
            cli("submit", str(job), "--quiet"), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            evs = wait_for(
                run_dir,
                lambda evs: any(e["kind"] == "escalated" for e in evs),
                300,
                sup,
                log,
            )
            escalated = next(e for e in evs if e["kind"] == "escalated")
            assert escalated["hold"] is True
            time.sleep(2)
            assert sup.poll() is None, "a held run's supervisor waits for a human"
            # a choice that cannot be honoured is refused with the list of what can be
            bad = subprocess.run(
                cli("resume", str(run_dir), "--from-step", "7"),
                capture_output=True,
                text=True,
                env=operator_env(),
                timeout=120,
            )
            assert bad.returncode == 2, bad.stderr
            assert "These can be chosen" in bad.stderr and "step       20" in bad.stderr
            ok = subprocess.run(
                cli("resume", str(run_dir), "--lr-scale", "0.25", "--note", "lr too high"),
                capture_output=True,
                text=True,
                env=operator_env(),
                timeout=120,
            )
            assert ok.returncode == 0, ok.stdout + ok.stderr
            assert "resumed by oncall-alice" in ok.stdout
            assert sup.wait(300) == 0, log.read_text()[-4000:]
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait(30)
    assert_resumed_and_completed(run_dir)


@pytest.mark.slow
def test_an_escalated_run_is_supervised_again_by_resume_from_its_recorded_job(tmp_path):
    job, run_dir = job_files(tmp_path, "stop")
    done = subprocess.run(
        cli("submit", str(job), "--quiet"), capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert (run_dir / "job.json").exists()
    # acknowledged with no supervisor alive: journaled here, under the lock
    ack = subprocess.run(
        cli("ack", str(run_dir), "--note", "looking"),
        capture_output=True,
        text=True,
        env=operator_env(),
        timeout=60,
    )
    assert ack.returncode == 0, ack.stderr
    assert events(run_dir)[-1]["code"] == "acknowledged"
    job.unlink()  # resume needs only what the run recorded
    again = subprocess.run(
        cli("resume", str(run_dir), "--lr-scale", "0.25", "--note", "lr too high", "--quiet"),
        capture_output=True,
        text=True,
        env=operator_env(),
        timeout=400,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert_resumed_and_completed(run_dir)
