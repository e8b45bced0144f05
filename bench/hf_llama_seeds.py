"""Seeds of the tiny-Llama Trainer example, without and with spikeguard (2 ranks each).

For each seed, ``examples/hf_llama_diverge.py`` runs

- **without spikeguard**: 2 gloo ranks with the torchrun variables, ``--no-sdk``, rank 0 writing
  the Trainer's per-step loss; the onset is the first loss spike as ``bench/example_seeds.py``
  defines it (:func:`spikeguard.examples.gpt_diverge.first_spike`: a non-finite loss, or a
  20-step mean more than 0.3 nats above the best earlier 20-step mean; the step where the
  excursion began);
- **with spikeguard**: ``spikeguard submit examples/hf_llama_diverge.yaml`` with that seed, on an
  embedded local Ray: the incidents, the Trainer checkpoints rolled back to, the final LR scale.

Final loss: the mean of the last 50 steps' loss (rank 0's, in the generation that finished).

    python3 bench/hf_llama_seeds.py                      # seeds 0 1 2, both modes
    python3 bench/hf_llama_seeds.py --seeds 0 --modes without
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_llama_diverge.py"
JOB = ROOT / "examples" / "hf_llama_diverge.yaml"
sys.path.insert(0, str(ROOT))


def _first_spike(losses: list[float], steps: list[int]) -> int | None:
    from spikeguard.examples.gpt_diverge import first_spike

    return first_spike(losses, steps)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _final(losses: list[float]) -> float:
    tail = losses[-50:]
    return sum(tail) / len(tail) if tail else math.nan


def without(seed: int, tmp: Path, extra: list[str]) -> dict:
    """One unsupervised 2-rank run: onset, min and final loss."""
    metrics = tmp / f"without-{seed}.jsonl"
    port, t0 = _port(), time.time()
    argv = [sys.executable, str(EXAMPLE), "--no-sdk", "--seed", str(seed)]
    argv += ["--output-dir", str(tmp / f"out-{seed}"), "--save-steps", "100000"]
    argv += ["--metrics", str(metrics), *extra]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses, steps = [r["loss"] for r in rows], [r["step"] for r in rows]
    return {
        "seed": seed,
        "mode": "without",
        "onset": _first_spike(losses, steps),
        "min_loss": min(losses),
        "final_loss": _final(losses),
        "incidents": "",
        "rollbacks": "",
        "lr_scale": 1.0,
        "wall_s": time.time() - t0,
        "exit": max(codes),
    }


def with_spikeguard(seed: int, tmp: Path, extra: list[str]) -> dict:
    """One supervised run of the job with ``--seed``: its story from the journal."""
    job = yaml.safe_load(JOB.read_text())
    job["entrypoint"] = str(EXAMPLE)
    job["args"] = [*job["args"], "--seed", str(seed), *extra]
    spec = tmp / f"job-{seed}.yaml"
    spec.write_text(yaml.safe_dump(job))
    run = tmp / f"run-{seed}"
    t0 = time.time()
    cmd = [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(spec)]
    code = subprocess.run([*cmd, "--run-dir", str(run), "--quiet"], check=False).returncode
    events = [json.loads(line) for line in (run / "journal.jsonl").read_text().splitlines()]
    reports = [json.loads(line) for line in (run / "reports.jsonl").read_text().splitlines()]
    last_gen = max(m["gen"] for m in reports)
    mine = [
        m
        for m in reports
        if m["gen"] == last_gen and m["rank"] == 0 and m["type"] in ("heartbeat", "report")
    ]
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    return {
        "seed": seed,
        "mode": "with",
        "onset": None,
        "min_loss": min(m["loss"] for m in mine if m["loss"] is not None),
        "final_loss": _final([m["loss"] for m in mine if m["loss"] is not None]),
        "incidents": ",".join(str(e["step"]) for e in events if e["kind"] == "incident"),
        "rollbacks": ",".join(
            Path(e["checkpoint_path"]).name if e.get("checkpoint_path") else "none"
            for e in rollbacks
        ),
        "lr_scale": next(
            (e["plan"]["lr_scale"] for e in reversed(events) if e["kind"] == "launch"), 1.0
        ),
        "wall_s": time.time() - t0,
        "exit": code,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=["without", "with"])
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="example arguments")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-llama-seeds-") as d:
        for seed in args.seeds:
            for mode in args.modes:
                run = without if mode == "without" else with_spikeguard
                rows.append(run(seed, Path(d), args.extra))
                print(json.dumps(rows[-1]), flush=True)
    print(
        table(
            rows,
            [
                ("seed", "d"),
                ("mode", "s"),
                ("onset", "d"),
                ("min_loss", ".2f"),
                ("final_loss", ".2f"),
                ("incidents", "s"),
                ("rollbacks", "s"),
                ("lr_scale", "g"),
                ("wall_s", ".0f"),
                ("exit", "d"),
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
