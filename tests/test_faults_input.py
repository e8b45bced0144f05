"""Hostile report lines through the whole loop: the controller keeps going, the policy engine
never sees a malformed message (no Ray: a fake group hands the controller its polls)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from conftest import SpyEngine, scripted_controller
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll

BIG = 10**400
# every rule reads a field a hostile line can poison: step, loss, the summary, one layer
POLICY = """
version: 1
name: hostile
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 100, action: notify}
  - {name: grade-low, when: grade < S1, action: notify}
  - {name: logit, when: max_logit > 1000, layers: "*", action: notify}
  - {name: world, when: loss > 100, ranks: {fraction: 0.5}, action: notify}
"""


def _hostile(gen: int, step: int) -> list[bytes]:
    def msg(**kw: Any) -> bytes:
        base = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": 0, "step": step}
        return json.dumps({**base, "t": 0.0, **kw}).encode()

    return [
        b'{"v":1,"x":' + b"[" * 5000 + b"]" * 5000 + b"}",
        msg(step=BIG),
        msg(loss=BIG),
        msg(type="report", summary={"grade": BIG}),
        msg(type="report", layers={"blocks.0": {"max_logit": BIG}}),
        msg(type="report", layers={"blocks.0": "not a dict"}),
        msg(type="dropped", count="x"),
        msg(type="hello", world_size=BIG),
        b"\xff" * 10,
    ]


class HostileGroup:
    """Rank 0 sends every hostile line before each good heartbeat; rank 1 is well behaved."""

    def __init__(self) -> None:
        self.gen = 0
        self.step = 0

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(2)
        ]

    def poll(self) -> list[RankPoll]:
        self.step += 1
        out = []
        for r in range(2):
            good = {"v": 1, "type": "heartbeat", "run": "t", "gen": self.gen, "rank": r}
            good.update(step=self.step, t=0.0, loss=2.0)
            lines = [json.dumps(good).encode()]
            if r == 0:
                lines = _hostile(self.gen, self.step) + lines
            out.append(RankPoll(rank=r, generation=self.gen, lines=tuple(lines)))
        return out

    def kill(self, grace_s: float = 0.0) -> KillReport:
        return KillReport(duration_s=0.0)


def _numbers(msg: dict[str, Any]) -> list[Any]:
    values = list(msg.values())
    for key in ("summary", "layers"):
        if isinstance(msg.get(key), dict):
            values += list(msg[key].values())
    for layer in (msg.get("layers") or {}).values():
        values += list(layer.values())
    return [v for v in values if isinstance(v, (int, float))]


def test_the_controller_survives_every_hostile_line_and_the_engine_sees_none(tmp_path: Path):
    spy = SpyEngine(POLICY)
    ctl = scripted_controller(tmp_path, HostileGroup(), spy)
    for _ in range(5):
        ctl.step()
    ctl.close()
    assert ctl.state.phase is rc.Phase.RUNNING
    assert ctl.collector.ranks[0].step == 5 and ctl.collector.ranks[1].step == 5
    assert [m["type"] for m in spy.seen] == ["heartbeat"] * 10  # only the good lines
    for msg in spy.seen:
        assert all(abs(x) <= 2**53 or not math.isfinite(x) for x in _numbers(msg))
    assert ctl.collector.dropped == {"malformed": 10, "out_of_range": 25, "wrong_type": 10}
