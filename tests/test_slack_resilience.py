"""Slack slow, rate limiting or down never delays a recovery step; nothing is lost silently."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakeslack import TOKEN, FakeSlack, incident_events
from spikeguard.supervisor.sinks.slack import SlackNotifier, SlackSettings

HANDLE_BUDGET_S = 0.05  # what one notification may cost a recovery step


def make(fake: FakeSlack, journal: list[dict], **opts: Any) -> SlackNotifier:
    env = {"SLACK_BOT_TOKEN": TOKEN, "SPIKEGUARD_SLACK_API_URL": fake.api_url}
    opts = {"min_interval_s": 0.0, "backoff_s": 0.05, "max_retries": 3, **opts}
    s = SlackSettings.from_env(channel="#ml-alerts", mention="S0ONCALL", environ=env, **opts)
    return SlackNotifier(s, run="gpt-1b", journal=journal.append)


def run_recovery(n: SlackNotifier) -> list[float]:
    """Feed the incident's events as the controller would; return each handle() duration."""
    took = []
    for ev in incident_events():
        t = time.perf_counter()
        n.handle(ev)
        took.append(time.perf_counter() - t)
    return took


def assert_whole_thread(fake: FakeSlack) -> None:
    (root,) = fake.roots()
    replies = fake.replies(root["ts"])
    assert len(replies) == 7 and replies[-1]["reply_broadcast"]
    assert len(fake.files) == 1 and next(iter(fake.files.values()))["thread_ts"] == root["ts"]
    assert root["blocks"][0]["text"]["text"].startswith("[RESOLVED]")


@pytest.fixture
def fake():
    with FakeSlack() as f:
        yield f
        assert f.violations == []


def test_rate_limit_storm_delays_messages_but_not_the_recovery(fake):
    fake.rate_limit(3, retry_after=1)
    journal: list[dict] = []
    n = make(fake, journal)
    t0 = time.perf_counter()
    took = run_recovery(n)
    recovery_s = time.perf_counter() - t0
    assert max(took) < HANDLE_BUDGET_S, took
    assert recovery_s < 0.2
    assert n.flush(30)
    n.close(5)
    limited = [c for c in fake.calls if c.status == 429]
    assert len(limited) == 3
    # Retry-After was honoured: the next call came at least 1 s after the first 429
    after = [c for c in fake.calls if c.at > limited[0].at]
    assert after and after[0].at - limited[0].at >= 0.95
    assert_whole_thread(fake)
    assert [e["kind"] for e in journal] == ["notify_thread"]


def test_outage_delays_messages_but_not_the_recovery(fake):
    fake.outage(1.5)
    journal: list[dict] = []
    n = make(fake, journal, backoff_s=0.2, max_retries=6)  # 0.2+0.4+0.8+1.6 s > the outage
    took = run_recovery(n)
    assert max(took) < HANDLE_BUDGET_S, took
    assert n.flush(30)
    n.close(5)
    assert any(c.status == 500 for c in fake.calls)
    assert_whole_thread(fake)
    assert [e["kind"] for e in journal] == ["notify_thread"]  # all delivered after the outage


def test_messages_given_up_after_retries_are_journaled(fake):
    fake.outage(None)
    journal: list[dict] = []
    n = make(fake, journal, max_retries=2, backoff_s=0.01)
    took = run_recovery(n)
    assert max(took) < HANDLE_BUDGET_S, took
    assert n.flush(30)
    n.close(5)
    lost = [e for e in journal if e["kind"] == "notify_undelivered"]
    whats = [e["what"] for e in lost]
    assert whats[:2] == ["inc-001 root", "inc-001 chart"]
    for kind in (
        "kill",
        "rollback",
        "lr_cut",
        "optimizer_reset",
        "launch",
        "probation_start",
        "probation_passed",
    ):
        assert f"inc-001 {kind}" in whats
    assert all(
        e["incident"] == "inc-001"
        and "gave up after 3 attempts" in e["error"]
        and "HTTP 500" in e["error"]
        for e in lost
    )
    # with no thread, every later message first retries the root (3 attempts each)
    attempts = [c for c in fake.calls if c.method == "chat.postMessage"]
    assert len(attempts) == 3 * len(whats)


