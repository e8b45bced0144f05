"""Slack configuration and the ``spikeguard slack test`` command.

* :class:`SlackSettings`: typed settings; secrets come only from the environment
  (``SLACK_BOT_TOKEN``, ``SPIKEGUARD_SLACK_WEBHOOK_URL``), never from a job or policy file.
* :func:`web_client`: the slack-sdk ``WebClient`` the notifier and the command share, with the
  opt-in ``RateLimitErrorRetryHandler`` (429 ``Retry-After``) installed.
* :func:`register`: adds ``spikeguard slack test [--channel C]`` to the CLI; exit 0 when a test
  message was posted, 2 with the exact reason otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TextIO

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry import ConnectionErrorRetryHandler, RateLimitErrorRetryHandler
from slack_sdk.webhook import WebhookClient

DEFAULT_API_URL = "https://slack.com/api/"


@dataclass(frozen=True)
class SlackSettings:
    """How spikeguard talks to Slack. Build it with :meth:`from_env`."""

    channel: str | None = None
    """Channel for bot mode, by name (``#ml-oncall``) or ID (``C0123456789``)."""
    mention: str | None = None
    """Who a page wakes: ``<@U123>`` or ``<!subteam^S123>``; bare ``U…``/``S…`` IDs are wrapped."""
    runbook_url: str | None = None
    """Runbook linked from every incident message (and from an escalation)."""
    dashboard_url: str | None = None
    """Dashboard linked from every incident message."""
    mode: str = "bot"
    """``bot`` (threads, updates, charts) or ``webhook`` (standalone messages only)."""
    repeat_interval_s: float = 600.0
    """The same alert (rule, severity, signal, rank, layer) is sent at most once per interval."""
    min_interval_s: float = 1.0
    """Pacing: at least this long between two messages to one channel (Slack allows ~1/s)."""
    max_retries: int = 5
    """Per message: 429s waited out (``Retry-After``) and 5xx/network errors retried (backoff)
    up to this many times each, then the message is journaled ``notify_undelivered``."""
    backoff_s: float = 1.0
    """First backoff after a 5xx or network error; doubles on each retry (with jitter)."""
    backoff_max_s: float = 60.0
    """Upper bound of one backoff wait."""
    progress_interval_s: float = 300.0
    """At most one ``probation_progress`` reply per incident per interval."""
    timeout_s: float = 10.0
    """HTTP timeout of one Slack call."""
    chart: bool = True
    """Upload a chart (grade, attention entropy, loss) into each incident thread (bot mode)."""
    api_url: str = DEFAULT_API_URL
    """Web API base URL (``SPIKEGUARD_SLACK_API_URL``), for Slack-compatible gateways and tests."""
    token: str | None = field(default=None, repr=False)
    """Bot token, only ever from ``SLACK_BOT_TOKEN``; never printed."""
    webhook_url: str | None = field(default=None, repr=False)
    """Incoming webhook, only ever from ``SPIKEGUARD_SLACK_WEBHOOK_URL``; never printed."""

    def __post_init__(self) -> None:
        if self.mode not in ("bot", "webhook"):
            raise ValueError(f"slack mode must be 'bot' or 'webhook', not {self.mode!r}")
        for f in (
            "repeat_interval_s",
            "min_interval_s",
            "backoff_s",
            "backoff_max_s",
            "progress_interval_s",
            "timeout_s",
            "max_retries",
        ):
            if getattr(self, f) < 0:
                raise ValueError(f"slack {f} must be >= 0, got {getattr(self, f)!r}")
        object.__setattr__(self, "mention", normalize_mention(self.mention))
        if not self.api_url.endswith("/"):
            object.__setattr__(self, "api_url", self.api_url + "/")

    @classmethod
    def from_env(
        cls,
        channel: str | None = None,
        mention: str | None = None,
        runbook_url: str | None = None,
        dashboard_url: str | None = None,
        *,
        mode: str | None = None,
        environ: Mapping[str, str] | None = None,
        **options: Any,
    ) -> SlackSettings:
        """Settings from arguments (job/policy file) plus the environment.

        The token comes only from ``SLACK_BOT_TOKEN``, the webhook URL only from
        ``SPIKEGUARD_SLACK_WEBHOOK_URL``, the API base from ``SPIKEGUARD_SLACK_API_URL``; the
        channel and mention fall back to ``SPIKEGUARD_SLACK_CHANNEL`` / ``SPIKEGUARD_SLACK_MENTION``.
        ``mode`` defaults to ``bot`` when a token is set, else ``webhook`` when a URL is set.
        ``options`` are the other fields (``repeat_interval_s=...``); secrets are refused there.
        """
        env = os.environ if environ is None else environ
        bad = {"token", "webhook_url", "api_url"} & set(options)
        if bad:
            raise ValueError(
                f"slack {', '.join(sorted(bad))} can only come from the environment "
                "(SLACK_BOT_TOKEN, SPIKEGUARD_SLACK_WEBHOOK_URL, SPIKEGUARD_SLACK_API_URL)"
            )
        token = env.get("SLACK_BOT_TOKEN") or None
        hook = env.get("SPIKEGUARD_SLACK_WEBHOOK_URL") or None
        return cls(
            channel=channel or env.get("SPIKEGUARD_SLACK_CHANNEL") or None,
            mention=mention or env.get("SPIKEGUARD_SLACK_MENTION") or None,
            runbook_url=runbook_url,
            dashboard_url=dashboard_url,
            mode=mode or ("webhook" if hook and not token else "bot"),
            api_url=env.get("SPIKEGUARD_SLACK_API_URL") or DEFAULT_API_URL,
            token=token,
            webhook_url=hook,
            **options,
        )

    def problems(self) -> list[str]:
        """What keeps these settings from working (empty when usable)."""
        if self.mode == "webhook":
            return [] if self.webhook_url else ["webhook mode needs SPIKEGUARD_SLACK_WEBHOOK_URL"]
        out = [] if self.token else ["SLACK_BOT_TOKEN is not set"]
        if not self.channel:
            out.append("no channel: set slack.channel in the job file or SPIKEGUARD_SLACK_CHANNEL")
        return out

    def with_options(self, **changes: Any) -> SlackSettings:
        """A copy with some non-secret fields changed."""
        known = {f.name for f in fields(self)} - {"token", "webhook_url"}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown or secret slack settings: {sorted(unknown)}")
        return replace(self, **changes)


def normalize_mention(mention: str | None) -> str | None:
    """``U123`` -> ``<@U123>``, ``S123`` -> ``<!subteam^S123>``; plain ``@name`` is refused.

    Slack only notifies for the escaped forms; ``@oncall`` typed as text pages nobody.
    """
    if not mention:
        return None
    m = mention.strip()
    if re.fullmatch(r"[UW][A-Z0-9]{2,}", m):
        return f"<@{m}>"
    if re.fullmatch(r"S[A-Z0-9]{2,}", m):
        return f"<!subteam^{m}>"
    if re.fullmatch(r"<(@[UW][A-Z0-9]+|!subteam\^S[A-Z0-9]+(\|[^>]*)?|!here|!channel)>", m):
        return m
    raise ValueError(
        f"slack mention {mention!r} would notify nobody: use a user ID (U…), a user "
        "group ID (S…), <@U…>, <!subteam^S…> or <!here>"
    )


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
        retry_handlers=[RateLimitHandler(abort, s.max_retries)],
    )


