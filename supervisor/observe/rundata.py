"""What a run directory holds, read for the post-mortem: any run, finished, running or crashed.

:func:`load_run` reads ``journal.jsonl`` (the story), ``reports.jsonl`` or, as recordings keep
it, ``reports.jsonl.gz`` (every accepted rank message, streamed and folded per generation and
step, so a long run never sits in memory whole), the checkpoints' sidecars where the run
recorded its checkpoints (torch-free:
:func:`~spikeguard.workers.checkpoint.choose.list_checkpoints`) and the incidents' batch-ids
files. A part that is missing or cannot be read is left out and said in ``problems``; a torn or
malformed line costs that line only.

Per (generation, step), over ranks: the mean loss and grad norm (every heartbeat), and the worst
of each declared per-layer signal (every report's summary, by where its declaration says trouble
lies): the lowest grade, rank ratio and entropy, the highest logit and log Z. Per (generation,
step, layer): the lowest grade and normalised min-head entropy (:data:`HEATMAP_SIGNALS`), for the
worst :data:`MAX_LAYER_SERIES` layers of each generation and signal only: a run whose ranks
reported tens of thousands of layer names (an old run, a hostile rank) costs the report time in
proportion to its file and memory in proportion to that bound, not to names × steps. The layers
left out are counted (:attr:`Generation.layer_count`), so the page can say how many it hides.
Per (generation, rank): its ``step_time`` (seconds it computed in a step), the mean over bins of
steps (:class:`StepTimes`: at most :data:`MAX_STEP_BINS` bins a rank, at most
:data:`MAX_TIMED_RANKS` ranks a generation), a timing kept only as validation would accept it
(:func:`~spikeguard.workers.contract.messages.is_timing`: finite, in [0, ``MAX_STEP_TIME_S``]).
"""

from __future__ import annotations

import dataclasses
import gzip
import heapq
import math
import statistics
from array import array
from pathlib import Path
from typing import IO, Any

from spikeguard.workers.checkpoint.choose import list_checkpoints
from spikeguard.workers.contract.messages import is_timing, loads_text
from spikeguard.workers.contract.signals import LAYER_SIGNALS, worse

from ..decide import recovery as rc
from ..intake import forensics
from ..journal import read_events
from ..settings import RunPaths
from .metrics import badness, peer_ratios

HEATMAP_SIGNALS = ("grade", "attn_entropy_min_norm")
"""The per-layer signals kept per layer: the ones the report's heatmaps show (every declared
per-layer signal is kept per step, the worst over ranks)."""
MAX_LAYER_SERIES = 256
"""Per generation and heatmap signal, how many layers keep their per-step values: the worst ones
by their worst value so far (the report shows the worst :data:`~.report.MAX_LAYER_ROWS` of them).
Below it, every layer is kept and the choice is exact; above it, a layer is admitted only when
its value is worse than the least bad kept one's, which it then replaces (a layer let in late
has its values from then on: the steps before read "not sampled")."""
MAX_NAMES_COUNTED = 65_536
"""Distinct layer names remembered for counting and row order, per generation and signal (and
for the run's row order); beyond it a count is a lower bound (:attr:`Generation.layer_count`)."""


@dataclasses.dataclass
class LayerSeries:
    """One layer's values of one heatmap signal, per sampled step (the worst over ranks)."""

    name: str
    order: int
    """When the run first reported the layer: the rows' order (the model's order, usually)."""
    worst: float
    """Its worst value over the steps kept (NaN: a non-finite value, the worst of all)."""
    values: dict[int, float] = dataclasses.field(default_factory=dict)


