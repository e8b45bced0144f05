"""The embedded Ray's dashboard port: 8265 when free, else the next free one, chosen by Ray's
dashboard when it binds. Two jobs started in the same seconds on one machine both start, on
distinct ports: a port chosen beforehand (8265 looked free to both) and handed to Ray lost that
race, and the second job's Ray failed to start."""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlsplit

import pytest
from spikeguard.supervisor.launch.ray_init import dashboard_installed

START = """
import ray, ray._private.worker as w
from spikeguard.supervisor.job import JobSpec
from spikeguard.supervisor.launch.ray_init import init_ray
assert init_ray(JobSpec(name="dash", entrypoint="x.py", workers=1))
print("URL", w.get_dashboard_url(), flush=True)
ray.shutdown()
"""


@pytest.mark.skipif(not dashboard_installed(), reason="Ray's dashboard is not installed")
def test_jobs_started_together_all_get_a_dashboard_on_their_own_port():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", START], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    ports = [
        urlsplit("//" + line.split()[1]).port
        for out, _ in outs
        for line in out.splitlines()
        if line.startswith("URL ")
    ]
    assert len(ports) == 2 and ports[0] != ports[1], ports
