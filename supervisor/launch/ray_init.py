"""Attaching to a Ray cluster, or starting an embedded one for a job."""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from typing import Any

from ..job import JobSpec


def dashboard_installed() -> bool:
    """Whether Ray's dashboard can run here (``ray[default]``: ``pip install
    'spikeguard[cluster]'``)."""
    return importlib.util.find_spec("aiohttp") is not None


def init_ray(job: JobSpec) -> bool:
    """Attach to ``job.ray.address`` or start an embedded local Ray. Returns True if we started
    it. The embedded Ray has its dashboard on http://127.0.0.1:8265 (or the next free port)
    when it is installed, unless the job turns it off.

    The port is left to Ray (``dashboard_port=None``): its dashboard binds 8265 or, when that is
    taken, the next free one of the following 50, at bind time. Choosing a free port here and
    handing it over loses a race: two jobs started in the same seconds on one machine both saw
    8265 free, and the second one's Ray failed to start."""
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
        dashboard_port=None,  # Ray's: 8265, else the next free one when its dashboard binds
        **kw,
    )
    return True


GCS_PROBE_S = 2.0
"""How long :func:`ray_reachable` waits for the GCS to accept a connection."""
GCS_PROBE_TRIES = 3
"""Connections it tries before it calls the GCS gone (every rank on it would be marked lost)."""


def ray_reachable(timeout_s: float = GCS_PROBE_S) -> bool:
    """Whether this process's Ray is still there: its GCS accepts a TCP connection within
    ``timeout_s``. False when Ray is not initialized, or when its GCS is gone: an embedded Ray
    whose processes got the supervisor's SIGTERM with it (a signal to the whole process group,
    as Slurm, systemd and ``timeout`` deliver it), or a cluster whose head went down.

    Asked before the calls that need the GCS (removing a placement group, killing actors):
    without one, such a call blocks until Ray's GCS client gives up, 60 s later, and that ends
    the process with exit code 1 whatever the run's outcome was."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        address = str(ray.get_runtime_context().gcs_address)
    except Exception:  # Ray's own state is gone with it
        return False
    host, _, port = address.rpartition(":")
    for attempt in range(GCS_PROBE_TRIES):  # a failover blip is not a dead GCS
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except ValueError:
            return False
        except OSError:
            if attempt + 1 < GCS_PROBE_TRIES:
                time.sleep(0.5)
    return False
