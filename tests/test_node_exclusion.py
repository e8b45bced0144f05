"""Nodes left out of a run: the machine's exclusion decisions (pure), a journal fold that keeps
them, the controller carrying them out (a scripted group: every launch is told what to avoid),
and, on a real multi-node Ray (``ray.cluster_utils.Cluster``), a gang placed off an excluded
node, or on it when nothing else fits, saying so."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import SpyEngine, ray_cluster, scripted_controller
from spikeguard.supervisor.decide import health
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, Placement, RankPoll
from spikeguard.supervisor.observe.status import run_view

NODES = ("node-a", "node-b")


def _launched(gen: int, nodes: tuple[str, ...] = NODES, **kw: Any) -> rc.Launched:
    return rc.Launched(gen, nodes=nodes, **kw)


def _running() -> rc.State:
    """A run whose generation 1 trains on node-a (rank 0) and node-b (rank 1)."""
    st = rc.step(rc.State(), rc.Start()).state
    return rc.step(st, _launched(1)).state


def _recover(rule: str = "crash", fault: bool = True) -> rc.Recover:
    return rc.Recover(rule, "it fired", 5, rc.Settings(), fault=fault)


def _through_recovery(st: rc.State, recover: rc.Recover) -> tuple[rc.State, rc.Launch]:
    """Recover, killed, a checkpoint chosen: the relaunch the machine asks for."""
    st = rc.step(st, recover).state
    st = rc.step(st, rc.Killed((0, 1), 0.1)).state
    t = rc.step(st, rc.CheckpointChosen("/ck/5", step=4))
    (launch,) = [e for e in t.effects if isinstance(e, rc.Launch)]
    return t.state, launch


# ---- the machine -------------------------------------------------------------------------------
def test_a_suspect_rank_excludes_its_node_and_every_later_launch_avoids_it() -> None:
    st = _running()
    t = rc.step(st, rc.NodeSuspect(1, 1, "lost", "agent lost: node removed"))
    (ev,) = t.events
    assert ev["kind"] == "node_excluded" and ev["code"] == "node_lost"
    assert ev["node_id"] == "node-b" and ev["rank"] == 1 and ev["excluded"] == ["node-b"]
    assert "later launches are placed without it" in ev["reason"]
    st, launch = _through_recovery(t.state, _recover())
    assert launch.avoid == ("node-b",)
    # the relaunch's launch event names them; the exclusion outlives the incident
    t = rc.step(st, _launched(2, ("node-a", "node-c")))
    assert t.events[0]["excluded_nodes"] == ["node-b"]
    assert [e.node_id for e in t.state.excluded] == ["node-b"]


def test_a_launch_without_exclusions_avoids_nothing() -> None:
    _, launch = _through_recovery(_running(), _recover())
    assert launch.avoid == ()


@pytest.mark.parametrize(
    "suspect",
    [
        rc.NodeSuspect(1, 7, "lost", "a replaced generation's rank"),
        rc.NodeSuspect(5, 1, "lost", "no such rank"),
    ],
)
def test_a_suspect_of_another_generation_or_an_unknown_rank_changes_nothing(suspect) -> None:
    st = _running()
    t = rc.step(st, suspect)
    assert t.state == st and t.events == ()


def test_a_node_is_excluded_once_and_a_rank_on_an_unknown_node_not_at_all() -> None:
    st = rc.step(_running(), rc.NodeSuspect(0, 1, "unhealthy", "GPU lost")).state
    t = rc.step(st, rc.NodeSuspect(0, 1, "straggler", "slow"))
    assert t.state == st and t.events == ()
    unknown = rc.step(rc.step(rc.State(), rc.Start()).state, _launched(1, ("", ""))).state
    assert rc.step(unknown, rc.NodeSuspect(0, 1, "lost", "x")).state.excluded == ()


def test_a_launch_placed_on_excluded_nodes_after_all_says_so() -> None:
    st = rc.step(_running(), rc.NodeSuspect(1, 1, "lost", "gone")).state
    st, _ = _through_recovery(st, _recover())
    t = rc.step(st, _launched(2, NODES, unavoided="nothing else fits"))
    unplaced = t.events[-1]
    assert unplaced["kind"] == "node_excluded" and unplaced["code"] == "exclusion_unplaceable"
    assert unplaced["excluded"] == ["node-b"] and unplaced["placed_on"] == list(NODES)
    assert "nothing else fits" in unplaced["reason"]
    assert [e.node_id for e in t.state.excluded] == ["node-b"]  # still excluded next time


def test_the_journal_fold_keeps_the_exclusions() -> None:
    """Replaying the recorded observations (as a restarted supervisor does) gives back the
    excluded nodes and the rank -> node map, and the restart's relaunch avoids them."""
    journal: list[dict[str, Any]] = []
    st = rc.State()
    for obs in (
        rc.Start(),
        _launched(1),
        rc.NodeSuspect(0, 1, "unhealthy", "3 uncorrectable ECC errors"),
        rc.NodeSuspect(1, 1, "straggler", "rank 1 is slow"),
    ):
        t = rc.step(st, obs)
        st = t.state
        journal.extend(json.loads(json.dumps(e)) for e in t.events)
    folded = rc.fold(journal)
    assert folded == st
    assert [(e.node_id, e.cause) for e in folded.excluded] == [
        ("node-a", "unhealthy"),
        ("node-b", "straggler"),
    ]
    t = rc.step(folded, rc.Restarted(rc.Settings()))
    t = rc.step(t.state, rc.CheckpointChosen(None))
    (launch,) = [e for e in t.effects if isinstance(e, rc.Launch)]
    assert launch.avoid == ("node-a", "node-b")
    # `spikeguard status` (status.json, --json) shows them, with why
    view = run_view(folded)["excluded_nodes"]
    assert [(e["node_id"], e["cause"], e["rank"]) for e in view] == [
        ("node-a", "unhealthy", 0),
        ("node-b", "straggler", 1),
    ]
    assert view[0]["reason"] == "3 uncorrectable ECC errors"


