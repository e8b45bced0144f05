"""Every benchmark in bench/ runs end to end at tiny sizes and prints the table it promises.

Shapes and columns only, never a timing: what the benchmarks measure is for their tables
(bench/README.md), not for pass/fail.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench(name: str) -> Any:
    """A bench script as a module (they run as ``python3 bench/NAME.py``: bench/ on the path)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_step_latency_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    rows = bench("bench_step_latency").main(["--smoke"])
    assert [r["variant"] for r in rows] == ["attached", "stalled"]
    for r in rows:
        assert r["steps"] == 300
        assert 0 < r["p50 ms"] <= r["p99 ms"] <= r["max ms"]
        # every message got through, was dropped and counted, or is the count of the drops
        assert r["received"] >= r["sent"] >= 1
    assert "p99 ms" in capsys.readouterr().out


def test_erank_smoke() -> None:
    rows = bench("bench_erank").main(["--smoke"])
    assert {(r["shape"], r["path"]) for r in rows} == {
        (s, p) for s in ("256x32", "512x160") for p in ("svdvals", "auto", "lowrank", "gram")
    }
    for r in rows:
        assert r["ms"] > 0 and r["speed-up"] > 0
        assert abs(r["err real"]) < 1e-2 and abs(r["err floor"]) < 1e-2
    assert {r["picks"] for r in rows if r["path"] == "auto"} == {"svd", "gram"}


def test_overhead_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # main() sets and clears these: restored
        monkeypatch.setenv(key, "0")
    for key in [k for k in os.environ if k.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(key)
    rows = bench("bench_overhead").main(["--smoke"])
    assert [r["variant"] for r in rows] == ["no-sdk", "sdk/200", "sdk/10"]
    assert rows[0]["slowdown"] == 1.0
    for r in rows:
        assert r["min"] <= r["steps/s"] <= r["max"] and r["steps/s"] > 0


def test_scale_smoke() -> None:
    (row,) = bench("bench_scale").main(["--smoke"])
    assert row["ranks"] == 32
    # 200 measured seconds of 32 ranks, one line each per second
    assert row["msgs"] == 32 * 200
    injected = int(row["fired"].split("/")[1])
    assert row["fired"] == f"{injected}/{injected}" and injected > 0  # every injection decided
    assert 0 < row["spike p50 ms"] <= row["spike p99 ms"]  # decided on a pending rank
    assert 0 < row["nan p50 ms"] <= row["nan p99 ms"]  # decided on its first message
    assert row["journal max ms"] > 0
    assert row["dropped"] == 0 and row["other alerts"] == 0
    assert row["cores"] > 0 and row["rss MB"] > 0


def test_detection_smoke(tmp_path: Path) -> None:
    out = bench("bench_detection").main(["--smoke", "--out", str(tmp_path)])
    rows = out["rows"]
    assert [(r["case"], r["variant"], r["seed"]) for r in rows] == [
        ("gpt-burst", "diverge", 0),
        ("gpt-burst", "control", 0),
    ]
    for row in rows:
        assert math.isfinite(row["final loss"])
        assert row["recoveries"] == 0  # 30 steps: inside every rule's warm-in
        assert row["probed"] == "attn,rank,logz"  # the example GPT: every probe kind found
    assert out["summary"]["controls"] == 1 and out["summary"]["diverging"] == 1
    assert (tmp_path / "alone" / "gpt-burst-diverge-s0.jsonl").stat().st_size > 0
