"""The live view at scale: 64 ranks fit a few lines (the worst ranks, the pace, tokens/s, the ETA),
whatever the world size; ``spikeguard status --watch`` redraws it until the run ends."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.journal import Journal
from spikeguard.supervisor.observe.status import live_status
from spikeguard.supervisor.sinks.console import WORST_K, render_status

WORLD = 64
TOKENS = 512


def line(rank: int, step: int, **fields) -> str:
    msg = {"v": 1, "type": "heartbeat", "run": "r", "gen": 1, "rank": rank, "step": step, "t": 0}
    msg.update(loss=2.0, lr=1e-3, grad_norm=1.0, tokens=TOKENS, total_steps=1000)
    if "summary" in fields:
        msg.update(type="report", layers={}, summary=fields.pop("summary"))
    msg.update(fields)
    return json.dumps(msg)


def sixty_four_ranks() -> tuple[Collector, float]:
    """64 ranks through the real collector, 30 s of polls every 0.5 s: every rank 2 steps/s
    but rank 17, the straggler, at 1 step/s. Grades: S7 everywhere but ranks 5 (S2), 40 (S3)
    and 63 (S3, lower entropy); rank 9's loss is NaN, rank 30 crashed; rank 50 is silent."""
    c = Collector(world_size=WORLD, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    c.new_generation(1, now=0.0, start_step=100)
    now = 0.0
    for tick in range(61):
        now = tick * 0.5
        for r in range(WORLD):
            if r == 50 and now > 20:
                continue  # silent for the last 10 s
            step = 100 + (tick // 2 if r == 17 else tick)
            grade = {5: 2, 40: 3, 63: 3}.get(r, 7)
            ent = 0.1 if r == 63 else 0.5
            extra = {"loss": float("nan")} if r == 9 else {}
            c.ingest(
                r,
                line(r, step, summary={"grade": grade, "attn_entropy_min_norm": ent}, **extra),
                now,
            )
    c.exit(30, -9, 1, now)
    c.check_hangs(now)
    return c, now


def test_sixty_four_ranks_read_in_a_few_lines():
    c, _ = sixty_four_ranks()
    state = rc.State(phase=rc.Phase.RUNNING, generation=1)
    status = json.loads(json.dumps(live_status(state, c)))  # as status.json holds it
    text = render_status(status)
    lines = text.splitlines()
    assert len(lines) == 4 + WORST_K, text
    assert lines[2] == "  silent: r50 10 s"  # whatever its grade
    assert all(len(x) <= 100 for x in lines), text
    # the pace is the straggler's (1 step/s over the last 30 s), tokens/s is every rank's
    progress = lines[1]
    assert progress.startswith("  64 ranks · steps 130..160 (slowest r17)"), progress
    t = status["throughput"]
    assert t["steps_per_s"] == pytest.approx(1.0, rel=0.05)
    # 62 ranks at 2 steps/s, the straggler at 1, rank 50 silent for the last 10 s of the 30
    assert t["tokens_per_s"] == pytest.approx(TOKENS * (62 * 2 + 1 + 40 / 30), rel=0.02)
    # ETA: the slowest rank at step 130 of 0..999, one step a second
    assert t["last_step"] == 999 and t["eta_s"] == pytest.approx(869, rel=0.05)
    assert re.search(r"ETA 14 min \d+ s to step 999", progress), progress
    # the worst five: the crash, the NaN, then by grade, then by entropy
    shown = [int(m) for m in re.findall(r"^    r(\d+)", text, re.M)]
    assert shown == [30, 9, 5, 63, 40], text
    assert "exited -9" in text and "loss nan" in text
    assert "worst 5 of 64 ranks" in lines[3]


def test_the_silent_rank_and_the_rates_come_from_the_collector_s_clock():
    c, _ = sixty_four_ranks()
    status = live_status(rc.State(phase=rc.Phase.RUNNING), c)
    r50, r0 = status["ranks"][50], status["ranks"][0]
    assert r50["heartbeat_age_s"] == pytest.approx(10.0, abs=0.6)
    assert r0["heartbeat_age_s"] == 0.0
    assert r0["steps_per_s"] == pytest.approx(2.0, rel=0.05)
    assert r0["tokens_per_s"] == pytest.approx(2.0 * TOKENS, rel=0.05)
    assert status["ranks"][17]["steps_per_s"] == pytest.approx(1.0, rel=0.1)


def test_a_small_world_lists_every_rank():
    c = Collector(world_size=2, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    c.new_generation(1, now=0.0)
    for r in (0, 1):
        c.ingest(r, line(r, 5, summary={"grade": 6, "attn_entropy_min_norm": 0.4}), 1.0)
    text = render_status(live_status(rc.State(phase=rc.Phase.RUNNING, generation=1), c))
    assert text.splitlines()[2:] == [
        "    r0    step 5  S6  H_min/max 0.400  loss 2.000  heartbeat 0.0 s ago",
        "    r1    step 5  S6  H_min/max 0.400  loss 2.000  heartbeat 0.0 s ago",
    ]


def test_status_watch_redraws_until_the_run_ends(tmp_path, capsys):
    """A live run's journal (written by the real machine, its supervisor's lock held):
    ``--watch`` keeps drawing while it runs and returns once it completes."""
    from spikeguard.supervisor import rundir

    lock = rundir.acquire_lock(tmp_path)  # a supervisor runs it (status tells one that is gone)
    journal = Journal(tmp_path, run="r")
    state = rc.State()

    def apply(obs: rc.Observation) -> None:
        nonlocal state
        t = rc.step(state, obs)
        state = t.state
        for ev in t.events:
            journal.record(ev)

    apply(rc.Start(3))
    apply(rc.Launched(1))
    c = Collector(world_size=2, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    c.new_generation(1, now=0.0)
    for r in (0, 1):
        c.ingest(r, line(r, 7), 1.0)
    (tmp_path / "status.json").write_text(json.dumps(live_status(state, c)))

    def finish() -> None:
        time.sleep(0.7)
        apply(rc.Finished(1.5))

    t = threading.Thread(target=finish)
    t.start()
    assert main(["status", str(tmp_path), "--watch", "0.1"]) == 0
    t.join()
    journal.close()
    lock.close()
    views = capsys.readouterr().out.split("\n\n")
    assert len(views) >= 3, views  # redrawn while running
    assert views[0].startswith("RUNNING") and "2 ranks · step 7" in views[0]
    assert views[-1].startswith("COMPLETED")
    assert main(["status", str(tmp_path), "--watch", "0"]) == 2
