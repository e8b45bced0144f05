"""``spikeguard slack test``: check the token, its scopes and the channel; post a test message.

:func:`register` adds the command to the CLI; exit 0 when a test message was posted, 2 with the
exact reason (``invalid_auth``, ``missing_scope``, ``not_in_channel``, ``channel_not_found``, a
network error) otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from slack_sdk.errors import SlackApiError, SlackRequestError
from spikeguard.workers.contract.secret_scan import redact

from .client import web_client, webhook_client
from .settings import SlackSettings

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
    secrets = [settings.token or "", settings.webhook_url or ""]

    def fail(msg: str) -> int:
        print(f"slack test FAILED: {redact(msg, known=secrets)}", file=err)
        return 2

    if settings.problems():
        return fail("; ".join(settings.problems()))
    text = ":white_check_mark: spikeguard test message: incident alerts will arrive here."
    if settings.mode == "webhook":
        try:
            r = webhook_client(settings).send(text=text)
        except OSError as e:
            return fail(f"network error: cannot reach the webhook URL: {e}")
        except (SlackRequestError, ValueError) as e:  # both quote the URL: fail() redacts it
            return fail(f"SPIKEGUARD_SLACK_WEBHOOK_URL is not a usable URL: {e}")
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
    except SlackRequestError as e:
        return fail(f"SPIKEGUARD_SLACK_API_URL is not a usable URL: {e}")
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
        print(f"slack test FAILED: {redact(str(e))}", file=sys.stderr)
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
