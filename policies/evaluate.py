"""Evaluating one condition on one message: values, trailing series, and the tests themselves.

Pure functions of a message and the series the engine keeps; no state of their own.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from spikeguard.workers.contract.signals import LAYER_SIGNALS, aggregate, spec_of

from .conditions import (
    AllOf,
    AnyOf,
    Change,
    Crash,
    Hang,
    NonFinite,
    PeerRelative,
    Threshold,
    Trailing,
)
from .values import format_grade


@dataclasses.dataclass(frozen=True)
class Hit:
    """A condition held: which signal, its value, on which layer, in words."""

    signal: str | None
    value: float | None
    layer: str | None
    text: str


def number(v: Any) -> float | None:
    """A reported value as a float, or None when absent or not a number."""
    if type(v) is float:  # most values: no conversion, no isinstance
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def fmt(signal: str | None, v: float | None) -> str:
    if v is None:
        return "null"
    if signal == "grade" and math.isfinite(v):
        return format_grade(v)
    return f"{v:.4g}"


class RankMessage:
    """A parsed rank message (heartbeat, report, exit, hang) as the engine evaluates it: its step,
    its time and its layers, with the accessors the conditions' tests need."""

    def __init__(self, raw: dict, step: int, at: float) -> None:
        self.raw, self.type, self.step, self.at = raw, raw.get("type"), step, at
        self.rank: int = raw["rank"]
        layers = raw.get("layers")
        self.layers: dict[str, dict] = (
            {k: v for k, v in layers.items() if isinstance(k, str) and isinstance(v, dict)}
            if isinstance(layers, dict)
            else {}
        )

    def value(self, signal: str, layer: str | None) -> float | None:
        if signal not in LAYER_SIGNALS:
            return number(self.raw.get(signal))
        if layer is not None:
            return number(self.layers.get(layer, {}).get(signal))
        summary = self.raw.get("summary")
        v = number(summary.get(signal)) if isinstance(summary, dict) else None
        if v is not None:
            return v
        values = [x for x in (number(d.get(signal)) for d in self.layers.values()) if x is not None]
        return aggregate(signal, values) if values else None

    def source_layer(self, signal: str, layer: str | None) -> str | None:
        """The layer a value came from: the layer itself, or the one that set the summary value."""
        if layer is not None or signal not in LAYER_SIGNALS:
            return layer
        v = self.value(signal, None)
        for name, d in self.layers.items():
            if number(d.get(signal)) == v:
                return name
        summary = self.raw.get("summary")
        worst = summary.get("worst_layer") if isinstance(summary, dict) else None
        return worst if signal == "grade" and isinstance(worst, str) else None


