"""The pagers (Alertmanager, PagerDuty, the webhook) against local servers the tests start:
what each gets for an incident's life, what a pager that is down or stuck costs (nothing to the
run, a journaled ``notify_undelivered``), and the one routing rule they share with Slack."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from fakepagers import PagerDutyServer, Receiver, events_v2_errors
from spikeguard.policies import load_policy_text
from spikeguard.supervisor.sinks.pagers.alertmanager import AlertmanagerSink, parse_time
from spikeguard.supervisor.sinks.pagers.delivery import (
    Message,
    Outbox,
    Retry,
    backoff_s,
    retry_after_s,
    verdict,
)
from spikeguard.supervisor.sinks.pagers.follow import Follow
from spikeguard.supervisor.sinks.pagers.pagerduty import (
    PagerDutySettings,
    PagerDutySink,
    dedup_key,
)
from spikeguard.supervisor.sinks.pagers.webhook import (
    DELIVERY,
    SIGNATURE,
    TIMESTAMP,
    WebhookSink,
    verify_signature,
)
from spikeguard.supervisor.sinks.registry import routes_to, rule_routes, wants

KEY = "R0UT1NGKEY0123456789abcdefABCDEF"  # 32 characters, as PagerDuty's are
FAST = Retry(tries=4, backoff_s=0.05, backoff_max_s=0.2, give_up_after_s=30.0, timeout_s=5.0)

POLICY = """\
version: 1
name: pagers
rules:
  - name: loss-spike
    when: {signal: loss, above_median: 2.0, window: 10 steps}
    action: recover
    severity: page
  - name: entropy-low
    when: {signal: attn_entropy_min, below: 0.1}
    action: notify
    severity: warn
  - name: quiet-drop
    when: {signal: grade, below: S2}
    action: recover
    severity: page
    notify: [slack]
notify:
  routes:
    info: [console]
    warn: [console, alertmanager, webhook]
    page: [console, slack, alertmanager, pagerduty, webhook]
  repeat_interval: 4h
  repeat_intervals: {pagerduty: 30m}
"""


@pytest.fixture
def policy():
    return load_policy_text(POLICY, "pagers.yaml")


def story(inc: str = "inc-001", *, rule: str = "loss-spike", end: str = "probation_passed"):
    """An incident's events as the journal has them (the fields the pagers read)."""
    base = {"incident": inc, "time": "2026-12-03T03:00:00+00:00"}
    opened = {
        **base,
        "kind": "incident",
        "code": "rule_fired",
        "rule": rule,
        "severity": "page",
        "signal": "loss",
        "value": 12.0,
        "rank": 1,
        "layer": "blocks.3.attn",
        "step": 480,
        "reason": "loss 12 > 2x its median",
    }
    steps = [
        {**base, "kind": "kill", "code": "ranks_killed"},
        {**base, "kind": "rollback", "code": "checkpoint_chosen", "step": 450},
        {**base, "kind": "probation_start", "code": "probation_started", "until_step": 530},
        {**base, "kind": end, "code": end},
    ]
    return [opened, *steps]


def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**e, "seq": i + 1, "mono": float(i)} for i, e in enumerate(events)]


class Journal(list):
    def __call__(self, event: dict[str, Any]) -> dict[str, Any]:
        self.append(event)
        return event


# ---- the one routing rule ------------------------------------------------------------------
def test_a_rule_that_names_its_destinations_overrides_the_routes_of_its_severity(policy):
    spike, quiet = story()[0], story(rule="quiet-drop")[0]
    assert wants(policy, "pagerduty", spike) and wants(policy, "slack", spike)
    # the same severity, but its rule says slack only
    assert not wants(policy, "pagerduty", quiet) and wants(policy, "slack", quiet)
    assert rule_routes(policy, "pagerduty") == {"quiet-drop": False}
    # a supervisor's own alert (no rule) follows its severity; no severity reads as warn
    assert routes_to(("warn",), {}, {"kind": "alert", "rule": None})
    assert not routes_to(("page",), {"x": True}, {"kind": "alert", "rule": "y", "severity": "warn"})
    assert policy.notify.repeat_interval_of("pagerduty").value == 1800
    assert policy.notify.repeat_interval_of("slack").value == 4 * 3600


def test_a_policy_routing_to_an_unknown_pager_says_where():
    from spikeguard.policies import PolicyError

    bad = POLICY.replace("notify: [slack]", "notify: [slak]")
    with pytest.raises(PolicyError, match=r"pagers.yaml:\d+:\d+: rules\[2\]\.notify\[0\]"):
        load_policy_text(bad, "pagers.yaml")


