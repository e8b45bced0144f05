"""Slack on-call notifications: one thread per incident, never in the way of recovery.

``settings`` (how to reach Slack, secrets only from the environment), ``client`` (the slack-sdk
clients and their 429 handling), ``render`` (pure Block Kit rendering of journal events),
``notifier`` (the queue that sends, paces, retries and restores threads from the journal),
``buttons`` (the root message's buttons answered over Socket Mode: a pure decision of who may
press what, then an operator request) and ``command`` (``spikeguard slack test``).
"""

from .notifier import SlackNotifier
from .settings import SlackSettings

__all__ = ["SlackNotifier", "SlackSettings"]
