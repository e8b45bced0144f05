"""Pictures of a run: loss, grade and attention entropy per generation, incidents marked."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from .. import rundir
from ..journal import read_events


def read_reports(run_dir: str | Path) -> list[dict[str, Any]]:
    out = []
    path = Path(run_dir) / "reports.jsonl"
    if not path.exists():
        return out
    with open(path, "rb") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def plot_run(run_dir: str | Path, *, rank: int = 0) -> Path:
    """Draw ``RUN_DIR/report.png`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    msgs = [m for m in read_reports(run_dir) if m.get("rank") == rank]
    events = read_events(run_dir)
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    gens = sorted({m["gen"] for m in msgs})
    for g in gens:
        hb = [m for m in msgs if m["gen"] == g and m["type"] in ("heartbeat", "report")]
        rep = [m for m in hb if m["type"] == "report"]
        label = f"generation {g}"
        axes[0].plot(
            [m["step"] for m in hb], [_num(m.get("loss")) for m in hb], lw=0.8, label=label
        )
        axes[1].step(
            [m["step"] for m in rep],
            [_num(m["summary"].get("grade")) for m in rep],
            where="post",
            label=label,
        )
        axes[2].plot(
            [m["step"] for m in rep],
            [
                _num(
                    m["summary"].get("attn_entropy_min_norm", m["summary"].get("attn_entropy_min"))
                )
                for m in rep
            ],
            marker=".",
            label=label,
        )
    for ev in events:
        if ev["kind"] == "incident" and isinstance(ev.get("step"), int):
            for ax in axes:
                ax.axvline(ev["step"], color="red", ls="--", lw=1)
            axes[0].annotate(
                f" {ev.get('rule')}",
                (ev["step"], 0.98),
                xycoords=("data", "axes fraction"),
                color="red",
                fontsize=7,
                va="top",
                rotation=90,
            )
        if ev["kind"] == "rollback" and isinstance(ev.get("checkpoint_step"), int):
            for ax in axes:
                ax.axvline(ev["checkpoint_step"], color="green", ls=":", lw=1)
    axes[0].set_ylabel(f"loss (rank {rank})")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("grade (min over layers)")
    axes[1].set_ylim(-0.5, 7.5)
    axes[1].set_yticks(range(8), [f"S{i}" for i in range(8)])
    axes[2].set_ylabel("min-head attn entropy\n(normalised)")
    axes[2].set_xlabel("step   (red: incident, green: rollback target)")
    for ax in axes:
        ax.grid(alpha=0.3)
    if gens:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"spikeguard run {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(run_dir) / "report.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    rundir.write_atomic(out, png.getvalue())  # private (0600), never through a symlink
    return out


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else float("nan")
