"""Detection quality: what the default policy catches on the example, and how early.

Three parts, all on ``examples/gpt_diverge.py`` (the recipe: see the example's docstring):

1. **Without spikeguard.** Each seed of the diverging recipe (``default``) and of the two
   stable controls (``stable``: the LR x0.1; ``qk-norm``: RMSNorm on q and k) trains in its own
   process (world size 1 with the 2-rank job's global batch, 2 x 16, as
   ``bench/example_seeds.py`` does), with the SDK reporting to a JSONL file, probing every 25
   steps as under ``spikeguard demo``. Nothing acts on the reports.
2. **Replay.** Over each run's reports, :func:`spikeguard.policies.replay` of the built-in
   ``default`` policy names the step the supervisor would first have recovered at, and a
   per-signal policy (:data:`SIGNAL_RULES`: one rule per signal, the default policy's own rule
   where it has one, otherwise a rule of the same shape, all ``notify`` so each fires
   independently) names the step each signal would first have fired at.
3. **Supervised.** Each diverging seed runs again under the supervisor: ``spikeguard demo
   --seed S`` (2 ranks on an embedded local Ray, the default policy, checkpoints every 50
   steps), one run at a time. Its first incident step and its final loss (the mean over the
   last 50 steps of the final generation of the ranks' mean loss) are read from the run
   directory.

**Onset** (the loss spike without spikeguard) is :func:`spikeguard.examples.gpt_diverge.
first_spike`: the first step whose loss is above the best earlier 20-step mean by more than
0.15 nats, inside the first 20-step window whose mean is 0.3 nats above that best (or the first
non-finite loss). The recipe's divergence is a climb of 0.5-0.9 nats over ~100 steps rather
than a jump: a ratio rule (1.5x the trailing median) lags it by tens of steps or never fires,
while the mean-above-best rule marks where the excursion began and stays silent on the
controls. **Lead** of a signal = onset - the step its rule fires (positive: before the spike;
negative: after it, the signal lags).

Targets (issue 15): the supervisor recovers before the onset in >= 4 of 5 seeds; the default
policy recovers zero times on the controls; the supervised final loss within 5 % of the stable
control's.

    python3 bench/bench_detection.py [--seeds 0 1 2 3 4] [--control-seeds 0 1 2] [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import split_passthrough, standalone_rank, table
from example_seeds import example_argv

SAMPLE_EVERY = 25
"""The probe interval of ``spikeguard demo`` (and so of these runs)."""

SIGNAL_RULES = """
version: 1
name: signals
description: One rule per signal, to see when each would fire on its own.
warm_in: 300 steps
rules:
  - name: grade             # the default policy's grade-drop
    when: {signal: grade, drops_by: 3, within: 2 samples}
    layers: "*"
    action: notify
  - name: rank-ratio        # the entropy rule's shape, on the erank ratio
    when: erank_ratio < 0.5 * median(5 samples)
    layers: "*"
    for: 2 samples
    action: notify
  - name: entropy           # the default policy's entropy-collapse
    when: attn_entropy_min_norm < 0.5 * median(5 samples)
    layers: "*"
    for: 2 samples
    action: notify
  - name: max-logit         # a logit growing 3x over its recent median
    when: {signal: max_logit, above_median: 3, window: 5 samples}
    layers: "*"
    for: 2 samples
    action: notify
  - name: log-z             # the LM head's log-partition growing 1.5x over its median
    when: {signal: logz_max, above_median: 1.5, window: 5 samples}
    for: 2 samples
    action: notify
  - name: grad-norm         # the loss rule's shape, on the gradient norm
    when: {signal: grad_norm, above_median: 3, z_above: 6, window: 50 steps}
    for: 3 steps
    action: notify
  - name: loss              # the default policy's loss-spike
    when: {signal: loss, above_median: 1.3, z_above: 6, window: 50 steps}
    for: 3 steps
    action: notify
