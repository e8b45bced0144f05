"""Sinks: what follows a run's journal, for the people and systems watching it.

:mod:`.registry` is the seam (the :class:`~.registry.Sink` lifecycle, ``SINKS`` keyed by the names
policies route to, :func:`~.registry.register`); the entries built in are ``console`` (the story
on stdout, :mod:`.console`), ``slack`` (one thread per incident, :mod:`.slack`), the pagers
``alertmanager``, ``pagerduty`` and ``webhook`` (:mod:`.pagers`, each on when its environment is
set) and ``metrics`` (``/metrics`` for Prometheus, :mod:`.metrics`). ``describe`` words each
event (plain or Slack mrkdwn), ``charts`` draws an incident's PNG. Nothing here decides anything:
each reads events and shows them. Importing this package registers the built-in entries; a new
sink is one module beside them and its import below.
"""

from .registry import SINKS, BaseSink, Sink, SinkContext, SinkSet, build_sinks, destinations

# isort: off
# The built-in entries, in the order their sinks are built and ticked (and closed in reverse:
# the metrics' final scrape first, as the run's last state, then the pagers', then Slack's queue).
from . import console  # noqa: F401 (registers "console")
from .slack import sink as _slack  # noqa: F401 (registers "slack")
from . import pagers  # noqa: F401 (registers "alertmanager", "pagerduty", "webhook")
from . import metrics  # noqa: F401 (registers "metrics")

# isort: on

__all__ = [
    "SINKS",
    "BaseSink",
    "Sink",
    "SinkContext",
    "SinkSet",
    "build_sinks",
    "destinations",
]
