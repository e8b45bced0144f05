"""Small PNG charts of an incident for Slack: grade, attention entropy and loss around the spike.

Rendered with matplotlib's object API on the Agg canvas (no pyplot, no global figure state, no
display), so it is safe from the notifier's background thread and on headless machines.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: The panels drawn, in order: context key, axis label, colour.
PANELS: tuple[tuple[str, str, str], ...] = (
    ("grade", "grade (0–7)", "#c0392b"),
    ("attn_entropy_min", "attn entropy (min)", "#2471a3"),
    ("loss", "loss", "#1e8449"),
)


def _floats(values: Sequence[Any]) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        out.append(f if math.isfinite(f) else math.nan)
    return out


def has_chart_data(context: Mapping[str, Any] | None) -> bool:
    """True when ``context`` has steps and at least one panel series of the same length."""
    if not context or not isinstance(context.get("steps"), (list, tuple)) or not context["steps"]:
        return False
    n = len(context["steps"])
    return any(
        isinstance(context.get(k), (list, tuple)) and len(context[k]) == n for k, _, _ in PANELS
    )


def render_incident_chart(
    context: Mapping[str, Any], *, step: int | None = None, title: str = "", dpi: int = 100
) -> bytes:
    """Render the incident ``context`` (``steps`` + series) to PNG bytes (about 600x460 px).

    Series that are missing or of the wrong length are skipped; ``None``/NaN/inf samples leave
    gaps (a NaN loss is exactly what a spike can look like). ``step`` draws the incident marker.

    Raises:
        ValueError: when there is nothing to draw (see :func:`has_chart_data`).
    """
    if not has_chart_data(context):
        raise ValueError("incident context has no steps or no series to draw")
    steps = _floats(context["steps"])
    panels = [
        (k, label, colour)
        for k, label, colour in PANELS
        if isinstance(context.get(k), (list, tuple)) and len(context[k]) == len(steps)
    ]
    fig = Figure(figsize=(6.0, 1.3 + 1.1 * len(panels)), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, label, colour) in zip(axes, panels):
        ys = _floats(context[key])
        if key == "grade":
            ax.step(steps, ys, where="post", color=colour, linewidth=1.6)
            ax.set_ylim(-0.4, 7.4)
            ax.set_yticks([0, 2, 4, 6])
        else:
            ax.plot(steps, ys, color=colour, linewidth=1.4, marker="o", markersize=2.2)
            bad = [s for s, y in zip(steps, _floats(context[key])) if math.isnan(y)]
            for s in bad:  # a gap in a sampled series would be invisible: mark it
                ax.axvline(s, color=colour, alpha=0.25, linewidth=4)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.25)
        if step is not None:
            ax.axvline(step, color="#e67e22", linestyle="--", linewidth=1.2)
    if step is not None:
        axes[0].annotate(
            f"incident @ {step:,}",
            xy=(step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -10),
            textcoords="offset points",
            fontsize=7,
            color="#e67e22",
        )
    axes[-1].set_xlabel("step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(pad=0.6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