class _Kept:
    """The worst :data:`MAX_LAYER_SERIES` layers of one (generation, signal), kept while the
    reports stream by: a layer not kept replaces the least bad kept one when its value is worse.
    ``_heap`` holds (badness, name) with stale entries dropped lazily (a kept layer's badness only
    grows); ``_floor`` is a lower bound of the least bad kept layer's badness, so most values of
    layers not kept are turned away without touching the heap."""

    def __init__(self, signal: str) -> None:
        self.signal = signal
        self.series: dict[str, LayerSeries] = {}
        self.names: set[str] = set()
        self.more = False
        """A name beyond :data:`MAX_NAMES_COUNTED` was seen: the count is a lower bound."""
        self._heap: list[tuple[float, str]] = []
        self._floor = -math.inf

    def add(self, name: str, step: int, value: float, order: dict[str, int]) -> None:
        """Fold one rank's ``value`` of layer ``name`` at ``step`` in: amortised constant time,
        logarithmic in :data:`MAX_LAYER_SERIES` when it displaces a kept layer."""
        kept = self.series.get(name)
        if kept is not None:
            old = kept.values.get(step)
            kept.values[step] = value if old is None else worse(self.signal, old, value)
            kept.worst = worse(self.signal, kept.worst, value)
            return
        self._count(name)
        at = _order_of(name, order)
        bad = badness(self.signal, value)
        if len(self.series) >= MAX_LAYER_SERIES:
            if bad <= self._floor or bad <= self._least_bad():
                return  # not worse than any kept layer
            _, victim = heapq.heappop(self._heap)
            del self.series[victim]
        self.series[name] = LayerSeries(name, at, value, {step: value})
        heapq.heappush(self._heap, (bad, name))

    def _least_bad(self) -> float:
        """The least bad kept layer's badness (its heap entry made current, on top)."""
        while True:
            bad, name = self._heap[0]
            kept = self.series.get(name)
            now = None if kept is None else badness(self.signal, kept.worst)
            if now == bad:
                self._floor = bad
                return bad
            if now is None:  # not kept any more (cannot happen: an evicted layer is popped)
                heapq.heappop(self._heap)
            else:  # it got worse since it was pushed: move it down the heap
                heapq.heapreplace(self._heap, (now, name))

    def _count(self, name: str) -> None:
        if name in self.names:
            return
        if len(self.names) < MAX_NAMES_COUNTED:
            self.names.add(name)
        else:
            self.more = True


def _order_of(name: str, order: dict[str, int]) -> int:
    """``name``'s place in the run's first-seen order (remembered for at most
    :data:`MAX_NAMES_COUNTED` names; a later one comes after all of them)."""
    at = order.get(name)
    if at is None:
        at = len(order)
        if at < MAX_NAMES_COUNTED:
            order[name] = at
    return at


MAX_STEP_BINS = 256
"""Per rank of a generation, its step times are kept as means over at most this many bins of
equal width (in steps): a rank costs the same whatever the generation's length. The width
doubles (or more, at once) when a step falls beyond the last bin."""
MAX_TIMED_RANKS = 4096
"""Per generation, the ranks whose step times are kept (the first this many to report one; the
values of the others are counted, :attr:`StepTimes.left_out`)."""
STRETCH_BINS = 5
"""A rank's slowest stretch (:meth:`StepTimes.stretches`) is over this many consecutive bins it
has a ratio in: one slow step (a checkpoint, a probe) is not a stretch, a rank slow for a while
is, whenever in the generation it became slow."""


@dataclasses.dataclass(frozen=True)
class Stretch:
    """A rank's slowest stretch of a generation: the median of its per-bin ratios to its peers'
    median over :data:`STRETCH_BINS` consecutive bins, and the steps those bins cover."""

    ratio: float
    first: int
    last: int