# ---- what a pager follows (pure) -------------------------------------------------------------
def test_follow_opens_steps_and_clears_an_incident(policy):
    f = Follow(lambda ev: wants(policy, "pagerduty", ev))
    whats = [c.what for ev in story() for c in f.apply(ev)]
    assert whats == ["opened", "step", "step", "step", "over"]
    (followed,) = f.followed.values()
    assert followed.over and followed.routed and not followed.needs_human


def test_an_escalation_needs_a_human_until_a_resume_passes(policy):
    f = Follow(lambda ev: True)
    for ev in story(end="escalated"):
        f.apply(ev)
    (inc,) = f.followed.values()
    assert inc.needs_human and not inc.over and inc in f.open_ones()
    ack = {"kind": "operator", "code": "acknowledged", "incident": None, "who": "alice"}
    assert [c.what for c in f.apply(ack)] == ["acknowledged"]  # no incident named: the open one
    assert inc.acknowledged is not None
    resumed = {"kind": "operator", "code": "operator_resumed", "incident": "inc-001"}
    f.apply(resumed)
    assert not inc.needs_human and inc.outcome is None
    assert [c.what for c in f.apply({**story()[-1]})] == ["over"]


def test_a_run_that_fails_with_no_incident_open_is_followed_as_the_run(policy):
    f = Follow(lambda ev: True)
    (change,) = f.apply({"kind": "failed", "code": "crashed", "incident": None})
    assert change.what == "needs_human" and change.followed.id == "run"


# ---- delivery: retried, bounded, never in the way --------------------------------------------
def test_verdicts_and_backoff():
    assert [verdict(s) for s in (202, 429, 503, 408, None, 400, 302)] == [
        "ok",
        "retry",
        "retry",
        "retry",
        "retry",
        "fail",
        "fail",
    ]
    r = Retry(backoff_s=1.0, backoff_max_s=10.0)
    assert [backoff_s(n, r, None) for n in (1, 2, 3, 5)] == [1.0, 2.0, 4.0, 10.0]
    assert backoff_s(1, r, 3.0) == 3.0 and backoff_s(1, r, 99.0) == 10.0
    assert retry_after_s("7", 0.0) == 7.0 and retry_after_s("soon", 0.0) is None
    assert retry_after_s("Thu, 01 Jan 1970 00:00:30 GMT", 10.0) == 20.0


def test_429_and_5xx_are_retried_until_delivered():
    rx = Receiver()
    try:
        rx.fail(429, 1, retry_after="0")
        rx.fail(503, 2)
        journal = Journal()
        box = Outbox("pagerduty", journal, retry=FAST)
        box.send(Message(what="inc-001 trigger", url=rx.url + "/x", document={"a": 1}))
        assert box.flush(30)
        assert [r.status for r in rx.requests] == [429, 503, 503, 200]
        assert box.delivered == 1 and journal == []
        box.close()
    finally:
        rx.close()


def test_what_cannot_be_delivered_is_journaled_without_the_secret():
    rx = Receiver()
    try:
        rx.fail(400, 1)
        rx.fail(503, 10)
        journal = Journal()
        box = Outbox("pagerduty", journal, retry=FAST, secrets=(KEY,))
        box.send(Message(what="inc-001 trigger", url=rx.url, document={}, incident="inc-001"))
        box.send(Message(what="inc-001 resolve", url=rx.url + f"/{KEY}", document={}))
        assert box.flush(30)
        box.close()
    finally:
        rx.close()
    refused, gave_up = journal
    assert refused["kind"] == "notify_undelivered" and refused["sink"] == "pagerduty"
    assert refused["incident"] == "inc-001" and refused["error"].startswith("refused: HTTP 400")
    assert "gave up after 4 attempts" in gave_up["error"]  # one 400, then four 503s
    assert KEY not in json.dumps(journal)


def test_a_stuck_pager_never_blocks_the_sender_and_what_it_held_is_journaled_at_close():
    rx = Receiver()
    rx.hang()
    journal = Journal()
    box = Outbox("alertmanager", journal, retry=FAST)
    try:
        box.send(Message(what="a", url=rx.url, document={}))
        assert rx.wait_hung(1)
        sent = threading.Event()

        def more() -> None:
            for i in range(50):
                box.send(Message(what=f"b{i}", url=rx.url, document={}))
            sent.set()

        threading.Thread(target=more, daemon=True).start()
        # while the pager holds the first request, the sends return (they only queue); the
        # wait is a deadline for a broken build, not a measurement
        assert sent.wait(60)
        box.close(timeout_s=0.5)
    finally:
        rx.close()
    assert {e["what"] for e in journal} == {"a", *(f"b{i}" for i in range(50))}
    assert all("shut down" in e["error"] for e in journal)


