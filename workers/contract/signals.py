"""Signal names, how a rank aggregates them over layers, and the stability grades S0..S7.

The math that produces the per-layer values lives in ``spikeguard.workers.measure`` (torch); this
module is the vocabulary both sides share: the probes write these names, the policies read them,
the supervisor shows them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

LAYER_SIGNALS = (
    "erank_ratio",
    "grade",
    "attn_entropy_mean",
    "attn_entropy_min",
    "attn_entropy_min_norm",
    "max_logit",
    "logz_mean",
    "logz_max",
)
"""Per-layer signals of a sampled ``report``:

``erank_ratio``            effective rank of the block's output / min(rows, d, k), in [0, 1]
``grade``                  0..7, from ``erank_ratio`` (:func:`grade_of`)
``attn_entropy_mean/min``  attention entropy over heads (nats): the mean, the lowest head
``attn_entropy_min_norm``  the lowest head's entropy / log(number of visible keys), in [0, 1]
``max_logit``              the largest pre-softmax attention logit
``logz_mean/max``          log-partition of the LM head's output
"""

STEP_SIGNALS = ("loss", "grad_norm", "lr")
"""Per-rank signals of every ``heartbeat`` (and of every ``report``)."""

SIGNALS = LAYER_SIGNALS + STEP_SIGNALS

AGGREGATE: dict[str, str] = {
    s: ("max" if s == "max_logit" or s.startswith("logz") else "min") for s in LAYER_SIGNALS
}
"""How a rank's ``summary`` aggregates a layer signal over its layers: the worst value, i.e. the
lowest grade, ratio and entropy, the highest logit and log Z."""

GRADE_THRESHOLDS: tuple[float, ...] = (0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""Grade boundaries on the effective-rank ratio: the grade is the number of thresholds strictly
below the ratio (> 0.7: S7, healthy; <= 0.1: S0, collapsing)."""


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def summarize(layers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A rank's summary of per-layer signals: each signal aggregated by :data:`AGGREGATE` (a NaN
    anywhere makes it NaN: a non-finite layer is the worst case), plus ``worst_layer``, the layer
    with the lowest grade (ties: the lower ratio, then the name)."""
    out: dict[str, Any] = {}
    for name, how in AGGREGATE.items():
        vals = [v[name] for v in layers.values() if _number(v.get(name))]
        if not vals:
            continue
        if any(math.isnan(v) for v in vals):
            out[name] = float("nan")
        else:
            out[name] = max(vals) if how == "max" else min(vals)
    graded = [
        (v["grade"], v.get("erank_ratio", 0.0), name)
        for name, v in layers.items()
        if _number(v.get("grade"))
    ]
    if graded:
        out["worst_layer"] = min(graded)[2]
    return out


def check_thresholds(thresholds: tuple[float, ...]) -> None:
    """``ValueError`` unless ``thresholds`` are 7 numbers in (0, 1), strictly decreasing."""
    t = tuple(thresholds)
    if len(t) != 7:
        raise ValueError(f"need 7 grade thresholds, got {len(t)}: {t}")
    for v in t:
        if not _number(v) or not 0.0 < v < 1.0:
            raise ValueError(f"grade thresholds must be numbers in (0, 1), got {t}")
    if any(a <= b for a, b in itertools.pairwise(t)):
        raise ValueError(f"grade thresholds must be strictly decreasing, got {t}")


def grade_of(ratio: float, thresholds: tuple[float, ...] = GRADE_THRESHOLDS) -> int:
    """Grade 0..7 of an effective-rank ratio: the number of thresholds strictly below it.

    With the defaults: ratio > 0.7 -> 7 (healthy), exactly 0.7 -> 6, ..., ratio <= 0.1 -> 0
    (collapsing). A NaN ratio grades 0: a non-finite activation is the worst case, not a missing
    value.
    """
    check_thresholds(thresholds)
    r = float(ratio)
    if math.isnan(r):
        return 0
    return sum(1 for t in thresholds if t < r)


def is_grade(g: Any) -> bool:
    """True for an int 0..7 (not a bool)."""
    return isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= 7


def format_grade(g: int) -> str:
    """``5 -> "S5"``; ``ValueError`` outside 0..7."""
    if not is_grade(g):
        raise ValueError(f"grade must be an int in 0..7, got {g!r}")
    return f"S{g}"


def grade_text(g: Any) -> str:
    """``S5`` for a grade, ``S?`` for anything else (a missing or malformed grade on display)."""
    return format_grade(g) if is_grade(g) else "S?"


def parse_grade(text: str) -> int:
    """``"S5" -> 5``: exactly ``S`` followed by one digit 0..7, else ``ValueError``."""
    if not isinstance(text, str) or len(text) != 2 or text[0] != "S" or text[1] not in "01234567":
        raise ValueError(f"not a grade: {text!r} (expected 'S0' .. 'S7')")
    return int(text[1])
