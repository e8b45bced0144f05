"""A smoke run of bench/bench_sharded_ckpt.py (``--smoke``: tiny sizes): it runs its five modes on
two real gloo ranks — no save, then sync and async saves into a local directory and onto the
local S3 server it starts itself (tests/s3server.py) — and prints them side by side. Timings are
measured, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import need_s3

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_sharded_ckpt.py"
MODES = ["no save", "sync posix", "async posix", "sync s3", "async s3"]
ROW = re.compile(
    r"^(?P<mode>" + "|".join(MODES) + r")\s+(?P<step>[\d.]+) ms\s+(?P<ratio>[\d.]+)"
    r"\s+(?P<wait>\d+ ms|-)\s+(?P<save>\d+ ms|-)\s+(?P<size>[\d.]+ [KM]iB|-)\s+(?P<rate>[\d.]+|-)$"
)


def test_the_benchmark_prints_its_modes_side_by_side_on_disk_and_on_s3(tmp_path: Path) -> None:
    need_s3()  # the S3 rows need moto's server, as the bench does
    res = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("sharded checkpoint cost: 2 ranks (FSDP2, gloo, CPU)")
    assert lines[1].split() == [
        *("mode", "step", "time", "x", "no", "save", "wait", "per", "save"),
        *("save", "time", "size", "MiB/s"),
    ]
    rows = {}
    for line in lines[2:-1]:
        m = ROW.match(line)
        assert m, line
        rows[m["mode"]] = m.groupdict()
    assert list(rows) == MODES
    none = rows["no save"]
    assert float(none["ratio"]) == 1.0
    assert none["wait"] == none["save"] == none["size"] == none["rate"] == "-"
    for mode in MODES[1:]:
        row = rows[mode]
        assert float(row["ratio"]) == pytest.approx(
            float(row["step"]) / float(none["step"]), abs=0.01
        )
        assert "-" not in (row["wait"], row["save"], row["size"], row["rate"]), row
    assert lines[-1].startswith("s3 rows: a local moto server on 127.0.0.1")
    assert lines[-1].endswith("; 0 objects left after the run")  # each S3 mode removed its own
    assert list(tmp_path.iterdir()) == []  # and each local one