def test_a_full_queue_drops_a_keepalive_first_and_says_so():
    rx = Receiver()
    rx.hang()
    journal = Journal()
    box = Outbox("alertmanager", journal, retry=FAST, max_queue=3)
    try:
        box.send(Message(what="busy", url=rx.url, document={}))
        assert rx.wait_hung(1)
        box.send(Message(what="keep", url=rx.url, document={}, droppable=True, key="k"))
        box.send(Message(what="keep2", url=rx.url, document={}, droppable=True, key="k"))
        box.send(Message(what="firing-1", url=rx.url, document={}))
        box.send(Message(what="firing-2", url=rx.url, document={}))
        box.send(Message(what="firing-3", url=rx.url, document={}))
        rx.release()
        assert box.flush(30)
        box.close()
    finally:
        rx.close()
    # the second keep-alive replaced the first in the queue; the full queue dropped it
    assert [e["what"] for e in journal] == ["keep2"]
    assert "dropped" in journal[0]["error"]
    assert [json.loads(r.body) for r in rx.requests] == [{}] * 4


# ---- PagerDuty -------------------------------------------------------------------------------
def pd_sink(server: PagerDutyServer, policy, journal, **kw: Any) -> PagerDutySink:
    settings = PagerDutySettings.from_env(
        {"SPIKEGUARD_PAGERDUTY_ROUTING_KEY": KEY, "SPIKEGUARD_PAGERDUTY_URL": server.url}
    )
    assert settings is not None
    return PagerDutySink(settings, run="demo", policy=policy, journal=journal, retry=FAST, **kw)


def test_pagerduty_gets_trigger_acknowledge_and_resolve_valid_by_the_schema(policy):
    pd = PagerDutyServer()
    try:
        journal = Journal()
        sink = pd_sink(pd, policy, journal)
        events = numbered(story())
        sink.handle(events[0])
        sink.handle(
            {
                "kind": "operator",
                "code": "acknowledged",
                "incident": "inc-001",
                "who": "alice@laptop",
                "via": "cli",
                "seq": 9,
            }
        )
        for ev in events[1:]:
            sink.handle(ev)
        sink.close(ended=True)
    finally:
        pd.close()
    assert pd.invalid == [] and journal == []
    sent = pd.events()
    assert [e["event_action"] for e in sent] == ["trigger", "acknowledge", "resolve"]
    key = dedup_key("demo", "inc-001")
    assert {e["dedup_key"] for e in sent} == {key} and pd.alerts == {key: "resolved"}
    trigger = sent[0]["payload"]
    assert trigger["severity"] == "critical" and trigger["component"] == "blocks.3.attn"
    assert "inc-001" in trigger["summary"] and "loss" in trigger["summary"]
    assert trigger["custom_details"]["rank"] == 1


def test_pagerduty_keeps_an_escalation_open_for_the_human_and_pages_it_whatever_its_severity(
    policy,
):
    pd = PagerDutyServer()
    try:
        sink = pd_sink(pd, policy, Journal())
        warn = [{**e, "severity": "warn"} for e in numbered(story(end="escalated"))]
        for ev in warn:
            sink.handle(ev)
        sink.close(ended=True)
    finally:
        pd.close()
    sent = pd.events()
    # a warn incident is not paged while spikeguard recovers it; its escalation is, critical
    assert [e["event_action"] for e in sent] == ["trigger"]
    assert sent[0]["payload"]["severity"] == "critical"
    assert "ESCALATED" in sent[0]["payload"]["summary"]
    assert pd.alerts == {dedup_key("demo", "inc-001"): "triggered"}  # left for the human


def test_pagerduty_repeats_an_unacknowledged_trigger_on_its_own_interval(policy):
    now = [0.0]
    pd = PagerDutyServer()
    try:
        sink = pd_sink(pd, policy, Journal(), clock=lambda: now[0])
        sink.handle(numbered(story())[0])
        for t in (600.0, 1799.0):  # before its 30 min (repeat_intervals.pagerduty), nothing
            now[0] = t
            sink.tick(None)
        now[0] = 1800.0
        sink.tick(None)
        sink.handle({"kind": "operator", "code": "acknowledged", "incident": "inc-001"})
        now[0] = 9000.0
        sink.tick(None)  # acknowledged: no more repeats
        sink.outbox.flush(30)
        sink.close()
    finally:
        pd.close()
    assert [e["event_action"] for e in pd.events()] == ["trigger", "trigger", "acknowledge"]


