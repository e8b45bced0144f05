"""`spikeguard slack test` says exactly what is wrong: real slack-sdk against fakeslack."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakeslack import TOKEN, FakeSlack
from spikeguard.supervisor.sinks.slack import command as slack_command
from spikeguard.supervisor.sinks.slack.settings import SlackSettings


def run_cli(
    monkeypatch,
    capsys,
    fake_url: str | None,
    *argv: str,
    token: str | None = TOKEN,
    webhook: str | None = None,
) -> tuple[int, str, str]:
    """Run ``spikeguard slack test ARGV`` through argparse as the CLI does."""
    for var in (
        "SLACK_BOT_TOKEN",
        "SPIKEGUARD_SLACK_WEBHOOK_URL",
        "SPIKEGUARD_SLACK_CHANNEL",
        "SPIKEGUARD_SLACK_API_URL",
        "SPIKEGUARD_SLACK_MENTION",
    ):
        monkeypatch.delenv(var, raising=False)
    if token:
        monkeypatch.setenv("SLACK_BOT_TOKEN", token)
    if webhook:
        monkeypatch.setenv("SPIKEGUARD_SLACK_WEBHOOK_URL", webhook)
    if fake_url:
        monkeypatch.setenv("SPIKEGUARD_SLACK_API_URL", fake_url)
    parser = argparse.ArgumentParser(prog="spikeguard")
    slack_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["slack", "test", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def fake():
    with FakeSlack() as f:
        yield f
        assert f.violations == []


def test_success_posts_a_test_message(fake, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, fake.api_url, "--channel", "#ml-alerts")
    assert code == 0, err
    assert "auth ok: @spikeguard in Fake Team" in out and "slack test ok" in out
    (msg,) = fake.messages
    assert msg["channel"] == "C0ALERTS" and "test message" in msg["text"]


def test_channel_from_the_environment(fake, monkeypatch, capsys):
    monkeypatch.setenv("SPIKEGUARD_SLACK_CHANNEL", "C0ALERTS")
    parser = argparse.ArgumentParser()
    slack_command.register(parser.add_subparsers())
    monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
    monkeypatch.setenv("SPIKEGUARD_SLACK_API_URL", fake.api_url)
    args = parser.parse_args(["slack", "test"])
    assert args.func(args) == 0


def test_invalid_token(fake, monkeypatch, capsys):
    code, _, err = run_cli(
        monkeypatch, capsys, fake.api_url, "--channel", "#ml-alerts", token="xoxb-not-a-valid-token"
    )
    assert code == 2
    assert "invalid_auth" in err and "SLACK_BOT_TOKEN is not valid" in err
    assert "xoxb-not-a-valid-token" not in err


def test_bot_not_in_channel(fake, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, fake.api_url, "--channel", "#elsewhere")
    assert code == 2
    assert "not_in_channel" in err and "/invite @spikeguard" in err


def test_channel_not_found(fake, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, fake.api_url, "--channel", "#no-such-channel")
    assert code == 2 and "channel_not_found" in err and "#no-such-channel" in err


def test_missing_scope_seen_in_the_token_scopes():
    with FakeSlack(scopes=("files:write",)) as fake:
        s = SlackSettings.from_env(
            channel="#ml-alerts",
            environ={"SLACK_BOT_TOKEN": TOKEN, "SPIKEGUARD_SLACK_API_URL": fake.api_url},
        )
        out, err = _Buf(), _Buf()
        assert slack_command.run_test(s, out, err) == 2
        assert "missing_scope" in err.text and "chat:write" in err.text
        assert not fake.messages


def test_missing_scope_reported_by_slack_with_needed(fake, monkeypatch, capsys):
    fake.force_error(
        "chat.postMessage",
        "missing_scope",
        needed="chat:write.public",
        provided="chat:write,files:write",
    )
    code, _, err = run_cli(monkeypatch, capsys, fake.api_url, "--channel", "#ml-alerts")
    assert code == 2
    assert "missing_scope" in err and "`chat:write.public`" in err
    assert "chat:write,files:write" in err


def test_network_error(monkeypatch, capsys):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run_cli(
        monkeypatch, capsys, f"http://127.0.0.1:{port}/api/", "--channel", "#ml-alerts"
    )
    assert code == 2 and "network error" in err and f"127.0.0.1:{port}" in err


def test_nothing_configured(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, None, token=None)
    assert code == 2
    assert "SLACK_BOT_TOKEN is not set" in err and "SPIKEGUARD_SLACK_CHANNEL" in err


def test_bad_mention(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, None, "--channel", "#x", "--mention", "@oncall")
    assert code == 2 and "would notify nobody" in err


@pytest.mark.parametrize(
    "scheme, quoted",
    [("", "unknown url type: '[redacted]'"), ("ftp://", "Invalid URL detected: [redacted]")],
)
def test_an_unusable_webhook_url_is_explained_without_echoing_it(
    monkeypatch, capsys, caplog, scheme, quoted
):
    hook = f"{scheme}hooks.example.com/services/T000/B000/s3cr3tP4th"  # urllib, slack-sdk quote it
    code, out, err = run_cli(monkeypatch, capsys, None, token=None, webhook=hook)
    assert code == 2 and "SPIKEGUARD_SLACK_WEBHOOK_URL is not a usable URL" in err
    assert quoted in err and "s3cr3tP4th" not in out + err + caplog.text


def test_webhook_mode(fake, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, None, token=None, webhook=fake.webhook_url)
    assert code == 0, err
    assert "webhook mode: no threads" in out and len(fake.webhook_posts) == 1
    fake.outage(None)
    code, _, err = run_cli(monkeypatch, capsys, None, token=None, webhook=fake.webhook_url)
    assert code == 2 and "HTTP 500" in err


class _Buf:
    """A minimal text sink (run_test writes with print(file=...))."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass
