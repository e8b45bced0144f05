"""Signal declarations, how a rank aggregates them over layers, and the stability grades S0..S7.

A signal is declared once, here, by a :class:`SignalSpec`: its name (the key in messages and
policies), the probe that computes it, how a rank's summary aggregates it over layers, the end
of its scale where trouble lies, its Prometheus family and the words ``policy explain`` uses.
Everything else derives from :func:`specs`: the policy language's signal names, the engine's
per-layer test and aggregation, the metrics exporter's families, the post-mortem's per-step
worst values. The math that produces the per-layer values lives in ``spikeguard.workers.measure``
(torch) and runs in the probe a declaration names (``spikeguard.workers.probes``); this module is
torch-free, so the supervisor and the policies read it on a head node.

:data:`SIGNALS`, :data:`LAYER_SIGNALS`, :data:`STEP_SIGNALS` and :data:`AGGREGATE` are live views
of the declarations (a signal declared later, by :func:`declare` or :func:`declared`, is in them
at once), so a module that imported them at its top never holds a stale copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

Aggregate = Literal["min", "max", "mean", "last"]
"""How a rank's summary folds a per-layer signal over its layers."""
Worst = Literal["low", "high"]
"""The end of a signal's scale where trouble lies."""
ProbeKind = Literal["residual", "attention", "lm_head", "step", "agent"]
"""What computes a signal: one of the probe kinds of ``spikeguard.workers.probes`` (per-layer
signals of a sampled ``report``), ``step``: the training loop, on every ``heartbeat``, or
``agent``: the rank's agent, beside the rank (its accelerators' health from NVML, every few
seconds), carried to the policy engine in a ``health`` message the supervisor makes."""

AGGREGATIONS: tuple[str, ...] = typing.get_args(Aggregate)
"""Every way of aggregating over layers that :func:`aggregate` knows."""
_WORST_OF: dict[str, Worst] = {"min": "low", "max": "high"}
"""Where trouble lies for an aggregation that takes the worst layer."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricFamily:
    """The Prometheus family a signal is exported under (the exporter adds ``spikeguard_`` and,
    for a per-layer signal, ``rank_`` / ``layer_`` in front and the aggregation to the help)."""

    name: str
    """The family's name after its prefix, base unit last (``attn_entropy_min_nats``)."""
    help: str
    """What it measures, as the ``# HELP`` line says it."""
    type: Literal["gauge"] = "gauge"
    """The Prometheus type: a signal is a latest value, so a gauge."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SignalSpec:
    """The one declaration of a signal; every other place reads it (see the module docstring)."""

    name: str
    """The key in messages, summaries and policies (``attn_entropy_min``)."""
    probe: ProbeKind
    """The probe kind that computes it, or ``step`` for a field of every heartbeat."""
    display: str
    """How ``policy explain`` names it in a sentence (``the min-head attention entropy``)."""
    metric: MetricFamily
    """The Prometheus family it is exported under."""
    aggregate: Aggregate = "min"
    """How a rank's summary folds it over the rank's layers (ignored for a per-step signal); by
    default the worst value, the lowest."""
    worst: Worst | None = None
    """Where trouble lies, for "the worst rank" (the post-mortem keeps it per step): by default
    ``low`` for ``min`` and ``high`` for ``max``; say it for ``mean`` and ``last``."""
    unit: str = ""
    """The unit of its values on display (``nats``), empty for a plain number or ratio."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a signal name is an identifier, got {self.name!r}")
        if self.probe not in typing.get_args(ProbeKind):
            raise ValueError(f"{self.name}: unknown probe kind {self.probe!r}")
        if self.aggregate not in AGGREGATIONS:
            raise ValueError(f"{self.name}: unknown aggregation {self.aggregate!r}")
        implied = _WORST_OF.get(self.aggregate)
        if self.worst is None and implied is None:
            raise ValueError(f"{self.name}: say where trouble lies (worst=) for {self.aggregate}")
        if self.worst is not None and implied is not None and self.worst != implied:
            raise ValueError(f"{self.name}: aggregate {self.aggregate} is the worst {implied}")

    @property
    def per_layer(self) -> bool:
        """Computed per layer by a probe on sampled steps (not a field of every heartbeat)."""
        return self.probe not in ("step", "agent")

    @property
    def worse_high(self) -> bool:
        """True when the higher of two values is the worse one."""
        return (self.worst or _WORST_OF[self.aggregate]) == "high"