# ---- what makes a node suspect (pure) ----------------------------------------------------------
@dataclasses.dataclass
class Decision:
    """The fields of a policy engine decision that the health rules read."""

    rule: str
    action: str
    rank: int | None
    signal: str | None
    reason: str = "fired"
    resolved: bool = False


def test_a_lost_agent_and_a_recovering_straggler_rule_make_their_ranks_suspect() -> None:
    lost = {"type": "exit", "rank": 1, "code": -9, "lost": "node removed"}
    assert health.suspects_of(lost, [], 3) == [
        rc.NodeSuspect(1, 3, "lost", "agent lost: node removed")
    ]
    beat = {"type": "heartbeat", "rank": 0}
    slow = Decision("straggler", "recover", 2, "step_time")
    (s,) = health.suspects_of(beat, [slow], 3)
    assert (s.rank, s.cause, s.generation) == (2, "straggler", 3)
    # a straggler rule that only notifies, one with no rank, another signal's: nothing
    others = [
        Decision("straggler", "notify", 2, "step_time"),
        Decision("straggler", "recover", None, "step_time"),
        Decision("loss", "recover", 2, "loss"),
    ]
    assert health.suspects_of(beat, others, 3) == []
    assert health.suspects_of({"type": "exit", "rank": 0, "code": 1}, [], 3) == []


def test_a_failed_health_check_is_a_lost_gpu_or_an_uncorrectable_ecc_error() -> None:
    ok = {"gpu_ecc_errors": 0, "gpu_xid": 79, "gpu_throttle": 0x40, "gpu_lost": False}
    assert health.health_failure(ok) is None  # throttling and XIDs are signals, not failures
    assert health.health_failure(None) is None
    assert "fell off the bus" in str(health.health_failure({**ok, "gpu_lost": True}))
    assert "2 uncorrectable ECC errors" in str(health.health_failure({**ok, "gpu_ecc_errors": 2}))
    polls = [
        RankPoll(rank=0, generation=4, health={**ok, "gpu_lost": True}),
        RankPoll(rank=1, generation=4, health=ok),
        RankPoll(rank=2, generation=3, health={**ok, "gpu_lost": True}),  # an older generation
        RankPoll(rank=3, generation=4),  # no NVML: nothing
    ]
    assert [(s.rank, s.cause) for s in health.health_suspects(polls, 4)] == [(0, "unhealthy")]


# ---- the controller carries it out (a scripted group, no Ray) ------------------------------------
POLICY = """
version: 1
name: slow
warm_in: 0 steps
rules:
  - {name: straggler, when: crash, action: recover}
"""


def _line(gen: int, rank: int, step: int, loss: float) -> bytes:
    """One heartbeat line of a rank."""
    msg = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": loss}).encode()


class StragglerEngine(SpyEngine):
    """The real engine, whose decisions read as a straggler rule's (signal ``step_time``): the
    rule of another helper, synthesised."""

    def observe(self, msg: dict[str, Any]) -> Any:
        return [dataclasses.replace(d, signal="step_time") for d in super().observe(msg)]


class TwoNodeGroup:
    """Two ranks, one per node of a four-node cluster, placed off whatever a launch avoids (all
    of them avoided: placed on the first two anyway, saying so). Generation 1: rank 0's GPU is
    lost at tick ``gpu_lost_at``; rank 1 ends at tick 3 (the rule fires on it)."""

    def __init__(self, gpu_lost_at: int | None = None, cluster: int = 4) -> None:
        self.gen, self.tick, self.avoids = 0, 0, []
        self.gpu_lost_at, self.cluster = gpu_lost_at, [f"n{i}" for i in range(cluster)]
        self.placement: Placement | None = None
        self.on: list[str] = []

    def launch(self, *, generation: int, avoid: tuple[str, ...] = (), **_: Any):
        self.gen, self.tick = generation, 0
        self.avoids.append(avoid)
        free = [n for n in self.cluster if n not in avoid]
        unavoided = None if len(free) >= 2 else "nothing else fits"
        self.on = free[:2] if len(free) >= 2 else self.cluster[:2]
        self.placement = Placement(avoid=avoid, unavoided=unavoided)
        return [
            LaunchedRank(
                rank=r, pid=1000 + r, generation=generation, report="-", port=1, node_id=self.on[r]
            )
            for r in range(2)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        self.tick += 1
        g, s = self.gen, self.tick
        ends = 1 if g == 1 and s == 3 else None
        sick = {"gpu_lost": True, "gpu_ecc_errors": 0} if s == self.gpu_lost_at and g == 1 else None
        return [
            RankPoll(rank=0, generation=g, lines=(_line(g, 0, s, 2.0),), health=sick),
            RankPoll(rank=1, generation=g, lines=(_line(g, 1, s, 2.0),), exit_code=ends),
        ]

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        return 0

    def kill(self, grace_s: float = 0.0) -> KillReport:
        return KillReport(duration_s=0.0)


def _journal(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run_dir / "journal.jsonl").read_text().splitlines()]