def test_a_rule_that_leaves_pagerduty_out_is_never_paged(policy):
    pd = PagerDutyServer()
    try:
        sink = pd_sink(pd, policy, Journal())
        for ev in numbered(story(rule="quiet-drop", end="escalated")):
            sink.handle(ev)
        sink.close(ended=True)
    finally:
        pd.close()
    assert pd.events() == []


def test_the_schema_check_can_refuse():
    assert events_v2_errors({"routing_key": "short", "event_action": "resolve"}) == [
        "Length of 'routing_key' is incorrect (should be 32 characters)",
        "'dedup_key' is missing or blank",
    ]
    assert "'payload.severity' must be one of critical, error, warning, info" in (
        events_v2_errors(
            {
                "routing_key": KEY,
                "event_action": "trigger",
                "payload": {"summary": "s", "source": "x", "severity": "page"},
            }
        )
    )


# ---- the webhook -----------------------------------------------------------------------------
def test_the_webhook_signs_one_document_per_story_event(policy):
    rx = Receiver()
    try:
        sink = WebhookSink(
            rx.url, secret="s3cret", run="demo", policy=policy, journal=Journal(), retry=FAST
        )
        for ev in numbered(story()):
            sink.handle(ev)
        sink.handle({"kind": "report", "seq": 99})  # not a story event: not sent
        sink.handle({"kind": "completed", "code": "completed", "incident": None, "seq": 100})
        sink.close()
    finally:
        rx.close()
    kinds = [r.json["event"]["kind"] for r in rx.requests]
    assert kinds == [
        "incident",
        "kill",
        "rollback",
        "probation_start",
        "probation_passed",
        "completed",
    ]
    for r in rx.requests:
        stamp, signed = r.headers[TIMESTAMP], r.headers[SIGNATURE]
        assert signed.startswith("sha256=")
        assert verify_signature("s3cret", stamp, r.body, signed)
        assert not verify_signature("wrong", stamp, r.body, signed)
        assert not verify_signature("s3cret", stamp, r.body + b" ", signed)
    assert rx.requests[0].headers[DELIVERY] == "demo:1"
    assert "loss" in rx.requests[0].json["text"]


def test_a_warn_incident_the_routes_keep_from_the_webhook_sends_nothing_of_its_story():
    policy = load_policy_text(
        POLICY.replace("warn: [console, alertmanager, webhook]", "warn: [console]"), "p.yaml"
    )
    rx = Receiver()
    try:
        sink = WebhookSink(rx.url, secret=None, run="demo", policy=policy, journal=Journal())
        for ev in numbered(story()):
            sink.handle({**ev, "severity": "warn"})
        sink.close()
    finally:
        rx.close()
    assert rx.requests == []


# ---- Alertmanager (the documents; the real Alertmanager is test_alertmanager_real.py) --------
def test_alertmanager_posts_firing_keeps_it_alive_and_ends_it(policy):
    now = [0.0]
    rx = Receiver()
    try:
        sink = AlertmanagerSink(
            rx.url,
            run="demo",
            policy=policy,
            journal=Journal(),
            clock=lambda: now[0],
            retry=FAST,
            repost_s=60.0,
        )
        events = numbered(story())
        sink.handle(events[0])
        now[0] = 61.0
        sink.tick(None)  # the keep-alive
        for ev in events[1:]:
            sink.handle(ev)
        sink.close()
    finally:
        rx.close()
    posts = [r.json[0] for r in rx.requests]
    assert all(r.path == "/api/v2/alerts" for r in rx.requests)
    labels = posts[0]["labels"]
    assert labels == {
        "alertname": "SpikeguardIncident",
        "run": "demo",
        "rule": "loss-spike",
        "severity": "page",
        "rank": "1",
        "layer": "blocks.3.attn",
        "incident": "inc-001",
    }
    assert all(p["labels"] == labels for p in posts)  # one alert to Alertmanager
    assert posts[0]["endsAt"] > posts[0]["startsAt"]
    firing, resolved = posts[0], posts[-1]
    assert parse_time(firing["endsAt"]) > time.time()  # alive until the next keep-alives
    assert resolved["annotations"]["status"] == "RESOLVED"
    assert parse_time(resolved["endsAt"]) <= time.time()  # ended: Alertmanager resolves it
    assert [p["annotations"]["status"] for p in posts[:2]] == ["RECOVERING", "RECOVERING"]
    assert "keep-alive" not in json.dumps(posts)  # the keep-alive is the same alert again