_DECLARED: dict[str, SignalSpec] = {}
"""Every declared signal by name, in declaration order (the views list the per-layer ones first,
each group in this order)."""


class _Names(Sequence[str]):
    """A live, tuple-like view of the names of the declared signals that ``keep`` selects: it
    compares equal to the tuple of them, and ``in`` is one set lookup (the engine asks it for
    every value of every message)."""

    __slots__ = ("_keep", "_names", "_set")
    __hash__ = None  # type: ignore[assignment]  # it changes when a signal is declared

    def __init__(self, keep: Callable[[SignalSpec], bool]) -> None:
        self._keep = keep
        self._names: tuple[str, ...] = ()
        self._set: frozenset[str] = frozenset()

    def _refresh(self) -> None:
        self._names = tuple(s.name for s in _ordered() if self._keep(s))
        self._set = frozenset(self._names)

    def __contains__(self, x: object) -> bool:
        return isinstance(x, str) and x in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        return self._names[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, _Names)):
            return self._names == tuple(other)
        return NotImplemented

    def __add__(self, other: Iterable[str]) -> tuple[str, ...]:
        return self._names + tuple(other)

    def __radd__(self, other: Iterable[str]) -> tuple[str, ...]:
        return tuple(other) + self._names

    def __repr__(self) -> str:
        return repr(self._names)


class _Aggregates(Mapping[str, str]):
    """A live view: per-layer signal -> its :attr:`SignalSpec.aggregate`."""

    def __getitem__(self, name: str) -> str:
        spec = _DECLARED.get(name)
        if spec is None or not spec.per_layer:
            raise KeyError(name)
        return spec.aggregate

    def __iter__(self) -> Iterator[str]:
        return iter(LAYER_SIGNALS)

    def __len__(self) -> int:
        return len(LAYER_SIGNALS)


def _ordered() -> list[SignalSpec]:
    """The declarations, per-layer signals first (each group in declaration order)."""
    every = list(_DECLARED.values())
    return [s for s in every if s.per_layer] + [s for s in every if not s.per_layer]


LAYER_SIGNALS = _Names(lambda s: s.per_layer)
"""Per-layer signals of a sampled ``report`` (``layers`` per layer, ``summary`` aggregated)."""
STEP_SIGNALS = _Names(lambda s: s.probe == "step")
"""Per-rank signals of every ``heartbeat`` (and of every ``report``)."""
AGENT_SIGNALS = _Names(lambda s: s.probe == "agent")
"""Per-rank signals the rank's agent reads (NVML), in the supervisor's ``health`` messages;
none on a machine without NVML."""
SIGNALS = _Names(lambda s: True)
"""Every declared signal: the per-layer ones, then the per-step and the agent's ones."""
AGGREGATE: Mapping[str, str] = _Aggregates()
"""How a rank's ``summary`` aggregates a layer signal over its layers (see :func:`aggregate`)."""
_VIEWS = (LAYER_SIGNALS, STEP_SIGNALS, AGENT_SIGNALS, SIGNALS)


def declare(spec: SignalSpec) -> SignalSpec:
    """Declare a signal, at once in every view and reader (``ValueError`` if its name or its
    metric family is taken); returns it."""
    if spec.name in _DECLARED:
        raise ValueError(f"signal {spec.name!r} is already declared")
    taken = {s.metric.name: s.name for s in _DECLARED.values()}
    if spec.metric.name in taken:
        raise ValueError(
            f"signal {spec.name!r}: metric {spec.metric.name!r} is {taken[spec.metric.name]!r}'s"
        )
    _DECLARED[spec.name] = spec
    _refresh()
    return spec


