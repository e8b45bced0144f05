"""The ``metrics`` sink: the job's Prometheus exporter (:mod:`..observe.exporter`), serving.

Not a route destination: the metrics count every event whatever the policy's routes say, and
what the other sinks journal from their own threads (Slack's undelivered messages) as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from spikeguard.workers.contract.logs import logger

from .. import rundir
from ..observe.exporter import MetricsExporter, missing
from .registry import SinkContext, register

if TYPE_CHECKING:
    from ..job import JobSpec

log = logger(__name__)


def start_metrics(
    job: JobSpec, run_dir: Path, clock: Callable[[], float] = time.monotonic
) -> MetricsExporter | None:
    """The job's Prometheus exporter, serving (its URL in ``RUN_DIR/metrics.url``); None (said
    in one line) when the job turns it off, ``prometheus_client`` is not installed or the
    address cannot be bound: metrics never stop a run. (A restarted run's journal is folded in
    by the sink's ``restore``, so the counters count the whole run.)"""
    m = job.metrics
    if not m.enabled:
        return None
    why = missing()
    if why is not None:
        log.warning("no /metrics: %s", why)
        return None
    exporter = MetricsExporter(
        run=job.name, max_layers=m.max_layers, clock=clock, final_scrape_s=m.final_scrape_s
    )
    try:
        url = exporter.serve(m.address, m.port)
    except OSError as e:
        log.warning("no /metrics: cannot listen on %s:%s: %s", m.address, m.port, e)
        return None
    rundir.write_atomic(run_dir / "metrics.url", url + "\n")
    log.info("Prometheus metrics at %s", url)
    return exporter


@register("metrics", routable=False, hears_sinks=True)
def metrics_sink(ctx: SinkContext) -> MetricsExporter | None:
    """``/metrics``, heartbeat ages on the supervisor's clock."""
    return start_metrics(ctx.job, ctx.run_dir, ctx.clock)
