"""Accelerator health as policy signals: the rank agent's NVML readings (``gpu_xid``,
``gpu_ecc_errors``, ``gpu_throttle_thermal``, ``gpu_throttle_power``, ``gpu_lost``) reach the
policy engine in ``health`` messages the supervisor makes from each poll, are recorded in
``reports.jsonl`` (so a replay decides the same), and a rule on them warns (the built-ins'
``gpu-xid``, ``gpu-thermal``) or recovers off the node. Without NVML (every CPU machine) no poll
carries a reading, no ``health`` message is made and nothing fires. The GPUs are a fake (none
here): the readings a real :class:`~spikeguard.supervisor.launch.nvml.NvmlReader` would make,
in a poll."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SpyEngine, scripted_controller
from spikeguard.policies import BUILTINS, PolicyError, load_policy, load_policy_text, replay
from spikeguard.policies.testing import heartbeat, hello
from spikeguard.supervisor.intake.collector import HEALTH_REPEAT_S, Collector
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, Placement, RankPoll
from spikeguard.supervisor.launch.nvml import GpuReading, signals_of
from spikeguard.workers.contract import AGENT_SIGNALS


def health(rank: int, step: int) -> dict[str, Any]:
    """The supervisor's ``health`` message for ``rank`` at its latest ``step``."""
    return {"v": 1, "type": "health", "gen": 0, "rank": rank, "step": step, "at": float(step)}


def test_the_agents_readings_are_the_policy_signals() -> None:
    """What the NVML reader makes of its readings, all of it that the policy language reads."""
    reading = signals_of(
        [
            GpuReading(gpu="0", ecc_uncorrected=2, throttle=0x20, xids=(79,)),
            GpuReading(gpu="1", lost=True),
        ]
    )
    assert reading is not None and set(AGENT_SIGNALS) <= set(reading)


@pytest.mark.parametrize("name", BUILTINS)
def test_the_builtins_warn_on_a_critical_xid_and_on_thermal_throttling(name: str) -> None:
    pol = load_policy(name)
    msgs: list[dict[str, Any]] = [hello(r, world_size=2) for r in range(2)]
    for s in range(1, 400):
        msgs += [heartbeat(r, s) for r in range(2)]
        if s % 50 == 0:  # the agent's readings, every few seconds
            msgs += [
                {**health(0, s), "gpu_xid": 79.0 if s == 200 else 0.0, "gpu_throttle_thermal": 0.0},
                {**health(1, s), "gpu_xid": 0.0, "gpu_throttle_thermal": float(s >= 300)},
            ]
    fired = [(d.rule, d.rank, d.step) for d in replay(pol, msgs) if not d.resolved]
    # two rules: a rank throttling never mutes another rank's XID (a cooldown is a rule's)
    assert fired == [("gpu-xid", 0, 200), ("gpu-thermal", 1, 300)], fired
    d = next(d for d in replay(pol, msgs) if d.rule == "gpu-xid")
    assert d.action == "notify" and d.severity == "warn" and "gpu_xid 79" in d.reason, d.reason
    # without NVML: no health message, nothing of the kind
    quiet = [m for m in msgs if m["type"] != "health"]
    assert [d for d in replay(pol, quiet) if d.rule.startswith("gpu-")] == []


@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_an_xid_read_once_is_seen_whichever_message_of_the_step_carries_it(at: int) -> None:
    """A poll every 0.25 s makes several health messages a step (the same step), or many while a
    rank is stuck at one step: the one that carries the XID is evaluated, wherever it comes."""
    msgs: list[dict[str, Any]] = [hello(0, world_size=1)]
    for s in range(1, 30):
        msgs.append(heartbeat(0, s))
        for k in range(4):
            msgs.append({**health(0, s), "gpu_xid": 79.0 if (s, k) == (20, at) else 0.0})
    fired = [(d.rule, d.step) for d in replay(load_policy("default"), msgs) if not d.resolved]
    assert fired == [("gpu-xid", 20)], fired


def test_a_gpu_signal_cannot_be_combined_with_a_step_signal_or_compared_with_peers() -> None:
    base = "version: 1\nname: p\nrules:\n  - name: r\n    when: {w}\n    action: notify\n"
    with pytest.raises(PolicyError, match="never arrive together"):
        load_policy_text(
            base.format(w="{all: [{signal: loss, above: 3}, {signal: gpu_xid, above: 0}]}"),
            "p.yaml",
        )
    with pytest.raises(PolicyError, match="a reading of the agent"):
        load_policy_text(base.format(w="{signal: gpu_xid, above_peer_median: 1.5}"), "p.yaml")
    load_policy_text(
        base.format(w="{any: [{signal: loss, above: 3}, {signal: gpu_xid, above: 0}]}"), "p.yaml"
    )


