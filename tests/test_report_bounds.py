"""``spikeguard report`` on a run whose ranks reported very many layer names: the run data keeps
per generation and heatmap signal only the worst layers (``rundata.MAX_LAYER_SERIES``), so its
work follows the file's size, not names × steps; the page counts what it leaves out.

Structural bounds only, never a timing (``bench/bench_report.py`` measures the time)."""

from __future__ import annotations

import importlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from spikeguard.supervisor.observe import rundata
from spikeguard.supervisor.observe.report import MAX_LAYER_ROWS, render
from spikeguard.supervisor.observe.rundata import MAX_LAYER_SERIES, load_run

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_report() -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("bench_report")


def kept_names(g: rundata.Generation) -> set[str]:
    """Every layer name the fold holds per-step values of (through the step-major view)."""
    return {name for at in g.layers.values() for name in at}


def test_thousands_of_layer_names_keep_a_bounded_fold_and_the_layer_that_fell(tmp_path):
    b = bench_report()
    b.write_synthetic(tmp_path / "run", names=3000, steps=30)
    data = load_run(tmp_path / "run")
    (g,) = data.generations.values()
    assert len(kept_names(g)) <= 2 * MAX_LAYER_SERIES  # not one series per name
    for signal in rundata.HEATMAP_SIGNALS:
        assert len(g.series[signal]) == MAX_LAYER_SERIES
        assert g.layer_count(signal) == (3000 + b.REAL_LAYERS, False)
    # the real layer that fell in the last tenth is kept, with its late values
    fell = g.series["grade"][b.FALLING]
    assert fell.worst == 0 and set(fell.values) >= set(range(27, 30))
    page = render(data, secrets=())
    assert f">g1 {b.FALLING}<" in page
    rows = re.findall(r'<text[^>]*class="row"[^>]*>g1 ', page)
    assert len(rows) == 2 * MAX_LAYER_ROWS  # two heatmaps, the worst rows of each
    hidden = 3000 + b.REAL_LAYERS - MAX_LAYER_ROWS
    assert page.count(f"+{hidden} layers not shown") == 2


def test_names_that_come_once_keep_exactly_the_worst(tmp_path):
    """Each name reported once: the streaming choice is the exact worst MAX_LAYER_SERIES."""
    rng = random.Random(7)
    values = {f"n{i}": rng.uniform(0.0, 1.0) for i in range(4 * MAX_LAYER_SERIES)}
    gens: dict[int, rundata.Generation] = {}
    order: dict[str, int] = {}
    for step, (name, v) in enumerate(values.items()):
        msg = {"type": "report", "gen": 1, "step": step, "layers": {name: {"grade": v * 7}}}
        rundata._fold(msg, gens, order)
    worst = sorted(values, key=values.get)[:MAX_LAYER_SERIES]
    assert set(gens[1].series["grade"]) == set(worst)
    assert gens[1].layer_count("grade") == (len(values), False)


def test_a_kept_layer_that_gets_worse_is_not_evicted_for_a_milder_one(monkeypatch):
    monkeypatch.setattr(rundata, "MAX_LAYER_SERIES", 3)
    gens: dict[int, rundata.Generation] = {}
    order: dict[str, int] = {}

    def report(step: int, layers: dict[str, float]) -> None:
        msg = {"type": "report", "gen": 0, "step": step}
        msg["layers"] = {n: {"grade": v} for n, v in layers.items()}
        rundata._fold(msg, gens, order)

    report(0, {"a": 7, "b": 6, "c": 5})
    report(1, {"a": 1})  # a falls: now the worst kept
    report(2, {"d": 4})  # worse than b (6), the least bad: b goes
    report(3, {"e": 6})  # not worse than any kept one: turned away
    report(4, {"f": float("nan")})  # NaN is the worst of all: c (5) goes
    kept = gens[0].series["grade"]
    assert set(kept) == {"a", "d", "f"}
    assert kept["a"].values == {0: 7, 1: 1} and kept["a"].worst == 1
    assert gens[0].layer_count("grade") == (6, False)
    assert [n for n in sorted(kept, key=lambda n: kept[n].order)] == ["a", "d", "f"]


def test_counts_past_the_name_cap_say_at_least(tmp_path, monkeypatch):
    monkeypatch.setattr(rundata, "MAX_NAMES_COUNTED", 100)
    monkeypatch.setattr(rundata, "MAX_LAYER_SERIES", 10)
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for step in range(5):
        layers = {f"x{step}.{i}": {"grade": 3, "attn_entropy_min_norm": 0.5} for i in range(60)}
        msg = {"v": 1, "type": "report", "gen": 1, "rank": 0, "step": step, "layers": layers}
        lines.append(json.dumps(msg))
    (run / "reports.jsonl").write_text("\n".join(lines) + "\n")
    data = load_run(run)
    g = data.generations[1]
    assert g.layer_count("grade") == (100, True)
    assert len(data.layer_names) <= 2 * 10  # the layers kept, not every name seen
    page = render(data, secrets=())
    assert page.count("+at least 90 layers not shown") == 2


@pytest.mark.parametrize("argv", [["--smoke"]])
def test_the_benchmark_runs_and_prints_its_table(argv, capsys):
    rows = bench_report().main(argv)
    assert [(r["names"], r["steps"]) for r in rows] == [(600, 20), (600, 40)]
    assert all(r["falling_shown"] and r["series_kept"] <= 2 * MAX_LAYER_SERIES for r in rows)
    assert "names  steps   load s" in capsys.readouterr().out
