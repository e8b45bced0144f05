"""Effective-rank paths side by side: what the SDK computes vs ``torch.linalg.svdvals``.

For each shape, one run times every way of getting the erank (best of ``--repeat``; the paths
alternate inside each repeat, so machine noise hits them alike) and reports each path's speed-up
over ``torch.linalg.svdvals`` (the exact reference, float32) and its relative erank error
against it on two spectra:

* ``real``: a power law (s_i ~ i^-0.5) with three massive-activation outliers, a typical
  healthy activation spectrum;
* ``floor``: eight strong directions over a flat noise floor at 1 %, a collapsing layer and the
  hard case for randomized methods.

Paths: ``auto`` is :func:`spikeguard.workers.measure.effective_rank` as the probes call it (the
path its shape picks, named in the ``picks`` column); ``gram`` and ``lowrank`` force one path
(``gram`` only where the smaller side is at most 4096: a float64 Gram beyond that takes
minutes). Every time includes the erank from the singular values and the finiteness check.
Target (issue 15): ``auto`` at least 5x faster than svdvals from 8192x1024 up, error <= 1 %.

    python3 bench/bench_erank.py [--threads 1] [--repeat 3] [--shapes 2048x64 8192x1024 ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from common import table
from spikeguard.workers import measure as S

K = 32
DEFAULT_SHAPES = ("2048x64", "8192x1024", "16384x4096")
GRAM_LIMIT = 4096
"""The forced ``gram`` path is timed only while the smaller side is at most this."""


def spectrum_matrix(rows: int, d: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A ``rows x d`` float32 matrix with the ``kind`` spectrum (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    r = min(rows, d)
    i = torch.arange(1, r + 1, dtype=torch.float32)
    if kind == "real":
        s = i**-0.5
        s[:3] *= 30
    else:
        s = torch.full((r,), 0.01)
        s[:8] = 1.0
    return (torch.randn(rows, r, generator=g) * s) @ torch.randn(r, d, generator=g) / math.sqrt(d)


def erank_of(s: torch.Tensor) -> float:
    """The erank of the top-``K`` singular values ``s`` (descending), in float64."""
    s = s[:K].double()
    p = s / s.sum()
    return math.exp(float(torch.special.entr(p).sum()))


def svdvals_erank(x: torch.Tensor) -> float:
    """The reference: every singular value (``torch.linalg.svdvals``), then the erank."""
    if not bool(torch.isfinite(x).all()):
        return math.nan
    return erank_of(torch.linalg.svdvals(x))


def paths_for(rows: int, d: int) -> dict[str, Callable[[torch.Tensor], float]]:
    """The paths timed for a ``rows x d`` matrix, the reference first."""
    paths: dict[str, Callable[[torch.Tensor], float]] = {
        "svdvals": svdvals_erank,
        "auto": lambda x: S.effective_rank(x, K),
        "lowrank": lambda x: S.effective_rank(x, K, method="lowrank"),
    }
    if min(rows, d) <= GRAM_LIMIT:
        paths["gram"] = lambda x: S.effective_rank(x, K, method="gram")
    return paths


def measure(rows: int, d: int, repeat: int) -> list[dict[str, Any]]:
    """One row per path for a ``rows x d`` shape: best time, speed-up and erank errors."""
    xs = {kind: spectrum_matrix(rows, d, kind) for kind in ("real", "floor")}
    paths = paths_for(rows, d)
    names = list(paths)
    best = dict.fromkeys(names, math.inf)
    for r in range(repeat + 1):  # round 0 warms up (allocations, lazy init)
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            t0 = time.perf_counter()
            paths[name](xs["real"])
            if r > 0:
                best[name] = min(best[name], time.perf_counter() - t0)
    ref = {kind: svdvals_erank(x) for kind, x in xs.items()}
    rows_out = []
    for name in names:
        errs = {kind: (paths[name](x) - ref[kind]) / ref[kind] for kind, x in xs.items()}
        rows_out.append(
            {
                "shape": f"{rows}x{d}",
                "path": name,
                "picks": S.choose_method(rows, d) if name == "auto" else name,
                "ms": best[name] * 1e3,
                "speed-up": best["svdvals"] / best[name],
                "err real": errs["real"],
                "err floor": errs["floor"],
            }
        )
    return rows_out


COLUMNS = (
    ("shape", ""),
    ("path", ""),
    ("picks", ""),
    ("ms", ".1f"),
    ("speed-up", ".1f"),
    ("err real", "+.1e"),
    ("err floor", "+.1e"),
)


def parse_shape(text: str) -> tuple[int, int]:
    """``"ROWSxD"`` as two positive ints."""
    try:
        rows, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a shape is ROWSxD, e.g. 8192x1024; got {text!r}"
        ) from None
    if rows < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"a shape has positive sides; got {text!r}")
    return rows, d


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print its table; returns the rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: shared machines)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats (best of)")
    ap.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in DEFAULT_SHAPES]
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.repeat = [(256, 32), (512, 160)], 1
    torch.set_num_threads(args.threads)
    print(
        f"bench_erank: torch {torch.__version__}, {args.threads} thread(s), k={K}, best of "
        f"{args.repeat}; err = relative erank error vs svdvals (real / floor spectrum)",
        flush=True,
    )
    rows = []
    for r, d in args.shapes:
        t0 = time.time()
        mine = measure(r, d, args.repeat)
        auto = next(row for row in mine if row["path"] == "auto")
        print(
            f"  {r}x{d}: auto ({auto['picks']}) {auto['ms']:.1f} ms, "
            f"{auto['speed-up']:.1f}x svdvals ({time.time() - t0:.0f}s)",
            flush=True,
        )
        rows += mine
    print()
    print(table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
