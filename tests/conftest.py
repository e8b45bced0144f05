"""Shared fixtures: a real local Ray, fault injection, run helpers."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can import fakeslack


@pytest.fixture(scope="session")
def ray_local():
    """A real embedded Ray for the whole session (small object store, logical CPUs for 2-4 ranks)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
                 log_to_driver=False, namespace="spikeguard-tests")
    yield ray
    ray.shutdown()


class Faults:
    """``fail_at(rank, step, mode, gen=1)``: inject a fault into ``tests/scripts/toy_rank.py``.

    Modes: exit, sigkill, hang, collapse, nan (see the script's docstring). The
    fault fires only in that launch generation, so a recovered run goes on. The
    faults travel to the ranks in the job's ``env`` (Ray workers do not see
    variables the test process sets after Ray started).
    """

    def __init__(self) -> None:
        self.specs: list[str] = []

    def __call__(self, rank: int, step: int, mode: str, gen: int = 1) -> None:
        self.specs.append(f"{rank}:{step}:{mode}:{gen}")

    @property
    def env(self) -> dict[str, str]:
        return {"SG_FAULT": ",".join(self.specs)} if self.specs else {}


@pytest.fixture
def fail_at() -> Faults:
    return Faults()


def toy_job(tmp_path: Path, *, policy: str | Path, steps: int = 120, workers: int = 2,
            heartbeat_s: float = 30.0, first_heartbeat_s: float = 120.0, extra_args: list[str] | None = None,
            faults: Faults | None = None, **fields: Any):
    from spikeguard.supervisor.job import JobSpec

    args = ["--steps", str(steps), *(extra_args or [])]
    return JobSpec(name="toy", entrypoint=str(SCRIPTS / "toy_rank.py"), args=args, workers=workers,
                   policy=str(policy), run_dir=str(tmp_path / "run"), env=faults.env if faults else {},
                   timeouts={"heartbeat_s": heartbeat_s, "first_heartbeat_s": first_heartbeat_s}, **fields)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    import json

    out = []
    for line in Path(path).read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


os.environ.setdefault("OMP_NUM_THREADS", "1")
