"""Node faults on a real multi-node Ray (``ray.cluster_utils.Cluster``: one head, three 1-CPU worker
nodes, all processes on this machine): a node removed, and a node frozen whose rank outlives its
generation.

The head has no CPUs, so ranks only land on worker nodes; the supervisor (this test process, the
driver) runs on the head. Ray's node health check is tightened here (dead after ~3-4 s instead of
its default ~60 s, see "Failure semantics" in the README) so the frozen-node test takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import When, alive, events, kinds, launch_of, reports, toy_job

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"
MB80 = 80 * 1024 * 1024
HEALTH = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
    "health_check_timeout_ms": 500,
    "health_check_initial_delay_ms": 0,
}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the session's single-node Ray; conftest.ray_local restarts it on demand
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": MB80, "_system_config": HEALTH},
    )
    for _ in range(3):
        c.add_node(num_cpus=1, object_store_memory=MB80)
    ray.init(
        address=c.address,
        include_dashboard=False,
        log_to_driver=False,
        namespace="spikeguard-tests",
    )
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def nodes(cluster):
    """The cluster with three live worker nodes (a node lost by an earlier test is replaced
    first)."""
    import ray

    alive_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for node in cluster.worker_nodes.copy():  # one Ray declared dead (frozen) is let go of
        if node.node_id not in alive_ids:
            cluster.remove_node(node, allow_graceful=False)
    live = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))
    for _ in range(3 - live):
        cluster.add_node(
            num_cpus=1, object_store_memory=MB80
        )  # (Ray starts nodes from the main thread only)
    cluster.wait_for_nodes()
    return cluster


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


def node_of(cluster, node_id: str):
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except OSError:
        return "gone"


def past_step(run_dir: Path, step: int):
    return lambda evs: (
        launch_of(evs, 1) and any(m.get("step", -1) >= step for m in reports(run_dir))
    )


def test_a_removed_node_is_replaced_and_the_run_recovers(nodes, tmp_path):
    job = toy_job(tmp_path, policy=POLICY, steps=60, extra_args=["--step-sleep", "0.05"])
    run_dir = Path(job.run_dir)
    gone: dict = {}

    def remove(evs):
        r1 = launch_of(evs, 1)["ranks"][1]
        gone.update(node_id=r1["node_id"], pid=r1["pid"])
        nodes.remove_node(node_of(nodes, r1["node_id"]))

    w = When(run_dir, past_step(run_dir, 25), remove)
    assert run(job) == 0
    assert w.ok()
    evs = events(run_dir)
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "crash" and inc["rank"] == 1 and inc["exit_code"] == -9 and inc["lost"]
    kill = next(e for e in evs if e["kind"] == "kill")
    assert kill["unreachable"] == [1]
    gen2 = launch_of(evs, 2)
    assert gone["node_id"] not in {
        r["node_id"] for r in gen2["ranks"]
    }  # a new gang on the live nodes
    assert not alive(gone["pid"])  # the orphaned rank of the removed node is gone too
    assert kinds(run_dir)[-1] == "completed"


def test_a_frozen_node_is_fenced_and_its_rank_killed_by_pid_once_reachable(
    nodes, tmp_path, fail_at
):
    fail_at(0, 35, "zombie")  # rank 0 (the checkpoint writer) freezes after step 35...
    out = tmp_path / "zombie.txt"
    job = toy_job(
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=60,
        heartbeat_s=60,
        env={"SG_ZOMBIE_OUT": str(out)},
        timeouts={"restart_backoff_s": 2.0, "agent_timeout_s": 15},
    )
    run_dir = Path(job.run_dir)
    frozen: dict = {}

    def freeze_node(evs):  # ...and so does everything else on its node: raylet and agent
        r0 = launch_of(evs, 1)["ranks"][0]
        raylet = node_of(nodes, r0["node_id"]).all_processes["raylet"][0].process.pid
        frozen.update(rank=r0["pid"], agent=r0["agent_pid"], raylet=raylet, node_id=r0["node_id"])
        for pid in (raylet, r0["agent_pid"]):
            os.kill(pid, signal.SIGSTOP)

    def wake_rank(
        evs,
    ):  # the node comes back after it was fenced: its rank goes on training and saving
        os.kill(frozen["rank"], signal.SIGCONT)

    def wake_node(evs):
        for pid in (frozen["raylet"], frozen["agent"]):
            os.kill(pid, signal.SIGCONT)

    w1 = When(
        run_dir,
        lambda evs: launch_of(evs, 1) and proc_state(launch_of(evs, 1)["pids"][0]) == "T",
        freeze_node,
    )
    w2 = When(run_dir, lambda evs: frozen and any(e["kind"] == "kill" for e in evs), wake_rank)
    w3 = When(run_dir, lambda evs: frozen and launch_of(evs, 2), wake_node)
    assert run(job) == 0
    assert all(w.ok() for w in (w1, w2, w3))
    evs = events(run_dir)
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "crash" and inc["rank"] == 0 and inc["lost"]  # Ray declared the node dead
    assert next(e for e in evs if e["kind"] == "kill")["unreachable"] == [0]
    # fenced: the zombie tried to save and was refused (FENCE holds generation 2 by then)
    tries = out.read_text().splitlines()
    assert tries and all(
        " refused " in t and "was fenced (current generation 2)" in t for t in tries
    )
    assert not [
        p for p in (run_dir / "checkpoints").glob("ckpt-step*-gen001-*") if int(p.name[9:17]) > 30
    ]
    # its reports never count: nothing of generation 1 past step 35 was accepted
    assert not [m for m in reports(run_dir) if m["gen"] == 1 and m.get("step", 0) > 35]
    # killed by pid as soon as its host was reachable, before generation 2 started
    reaped = next(e for e in evs if e["kind"] == "reaped")
    assert [p["pid"] for p in reaped["processes"]] == [frozen["rank"]]
    assert reaped["processes"][0]["generation"] == 1 and reaped["seq"] < launch_of(evs, 2)["seq"]
    assert not alive(frozen["rank"])
    assert frozen["node_id"] not in {r["node_id"] for r in launch_of(evs, 2)["ranks"]}
    assert kinds(run_dir)[-1] == "completed"


def test_strict_spread_puts_each_rank_on_its_own_node_and_a_recovery_relaunches_across_nodes(
    nodes, tmp_path, fail_at
):
    """Ranks across nodes: the two ranks land on different nodes (the journal's node ids), every
    rank's MASTER_ADDR is rank 0's node address, and the recovered generation is spread again."""
    import ray

    fail_at(0, 30, "collapse")  # generation 1 only: a loss spike, recovered
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    job = toy_job(
        tmp_path,
        policy=POLICY,
        faults=fail_at,
        steps=70,
        extra_args=["--env-out", str(env_dir)],
        placement={"strategy": "STRICT_SPREAD", "timeout_s": 60},
    )
    assert run(job) == 0
    run_dir = Path(job.run_dir)
    evs = events(run_dir)
    assert [e["rule"] for e in evs if e["kind"] == "incident"] == ["loss-spike"]
    assert kinds(run_dir)[-1] == "completed"
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    for gen in (1, 2):
        ranks = launch_of(evs, gen)["ranks"]
        assert len({r["node_id"] for r in ranks}) == 2, ranks  # one rank per node
        assert ranks[0]["ip"] == address[ranks[0]["node_id"]]
        for r in ranks:
            seen = json.loads((env_dir / f"gen{gen}-rank{r['rank']}.json").read_text())
            assert seen["MASTER_ADDR"] == ranks[0]["ip"]
            assert seen["MASTER_PORT"] == str(r["port"])
            assert seen["GROUP_RANK"] == str(r["rank"])  # one rank per node: node rank = rank
            assert seen["LOCAL_RANK"] == "0" and seen["LOCAL_WORLD_SIZE"] == "1"
            assert seen["GROUP_WORLD_SIZE"] == "2" and seen["WORLD_SIZE"] == "2"


def test_a_gang_that_cannot_be_placed_fails_the_launch_after_the_placement_timeout(nodes, tmp_path):
    """STRICT_SPREAD of four ranks on three nodes never places: the run says so and fails."""
    job = toy_job(
        tmp_path,
        policy=POLICY,
        workers=4,
        steps=10,
        placement={"strategy": "STRICT_SPREAD", "timeout_s": 3},
        timeouts={"launch_retries": 0},
    )
    code = run(job)
    evs = events(Path(job.run_dir))
    failed = [e for e in evs if e["kind"] == "launch_failed"]
    assert failed and "could not place 4 workers" in failed[-1]["reason"]
    assert "STRICT_SPREAD" in failed[-1]["reason"]
    assert code != 0 and kinds(Path(job.run_dir))[-1] != "completed"
