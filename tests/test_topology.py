"""The launcher's variables per rank: the torchrun contract (compared with torchrun itself) and
the GPU assignment (no Ray: node facts as Ray would report them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from spikeguard.supervisor.launch.interface import NodeInfo
from spikeguard.supervisor.launch.topology import Layout, rank_variables, visible_devices
from spikeguard.workers.contract.env import TORCHRUN_VARIABLES

DUMP = textwrap.dedent(
    """
    import json, os, sys
    names = set(json.loads(os.environ["BASE_NAMES"]))
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k not in names}, f)
    """
)


def node(nid: str, *gpus: str, ip: str = "10.0.0.1") -> NodeInfo:
    return NodeInfo(node_id=nid, ip=ip, host=nid, pid=1, gpu_ids=tuple(gpus))


def layout(**kw) -> Layout:
    return Layout(
        **{"run_id": "run", "generation": 3, "master_addr": "10.0.0.1", "master_port": 29500, **kw}
    )


@pytest.fixture(scope="module")
def torchrun_env(tmp_path_factory) -> list[dict[str, str]]:
    """What torchrun itself exports to 2 local workers (minus the environment it was given)."""
    out = tmp_path_factory.mktemp("torchrun")
    script = out / "dump.py"
    script.write_text(DUMP)
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets it only when it is not set already
    env["BASE_NAMES"] = json.dumps(sorted(env) + ["BASE_NAMES"])
    torchrun = Path(sys.executable).parent / "torchrun"
    subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            str(script),
            str(out),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=180,
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_contract_names_what_torchrun_exports(torchrun_env):
    for exported in torchrun_env:
        assert set(exported) - {"_"} == set(TORCHRUN_VARIABLES)


def test_the_launcher_exports_the_same_names_with_the_same_layout(torchrun_env):
    ours = rank_variables([node("a"), node("a")], layout(cpus_per_worker=1))
    for r, (mine, theirs) in enumerate(zip(ours, torchrun_env)):
        # every torchrun name but the error file, which the launcher adds with the run's path
        assert set(TORCHRUN_VARIABLES) - {"TORCHELASTIC_ERROR_FILE"} <= set(mine)
        same = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_NAME",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "OMP_NUM_THREADS",
        )
        assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}, r
    # by design: the run's name, the generation as the restart count, no agent store
    assert ours[0]["TORCHELASTIC_RUN_ID"] == "run"
    assert ours[0]["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert ours[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_nodes_are_groups_and_local_ranks_count_within_a_node():
    nodes = [node("a"), node("b"), node("a"), node("b")]
    v = rank_variables(nodes, layout())
    assert [x["GROUP_RANK"] for x in v] == ["0", "1", "0", "1"]
    assert [x["LOCAL_RANK"] for x in v] == ["0", "0", "1", "1"]
    assert {x["LOCAL_WORLD_SIZE"] for x in v} == {"2"} and v[0]["GROUP_WORLD_SIZE"] == "2"
    assert all(x["MASTER_ADDR"] == "10.0.0.1" and x["MASTER_PORT"] == "29500" for x in v)
    assert all("CUDA_VISIBLE_DEVICES" not in x for x in v)


def test_omp_threads_follow_the_reserved_cpus_unless_the_job_sets_them():
    assert rank_variables([node("a")], layout(cpus_per_worker=8))[0]["OMP_NUM_THREADS"] == "8"
    assert rank_variables([node("a")], layout(cpus_per_worker=0.5))[0]["OMP_NUM_THREADS"] == "1"
    mine = layout(cpus_per_worker=8, omp_num_threads="3")
    assert rank_variables([node("a")], mine)[0]["OMP_NUM_THREADS"] == "3"


def test_whole_gpus_are_shared_among_the_runs_ranks_on_a_node_in_local_rank_order():
    nodes = [node("a", "3"), node("a", "1"), node("b", "0")]
    v = rank_variables(nodes, layout(gpus_per_worker=1))
    assert [x["CUDA_VISIBLE_DEVICES"] for x in v] == ["3,1", "3,1", "0"]
    # cuda:LOCAL_RANK is each rank's own GPU
    for x, n in zip(v, nodes):
        assert x["CUDA_VISIBLE_DEVICES"].split(",")[int(x["LOCAL_RANK"])] == n.gpu_ids[0]


def test_several_gpus_per_rank_and_fractions():
    two = [node("a", "0", "1"), node("a", "2", "3")]
    assert visible_devices(two, 1, 2) == "0,1,2,3"  # rank 1: cuda:2 and cuda:3
    half = [node("a", "0"), node("a", "0")]
    assert visible_devices(half, 1, 0.5) == "0"  # a shared GPU: each sees only it, cuda:0
