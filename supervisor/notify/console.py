"""Console output: one line per journal event, and a live per-rank view."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

_STORY = {
    "launch": "launched generation {generation} (LR scale {lr_scale:g})",
    "incident": "INCIDENT {incident} at step {step}: {rule} — {reason}",
    "kill": "killed ranks {ranks} in {duration_s:.2f}s",
    "rollback": "rolled back to step {checkpoint_step} (S{grade}) — {reason}",
    "lr_cut": "LR x{factor:g} → scale {lr_scale:.4g}",
    "optimizer_reset": "optimizer state reset",
    "probation_start": "probation: steps {from_step}..{until_step} must stay healthy",
    "probation_passed": "probation passed — {reason}",
    "probation_failed": "probation FAILED at step {step} — {reason}",
    "escalated": "ESCALATED — {reason}",
    "completed": "completed (final loss {final_loss})",
    "failed": "FAILED — {reason}",
    "stopped": "stopped — {reason}",
    "alert": "[{severity}] {rule} rank {rank} {layer} step {step}: {reason}",
    "launch_failed": "launch of generation {generation} FAILED — {reason}",
    "resume": "supervisor restarted — {reason}",
    "reaped": "killed leftover rank processes — {reason}",
    "supervisor_start": "supervisor started — {reason}",
}


def describe(ev: dict[str, Any]) -> str:
    """A one-line human description of a journal event."""
    fmt = _STORY.get(ev["kind"])
    if fmt is None:
        return f"{ev['kind']}: {ev.get('reason', '')}"
    try:
        return fmt.format_map(_Default(ev))
    except (ValueError, TypeError):
        return f"{ev['kind']}: {ev.get('reason', '')}"


class _Default(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> str:
        return "?"


class ConsoleNotifier:
    """Prints every story event as it is journaled."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def handle(self, ev: dict[str, Any]) -> None:
        if ev["kind"] in _STORY:
            print(f"[spikeguard {ev['mono']:8.1f}s] {describe(ev)}", file=self.out, flush=True)


class LiveView:
    """Prints the per-rank grade, entropy, loss and the recovery state every few seconds."""

    def __init__(self, *, every_s: float = 5.0, out: TextIO | None = None) -> None:
        self.every_s = every_s
        self.out = out or sys.stderr
        self._last = 0.0

    def __call__(self, ctl: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        print(render_status(_status_of(ctl)), file=self.out, flush=True)


def _status_of(ctl: Any) -> dict[str, Any]:
    st, c = ctl.state, ctl.collector
    return {
        "phase": st.phase.value,
        "generation": st.generation,
        "lr_scale": st.lr_scale,
        "probation_until": st.probation_until,
        "ranks": {
            r: {
                "step": v.step,
                "loss": v.loss,
                "grade": v.summary.get("grade"),
                "attn_entropy_min": v.summary.get("attn_entropy_min"),
            }
            for r, v in c.ranks.items()
        },
    }


def render_status(s: dict[str, Any]) -> str:
    """The live view / ``spikeguard status`` text for a status dict."""
    head = f"{s['phase']:<12} gen {s['generation']}  LR x{s['lr_scale']:.3g}"
    if s.get("probation_until"):
        head += f"  probation until step {s['probation_until']}"
    parts = []
    for r, v in sorted(s.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
        g = v.get("grade")
        grade = f"S{g}" if isinstance(g, int) else "S?"
        ent = v.get("attn_entropy_min")
        loss = v.get("loss")
        parts.append(f"r{r}: step {v.get('step')} {grade} H_min {_f(ent)} loss {_f(loss)}")
    return head + ("  |  " + "  |  ".join(parts) if parts else "")


def _f(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else str(x)
