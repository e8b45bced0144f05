"""Warm standby on a real local Ray with real gloo ranks (the job's ``standby: true``).

While generation 1 trains, generation 2's processes are started and wait in ``resume()``; the
recovery releases them (the same pids train generation 2, from the chosen checkpoint, at the cut
LR with fresh optimizer state, asserted from what the resumed ranks report). A standby that dies
while waiting is replaced; one whose generation will not come is discarded; none outlives the run.

Every run holds its ranks before the injected collapse (``--hold-at``) until the journal says the
standby is ready, so the recovery meets a waiting standby whatever the machine's speed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import When, alive, events, launch_of, reports, toy_job

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


def standby_events(evs: list[dict], code: str | None = None) -> list[dict]:
    return [e for e in evs if e["kind"] == "standby" and (code is None or e["code"] == code)]


def held_job(tmp_path: Path, fail_at, hold: Path):
    fail_at(0, 32, "collapse")  # generation 1 only
    return toy_job(
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=60,
        extra_args=["--hold-at", "30", "--hold-file", str(hold)],
        standby=True,
        # a held rank sends no heartbeat: on a loaded machine a replacement standby can take
        # longer than the usual 30 s to import torch, and the hold must not read as a hang
        heartbeat_s=600.0,
    )


def check_released(run_dir: Path, standby: dict) -> None:
    """Generation 2 is the standby that was ready, resumed as the recovery decided."""
    evs = events(run_dir)
    gen2 = launch_of(evs, 2)
    assert gen2 is not None and all(r["standby"] for r in gen2["ranks"]), gen2
    assert [r["pid"] for r in gen2["ranks"]] == standby["pids"]  # the same processes
    assert gen2["port"] == standby["port"]
    rb = next(e for e in evs if e["kind"] == "rollback")
    msgs = [m for m in reports(run_dir) if m["gen"] == 2]
    resumed = [m for m in msgs if m["type"] == "resumed"]
    assert {m["rank"] for m in resumed} == {0, 1}
    for m in resumed:
        assert m["from_step"] == rb["checkpoint_step"] + 1
        assert m["checkpoint"] == rb["checkpoint_path"]
        assert m["lr_scale"] == pytest.approx(0.5) and m["optimizer_reset"] is True
        assert m["standby_wait_s"] > 0  # it waited in resume() for its release
    first = min(
        (m for m in msgs if m["type"] in ("heartbeat", "report") and m["rank"] == 0),
        key=lambda m: m["step"],
    )
    assert first["step"] == rb["checkpoint_step"] + 1
    assert first["extra"]["adam_steps"] == 1  # fresh optimizer state, one step taken


def test_a_recovery_releases_the_waiting_standby(ray_local, tmp_path, fail_at):
    hold = tmp_path / "go"
    job = held_job(tmp_path, fail_at, hold)
    run_dir = Path(job.run_dir)
    w = When(run_dir, lambda evs: standby_events(evs, "standby_ready"), lambda evs: hold.touch())
    assert run(job) == 0
    assert w.ok()
    evs = events(run_dir)
    started = standby_events(evs, "standby_started")
    assert started[0]["generation"] == 2
    ready = standby_events(evs, "standby_ready")[0]
    inc = next(e for e in evs if e["kind"] == "incident")
    assert started[0]["seq"] < ready["seq"] < inc["seq"]
    check_released(run_dir, started[0])
    assert evs[-1]["kind"] == "completed"
    # a standby of generation 3 may have been started for the rest of the run: gone with it
    for e in started:
        assert not any(alive(pid) for pid in e["pids"]), e


def test_a_standby_that_dies_while_waiting_is_replaced_and_the_replacement_released(
    ray_local, tmp_path, fail_at
):
    hold = tmp_path / "go"
    job = held_job(tmp_path, fail_at, hold)
    run_dir = Path(job.run_dir)
    first: dict = {}

    def kill_one(evs):
        first.update(standby_events(evs, "standby_started")[0])
        os.kill(first["pids"][1], signal.SIGKILL)

    w1 = When(run_dir, lambda evs: standby_events(evs, "standby_ready"), kill_one)
    w2 = When(
        run_dir,
        lambda evs: len(standby_events(evs, "standby_ready")) >= 2,
        lambda evs: hold.touch(),
    )
    assert run(job) == 0
    assert w1.ok() and w2.ok()
    evs = events(run_dir)
    lost = standby_events(evs, "standby_lost")
    assert lost and lost[0]["rank"] == 1 and lost[0]["exit_code"] == -9
    started = standby_events(evs, "standby_started")
    assert [e["generation"] for e in started[:2]] == [2, 2]
    replacement = started[1]
    assert not set(replacement["pids"]) & set(first["pids"])
    assert not any(alive(pid) for pid in first["pids"])  # rank 0's survivor was killed too
    check_released(run_dir, replacement)
    assert evs[-1]["kind"] == "completed"


def test_a_standby_of_a_generation_that_will_not_come_is_discarded(ray_local, tmp_path):
    """The group, driven as the controller drives it: a standby of generation 2 is ready, then
    generation 3 is the next one (a launch failure took 2): the standby is discarded (its
    processes killed) and generation 3 starts cold; a release of the wrong generation never
    happens."""
    import time

    from spikeguard.supervisor.launch.group import GroupSpec, WorkerGroup, python_cmd

    scripts = Path(__file__).parent / "scripts"
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    fence = run_dir / "FENCE"
    fence.write_text("1")
    group = WorkerGroup(GroupSpec(world_size=2), run_id="discard", run_dir=str(run_dir))
    cmd = python_cmd(str(scripts / "toy_rank.py"), ["--steps", "400", "--step-sleep", "0.05"])
    common = dict(cmd=cmd, env={}, fence_file=str(fence), ckpt_dir=str(run_dir / "checkpoints"))
    try:
        group.start()
        group.launch(generation=1, plan_path=None, **common)
        change = group.standby(generation=2, **common)
        assert change is not None and change.what == "started"
        standby_pids = change.pids
        end = time.monotonic() + 120
        while (c := group.standby(generation=2, **common)) is None or c.what != "ready":
            assert time.monotonic() < end, "the standby never got ready"
            group.poll()
            time.sleep(0.2)
        fence.write_text("3")
        change = group.standby(generation=3, **common)
        assert change is not None and change.what == "discarded" and change.generation == 2
        assert not any(alive(pid) for pid in standby_pids)
        gen3 = group.launch(generation=3, plan_path=None, **common)
        assert not any(r.standby for r in gen3)  # cold: no standby of generation 3 existed
        assert not set(standby_pids) & {r.pid for r in gen3}
    finally:
        group.shutdown()
