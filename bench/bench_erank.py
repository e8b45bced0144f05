"""Effective-rank paths side by side: svdvals vs Gram+eigvalsh vs randomized.

For each shape, one run times (best of ``--repeat``) every way of getting the
top-k singular values and the erank from them, and reports each fast path's
speed-up over ``torch.linalg.svdvals`` and its relative erank error against it
on two spectra:

* ``real``: a power law (s_i ~ i^-0.5) with three massive-activation outliers,
  a typical healthy activation spectrum;
* ``floor``: eight strong directions over a flat noise floor at 1 %, a
  collapsing layer and the hard case for randomized methods.

Columns ``lowrank`` are :func:`spikeguard.workers.signals.effective_rank` with
``method="lowrank"`` (block Krylov, block k+16, depth 4, private generator);
``svd_lowrank`` is ``torch.svd_lowrank(q=k+8, niter=2)`` for comparison.

    python3 bench/bench_erank.py [--threads 1] [--repeat 3] [--large]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from spikeguard.workers import signals as S

K = 32


def spectrum_matrix(rows: int, d: int, kind: str, seed: int = 0) -> torch.Tensor:
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
    s = s[:K].double()
    p = s / s.sum()
    return math.exp(float(torch.special.entr(p).sum()))


def torch_lowrank(x: torch.Tensor) -> torch.Tensor:
    return torch.svd_lowrank(x, q=K + 8, niter=2)[1]


PATHS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "svdvals": lambda x: torch.linalg.svdvals(x),
    "gram": lambda x: S.top_singular_values(x, K, method="gram"),
    "lowrank": lambda x: S.top_singular_values(x, K, method="lowrank"),
    "svd_lowrank": torch_lowrank,
}


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: shared machines)"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--large", action="store_true", help="add 2048x4096 (svdvals takes seconds on CPU)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(4096, 256), (2048, 1024), (8192, 1024), (2048, 2048)] + (
        [(2048, 4096)] if args.large else []
    )

    print(
        f"torch {torch.__version__}, {args.threads} thread(s), k={K}, best of {args.repeat}; "
        f"err = relative erank error vs svdvals (real / floor spectrum)"
    )
    head = f"{'shape':>11} {'auto':>7} {'svdvals':>9}"
    for name in ("gram", "lowrank", "svd_lowrank"):
        head += f" | {name + ' ms':>15} {'x':>5} {'err real':>9} {'err floor':>9}"
    print(head)
    print("-" * len(head))
    for rows, d in shapes:
        xs = {kind: spectrum_matrix(rows, d, kind) for kind in ("real", "floor")}
        real = xs["real"]
        ms = {name: best_ms(lambda f=fn, x=real: f(x), args.repeat) for name, fn in PATHS.items()}
        ref = {kind: erank_of(PATHS["svdvals"](x)) for kind, x in xs.items()}
        line = f"{rows:>5}x{d:<5} {S.choose_method(rows, d):>7} {ms['svdvals']:>7.1f}ms"
        for name in ("gram", "lowrank", "svd_lowrank"):
            errs = [
                (erank_of(PATHS[name](xs[kind])) - ref[kind]) / ref[kind]
                for kind in ("real", "floor")
            ]
            line += (
                f" | {ms[name]:>13.1f}ms {ms['svdvals'] / ms[name]:>4.1f}x"
                f" {errs[0]:>+9.1e} {errs[1]:>+9.1e}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