def test_the_collector_makes_health_messages_of_its_generations_readings_only() -> None:
    c = Collector(world_size=2, hang_timeout_s=60, first_heartbeat_timeout_s=60)
    c.new_generation(3, now=0.0)
    line = {"v": 1, "type": "heartbeat", "run": "t", "gen": 3, "rank": 0, "step": 17, "t": 0.0}
    c.ingest(0, json.dumps({**line, "loss": 2.0}).encode(), now=1.0)
    reading = {"gpu_xid": 79, "gpu_lost": True, "gpu_throttle": 0x40, "gpu_ecc_errors": None}
    polls = [
        RankPoll(rank=0, generation=3, health=reading),
        RankPoll(rank=1, generation=3, health=None),  # no NVML on its node
        RankPoll(rank=1, generation=-1, health=reading),  # a standby's
        RankPoll(rank=0, generation=2, health=reading),  # an old generation's
    ]
    (msg,) = c.health_messages(polls, now=5.0)
    assert msg["type"] == "health" and (msg["gen"], msg["rank"], msg["step"]) == (3, 0, 17)
    assert (msg["gpu_xid"], msg["gpu_lost"]) == (79.0, 1.0)
    assert "gpu_ecc_errors" not in msg and "gpu_throttle" not in msg  # unread; not a signal
    assert c.health_messages([RankPoll(rank=0, generation=3)], now=6.0) == []
    # the same reading again (polls come every 0.25 s, NVML is read every 5 s): no new line,
    # until it changes or HEALTH_REPEAT_S passed
    again = [RankPoll(rank=0, generation=3, health=reading)]
    assert c.health_messages(again, now=5.25) == []
    assert c.health_messages(again, now=5.0 + HEALTH_REPEAT_S)[0]["gpu_xid"] == 79.0
    changed = [RankPoll(rank=0, generation=3, health={**reading, "gpu_xid": 0})]
    assert c.health_messages(changed, now=40.0)[0]["gpu_xid"] == 0.0


# ---- the controller: recorded, replayed, and a recover rule leaves the node out -------------
RECOVER = """\
version: 1
name: gpu-recovers
rules:
  - name: xid
    when: gpu_xid > 0
    action: recover
    recovery: {lr_factors: [1.0], reset_optimizer: false}
"""


def _line(gen: int, rank: int, step: int) -> bytes:
    msg = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": 2.0}).encode()


class XidGroup:
    """Two ranks on nodes n0, n1 of a four-node cluster, placed off what a launch avoids;
    generation 1: rank 1's GPU reports XID 79 at tick 3."""

    def __init__(self) -> None:
        self.gen, self.tick, self.avoids = 0, 0, []
        self.cluster = ["n0", "n1", "n2", "n3"]
        self.placement: Placement | None = None

    def launch(self, *, generation: int, avoid: tuple[str, ...] = (), **_: Any):
        self.gen, self.tick = generation, 0
        self.avoids.append(avoid)
        on = [n for n in self.cluster if n not in avoid][:2]
        self.placement = Placement(avoid=avoid)
        return [
            LaunchedRank(
                rank=r, pid=1000 + r, generation=generation, report="-", port=1, node_id=on[r]
            )
            for r in range(2)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        self.tick += 1
        g, s = self.gen, self.tick
        xid = 79 if (g, s) == (1, 3) else 0
        return [
            RankPoll(
                rank=r,
                generation=g,
                lines=(_line(g, r, s),),
                health=signals_of([GpuReading(gpu=str(r), xids=(xid,) if xid and r == 1 else ())]),
            )
            for r in range(2)
        ]

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        return 0

    def kill(self, grace_s: float = 0.0) -> KillReport:
        return KillReport(duration_s=0.0)


def test_a_recovering_gpu_rule_relaunches_off_the_node_and_the_run_replays(tmp_path: Path) -> None:
    pol = load_policy_text(RECOVER, "gpu.yaml")
    group = XidGroup()
    ctl = scripted_controller(tmp_path, group, SpyEngine(RECOVER), batch_ids_wait_s=0)
    for _ in range(4):
        ctl.step()
    ctl.close()
    evs = [json.loads(ln) for ln in (tmp_path / "journal.jsonl").read_text().splitlines()]
    inc = next(e for e in evs if e["kind"] == "incident")
    assert (inc["rule"], inc["rank"]) == ("xid", 1), inc
    excluded = [(e["node_id"], e["code"]) for e in evs if e["kind"] == "node_excluded"]
    assert excluded == [("n1", "node_unhealthy")], excluded
    assert group.avoids == [(), ("n1",)]
    # recorded: a replay of reports.jsonl makes the same decision
    recorded = [json.loads(ln) for ln in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert any(m["type"] == "health" and m.get("gpu_xid") == 79.0 for m in recorded)
    assert [(d.rule, d.rank) for d in replay(pol, recorded)][:1] == [("xid", 1)]
