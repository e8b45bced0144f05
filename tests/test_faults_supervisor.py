"""The supervisor itself dies: ``spikeguard submit`` SIGKILLed in the middle of a recovery and again
while its ranks train, restarted each time on the same run directory; and restarts of finished or
still-supervised runs. Slack is tests/fakeslack.py (real slack-sdk over HTTP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import SCRIPTS, When, alive, events, reports
from fakeslack import TOKEN, FakeSlack
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.journal import Journal
from spikeguard.supervisor.launch import reaper
from spikeguard.supervisor.rundir import highest_generation
from spikeguard.workers.checkpoint import list_checkpoints

POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"

JOB = """\
name: toy
entrypoint: {script}
# 400 steps: B's orphans must still be training when C comes up to reap them (under load C's Ray
# took longer than the ~15 s that 200 steps left them, and there was nothing to reap)
args: ["--steps", "400", "--step-sleep", "0.1"]
workers: 2
policy: {policy}
run_dir: {run_dir}
env: {{SG_FAULT: "0:40:collapse:1"}}
timeouts: {{heartbeat_s: 30, first_heartbeat_s: 120, restart_backoff_s: 4, reap_interval_s: 2}}
ray: {{num_cpus: 4, object_store_mb: 80, dashboard: false}}  # a Ray start ~3 CPU-s cheaper
notify: {{slack: {{channel: "#ml-alerts"}}}}
checkpoints: {{enabled: false}}  # what the orphans wrote stays on disk, as evidence
"""


class Supervisor:
    """``spikeguard submit JOB --quiet`` as a separate process (its own embedded Ray)."""

    def __init__(self, job: Path, log: Path, slack_url: str, **env_extra: str) -> None:
        env = dict(
            os.environ, SLACK_BOT_TOKEN=TOKEN, SPIKEGUARD_SLACK_API_URL=slack_url, **env_extra
        )
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(job), "--quiet"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log.close()


@pytest.mark.slow
def test_a_supervisor_killed_mid_recovery_and_mid_training_resumes_from_the_journal(tmp_path):
    log = tmp_path / "supervisors.log"
    with FakeSlack() as fake:
        # 1. killed mid-recovery: incident, kill and rollback journaled, no launch yet. A numerical
        # incident relaunches at once, so the kill races the relaunch: on a loaded machine the
        # watcher may see the journal only after the launch. The precondition is established, not
        # assumed: a try that lost the race starts over in a fresh run directory.
        for attempt in range(4):
            run_dir = tmp_path / f"run{attempt}"
            job = tmp_path / "job.yaml"
            job.write_text(
                JOB.format(script=SCRIPTS / "toy_rank.py", policy=POLICY, run_dir=run_dir)
            )
            a = Supervisor(job, log, fake.api_url)
            w = When(
                run_dir,
                lambda evs: {"notify_thread", "optimizer_reset"} <= {e["kind"] for e in evs},
                lambda evs, a=a: a.kill9(),
                timeout_s=180,
            )
            assert w.ok(180), log.read_text()[-3000:]
            if [e["kind"] for e in events(run_dir)][-1] in (
                "lr_cut",
                "optimizer_reset",
                "notify_thread",
            ):
                break
            for proc in reaper.find(str(run_dir / "FENCE"), 10**9):
                os.kill(proc["pid"], signal.SIGKILL)  # the lost try's ranks, if its Ray left any
            fake.messages.clear()  # the next try's Slack story starts afresh
            fake.calls.clear()
        else:
            raise AssertionError("the supervisor reached the relaunch before every kill")
        highest_generation_before_b = highest_generation(run_dir)  # 2 if A wrote gen 2's plan

        # 2. the restart finishes the recovery (generation 2, or 3 if A's plan for 2 was written),
        # then is killed while its ranks train.
        # Ray's workers kill their children when they exit cleanly (the embedded Ray dies with the
        # supervisor, its workers notice and exit); that is off here, so the ranks outlive the
        # supervisor as they do when an agent is SIGKILLed, OOM-killed or frozen.
        b = Supervisor(job, log, fake.api_url, RAY_kill_child_processes_on_worker_exit="0")
        orphans: list[int] = []

        def recovery_launch(evs):
            return next(
                (e for e in evs if e["kind"] == "launch" and e["cause"] == "recovery"), None
            )

        def gen2_going(evs):
            g2 = recovery_launch(evs)
            return g2 and any(
                m["gen"] == g2["generation"]
                and m["type"] == "heartbeat"
                and m["step"] >= g2["plan"]["checkpoint_step"] + 5
                for m in reports(run_dir)
            )

        def kill_b(evs):
            b.kill9()
            orphans.extend(recovery_launch(evs)["pids"])

        w = When(run_dir, gen2_going, kill_b, timeout_s=180)
        assert w.ok(180), log.read_text()[-3000:]
        assert orphans and all(alive(p) for p in orphans)  # its ranks outlive it and keep training

        # 3. the second restart reaps them and resumes from the newest healthy checkpoint
        c = Supervisor(job, log, fake.api_url)
        assert c.wait(240) == 0, log.read_text()[-3000:]
        roots = fake.roots()
        replies = {
            root["ts"]: [r.get("text", "") for r in fake.replies(root["ts"])] for root in roots
        }

    evs = events(run_dir)
    kinds = [e["kind"] for e in evs]
    assert (
        kinds.count("incident") == 1 and kinds.count("kill") == 1
    )  # the incident was not repeated
    assert kinds.count("supervisor_start") == 2 and kinds[-1] == "completed"
    launches = [e for e in evs if e["kind"] == "launch"]
    # A may be killed after writing generation 2's plan (a launch that may have begun): then B
    # fences that number and relaunches as generation 3
    rec = launches[1]["generation"]
    assert rec in (2, 3) and (rec == 2) == (highest_generation_before_b == 1)
    assert [(e["generation"], e["cause"]) for e in launches] == [
        (1, "initial"),
        (rec, "recovery"),
        (rec + 1, "restart"),
    ]
    assert (
        launches[1]["lr_scale"] == launches[2]["lr_scale"] == pytest.approx(0.5)
    )  # the cut carries over
    assert {
        e["incident"]
        for e in evs
        if e["kind"] in ("incident", "rollback", "launch", "resume", "probation_passed")
        and e["incident"]
    } == {"inc-001"}
    reaped = next(e for e in evs if e["kind"] == "reaped")
    assert sorted(p["pid"] for p in reaped["processes"]) == sorted(orphans)
    assert not any(alive(p) for p in orphans)
    infos = list_checkpoints(run_dir / "checkpoints")
    by_orphans = [c for c in infos if c.generation == rec]
    assert by_orphans and max(c.step for c in by_orphans) >= 60  # they trained on after B died...
    fenced_at = datetime.fromisoformat(reaped["time"]).timestamp()
    assert all(
        os.path.getmtime(c.meta_path) < fenced_at for c in by_orphans
    )  # ...until fenced and reaped
    resume = next(e for e in evs if e["kind"] == "resume")
    healthy = [c.step for c in infos if c.generation <= rec and (c.grade or 0) >= 4]
    assert resume["checkpoint_step"] == max(healthy)  # the newest healthy one on the lineage
    assert resume["lr_scale"] == pytest.approx(0.5) and resume["resume_to"] == "PROBATION"
    restart_gen = [m for m in reports(run_dir) if m["gen"] == rec + 1]
    assert {m["from_step"] for m in restart_gen if m["type"] == "resumed"} == {
        resume["checkpoint_step"] + 1
    }
    assert all(m["lr_scale"] == pytest.approx(0.5) for m in restart_gen if m["type"] == "resumed")
    steps3 = [m["step"] for m in restart_gen if m["type"] in ("heartbeat", "report")]
    assert min(steps3) == resume["checkpoint_step"] + 1
    assert reaper.find(str(run_dir / "FENCE"), 10**9) == []  # nothing of the run is left running
    # one Slack thread for the incident, across three supervisors
    threads = [
        r for r in roots if r.get("thread_ts") is None and "Run completed" not in r.get("text", "")
    ]
    assert kinds.count("notify_thread") == 1 and len(threads) == 1, [r.get("text") for r in roots]
    assert threads[0]["blocks"][0]["text"]["text"].startswith(
        "[RESOLVED]"
    )  # updated by the third supervisor
    said = replies[threads[0]["ts"]]  # the second and third supervisors posted into the same thread
    assert f"[inc-001] Launched generation {rec}, LR scale 0.5" in said
    assert "[inc-001] Launched generation 3, LR scale 0.5" in said
    assert any(t.startswith("[inc-001] RESOLVED: probation passed") for t in said)


def journal(run_dir: Path, end: str | None = None) -> None:
    """A real journal of a run launched once and then ended by ``end`` (or still running): the
    machine's own events, as a supervisor writes them."""
    steps: list[rc.Observation] = [rc.Start(), rc.Launched(1, port=1)]
    if end == "completed":
        steps.append(rc.Finished(1.0))
    elif end == "stopped":
        steps.append(rc.StopRequested("stopped (test)"))
    elif end == "failed":
        steps.append(rc.RankExited(rank=0, generation=1, code=1))
    elif end == "escalated":
        steps += [
            rc.Recover("r", "collapse (test)", 10, rc.Settings()),
            rc.Killed((0, 1), 0.0),
            rc.CheckpointChosen(None),
        ]
    j = Journal(run_dir, run="toy")
    state = rc.State()
    for obs in steps:
        t = rc.step(state, obs)
        state = t.state
        for ev in t.events:
            j.record(ev)
    j.close()


