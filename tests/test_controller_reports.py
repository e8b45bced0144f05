"""``reports.jsonl`` holds every rank message the supervisor received, in arrival order, even
when a decision on one message of a tick fences the generation: the rest of that tick (here the
steps a slower rank had queued, in its own poll) is accepted and recorded, not evaluated, and
ahead of what arrives while the kill waits for batch ids. (No Ray: a scripted group hands the
controller its polls.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import SpyEngine, scripted_controller
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll

POLICY = """
version: 1
name: spike
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 100, action: recover}
"""


def _line(gen: int, rank: int, step: int, loss: float, **kw: Any) -> bytes:
    msg = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": loss, **kw}).encode()


class LaggingGroup:
    """Tick 1: steps 0-4 from both ranks. Tick 2: rank 0 reaches step 10 with a loss of 1000
    (the rule fires on it); rank 1's poll, after it in the same tick, carries its queued steps
    5-9. While the kill waits for batch ids, rank 1 delivers steps 10-11 and its answer."""

    def __init__(self) -> None:
        self.gen = 0
        self.ticks = 0
        self.requested: dict[str, Any] | None = None
        self.killed = False

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(2)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        g = self.gen
        if self.requested is not None:  # the kill's wait for batch ids
            rid = self.requested["id"]
            answer = json.dumps(
                {"v": 1, "type": "batch_ids", "run": "t", "gen": g, "rank": 1, "step": 11}
                | {"t": 0.0, "request": rid, "ids": []}
            ).encode()
            lines = (_line(g, 1, 10, 2.0), _line(g, 1, 11, 2.0), answer)
            self.requested = None
            return [RankPoll(rank=1, generation=g, lines=lines)]
        if self.killed:
            return []
        self.ticks += 1
        if self.ticks == 1:
            steps = range(0, 5)
            return [
                RankPoll(rank=r, generation=g, lines=tuple(_line(g, r, s, 2.0) for s in steps))
                for r in range(2)
            ]
        if self.ticks == 2:
            rank0 = tuple(_line(g, 0, s, 2.0) for s in range(5, 10)) + (_line(g, 0, 10, 1000.0),)
            rank1 = tuple(_line(g, 1, s, 2.0) for s in range(5, 10))
            return [
                RankPoll(rank=0, generation=g, lines=rank0),
                RankPoll(rank=1, generation=g, lines=rank1),
            ]
        return []

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        self.requested = payload
        return 2

    def kill(self, grace_s: float = 0.0) -> KillReport:
        self.killed = True
        return KillReport(duration_s=0.0)


def test_a_fence_mid_poll_still_records_the_rest_of_the_poll_in_order(tmp_path: Path) -> None:
    spy = SpyEngine(POLICY)
    group = LaggingGroup()
    ctl = scripted_controller(tmp_path, group, spy, batch_ids_wait_s=0.5)
    ctl.step()
    ctl.step()  # rank 0's step 10 fires; the kill fences generation 1
    ctl.close()
    kinds = [json.loads(ln)["kind"] for ln in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert "incident" in kinds and "kill" in kinds, kinds

    recorded = [json.loads(ln) for ln in (tmp_path / "reports.jsonl").read_text().splitlines()]
    rank1 = [m["step"] for m in recorded if m["rank"] == 1 and m["type"] == "heartbeat"]
    assert rank1 == list(range(12))  # steps 5-9 (after the fence in their poll) are there, in order
    rank0 = [m["step"] for m in recorded if m["rank"] == 0]
    assert rank0 == list(range(11))
    # evaluated: everything up to and including the message that fired, nothing after it
    seen = [(m["rank"], m["step"]) for m in spy.seen]
    assert seen[-1] == (0, 10) and (1, 5) not in seen


class LockstepGroup:
    """Three ranks in lockstep, one step per tick; rank 2's loss is high from step 1 on."""

    def __init__(self) -> None:
        self.gen = 0
        self.step = -1

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(3)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        self.step += 1
        s, g = self.step, self.gen
        return [
            RankPoll(rank=r, generation=g, lines=(_line(g, r, s, 9.0 if r == 2 and s else 2.0),))
            for r in range(3)
        ]

    def kill(self, grace_s: float = 0.0) -> KillReport:
        return KillReport(duration_s=0.0)


def test_a_rank_whose_message_may_decide_is_evaluated_first_in_its_tick(tmp_path: Path) -> None:
    """From step 1 rank 2's loss may hold the rule (its value is above the threshold; then it
    is part-way through ``for:``; then it holds): its messages are evaluated before those of
    ranks 0 and 1 (quiet: their values cannot hold it), the rule fires on it first thing in its
    tick, and ``reports.jsonl`` records the order they were evaluated in (a replay decides the
    same)."""
    from spikeguard.policies import load_policy_text, replay

    policy = """
version: 1
name: spike
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 5, for: 2 steps, action: notify}
"""
    spy = SpyEngine(policy)
    ctl = scripted_controller(tmp_path, LockstepGroup(), spy, world_size=3)
    for _ in range(4):
        ctl.step()
    ctl.close()
    order = [(m["step"], m["rank"]) for m in spy.seen]
    assert order[:3] == [(0, 0), (0, 1), (0, 2)]  # every rank quiet: poll order
    assert order[3:6] == [(1, 2), (1, 0), (1, 1)]  # rank 2's value may hold the rule
    assert order[6:9] == [(2, 2), (2, 0), (2, 1)]  # part-way through for: (and it fires)
    assert order[9:12] == [(3, 2), (3, 0), (3, 1)]  # holding: its next message may resolve
    recorded = [json.loads(ln) for ln in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert [(m["step"], m["rank"]) for m in recorded] == order
    journal = [json.loads(ln) for ln in (tmp_path / "journal.jsonl").read_text().splitlines()]
    alerts = [e for e in journal if e["kind"] == "alert"]
    assert [(a["rank"], a["step"]) for a in alerts] == [(2, 2)]
    decided = replay(load_policy_text(policy), recorded)
    assert [(d.rank, d.step) for d in decided] == [(2, 2)]


def test_a_screen_that_fails_costs_the_order_not_the_supervisor(tmp_path: Path, capsys) -> None:
    """If the engine's screen raises, the tick is read in poll order and every decision is
    still made (it never decides anything itself)."""
    policy = """
version: 1
name: spike
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 5, for: 2 steps, action: notify}
"""
    spy = SpyEngine(policy)

    def broken(msgs: Any) -> bool:
        raise RuntimeError("screen bug")

    spy.quiet = broken  # type: ignore[method-assign]
    ctl = scripted_controller(tmp_path, LockstepGroup(), spy, world_size=3)
    for _ in range(4):
        ctl.step()
    ctl.close()
    order = [(m["step"], m["rank"]) for m in spy.seen]
    assert order[3:6] == [(1, 0), (1, 1), (1, 2)]  # poll order: nothing screened
    assert order[6] == (2, 2)  # still part-way through for: (pending comes before screening)
    journal = [json.loads(ln) for ln in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert [(a["rank"], a["step"]) for a in journal if a["kind"] == "alert"] == [(2, 2)]
    assert capsys.readouterr().out.count("screen failed") == 1
