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

The ``timing`` column is the part of an SDK variant's step the step timing costs (``step_time``
and ``phases``: the forward hooks' clock reads, a ``data`` phase, the fields in the message), as
a ratio: (variant's step + timing cost) / variant's step. The cost is measured apart, since a
few microseconds are far below the noise of a training run: ``--timing-steps`` calls of a tiny
forward, one ``sg.phase("data")`` and ``sg.step()`` with ``attach(step_timing=True)`` and
with ``False``, alternated over the rounds, in CPU time of the process (a descheduled process
waits for longer than the cost); cost = the median over rounds of the per-step difference
(printed below the table).

    python3 bench/bench_overhead.py [--steps 400] [--rounds 5] [--timing-steps 5000]
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


TIMING_VARIANTS = ("timing", "no-timing")


def timing_once(timing: bool, steps: int, report_dir: str) -> float:
    """CPU seconds (the process's, its writer thread included) per step of ``steps`` steps of a
    tiny forward, a ``data`` phase and ``sg.step()``, with the step timing on or off (reporting
    to a JSONL file). CPU time, not wall time: on a shared machine the time a process waits
    for a core is many times the microseconds measured."""
    import torch
    from spikeguard.workers import attach

    model = torch.nn.Linear(4, 4)
    x = torch.zeros(1, 4)
    path = os.path.join(report_dir, f"timing-{timing}.jsonl")
    sg = attach(model, report=f"jsonl://{path}", sample_every=10**9, step_timing=timing)
    t0 = time.process_time()
    for step in range(steps):
        with sg.phase("data"):
            pass
        model(x)
        sg.step(step=step, loss=1.0)
    seconds = (time.process_time() - t0) / steps
    sg.close()
    return seconds


def timing_cost(steps: int, rounds: int, report_dir: str) -> float:
    """The step timing's cost in seconds per step (see the module docstring)."""
    timing_once(True, min(steps, 200), report_dir)  # warm-up
    per_step: dict[tuple[int, str], float] = {}
    for r, variant in interleaved(TIMING_VARIANTS, rounds):
        per_step[(r, variant)] = timing_once(variant == "timing", steps, report_dir)
    cost = statistics.median(
        per_step[(r, "timing")] - per_step[(r, "no-timing")] for r in range(rounds)
    )
    without = statistics.median(per_step[(r, "no-timing")] for r in range(rounds))
    print(
        f"step timing: {cost * 1e6:.2f} us a step (sg.step() and a tiny forward without it: "
        f"{without * 1e6:.1f} us; median of {rounds} round(s) x {steps} steps)",
        flush=True,
    )
    return cost


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print its table; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="training steps per run")
    p.add_argument("--rounds", type=int, default=5, help="runs per variant, alternated")
    p.add_argument(
        "--timing-steps", type=int, default=5000, help="steps per run of the timing's cost"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.timing_steps = 5, 1, 20
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
    cost = timing_cost(args.timing_steps, args.rounds, report_dir)
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
                # the timing's share of this variant's step (none without the SDK)
                "timing": None if VARIANTS[variant] is None else 1 + cost * statistics.median(mine),
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
                ("timing", ".5f"),
            ),
        )
    )
    default = next(row for row in rows if row["variant"] == "sdk/200")
    verdict = "met" if default["slowdown"] <= 1.01 else "MISSED"
    print(f"target slowdown <= 1.01 at the default sampling: {verdict}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
