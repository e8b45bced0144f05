"""The sinks seam: everything that follows a run's journal, registered under one name each.

A sink lives as long as its supervisor: :meth:`Sink.restore` folds the journal a dead supervisor
left (a restart continues the same run), :meth:`Sink.handle` gets every event as it is journaled,
:meth:`Sink.tick` every controller tick, :meth:`Sink.close` the end. A factory registered with
:func:`register` builds it from a :class:`SinkContext`, or says why not and returns None. The
names of the routable entries are what a policy's ``notify.routes`` and a rule's ``notify`` may
name (:func:`destinations`, passed to ``load_policy``; :func:`wants` says where an alert goes,
:func:`repeat_interval_s` how often it repeats there); the others (``/metrics``) follow every
event whatever the routes say. The built-in entries (console, Slack, the pagers, metrics)
register when :mod:`spikeguard.supervisor.sinks` is imported: a new sink is one module there
plus its import.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spikeguard.policies.values import SEVERITIES
from spikeguard.workers.contract.logs import logger

if TYPE_CHECKING:
    from spikeguard.policies.schema import NotifySettings, Policy

    from ..job import JobSpec

log = logger(__name__)

Record = Callable[[dict[str, Any]], dict[str, Any]]
"""The journal's ``record``: appends an event (a dict with a ``kind``), returns it as journaled."""


class Sink(Protocol):
    """What follows a run's journal: a notifier, an exporter, a pager, a tracker."""

    def restore(self, events: list[dict[str, Any]]) -> None:
        """Continue after a supervisor restart: fold ``events``, the journal the dead supervisor
        left (called once, before the first :meth:`handle`, only when there is one)."""

    def tick(self, ctl: Any) -> None:
        """Each controller tick (and once more at the end): read its state and views."""

    def handle(self, event: dict[str, Any]) -> None:
        """Each event as it is journaled; never raises into the controller (it is caught)."""

    def close(self, timeout_s: float, *, ended: bool = False) -> None:
        """The supervisor is done: finish within about ``timeout_s``. ``ended``: the run is over
        and the last tick showed its final state (not a Ctrl-C nor a preemption, after which
        the supervisor goes but the run may come back)."""


