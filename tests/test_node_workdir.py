"""Each rank starts in its own node's copy of the job's working directory (Ray Jobs'
``--working-dir``), not in the head's.

Ray gives every node its own copy, under that node's temp dir
(``TEMP/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>``): the same name on every
node, not the same path. The supervisor runs on the head, in the head's copy; a rank on another
node must run its node's copy of the entrypoint, in its node's copy. The pure part
(:func:`~spikeguard.supervisor.launch.topology.rank_start`) is tested without Ray; the real one on
a Ray cluster of two nodes on this machine whose temp dirs differ (a head and a worker, each
``ray start --block`` with its own ``--temp-dir``), with a job submitted through the Jobs API.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_journal_replays, events, launch_of
from spikeguard.supervisor.launch.topology import copy_root, rank_start

COPY = "_ray_pkg_42ec9172af08f19a"
HEAD = f"/tmp/a/session_1/runtime_resources/working_dir_files/{COPY}"
NODE = f"/tmp/b/session_1/runtime_resources/working_dir_files/{COPY}"
PY = "/opt/venv/bin/python"


def test_a_rank_starts_in_its_own_nodes_copy_with_the_entrypoint_of_that_copy():
    cmd, cwd = rank_start(
        [PY, f"{HEAD}/train.py", "--data", f"{HEAD}/data/x.bin", "--steps", "5", "rel/path"],
        cwd=HEAD,
        working_dir=True,
        agent_cwd=NODE,
    )
    assert cwd == NODE
    assert cmd == [
        PY,
        f"{NODE}/train.py",
        "--data",
        f"{NODE}/data/x.bin",
        "--steps",
        "5",
        "rel/path",
    ]


def test_a_supervisor_in_a_folder_of_its_copy_starts_the_ranks_in_the_same_folder():
    cmd, cwd = rank_start(
        [PY, f"{HEAD}/jobs/a/train.py"], cwd=f"{HEAD}/jobs/a", working_dir=True, agent_cwd=NODE
    )
    assert (cmd[1], cwd) == (f"{NODE}/jobs/a/train.py", f"{NODE}/jobs/a")


def test_without_a_working_dir_the_ranks_get_the_supervisors_paths():
    """An embedded Ray or a shell on the head: the paths must mean the same on every node."""
    cmd = [PY, "/home/u/proj/train.py"]
    assert rank_start(cmd, cwd="/home/u/proj", working_dir=False, agent_cwd="/") == (
        cmd,
        "/home/u/proj",
    )
    assert rank_start(cmd, cwd="/home/u/proj", working_dir=True, agent_cwd="") == (
        cmd,
        "/home/u/proj",
    )


def test_a_supervisor_outside_its_copy_starts_the_ranks_at_the_top_of_theirs():
    cmd = [PY, "/home/u/train.py"]
    assert rank_start(cmd, cwd="/home/u", working_dir=True, agent_cwd=NODE) == (cmd, NODE)


def test_only_paths_inside_the_copy_move():
    assert copy_root(f"{HEAD}/a/b", COPY) == HEAD
    assert copy_root("/elsewhere", COPY) is None
    cmd, _ = rank_start(
        [PY, f"{HEAD}x/train.py", "/etc/hosts", HEAD], cwd=HEAD, working_dir=True, agent_cwd=NODE
    )
    assert cmd == [PY, f"{HEAD}x/train.py", "/etc/hosts", NODE]  # a sibling named alike stays


# ---- on a real two-node cluster ------------------------------------------------------------------
WHERE = """\
import json, os, runpy, sys

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(os.environ["SG_WHERE"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"cwd": os.getcwd(), "script": os.path.abspath(__file__)}, f)
sys.argv = [os.path.join(here, "toy_rank.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

JOB = """\
name: workdir
entrypoint: where.py
args: ["--steps", "20"]
workers: 2
cpus_per_worker: 1
policy: policy.yaml
run_dir: {run_dir}
env: {{SG_WHERE: "{where}"}}
placement: {{timeout_s: 300}}
timeouts: {{heartbeat_s: 60, first_heartbeat_s: 180}}
"""


def raylet_temp_dir(node_id: str) -> str:
    """The temp dir of the node ``node_id``: read from its raylet's command line."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if args and args[0].endswith("/raylet") and f"--node_id={node_id}" in args:
            return next(a.split("=", 1)[1] for a in args if a.startswith("--temp_dir="))
    raise AssertionError(f"no raylet of node {node_id} on this machine")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head (1 CPU) and a worker node (1 CPU) with different temp dirs: a 2-rank gang of 1 CPU
    per rank puts one rank on each."""
    import ray
    from test_ray_jobs import Head

    if ray.is_initialized():
        ray.shutdown()  # the session's local Ray; conftest.ray_local restarts it on demand
    head = Head(tmp_path_factory.mktemp("ray-two-nodes"), num_cpus=1)
    try:
        worker_temp = head.add_node(num_cpus=1)
        yield head, worker_temp
    finally:
        head.close()


@pytest.mark.slow
def test_each_rank_runs_its_own_nodes_copy_of_the_working_dir(two_nodes, tmp_path):
    head, worker_temp = two_nodes
    wd = tmp_path / "wd"
    wd.mkdir()
    where = tmp_path / "where"
    where.mkdir()
    run_dir = tmp_path / "run"
    (wd / "job.yaml").write_text(JOB.format(run_dir=run_dir, where=where))
    (wd / "policy.yaml").write_text(
        (Path(__file__).parent / "data" / "toy_policy.yaml").read_text()
    )
    (wd / "where.py").write_text(WHERE)
    shutil.copy(SCRIPTS / "toy_rank.py", wd / "toy_rank.py")

    head.submit("sg-workdir", wd, "spikeguard submit job.yaml --address auto")
    # well inside pytest's limit, so a run that never ends fails with its logs, not a stack dump
    info = head.client("wait", "sg-workdir", "200", timeout=240)
    assert (info["status"], info["driver_exit_code"]) == ("SUCCEEDED", 0), (
        info["logs"][-3000:] + "\n--- worker node log ---\n" + head.node_log_tail()
    )

    ranks = launch_of(events(run_dir), 1)["ranks"]
    temps = {}
    for r in ranks:
        seen = json.loads((where / f"rank{r['rank']}.json").read_text())
        temps[r["rank"]] = temp = raylet_temp_dir(r["node_id"])
        # the rank's own node's copy: its working directory, and the script it runs there
        cwd = Path(seen["cwd"])
        assert cwd.is_relative_to(temp) and cwd.parent.name == "working_dir_files", (seen, temp)
        assert Path(seen["script"]) == cwd / "where.py", seen
    # one rank per node, and the nodes' temp dirs differ: the worker node's rank ran its copy
    assert sorted(temps.values()) == sorted({head.temp, worker_temp}), temps
    assert_journal_replays(run_dir / "journal.jsonl")