@pytest.mark.parametrize(
    "end,code", [("completed", 0), ("escalated", 3), ("failed", 1), ("stopped", 5)]
)
def test_a_finished_run_is_not_restarted(tmp_path, capsys, end, code):
    from conftest import toy_job
    from spikeguard.supervisor.runner import run_job

    job = toy_job(tmp_path, policy=POLICY)
    journal(Path(job.run_dir), end)
    before = events(Path(job.run_dir))
    assert before[0]["kind"] == "launch" and before[-1]["kind"] == end
    t0 = time.monotonic()
    assert run_job(job, live=False) == code
    assert f"already finished: {end}" in capsys.readouterr().out
    assert time.monotonic() - t0 < 10 and events(Path(job.run_dir)) == before  # nothing ran


def test_a_run_another_supervisor_holds_is_refused(tmp_path, capsys):
    from conftest import toy_job
    from spikeguard.supervisor import rundir
    from spikeguard.supervisor.runner import run_job
    from spikeguard.workers.contract import ExitCode

    job = toy_job(tmp_path, policy=POLICY)
    journal(Path(job.run_dir))
    held = rundir.acquire_lock(Path(job.run_dir))
    try:
        assert run_job(job, live=False) == ExitCode.BAD_INPUT
        assert "another supervisor holds" in capsys.readouterr().out
    finally:
        held.close()


def test_the_journal_of_an_older_spikeguard_is_refused_not_restarted(tmp_path, capsys):
    from conftest import toy_job
    from spikeguard.supervisor.runner import run_job
    from spikeguard.workers.contract import ExitCode

    job = toy_job(tmp_path, policy=POLICY)
    j = Journal(Path(job.run_dir), run="toy")  # events as an older spikeguard wrote them: no obs
    j.append("launch", reason="initial launch", generation=1, cause="initial")
    j.append("incident", reason="collapse", rule="r", step=10)
    j.close()
    before = events(Path(job.run_dir))
    assert run_job(job, live=False) == ExitCode.BAD_INPUT
    assert "older spikeguard" in capsys.readouterr().out
    assert events(Path(job.run_dir)) == before
