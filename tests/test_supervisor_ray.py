"""The supervisor end to end on real Ray + gloo with 2 ranks, faults injected into real
processes."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from conftest import read_jsonl, toy_job
from spikeguard.policies.schema import RecoverySettings

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


def story(run_dir: Path) -> list[dict]:
    """The journal without the periodic probation reports (checked on their own) and the
    retention's deletions (bookkeeping)."""
    evs = read_jsonl(run_dir / "journal.jsonl")
    return [e for e in evs if e["kind"] not in ("probation_progress", "checkpoint_deleted")]


def test_collapse_is_recovered_from_the_chosen_checkpoint_with_cut_lr_and_fresh_optimizer(
    ray_local, tmp_path, fail_at
):
    fail_at(0, 60, "collapse")  # generation 1 only
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=120)
    assert run(job) == 0
    run_dir = Path(job.run_dir)
    evs = story(run_dir)
    kinds = [e["kind"] for e in evs]
    assert kinds == [
        "launch",
        "incident",
        "forensics",  # the ranks' batch ids, asked for before the kill
        "kill",
        "rollback",
        "lr_cut",
        "optimizer_reset",
        "launch",
        "probation_start",
        "probation_passed",
        "completed",
    ]
    progress = [
        e for e in read_jsonl(run_dir / "journal.jsonl") if e["kind"] == "probation_progress"
    ]
    assert progress and all(e["incident"] == "inc-001" for e in progress)
    assert [e["step"] for e in progress] == sorted(e["step"] for e in progress)
    inc = evs[1]
    assert inc["rule"] == "loss-spike" and 60 <= inc["step"] <= 64
    rb = evs[4]
    assert rb["checkpoint_step"] < inc["step"] and rb["grade"] >= 4
    # the chosen checkpoint really is the newest healthy one before the incident
    from spikeguard.workers.checkpoint import list_checkpoints

    healthy = [
        c
        for c in list_checkpoints(run_dir / "checkpoints")
        if c.generation == 1 and c.grade is not None and c.grade >= 4 and c.step <= inc["step"]
    ]
    assert rb["checkpoint_step"] == max(c.step for c in healthy)

    msgs = read_jsonl(run_dir / "reports.jsonl")
    gen2 = [m for m in msgs if m["gen"] == 2]
    resumed = [m for m in gen2 if m["type"] == "resumed"]
    assert {m["rank"] for m in resumed} == {0, 1}
    for m in resumed:  # the ranks' own account of what they did
        assert m["from_step"] == rb["checkpoint_step"] + 1
        assert m["lr_scale"] == pytest.approx(0.5) and m["optimizer_reset"] is True
        assert m["checkpoint"] == rb["checkpoint_path"]
    steps = [m for m in gen2 if m["type"] in ("heartbeat", "report") and m["rank"] == 0]
    assert steps[0]["step"] == rb["checkpoint_step"] + 1
    # the LR each step used: the cut LR, re-warmed over the first rewarm_steps after the reset
    rewarm = RecoverySettings().rewarm_steps
    for m in steps:
        ramp = min(1.0, (m["step"] - rb["checkpoint_step"]) / rewarm)
        assert m["lr"] == pytest.approx(0.5e-3 * ramp), m
    # a fresh AdamW: its step counter restarts at 1 on the first resumed step
    assert [m["extra"]["adam_steps"] for m in steps[:3]] == [1, 2, 3]
    assert steps[-1]["step"] == 119
    killed_at = datetime.fromisoformat(evs[3]["time"]).timestamp()
    assert evs[3]["kind"] == "kill"
    late = [m for m in msgs if m["gen"] == 1 and m["t"] > killed_at]
    assert not late, late  # nothing of generation 1 after its kill (same machine, same clock)


def test_rank_killed_mid_step_leads_to_recovery(ray_local, tmp_path, fail_at):
    fail_at(1, 50, "sigkill")
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=90)
    assert run(job) == 0
    evs = story(Path(job.run_dir))
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "crash" and inc["rank"] == 1
    assert [e["kind"] for e in evs][-1] == "completed"
    assert next(e for e in evs if e["kind"] == "lr_cut")["lr_scale"] == pytest.approx(
        1.0
    )  # crash: no cut


def test_rank_hung_in_all_reduce_is_caught_by_heartbeat_and_recovered(ray_local, tmp_path, fail_at):
    fail_at(0, 40, "hang")  # rank 0 sleeps; rank 1 blocks inside all_reduce
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=80, heartbeat_s=4.0)
    assert run(job) == 0
    evs = story(Path(job.run_dir))
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "hang"
    kill = next(e for e in evs if e["kind"] == "kill")
    assert kill["duration_s"] < 15  # SIGKILL frees a rank stuck in a collective
    assert [e["kind"] for e in evs][-1] == "completed"


def test_no_healthy_checkpoint_escalates_and_stops(ray_local, tmp_path, fail_at):
    fail_at(0, 15, "nan")  # before the first checkpoint (step 20): nothing to roll back to
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=60)
    assert run(job) == 3
    kinds = [e["kind"] for e in story(Path(job.run_dir))]
    assert kinds == ["launch", "incident", "forensics", "kill", "rollback", "escalated"]
