"""GPU reservation on a real multi-node Ray, proven without a GPU: a node started with
``num_gpus=4`` (Ray's GPU resource, no device behind it). Two runs submitted at the same time with
``gpus_per_worker: 1`` share the node: each rank's agent holds its own GPU, each rank sees exactly
its run's GPUs on that node (``CUDA_VISIBLE_DEVICES`` in local-rank order, so ``cuda:LOCAL_RANK``
is its own), and the two runs' devices are disjoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, events, launch_of

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"
MB80 = 80 * 1024 * 1024

JOB = """\
name: {name}
entrypoint: {script}
args: ["--steps", "60", "--step-sleep", "0.1", "--env-out", "{env_out}"]
workers: 2
gpus_per_worker: 1
backend: gloo  # no device behind the fake GPUs
policy: {policy}
run_dir: {run_dir}
timeouts: {{heartbeat_s: 30, first_heartbeat_s: 120, reap_interval_s: 2}}
"""


@pytest.fixture(scope="module")
def gpu_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the session's single-node Ray; conftest.ray_local restarts it on demand
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": MB80})
    c.add_node(num_cpus=4, num_gpus=4, object_store_memory=MB80)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def test_two_runs_share_a_gpu_node_on_disjoint_gpus_each_rank_seeing_its_own(gpu_cluster, tmp_path):
    runs = {}
    for name in ("a", "b"):
        env_out = tmp_path / f"env-{name}"
        env_out.mkdir()
        job = tmp_path / f"{name}.yaml"
        job.write_text(
            JOB.format(
                name=name,
                script=SCRIPTS / "toy_rank.py",
                env_out=env_out,
                policy=POLICY,
                run_dir=tmp_path / f"run-{name}",
            )
        )
        log = open(tmp_path / f"{name}.log", "wb")
        argv = [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(job)]
        proc = subprocess.Popen(
            [*argv, "--address", gpu_cluster.address, "--quiet"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        runs[name] = (proc, tmp_path / f"run-{name}", env_out)
    for name, (proc, _, _) in runs.items():
        assert proc.wait(300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    held: dict[str, list[str]] = {}
    spans = {}
    for name, (_, run_dir, env_out) in runs.items():
        evs = events(run_dir)
        assert evs[-1]["kind"] == "completed"
        spans[name] = (launch_of(evs, 1)["time"], evs[-1]["time"])
        ranks = launch_of(evs, 1)["ranks"]
        held[name] = [g for r in ranks for g in r["gpu_ids"]]
        assert all(len(r["gpu_ids"]) == 1 for r in ranks), ranks  # one GPU per rank, its own
        for r in ranks:
            seen = json.loads((env_out / f"gen1-rank{r['rank']}.json").read_text())
            visible = seen["CUDA_VISIBLE_DEVICES"].split(",")
            # both ranks are on the GPU node: they see the run's two GPUs, in local-rank order
            assert sorted(visible) == sorted(held[name]), (visible, held[name])
            assert seen["LOCAL_WORLD_SIZE"] == "2"
            assert visible[int(seen["LOCAL_RANK"])] == r["gpu_ids"][0]
    # the runs overlapped in time and never shared a device
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1], spans
    assert not set(held["a"]) & set(held["b"]), held
    assert sorted(held["a"] + held["b"]) == ["0", "1", "2", "3"]
