"""Time to recover, split into its phases, with and without the warm standby; and how long after
its timeout a hang is detected.

Two supervised runs of the toy GPT (``tests/scripts/toy_rank.py``: 2 real gloo ranks on the
embedded Ray, checkpoints every 10 steps), the same schedule in both: generation g collapses at
step 60·g (a loss spike the policy recovers from), so each run has ``--recoveries`` incidents,
each rolled back, relaunched and through its probation. One run relaunches cold (a new process
per rank), the other with ``standby: true`` (the next generation waits in ``resume()``). From
the journal (supervisor clock) and the ranks' own messages (their wall clock, same machine),
each recovery splits into:

* ``kill``       decision (incident journaled) → the ranks are dead (kill journaled)
* ``select``     → the checkpoint is chosen (rollback journaled)
* ``launch``     → the launch call returned (processes started, or the standby released)
* ``start``      → the rank's SDK said hello (interpreter, imports, process group, model);
                   0 for a released standby (it said hello long before)
* ``load``       → ``resumed`` (the checkpoint loaded, the plan applied)
* ``first step`` → the first heartbeat of the new generation
* ``total``      decision → first step; ``supervisor`` = kill + select + launch, its own share

After its collapses the cold run hangs rank 1 inside a collective in ``--hangs`` more
generations; the detection latency is the time from the last message of the rank the incident
names to the incident, past ``heartbeat_s`` (the hang timeout).

    python3 bench/bench_recovery.py                  # 6 recoveries per variant, 3 hangs
    python3 bench/bench_recovery.py --recoveries 2 --hangs 1 --smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "tests" / "scripts" / "toy_rank.py"
PHASES = ("kill", "select", "launch", "start", "load", "first step", "total", "supervisor")

POLICY = """\
version: 1
name: bench-recovery
warm_in: 0 steps
rules:
  - name: loss-spike
    when: {signal: loss, above_median: 1.5, window: 10 steps}
    for: 2 steps
    action: recover
  - name: hang
    when: hang
    action: recover
    recovery: {lr_factors: [1.0], reset_optimizer: false}
recovery:
  min_grade: S4
  lr_factors: [0.7]
  reset_optimizer: true
  probation_steps: 15
  max_attempts: 2
  max_incidents: 20
