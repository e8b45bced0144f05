"""Rank faults on real Ray + gloo with 2 real rank processes: crashes, budgets, hangs, stragglers,
early finishers and garbage on the report socket."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import When, alive, events, kinds, launch_of, reports, toy_job

pytestmark = pytest.mark.slow
POLICY = (
    Path(__file__).parent / "data" / "toy_policy.yaml"
)  # crash/hang: lr x1; max_attempts 2; probation 30


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


def test_rank_exiting_nonzero_kills_its_peers_at_once_and_journals_code_and_log_tail(
    ray_local, tmp_path, fail_at
):
    fail_at(1, 30, "exit")
    fail_at(
        0, 30, "hang"
    )  # rank 0 never reaches any exit: a failure must not wait on an exit barrier
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=50, heartbeat_s=120)
    assert run(job) == 0
    evs = events(Path(job.run_dir))
    gen1 = launch_of(evs, 1)
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "crash" and inc["rank"] == 1 and inc["exit_code"] == 3
    assert "exited with code 3" in inc["reason"]
    assert (
        "rank 1: injected exit at step 30" in inc["log_tail"]
    )  # the tail of logs/gen001-rank1.log
    assert inc["mono"] - gen1["mono"] < 60  # not the 120 s heartbeat timeout: the exit itself
    kill = next(e for e in evs if e["kind"] == "kill")
    assert kill["ranks"] == [0, 1] and kill["duration_s"] < 15
    assert not any(alive(p) for p in gen1["pids"])  # rank 0, hung in its step, was killed
    assert kinds(Path(job.run_dir))[-1] == "completed"


def test_a_rank_that_always_fails_stops_after_exactly_the_budgeted_restarts_with_backoff(
    ray_local, tmp_path, fail_at
):
    fail_at(
        1, "+25", "exit", gen="*"
    )  # every generation, 25 steps after it started: a new step each time
    job = toy_job(
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=200,
        timeouts={"restart_backoff_s": 0.5, "restart_backoff_max_s": 10},
    )
    assert run(job) == 3
    evs = events(Path(job.run_dir))
    launches = [e for e in evs if e["kind"] == "launch"]
    assert [e["generation"] for e in launches] == [
        1,
        2,
        3,
    ]  # max_attempts: 2 restarts, not one more
    assert [e["backoff_s"] for e in launches] == [0.0, 0.5, 1.0]  # base x 2^(attempt-1)
    for launch in launches[1:]:  # really waited: from the rollback decision to the launch
        rb = [e for e in evs if e["kind"] == "rollback" and e["seq"] < launch["seq"]][-1]
        assert launch["mono"] - rb["mono"] >= launch["backoff_s"]
    assert [e["step"] for e in evs if e["kind"] in ("incident", "probation_failed")] == [
        24,
        45,
        45,
        65,
    ]  # the last step done
    esc = evs[-1]
    assert esc["kind"] == "escalated" and "budget of 2 attempts spent" in esc["reason"]


def test_a_fault_recurring_at_the_same_step_fails_fast(ray_local, tmp_path, fail_at):
    fail_at(1, 30, "exit", gen="*")  # deterministic: every generation dies at step 30
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=60)
    assert run(job) == 3
    evs = events(Path(job.run_dir))
    assert [e["generation"] for e in evs if e["kind"] == "launch"] == [
        1,
        2,
    ]  # budget 2, only 1 spent
    esc = evs[-1]
    assert esc["kind"] == "escalated" and esc["fail_fast"] is True
    assert re.search(r"crash recurred at steps? 2[89].* on consecutive attempts", esc["reason"])


def test_a_sigstopped_rank_is_caught_by_heartbeat_and_killed(ray_local, tmp_path, fail_at):
    job = toy_job(
        tmp_path, policy=POLICY, steps=80, heartbeat_s=3, extra_args=["--step-sleep", "0.05"]
    )
    run_dir = Path(job.run_dir)
    stopped: list[int] = []

    def at_step_25(evs):
        return launch_of(evs, 1) and any(
            m.get("step", 0) >= 25 and m["rank"] == 1 for m in reports(run_dir)
        )

    def sigstop(evs):
        pid = launch_of(evs, 1)["pids"][1]  # the pid the agent launched, as journaled
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    w = When(run_dir, at_step_25, sigstop)
    assert run(job) == 0
    assert w.ok()
    evs = events(run_dir)
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "hang" and inc["first_heartbeat"] is False and inc["heartbeat_age_s"] >= 3
    assert (
        next(e for e in evs if e["kind"] == "kill")["duration_s"] < 10
    )  # SIGKILL works on stopped processes
    assert not alive(stopped[0])
    assert kinds(run_dir)[-1] == "completed"


def test_a_rank_that_never_sends_its_first_heartbeat_hits_the_first_heartbeat_timeout(
    ray_local, tmp_path, fail_at
):
    fail_at(1, 25, "exit")  # generation 1 crashes early...
    fail_at(1, 0, "stall_start", gen=2)  # ...and in generation 2 rank 1 never starts
    job = toy_job(
        # 20 s: a loaded 2-core machine can take over 12 s to start a healthy rank
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=60,
        heartbeat_s=3,
        first_heartbeat_s=20,
    )
    assert run(job) == 0
    evs = events(Path(job.run_dir))
    # generation 2's (on a loaded machine generation 1's crash may first read as a 3 s hang:
    # rank 0 waits in the all_reduce its dead peer never joins)
    gen2 = launch_of(evs, 2)["mono"]
    hang = next(
        e for e in evs if e["kind"] == "incident" and e["rule"] == "hang" and e["mono"] > gen2
    )
    assert hang["first_heartbeat"] is True and hang["timeout_s"] == 20
    assert hang["heartbeat_age_s"] >= 20  # not the 3 s heartbeat timeout
    assert hang["mono"] - launch_of(evs, 2)["mono"] >= 20
    assert hang["step"] == 21  # the step generation 2 was to start at (checkpoint 20 + 1), not -1
    assert [e["generation"] for e in evs if e["kind"] == "launch"] == [1, 2, 3]
    assert kinds(Path(job.run_dir))[-1] == "completed"


def test_a_slow_but_progressing_straggler_is_not_a_hang(ray_local, tmp_path, fail_at):
    fail_at(1, 0, "slow")  # rank 1 sleeps 0.7 s every step; rank 0 waits for it inside all_reduce
    job = toy_job(
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=12,
        heartbeat_s=2.0,
        extra_args=["--slow-sleep", "0.7"],
    )
    assert run(job) == 0
    run_dir = Path(job.run_dir)
    assert kinds(run_dir) == ["launch", "completed"]
    beats = [
        m["at"] for m in reports(run_dir) if m["rank"] == 1 and m["type"] in ("heartbeat", "report")
    ]
    assert beats[-1] - beats[0] > 3 * 2.0  # the run lasted several heartbeat timeouts...
    assert max(b - a for a, b in itertools.pairwise(beats)) > 0.6  # ...one slow step at a time


def test_one_rank_finishing_early_does_not_kill_the_job(ray_local, tmp_path, fail_at):
    fail_at(1, 20, "finish")  # rank 1 exits 0 at step 20; rank 0 trains on alone (no collectives)
    job = toy_job(
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=60,
        heartbeat_s=5,
        # rank 0 trains ~6 s alone: longer than rank 1's teardown on a loaded machine
        extra_args=["--step-sleep", "0.15"],
    )
    assert run(job) == 0
    run_dir = Path(job.run_dir)
    assert kinds(run_dir) == ["launch", "completed"]
    msgs = reports(run_dir)
    exit1 = next(m for m in msgs if m["type"] == "exit" and m["rank"] == 1)
    assert exit1["code"] == 0 and exit1["step"] == 19
    later = [
        m for m in msgs if m["rank"] == 0 and m["type"] == "heartbeat" and m["at"] > exit1["at"]
    ]
    assert later and later[-1]["step"] == 59  # rank 0 went on for seconds after rank 1 left
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "COMPLETED" and status["ranks"]["1"]["exit_code"] == 0


def test_garbage_on_the_report_socket_is_dropped_and_counted(ray_local, tmp_path, fail_at):
    fail_at(0, 10, "garbage")
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=40)
    assert run(job) == 0
    run_dir = Path(job.run_dir)
    assert kinds(run_dir) == [
        "launch",
        "completed",
    ]  # a NaN *string* is a wrong type, not an incident
    dropped = json.loads((run_dir / "status.json").read_text())["dropped"]
    assert dropped == {
        "malformed": 4,
        "bad_version": 1,
        "unknown_type": 1,
        "wrong_type": 2,
        "unknown_rank": 1,
        "stale_generation": 1,
        "oversize": 1,
    }


def test_a_crash_before_any_checkpoint_starts_over_instead_of_escalating(
    ray_local, tmp_path, fail_at
):
    fail_at(1, 8, "sigkill")  # the first checkpoint would be at step 20
    job = toy_job(tmp_path, policy="default", faults=fail_at, steps=40)
    assert run(job) == 0
    evs = events(Path(job.run_dir))
    rollback = next(e for e in evs if e["kind"] == "rollback")
    assert rollback["code"] == "restart_from_start" and rollback["checkpoint_step"] is None
    gen2 = launch_of(evs, 2)
    assert gen2["plan"]["checkpoint"] is None and gen2["lr_scale"] == 1.0
    assert min(m["step"] for m in reports(Path(job.run_dir)) if m["gen"] == 2) == 0
    assert [e["kind"] for e in evs][-1] == "completed"


def test_a_crash_rolls_back_to_the_newest_checkpoint_whatever_its_grade(
    ray_local, tmp_path, fail_at
):
    # the default policy asks numerical incidents for S4 and 200 steps back; a crash is not one
    fail_at(1, 45, "sigkill")
    job = toy_job(tmp_path, policy="default", faults=fail_at, steps=60)
    assert run(job) == 0
    evs = events(Path(job.run_dir))
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "crash"
    rollback = next(e for e in evs if e["kind"] == "rollback")
    assert rollback["checkpoint_step"] == 40 and "any grade" in rollback["reason"]
    assert launch_of(evs, 2)["plan"]["checkpoint_step"] == 40
    assert [e["kind"] for e in evs][-1] == "completed"
