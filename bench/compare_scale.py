"""``bench_scale`` on two versions of spikeguard in one run, interleaved: this tree and a base.

A restructuring must not cost the supervisor's speed. This runs ``bench/bench_scale.py`` of this
checkout and of a base revision (its own bench script against its own library, from a
``git worktree`` of this repository), alternating them round by round
(:func:`common.interleaved`), each in a fresh interpreter, and prints their rows side by side
with the ratio new / base of each latency. The base is imported from a folder that maps the
``spikeguard.*`` packages onto the worktree, put first on ``PYTHONPATH``, so the installed
(editable) package does not shadow it.

    python3 bench/compare_scale.py --base e157824 [--ranks 1024] [--rounds 2] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import interleaved, table

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("supervisor", "policies", "workers", "examples")
RUN = (
    "import json, sys; sys.argv[0] = 'bench_scale'; import bench_scale; "
    "rows = bench_scale.main(sys.argv[1:]); print('ROWS ' + json.dumps(rows, default=str))"
)
KEYS = ("spike p99 cpu", "nan p99 cpu", "burst cpu ms", "spike p99 ms", "nan p99 ms", "cores")


def base_tree(rev: str, where: Path) -> tuple[Path, Path]:
    """(the worktree of ``rev``, a folder whose ``spikeguard/`` maps onto it)."""
    tree = where / f"tree-{rev}"
    if not tree.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev],
            check=True,
            capture_output=True,
        )
    ns = where / f"ns-{rev}" / "spikeguard"
    ns.mkdir(parents=True, exist_ok=True)
    for folder in FOLDERS:
        link = ns / folder
        if not link.exists():
            link.symlink_to(tree / folder)
    return tree, ns.parent


def run_once(bench_dir: Path, pythonpath: list[str], args: list[str]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(bench_dir)])}
    out = subprocess.run(
        [sys.executable, "-c", RUN, *args],
        cwd=str(bench_dir),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("ROWS "))
    return json.loads(line[5:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the revision to compare with (e.g. e157824)")
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tmp", default=None, help="bench_scale's --tmp (the run directory)")
    p.add_argument("--work", default=None, help="where the base worktree goes (default: a tmp dir)")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="sg-compare-"))
    tree, ns = base_tree(args.base, work)
    scale_args = ["--ranks", str(args.ranks)] + (["--tmp", args.tmp] if args.tmp else [])
    where = {
        "base": (tree / "bench", [str(ns)]),
        "new": (ROOT / "bench", []),
    }
    results: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    for r, variant in interleaved(["new", "base"], args.rounds):
        bench_dir, path = where[variant]
        print(f"round {r + 1}: {variant} ({args.ranks} ranks) ...", flush=True)
        results[variant] += run_once(bench_dir, path, scale_args)
    rows = []
    for variant in ("base", "new"):
        for i, row in enumerate(results[variant]):
            rows.append({"version": f"{variant} #{i + 1}", **{k: row[k] for k in KEYS}})
    median = {v: {k: statistics.median(x[k] for x in results[v]) for k in KEYS} for v in results}
    ratio = {k: median["new"][k] / median["base"][k] if median["base"][k] else None for k in KEYS}
    rows.append(
        {"version": "new / base (medians)"}
        | {k: "-" if v is None else f"{v:.2f}×" for k, v in ratio.items()}
    )
    cols = (("version", ""),) + tuple((k, ".3f" if k == "cores" else ".1f") for k in KEYS)
    print()
    print(f"base {args.base} vs this tree, {args.ranks} ranks, {args.rounds} rounds interleaved")
    print(table(rows, cols))


if __name__ == "__main__":
    main()