class Series:
    """The recent (step, value) points of one signal on one rank and layer (see the engine's
    docstring for what a new generation keeps).

    Steps and values are kept in two parallel deques, with a count of the non-finite values, so
    that a trailing window's values are a slice taken in C (:meth:`window`): every heartbeat of
    every rank asks for one."""

    __slots__ = ("_extremes", "_since", "first_step", "nonfinite", "steps", "values")

    def __init__(self, maxlen: int) -> None:
        self.steps: collections.deque[int] = collections.deque(maxlen=maxlen)
        self.values: collections.deque[float] = collections.deque(maxlen=maxlen)
        self.nonfinite = 0
        """How many of ``values`` are NaN or infinite."""
        self.first_step: int | None = None
        self._extremes: tuple[float, float] | None = None
        self._since = 0

    @property
    def maxlen(self) -> int | None:
        return self.steps.maxlen

    @property
    def points(self) -> list[tuple[int, float]]:
        """Every (step, value) point held, oldest first."""
        return list(zip(self.steps, self.values))

    def add(self, step: int, value: float) -> None:
        steps = self.steps
        if steps and step <= steps[-1]:
            return  # the report repeats its step's heartbeat, or arrived late
        if self.first_step is None:
            self.first_step = step
        if len(steps) == steps.maxlen and not math.isfinite(self.values[0]):
            self.nonfinite -= 1  # the oldest point is about to be let go
        if not math.isfinite(value):
            self.nonfinite += 1
        elif self._extremes is not None:
            lo, hi = self._extremes
            if value < lo or value > hi:
                self._extremes = (min(lo, value), max(hi, value))
        self._since += 1
        steps.append(step)
        self.values.append(value)

    def extremes(self, exact: bool = False) -> tuple[float, float] | None:
        """Bounds (lo, hi) of the finite values held: lo <= their minimum, hi >= their maximum
        (None: no finite value was held when they were last computed). Kept up to date as
        values come in, and recomputed (exactly their minimum and maximum) when ``exact`` or
        once every value they were computed on has been let go (until then a value let go may
        only have loosened them). For :func:`screen`, asked on every heartbeat."""
        if self._since and (exact or self._since >= (self.steps.maxlen or 0)):
            self._extremes = None
        if self._extremes is None:
            values: Iterable[float] = self.values
            if self.nonfinite:
                values = [x for x in values if math.isfinite(x)]
            self._extremes = (min(values), max(values)) if values else None
            self._since = 0
        return self._extremes

    @property
    def exact(self) -> bool:
        """Whether :meth:`extremes` is exactly the minimum and maximum held now."""
        return self._since == 0 and self._extremes is not None

    def _end(self, step: int) -> int:
        """How many points are of steps before ``step`` (steps only ever increase)."""
        steps = self.steps
        end = len(steps)
        while end and steps[end - 1] >= step:  # usually the message's own point, if any
            end -= 1
        return end

    def before(self, step: int) -> list[tuple[int, float]]:
        """The points of steps before ``step``, oldest first."""
        end = self._end(step)
        return list(zip(itertools.islice(self.steps, end), itertools.islice(self.values, end)))

    def window(self, step: int, size: int, unit: str, need_full: bool) -> list[float] | None:
        """The finite values of :func:`_window`'s points (same window, same None)."""
        end = self._end(step)
        if unit == "samples":
            start = max(0, end - size)
            if end - start < size and (need_full or start == end):
                return None
        else:
            if need_full and (self.first_step is None or self.first_step > step - size):
                return None
            start = bisect.bisect_left(self.steps, step - size, 0, end)
            if start == end:
                return None
        values = list(itertools.islice(self.values, start, end))
        if self.nonfinite:
            values = [x for x in values if math.isfinite(x)]
        return values

    def rewound(self, step: int) -> Series | None:
        """A copy holding only the points before ``step`` (None when none is)."""
        return Series.rewind(step, self, None)

    @staticmethod
    def rewind(step: int, live: Series | None, older: Series | None) -> Series | None:
        """The points before ``step`` of ``live``, preceded by those of ``older`` (a snapshot
        taken earlier) that ``live`` no longer holds; None when there are none."""
        recent = live.before(step) if live is not None else []
        since = recent[0][0] if recent else step
        earlier = older.before(since) if older is not None else []
        kept = earlier + recent
        if not kept:
            return None
        ref = live if live is not None else older
        assert ref is not None
        s = Series(ref.maxlen or len(kept))
        for point in kept[-(ref.maxlen or len(kept)) :]:
            s.add(*point)
        firsts = [x.first_step for x in (live, older) if x is not None and x.first_step is not None]
        s.first_step = min(firsts) if firsts else kept[0][0]
        return s


def _window(
    series: Series | None, step: int, size: int, unit: str, need_full: bool
) -> list[tuple[int, float]] | None:
    """Points before ``step`` inside the window, or None while the window is not yet full."""
    if series is None:
        return None
    past = series.before(step)
    if unit == "samples":
        pts = past[-size:]
        return pts if len(pts) >= size or (not need_full and pts) else None
    if need_full and (series.first_step is None or series.first_step > step - size):
        return None
    # past is in step order: the window starts at the first point of step >= step - size
    # ((s,) sorts before every (s, value), so no value is ever compared)
    pts = past[bisect.bisect_left(past, (step - size,)) :]
    return pts or None


PeerKey = tuple[str, int, int]
"""What a peer comparison's values depend on: (signal, median_of steps, peers_within steps)."""


