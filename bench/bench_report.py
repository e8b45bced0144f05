"""How long ``spikeguard report`` takes on a run whose ranks reported very many layer names.

A synthetic ``reports.jsonl`` (:func:`write_synthetic`): a few real layers reported on every
sampled step, one of which falls (its grade drops to S0) near the end, and ``--names`` distinct
other layer names spread over the steps (each reported once, on one step), as an old run or a
hostile rank could leave. The report reads it, keeps per generation and heatmap signal only the
worst layers (``rundata.MAX_LAYER_SERIES``) and renders the page; the table gives the seconds of
each part and how many layer series the fold kept.

    python3 bench/bench_report.py                        # 40k names over 200 and 400 steps
    python3 bench/bench_report.py --names 10000 --steps 100 200
    python3 bench/bench_report.py --smoke                # tiny sizes (tests/test_report_bounds.py)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spikeguard.supervisor.observe.report import render
from spikeguard.supervisor.observe.rundata import load_run

REAL_LAYERS = 8
FALLING = "blocks.5.attn"
"""The real layer that falls in the last tenth of the run (the one the report must show)."""


def write_synthetic(
    run_dir: Path, *, names: int, steps: int, ranks: int = 2, seed: int = 0
) -> Path:
    """Write ``run_dir/reports.jsonl``: ``steps`` sampled steps of ``ranks`` ranks, the
    :data:`REAL_LAYERS` real layers on every one, ``names`` other layer names spread evenly
    over the steps (graded S2..S6), :data:`FALLING` graded S0 in the last tenth. Returns the
    file's path."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "reports.jsonl"
    per_step = -(-names // steps) if steps else 0
    made = 0
    with path.open("w") as f:
        for step in range(steps):
            late = step >= steps - max(1, steps // 10)
            for rank in range(ranks):
                layers: dict[str, dict[str, Any]] = {}
                for i in range(REAL_LAYERS):
                    name = f"blocks.{i}.attn"
                    fell = name == FALLING and late
                    layers[name] = {
                        "grade": 0 if fell else 7,
                        "attn_entropy_min_norm": 0.05 if fell else 0.8,
                    }
                if rank == 0:
                    for j in range(made, min(names, made + per_step)):
                        layers[f"noise.{j}"] = {
                            "grade": rng.randint(2, 6),
                            "attn_entropy_min_norm": rng.uniform(0.2, 0.7),
                        }
                msg = {"v": 1, "type": "report", "run": "bench", "gen": 1, "rank": rank}
                msg.update(step=step, t=0, loss=2.0, grad_norm=1.0, lr=1e-3)
                msg.update(
                    layers=layers, summary={"grade": min(v["grade"] for v in layers.values())}
                )
                f.write(json.dumps(msg) + "\n")
            made = min(names, made + per_step)
    return path


def measure(names: int, steps: int) -> dict[str, Any]:
    """One row: build the file, then time :func:`load_run` and :func:`render` on it."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        write_synthetic(run, names=names, steps=steps)
        t0 = time.perf_counter()
        data = load_run(run)
        t1 = time.perf_counter()
        page = render(data, secrets=())
        t2 = time.perf_counter()
    kept = sum(len(s) for g in data.generations.values() for s in getattr(g, "series", {}).values())
    return {
        "names": names,
        "steps": steps,
        "load_s": t1 - t0,
        "render_s": t2 - t1,
        "series_kept": kept,
        "falling_shown": f">g1 {FALLING}<" in page,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", type=int, default=40_000)
    p.add_argument("--steps", type=int, nargs="+", default=[200, 400])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests")
    a = p.parse_args(argv)
    sizes = [(600, 20), (600, 40)] if a.smoke else [(a.names, s) for s in a.steps]
    rows = [measure(n, s) for n, s in sizes]
    print(f"{'names':>8} {'steps':>6} {'load s':>8} {'render s':>9} {'kept':>6} falling shown")
    for r in rows:
        print(
            f"{r['names']:>8} {r['steps']:>6} {r['load_s']:>8.2f} {r['render_s']:>9.2f} "
            f"{r['series_kept']:>6} {r['falling_shown']}"
        )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
