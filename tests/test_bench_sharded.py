"""A smoke run of bench/bench_sharded_ckpt.py with tiny sizes: it runs its three modes on two
real gloo ranks and prints them side by side. Timings are measured, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_sharded_ckpt.py"


def test_the_benchmark_prints_the_three_modes_side_by_side(tmp_path: Path) -> None:
    args = ["--width", "32", "--depth", "1", "--batch", "4", "--steps", "4", "--every", "2"]
    res = subprocess.run(
        [sys.executable, str(BENCH), *args, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("sharded checkpoint cost: 2 ranks (FSDP2, gloo, CPU)")
    rows = {}
    for line in lines[2:]:
        m = re.match(r"^(no save|sync save|async save)\s+([\d.]+) ms\s+([\d.]+)\s+(\S.*)$", line)
        assert m, line
        rows[m[1]] = (float(m[2]), float(m[3]), m[4].strip())
    assert list(rows) == ["no save", "sync save", "async save"]
    assert rows["no save"][1] == 1.0 and rows["no save"][2] == "-"
    for mode in ("sync save", "async save"):
        step_ms, ratio, wait = rows[mode]
        assert ratio == pytest.approx(step_ms / rows["no save"][0], abs=0.01)
        assert wait.endswith(" ms")
    assert list(tmp_path.iterdir()) == []  # each mode's checkpoints were removed
