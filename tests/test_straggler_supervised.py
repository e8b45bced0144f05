"""A straggler under ``spikeguard``, end to end: real Ray, real gloo ranks, the real policies.

From step ``SLOW_FROM`` one rank's model forward is slower by half a step, inside the model (the
toy script's ``straggle`` fault: its last block sleeps half the median of the rank's own steps).
Its peers then wait in the gradient all-reduce, so every rank steps at the same pace; only the
ranks' own compute time (``step_time``) tells them apart.

* Two ranks under the built-in ``default`` policy: its ``straggler`` rule warns within its window
  (50 steps of a 5-step median at 1.3x the peers'), naming the rank and its host; nothing is
  killed. The same run without a slow rank raises nothing at all.
* Four ranks on a two-node ``ray.cluster_utils.Cluster`` (4 logical CPUs per node, spread 2 + 2)
  under a policy whose straggler rule recovers: the rank's node is excluded, and the relaunch
  (from the newest checkpoint, at the same LR: a slow node is not a numerical fault) puts all
  four ranks on the other node; the run completes there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_journal_replays, events, launch_of, ray_cluster, toy_job

pytestmark = pytest.mark.slow

SLOW_FROM = 40
FOR_STEPS = 50  # the built-in rule's ``for``
MEDIAN_OF = 5  # ... and its ``median_of``
SLACK = 15
"""Steps the firing may come after the earliest step it can (a noisy step resets ``for``); far
less than another window."""
STEPS = SLOW_FROM + FOR_STEPS + MEDIAN_OF + SLACK + 40
PACE = ["--step-sleep", "0.05"]
"""Steps of ~50 ms, as a real job's are long beside its scheduling noise (a millisecond on a 3 ms
forward is 1.3×): the built-in rule weighs what a slow rank costs a step, so a loaded machine's
noise is not a straggler and half a step is."""

TOY_POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"
RECOVER_POLICY = TOY_POLICY.read_text().replace(
    "rules:\n",
    """rules:
  - name: straggler
    when: {signal: step_time, above_peer_median: 1.3, min_step_share: 0.05, median_of: 5 steps}
    for: 50 steps
    action: recover
    recovery: {lr_factors: [1.0], reset_optimizer: false, skip_window: 0}
""",
    1,
)
"""The tests' toy policy (its crash and hang rules, no warm-in) with a straggler rule that
recovers."""


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


def alerts(evs: list[dict[str, Any]], rule: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == "alert" and e.get("rule") == rule]


def hosts(run_dir: Path) -> dict[int, str]:
    """Rank -> host, from the ranks' hello lines."""
    from conftest import reports

    return {m["rank"]: m["host"] for m in reports(run_dir) if m["type"] == "hello" and "host" in m}


def test_the_default_policy_names_a_straggling_rank_within_its_window(ray_local, tmp_path, fail_at):
    fail_at(1, SLOW_FROM, "straggle")
    job = toy_job(tmp_path, policy="default", faults=fail_at, steps=STEPS, extra_args=PACE)
    assert run(job) == 0
    evs = events(job.run_dir)
    fired = alerts(evs, "straggler")
    assert [(e["code"], e["rank"]) for e in fired if not e.get("resolved")][:1] == [
        ("rule_notify", 1)
    ], fired
    first = fired[0]
    # within the rule's window: after the rank slowed down, and well before a second window
    # (it may hold a few steps early: a noisy stretch just before the slowdown joins its streak)
    assert SLOW_FROM < first["step"] <= SLOW_FROM + FOR_STEPS + MEDIAN_OF + SLACK
    ratio = re.search(r"is ([0-9.]+)× the median", first["reason"])
    assert first["signal"] == "step_time" and ratio and float(ratio[1]) >= 1.3, first["reason"]
    host = hosts(Path(job.run_dir))[1]
    assert "rank 1" in first["reason"] and host in first["reason"], first["reason"]
    assert first.get("node_id"), first  # the node it runs on, for the operator
    # a warning: nothing killed, one generation, the run completed
    assert not [e for e in evs if e["kind"] in ("incident", "kill")], [e["kind"] for e in evs]
    assert evs[-1]["kind"] == "completed"
    assert_journal_replays(Path(job.run_dir) / "journal.jsonl")


def test_without_a_slow_rank_the_default_policy_raises_nothing(ray_local, tmp_path):
    job = toy_job(tmp_path, policy="default", steps=STEPS, extra_args=PACE)
    assert run(job) == 0
    evs = events(job.run_dir)
    assert not [e for e in evs if e["kind"] in ("alert", "incident", "kill")], evs
    assert evs[-1]["kind"] == "completed"


# ---- four ranks on two nodes, a policy that recovers ------------------------------------------
@pytest.fixture(scope="module")
def two_nodes():
    with ray_cluster(nodes=2, num_cpus=4) as c:
        yield c


def test_a_recovering_straggler_rule_relaunches_the_ranks_off_the_slow_node(
    two_nodes, tmp_path, fail_at
):
    policy = tmp_path / "policy.yaml"
    policy.write_text(RECOVER_POLICY)
    fail_at(1, SLOW_FROM, "straggle")  # generation 1 only: the slowness is its node's
    job = toy_job(
        tmp_path,
        policy=policy,
        faults=fail_at,
        workers=4,
        steps=STEPS,
        extra_args=PACE,
        placement={"strategy": "SPREAD", "timeout_s": 120},
    )
    assert run(job) == 0
    evs = events(job.run_dir)
    gen1 = launch_of(evs, 1)
    on1 = [r["node_id"] for r in gen1["ranks"]]
    assert len(set(on1)) == 2, on1  # spread over both nodes
    inc = next(e for e in evs if e["kind"] == "incident")
    assert (inc["rule"], inc["rank"]) == ("straggler", 1), inc
    assert SLOW_FROM < inc["step"] <= SLOW_FROM + FOR_STEPS + MEDIAN_OF + SLACK
    excluded = [e for e in evs if e["kind"] == "node_excluded"]
    assert [e["node_id"] for e in excluded] == [on1[1]], excluded
    # a slow node is not a numerical fault: the newest checkpoint, the same LR
    rb = next(e for e in evs if e["kind"] == "rollback")
    assert inc["step"] - rb["checkpoint_step"] <= 20 + 1, (rb, inc)  # the toy saves every 20
    assert not [e for e in evs if e["kind"] == "lr_cut" and e.get("factor", 1.0) != 1.0]
    gen2 = launch_of(evs, 2)
    assert gen2 is not None and {r["node_id"] for r in gen2["ranks"]} == {on1[0]}, gen2
    assert evs[-1]["kind"] == "completed"
    assert_journal_replays(Path(job.run_dir) / "journal.jsonl")
