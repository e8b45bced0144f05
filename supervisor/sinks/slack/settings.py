"""How spikeguard talks to Slack: :class:`SlackSettings`, typed and validated.

Secrets come only from the environment (``SLACK_BOT_TOKEN``, ``SPIKEGUARD_SLACK_WEBHOOK_URL``,
``SLACK_APP_TOKEN``), never from a job or policy file, and so does who may press the buttons
(``SPIKEGUARD_SLACK_OPERATORS``); a policy says where messages go (``policies.schema.SlackTarget``:
channel, mention, links) and :meth:`SlackSettings.from_env` merges the two.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

DEFAULT_API_URL = "https://slack.com/api/"
USER_ID = re.compile(r"[UW][A-Z0-9]{2,30}")
"""What a Slack user ID looks like (``U0123ABCD``; ``W…`` on Enterprise Grid)."""


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
    severities: tuple[str, ...] = ("info", "warn", "page")
    """The severities Slack receives (the policy's ``notify.routes``): an alert or an incident
    thread of another severity is not posted; run outcomes (completed, failed, stopped,
    preempted) always are."""
    rules: Mapping[str, bool] = field(default_factory=dict)
    """Rules that name their own destinations (a rule's ``notify:``), and whether Slack is one
    of them: their alerts and incidents go where they say, whatever their severity."""
    chart: bool = True
    """Upload a chart (grade, attention entropy, loss) into each incident thread (bot mode)."""
    api_url: str = DEFAULT_API_URL
    """Web API base URL (``SPIKEGUARD_SLACK_API_URL``), for Slack-compatible gateways and tests."""
    token: str | None = field(default=None, repr=False)
    """Bot token, only ever from ``SLACK_BOT_TOKEN``; never printed."""
    webhook_url: str | None = field(default=None, repr=False)
    """Incoming webhook, only ever from ``SPIKEGUARD_SLACK_WEBHOOK_URL``; never printed."""
    app_token: str | None = field(default=None, repr=False)
    """App-level token (``xapp-…``, scope ``connections:write``), only ever from
    ``SLACK_APP_TOKEN``; never printed. With it (in bot mode) the incident's root message has
    buttons, answered over Socket Mode (:mod:`.buttons`)."""
    operators: tuple[str, ...] = ()
    """The Slack user IDs whose button presses are carried out (``SPIKEGUARD_SLACK_OPERATORS``,
    comma-separated); empty: every press is refused."""

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
        object.__setattr__(self, "operators", tuple(u for u in self.operators if u))
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
        channel and mention fall back to ``SPIKEGUARD_SLACK_CHANNEL`` /
        ``SPIKEGUARD_SLACK_MENTION``. The buttons' app token comes only from ``SLACK_APP_TOKEN``,
        who may press them only from ``SPIKEGUARD_SLACK_OPERATORS``.
        ``mode`` defaults to ``bot`` when a token is set, else ``webhook`` when a URL is set.
        ``options`` are the other fields (``repeat_interval_s=...``); secrets are refused there.
        """
        env = os.environ if environ is None else environ
        bad = set(ENV_ONLY) & set(options)
        if bad:
            raise ValueError(
                f"slack {', '.join(sorted(bad))} can only come from the environment "
                f"({', '.join(ENV_ONLY[b] for b in sorted(bad))})"
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
            app_token=env.get("SLACK_APP_TOKEN") or None,
            operators=tuple(
                u.strip() for u in (env.get("SPIKEGUARD_SLACK_OPERATORS") or "").split(",")
            ),
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

    @property
    def buttons(self) -> bool:
        """Whether root messages carry the operator buttons: bot mode with an app token."""
        return bool(self.app_token) and self.buttons_problem() is None

    def buttons_problem(self) -> str | None:
        """Why an app token that is set gives no buttons (None: it does, or none is set)."""
        if not self.app_token:
            return None
        if not self.app_token.startswith("xapp-"):
            return "SLACK_APP_TOKEN is not an app-level token (xapp-…): no buttons"
        if self.mode != "bot":
            return "buttons need bot mode (SLACK_BOT_TOKEN), not a webhook: no buttons"
        return None

    def operators_problem(self) -> str | None:
        """What is wrong with ``operators`` for pressing buttons (None: nothing)."""
        if not self.operators:
            return (
                "SPIKEGUARD_SLACK_OPERATORS is empty: every Slack button press is refused "
                "(list the Slack user IDs allowed, comma-separated)"
            )
        odd = [u for u in self.operators if not USER_ID.fullmatch(u)]
        if odd:
            return (
                f"SPIKEGUARD_SLACK_OPERATORS has entries that are no Slack user ID ({odd!r:.200}):"
                " they match no press (use IDs like U0123ABCD, not names)"
            )
        return None

    def with_options(self, **changes: Any) -> SlackSettings:
        """A copy with some non-secret fields changed."""
        known = {f.name for f in fields(self)} - {"token", "webhook_url", "app_token"}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown or secret slack settings: {sorted(unknown)}")
        return replace(self, **changes)


ENV_ONLY = {
    "token": "SLACK_BOT_TOKEN",
    "webhook_url": "SPIKEGUARD_SLACK_WEBHOOK_URL",
    "api_url": "SPIKEGUARD_SLACK_API_URL",
    "app_token": "SLACK_APP_TOKEN",
    "operators": "SPIKEGUARD_SLACK_OPERATORS",
}
"""The settings only the environment gives, and the variable that gives each."""


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