@contextlib.contextmanager
def declared(*new: SignalSpec) -> Iterator[tuple[SignalSpec, ...]]:
    """Declare ``new`` for the ``with`` block only (a test, a plug-in tried out), then forget
    them again, even when the block raises."""
    added: list[str] = []
    try:
        for spec in new:
            declare(spec)
            added.append(spec.name)
        yield new
    finally:
        for name in added:
            del _DECLARED[name]
        _refresh()


def _refresh() -> None:
    for view in _VIEWS:
        view._refresh()


def spec_of(name: str) -> SignalSpec:
    """The declaration of signal ``name`` (``KeyError`` naming the declared ones otherwise)."""
    try:
        return _DECLARED[name]
    except KeyError:
        raise KeyError(f"undeclared signal {name!r}; declared: {', '.join(SIGNALS)}") from None


def specs(*, per_layer: bool | None = None) -> tuple[SignalSpec, ...]:
    """Every declaration in :data:`SIGNALS` order, or only the per-layer (``True``) or the
    training loop's per-step (``False``: :data:`STEP_SIGNALS`) ones."""
    if per_layer is False:
        return tuple(s for s in _ordered() if s.probe == "step")
    return tuple(s for s in _ordered() if per_layer is None or s.per_layer == per_layer)


def aggregate(name: str, values: Sequence[float]) -> float:
    """Fold the per-layer ``values`` (in layer order, at least one) of signal ``name`` as it is
    declared; a NaN anywhere makes it NaN: a non-finite layer is the worst case."""
    if any(math.isnan(v) for v in values):
        return float("nan")
    how = spec_of(name).aggregate
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "mean":
        return math.fsum(values) / len(values)
    return values[-1]


def worse(name: str, a: float, b: float) -> float:
    """The worse of two values of signal ``name`` (NaN is the worst of all)."""
    if math.isnan(a) or math.isnan(b):
        return float("nan")
    return max(a, b) if spec_of(name).worse_high else min(a, b)


# -- the declarations ----------------------------------------------------------------------------
# Grouped by the probe that computes them (spikeguard.workers.probes), each with its math in
# spikeguard.workers.measure. A new signal is one more declare(...) here, plus its math.

# residual probe: measure.effective_rank_ratio and measure.grade_of of a block's output
declare(
    SignalSpec(
        name="erank_ratio",
        probe="residual",
        display="the effective-rank ratio",
        metric=MetricFamily(
            name="erank_ratio", help="effective rank of the residual output / min(rows, d, k)"
        ),
    )
)
declare(
    SignalSpec(
        name="grade",
        probe="residual",
        display="the grade",
        metric=MetricFamily(
            name="grade", help="stability grade, 0 (S0, collapsing) to 7 (S7, healthy)"
        ),
    )
)
# attention probe: measure.attention_stats of an attention module's Q and K
declare(
    SignalSpec(
        name="attn_entropy_mean",
        probe="attention",
        display="the mean attention entropy",
        metric=MetricFamily(
            name="attn_entropy_mean_nats", help="attention entropy, mean over heads"
        ),
        unit="nats",
    )
)
declare(
    SignalSpec(
        name="attn_entropy_min",
        probe="attention",
        display="the min-head attention entropy",
        metric=MetricFamily(
            name="attn_entropy_min_nats", help="attention entropy of the lowest head"
        ),
        unit="nats",
    )
)
declare(
    SignalSpec(
        name="attn_entropy_min_norm",
        probe="attention",
        display="the min-head attention entropy (normalised to 0..1)",
        metric=MetricFamily(
            name="attn_entropy_min_norm_ratio",
            help="lowest head's attention entropy / log(visible keys)",
        ),
    )
)
declare(
    SignalSpec(
        name="max_logit",
        probe="attention",
        display="the max attention logit",
        metric=MetricFamily(name="max_attn_logit", help="largest pre-softmax attention logit"),
        aggregate="max",
    )
)
# lm_head probe: measure.logz_stats of the output logits
declare(
    SignalSpec(
        name="logz_mean",
        probe="lm_head",
        display="the mean log Z of the output",
        metric=MetricFamily(name="logz_mean", help="log-partition of the LM head's output, mean"),
        aggregate="max",
    )
)
declare(
    SignalSpec(
        name="logz_max",
        probe="lm_head",
        display="the max log Z of the output",
        metric=MetricFamily(name="logz_max", help="log-partition of the LM head's output, max"),
        aggregate="max",
    )
)
# the training loop: Session.step(loss=..., grad_norm=..., lr=...) on every heartbeat
declare(
    SignalSpec(
        name="loss",
        probe="step",
        display="the loss",
        metric=MetricFamily(name="loss", help="the rank's latest loss"),
    )
)
declare(
    SignalSpec(
        name="grad_norm",
        probe="step",
        display="the gradient norm",
        metric=MetricFamily(name="grad_norm", help="the rank's latest gradient norm"),
    )
)
declare(
    SignalSpec(
        name="lr",
        probe="step",
        display="the learning rate",
        metric=MetricFamily(name="lr", help="the rank's latest learning rate (LR scale applied)"),
    )
)
# measured by the SDK on every step (workers/rank/timing.py: the attached model's forward passes
# and the script's "data" phase): the seconds the rank spent computing, not waiting on its peers
# (a rank slower than its peers is a straggler: policies' above_peer_median)
declare(
    SignalSpec(
        name="step_time",
        probe="step",
        display="the step time",
        metric=MetricFamily(
            name="step_seconds", help="seconds the rank spent computing in its latest step"
        ),
        aggregate="max",
        unit="s",
    )
)