_HINTS = {
    "invalid_auth": "the token in SLACK_BOT_TOKEN is not valid for this workspace",
    "not_authed": "no token reached Slack",
    "token_revoked": "the token in SLACK_BOT_TOKEN was revoked",
    "token_expired": "the token in SLACK_BOT_TOKEN has expired",
    "account_inactive": "the bot user behind SLACK_BOT_TOKEN is deactivated",
    "not_in_channel": "the bot is not a member of {channel}: run `/invite @{bot}` in that channel",
    "channel_not_found": "channel {channel} does not exist, or it is private and the bot is "
    "not in it: check the name/ID and invite the bot",
    "is_archived": "channel {channel} is archived",
    "ratelimited": "Slack is rate limiting this app; try again in a minute",
}


def _explain(e: SlackApiError, channel: str, bot: str) -> str:
    data = e.response.data if isinstance(e.response.data, dict) else {}
    err = str(data.get("error") or f"HTTP {e.response.status_code}")
    if err == "missing_scope":
        return (
            f"missing_scope: the token lacks the `{data.get('needed', '?')}` scope (it has: "
            f"{data.get('provided', '?')}); add it under OAuth & Permissions and reinstall"
        )
    return f"{err}: " + _HINTS.get(err, "Slack refused the call").format(channel=channel, bot=bot)


