"""What the benchmarks share: percentiles, interleaved rounds, and plain-text tables.

The scripts in ``bench/`` run as ``python3 bench/NAME.py``, which puts this folder on
``sys.path``; the smoke tests import them the same way (``tests/test_bench_smoke.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def interleaved(variants: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, variant)`` pairs, every variant once per round, the order rotated each round.

    Alternating the variants inside one run makes machine noise (other jobs on a shared machine,
    thermal drift) hit all of them alike; rotating the order keeps any one variant from always
    running first (cold caches) or last.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    n = len(variants)
    for r in range(rounds):
        for i in range(n):
            yield r, variants[(i + r) % n]


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """``rows`` as a plain-text table; ``columns`` are ``(key, format spec)`` pairs.

    A value of None prints as ``-``; the header is the key. Right-aligned except for strings.
    """
    cells = [[_cell(row.get(key), spec) for key, spec in columns] for row in rows]
    widths = [
        max(len(key), *(len(c[i]) for c in cells)) if cells else len(key)
        for i, (key, _) in enumerate(columns)
    ]
    text_cols = [
        all(isinstance(row.get(key), str) or row.get(key) is None for row in rows) and rows
        for key, _ in columns
    ]
    lines = [
        "  ".join(
            key.ljust(w) if text_cols[i] else key.rjust(w)
            for i, ((key, _), w) in enumerate(zip(columns, widths))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append(
            "  ".join(
                v.ljust(w) if text_cols[i] else v.rjust(w)
                for i, (v, w) in enumerate(zip(c, widths))
            )
        )
    return "\n".join(lines)


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split at ``--``: the bench's own arguments, and those passed on to the example."""
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def standalone_rank() -> None:
    """Make this process a lone rank (world size 1) that no supervisor steers: torchrun's
    variables set, every ``SPIKEGUARD_*`` variable of a surrounding run removed."""
    import os

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    for key in [k for k in os.environ if k.startswith("SPIKEGUARD_")]:
        del os.environ[key]
