"""Probe overhead: training steps/s of the example with the SDK against without it.

Runs ``examples/gpt_diverge.py``'s training loop (world size 1, batch 16 x 64, one torch
thread, ``--steps`` steps, no checkpoints) in this process, in three variants alternated round
by round (the order rotated each round, so machine noise hits all of them alike):

* ``no-sdk``     ``--no-sdk``: spikeguard is not imported at all;
* ``sdk/200``    the SDK at its default sampling (probes every 200 steps), reporting every step
  to a JSONL file (encoding and the writer thread included);
* ``sdk/10``     the same, probing every 10 steps.

Per variant: the median steps/s over the rounds, and the slowdown against ``no-sdk`` (the
median of the per-round ratios, each ratio from runs of the same round). Target: at most
1.01 at the default sampling. The per-probe cost of the effective rank is
``bench/bench_erank.py``.

    python3 bench/bench_overhead.py [--steps 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from common import interleaved, standalone_rank, table

VARIANTS = {"no-sdk": None, "sdk/200": 200, "sdk/10": 10}


def run_once(variant: str, steps: int, report_dir: str) -> float:
    """Steps/s of one training run of ``steps`` steps in ``variant``."""
    from spikeguard.examples import gpt_diverge as ex

    every = VARIANTS[variant]
    argv = ["--steps", str(steps), "--log-every", "0", "--ckpt-every", "0", "--nan-patience", "0"]
    if every is None:
        argv.append("--no-sdk")
    else:
        path = os.path.join(report_dir, f"{variant.replace('/', '-')}.jsonl")
        argv += ["--sample-every", str(every), "--report", f"jsonl://{path}"]
    result = ex.train(ex.parse_args(argv))
    return (result["last_step"] + 1) / result["wall"]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print its table; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="training steps per run")
    p.add_argument("--rounds", type=int, default=5, help="runs per variant, alternated")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds = 5, 1
    standalone_rank()  # nothing from a surrounding supervised run may steer the SDK here

    import torch

    torch.set_num_threads(1)
    names = list(VARIANTS)
    print(
        f"bench_overhead: {args.rounds} round(s) x {names}, {args.steps} steps each "
        "(world size 1, batch 16x64, 1 thread)",
        flush=True,
    )
    report_dir = tempfile.mkdtemp(prefix="sg-overhead-")
    run_once("sdk/10", min(args.steps, 20), report_dir)  # warm-up: imports, allocator, corpus
    rate: dict[tuple[int, str], float] = {}
    for r, variant in interleaved(names, args.rounds):
        t0 = time.time()
        rate[(r, variant)] = run_once(variant, args.steps, report_dir)
        print(
            f"  round {r + 1} {variant:<8} {rate[(r, variant)]:.1f} steps/s "
            f"({time.time() - t0:.1f}s)",
            flush=True,
        )
    rows = []
    for variant in names:
        mine = [rate[(r, variant)] for r in range(args.rounds)]
        ratios = [rate[(r, "no-sdk")] / rate[(r, variant)] for r in range(args.rounds)]
        rows.append(
            {
                "variant": variant,
                "steps/s": statistics.median(mine),
                "min": min(mine),
                "max": max(mine),
                "slowdown": statistics.median(ratios),
                "worst round": max(ratios),
            }
        )
    print()
    print(
        table(
            rows,
            (
                ("variant", ""),
                ("steps/s", ".2f"),
                ("min", ".2f"),
                ("max", ".2f"),
                ("slowdown", ".4f"),
                ("worst round", ".4f"),
            ),
        )
    )
    default = next(row for row in rows if row["variant"] == "sdk/200")
    verdict = "met" if default["slowdown"] <= 1.01 else "MISSED"
    print(f"target slowdown <= 1.01 at the default sampling: {verdict}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
