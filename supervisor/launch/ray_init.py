"""Attaching to a Ray cluster, or starting an embedded one for a job."""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

from ..job import JobSpec

DASHBOARD_PORT = 8265


def dashboard_installed() -> bool:
    """Whether Ray's dashboard can run here (``ray[default]``: ``pip install
    'spikeguard[cluster]'``)."""
    return importlib.util.find_spec("aiohttp") is not None


def dashboard_port(preferred: int = DASHBOARD_PORT) -> int:
    """``preferred`` when nothing listens on it, else a free port the kernel picks: a second job
    on the machine (or a Ray dashboard already running) must not stop this one from starting."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free port for Ray's dashboard")


def init_ray(job: JobSpec) -> bool:
    """Attach to ``job.ray.address`` or start an embedded local Ray. Returns True if we started
    it. The embedded Ray has its dashboard on http://127.0.0.1:8265 (or the next free port)
    when it is installed, unless the job turns it off."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"log_to_driver": False, "namespace": "spikeguard"}
    if job.ray.address:
        ray.init(address=job.ray.address, **kw)
        return False
    need = int(job.workers * max(job.cpus_per_worker, 0) + 0.999)
    dashboard = job.ray.dashboard and dashboard_installed()
    # address="local": always a fresh embedded instance, never a cluster that happens to run here
    ray.init(
        address="local",
        num_cpus=job.ray.num_cpus or max(need, os.cpu_count() or 1),
        object_store_memory=job.ray.object_store_mb * 1024 * 1024,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port() if dashboard else DASHBOARD_PORT,
        **kw,
    )
    return True