class StepTimes:
    """One generation's ``step_time`` per rank: per bin of :attr:`width` steps from
    :attr:`origin` (the first step reported), the sum and count of the rank's values, in one
    flat array of doubles per rank (``[sum0, n0, sum1, n1, ...]``, :data:`MAX_STEP_BINS` bins):
    memory ranks × bins, time constant per value (and ranks × bins when the bins widen, at most
    a few dozen times). A step before the origin counts into the first bin."""

    def __init__(self) -> None:
        self.origin: int | None = None
        """The first step any rank reported a step time at."""
        self.width = 1
        """Steps per bin."""
        self.bins = 0
        """Bins in use (the last one with a value, plus one)."""
        self.rows: dict[int, array[float]] = {}
        """Rank -> its bins' sums and counts."""
        self.left_out = 0
        """Values of ranks beyond :data:`MAX_TIMED_RANKS`, not kept."""

    def add(self, rank: int, step: int, seconds: float) -> None:
        """Rank ``rank`` computed ``seconds`` in ``step``."""
        if self.origin is None:
            self.origin = step
        offset = max(0, step - self.origin)
        if offset // self.width >= MAX_STEP_BINS:
            factor = 1
            while offset // (self.width * factor) >= MAX_STEP_BINS:
                factor *= 2
            self._widen(factor)
        i = offset // self.width
        row = self.rows.get(rank)
        if row is None:
            if len(self.rows) >= MAX_TIMED_RANKS:
                self.left_out += 1
                return
            row = self.rows[rank] = array("d", bytes(16 * MAX_STEP_BINS))
        row[2 * i] += seconds
        row[2 * i + 1] += 1
        self.bins = max(self.bins, i + 1)

    def _widen(self, factor: int) -> None:
        """Bins ``factor`` times as wide: new bin j sums old bins j×factor … (j+1)×factor - 1."""
        for row in self.rows.values():
            merged = array("d", bytes(16 * MAX_STEP_BINS))
            for i in range(self.bins):
                j = i // factor
                merged[2 * j] += row[2 * i]
                merged[2 * j + 1] += row[2 * i + 1]
            row[:] = merged
        self.width *= factor
        self.bins = -(-self.bins // factor)

    def step_of(self, i: int) -> float:
        """The middle step of bin ``i``."""
        return (self.origin or 0) + i * self.width + (self.width - 1) / 2

    def series(self, rank: int) -> list[tuple[float, float]]:
        """Rank ``rank``'s (middle step, mean step time) of each bin it has values in."""
        row = self.rows.get(rank)
        if row is None:
            return []
        return [
            (self.step_of(i), row[2 * i] / row[2 * i + 1])
            for i in range(self.bins)
            if row[2 * i + 1]
        ]

    def medians(self) -> dict[int, float]:
        """Per rank: the median of its bins' means, its step time over the generation (one slow
        step - a checkpoint, a probe - left out, as the live views' median does)."""
        return {rank: statistics.median(v for _, v in self.series(rank)) for rank in self.rows}

    def stretches(self) -> dict[int, Stretch]:
        """Per rank with a ratio: its slowest :class:`Stretch`. In each bin, each rank's mean
        over the median of the other ranks' means there (:func:`~.metrics.peer_ratios`, the
        ratio every view shows); then the highest median of :data:`STRETCH_BINS` consecutive
        ones (of all of them, for a rank with fewer). Time: bins × ranks × log(ranks)."""
        per_rank: dict[int, list[tuple[int, float]]] = {}
        for i in range(self.bins):
            means = {
                r: row[2 * i] / row[2 * i + 1] for r, row in self.rows.items() if row[2 * i + 1]
            }
            for rank, ratio in peer_ratios(means).items():
                per_rank.setdefault(rank, []).append((i, ratio))
        out = {}
        origin = self.origin or 0
        for rank, pts in per_rank.items():
            k = min(STRETCH_BINS, len(pts))
            windows = (
                (statistics.median(x for _, x in pts[j : j + k]), pts[j][0], pts[j + k - 1][0])
                for j in range(len(pts) - k + 1)
            )
            ratio, i0, i1 = max(windows, key=lambda w: w[0])  # the first of equal ones
            first, last = origin + i0 * self.width, origin + (i1 + 1) * self.width - 1
            out[rank] = Stretch(ratio, first, last)
        return out

    def median_series(self) -> list[tuple[float, float]]:
        """Per bin: (middle step, the median over ranks of their means in it)."""
        out = []
        for i in range(self.bins):
            means = [row[2 * i] / row[2 * i + 1] for row in self.rows.values() if row[2 * i + 1]]
            if means:
                out.append((self.step_of(i), statistics.median(means)))
        return out


@dataclasses.dataclass
class Generation:
    """What the ranks of one generation reported, per step (over ranks)."""

    number: int
    loss: dict[int, float] = dataclasses.field(default_factory=dict)
    grad_norm: dict[int, float] = dataclasses.field(default_factory=dict)
    signals: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    layer_steps: set[int] = dataclasses.field(default_factory=set)
    """The steps any rank reported a heatmap signal of a layer at (the heatmap's samples)."""
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)
    """Step -> how its batch was skipped (``steps`` or ``batch_ids``)."""
    step_times: StepTimes = dataclasses.field(default_factory=StepTimes)
    """Each rank's ``step_time`` over the generation's steps (bounded: :class:`StepTimes`)."""
    _kept: dict[str, _Kept] = dataclasses.field(default_factory=dict, repr=False)
    _sums: dict[int, list[float]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def steps(self) -> tuple[int, int] | None:
        """The first and last step any rank of this generation reported."""
        known = list(self._sums) or list(self.loss) or list(self.signals)
        return (min(known), max(known)) if known else None

    @property
    def series(self) -> dict[str, dict[str, LayerSeries]]:
        """Heatmap signal -> the layers kept for it (at most :data:`MAX_LAYER_SERIES`)."""
        return {signal: k.series for signal, k in self._kept.items()}

    def layer_count(self, signal: str) -> tuple[int, bool]:
        """How many distinct layers reported ``signal`` in this generation, and whether that is
        only a lower bound (more than :data:`MAX_NAMES_COUNTED`)."""
        k = self._kept.get(signal)
        return (0, False) if k is None else (len(k.names), k.more)

    @property
    def layers(self) -> dict[int, dict[str, dict[str, float]]]:
        """Step -> layer -> signal -> value, of the layers kept (built on each call)."""
        out: dict[int, dict[str, dict[str, float]]] = {}
        for signal, kept in self.series.items():
            for name, s in kept.items():
                for step, value in s.values.items():
                    out.setdefault(step, {}).setdefault(name, {})[signal] = value
        return dict(sorted(out.items()))


@dataclasses.dataclass
class Forensics:
    """One incident's batch-ids file, read back (``error`` when it could not be)."""

    path: Path
    incident: str
    attempt: int
    doc: dict[str, Any] | None = None
    error: str | None = None


@dataclasses.dataclass
class RunData:
    """Everything the report shows of one run directory."""

    run_dir: Path
    name: str
    events: list[dict[str, Any]]
    state: rc.State | None
    generations: dict[int, Generation]
    layer_names: list[str]
    """The layers kept in any generation (:attr:`Generation.series`), in first-seen order."""
    checkpoints: list[Any]
    checkpoint_problems: list[tuple[str, str]]
    forensics: list[Forensics]
    reports_file: Path | None
    problems: list[str]


def reports_path(run_dir: Path) -> Path | None:
    """``reports.jsonl``, else ``reports.jsonl.gz``, else None."""
    for name in ("reports.jsonl", "reports.jsonl.gz"):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


def _open_reports(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def load_run(run_dir: str | Path) -> RunData:
    """Read ``run_dir`` (see the module docstring); ``FileNotFoundError`` when it holds no
    journal and no reports (it is not a run directory)."""
    run = Path(run_dir)
    problems: list[str] = []
    reports = reports_path(run)
    if not (run / "journal.jsonl").is_file() and reports is None:
        raise FileNotFoundError(f"{run} holds no journal.jsonl and no reports.jsonl(.gz)")
    events = read_events(run)
    state: rc.State | None = None
    try:
        state = rc.fold(events)
    except (ValueError, TypeError, KeyError) as e:
        problems.append(f"the journal does not fold into a recovery state: {e}")
    generations: dict[int, Generation] = {}
    order: dict[str, int] = {}
    if reports is None:
        problems.append("no reports.jsonl(.gz): the panels are empty")
    else:
        try:
            _read_reports(reports, generations, order)
        except (OSError, EOFError) as e:  # a truncated .gz: what was read so far counts
            problems.append(f"{reports.name} could not be read to its end: {e}")
    kept: dict[str, int] = {}
    for g in generations.values():
        _finish(g)
        for series in g.series.values():
            kept.update((name, s.order) for name, s in series.items())
    ckpts = list_checkpoints(RunPaths.recorded(run).ckpt_dir)
    names = [e.get("run") for e in events if isinstance(e.get("run"), str)]
    return RunData(
        run_dir=run,
        name=names[0] if names else run.name,
        events=events,
        state=state,
        generations=dict(sorted(generations.items())),
        layer_names=sorted(kept, key=lambda n: (kept[n], n)),
        checkpoints=list(ckpts),
        checkpoint_problems=list(ckpts.problems),
        forensics=_read_forensics(run),
        reports_file=reports,
        problems=problems,
    )


def _read_reports(path: Path, gens: dict[int, Generation], order: dict[str, int]) -> None:
    with _open_reports(path) as f:
        for line in f:
            try:
                msg = loads_text(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(msg, dict):
                _fold(msg, gens, order)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fold(msg: dict[str, Any], gens: dict[int, Generation], order: dict[str, int]) -> None:
    """Fold one rank message into its generation; ``order`` is the run's first-seen order of
    layer names (:func:`_order_of`)."""
    kind, gen, step = msg.get("type"), msg.get("gen"), msg.get("step")
    if not (_int(gen) and _int(step)):
        return
    g = gens.get(gen)
    if g is None:
        g = gens[gen] = Generation(gen)
    if kind == "skipped":
        g.skipped[step] = str(msg.get("by") or "steps")
        return
    if kind not in ("heartbeat", "report"):
        return
    sums = g._sums.setdefault(step, [0.0, 0.0, 0.0, 0.0, 0.0])
    loss, gn = msg.get("loss"), msg.get("grad_norm")
    if _num(loss):
        if math.isfinite(loss):
            sums[0] += loss
            sums[1] += 1
        else:
            sums[4] += 1
    if _num(gn) and math.isfinite(gn):
        sums[2] += gn
        sums[3] += 1
    seconds, rank = msg.get("step_time"), msg.get("rank")
    if is_timing(seconds) and _int(rank):  # the bounds validation applies (NaN, huge: not)
        g.step_times.add(rank, step, float(seconds))
    if kind != "report":
        return
    summary = msg.get("summary")
    if isinstance(summary, dict):
        worst = g.signals.setdefault(step, {})
        for name in LAYER_SIGNALS:
            _keep_worst(worst, name, summary.get(name))
    per_layer = msg.get("layers")
    if isinstance(per_layer, dict):
        for layer, signals in per_layer.items():
            if not isinstance(signals, dict):
                continue
            for name in HEATMAP_SIGNALS:
                value = signals.get(name)
                if not _num(value):
                    continue
                kept = g._kept.get(name)
                if kept is None:
                    kept = g._kept[name] = _Kept(name)
                kept.add(str(layer), step, float(value), order)
                g.layer_steps.add(step)


def _keep_worst(into: dict[str, float], name: str, value: Any) -> None:
    """Keep the worse of ``into[name]`` and ``value`` (by where the signal's declaration says
    trouble lies; NaN is the worst of all)."""
    if not _num(value):
        return
    old = into.get(name)
    into[name] = float(value) if old is None else worse(name, old, float(value))


def _finish(g: Generation) -> None:
    """Means from the running sums (a step whose every loss was non-finite reads NaN)."""
    for step, (ls, ln, gs, gn, bad) in g._sums.items():
        if ln:
            g.loss[step] = ls / ln
        elif bad:
            g.loss[step] = math.nan
        if gn:
            g.grad_norm[step] = gs / gn


def _read_forensics(run: Path) -> list[Forensics]:
    out = []
    base = run / forensics.INCIDENTS_DIR
    for path in base.glob("inc-*/batch_ids-*.json") if base.is_dir() else ():
        try:
            attempt = int(path.stem.rpartition("-")[2])
        except ValueError:
            continue
        item = Forensics(path=path, incident=path.parent.name, attempt=attempt)
        try:
            item.doc = forensics.read_batch_ids(path)
        except ValueError as e:
            item.error = str(e)
        out.append(item)
    return sorted(out, key=lambda f: (f.incident, f.attempt))