# read by the rank's agent from NVML for its rank's GPUs (supervisor/launch/nvml.py), every few
# seconds, when there is NVML; a machine without one reports none of them
declare(
    SignalSpec(
        name="gpu_xid",
        probe="agent",
        display="the latest critical XID error code of the rank's GPUs",
        metric=MetricFamily(name="gpu_xid", help="latest critical XID error code (0: none)"),
        aggregate="max",
    )
)
declare(
    SignalSpec(
        name="gpu_ecc_errors",
        probe="agent",
        display="the uncorrectable ECC errors of the rank's GPUs",
        metric=MetricFamily(name="gpu_ecc_errors", help="uncorrectable ECC errors, summed"),
        aggregate="max",
    )
)
declare(
    SignalSpec(
        name="gpu_throttle_thermal",
        probe="agent",
        display="thermal throttling of the rank's GPUs (1: throttling)",
        metric=MetricFamily(name="gpu_throttle_thermal", help="1 while a GPU throttles for heat"),
        aggregate="max",
    )
)
declare(
    SignalSpec(
        name="gpu_throttle_power",
        probe="agent",
        display="power throttling of the rank's GPUs (1: throttling)",
        metric=MetricFamily(name="gpu_throttle_power", help="1 while a GPU throttles for power"),
        aggregate="max",
    )
)
declare(
    SignalSpec(
        name="gpu_lost",
        probe="agent",
        display="a GPU of the rank fallen off the bus (1: lost)",
        metric=MetricFamily(name="gpu_lost", help="1 when a GPU of the rank is lost"),
        aggregate="max",
    )
)


GRADE_THRESHOLDS: tuple[float, ...] = (0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""Grade boundaries on the effective-rank ratio: the grade is the number of thresholds strictly
below the ratio (> 0.7: S7, healthy; <= 0.1: S0, collapsing)."""


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def summarize(layers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A rank's summary of per-layer signals: each signal aggregated as declared
    (:func:`aggregate`: a NaN anywhere makes it NaN, a non-finite layer is the worst case), plus
    ``worst_layer``, the layer with the lowest grade (ties: the lower ratio, then the name)."""
    out: dict[str, Any] = {}
    for name in LAYER_SIGNALS:
        vals = [v[name] for v in layers.values() if _number(v.get(name))]
        if vals:
            out[name] = aggregate(name, vals)
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
