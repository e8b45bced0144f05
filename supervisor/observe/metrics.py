"""The run's Prometheus metrics as a pure fold: journal events in, metric families out.

Two inputs, no clock and no I/O of its own:

* :meth:`MetricsFold.handle` folds every journal event (it is a notifier, like the console):
  incidents, recovery attempts and how incidents ended, alerts, launch failures and undelivered
  notifications as counters; how long each recovery took (incident to relaunch) as a histogram.
  Events carry a ``kind`` and a reason ``code``; the fold reads those, never the prose.
* :meth:`MetricsFold.tick` reads a :class:`Snapshot` of the controller on each of its ticks: the
  machine's phase, generation and LR scale, and the collector's per-rank views (step, loss, LR,
  grad norm, the latest report's summary and per-layer signals, when each rank last spoke,
  tokens) and drop counts.

:meth:`MetricsFold.families` renders the folded state as :class:`Family` records at scrape time
(``now`` on the supervisor's monotonic clock, so a heartbeat's age keeps growing while the
controller loop is stuck); :mod:`.exporter` turns them into ``prometheus_client`` families.

Naming follows Prometheus' conventions: a ``spikeguard_`` prefix, base units in the name
(``_seconds``, ``_nats``, ``_ratio``), ``_total`` on counters, and labels whose values are
bounded: ``run`` (the job's name), ``rank`` (the world size), ``layer`` (per per-layer signal, at
most ``max_layers`` names: the worst layers, the rest folded into ``layer="(other)"``; see
:meth:`MetricsFold._admit`), ``rule`` (the policy's rule names),
``phase``/``outcome``/``reason``/``severity`` (fixed sets). Never a step, never a free-text
reason.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any, Literal

from spikeguard.workers.contract.signals import LAYER_SIGNALS, aggregate, spec_of, specs, worse

from ..decide import recovery as rc
from ..decide.lifecycle import outcome_of
from ..intake.collector import Collector

PREFIX = "spikeguard_"
OTHER_LAYERS = "(other)"
"""The ``layer`` label of a per-layer signal's layers beyond the ``max_layers`` worst: their
worst value (the signal's aggregation over them)."""
MAX_LABEL_CHARS = 120
"""A longer layer name is shortened (with a hash of the whole, so two stay apart)."""
DURATION_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Upper bounds (seconds) of the recovery-duration histogram's buckets (+Inf is added)."""
INCIDENT_BUCKETS = (60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
"""Upper bounds (seconds) of the incident-duration histogram (probation takes a while)."""

OVER_LAYERS = {
    "min": "worst over layers",
    "max": "highest over layers",
    "mean": "mean over layers",
    "last": "of the last layer",
}
"""A per-layer signal's aggregation (``SignalSpec.aggregate``), as its ``rank_`` family's help
says it. The signals, their families and helps are their declarations (``contract.signals``):
``spikeguard_rank_<metric>`` per rank (a per-step signal, or a per-layer one aggregated) and
``spikeguard_layer_<metric>`` per layer."""

DROP_REASONS = (
    "oversize",
    "malformed",
    "bad_version",
    "unknown_type",
    "wrong_type",
    "out_of_range",
    "unknown_rank",
    "stale_generation",
    "agent_overflow",
    "rank_backpressure",
    "too_many_layers",
)
"""The ``reason`` label of dropped reports (anything else counts as ``other``)."""

MetricType = Literal["gauge", "counter", "histogram"]
"""A metric family's Prometheus type."""
Labels = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Histogram:
    """One histogram series: cumulative bucket counts (by upper bound), the count and sum."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float


@dataclasses.dataclass(frozen=True)
class Family:
    """One metric family: its name (counters end in ``_total``), type, help, label names and
    samples (label values -> value; a histogram's values are :class:`Histogram`)."""

    name: str
    kind: MetricType
    help: str
    labels: Labels
    samples: tuple[tuple[Labels, float], ...] = ()
    histograms: tuple[tuple[Labels, Histogram], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankSnapshot:
    """What the collector knows of one rank at a tick."""

    rank: int
    step: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    summary: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    layers: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    last_seen: float | None = None
    """Supervisor monotonic time of its last message (None: not yet)."""
    tokens_total: int = 0
    running: bool = True
    """Neither exited nor done: its heartbeat's age means something."""
    step_time: float | None = None
    """Seconds the rank computed in its latest measured step (None: not measured)."""
    step_ratio: float | None = None
    """Its recent compute time (the median of its last steps) over the median of its peers'
    (:func:`peer_ratios`): about 1 for every rank of a healthy job, above it for a straggler."""

    def step_value(self, signal: str) -> Any:
        """The rank's latest value of a per-step signal: its field of that name (every declared
        per-step signal has one; ``tests/test_signal_seam.py`` checks it)."""
        return getattr(self, signal, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What one controller tick shows: the machine's state and the collector's views."""

    phase: str
    generation: int
    lr_scale: float
    launched_at: float
    """When the current generation was launched (a rank's age before its first message)."""
    ranks: tuple[RankSnapshot, ...] = ()
    dropped: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rank_dropped: int = 0
    now: float = 0.0


STRAGGLER_RATIO = 1.3
"""The ratio to the peers' median step time at which the views (the live view, ``status``, the
Grafana board, the report) mark a rank slow: the built-in ``straggler`` rule's
``above_peer_median`` (``tests/test_step_time_views.py`` holds them equal). A view's mark only:
what warns or recovers is the policy's rule."""


def is_slow(ratio: Any) -> bool:
    """Whether a ratio to the peers' median marks a rank slow in the views: a finite number at
    or above :data:`STRAGGLER_RATIO` (status.json is input too: anything else is not)."""
    return _number(ratio) and math.isfinite(ratio) and ratio >= STRAGGLER_RATIO


def peer_ratios(medians: Mapping[int, float | None]) -> dict[int, float]:
    """Per rank with a recent compute time: its ratio to the median of the other ranks' (none
    for a rank alone, whose peers' median is not positive, or whose ratio is not a finite
    number: a time that is not finite, or a ratio that overflows against a tiny median). The
    one copy of the ratio every view shows: the metrics, ``status.json`` and the report."""
    known = {
        r: float(m) for r, m in medians.items() if m is not None and _number(m) and math.isfinite(m)
    }
    ordered = sorted(known.values())
    n = len(ordered)
    out: dict[int, float] = {}
    if n < 2:
        return out
    for rank, mine in known.items():
        mid = _median_without(ordered, bisect.bisect_left(ordered, mine))
        if mid > 0 and math.isfinite(mine / mid):
            out[rank] = mine / mid
    return out


def _median_without(ordered: list[float], i: int) -> float:
    """The median of sorted ``ordered`` without its element ``i`` (an index away: a thousand
    ranks cost a sort, not a million comparisons)."""
    k = len(ordered) - 1

    def at(j: int) -> float:  # position j of the list without element i
        return ordered[j if j < i else j + 1]

    return at(k // 2) if k % 2 else (at(k // 2 - 1) + at(k // 2)) / 2


def step_ratios(collector: Collector) -> dict[int, float]:
    """:func:`peer_ratios` of the collector's ranks' recent step-time medians
    (:meth:`~..intake.collector.RankView.step_time_median`): what the metrics and
    ``status.json`` show."""
    return peer_ratios({v.rank: v.step_time_median() for v in collector.ranks.values()})


def snapshot(state: rc.State, collector: Collector, now: float) -> Snapshot:
    """The :class:`Snapshot` of a controller's machine state and collector at ``now``."""
    ratios = step_ratios(collector)
    ranks = tuple(
        RankSnapshot(
            rank=v.rank,
            step=v.step,
            loss=v.loss,
            lr=v.lr,
            grad_norm=v.grad_norm,
            summary=dict(v.summary),
            layers={k: dict(s) for k, s in v.layers.items()},
            last_seen=v.last_seen,
            tokens_total=v.tokens_total,
            running=v.exit_code is None and not v.done,
            step_time=v.step_time,
            step_ratio=ratios.get(v.rank),
        )
        for v in collector.ranks.values()
    )
    return Snapshot(
        phase=state.phase.value,
        generation=state.generation,
        lr_scale=state.lr_scale,
        launched_at=collector.launched_at,
        ranks=ranks,
        dropped=dict(collector.dropped),
        rank_dropped=collector.rank_dropped,
        now=now,
    )


class MetricsFold:
    """The folded state behind ``/metrics``; see the module docstring."""

    def __init__(self, *, run: str, max_layers: int = 64) -> None:
        self.run = run
        self.max_layers = max_layers
        self._layers: dict[str, dict[str, str]] = {}
        """Per-layer signal -> its layers exported under their own name (name -> label value):
        at most ``max_layers``, the worst ones (:meth:`_admit`)."""
        self._folded = 0
        """At the last tick: the most layer names any per-layer signal folded into (other)."""
        self._last: Snapshot | None = None
        self._tick_at: float | None = None
        self._tokens_base: dict[int, int] = {}
        self._tokens_seen: dict[int, int] = {}
        self.incidents: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.recoveries: dict[tuple[str, str], int] = {}
        self.alerts: dict[tuple[str, str], int] = {}
        self.launch_failures = 0
        self.undelivered: dict[str, int] = {}
        """Sink (``slack``, ``pagerduty``, …) -> messages it gave up on."""
        self.durations: dict[str, list[float]] = {}
        """Rule -> seconds from each attempt's incident event to its relaunch."""
        self.incident_durations: dict[tuple[str, str], list[float]] = {}
        """(rule, outcome) -> seconds from each incident's first event to its end."""
        self._opened_at: dict[str, float] = {}
        self._rule_of: dict[str, str] = {}
        """Incident id -> the rule that opened it."""
        self._attempt_at: dict[str, float] = {}
        """Incident id -> ``mono`` of the incident event of its current attempt."""
        self._concluded: set[str] = set()

    # -- the journal ---------------------------------------------------------------------------
    def handle(self, ev: Mapping[str, Any]) -> None:
        """Fold one journal event in (the events of a restarted run's journal too)."""
        kind, inc = ev.get("kind"), ev.get("incident")
        mono = _float(ev.get("mono"))
        if kind == "incident" and isinstance(inc, str):
            if inc not in self._rule_of or inc in self._concluded:
                self._concluded.discard(inc)
                self._rule_of[inc] = _label(ev.get("rule"))
                _bump(self.incidents, self._rule_of[inc])
                if mono is not None:
                    self._opened_at[inc] = mono
            if mono is not None:
                self._attempt_at[inc] = mono
        elif kind == "launch" and ev.get("code") == "relaunch_after_rollback":
            if isinstance(inc, str) and inc in self._rule_of:
                rule = self._rule_of[inc]
                _bump(self.attempts, rule)
                started = self._attempt_at.pop(inc, None)
                if started is not None and mono is not None:
                    self.durations.setdefault(rule, []).append(max(0.0, mono - started))
        elif kind == "launch_failed":
            self.launch_failures += 1
        elif kind == "notify_undelivered":
            sink = ev.get("sink")
            known = ("slack", "alertmanager", "pagerduty", "webhook")
            _bump(self.undelivered, sink if sink in known else "slack" if sink is None else "other")
        elif kind == "alert" and not ev.get("resolved"):
            severity = str(ev.get("severity") or "warn")
            if severity not in ("info", "warn", "page"):
                severity = "warn"
            _bump(self.alerts, (_label(ev.get("rule")), severity))
        outcome = outcome_of(kind)  # the one lifecycle (decide.lifecycle)
        if outcome is not None and isinstance(inc, str) and inc in self._rule_of:
            self._conclude(inc, outcome.value, mono)

    def _conclude(self, inc: str, outcome: str, mono: float | None) -> None:
        """Incident ``inc`` ended (the first ending counts)."""
        if inc in self._concluded:
            return
        self._concluded.add(inc)
        key = (self._rule_of[inc], outcome)
        _bump(self.recoveries, key)
        opened = self._opened_at.pop(inc, None)
        if opened is not None and mono is not None:
            self.incident_durations.setdefault(key, []).append(max(0.0, mono - opened))

    # -- the collector ---------------------------------------------------------------------------
    def tick(self, snap: Snapshot) -> None:
        """Take the controller's view at one tick (it replaces the previous one), and choose
        for each per-layer signal the layers it exports under their own name (:meth:`_admit`)."""
        for r in snap.ranks:
            seen = self._tokens_seen.get(r.rank, 0)
            if r.tokens_total < seen:  # a new generation: its ranks count from 0 again
                self._tokens_base[r.rank] = self._tokens_base.get(r.rank, 0) + seen
            self._tokens_seen[r.rank] = r.tokens_total
        worst: dict[str, dict[str, float]] = {}  # signal -> layer -> the worst over ranks
        for r in snap.ranks:
            for name, signals in r.layers.items():
                for signal, value in signals.items():
                    if signal not in LAYER_SIGNALS or not _number(value):
                        continue
                    at = worst.setdefault(signal, {})
                    old = at.get(name)
                    at[name] = float(value) if old is None else worse(signal, old, float(value))
        folded = 0
        for signal, values in worst.items():
            admitted = self._admit(signal, values)
            folded = max(folded, sum(1 for n in values if n not in admitted))
        self._folded = folded
        self._last = snap
        self._tick_at = snap.now

    def _admit(self, signal: str, values: Mapping[str, float]) -> dict[str, str]:
        """Which layers ``signal`` exports under their own name, given its value per layer at
        this tick (the worst over ranks): up to ``max_layers`` of them, the worst first (where
        its declaration says trouble lies, NaN worst of all; ties in the order reported). Once
        full, a layer replaces the least bad exported one only when it is strictly worse (one
        not reported now is the least bad of all), so a series stays put while nothing worse
        comes along, and memory stays at ``max_layers`` names per signal, whatever the run's
        names. Returns the admitted layers (name -> label)."""
        admitted = self._layers.setdefault(signal, {})
        cap = self.max_layers
        if cap <= 0:
            return admitted
        labels = set(admitted.values())
        bad = {n: badness(signal, v) for n, v in values.items()}

        def now(name: str) -> float:
            return bad.get(name, -math.inf)

        victims = sorted(admitted, key=now)  # the least bad first
        floor = now(victims[0]) if len(admitted) >= cap else -math.inf
        candidates = [n for n in values if n not in admitted and bad[n] > floor]
        candidates.sort(key=lambda n: -bad[n])  # the worst first (stable: the order reported)
        next_victim = 0
        for name in candidates:
            label = _label_value(name)
            if label == OTHER_LAYERS or label in labels:
                continue  # cannot be told apart: folded into (other)
            if len(admitted) >= cap:
                if next_victim == len(victims) or bad[name] <= now(victims[next_victim]):
                    break  # no exported layer is less bad than this one (nor than the rest)
                labels.discard(admitted.pop(victims[next_victim]))
                next_victim += 1
            admitted[name] = label
            labels.add(label)
        return admitted

    # -- the exposition ---------------------------------------------------------------------------
    def families(self, now: float) -> list[Family]:
        """Every family, with its samples as of the last tick (ages measured at ``now``)."""
        run = self.run
        out = self._run_families(now)
        out += self._rank_families(now)
        out += [
            _counter(
                "incidents_total",
                "incidents opened, by the rule that opened them",
                ("run", "rule"),
                {(run, r): n for r, n in self.incidents.items()},
            ),
            _counter(
                "recovery_attempts_total",
                "relaunches after a rollback, by the incident's rule",
                ("run", "rule"),
                {(run, r): n for r, n in self.attempts.items()},
            ),
            _counter(
                "recoveries_total",
                "incidents that ended, by rule and outcome (resolved, escalated, failed, stopped)",
                ("run", "rule", "outcome"),
                {(run, r, o): n for (r, o), n in self.recoveries.items()},
            ),
            _counter(
                "alerts_total",
                "notify and checkpoint rules that fired, by rule and severity",
                ("run", "rule", "severity"),
                {(run, r, s): n for (r, s), n in self.alerts.items()},
            ),
            _counter(
                "launch_failures_total",
                "launches that did not come up (retried outside the incident budget)",
                ("run",),
                {(run,): self.launch_failures},
            ),
            _counter(
                "notify_undelivered_total",
                "notifications given up on, by sink",
                ("run", "sink"),
                {(run, k): n for k, n in self.undelivered.items()},
            ),
            self._dropped(),
            *self._durations(),
        ]
        return out

    def _run_families(self, now: float) -> list[Family]:
        snap, run = self._last, self.run
        phases = [p.value for p in rc.Phase]
        current = snap.phase if snap else rc.Phase.STARTING.value  # before the first tick
        gauges = [
            Family(
                PREFIX + "phase",
                "gauge",
                "the recovery machine's phase: 1 for the current one, 0 for the others",
                ("run", "phase"),
                tuple(((run, p), 1.0 if p == current else 0.0) for p in phases),
            ),
        ]
        if snap is None:
            return gauges
        gauges += [
            _gauge(
                "generation",
                "the generation of ranks running now",
                ("run",),
                {(run,): snap.generation},
            ),
            _gauge(
                "lr_scale",
                "the compounded LR scale of every launch",
                ("run",),
                {(run,): snap.lr_scale},
            ),
            _gauge("world_size", "ranks per generation", ("run",), {(run,): len(snap.ranks)}),
            _gauge(
                "layers_folded",
                "layer names beyond max_layers (the most of any per-layer signal), exported as "
                'layer="(other)"',
                ("run",),
                {(run,): self._folded},
            ),
            _gauge(
                "tick_age_seconds",
                "seconds since the controller's loop last ran",
                ("run",),
                {(run,): max(0.0, now - (self._tick_at or now))},
            ),
        ]
        return gauges

    def _rank_families(self, now: float) -> list[Family]:
        snap, run = self._last, self.run
        ranks = snap.ranks if snap else ()
        per_rank: dict[str, dict[Labels, float]] = {}
        per_layer: dict[str, dict[Labels, float]] = {}
        steps: dict[Labels, float] = {}
        ages: dict[Labels, float] = {}
        tokens: dict[Labels, float] = {}
        step_ratios: dict[Labels, float] = {}
        for r in ranks:
            key = (run, str(r.rank))
            step = _float(r.step)
            if step is not None:
                steps[key] = step
            for spec in specs(per_layer=False):
                number = _float(r.step_value(spec.name))
                if number is not None:
                    per_rank.setdefault(spec.name, {})[key] = number
            for signal, value in r.summary.items():
                if signal in LAYER_SIGNALS and _number(value):
                    per_rank.setdefault(signal, {})[key] = float(value)
            for layer, signals in self._layer_values(r.layers).items():
                for signal, value in signals.items():
                    per_layer.setdefault(signal, {})[(run, str(r.rank), layer)] = value
            if r.running and snap is not None:
                since = snap.launched_at if r.last_seen is None else r.last_seen
                ages[key] = max(0.0, now - since)
            if r.step_ratio is not None:
                step_ratios[key] = r.step_ratio
            if r.tokens_total or self._tokens_base.get(r.rank):
                tokens[key] = float(self._tokens_base.get(r.rank, 0) + r.tokens_total)
        labels = ("run", "rank")
        out = [
            _gauge("rank_step", "the rank's latest step", labels, steps),
            *(
                _signal(spec.name, "rank_", spec.metric.help, labels, per_rank)
                for spec in specs(per_layer=False)
            ),
            _gauge(
                "rank_heartbeat_age_seconds",
                "seconds since the rank's last message (since its launch, before the first)",
                labels,
                ages,
            ),
            _gauge(
                "rank_step_ratio",
                "the rank's recent compute time over the median of its peers' (a straggler: > 1)",
                labels,
                step_ratios,
            ),
            _counter(
                "rank_tokens_total",
                "tokens the rank reported processing (sg.step(tokens=...))",
                labels,
                tokens,
            ),
        ]
        layer_specs = specs(per_layer=True)
        out += [
            _signal(
                s.name, "rank_", f"{s.metric.help} ({OVER_LAYERS[s.aggregate]})", labels, per_rank
            )
            for s in layer_specs
        ]
        out += [
            _signal(s.name, "layer_", f"{s.metric.help}, per layer", labels + ("layer",), per_layer)
            for s in layer_specs
        ]
        return out

    def _layer_values(self, layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
        """Per exported layer label: its signals; the layers a signal does not export under
        their own name folded into ``(other)`` with the worst value (NaN if any is NaN)."""
        out: dict[str, dict[str, float]] = {}
        other: dict[str, list[float]] = {}
        if self.max_layers <= 0:
            return out  # no per-layer series at all (the rank_ families have the worst layer)
        for name, signals in layers.items():
            for signal, value in signals.items():
                if signal not in LAYER_SIGNALS or not _number(value):
                    continue
                label = self._layers.get(signal, {}).get(name)
                if label is not None:
                    out.setdefault(label, {})[signal] = float(value)
                else:
                    other.setdefault(signal, []).append(float(value))
        for signal, values in other.items():
            out.setdefault(OTHER_LAYERS, {})[signal] = aggregate(signal, values)
        return out

    def _dropped(self) -> Family:
        counts: dict[Labels, float] = {}
        snap = self._last
        if snap is not None:
            for reason, n in snap.dropped.items():
                key = (self.run, reason if reason in DROP_REASONS else "other")
                counts[key] = counts.get(key, 0.0) + n
            if snap.rank_dropped:
                counts[(self.run, "rank_backpressure")] = float(snap.rank_dropped)
        return _counter(
            "reports_dropped_total",
            "rank messages dropped, by reason (malformed, stale_generation, ...)",
            ("run", "reason"),
            counts,
        )

    def _durations(self) -> list[Family]:
        recoveries: dict[Labels, list[float]] = {
            (self.run, rule): v for rule, v in self.durations.items()
        }
        incidents: dict[Labels, list[float]] = {
            (self.run, rule, outcome): v for (rule, outcome), v in self.incident_durations.items()
        }
        return [
            _histogram(
                "recovery_duration_seconds",
                "seconds from an incident (each attempt) to the relaunch of its ranks: kill, "
                "batch forensics, rollback and launch",
                ("run", "rule"),
                recoveries,
                DURATION_BUCKETS,
            ),
            _histogram(
                "incident_duration_seconds",
                "seconds from an incident's first event to its end (probation included)",
                ("run", "rule", "outcome"),
                incidents,
                INCIDENT_BUCKETS,
            ),
        ]


def _histogram(
    name: str,
    help: str,
    labels: Labels,
    values: Mapping[Labels, list[float]],
    bounds: tuple[float, ...],
) -> Family:
    series = []
    for key, vs in sorted(values.items()):
        buckets = tuple((b, sum(1 for v in vs if v <= b)) for b in bounds)
        hist = Histogram(buckets + ((math.inf, len(vs)),), len(vs), sum(vs))
        series.append((key, hist))
    return Family(PREFIX + name, "histogram", help, labels, histograms=tuple(series))


def _signal(
    signal: str,
    prefix: str,
    help: str,
    labels: Labels,
    values: Mapping[str, Mapping[Labels, float]],
) -> Family:
    """The family of a declared signal (``prefix`` + its metric's name, of its metric's type),
    with the series ``values`` hold for it."""
    metric = spec_of(signal).metric
    series = tuple(sorted(values.get(signal, {}).items()))
    return Family(PREFIX + prefix + metric.name, metric.type, help, labels, series)


def _gauge(name: str, help: str, labels: Labels, values: Mapping[Labels, float]) -> Family:
    return Family(PREFIX + name, "gauge", help, labels, tuple(sorted(values.items())))


def _counter(name: str, help: str, labels: Labels, values: Mapping[Labels, float]) -> Family:
    return Family(PREFIX + name, "counter", help, labels, tuple(sorted(values.items())))


def _bump(counts: dict[Any, int], key: Any) -> None:
    counts[key] = counts.get(key, 0) + 1


def _label(value: Any) -> str:
    """A rule name as a label value (None: empty; clipped like a layer name)."""
    return "" if value is None else str(value)[:MAX_LABEL_CHARS]


def _label_value(name: str) -> str:
    """A layer name as a label value: clipped to :data:`MAX_LABEL_CHARS` with a hash of the
    whole, so two long names stay apart."""
    if len(name) <= MAX_LABEL_CHARS:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "replace")).hexdigest()[:8]
    return f"{name[: MAX_LABEL_CHARS - 10]}…{digest}"


def badness(signal: str, value: float) -> float:
    """How bad ``value`` of ``signal`` is, larger worse (by where its declaration says trouble
    lies), NaN the worst of all: the sort key of "the worst layers" here and in the report's
    run data (:mod:`.rundata`)."""
    if math.isnan(value):
        return math.inf
    return value if spec_of(signal).worse_high else -value


def _float(x: Any) -> float | None:
    """``x`` as a float, or None when it is not a number (None, a string, a bool)."""
    return float(x) if _number(x) else None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