def peer_key(cond: PeerRelative) -> PeerKey:
    """The :class:`Peers` table a peer comparison reads (rules that agree share one)."""
    return (cond.signal, int(cond.median_of.value), int(cond.peers_within.value))


class Peers:
    """Each rank's recent median of one per-rank signal in the current generation, and the
    median of the other ranks' (what ``above_peer_median`` / ``below_peer_median`` compare).

    Per rank it keeps the points of its last ``span`` steps (its median needs ``need`` of them);
    the ranks whose latest value is within ``within`` steps of the furthest step the job has
    reached are *counted*: their medians are kept sorted, so the median of everyone's but one
    rank's is an index away. Memory: ranks × ``span`` points; no clock (staleness is counted in
    steps, so a replay decides as the live engine did)."""

    __slots__ = (
        "_at",
        "_low",
        "_own",
        "_recent",
        "_sorted",
        "_step",
        "need",
        "span",
        "top",
        "within",
    )

    def __init__(self, span: int, need: int, within: int) -> None:
        self.span, self.need, self.within = span, need, within
        self._recent: dict[int, collections.deque[tuple[int, float, float | None]]] = {}
        """Rank -> its finite (step, value, t) points, at most ``span`` (steps only increase;
        ``t``: the message's own clock, None when it has none)."""
        self._own: dict[int, float] = {}
        """Rank -> its median over its last ``span`` steps (when it has ``need`` values there)."""
        self._step: dict[int, int] = {}
        """Counted rank -> the step of its latest value."""
        self._at: dict[int, set[int]] = {}
        """Step -> the counted ranks whose latest value is of that step."""
        self._sorted: list[float] = []
        """The medians (``_own``) of the counted ranks, in order."""
        self._low: int | None = None
        """No counted rank's latest step is below this."""
        self.top: int | None = None
        """The furthest step the job has reached (:meth:`expire`)."""

    def clear(self) -> None:
        """Forget everything (a new generation: other processes, maybe on other nodes)."""
        self._recent.clear()
        self._own.clear()
        self._step.clear()
        self._at.clear()
        self._sorted.clear()
        self._low = self.top = None

    def add(self, rank: int, step: int, value: float, t: float | None = None) -> None:
        """Rank ``rank`` measured ``value`` at ``step``, its clock reading ``t`` (non-finite
        value: not measured; ``t`` None or non-finite: no pace from this point)."""
        pts = self._recent.get(rank)
        if pts is None:
            pts = self._recent[rank] = collections.deque(maxlen=self.span)
        if (pts and step <= pts[-1][0]) or not math.isfinite(value):
            return  # the report repeats its step's heartbeat, or arrived late
        pts.append((step, value, t if t is not None and math.isfinite(t) else None))
        values = [v for s, v, _ in pts if s > step - self.span]
        self._uncount(rank)
        if len(values) < self.need:
            self._own.pop(rank, None)
            return
        own = self._own[rank] = statistics.median(values)
        bisect.insort(self._sorted, own)
        self._step[rank] = step
        self._at.setdefault(step, set()).add(rank)
        if self._low is None or step < self._low:
            self._low = step

    def _uncount(self, rank: int) -> None:
        step = self._step.pop(rank, None)
        if step is None:
            return
        del self._sorted[bisect.bisect_left(self._sorted, self._own[rank])]
        ranks = self._at[step]
        ranks.discard(rank)
        if not ranks:
            del self._at[step]

    def settled(self, top: int) -> bool:
        """Whether the job reaching step ``top`` would leave every counted rank counted."""
        if self.top is not None:
            top = max(top, self.top)
        return self._low is None or self._low > top - self.within

    def expire(self, top: int) -> None:
        """The job has reached step ``top``: ranks whose latest value is ``within`` steps or more
        behind it are no longer counted (they stopped reporting, or measuring)."""
        self.top = top if self.top is None else max(self.top, top)
        cut = self.top - self.within  # latest values at steps <= cut are stale
        if self._low is None or self._low > cut:
            return
        if cut - self._low > len(self._at):
            stale = sorted(s for s in self._at if s <= cut)
        else:
            stale = [s for s in range(self._low, cut + 1) if s in self._at]
        for s in stale:
            for rank in list(self._at.get(s, ())):
                self._uncount(rank)
        self._low = min(self._at) if self._at else None

    def values_of(self, rank: int) -> list[float]:
        """The rank's kept values, oldest first."""
        return [v for _, v, _ in self._recent.get(rank, ())]

    def pace(self, rank: int) -> float | None:
        """The rank's seconds per step over its kept points, from the messages' own clock: the
        median of the intervals between them, so one pause among them (an evaluation, a
        checkpoint, a data stall) does not stretch it (None: fewer than two points with a clock,
        or a clock that did not move forward)."""
        timed = [(s, t) for s, _, t in self._recent.get(rank, ()) if t is not None]
        paces = [
            (t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(timed) if t1 > t0
        ]
        return statistics.median(paces) if paces else None

    def own(self, rank: int) -> float | None:
        """The rank's median over its last ``span`` steps (None: fewer than ``need`` values)."""
        return self._own.get(rank)

    def peer_median(self, rank: int) -> tuple[float, int] | None:
        """(median, how many) of the counted ranks' medians other than ``rank``'s; None when
        there is no such rank."""
        vals = self._sorted
        n = len(vals)
        skip = n
        if rank in self._step:  # leave one copy of its own median out
            n -= 1
            skip = bisect.bisect_left(vals, self._own[rank])
        if n < 1:
            return None

        def at(j: int) -> float:
            return vals[j] if j < skip else vals[j + 1]

        half = n // 2
        med = at(half) if n % 2 else (at(half - 1) + at(half)) / 2
        return med, n


class Context:
    """Where a condition is evaluated: one message, one layer (None: the summary), the series,
    the per-rank medians of the peer comparisons, and the ranks' hosts (their ``hello``)."""

    def __init__(
        self,
        msg: RankMessage,
        layer: str | None,
        series: dict,
        peers: dict[PeerKey, Peers] | None = None,
        hosts: dict[int, str] | None = None,
    ) -> None:
        self.msg, self.layer, self.series = msg, layer, series
        self.peers = peers or {}
        self.hosts = hosts or {}

    def value(self, signal: str) -> float | None:
        return self.msg.value(signal, self.layer)

    def layer_of(self, signal: str) -> str | None:
        return self.msg.source_layer(signal, self.layer)

    def history(self, signal: str) -> Series | None:
        layer = self.layer if signal in LAYER_SIGNALS else None
        return self.series.get((self.msg.rank, layer, signal))


def crossed(cond: Threshold, v: float) -> str | None:
    """``"below"`` or ``"above"`` when the finite value ``v`` crosses the threshold, else None:
    the one test of a threshold, for evaluation and its screen alike."""
    if cond.below is not None and v < cond.below:
        return "below"
    if cond.above is not None and v > cond.above:
        return "above"
    return None


def non_finite(v: Any) -> bool:
    """True for a NaN or an infinity (a float: :func:`number` keeps a float as it is)."""
    return type(v) is float and not math.isfinite(v)


def evaluate(cond: Any, ctx: Context) -> Hit | None:
    """The hit if ``cond`` holds on this message, else None."""
    kind = type(cond)
    if kind is AllOf:
        hits = []
        for c in cond.all:
            hit = evaluate(c, ctx)
            if hit is None:
                return None
            hits.append(hit)
        return Hit(
            hits[0].signal,
            hits[0].value,
            next((h.layer for h in hits if h.layer), None),
            " and ".join(h.text for h in hits),
        )
    if kind is AnyOf:
        for c in cond.any:
            if ctx.msg.type in c.cadence():
                hit = evaluate(c, ctx)
                if hit is not None:
                    return hit
        return None
    if kind is Crash:
        if ctx.msg.raw.get("first") is True:
            return None  # it never sent a message: a launch failure, retried by the supervisor
        code = ctx.msg.raw.get("code")
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            how = f" (killed by signal {-code})" if code < 0 else ""
            return Hit("exit_code", float(code), None, f"the process exited with code {code}{how}")
        return None
    if kind is Hang:
        age = number(ctx.msg.raw.get("age_s"))
        if age is not None and (cond.hang is True or age >= cond.hang.value):
            return Hit("heartbeat_age", age, None, f"no heartbeat for {age:.0f} s")
        return None
    signal = cond.signal
    v = ctx.value(signal)
    if v is None:
        return None
    if kind is NonFinite:
        if not non_finite(v):
            return None
        return Hit(signal, v, ctx.layer_of(signal), f"{signal} is {v}")
    if not math.isfinite(v):
        return None
    if kind is Threshold:
        side = crossed(cond, v)
        if side is None:
            return None
        bound = cond.below if side == "below" else cond.above
        return Hit(
            signal,
            v,
            ctx.layer_of(signal),
            f"{signal} {fmt(signal, v)} is {side} {fmt(signal, bound)}",
        )
    if kind is Change:
        return _change(cond, ctx, v)
    if kind is Trailing:
        return _trailing(cond, ctx, v)
    if kind is PeerRelative:
        return _peer(cond, ctx)
    raise TypeError(f"unknown condition {kind.__name__}")


Screen = Callable[[dict, dict, Any, dict[str, list[float]]], bool]
"""``(msg, series, rank, earlier) -> bool``: True only when the condition is certain not to
hold on heartbeat ``msg`` of ``rank``, given the engine's ``series`` and the values of the
rank's messages that come before ``msg`` and are not in them yet (``earlier``, per signal).
False means it may hold."""


def screen(cond: Any, peers: dict[PeerKey, Peers] | None = None) -> Screen:
    """The :data:`Screen` of ``cond`` (see :meth:`Engine.quiet`), made once per rule: thresholds
    and non-finite tests are answered from the value, trailing-median tests from bounds of the
    window's minimum or maximum; what it does not bound (changes, z-score-only windows, layer
    signals, crashes, hangs) may hold.

    A trailing window at evaluation time holds finite values of the series as it is now or of
    ``earlier``, so its median lies between their minimum and maximum (the argument of
    :func:`_beyond_median_impossible`); a series keeps bounds of them (:meth:`Series.extremes`),
    made exact when the kept ones do not settle it. A peer comparison is answered from the
    engine's ``peers`` tables (:func:`_peer_screen`)."""
    kind = type(cond)
    if kind is AllOf:
        every = [screen(c, peers) for c in cond.all]
        return lambda msg, series, rank, earlier: any(
            part(msg, series, rank, earlier) for part in every
        )
    if kind is AnyOf:  # a heartbeat evaluates the alternatives that read it
        some = [screen(c, peers) for c in cond.any if "heartbeat" in c.cadence()]
        return lambda msg, series, rank, earlier: all(
            part(msg, series, rank, earlier) for part in some
        )
    if kind is PeerRelative and peers is not None and peer_key(cond) in peers:
        return _peer_screen(cond, peers[peer_key(cond)])
    if kind not in (NonFinite, Threshold, Trailing) or cond.signal in LAYER_SIGNALS:
        return lambda msg, series, rank, earlier: False
    if kind is Trailing and cond.median_of is not None:
        return lambda msg, series, rank, earlier: False  # a median of recent values: not bounded
    signal = cond.signal
    if kind is NonFinite:

        def finite(msg: dict, series: dict, rank: Any, earlier: dict) -> bool:
            return not non_finite(msg.get(signal))  # number(v) is v for a float

        return finite
    if kind is Threshold:

        def within(msg: dict, series: dict, rank: Any, earlier: dict) -> bool:
            v = number(msg.get(signal))
            if v is None or not math.isfinite(v):
                return True  # the tests ignore non-finite values
            return crossed(cond, v) is None

        return within
    above, below = cond.above_median, cond.below_median

    def beyond(msg: dict, series: dict, rank: Any, earlier: dict) -> bool:
        v = number(msg.get(signal))
        if v is None or not math.isfinite(v):
            return True
        if above is None and below is None:
            return False  # a z-score alone: no bound from the extremes
        s = series.get((rank, None, signal))
        prior = [x for x in earlier.get(signal, ()) if math.isfinite(x)] if earlier else []
        for exact in (False, True):  # the kept bounds first; exact ones if they do not settle it
            bounds = s.extremes(exact) if s is not None else None
            if bounds is None and not prior:
                return True  # no window at all
            if _beyond_median_impossible(cond, v, prior + list(bounds) if bounds else prior):
                return True  # the test evaluation makes, on the window's extremes
            if s is None or s.exact:
                return False
        return False

    return beyond


def _peer_screen(cond: PeerRelative, table: Peers) -> Screen:
    """A peer comparison cannot hold on heartbeat ``msg`` when no median of the rank's values
    its window may hold (its kept points, ``earlier`` and the message's: some of the latest
    ``median_of`` of them) can pass the test against the peers' median as it stands: the
    rank's own messages do not change the other ranks' medians, only the job's furthest step
    could drop a peer (then it may hold)."""
    signal, span = cond.signal, int(cond.median_of.value)

    def calm(msg: dict, series: dict, rank: Any, earlier: dict) -> bool:
        v, step = number(msg.get(signal)), number(msg.get("step"))
        if v is None or not math.isfinite(v):
            return True  # the test reads the message's value: absent, it is not evaluated
        if step is None or not table.settled(int(step)):
            return False
        peers = table.peer_median(rank)
        if peers is None or peers[0] <= 0:
            return True  # no peer (they cannot appear in the rank's own messages), no ratio
        recent = table.values_of(rank) + [x for x in earlier.get(signal, ()) if math.isfinite(x)]
        window = [*recent[-(span - 1) :], v] if span > 1 else [v]
        # the window's median is the median of a suffix of these: between their min and max
        if cond.above_peer_median is not None:
            return not peer_holds(cond, max(window), peers[0])
        return not peer_holds(cond, min(window), peers[0])

    return calm


def _change(cond: Change, ctx: Context, v: float) -> Hit | None:
    w = cond.within
    size = int(w.value) - 1 if w.unit == "samples" else int(w.value)
    pts = _window(ctx.history(cond.signal), ctx.msg.step, size, w.unit, need_full=False)
    pts = [p for p in (pts or []) if math.isfinite(p[1])]
    if not pts:
        return None
    s = cond.signal
    if cond.drops_by is not None:
        ref = max(pts, key=lambda p: p[1])
        if ref[1] - v >= cond.drops_by:
            return Hit(
                s,
                v,
                ctx.layer_of(s),
                f"{s} fell from {fmt(s, ref[1])} to {fmt(s, v)} within {w} "
                f"(steps {ref[0]}→{ctx.msg.step})",
            )
        return None
    ref = min(pts, key=lambda p: p[1])
    if v - ref[1] >= cond.rises_by:  # type: ignore[operator]
        return Hit(
            s,
            v,
            ctx.layer_of(s),
            f"{s} rose from {fmt(s, ref[1])} to {fmt(s, v)} within {w} "
            f"(steps {ref[0]}→{ctx.msg.step})",
        )
    return None


def robust_z(v: float, values: Iterable[float]) -> tuple[float, float]:
    """(median, z) with z = (v - median) / (1.4826 · MAD); ±inf when the window is constant."""
    values = list(values)
    med = statistics.median(values)
    scale = 1.4826 * statistics.median([abs(x - med) for x in values])
    if scale > 0:
        return med, (v - med) / scale
    return med, 0.0 if v == med else math.copysign(math.inf, v - med)


def _beyond_median_impossible(cond: Trailing, v: float, values: list[float]) -> bool:
    """True when ``v`` cannot pass the condition's ``above_median``/``below_median`` part,
    decided from the window's minimum or maximum alone (no sort): the median lies between them.
    Every heartbeat of every rank meets the loss rule, and almost every one is far from it; this
    answers those in one pass, with the decision the full check would give."""
    factor = cond.above_median if cond.above_median is not None else cond.below_median
    if factor is None or factor <= 0:
        return False
    if cond.above_median is not None:  # v > factor·median needs v > factor·min (when min > 0)
        lo = min(values)
        return lo > 0 and v <= factor * lo
    return v >= factor * max(values)  # v < factor·median needs v < factor·max (or median <= 0)


def _recent_median(cond: Trailing, series: Series | None, step: int, v: float) -> tuple[float, int]:
    """``(median, first step)`` of the values over ``cond.median_of`` up to ``step`` (``v`` is
    the current one): what a ``median_of`` test compares (a median, so a blip of a step or two
    does not move it), and where its trailing window ends."""
    span = cond.median_of
    assert span is not None
    size = int(span.value) - 1  # the values before the current one
    pts = _window(series, step, size, span.unit, need_full=False) if size > 0 else None
    pts = [p for p in (pts or []) if math.isfinite(p[1])]
    values = [p[1] for p in pts] + [v]
    return statistics.median(values), (pts[0][0] if pts else step)


def _trailing(cond: Trailing, ctx: Context, v: float) -> Hit | None:
    w = cond.window
    series = ctx.history(cond.signal)
    end = ctx.msg.step
    if cond.median_of is not None:
        v, end = _recent_median(cond, series, ctx.msg.step, v)
    values = series.window(end, int(w.value), w.unit, need_full=True) if series else None
    if values is None or len(values) < 3:
        return None
    if _beyond_median_impossible(cond, v, values):
        return None
    wants_z = cond.z_above is not None or cond.z_below is not None
    med, z = robust_z(v, values) if wants_z else (statistics.median(values), math.nan)
    s, parts = cond.signal, []
    if cond.above_median is not None or cond.below_median is not None:
        factor = cond.above_median if cond.above_median is not None else cond.below_median
        if med <= 0:
            return None
        ok = (
            v > factor * med  # type: ignore[operator]
            if cond.above_median is not None
            else v < factor * med  # type: ignore[operator]
        )
        if not ok:
            return None
        parts.append(f"{v / med:.2f}× its trailing median {fmt(s, med)} over {w}")
    if cond.z_above is not None or cond.z_below is not None:
        ok = (
            z >= cond.z_above  # type: ignore[operator]
            if cond.z_above is not None
            else -z >= cond.z_below  # type: ignore[operator]
        )
        if not ok:
            return None
        parts.append(
            f"z-score {z:.3g} against the trailing median {fmt(s, med)} over {w}"
            if len(parts) == 0
            else f"z-score {z:.3g}"
        )
    what = (
        f"{s} {fmt(s, v)}"
        if cond.median_of is None
        else f"{s}'s median {fmt(s, v)} over the last {cond.median_of}"
    )
    return Hit(s, v, ctx.layer_of(s), f"{what} is " + ", ".join(parts))


def peer_holds(cond: PeerRelative, own: float, median: float) -> bool:
    """The one test of a peer comparison: ``own`` at least (at most) factor × the peers'
    ``median``; never against a median <= 0 (no ratio to speak of)."""
    if median <= 0:
        return False
    if cond.above_peer_median is not None:
        return own >= cond.above_peer_median * median
    return own <= cond.factor * median


def _peer(cond: PeerRelative, ctx: Context) -> Hit | None:
    table = ctx.peers.get(peer_key(cond))
    rank = ctx.msg.rank
    own = table.own(rank) if table is not None else None
    if own is None:
        return None
    peers = table.peer_median(rank)  # type: ignore[union-attr]
    if peers is None:
        return None
    med, n = peers
    if not peer_holds(cond, own, med):
        return None
    cost = ""
    if cond.min_step_share is not None:
        pace = table.pace(rank)  # type: ignore[union-attr]
        if pace is None or own - med < cond.min_step_share * pace:
            return None
        cost = f" ({(own - med) / pace:.0%} of its {pace:.3g} s steps)"
    s = cond.signal
    unit = spec_of(s).unit
    unit = f" {unit}" if unit else ""
    host = ctx.hosts.get(rank)
    others = "its one peer" if n == 1 else f"its {n} peers'"
    return Hit(
        s,
        own,
        None,
        f"{s}'s median {fmt(s, own)}{unit} over the last {cond.median_of} is "
        f"{own / med:.2f}× the median {fmt(s, med)}{unit} of {others}{cost}"
        + (f", on host {host}" if host else ""),
    )