def run_test(settings: SlackSettings, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``slack test``: auth.test, scope check, then a test message. 0 ok, 2 with the reason."""
    out, err = out or sys.stdout, err or sys.stderr

    def fail(msg: str) -> int:
        print(f"slack test FAILED: {msg}", file=err)
        return 2

    if settings.problems():
        return fail("; ".join(settings.problems()))
    text = ":white_check_mark: spikeguard test message: incident alerts will arrive here."
    if settings.mode == "webhook":
        try:
            r = webhook_client(settings).send(text=text)
        except OSError as e:
            return fail(f"network error: cannot reach the webhook URL: {e}")
        if r.status_code != 200:
            return fail(
                f"webhook answered HTTP {r.status_code}: {r.body} (no_service/"
                "invalid_token: the URL was revoked; channel_is_archived: pick another)"
            )
        print(
            "slack test ok: webhook message posted (webhook mode: no threads, no charts)", file=out
        )
        return 0
    client, channel, bot = web_client(settings), str(settings.channel), "the bot"
    try:
        auth = client.auth_test()
        bot = str(auth.get("user") or bot)
        print(f"auth ok: @{bot} in {auth.get('team')} ({auth.get('url')})", file=out)
        scopes = {s.strip() for s in (_header(auth.headers, "x-oauth-scopes") or "").split(",")}
        missing = [s for s in ("chat:write", "files:write") if scopes != {""} and s not in scopes]
        if missing:
            return fail(
                f"missing_scope: the token lacks {', '.join(missing)} (it has: "
                f"{', '.join(sorted(scopes))}); add under OAuth & Permissions, reinstall"
            )
        r = client.chat_postMessage(channel=channel, text=text)
    except SlackApiError as e:
        return fail(_explain(e, channel, bot))
    except OSError as e:
        return fail(f"network error: cannot reach {settings.api_url}: {e}")
    print(
        f"slack test ok: posted to {channel} (channel {r.get('channel')}, ts {r.get('ts')})",
        file=out,
    )
    return 0


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    for k, v in headers.items():
        if k.lower() == name:
            return v[0] if isinstance(v, list) else str(v)
    return None


def cmd_test(args: argparse.Namespace) -> int:
    """Entry point of ``spikeguard slack test``."""
    try:
        settings = SlackSettings.from_env(channel=args.channel, mention=args.mention)
    except ValueError as e:
        print(f"slack test FAILED: {e}", file=sys.stderr)
        return 2
    return run_test(settings)


def register(subparsers: Any) -> None:
    """Add ``slack test`` to the CLI; the handler is ``args.func(args) -> exit code``."""
    slack = subparsers.add_parser("slack", help="Slack notifications")
    sub = slack.add_subparsers(dest="slack_command", metavar="COMMAND")
    sub.required = True
    test = sub.add_parser(
        "test",
        help="check token, scopes and channel; post a test message",
        description="Calls auth.test, checks the chat:write and files:write "
        "scopes, and posts a test message. Exit 0 on success, 2 with the "
        "exact reason (invalid_auth, missing_scope, not_in_channel, "
        "channel_not_found, network error) otherwise.",
    )
    test.add_argument("--channel", help="channel name or ID (default: SPIKEGUARD_SLACK_CHANNEL)")
    test.add_argument("--mention", help="on-call user/group ID, checked for validity")
    test.set_defaults(func=cmd_test)