"""
SIGNALS = {
    "grade": "grade",
    "rank-ratio": "rank ratio",
    "entropy": "entropy",
    "max-logit": "max logit",
    "log-z": "log Z",
    "grad-norm": "grad norm",
    "loss": "loss",
}
"""Rule name in :data:`SIGNAL_RULES` -> column name."""


def train_unsupervised(
    seed: int, variant: str, out_dir: str, extra: list[str], progress_every: int
) -> dict[str, Any]:
    """One run without a supervisor, its reports in ``out_dir``; returns its path and losses."""
    standalone_rank()
    import torch

    torch.set_num_threads(1)
    from spikeguard.examples import gpt_diverge as ex

    report = os.path.join(out_dir, f"seed{seed}-{variant}.jsonl")
    if os.path.exists(report):
        os.unlink(report)
    more = ["--sample-every", str(SAMPLE_EVERY), "--report", f"jsonl://{report}", *extra]
    argv = example_argv(seed, variant, more)
    args = ex.parse_args(argv)
    tag = f"[seed {seed} {variant}]"

    def on_step(rec: dict) -> None:
        if progress_every and rec["step"] % progress_every == 0:
            print(f"  {tag} step {rec['step']}/{args.steps} loss {rec['loss']:.3f}", flush=True)

    t0 = time.time()
    result = ex.train(args, on_step=on_step)
    steps = [s for s, _ in result["history"]]
    losses = [v for _, v in result["history"]]
    return {
        "seed": seed,
        "variant": variant,
        "report": report,
        "steps": steps,
        "losses": losses,
        "wall": time.time() - t0,
    }


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a (possibly gzipped) JSON-lines file; torn lines skipped."""
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                out.append(msg)
    return out


def first_steps(policy: Any, messages: list[dict[str, Any]]) -> dict[str, int]:
    """The first step each rule of ``policy`` decides at, over ``messages`` (replayed)."""
    from spikeguard.policies import replay

    out: dict[str, int] = {}
    for d in replay(policy, messages):
        if not d.resolved and d.rule not in out:
            out[d.rule] = d.step
    return out


def analyse_unsupervised(run: dict[str, Any]) -> dict[str, Any]:
    """Onset, the default policy's first recovery and every signal's first firing of one run."""
    from spikeguard.examples.gpt_diverge import first_spike
    from spikeguard.policies import load_policy, replay
    from spikeguard.policies.loader import load_policy_text

    messages = read_jsonl(run["report"])
    default = load_policy("default")
    recovers = [d for d in replay(default, messages) if d.action == "recover"]
    signals = first_steps(load_policy_text(SIGNAL_RULES, "bench signals"), messages)
    losses = run["losses"]
    finite = [v for v in losses if math.isfinite(v)]
    tail = losses[-50:]
    return {
        "seed": run["seed"],
        "variant": run["variant"],
        "onset": first_spike(losses, run["steps"]),
        "recover": recovers[0].step if recovers else None,
        "rule": recovers[0].rule if recovers else None,
        "recoveries": len(recovers),
        "fired": signals,
        "min loss": min(finite) if finite else math.nan,
        "final loss": sum(tail) / len(tail) if tail else math.nan,
        "wall s": run["wall"],
    }


def run_unsupervised(
    combos: list[tuple[int, str]], out: Path, extra: list[str], args: argparse.Namespace
) -> dict[tuple[int, str], dict[str, Any]]:
    """Part 1: every run, ``args.jobs`` at a time (or, with ``--reuse``, what ``out`` holds)."""
    saved = out / "unsupervised.json"
    runs: dict[tuple[int, str], dict[str, Any]] = {}
    if args.reuse and saved.exists():
        for run in json.loads(saved.read_text()):
            runs[(run["seed"], run["variant"])] = run
    todo = [c for c in combos if c not in runs]
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futs = {
            pool.submit(train_unsupervised, s, v, str(out), extra, args.progress_every): (s, v)
            for s, v in todo
        }
        for n, fut in enumerate(cf.as_completed(futs), 1):
            runs[futs[fut]] = fut.result()
            print(f"-- {n}/{len(todo)} unsupervised runs done ({time.time() - t0:.0f}s)")
            saved.write_text(json.dumps(list(runs.values())))
    return runs


