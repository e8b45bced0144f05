"""Seeds x variants of the diverging example, WITHOUT any supervisor.

Runs ``examples/gpt_diverge.py`` (its ``train()``, in a fresh process per run)
for each seed and each variant:

- ``default``  the diverging recipe;
- ``stable``   ``--stable``: the same schedule scaled x0.1 (the control);
- ``qk-norm``  ``--qk-norm``: RMSNorm on q and k per head (the known fix);

and prints one row per run: the step of the first loss spike (if any), the
min loss, the final loss (mean of the last 50 steps), the largest attention
logit seen (recorded every ``--logit-every`` steps) and the wall time.

World size 1 here: each run is one process with ``--batch 32``, i.e. the
global batch of the 2-rank job (2 x 16); the example's data are a function of
``(seed, step)`` split across ranks, so it sees the same batches the 2-rank
job does (the gradients differ only by float rounding of the all-reduce).

    python3 bench/example_seeds.py                 # 3 seeds x 3 variants, one run at a time
    python3 bench/example_seeds.py --jobs 2        # two runs at a time (one core each)
    python3 bench/example_seeds.py --seeds 0 --variants default -- --steps 1200
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import sys
import time

from common import split_passthrough

VARIANTS = {"default": [], "stable": ["--stable"], "qk-norm": ["--qk-norm"]}


def example_argv(seed: int, variant: str, extra: list[str]) -> list[str]:
    """The example's arguments for one world-size-1 run of ``seed`` and ``variant``: the 2-rank
    job's global batch (2 x 16), quiet, no checkpoints, never stopping on NaNs; ``extra`` last."""
    return [
        *("--seed", str(seed), "--batch", "32", "--log-every", "0", "--ckpt-every", "0"),
        *("--nan-patience", "0", *VARIANTS[variant], *extra),
    ]


def run_one(seed: int, variant: str, extra: list[str], progress_every: int) -> dict:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch

    torch.set_num_threads(1)
    from spikeguard.examples import gpt_diverge as ex

    argv = ["--no-sdk", "--logit-every", "50", *example_argv(seed, variant, extra)]
    args = ex.parse_args(argv)
    tag = f"[seed {seed} {variant}]"
    steps: list[int] = []
    losses: list[float] = []
    logits: list[float] = []

    def on_step(rec: dict) -> None:
        steps.append(rec["step"])
        losses.append(rec["loss"])
        if rec["max_logit"] is not None:
            logits.append(rec["max_logit"])
        if progress_every and rec["step"] % progress_every == 0:
            print(
                f"{tag} step {rec['step']}/{args.steps} loss {rec['loss']:.3f} "
                f"lr {rec['lr']:.2e} ({rec['t']:.0f}s)",
                flush=True,
            )

    print(f"{tag} start: {' '.join(argv)}", flush=True)
    t0 = time.time()
    ex.train(args, on_step=on_step)
    wall = time.time() - t0
    tail = losses[-50:]
    finite = [x for x in losses if math.isfinite(x)]
    row = {
        "seed": seed,
        "variant": variant,
        "spike_step": ex.first_spike(losses, steps),
        "min_loss": min(finite) if finite else float("nan"),
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "max_attn_logit": max(logits) if logits else float("nan"),
        "steps": len(steps),
        "wall_s": wall,
    }
    print(
        f"{tag} done in {wall:.0f}s: spike {row['spike_step']}, final {row['final_loss']:.3f}",
        flush=True,
    )
    return row


def fmt_table(rows: list[dict]) -> str:
    head = (
        f"{'seed':>4}  {'variant':<8}  {'spike step':>10}  {'min loss':>8}  {'final loss':>10}  "
        f"{'max attn logit':>14}  {'wall s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        spike = "-" if r["spike_step"] is None else str(r["spike_step"])
        lines.append(
            f"{r['seed']:>4}  {r['variant']:<8}  {spike:>10}  {r['min_loss']:>8.3f}  "
            f"{r['final_loss']:>10.3f}  {r['max_attn_logit']:>14.4g}  {r['wall_s']:>6.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="arguments after -- go to gpt_diverge.py"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses one core)")
    p.add_argument("--progress-every", type=int, default=250, help="progress line every N steps")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)

    combos = [(s, v) for s in args.seeds for v in args.variants]
    print(
        f"example_seeds: {len(combos)} runs, {args.jobs} at a time, "
        "world size 1 (batch 32 = 2 ranks x 16)",
        flush=True,
    )
    t0 = time.time()
    rows: dict[tuple[int, str], dict] = {}
    ctx = mp.get_context("spawn")  # a fresh interpreter per run: no state shared between runs
    with cf.ProcessPoolExecutor(
        max_workers=max(1, args.jobs), mp_context=ctx, max_tasks_per_child=1
    ) as pool:
        futs = {pool.submit(run_one, s, v, extra, args.progress_every): (s, v) for s, v in combos}
        for n, fut in enumerate(cf.as_completed(futs), 1):
            rows[futs[fut]] = fut.result()
            print(f"-- {n}/{len(combos)} runs done ({time.time() - t0:.0f}s)", flush=True)
    ordered = [rows[c] for c in combos]
    print()
    print(fmt_table(ordered))
    for v in args.variants:
        sub = [r for r in ordered if r["variant"] == v]
        n_spike = sum(r["spike_step"] is not None for r in sub)
        mean_final = sum(r["final_loss"] for r in sub) / len(sub)
        print(f"{v:<8}: spiked {n_spike}/{len(sub)}, mean final loss {mean_final:.3f}")
    print(f"total wall {time.time() - t0:.0f}s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(ordered, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
