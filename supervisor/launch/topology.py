"""Where each rank sits and the variables it starts with: the torchrun contract, computed.

Pure (no Ray, no I/O): given the node each rank's agent landed on, the GPUs Ray assigned it, the
master port and the generation, :func:`rank_variables` returns every rank's launcher variables:
exactly the names ``torchrun`` exports for the same layout (``RANK``, ``LOCAL_RANK``,
``GROUP_RANK``, ``ROLE_RANK``, ``TORCHELASTIC_RUN_ID``, …, see
:data:`spikeguard.workers.contract.env.TORCHRUN_VARIABLES`), so frameworks that detect a
torchelastic launch (Lightning, HF Accelerate) recognise it, plus spikeguard's own and, on GPU
nodes, ``CUDA_VISIBLE_DEVICES``.

Working directory: under Ray Jobs' ``--working-dir`` every node has its own copy of the job's
working directory, under that node's Ray temp directory (``…/runtime_resources/working_dir_files/
_ray_pkg_<hash>``, the same name on every node, not the same path), and Ray starts the job's
workers in it. :func:`rank_start` starts each rank in its own node's copy, with the supervisor's
paths into its copy (the entrypoint) translated.

GPUs: each rank's agent reserves ``gpus_per_worker`` GPUs, so Ray assigns it device ids and two
runs on one node never share a GPU. With whole GPUs, every rank on a node sees the GPUs of all
of this run's ranks on that node, in local-rank order (NCCL can then use peer-to-peer paths
between them), so ``cuda:LOCAL_RANK`` is the rank's own GPU (with ``k`` GPUs per rank:
``cuda:k*LOCAL_RANK`` … ``cuda:k*LOCAL_RANK+k-1``). With a fraction of a GPU a rank sees only
its own device, ``cuda:0``.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Sequence

from spikeguard.workers.contract import env as names

from .interface import NodeInfo


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """What a launch is: the run, the generation, where the master is."""

    run_id: str
    generation: int
    master_addr: str
    master_port: int
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    omp_num_threads: str | None = None
    """The job's own ``OMP_NUM_THREADS`` (None: cpus per worker, as torchrun would want)."""


def local_ranks(nodes: Sequence[NodeInfo]) -> tuple[list[int], list[int], list[int]]:
    """Per rank: its index among the ranks on its node, how many share its node, and its node's
    index (nodes numbered in order of their first rank)."""
    order: dict[str, int] = {}
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node.node_id, len(order))
        members.setdefault(node.node_id, []).append(rank)
    local = [members[n.node_id].index(r) for r, n in enumerate(nodes)]
    sizes = [len(members[n.node_id]) for n in nodes]
    groups = [order[n.node_id] for n in nodes]
    return local, sizes, groups


def visible_devices(nodes: Sequence[NodeInfo], rank: int, gpus_per_worker: float) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for ``rank`` (None without GPUs): see the module docstring."""
    if gpus_per_worker <= 0:
        return None
    own = list(nodes[rank].gpu_ids)
    if gpus_per_worker < 1:
        return ",".join(own)
    shared: list[str] = []
    for node in nodes:
        if node.node_id != nodes[rank].node_id:
            continue
        for gpu in node.gpu_ids:
            if gpu not in shared:
                shared.append(gpu)
    return ",".join(shared)


def rank_variables(nodes: Sequence[NodeInfo], layout: Layout) -> list[dict[str, str]]:
    """The launcher variables of every rank (index = rank)."""
    world = len(nodes)
    local, sizes, groups = local_ranks(nodes)
    group_world = len({n.node_id for n in nodes})
    threads = layout.omp_num_threads or str(max(1, int(layout.cpus_per_worker)))
    out = []
    for rank in range(world):
        v = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local[rank]),
            "LOCAL_WORLD_SIZE": str(sizes[rank]),
            "GROUP_RANK": str(groups[rank]),
            "GROUP_WORLD_SIZE": str(group_world),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": layout.master_addr,
            "MASTER_PORT": str(layout.master_port),
            "TORCHELASTIC_RUN_ID": layout.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(max(layout.generation - 1, 0)),
            "TORCHELASTIC_MAX_RESTARTS": names.UNBOUNDED_RESTARTS,
            # rank 0 hosts the rendezvous store on MASTER_PORT: there is no torchrun agent store
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": threads,
            names.ENV_RUN_ID: layout.run_id,
            names.ENV_GENERATION: str(layout.generation),
        }
        devices = visible_devices(nodes, rank, layout.gpus_per_worker)
        if devices is not None:
            v["CUDA_VISIBLE_DEVICES"] = devices
        out.append(v)
    return out


def copy_root(cwd: str, copy_name: str) -> str | None:
    """The directory named ``copy_name`` that ``cwd`` is (or lies in), the closest one; None
    when there is none."""
    path = posixpath.normpath(cwd)
    while True:
        if posixpath.basename(path) == copy_name:
            return path
        parent = posixpath.dirname(path)
        if parent == path:
            return None
        path = parent


def rebase(path: str, root: str, new_root: str) -> str:
    """``path`` moved from under ``root`` to under ``new_root``; any other string as it is."""
    if not posixpath.isabs(path):
        return path
    norm = posixpath.normpath(path)
    if norm != root and not norm.startswith(root.rstrip("/") + "/"):
        return path
    return posixpath.normpath(posixpath.join(new_root, posixpath.relpath(norm, root)))


def rank_start(
    cmd: Sequence[str], *, cwd: str, working_dir: bool, agent_cwd: str
) -> tuple[list[str], str]:
    """The command and the working directory of a rank whose agent Ray started in
    ``agent_cwd``; ``cmd`` and ``cwd`` are the supervisor's.

    Without a runtime-env working directory (``working_dir`` False: an embedded Ray, a shell on
    the head of a cluster) the rank gets the supervisor's own, which must then mean the same on
    every node (a shared filesystem). With one, the agent's ``agent_cwd`` is its node's copy:
    the rank starts there, at the place the supervisor's ``cwd`` has in the supervisor's copy
    (the closest directory of the same name), and every argument that is a path into the
    supervisor's copy (the entrypoint) points into the node's copy instead. A supervisor that
    runs outside its copy has nothing to translate: the rank starts at the top of its node's
    copy, ``cmd`` as it is."""
    if not working_dir or not agent_cwd:
        return list(cmd), cwd
    root = copy_root(cwd, posixpath.basename(posixpath.normpath(agent_cwd)))
    if root is None:
        return list(cmd), agent_cwd
    return [rebase(arg, root, agent_cwd) for arg in cmd], rebase(cwd, root, agent_cwd)