def journal_of(run_dir: Path) -> list[dict[str, Any]]:
    """The run directory's journal events (none when it has no journal)."""
    path = run_dir / "journal.jsonl"
    return read_jsonl(path) if path.exists() else []


def supervised(seed: int, run_dir: Path, steps: int | None) -> dict[str, Any]:
    """``spikeguard demo --seed SEED`` in a subprocess; its first incident and final loss."""
    exe = Path(sys.executable).with_name("spikeguard")
    cmd = [str(exe), "demo", "--seed", str(seed), "--run-dir", str(run_dir), "--no-dashboard"]
    if steps:
        cmd += ["--steps", str(steps)]
    t0 = time.time()
    log = run_dir.with_suffix(".log")
    with open(log, "wb") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    return {**read_supervised(run_dir), "exit": code, "sup wall s": time.time() - t0}


def read_supervised(run_dir: Path) -> dict[str, Any]:
    """What a supervised run directory says: its incidents, rollbacks and final loss."""
    journal = journal_of(run_dir)
    incidents = [e for e in journal if e.get("kind") == "incident"]
    plain = run_dir / "reports.jsonl"
    reports = read_jsonl(plain if plain.exists() else run_dir / "reports.jsonl.gz")
    last_gen = max((m.get("gen", 0) for m in reports), default=0)
    per_step: dict[int, list[float]] = {}
    for m in reports:
        if m.get("gen") == last_gen and m.get("type") in ("heartbeat", "report"):
            loss = m.get("loss")
            if isinstance(loss, (int, float)):
                per_step.setdefault(m["step"], []).append(float(loss))
    means = [sum(v) / len(v) for _, v in sorted(per_step.items())]
    tail = means[-50:]
    lr_cuts = [e for e in journal if e.get("kind") == "lr_cut"]
    return {
        "exit": 0 if any(e.get("kind") == "completed" for e in journal) else None,
        "first incident": _incident_step(incidents[0]) if incidents else None,
        "incident rule": incidents[0].get("rule") if incidents else None,
        "incidents": len(incidents),
        "rollbacks": sum(e.get("kind") == "rollback" for e in journal),
        "lr scale": lr_cuts[-1].get("lr_scale") if lr_cuts else 1.0,
        "supervised loss": sum(tail) / len(tail) if tail else math.nan,
        "sup wall s": None,
    }


def _incident_step(event: dict[str, Any]) -> int | None:
    step = event.get("step")
    return step if isinstance(step, int) else None


def lead(onset: int | None, fired: int | None) -> int | None:
    """Steps from a signal's firing to the onset (positive: before it); None if either is."""
    if onset is None or fired is None:
        return None
    return onset - fired


