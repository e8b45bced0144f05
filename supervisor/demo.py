"""``spikeguard demo``: the diverging example, 2 ranks on an embedded local Ray,
recovered by the default policy — then the story, from the journal."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from .decide.events import STORY_KINDS
from .journal import read_events
from .observe.describe import describe


def run_demo(
    *,
    run_dir: str | None = None,
    steps: int | None = None,
    workers: int = 2,
    policy: str = "default",
    dashboard: bool = True,
    seed: int = 0,
) -> int:
    from spikeguard.examples import gpt_diverge

    from .job import JobSpec
    from .runner import run_job

    run_path = Path(run_dir or tempfile.mkdtemp(prefix="spikeguard-demo-")).resolve()
    if run_path.exists() and any(run_path.iterdir()):
        events = read_events(run_path)
        if not events or events[0].get("run") != "demo":
            print(
                f"spikeguard demo: {run_path} is not empty and holds no earlier demo; "
                "choose another --run-dir",
                file=sys.stderr,
            )
            return 2
        shutil.rmtree(run_path)  # an earlier demo: start over
    args = ["--seed", str(seed), "--ckpt-every", "50", "--sample-every", "25", "--log-every", "250"]
    if steps:
        args += ["--steps", str(steps)]
    job = JobSpec(
        name="demo",
        entrypoint=gpt_diverge.__file__,
        args=args,
        workers=workers,
        policy=policy,
        run_dir=str(run_path),
        timeouts={"heartbeat_s": 60, "first_heartbeat_s": 180},
        ray={"dashboard": dashboard},
    )
    print(
        f"spikeguard demo: {workers} ranks of examples/gpt_diverge.py "
        "(a GPT whose LR warm-up overshoots)\n"
        f"  run directory: {run_path}\n"
        f"  watch from another terminal: spikeguard status {run_path}\n",
        flush=True,
    )
    code = run_job(job, live=True)
    story(run_path)
    return code


def story(run_dir: Path) -> None:
    """Print the journal's recovery story and write the run's post-mortem."""
    events = read_events(run_dir)
    print("\n=== what happened (spikeguard events " + str(run_dir) + ") ===")
    for ev in events:
        if ev.get("kind") not in STORY_KINDS:
            continue
        print(f"  {ev['kind']:<17} {describe(ev)}")
    try:
        from .observe.report import write_report

        page = write_report(run_dir, run_dir / "report.html")
        print(
            f"\nthe post-mortem (signals per generation, per-layer heatmap, checkpoints, batch "
            f"forensics, journal): {page}\n  open it in a browser; `spikeguard report` makes it "
            "for any run"
        )
    except Exception as e:  # a missing report must not fail the demo
        print(f"(no report: {e})")
    last = events[-1] if events else {}
    if last.get("kind") == "completed":
        print(
            f"\nfinal loss {last.get('final_loss'):.3f} — see the README for the unsupervised run "
            "of the same recipe, which diverges"
        )
