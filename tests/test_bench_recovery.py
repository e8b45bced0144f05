"""Smoke run of bench/bench_recovery.py (one recovery per variant, one hang): the table comes out
with every phase, the standby run's recovery was a release, and the hang was measured. No timing
is asserted (benchmarks measure; tests check that the measurement works)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_recovery.py"


def test_the_recovery_bench_runs_and_splits_each_recovery(tmp_path, capsys):
    import ray

    if ray.is_initialized():
        ray.shutdown()  # the bench starts its own embedded Ray
    spec = importlib.util.spec_from_file_location("bench_recovery", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--recoveries", "1", "--hangs", "1", "--heartbeat-s", "5", "--smoke"]
    assert bench.main([*argv, "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 of the standby run's launches were releases" in out
    for phase in bench.PHASES:
        assert any(line.split()[:1] == [phase.split()[0]] for line in out.splitlines()), phase
    cold = bench.recoveries(tmp_path / "cold")
    warm = bench.recoveries(tmp_path / "standby")
    assert len(cold) == 1 and cold[0]["warm"] == 0.0 and cold[0]["start"] > 0
    assert len(warm) == 1 and warm[0]["warm"] == 1.0 and warm[0]["start"] == 0.0
    assert len(bench.hang_latencies(tmp_path / "cold", 5.0)) == 1
