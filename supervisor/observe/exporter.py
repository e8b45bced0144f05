"""``/metrics`` for Prometheus: the :class:`~.metrics.MetricsFold` served by ``prometheus_client``.

:class:`MetricsExporter` is one of the supervisor's sinks (``metrics``, registered in
:mod:`..sinks.metrics`): every journaled event goes to :meth:`~MetricsExporter.handle`, every
tick to :meth:`~MetricsExporter.tick` (it reads the controller's machine state and collector
views). A scrape renders the fold under a lock, so the HTTP thread never sees half a tick. It
decides nothing and never raises into the controller.

``prometheus_client`` is an optional extra (``pip install 'spikeguard[metrics]'``, also in the
``test`` extra; Ray's ``ray[default]`` brings it too); :func:`missing` says why it cannot be
used, if it cannot.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .metrics import Family, MetricsFold, snapshot

MIN_VERSION = (0, 17)
"""The oldest ``prometheus_client`` whose ``start_http_server`` hands back its server (to stop
it); the ``metrics`` extra asks for it."""


def missing() -> str | None:
    """Why ``/metrics`` cannot be served here (None: it can)."""
    if importlib.util.find_spec("prometheus_client") is None:
        return "prometheus_client is not installed (pip install 'spikeguard[metrics]')"
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("prometheus_client")
    except PackageNotFoundError:
        return None
    numbers = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
    if numbers < MIN_VERSION:
        return (
            f"prometheus_client {found} is older than "
            f"{'.'.join(map(str, MIN_VERSION))} (pip install 'spikeguard[metrics]')"
        )
    return None


class MetricsExporter:
    """A :class:`MetricsFold` with a ``prometheus_client`` registry and an HTTP server."""

    def __init__(
        self,
        *,
        run: str,
        max_layers: int = 64,
        clock: Callable[[], float] = time.monotonic,
        final_scrape_s: float = 0.0,
    ) -> None:
        """``clock``: the supervisor's monotonic clock (the journal's ``mono``), against which
        heartbeat ages are measured at scrape time. ``final_scrape_s``: how long
        :meth:`close` waits for the final scrape of a run that ended."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        self.fold = MetricsFold(run=run, max_layers=max_layers)
        self.clock = clock
        self._lock = threading.Lock()
        self._scraped = threading.Condition(self._lock)
        self.scrapes = 0
        """How many times the families were rendered (each scrape once)."""
        self._final_tick = -1
        self.final_scrape_s = final_scrape_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Adapter(self))
        ProcessCollector(registry=self.registry)  # process_* of the supervisor itself
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- inputs ------------------------------------------------------------------------------
    def handle(self, event: dict[str, Any]) -> None:
        """Fold a journal event in (the notifier side)."""
        with self._lock:
            self.fold.handle(event)

    def restore(self, events: list[dict[str, Any]]) -> None:
        """Fold the journal a restarted supervisor found: the counters count the whole run."""
        with self._lock:
            for ev in events:
                self.fold.handle(ev)

    def tick(self, ctl: Any) -> None:
        """Read the controller's machine state and collector views (the tick side)."""
        snap = snapshot(ctl.state, ctl.collector, self.clock())
        with self._lock:
            self.fold.tick(snap)

    # -- output ------------------------------------------------------------------------------
    def families(self) -> list[Family]:
        """The fold's families now (what a scrape renders); counts the scrape."""
        with self._lock:
            out = self.fold.families(self.clock())
            self.scrapes += 1
            self._scraped.notify_all()
            return out

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (what ``/metrics`` serves)."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))

    def serve(self, address: str, port: int) -> str:
        """Serve ``/metrics`` at ``address:port`` (0: a free port) in a daemon thread; returns
        the URL. ``OSError`` when the address cannot be bound (a port in use)."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=address, registry=self.registry)
        host, bound = self._server.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        self.url = f"http://{shown}:{bound}/metrics"
        return self.url

    def final_scrape(self, timeout_s: float) -> bool:
        """After the run ended (call after the last :meth:`tick`): wait until a scrape has seen
        the final state, at most ``timeout_s``. Returns at once, False, when nothing ever scraped
        this exporter (no Prometheus is watching)."""
        with self._lock:
            if self.scrapes == 0:
                return False
            target = self.scrapes + 1
            return self._scraped.wait_for(lambda: self.scrapes >= target, timeout_s)

    def close(self, timeout_s: float = 5.0, *, ended: bool = False) -> None:
        """Stop serving (idempotent; a sink's ``close``). When the run ``ended``, first keep
        serving until Prometheus scraped its final state once (:meth:`final_scrape`, at most
        ``final_scrape_s``): the alert rules tell a finished run from a dead supervisor by it.
        Not after Ctrl-C (a person is at the terminal) nor a preemption (the platform's grace
        period is short, and a preempted run is not finished: its supervisor is meant to come
        back)."""
        if ended and self._server is not None:
            self.final_scrape(self.final_scrape_s)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


class _Adapter:
    """The registry's view of the exporter: its families as ``prometheus_client`` families."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        for f in self.exporter.families():
            if f.kind == "histogram":
                h = HistogramMetricFamily(f.name, f.help, labels=list(f.labels))
                for labels, hist in f.histograms:
                    buckets = [(_le(b), float(n)) for b, n in hist.buckets]
                    h.add_metric(list(labels), buckets, hist.sum)
                yield h
                continue
            cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            fam = cls(f.name, f.help, labels=list(f.labels))
            for labels, value in f.samples:
                fam.add_metric(list(labels), value)
            yield fam


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
