"""A batch-ids file that cannot be written (a full disk, an unwritable ``incidents/``) costs the
incident its forensics, never its recovery: the kill, the rollback choice and the relaunch go on,
and the ``forensics`` event says no file was stored. (No Ray: a scripted group.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import SpyEngine, scripted_controller
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll

POLICY = """
version: 1
name: spike
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 100, action: recover}
"""


def _line(gen: int, rank: int, step: int, loss: float) -> bytes:
    msg = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": loss}).encode()


class AnsweringGroup:
    """Tick 1: steps 0-4 from both ranks; tick 2: rank 0's loss 1000 at step 5. Asked for batch
    ids, both ranks answer with the ids of steps 3-5 (6 batches)."""

    def __init__(self) -> None:
        self.gen = 0
        self.ticks = 0
        self.requested: dict[str, Any] | None = None
        self.killed = False

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen, self.ticks, self.killed = generation, 0, False
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(2)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        g = self.gen
        if self.requested is not None:
            rid, self.requested = self.requested["id"], None
            return [
                RankPoll(
                    rank=r,
                    generation=g,
                    lines=(
                        json.dumps(
                            {"v": 1, "type": "batch_ids", "run": "t", "gen": g, "rank": r}
                            | {"step": 5, "t": 0.0, "request": rid, "window": 200}
                            | {"truncated": 0, "entries": [[s, [s, r]] for s in (3, 4, 5)]}
                        ).encode(),
                    ),
                )
                for r in range(2)
            ]
        if self.killed:
            return []
        self.ticks += 1
        if self.ticks == 1:
            return [
                RankPoll(rank=r, generation=g, lines=tuple(_line(g, r, s, 2.0) for s in range(5)))
                for r in range(2)
            ]
        if self.ticks == 2:
            return [RankPoll(rank=0, generation=g, lines=(_line(g, 0, 5, 1000.0),))]
        return []

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        if payload.get("type") == "batch_ids":
            self.requested = payload
        return 2

    def kill(self, grace_s: float = 0.0) -> KillReport:
        self.killed = True
        return KillReport(duration_s=0.0)


def test_an_unwritable_batch_ids_file_does_not_stop_the_recovery(tmp_path: Path) -> None:
    (tmp_path / "incidents").write_text("")  # a file where the directory must go: mkdir fails
    group = AnsweringGroup()
    ctl = scripted_controller(tmp_path, group, SpyEngine(POLICY), batch_ids_wait_s=2.0)
    try:
        for _ in range(20):
            ctl.step()
            if ctl.state.phase in rc.EXITS:
                break
    finally:
        ctl.close()
    evs = [json.loads(ln) for ln in (tmp_path / "journal.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in evs]
    # the recovery went on past the kill to its checkpoint choice (none here: it escalates as
    # any numerical incident without a healthy checkpoint does), never the unwritable stop
    assert kinds[:5] == ["launch", "incident", "forensics", "kill", "rollback"], kinds
    assert ctl.state.exit_code != 143 and not any(e["kind"] == "alert" for e in evs), kinds
    forensics = evs[2]
    assert forensics["path"] is None and forensics["batches"] == 6