def plot_leads(rows: list[dict[str, Any]], path: Path) -> None:
    """Lead time per signal per diverging seed (a point each; none where it never fired)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, r in enumerate(rows):
        xs, ys = [], []
        for j, sig in enumerate(SIGNALS):
            v = lead(r["onset"], r["fired"].get(sig))  # rule names
            if v is not None:
                xs.append(j + (i - (len(rows) - 1) / 2) * 0.08)
                ys.append(v)
        ax.scatter(xs, ys, label=f"seed {r['seed']}", s=28)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(SIGNALS)), list(SIGNALS.values()))
    ax.set_ylabel("lead: steps before the loss spike")
    ax.set_title("When each signal's rule fires, against the loss-spike onset (diverging seeds)")
    ax.legend(fontsize=8, ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its tables; returns the rows."""
    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="arguments after -- go to gpt_diverge.py"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--control-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2, choices=(1, 2), help="unsupervised runs at once")
    p.add_argument("--no-supervised", action="store_true", help="skip part 3")
    p.add_argument("--out", default=None, help="keep the reports and run directories here")
    p.add_argument(
        "--reuse", action="store_true", help="reuse the finished runs --out holds (a rerun)"
    )
    p.add_argument("--plot", default="bench/results/detection-lead.png")
    p.add_argument("--progress-every", type=int, default=400)
    p.add_argument("--smoke", action="store_true", help="tiny: 1 seed each, 30 steps, no Ray")
    args = p.parse_args(argv)
    sup_steps = None
    if args.smoke:
        args.seeds, args.control_seeds, args.no_supervised = [0], [0], True
        extra = ["--steps", "30", "--data-bytes", "300000", *extra]
        args.plot = None
    out = Path(args.out or tempfile.mkdtemp(prefix="sg-detection-"))
    out.mkdir(parents=True, exist_ok=True)
    combos = [(s, "default") for s in args.seeds] + [
        (s, v) for v in ("stable", "qk-norm") for s in args.control_seeds
    ]
    print(
        f"bench_detection: {len(combos)} unsupervised runs ({args.jobs} at a time), "
        f"{0 if args.no_supervised else len(args.seeds)} supervised; files in {out}",
        flush=True,
    )
    t0 = time.time()
    runs = run_unsupervised(combos, out, extra, args)
    rows = [analyse_unsupervised(runs[c]) for c in combos]
    diverging = [r for r in rows if r["variant"] == "default"]
    controls = [r for r in rows if r["variant"] != "default"]
    for r in diverging:
        r.update({"supervised loss": None, "first incident": None, "incidents": None})
        if args.no_supervised:
            continue
        print(f"-- supervised seed {r['seed']} (spikeguard demo) ...", flush=True)
        run_dir = out / f"supervised-seed{r['seed']}"
        if args.reuse and any(e.get("kind") == "completed" for e in journal_of(run_dir)):
            r.update(read_supervised(run_dir))
        else:
            r.update(supervised(r["seed"], run_dir, sup_steps))
        print(
            f"   exit {r['exit']}, first incident at {r['first incident']} "
            f"({r['incident rule']}), {r['rollbacks']} rollback(s), final loss "
            f"{r['supervised loss']:.3f}",
            flush=True,
        )
    stable_loss = statistics.mean(r["final loss"] for r in controls if r["variant"] == "stable")
    for r in diverging:
        sup = r.get("supervised loss")
        r["vs stable"] = None if sup is None else sup / stable_loss
        r["first"] = r["first incident"] if r["first incident"] is not None else r["recover"]
        r["before onset"] = (
            None if r["onset"] is None or r["first"] is None else r["first"] < r["onset"]
        )
        for sig, col in SIGNALS.items():
            r[col] = lead(r["onset"], r["fired"].get(sig))
    for r in controls:
        for sig, col in SIGNALS.items():
            r[col] = r["fired"].get(sig)

    print("\nDiverging seeds: onset without spikeguard, recovery, final loss")
    print(
        table(
            diverging,
            (
                ("seed", "d"),
                ("onset", "d"),
                ("recover", "d"),
                ("rule", ""),
                ("first incident", "d"),
                ("before onset", ""),
                ("incidents", "d"),
                ("final loss", ".3f"),
                ("supervised loss", ".3f"),
                ("vs stable", ".3f"),
            ),
        )
    )
    print("\nLead (steps before the onset; negative: the signal lags; '-': never fired)")
    print(table(diverging, (("seed", "d"), *((c, "+d") for c in SIGNALS.values()))))
    print("\nControls: default-policy recoveries and the step each signal's rule would fire")
    print(
        table(
            controls,
            (
                ("seed", "d"),
                ("variant", ""),
                ("onset", "d"),
                ("recoveries", "d"),
                ("final loss", ".3f"),
                *((c, "d") for c in SIGNALS.values()),
            ),
        )
    )
    before = sum(bool(r["before onset"]) for r in diverging)
    false = sum(r["recoveries"] for r in controls)
    sup = [r["vs stable"] for r in diverging if r["vs stable"] is not None]
    print(
        f"\nrecovered before the onset: {before}/{len(diverging)} (target >= 4/5); "
        f"recoveries on the controls: {false} (target 0); stable control final loss "
        f"{stable_loss:.3f}"
        + (f"; supervised/stable: {min(sup):.3f}..{max(sup):.3f} (target <= 1.05)" if sup else "")
    )
    if args.plot:
        plot_leads(diverging, Path(args.plot))
        print(f"plot: {args.plot}")
    print(f"total wall {time.time() - t0:.0f}s")
    return {"diverging": diverging, "controls": controls}


if __name__ == "__main__":
    main()