def test_refused_message_is_not_retried_and_is_journaled(fake):
    fake.force_error("chat.postMessage", "channel_not_found")
    journal: list[dict] = []
    n = make(fake, journal)
    n.handle(incident_events()[0])
    assert n.flush(30)
    n.close(5)
    (lost, *_) = [e for e in journal if e["kind"] == "notify_undelivered"]
    assert lost["what"] == "inc-001 root" and "channel_not_found" in lost["error"]
    assert len([c for c in fake.calls if c.method == "chat.postMessage"]) == 2  # root, chart


def test_slow_slack_never_blocks_and_close_is_bounded():
    with FakeSlack(delay_s=0.6) as slow:
        journal: list[dict] = []
        n = make(slow, journal)
        took = run_recovery(n)
        assert max(took) < HANDLE_BUDGET_S, took
        t0 = time.perf_counter()
        n.close(timeout_s=0.5)
        assert time.perf_counter() - t0 < 2.5
        lost = [e for e in journal if e["kind"] == "notify_undelivered"]
        assert lost and all("shut down" in e["error"] for e in lost)
        n.handle(incident_events()[1])  # after close: ignored, no error
        assert slow.violations == []


def test_messages_are_paced_per_channel(fake):
    n = make(fake, [], min_interval_s=0.2)
    # when each call leaves the notifier (the server's arrival times would measure the
    # machine's scheduling too: on a loaded machine two paced requests can arrive closer)
    started: list[float] = []
    paced = n._call

    def call(fn):
        return paced(lambda: (started.append(time.monotonic()), fn())[1])

    n._call = call
    run_recovery(n)
    assert n.flush(30)
    n.close(5)
    writes = [
        c
        for c in fake.calls
        if c.method in ("chat.postMessage", "chat.update", "files.getUploadURLExternal")
    ]
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert len(writes) >= 8 and len(started) >= len(writes), (len(writes), len(started))
    assert min(gaps) >= 0.19, gaps  # 0.2 s apart, less the scheduling between two lines


def test_a_broken_journal_or_event_never_raises_into_the_caller(fake):
    def broken(ev: dict) -> None:
        raise OSError("disk full")

    env = {"SLACK_BOT_TOKEN": TOKEN, "SPIKEGUARD_SLACK_API_URL": fake.api_url}
    s = SlackSettings.from_env(channel="#ml-alerts", environ=env, min_interval_s=0.0)
    n = SlackNotifier(s, run="gpt-1b", journal=broken)
    n.handle({"kind": "incident"})  # no incident id, no fields: ignored
    n.handle({"kind": "kill", "incident": "inc-009", "ranks": "not-a-list"})
    n.handle({"kind": "notify_thread", "incident": "x"})  # our own bookkeeping: ignored
    run_recovery(n)
    assert n.flush(30)
    n.close(5)
    assert len(fake.roots()) == 2  # inc-009 (created from its first step) and inc-001


@pytest.mark.parametrize(
    "scheme, quoted",
    [("", "unknown url type: '[redacted]'"), ("ftp://", "Invalid URL detected: [redacted]")],
)
def test_an_unusable_webhook_url_is_never_journaled_or_logged(caplog, scheme, quoted):
    hook = f"{scheme}hooks.example.com/services/T000/B000/s3cr3tP4th"  # urllib, slack-sdk quote it
    env = {"SPIKEGUARD_SLACK_WEBHOOK_URL": hook}
    s = SlackSettings.from_env(environ=env, min_interval_s=0.0, max_retries=1, backoff_s=0.01)
    journal: list[dict] = []
    n = SlackNotifier(s, run="gpt-1b", journal=journal.append)
    n.handle(incident_events()[0])
    assert n.flush(30)
    n.close(5)
    (lost,) = [e for e in journal if e["kind"] == "notify_undelivered"]
    assert quoted in lost["error"]
    assert "s3cr3tP4th" not in json.dumps(journal) and "s3cr3tP4th" not in caplog.text
