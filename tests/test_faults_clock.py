"""Time: hang detection runs on monotonic clocks only; a wall-clock jump never fires it (no Ray)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import events, kinds, scripted_controller
from spikeguard.policies import Engine, load_policy
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll

POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


class FakeGroup:
    """Two ranks that heartbeat whenever polled (``silent`` ranks say nothing)."""

    def __init__(self) -> None:
        self.gen = 0
        self.step = 0
        self.silent: set[int] = set()
        self.killed = 0

    def launch(self, *, generation, **_):
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(2)
        ]

    def poll(self):
        self.step += 1
        out = []
        for r in range(2):
            lines = (
                []
                if r in self.silent
                else [
                    json.dumps(
                        {
                            "v": 1,
                            "type": "heartbeat",
                            "run": "t",
                            "gen": self.gen,
                            "rank": r,
                            "step": self.step,
                            "t": time.time(),
                            "loss": 2.0,
                        }
                    ).encode()
                ]
            )
            out.append(RankPoll(rank=r, generation=self.gen, lines=tuple(lines)))
        return out

    def kill(self, grace_s=0.0):
        self.killed += 1
        return KillReport(duration_s=0.0)

    def request(self, payload):
        return 0  # these ranks only heartbeat: no rank can take a request (batch ids)


def test_collector_hangs_depend_only_on_the_time_passed_in():
    c = Collector(world_size=1, hang_timeout_s=5, first_heartbeat_timeout_s=50)
    c.new_generation(1, now=100.0)
    c.ingest(
        0,
        json.dumps(
            {"v": 1, "type": "heartbeat", "run": "t", "gen": 1, "rank": 0, "step": 0, "t": 9e12}
        ).encode(),
        now=101.0,
    )  # the rank's own clock is absurd: ignored
    assert c.check_hangs(105.9) == []
    assert [m["type"] for m in c.check_hangs(106.1)] == ["hang"]


def test_a_wall_clock_jump_does_not_fire_a_hang_but_monotonic_time_does(tmp_path, monkeypatch):
    group = FakeGroup()
    engine = Engine(load_policy(str(POLICY)))
    ctl = scripted_controller(tmp_path, group, engine, hang_timeout_s=5.0)
    ctl.step()
    real_time = time.time
    group.silent = {1}  # rank 1 goes quiet...
    monkeypatch.setattr(
        time, "time", lambda: real_time() + 10 * 3600
    )  # ...while NTP jumps 10 h ahead
    for _ in range(5):
        ctl.step()
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)  # and back an hour
    ctl.step()
    assert "incident" not in kinds(tmp_path) and group.killed == 0
    # the monotonic clock is what counts: 6 s of it without a message is a hang
    real_mono = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() + 6.0)
    ctl.step()
    inc = next(e for e in events(tmp_path) if e["kind"] == "incident")
    assert inc["rule"] == "hang" and inc["rank"] == 1 and inc["first_heartbeat"] is False
    ctl.close()
