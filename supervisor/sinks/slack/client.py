"""The slack-sdk clients the notifier and ``spikeguard slack test`` share.

Both honour 429 ``Retry-After`` through :class:`RateLimitHandler` (slack-sdk's opt-in handler,
made interruptible so a shutdown does not wait out a long ``Retry-After``), and log through
:data:`SDK_LOG`, which blanks secrets out: slack-sdk logs the URL it refuses, webhook included.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping
from typing import Any

from slack_sdk import WebClient
from slack_sdk.http_retry import ConnectionErrorRetryHandler, RateLimitErrorRetryHandler
from slack_sdk.webhook import WebhookClient
from spikeguard.workers.contract.secret_scan import redact

from .settings import SlackSettings


class RedactingFilter(logging.Filter):
    """Blanks the ``known`` secrets, and anything shaped like a credential, out of log records."""

    def __init__(self) -> None:
        super().__init__()
        self.known: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message (and traceback) with the secrets redacted."""
        record.msg, record.args = redact(record.getMessage(), self.known), ()
        if record.exc_info:
            trace = logging.Formatter().formatException(record.exc_info)
            record.exc_info, record.exc_text = None, redact(trace, self.known)
        return True


_REDACT = RedactingFilter()
SDK_LOG = logging.getLogger("spikeguard.slack.sdk")
"""The logger the slack-sdk clients are given; its records never carry a secret."""
SDK_LOG.addFilter(_REDACT)


def _sdk_log(s: SlackSettings) -> logging.Logger:
    _REDACT.known.update(v for v in (s.token, s.webhook_url) if v)
    return SDK_LOG


class RateLimitHandler(RateLimitErrorRetryHandler):
    """slack-sdk's 429 handler, waiting ``Retry-After`` on an event so a shutdown can cut it."""

    def __init__(self, abort: threading.Event | None = None, max_retry_count: int = 5) -> None:
        super().__init__(max_retry_count=max_retry_count)
        self._abort = abort or threading.Event()

    def prepare_for_next_attempt(self, *, state, request, response=None, error=None) -> None:
        """Wait ``Retry-After`` (+ jitter), then ask for another attempt unless aborted."""
        if response is None:
            raise error  # type: ignore[misc]
        if self._abort.wait(retry_after(response.headers) + random.random() * 0.2):
            return  # shutting down: the 429 surfaces and the caller gives the message up
        state.next_attempt_requested = True
        state.increment_current_attempt()


def retry_after(headers: Mapping[str, Any]) -> float:
    """Seconds from a ``Retry-After`` header (value or list of values); 1.0 when absent."""
    for k, v in headers.items():
        if k.lower() == "retry-after":
            v = v[0] if isinstance(v, (list, tuple)) else v
            try:
                return max(0.0, float(v))
            except (TypeError, ValueError):
                break
    return 1.0


def web_client(s: SlackSettings, abort: threading.Event | None = None) -> WebClient:
    """A ``WebClient`` for ``s`` with connection-error and 429 retry handlers."""
    return WebClient(
        token=s.token,
        base_url=s.api_url,
        timeout=max(1, int(s.timeout_s)),
        logger=_sdk_log(s),
        retry_handlers=[
            ConnectionErrorRetryHandler(max_retry_count=1),
            RateLimitHandler(abort, s.max_retries),
        ],
    )


def webhook_client(s: SlackSettings, abort: threading.Event | None = None) -> WebhookClient:
    """A ``WebhookClient`` for ``s`` with the 429 retry handler."""
    return WebhookClient(
        s.webhook_url or "",
        timeout=max(1, int(s.timeout_s)),
        logger=_sdk_log(s),
        retry_handlers=[RateLimitHandler(abort, s.max_retries)],
    )
