"""What a preemption (SIGTERM: an eviction, a spot reclaim, ``ray job stop``) of training ends in,
never neither: the ranks finish in the grace period (every rank exits 0: completed wins), or their
emergency checkpoint comes, or the grace expires and the ``preempted`` event names the newest
usable checkpoint, the one the resume starts from.

The machine's transitions without Ray (one step at a time, every journaled transition folded back);
the controller with a scripted group (no Ray, real checkpoint files); then real Ray + gloo, where
the ranks wait at a step until the test lets them go, so what the preemption finds does not
depend on the machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, assert_journal_replays, events, reports, scripted_controller
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll
from test_faults_fold import Run, ckpt, launched

LINEAGE = ((1, None),)


def running() -> Run:
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    return r


def preempting() -> Run:
    r = running()
    t = r.feed(rc.Preempt("SIGTERM"))
    assert t.effects == (rc.RequestCheckpoint(1, "SIGTERM", wait=True),)
    return r


# ---- the machine -------------------------------------------------------------------------------
def test_ranks_that_finish_in_the_grace_period_complete_the_run():
    r = preempting()
    t = r.feed(rc.Finished(1.25))
    assert r.state.phase is rc.Phase.COMPLETED and r.state.exit_code == 0
    assert t.effects == (rc.Shutdown(0),)  # nothing to kill: they exited
    assert r.kinds()[-1] == "completed" and "preempted" not in r.kinds()


def test_an_emergency_checkpoint_is_where_the_resume_starts():
    r = preempting()
    r.feed(rc.CheckpointSaved(1, "/c/77.pt", 77))
    pre = r.journal[-1]
    assert pre["code"] == "preempted_after_checkpoint"
    assert (pre["checkpoint_step"], pre["resume_step"]) == (77, 77)
    assert pre["resume_checkpoint"] == pre["checkpoint_path"] == "/c/77.pt"
    assert "step 77" in pre["reason"]


def test_after_the_grace_the_ranks_are_killed_then_the_newest_usable_checkpoint_is_named():
    r = preempting()
    t = r.feed(rc.GraceExpired(1))
    kill, select = t.effects  # killed first: nothing is written between the choice and the resume
    assert isinstance(kill, rc.Kill)
    assert select == rc.SelectCheckpoint(None, None, 0, LINEAGE)  # any grade, on the lineage
    assert r.state.phase is rc.Phase.PREEMPTING  # nothing journaled before the choice
    chosen = rc.CheckpointChosen(
        "/c/50.pt", step=50, sha256="ab" * 32, grade=2, skipped=(("/c/60.pt", "corrupt"),)
    )
    t = r.feed(chosen)
    assert t.effects == (rc.Shutdown(143),)  # the ranks are dead already
    assert r.state.phase is rc.Phase.PREEMPTED and r.state.exit_code == 143
    pre = r.journal[-1]
    assert pre["kind"] == "preempted" and pre["code"] == "preempted_without_checkpoint"
    assert pre["checkpoint_step"] is None  # no emergency checkpoint...
    assert (pre["resume_checkpoint"], pre["resume_step"]) == ("/c/50.pt", 50)  # ...but this one
    assert pre["resume_skipped"] == [["/c/60.pt", "corrupt"]]
    assert "newest usable checkpoint, step 50" in pre["reason"]


def test_the_checkpoint_named_is_the_one_a_restarted_supervisor_chooses():
    """One rule: the restart asks for the same choice the preempted event answered."""
    r = preempting()
    select = r.feed(rc.GraceExpired(1)).effects[1]
    r.feed(ckpt(50, grade=2))
    folded = rc.fold(r.journal)
    assert folded.phase is rc.Phase.PREEMPTED
    t = rc.step(folded, rc.Restarted(rc.Settings(min_grade=6), highest_generation=1))
    assert t.effects == (select,)
    t = rc.step(t.state, ckpt(50, grade=2))
    assert t.events[0]["code"] == "resume_after_preemption"
    assert t.effects[0].plan.checkpoint_step == r.journal[-1]["resume_step"] == 50


def test_a_run_without_a_checkpoint_says_the_resume_starts_at_step_0():
    r = preempting()
    r.feed(rc.GraceExpired(1))
    r.feed(rc.CheckpointChosen(None))
    pre = r.journal[-1]
    assert pre["resume_checkpoint"] is None and pre["resume_step"] is None
    assert "starts at step 0" in pre["reason"]


def test_an_older_journals_grace_expiry_still_restarts_the_same_way():
    """An older supervisor journaled the grace expiry itself as the preemption: its journal folds
    to a phase the restart resumes from the newest checkpoint, as it did."""
    r = preempting()
    old = {
        "kind": "preempted",
        "code": "preempted_without_checkpoint",
        "obs": [{"type": "GraceExpired", "request_id": 1}],
    }
    st = rc.fold([*r.journal, old])
    t = rc.step(st, rc.Restarted(rc.Settings(), highest_generation=1))
    assert t.state.phase is rc.Phase.RESUMING
    assert t.effects == (rc.SelectCheckpoint(None, None, 0, LINEAGE),)


# ---- the controller, with a scripted group (no Ray) --------------------------------------------
def _line(gen: int, rank: int, step: int, kind: str = "heartbeat") -> bytes:
    msg = {"v": 1, "type": kind, "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": 2.0}).encode()


class ScriptedGroup:
    """Two ranks that report steps 0-4, then (after the preemption) ``then``: ``"finish"`` (both
    say ``done`` and exit 0), ``"gone"`` (both had finished before the SIGTERM: nobody gets the
    request), ``"exit"`` (both exit 0 without ``done``: their own SIGTERM handler, not the end of
    training) or ``"hold"`` (they never answer)."""

    def __init__(self, then: str) -> None:
        self.then = then
        self.gen = 0
        self.ticks = 0
        self.calls: list[str] = []

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(2)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        self.ticks += 1
        g = self.gen
        if self.ticks == 1:
            return [
                RankPoll(rank=r, generation=g, lines=tuple(_line(g, r, s) for s in range(5)))
                for r in range(2)
            ]
        if self.then in ("finish", "gone", "exit") and "request" in self.calls:
            done = () if self.then == "exit" else (_line(g, r, 5, "done") for r in range(2))
            lines = list(done)
            return [
                RankPoll(rank=r, generation=g, lines=tuple(lines[r : r + 1]), exit_code=0)
                for r in range(2)
            ]
        return []

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        self.calls.append("request")
        return 0 if self.then == "gone" else 2

    def kill(self, grace_s: float = 0.0) -> KillReport:
        self.calls.append("kill")
        return KillReport(duration_s=0.0)


def _controller(tmp_path: Path, group: ScriptedGroup):
    from conftest import SpyEngine

    engine = SpyEngine(
        "version: 1\nname: t\nrules:\n  - {name: loss-high, when: loss > 100, action: recover}\n"
    )
    return scripted_controller(tmp_path, group, engine, preempt_grace_s=0.5)


def _run_out(ctl, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while ctl.state.phase not in rc.EXITS:
        assert time.monotonic() < end, ctl.state.phase
        ctl.step()
        time.sleep(0.02)
    ctl.close()


@pytest.mark.parametrize("then", ["finish", "gone"])
def test_ranks_that_finish_while_preempted_complete_the_run_not_preempt_it(tmp_path, then):
    """Asked for an emergency checkpoint after their last step, they exit 0 instead of saving;
    and ranks whose exits the supervisor had not read yet when the SIGTERM came get no request
    at all: both runs are complete (exit 0), not preempted without a checkpoint."""
    group = ScriptedGroup(then)
    ctl = _controller(tmp_path, group)
    ctl.step()  # steps 0-4
    ctl.preempt("SIGTERM: the supervisor must go")
    _run_out(ctl)
    kinds = [e["kind"] for e in events(tmp_path)]
    assert ctl.state.phase is rc.Phase.COMPLETED and ctl.state.exit_code == 0, kinds
    assert kinds[-1] == "completed" and "preempted" not in kinds
    assert "kill" not in group.calls


def test_ranks_that_exit_0_without_finishing_while_preempted_do_not_complete_the_run(tmp_path):
    """A script whose own SIGTERM handler saves and exits 0 (Slurm signals the whole step) has
    not finished training: the run is preempted (resumable), never completed."""
    group = ScriptedGroup("exit")
    ctl = _controller(tmp_path, group)
    ctl.step()
    ctl.preempt("SIGTERM: the supervisor must go")
    _run_out(ctl)
    kinds = [e["kind"] for e in events(tmp_path)]
    assert ctl.state.phase is rc.Phase.PREEMPTED and ctl.state.exit_code == 143, kinds
    assert "completed" not in kinds and kinds[-1] == "preempted"


def _checkpoint(ckpt_dir: Path, step: int) -> Path:
    import torch
    from spikeguard.workers.checkpoint import write_checkpoint

    info = write_checkpoint(
        ckpt_dir, {"w": torch.ones(2) * step}, step=step, generation=1, meta={"grade": 2}
    )
    return Path(info.path)


def test_ranks_that_never_answer_are_killed_and_the_newest_usable_checkpoint_is_named(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir(mode=0o700)
    _checkpoint(ckpt_dir, 20)
    good = _checkpoint(ckpt_dir, 50)
    bad = _checkpoint(ckpt_dir, 60)
    with open(bad, "r+b") as f:  # corrupt: the sha256 in its sidecar no longer matches
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    group = ScriptedGroup("hold")
    ctl = _controller(tmp_path, group)
    ctl.step()
    ctl.preempt("SIGTERM: the supervisor must go")
    _run_out(ctl)
    assert ctl.state.exit_code == 143
    pre = events(tmp_path)[-1]
    assert pre["kind"] == "preempted" and pre["code"] == "preempted_without_checkpoint", pre
    assert (pre["resume_checkpoint"], pre["resume_step"]) == (str(good), 50)
    assert [p for p, _ in pre["resume_skipped"]] == [str(bad)]
    assert group.calls == ["request", "kill"]  # one kill, before the choice


# ---- real Ray + gloo ----------------------------------------------------------------------------
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"
JOB = """\
name: toy
entrypoint: {script}
args: {args}
workers: 2
policy: {policy}
run_dir: {run_dir}
env: {env}
timeouts: {{heartbeat_s: 30, first_heartbeat_s: 120, preempt_grace_s: {grace}, reap_interval_s: 2}}
ray: {{num_cpus: 4, object_store_mb: 80, dashboard: false}}
"""


def held_job(tmp_path: Path, *, hold_at: int, grace: float, faults: str = "") -> tuple[Path, Path]:
    """A job whose ranks (generation 1) wait before step ``hold_at`` until ``go`` exists."""
    go = tmp_path / "go"
    args = ["--steps", "120", "--ckpt-every", "50", "--hold-at", str(hold_at)]
    args += ["--hold-file", str(go)]
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.format(
            script=SCRIPTS / "toy_rank.py",
            args=json.dumps(args),
            policy=POLICY,
            run_dir=tmp_path / "run",
            env=json.dumps({"SG_FAULT": faults} if faults else {}),
            grace=grace,
        )
    )
    return job, go


def submit(job: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(job), "--quiet"],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
        start_new_session=True,
    )


def wait_for(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def held(run_dir: Path, step: int) -> bool:
    """Both ranks reported the step before the hold (they wait there now)."""
    seen = {
        (m["rank"], m["step"]) for m in reports(run_dir) if m["type"] in ("heartbeat", "report")
    }
    return {(0, step - 1), (1, step - 1)} <= seen


def wait_held(sup: subprocess.Popen[bytes], run_dir: Path, step: int, log: Path) -> None:
    """Wait until both ranks wait before ``step`` (the supervisor still running)."""
    wait_for(lambda: sup.poll() is not None or held(run_dir, step), 240, f"the hold at {step}")
    assert sup.poll() is None, log.read_text()[-3000:]


def asked(run_dir: Path) -> bool:
    journal = run_dir / "journal.jsonl"
    return journal.exists() and any(e.get("code") == "preemption" for e in events(run_dir))


@pytest.mark.slow
def test_sigterm_while_the_ranks_take_their_last_step_completes_the_run(tmp_path):
    """The SIGTERM comes while the ranks are at their last step: they finish (exit 0) instead of
    saving, and the run is complete (exit 0), not preempted without a checkpoint."""
    job, go = held_job(tmp_path, hold_at=90, grace=60, faults="0:90:finish,1:90:finish")
    run_dir, log = tmp_path / "run", tmp_path / "supervisor.log"
    sup = submit(job, log)
    wait_held(sup, run_dir, 90, log)
    sup.send_signal(signal.SIGTERM)
    wait_for(lambda: asked(run_dir), 120, "the emergency checkpoint request")
    go.touch()  # the ranks go on: their last step is the end of their data
    assert sup.wait(180) == 0, log.read_text()[-3000:]
    kinds = [e["kind"] for e in events(run_dir)]
    assert kinds[-1] == "completed" and "preempted" not in kinds, kinds
    assert_journal_replays(run_dir / "journal.jsonl")


@pytest.mark.slow
def test_ranks_that_cannot_answer_in_the_grace_are_resumed_from_the_named_checkpoint(tmp_path):
    """The ranks are held (they never reach a step boundary): after the grace the supervisor
    kills them, names the newest checkpoint (step 50) and exits 143; the resubmit starts there."""
    job, _ = held_job(tmp_path, hold_at=70, grace=2)
    run_dir, log = tmp_path / "run", tmp_path / "supervisor.log"
    sup = submit(job, log)
    wait_held(sup, run_dir, 70, log)
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(180) == 143, log.read_text()[-3000:]
    pre = events(run_dir)[-1]
    assert pre["kind"] == "preempted" and pre["code"] == "preempted_without_checkpoint", pre
    assert pre["resume_step"] == 50 and Path(pre["resume_checkpoint"]).is_file(), pre
    again = submit(job, log)  # generation 2 does not hold
    assert again.wait(240) == 0, log.read_text()[-3000:]
    evs = events(run_dir)
    resume = next(e for e in evs if e["kind"] == "resume")
    assert resume["checkpoint_step"] == 50 and resume["code"] == "resume_after_preemption"
    assert evs[-1]["kind"] == "completed"
    assert_journal_replays(run_dir / "journal.jsonl")
