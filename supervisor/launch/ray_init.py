"""Attaching to a Ray cluster, or starting an embedded one for a job."""

from __future__ import annotations

import os
from typing import Any

from ..job import JobSpec


def init_ray(job: JobSpec) -> bool:
    """Attach to ``job.ray.address`` or start an embedded local Ray. Returns True if we started
    it."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "namespace": "spikeguard",
    }
    if job.ray.address:
        ray.init(address=job.ray.address, **kw)
        return False
    need = int(job.workers * max(job.cpus_per_worker, 0) + 0.999)
    # address="local": always a fresh embedded instance, never a cluster that happens to run here
    ray.init(
        address="local",
        num_cpus=job.ray.num_cpus or max(need, os.cpu_count() or 1),
        object_store_memory=job.ray.object_store_mb * 1024 * 1024,
        **kw,
    )
    return True
