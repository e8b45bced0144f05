"""Seeds of the tiny-Llama Trainer example, without and with spikeguard (2 ranks each).

For each seed, ``examples/hf_llama_diverge.py`` runs

- **without spikeguard**: 2 gloo ranks with the torchrun variables, ``--no-sdk``, rank 0 writing
  the Trainer's per-step loss; the onset is the first loss spike as ``bench/example_seeds.py``
  defines it (:func:`spikeguard.examples.gpt_diverge.first_spike`: a non-finite loss, or a
  20-step mean more than 0.3 nats above the best earlier 20-step mean; the step where the
  excursion began);
- **with spikeguard**: ``spikeguard submit examples/hf_llama_diverge.yaml`` with that seed, on an
  embedded local Ray: the incidents, the Trainer checkpoints rolled back to, the final LR scale.

Both modes read the loss from the same place: the Trainer's own per-step log (``--metrics``:
rank 0 writes what ``on_log`` hands the callbacks, the all-rank mean the Trainer computes,
``logging_steps=1``), never from spikeguard's reports. Under spikeguard a rolled-back step is
logged again by the generation that retrains it; the run's loss curve is its final timeline, each
step's loss from the generation that trained it last.

Best loss: the lowest step of that curve. Final loss: the mean of its last 50 steps.

    python3 bench/hf_llama_seeds.py                      # seeds 0 1 2, both modes
    python3 bench/hf_llama_seeds.py --seeds 0 --modes without --world 1  # 1 process, batch 32
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


def _trainer_losses(metrics: Path) -> tuple[list[int], list[float]]:
    """The Trainer's logged loss per step from a ``--metrics`` file: the final timeline (a step
    logged again by a later generation, after a rollback, takes that generation's value)."""
    by_step: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "train_runtime" not in row:
            by_step[int(row["step"])] = float(row["loss"])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def without(seed: int, tmp: Path, extra: list[str], world: int = 2) -> dict:
    """One unsupervised run on ``world`` ranks (1: one process with the 2-rank job's global
    batch, 2 x 16, as ``bench/example_seeds.py`` does): onset, min and final loss."""
    metrics = tmp / f"without-{seed}.jsonl"
    port, t0 = _port(), time.time()
    argv = [sys.executable, str(EXAMPLE), "--no-sdk", "--seed", str(seed)]
    argv += ["--output-dir", str(tmp / f"out-{seed}"), "--save-steps", "100000"]
    argv += ["--metrics", str(metrics), *(["--batch", "32"] if world == 1 else []), *extra]
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env.update(LOCAL_WORLD_SIZE=str(world))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    steps, losses = _trainer_losses(metrics)
    return {
        "seed": seed,
        "mode": f"without ({world} rank{'s' if world > 1 else ''})",
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
    metrics = tmp / f"with-{seed}.jsonl"
    metrics.unlink(missing_ok=True)
    job = yaml.safe_load(JOB.read_text())
    job["entrypoint"] = str(EXAMPLE)
    job["policy"] = str(JOB.parent / job["policy"])
    job["args"] = [*job["args"], "--seed", str(seed), "--metrics", str(metrics), *extra]
    spec = tmp / f"job-{seed}.yaml"
    spec.write_text(yaml.safe_dump(job))
    run = tmp / f"run-{seed}"
    t0 = time.time()
    cmd = [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(spec)]
    argv = [*cmd, "--run-dir", str(run), "--quiet", "--no-dashboard"]  # no port 8265 clash
    code = subprocess.run(argv, check=False).returncode
    events = [json.loads(line) for line in (run / "journal.jsonl").read_text().splitlines()]
    _, losses = _trainer_losses(metrics)
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    return {
        "seed": seed,
        "mode": "with spikeguard (2 ranks)",
        "onset": None,
        "min_loss": min(losses),
        "final_loss": _final(losses),
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
    p.add_argument("--world", type=int, default=2, help="ranks of the runs without spikeguard")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="example arguments")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-llama-seeds-") as tmp:
        d = args.out or tmp
        os.makedirs(d, exist_ok=True)
        for seed in args.seeds:
            for mode in args.modes:
                if mode == "without":
                    rows.append(without(seed, Path(d), args.extra, args.world))
                else:
                    rows.append(with_spikeguard(seed, Path(d), args.extra))
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
