"""Detection and rescue on the divergence zoo: the default policy on models it was never tuned on.

The zoo (:mod:`zoo_cases`, :mod:`zoo_models`, the rank script :mod:`zoo_train`) is several model
families (the example GPT with and without QK-norm; Qwen3, GPT-NeoX and Gemma built from their
Hugging Face configs; an FSDP2 GPT with sharded checkpoints; a model whose modules no probe
pattern names) and several failure kinds (an LR warm-up overshoot, an output-logit blow-up with no
precursor, a burst of repeated content; a constant LR too high and a data shift, which on these
models plateau or fall rather than spike), each with its stable control, over several seeds.

1. **Without spikeguard.** Every (case, variant, seed) trains alone (world size 1, the 2-rank
   job's global batch), the SDK reporting to a JSONL file with probes every 25 steps; nothing acts.
2. **Replay.** Over each run's reports, :func:`spikeguard.policies.replay` of the built-in
   ``default`` policy gives the step it would first recover at (on a control: every recovery is a
   false alarm), and a per-signal policy (:data:`SIGNAL_RULES`, one ``notify`` rule per signal)
   the step each signal would fire at.
3. **Supervised.** Each diverging (case, seed) runs again under ``spikeguard submit`` (2 gloo ranks
   on an embedded local Ray, the ``default`` policy, checkpoints every 50 steps), one at a time:
   its exit, incidents, escalation and final loss.

**Onset**: :func:`spikeguard.examples.gpt_diverge.first_spike` of the unsupervised diverging
run's loss (the first step above the best earlier 20-step mean by 0.15 nats inside the first
20-step window 0.3 nats above it, or the first non-finite loss). **Lead** of a signal: onset − the
step its rule fires. **Rescued**: the supervised run completed (exit 0, no escalation) with its
final loss (the mean of the last 50 steps) within 5 % of its control's mean final loss.

Targets (issue 23): 0 recoveries on every control; >= 90 % of divergences rescued; detected
(the first incident) before the onset in >= 70 % of them.

    python3 bench/bench_detection.py --out /tmp/zoo            # everything (~1 h on 2 cores)
    python3 bench/bench_detection.py --out /tmp/zoo --reuse    # again, reusing finished runs
    python3 bench/bench_detection.py --cases gpt-burst --seeds 0 --no-supervised
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import table
from zoo_cases import CASES, DIVERGING

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "zoo_train.py"
SAMPLE_EVERY = 25
CKPT_EVERY = 50

SIGNAL_RULES = """
version: 1
name: signals
description: One rule per signal, to see when each would fire on its own.
warm_in: 200 steps
rules:
  - name: grade
    when: {signal: grade, drops_by: 3, within: 2 samples}
    layers: "*"
    action: notify
  - name: entropy
    when: {signal: attn_entropy_min_norm, below_median: 0.5, window: 5 samples}
    layers: "*"
    for: 2 samples
    action: notify
  - name: max-logit
    when: {signal: max_logit, above_median: 2, window: 5 samples}
    layers: "*"
    for: 2 samples
    action: notify
  - name: log-z
    when: {signal: logz_max, above_median: 1.5, window: 5 samples}
    for: 2 samples
    action: notify
  - name: grad-norm
    when: {signal: grad_norm, above_median: 3, z_above: 6, window: 50 steps}
    for: 3 steps
    action: notify
  - name: loss
    when: {signal: loss, above_median: 1.3, z_above: 6, window: 50 steps}
    for: 3 steps
    action: notify