def test_the_controller_relaunches_off_a_straggler_and_an_unhealthy_node(tmp_path: Path) -> None:
    group = TwoNodeGroup(gpu_lost_at=2)
    ctl = scripted_controller(tmp_path, group, StragglerEngine(POLICY), batch_ids_wait_s=0)
    for _ in range(3):
        ctl.step()
    ctl.close()
    assert group.avoids == [(), ("n0", "n1")]  # rank 0's GPU was lost, rank 1 straggled
    evs = _journal(tmp_path)
    excluded = [e for e in evs if e["kind"] == "node_excluded"]
    assert [(e["node_id"], e["code"]) for e in excluded] == [
        ("n0", "node_unhealthy"),
        ("n1", "node_straggler"),
    ]
    kinds = [e["kind"] for e in evs]
    assert kinds.index("node_excluded") < kinds.index("incident")  # before the relaunch
    gen2 = [e for e in evs if e["kind"] == "launch"][-1]
    assert gen2["generation"] == 2 and {r["node_id"] for r in gen2["ranks"]} == {"n2", "n3"}
    assert [e.node_id for e in rc.fold(evs).excluded] == ["n0", "n1"]


def test_with_no_other_node_the_controller_relaunches_anyway_and_says_so(tmp_path: Path) -> None:
    group = TwoNodeGroup(gpu_lost_at=2, cluster=2)
    ctl = scripted_controller(tmp_path, group, StragglerEngine(POLICY), batch_ids_wait_s=0)
    for _ in range(3):
        ctl.step()
    ctl.close()
    assert group.avoids == [(), ("n0", "n1")] and ctl.state.generation == 2
    (said,) = [e for e in _journal(tmp_path) if e.get("code") == "exclusion_unplaceable"]
    assert said["generation"] == 2 and said["excluded"] == ["n0", "n1"]


# ---- a real multi-node Ray ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=3, num_cpus=1) as c:
        yield c


@pytest.mark.slow
def test_a_real_gang_is_placed_off_excluded_nodes_or_where_it_fits(cluster, tmp_path) -> None:
    """Three 1-CPU nodes, two ranks: generation 2 avoids a node of generation 1 and lands on the
    other two; with two of three nodes excluded nothing fits, so generation 3 is placed anyway
    (after the placement timeout) and the group says why."""
    from spikeguard.supervisor.launch.group import GroupSpec, WorkerGroup

    spec = GroupSpec(world_size=2, strategy="SPREAD", placement_timeout_s=3.0)
    group = WorkerGroup(spec, run_id="excl", run_dir=str(tmp_path))
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    args = dict(cmd=cmd, env={}, plan_path=None, fence_file=str(tmp_path / "FENCE"))
    args["ckpt_dir"] = str(tmp_path / "ck")
    try:
        gen1 = group.launch(generation=1, **args)
        on1 = [r.node_id for r in gen1]
        assert len(set(on1)) == 2 and group.placement == Placement()
        gen2 = group.launch(generation=2, avoid=(on1[1],), **args)
        on2 = {r.node_id for r in gen2}
        assert on1[1] not in on2 and len(on2) == 2
        assert group.placement == Placement(avoid=(on1[1],))
        both = tuple(sorted(on2))
        gen3 = group.launch(generation=3, avoid=both, **args)
        assert len(gen3) == 2 and group.placement is not None
        assert group.placement.avoid == both
        assert "off the 2 excluded node(s) within 3s" in str(group.placement.unavoided)
    finally:
        group.shutdown()


def test_a_decision_about_a_rank_names_its_node() -> None:
    from types import SimpleNamespace

    from spikeguard.supervisor.decide.observation import observation_of

    d = SimpleNamespace(
        rule="straggler",
        action="notify",
        severity="warn",
        signal="step_time",
        value=1.5,
        rank=1,
        layer=None,
        step=250,
        repeated=False,
        resolved=False,
        reason="rank 1: slow",
    )
    msg = {"type": "heartbeat", "rank": 1, "step": 250}
    obs = observation_of(d, msg, views={}, history=[], nodes=("node-a", "node-b"))
    assert isinstance(obs, rc.Notify) and obs.details["node_id"] == "node-b"
    unknown = observation_of(d, msg, views={}, history=[], nodes=("node-a", ""))
    assert "node_id" not in unknown.details