"""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wall(event: dict[str, Any]) -> float:
    """An event's wall-clock time (the journal's ISO ``time``) as seconds since the epoch."""
    return dt.datetime.fromisoformat(event["time"]).timestamp()


def run_job(
    work: Path, name: str, *, standby: bool, faults: str, steps: int, heartbeat_s: float
) -> Path:
    from spikeguard.supervisor.job import JobSpec
    from spikeguard.supervisor.runner import run_job as supervise

    policy = work / "policy.yaml"
    policy.write_text(POLICY)
    job = JobSpec(
        name=name,
        entrypoint=str(TOY),
        # torch's own AdamW: a cold start pays its lazy torch._dynamo import, as a user's does
        args=["--steps", str(steps), "--ckpt-every", "10", "--step-sleep", "0.05"]
        + ["--optimizer", "adamw"],
        workers=2,
        policy=str(policy),
        run_dir=str(work / name),
        env={"SG_FAULT": faults},
        timeouts={
            "heartbeat_s": heartbeat_s,
            "first_heartbeat_s": 120,
            "restart_backoff_s": 0.5,
            "reap_interval_s": 5,
        },
        standby=standby,
        logs={"to_driver": False},
    )
    t0 = time.monotonic()
    code = supervise(job, live=False)
    print(f"  {name}: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
    return Path(job.run_dir)


def recoveries(run_dir: Path) -> list[dict[str, float]]:
    """Per recovery, the seconds each phase took (see the module docstring)."""
    evs = read_jsonl(run_dir / "journal.jsonl")
    msgs = read_jsonl(run_dir / "reports.jsonl")
    out = []
    for inc in (e for e in evs if e["kind"] == "incident" and e.get("rule") == "loss-spike"):
        after = [e for e in evs if e["seq"] > inc["seq"]]
        kill = next((e for e in after if e["kind"] == "kill"), None)
        rb = next((e for e in after if e["kind"] == "rollback"), None)
        launch = next((e for e in after if e["kind"] == "launch"), None)
        if kill is None or rb is None or launch is None:
            continue
        gen = launch["generation"]
        mine = [m for m in msgs if m.get("gen") == gen]
        hello = [m["t"] for m in mine if m["type"] == "hello"]
        resumed = [m["t"] for m in mine if m["type"] == "resumed"]
        beats = [m["t"] for m in mine if m["type"] in ("heartbeat", "report")]
        if len(resumed) < 2 or not beats:
            continue
        t_launch = wall(launch)
        warm = all(r.get("standby") for r in launch["ranks"])
        started = max(max(hello), t_launch) if hello else t_launch
        first = min(beats)
        p = {
            "kill": wall(kill) - wall(inc),
            "select": wall(rb) - wall(kill),
            "launch": t_launch - wall(rb),
            "start": 0.0 if warm else started - t_launch,
            "load": max(resumed) - started,
            "first step": first - max(resumed),
            "total": first - wall(inc),
        }
        p["supervisor"] = p["kill"] + p["select"] + p["launch"]
        p["warm"] = float(warm)
        out.append(p)
    return out


def hang_latencies(run_dir: Path, heartbeat_s: float) -> list[float]:
    """Per hang incident: seconds from the hung rank's last message to the incident, minus the
    timeout (0 would be a detection exactly at the timeout)."""
    evs = read_jsonl(run_dir / "journal.jsonl")
    msgs = read_jsonl(run_dir / "reports.jsonl")
    out = []
    for inc in (e for e in evs if e["kind"] == "incident" and e.get("rule") == "hang"):
        gen = next(
            e["generation"]
            for e in reversed(evs)
            if e["kind"] == "launch" and e["seq"] < inc["seq"]
        )
        rank = inc.get("rank")
        seen = [
            m["at"]
            for m in msgs
            if m.get("gen") == gen and m.get("rank") == rank and m["type"] not in ("exit", "hang")
        ]
        if seen:
            out.append(inc["mono"] - max(seen) - heartbeat_s)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recoveries", type=int, default=6, help="incidents per variant")
    ap.add_argument("--hangs", type=int, default=3, help="hangs to detect (0: skip)")
    ap.add_argument("--heartbeat-s", type=float, default=5.0, help="the hang timeout")
    ap.add_argument("--smoke", action="store_true", help="tiny: for the test suite")
    ap.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    n, h = args.recoveries, args.hangs
    work = Path(args.work or tempfile.mkdtemp(prefix="sg-bench-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    collapses = [f"0:{60 * g}:collapse:{g}" for g in range(1, n + 1)]
    hangs_at = [f"1:+20:hang:{g}" for g in range(n + 1, n + h + 1)]
    steps = 60 * n + 40 * h + 40

    import ray

    ray.init(
        address="local", num_cpus=4, object_store_memory=80 * 1024 * 1024, include_dashboard=False
    )
    results: dict[str, list[dict[str, float]]] = {}
    hangs: list[float] = []
    try:
        for variant, standby in (("cold", False), ("standby", True)):
            extra = hangs_at if variant == "cold" else []
            print(f"{variant}: {n} recoveries, {len(extra)} hangs ...", flush=True)
            run_dir = run_job(
                work,
                variant,
                standby=standby,
                faults=",".join(collapses + extra),
                steps=steps if extra else 60 * n + 40,
                heartbeat_s=args.heartbeat_s,
            )
            results[variant] = recoveries(run_dir)
            if extra:
                hangs = hang_latencies(run_dir, args.heartbeat_s)
    finally:
        ray.shutdown()

    cold, warm = results["cold"], results["standby"]
    released = sum(int(r["warm"]) for r in warm)
    print()
    print(f"Time to recover, median seconds over {len(cold)} (cold) and {len(warm)} (standby)")
    print(f"recoveries; {released} of the standby run's launches were releases")
    print(f"{'phase':<12} {'cold':>8} {'standby':>8} {'ratio':>7}")
    for ph in PHASES:
        c, w = median([r[ph] for r in cold]), median([r[ph] for r in warm])
        ratio = f"{c / w:6.1f}x" if w > 0 else "   -"
        print(f"{ph:<12} {c:8.3f} {w:8.3f} {ratio:>7}")
    if hangs:
        print()
        print(f"Hang detection: {len(hangs)} hangs, heartbeat_s {args.heartbeat_s}")
        print(
            "seconds past the timeout: "
            + ", ".join(f"{h:.2f}" for h in hangs)
            + f" (max {max(hangs):.2f}; target <= 1.0)"
        )
    ok = bool(cold) and bool(warm)
    if args.smoke:
        return 0 if ok else 1
    print(f"\nruns kept in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