"""
SIGNALS = {
    "grade": "grade",
    "entropy": "entropy",
    "max-logit": "max logit",
    "log-z": "log Z",
    "grad-norm": "grad norm",
    "loss": "loss",
}
"""Rule name in :data:`SIGNAL_RULES` -> column name."""


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


# ---- 1. unsupervised ---------------------------------------------------------------------------
def run_key(case: str, variant: str, seed: int) -> str:
    return f"{case}-{variant}-s{seed}"


def train_alone(
    case: str, variant: str, seed: int, out: Path, reuse: bool, steps: int | None = None
) -> dict[str, Any]:
    """One world-size-1 run in a subprocess (reused when ``reuse`` and it finished before)."""
    key = run_key(case, variant, seed)
    report, metrics, done = out / f"{key}.jsonl", out / f"{key}.metrics.jsonl", out / f"{key}.done"
    if not (reuse and done.exists()):
        for f in (report, metrics, done):
            f.unlink(missing_ok=True)
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        env["MASTER_PORT"] = str(20000 + (abs(hash(key)) % 20000))
        cmd = [sys.executable, str(TRAIN), "--case", case, "--variant", variant]
        cmd += ["--seed", str(seed), "--sample-every", str(SAMPLE_EVERY)]
        cmd += ["--report", f"jsonl://{report}", "--metrics", str(metrics), "--nan-patience", "0"]
        cmd += ["--steps", str(steps)] if steps else []
        t0 = time.time()
        with open(out / f"{key}.log", "wb") as log:
            code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if code != 0:
            raise RuntimeError(f"{key} exited {code}: see {out / (key + '.log')}")
        done.write_text(json.dumps({"wall": time.time() - t0}))
    rows = read_jsonl(metrics)
    return {
        "case": case,
        "variant": variant,
        "seed": seed,
        "report": str(report),
        "steps": [r["step"] for r in rows],
        "losses": [float(r["loss"]) for r in rows],
        "wall": json.loads(done.read_text())["wall"],
    }


def run_all_alone(
    combos: list[tuple[str, str, int]], out: Path, jobs: int, reuse: bool, steps: int | None
) -> dict[tuple[str, str, int], dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    t0 = time.time()
    with cf.ThreadPoolExecutor(jobs) as pool:
        futs = {pool.submit(train_alone, *c, out, reuse, steps): c for c in combos}
        for n, fut in enumerate(cf.as_completed(futs), 1):
            runs[futs[fut]] = fut.result()
            print(
                f"-- {n}/{len(combos)} unsupervised runs done: {run_key(*futs[fut])} "
                f"({time.time() - t0:.0f}s)",
                flush=True,
            )
    return runs


# ---- 2. replay ---------------------------------------------------------------------------------
def first_steps(policy: Any, messages: list[dict[str, Any]]) -> dict[str, int]:
    """The first step each rule of ``policy`` decides at, over ``messages`` (replayed)."""
    from spikeguard.policies import replay

    out: dict[str, int] = {}
    for d in replay(policy, messages):
        if not d.resolved and d.rule not in out:
            out[d.rule] = d.step
    return out


def analyse(run: dict[str, Any], policy: Any, signals: Any) -> dict[str, Any]:
    """Onset, the policy's recoveries and every signal's first firing of one unsupervised run."""
    from spikeguard.examples.gpt_diverge import first_spike
    from spikeguard.policies import replay

    messages = read_jsonl(run["report"])
    recovers = [d for d in replay(policy, messages) if d.action == "recover"]
    losses = run["losses"]
    tail = losses[-50:]
    return {
        "case": run["case"],
        "variant": run["variant"],
        "seed": run["seed"],
        "onset": first_spike(losses, run["steps"]) if run["variant"] == "diverge" else None,
        "recover": recovers[0].step if recovers else None,
        "rule": recovers[0].rule if recovers else None,
        "recoveries": len(recovers),
        "fired": first_steps(signals, messages),
        "final loss": sum(tail) / len(tail) if tail else math.nan,
        "probed": _probed(messages),
    }


def _probed(messages: list[dict[str, Any]]) -> str:
    """Which probe kinds reported anything (the unnamed model's honest answer)."""
    have = set()
    for m in messages:
        for values in (m.get("layers") or {}).values():
            have.update(values)
        have.update(m.get("summary") or {})
    kinds = [("attn", "attn_entropy_min_norm"), ("rank", "grade"), ("logz", "logz_max")]
    return ",".join(k for k, sig in kinds if sig in have) or "none"


# ---- 3. supervised -----------------------------------------------------------------------------
JOB = """name: {name}
entrypoint: {train}
args: {args}
workers: 2
policy: {policy}
timeouts:
  heartbeat_s: 120
  first_heartbeat_s: 300
checkpoints:
  keep_last: 4
  keep_healthy: 3
"""


def supervised(case: str, seed: int, out: Path, policy: str, reuse: bool) -> dict[str, Any]:
    """``spikeguard submit`` of the diverging (case, seed) with 2 ranks; what its run says."""
    run_dir = out / f"{case}-s{seed}"
    metrics = out / f"{case}-s{seed}.metrics.jsonl"
    if not (reuse and (run_dir / "journal.jsonl").exists() and _ended(run_dir)):
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        metrics.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        args = ["--case", case, "--variant", "diverge", "--seed", str(seed)]
        args += ["--sample-every", str(SAMPLE_EVERY), "--ckpt-every", str(CKPT_EVERY)]
        args += ["--metrics", str(metrics)]
        job = out / f"{case}-s{seed}.job.yaml"
        job.write_text(
            JOB.format(name=f"{case}-s{seed}", train=TRAIN, args=json.dumps(args), policy=policy)
        )
        exe = Path(sys.executable).with_name("spikeguard")
        cmd = [str(exe), "submit", str(job), "--run-dir", str(run_dir), "--quiet"]
        cmd += ["--no-dashboard"]
        with open(out / f"{case}-s{seed}.log", "wb") as log:
            subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    return read_supervised(run_dir, metrics)


def _ended(run_dir: Path) -> bool:
    ends = ("completed", "escalated", "failed", "stopped")
    return any(e.get("kind") in ends for e in read_jsonl(run_dir / "journal.jsonl"))


def read_supervised(run_dir: Path, metrics: Path) -> dict[str, Any]:
    """A supervised run's outcome from its journal, and its final loss from rank 0's metrics
    (the last 50 steps of the last generation)."""
    journal = read_jsonl(run_dir / "journal.jsonl") if (run_dir / "journal.jsonl").exists() else []
    incidents = [e for e in journal if e.get("kind") == "incident"]
    rows = read_jsonl(metrics) if metrics.exists() else []
    last_gen = max((r.get("gen", 0) for r in rows), default=0)
    by_step = {r["step"]: float(r["loss"]) for r in rows if r.get("gen", 0) == last_gen}
    tail = [v for _, v in sorted(by_step.items())][-50:]
    end = next((e["kind"] for e in reversed(journal) if e.get("kind") in _END_KINDS), None)
    cuts = [e for e in journal if e.get("kind") == "lr_cut"]
    return {
        "end": end,
        "first incident": incidents[0].get("step") if incidents else None,
        "incident rule": incidents[0].get("rule") if incidents else None,
        "incidents": len({e.get("incident") for e in incidents}),
        "attempts": len(incidents),
        "lr scale": cuts[-1].get("lr_scale") if cuts else 1.0,
        "supervised loss": sum(tail) / len(tail) if tail else math.nan,
    }


_END_KINDS = ("completed", "escalated", "failed", "stopped")


# ---- report ------------------------------------------------------------------------------------
def lead(onset: int | None, fired: int | None) -> int | None:
    """Steps from a signal's firing to the onset (positive: before it); None if either is."""
    if onset is None or fired is None:
        return None
    return onset - fired


def plot_leads(rows: list[dict[str, Any]], path: Path) -> None:
    """Lead per signal (x) per diverging case (colour), one point per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    cmap = plt.get_cmap("tab10")
    for ci, case in enumerate(cases):
        xs, ys = [], []
        for r in (r for r in rows if r["case"] == case):
            for j, sig in enumerate(SIGNALS):
                v = lead(r["onset"], r["fired"].get(sig))
                if v is not None:
                    xs.append(j + (ci - (len(cases) - 1) / 2) * 0.07)
                    ys.append(v)
        ax.scatter(xs, ys, label=case, s=22, color=cmap(ci % 10))
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(SIGNALS)), list(SIGNALS.values()))
    ax.set_ylabel("lead: steps before the loss onset")
    ax.set_title("When each signal's rule fires against the onset, per zoo case (one point a seed)")
    ax.legend(fontsize=7, ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The three targets over the rows (diverging rows carry their supervised outcome)."""
    controls = [r for r in rows if not r["diverging"]]
    diverging = [r for r in rows if r["diverging"]]
    sup = [r for r in diverging if r.get("end") is not None]
    return {
        "false recoveries": sum(r["recoveries"] for r in controls),
        "controls": len(controls),
        "controls with a recovery": sum(r["recoveries"] > 0 for r in controls),
        "rescued": sum(bool(r.get("rescued")) for r in sup),
        "supervised": len(sup),
        "before onset": sum(bool(r.get("before onset")) for r in diverging),
        "diverging": len(diverging),
    }


def policy_variant(base: str, changes: list[str], out: Path) -> Path:
    """``base`` (a built-in name or a file) with ``KEY=VALUE`` recovery settings changed, written
    to ``out`` (the supervised runs read it from there; it is checked like any policy)."""
    import yaml
    from spikeguard.policies.loader import BUILTINS, builtin_path, load_policy

    path = builtin_path(base) if base in BUILTINS else Path(base)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    for change in changes:
        key, _, value = change.partition("=")
        data.setdefault("recovery", {})[key] = yaml.safe_load(value)
    tag = "-".join(c.replace("=", "") for c in changes)
    data["name"] = f"{data.get('name', 'policy')}-{tag}"
    variant = out / f"policy-{tag}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    variant.write_text(yaml.safe_dump(data, sort_keys=False))
    load_policy(str(variant))
    return variant


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the zoo and print its tables; returns the rows and the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--policy", default="default", help="the policy replayed and supervised")
    p.add_argument("--jobs", type=int, default=2, help="unsupervised runs at once")
    p.add_argument("--no-supervised", action="store_true", help="skip part 3")
    p.add_argument("--out", default=None, help="keep the reports and run directories here")
    p.add_argument("--reuse", action="store_true", help="reuse the finished runs --out holds")
    p.add_argument("--plot", default=str(HERE / "results" / "detection-lead.png"))
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--steps", type=int, default=None, help="override every case's steps")
    p.add_argument(
        "--recovery",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a variant of --policy with this recovery setting (YAML value), e.g. rewarm_steps=0",
    )
    p.add_argument("--smoke", action="store_true", help="tiny: 1 case, 1 seed, 30 steps, no Ray")
    args = p.parse_args(argv)
    if args.smoke:
        args.cases, args.seeds, args.steps, args.no_supervised = ["gpt-burst"], [0], 30, True
        args.plot = None
    from spikeguard.policies import load_policy
    from spikeguard.policies.loader import load_policy_text

    out = Path(args.out or tempfile.mkdtemp(prefix="sg-zoo-"))
    if args.recovery:
        args.policy = str(policy_variant(args.policy, args.recovery, out))
    combos = [(c, v, s) for c in args.cases for v in ("diverge", "control") for s in args.seeds]
    n_sup = 0 if args.no_supervised else sum(c in DIVERGING for c in args.cases) * len(args.seeds)
    print(
        f"bench_detection: {len(combos)} unsupervised runs ({args.jobs} at a time), {n_sup} "
        f"supervised; files in {out}",
        flush=True,
    )
    t0 = time.time()
    runs = run_all_alone(combos, out / "alone", args.jobs, args.reuse, args.steps)
    policy = load_policy(args.policy)
    signals = load_policy_text(SIGNAL_RULES, "bench signals")
    rows = [analyse(runs[c], policy, signals) for c in combos]
    control_loss = {
        c: statistics.mean(
            r["final loss"] for r in rows if r["case"] == c and r["variant"] == "control"
        )
        for c in args.cases
    }
    for r in rows:
        r["diverging"] = r["variant"] == "diverge" and r["case"] in DIVERGING
        r["control loss"] = control_loss[r["case"]]
    diverging = [r for r in rows if r["diverging"]]
    for i, r in enumerate(diverging):
        if args.no_supervised:
            r["first"] = r["recover"]
        else:
            print(
                f"-- supervised {i + 1}/{len(diverging)}: {r['case']} seed {r['seed']}", flush=True
            )
            r.update(supervised(r["case"], r["seed"], out / "supervised", args.policy, args.reuse))
            r["vs control"] = r["supervised loss"] / r["control loss"]
            r["rescued"] = r["end"] == "completed" and r["vs control"] <= 1.05
            r["first"] = r["first incident"]
            print(
                f"   {r['end']}: first incident {r['first incident']} ({r['incident rule']}), "
                f"{r['attempts']} attempt(s), lr x{r['lr scale']:g}, final "
                f"{r['supervised loss']:.3f} ({r['vs control']:.3f} x control)",
                flush=True,
            )
        r["before onset"] = (
            None if r["onset"] is None or r["first"] is None else r["first"] < r["onset"]
        )
        for sig, col in SIGNALS.items():
            r[col] = lead(r["onset"], r["fired"].get(sig))
    controls = [r for r in rows if not r["diverging"]]
    for r in controls:
        for sig, col in SIGNALS.items():
            r[col] = r["fired"].get(sig)
    print("\nDiverging runs: onset without spikeguard, the default policy's recovery, rescue")
    cols = [
        ("case", ""),
        ("seed", "d"),
        ("probed", ""),
        ("onset", "d"),
        ("recover", "d"),
        ("rule", ""),
        ("final loss", ".3f"),
        ("control loss", ".3f"),
    ]
    if not args.no_supervised:
        cols += [
            ("first incident", "d"),
            ("attempts", "d"),
            ("end", ""),
            ("lr scale", ".3g"),
            ("supervised loss", ".3f"),
            ("vs control", ".3f"),
            ("rescued", ""),
        ]
    print(table(diverging, [*cols, ("before onset", "")]))
    print("\nLead of each signal's rule (steps before the onset; negative: after; '-': never)")
    print(table(diverging, (("case", ""), ("seed", "d"), *((c, "+d") for c in SIGNALS.values()))))
    print("\nControls: the default policy's recoveries (false alarms) and each signal's first step")
    ccols = [("case", ""), ("variant", ""), ("seed", "d"), ("recoveries", "d"), ("rule", "")]
    print(table(controls, [*ccols, ("final loss", ".3f"), *((c, "d") for c in SIGNALS.values())]))
    summary = summarise(rows)
    print(
        f"\ncontrols: {summary['false recoveries']} recoveries on {summary['controls']} runs "
        f"(target 0); rescued {summary['rescued']}/{summary['supervised']} (target >= 90 %); "
        f"detected before the onset {summary['before onset']}/{summary['diverging']} "
        f"(target >= 70 %)"
    )
    if args.plot and diverging:
        plot_leads(diverging, Path(args.plot))
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, default=str))
    print(f"total wall {time.time() - t0:.0f}s")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