class BaseSink:
    """A :class:`Sink` that does nothing: subclass it and override what the sink needs."""

    def restore(self, events: list[dict[str, Any]]) -> None:
        """Nothing to continue by default."""

    def tick(self, ctl: Any) -> None:
        """No tick work by default."""

    def handle(self, event: dict[str, Any]) -> None:
        """Ignore every event by default."""

    def close(self, timeout_s: float = 10.0, *, ended: bool = False) -> None:
        """Nothing to finish by default."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkContext:
    """What a factory may build its sink from."""

    job: JobSpec
    """The job (its ``notify`` and ``metrics`` sections are the sinks' settings)."""
    policy: Policy
    """The run's policy (``notify``: routes, Slack target, repeat interval)."""
    run_id: str
    """The run's name, as the journal and the ranks know it."""
    run_dir: Path
    """The run directory (a sink may write a file there, e.g. ``metrics.url``)."""
    record: Record
    """Journals an event (one of the journal's kinds, e.g. ``notify_undelivered``), also from
    the sink's own threads; the sinks that hear sinks are handed it too, this one is not."""
    severities: tuple[str, ...]
    """The alert severities the policy routes to this sink's name (none for an entry that is not
    routable)."""
    rules: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    """The rules that name their own destinations, and whether this sink is one of them
    (:func:`rule_routes`): with ``severities``, what :func:`routes_to` decides from."""
    clock: Callable[[], float] = time.monotonic
    """The supervisor's monotonic clock (the journal's ``mono``)."""


SinkFactory = Callable[[SinkContext], Sink | None]
"""Builds a sink, or returns None when the job does not configure it (saying why in one log line
when it was meant to be on but cannot be)."""


@dataclasses.dataclass(frozen=True)
class SinkEntry:
    """A registered sink."""

    factory: SinkFactory
    """Builds it for a run."""
    routable: bool = True
    """A name ``notify.routes`` may use; False: the sink follows every event (``/metrics``)."""
    hears_sinks: bool = False
    """Also handed what the other sinks journal from their own threads (Slack's undelivered
    messages), so its :meth:`Sink.handle` must be thread-safe: the metrics count those too."""


SINKS: dict[str, SinkEntry] = {}
"""Every registered sink by name, in registration order (the order they are built and ticked;
they close in the reverse order)."""


def register(
    name: str, *, routable: bool = True, hears_sinks: bool = False
) -> Callable[[SinkFactory], SinkFactory]:
    """Register the decorated factory under ``name`` (see :class:`SinkEntry` for the flags)."""

    def add(factory: SinkFactory) -> SinkFactory:
        if name in SINKS:
            raise ValueError(f"a sink named {name!r} is registered already")
        SINKS[name] = SinkEntry(factory, routable=routable, hears_sinks=hears_sinks)
        return factory

    return add


def destinations() -> tuple[str, ...]:
    """The names a policy's ``notify.routes`` may use: the routable entries."""
    return tuple(name for name, entry in SINKS.items() if entry.routable)


def routed(notify: NotifySettings, name: str) -> tuple[str, ...]:
    """The severities ``notify.routes`` send to ``name``."""
    return tuple(s for s in SEVERITIES if name in notify.destinations(s))


def severity_of(event: Mapping[str, Any]) -> str:
    """The severity of an alert or an incident's opening event (``warn`` when it has none, or
    one no policy names: a hand-written journal)."""
    severity = event.get("severity")
    return severity if isinstance(severity, str) and severity in SEVERITIES else "warn"


def rule_routes(policy: Policy, name: str) -> dict[str, bool]:
    """For each rule that names its own destinations (its ``notify:`` list), whether ``name``
    is among them: those rules' alerts and incidents go where they say, not where the routes
    of their severity would send them."""
    return {r.name: name in r.notify for r in policy.rules if r.notify is not None}


def routes_to(
    severities: Iterable[str], rules: Mapping[str, bool], event: Mapping[str, Any]
) -> bool:
    """The one routing rule: the alert or incident that ``event`` opens goes to a destination
    when the rule that wrote it lists that destination (``rules``, :func:`rule_routes`), or,
    for a rule that lists none (or no rule's event: the supervisor's own alert), when its
    severity is one the routes send there (``severities``, :func:`routed`)."""
    rule = event.get("rule")
    if isinstance(rule, str) and rule in rules:
        return rules[rule]
    return severity_of(event) in severities


def wants(policy: Policy, name: str, event: Mapping[str, Any]) -> bool:
    """Whether the alert or incident that ``event`` opens goes to the destination ``name``
    (:func:`routes_to` under ``policy``). A later event of an incident follows its opening
    one; how a run ended goes wherever a sink says."""
    return routes_to(routed(policy.notify, name), rule_routes(policy, name), event)


def repeat_interval_s(notify: NotifySettings, name: str) -> float:
    """Seconds between two notifications of one still-firing alert or open incident to
    ``name`` (its ``repeat_intervals`` entry, else ``repeat_interval``); ``inf``: never again."""
    every = notify.repeat_interval_of(name)
    return math.inf if every is None else float(every.value)


MIN_CLOSE_S = 1.0
"""The least time a sink gets to finish at close, however long the ones before it took."""


class SinkSet:
    """The sinks of one run, by name, and their lifecycle: a failing sink is logged and skipped,
    never in the way of the run or of the other sinks."""

    def __init__(self) -> None:
        self.named: dict[str, Sink] = {}
        self._hearing: list[str] = []

    @property
    def sinks(self) -> list[Sink]:
        """The sinks in build order (what the controller hands each journaled event)."""
        return list(self.named.values())

    def add(self, name: str, sink: Sink, *, hears_sinks: bool = False) -> None:
        """Add ``sink`` under ``name`` (last in build order)."""
        self.named[name] = sink
        if hears_sinks:
            self._hearing.append(name)

    def recorder(self, name: str, record: Record) -> Record:
        """``record`` for the sink ``name``: what it journals is handed to the sinks that hear
        sinks (not back to itself)."""

        def journal(event: dict[str, Any]) -> dict[str, Any]:
            rec = record(event)
            for other in self._hearing:
                if other != name:
                    _guarded(other, "handle", self.named[other].handle, rec)
            return rec

        return journal

    def restore(self, events: list[dict[str, Any]]) -> None:
        for name, sink in self.named.items():
            _guarded(name, "restore", sink.restore, events)

    def tick(self, ctl: Any) -> None:
        for name, sink in self.named.items():
            _guarded(name, "tick", sink.tick, ctl)

    def close(self, timeout_s: float, *, ended: bool = False) -> None:
        """Close every sink, the last built first, all within about ``timeout_s``: the sinks
        deliver on their own threads meanwhile, so one that is down does not add its wait to
        the others' (each still gets :data:`MIN_CLOSE_S`)."""
        deadline = time.monotonic() + timeout_s
        for name, sink in reversed(self.named.items()):
            left = max(MIN_CLOSE_S, deadline - time.monotonic())
            _guarded(name, "close", lambda s=sink, t=left: s.close(t, ended=ended))


def build_sinks(
    job: JobSpec,
    policy: Policy,
    *,
    run_id: str,
    run_dir: Path,
    record: Record,
    clock: Callable[[], float] = time.monotonic,
    names: Iterable[str] | None = None,
) -> SinkSet:
    """The sinks the registry's factories build for this run (``names``: only those entries)."""
    built = SinkSet()
    wanted = SINKS if names is None else {n: SINKS[n] for n in names}
    for name, entry in wanted.items():
        ctx = SinkContext(
            job=job,
            policy=policy,
            run_id=run_id,
            run_dir=run_dir,
            record=built.recorder(name, record),
            severities=routed(policy.notify, name) if entry.routable else (),
            rules=rule_routes(policy, name) if entry.routable else {},
            clock=clock,
        )
        try:
            sink = entry.factory(ctx)
        except Exception as e:  # a sink never stops a run
            log.warning(
                "sink %s cannot start (%s: %s); the run goes on without it",
                name,
                type(e).__name__,
                e,
            )
            continue
        if sink is not None:
            built.add(name, sink, hears_sinks=entry.hears_sinks)
    return built


def _guarded(name: str, what: str, call: Callable[..., None], *args: Any) -> None:
    try:
        call(*args)
    except Exception as e:  # a sink never stops a recovery
        log.warning("sink %s: %s failed: %s", name, what, e)
