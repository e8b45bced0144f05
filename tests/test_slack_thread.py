"""One incident = one Slack thread: real slack-sdk over HTTP against tests/fakeslack.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakeslack import TOKEN, FakeSlack, incident_events
from spikeguard.supervisor.sinks.slack import SlackNotifier, SlackSettings

RUN_URL = "https://runs.example.com/gpt-1b"


def make_settings(fake: FakeSlack, **opts: Any) -> SlackSettings:
    """Bot-mode settings pointed at ``fake`` (fast pacing and backoff unless overridden)."""
    env = {"SLACK_BOT_TOKEN": TOKEN, "SPIKEGUARD_SLACK_API_URL": fake.api_url}
    opts = {"min_interval_s": 0.0, "backoff_s": 0.05, "max_retries": 3, **opts}
    return SlackSettings.from_env(
        channel="#ml-alerts",
        mention="S0ONCALL",
        runbook_url="https://wiki.example.com/runbook",
        dashboard_url="https://grafana.example.com/d/train",
        environ=env,
        **opts,
    )


def notifier(fake: FakeSlack, journal: list[dict], **opts: Any) -> SlackNotifier:
    return SlackNotifier(
        make_settings(fake, **opts), run="gpt-1b", journal=journal.append, run_dir_url=RUN_URL
    )


def header(blocks: Any) -> str:
    blocks = json.loads(blocks) if isinstance(blocks, str) else blocks
    return blocks[0]["text"]["text"]


def all_text(blocks: list[dict]) -> str:
    return json.dumps(blocks, ensure_ascii=False)


@pytest.fixture
def fake():
    with FakeSlack() as f:
        yield f
        assert f.violations == []


def test_full_incident_is_one_thread_with_replies_update_broadcast_and_chart(fake):
    journal: list[dict] = []
    n = notifier(fake, journal)
    for ev in incident_events():
        n.handle(ev)
    assert n.flush(30)
    n.close(5)

    roots = fake.roots()
    assert len(roots) == 1, "one incident must make exactly one root message"
    root = roots[0]
    first = fake.ok_calls("chat.postMessage")[0]
    assert header(first.params["blocks"]) == "[RECOVERING] S2 · gpt-1b"
    assert first.params["text"].startswith("<!subteam^S0ONCALL> [RECOVERING] S2 · gpt-1b")
    replies = fake.replies(root["ts"])
    texts = [r["text"] for r in replies]
    assert len(replies) == 7, texts  # one per recovery step, the last one the conclusion
    for word, text in zip(
        ("Killed", "Rolled back", "LR cut", "Optimizer reset", "Launched", "Probation", "RESOLVED"),
        texts,
    ):
        assert word in text
    assert [r["reply_broadcast"] for r in replies] == [False] * 6 + [True]
    assert "optimizer moments may carry the instability" in all_text(replies[3]["blocks"])
    assert "step 1,100" in texts[1] and "S6" in texts[1]
    assert len(root["updates"]) >= 1
    assert header(root["blocks"]) == "[RESOLVED] S2 · gpt-1b"
    assert "Resolved by spikeguard" in all_text(root["blocks"])
    # one PNG chart, uploaded into the thread (channel ID, root ts)
    assert len(fake.files) == 1
    (f,) = fake.files.values()
    assert f["data"][:8] == b"\x89PNG\r\n\x1a\n" and f["thread_ts"] == root["ts"]
    assert f["channel"] == "C0ALERTS" and f["alt_txt"]
    # the plain-text fallback is always set
    for c in fake.ok_calls("chat.postMessage") + fake.ok_calls("chat.update"):
        assert c.params.get("text"), c.params
    assert journal == [
        {"kind": "notify_thread", "incident": "inc-001", "channel": "C0ALERTS", "ts": root["ts"]}
    ]


def test_root_message_says_what_broke_and_links(fake):
    n = notifier(fake, [])
    n.handle(incident_events()[0])
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()
    body = all_text(root["blocks"])
    for expected in (
        "rank 3 · layer `blocks.7.attn`",
        "`attn_entropy_min` = 0.15",
        "*Step*\\n1,230",
        "*Loss*\\n7.9",
        "*Grad norm*\\n412",
        "`entropy-collapse`",
        "*Grade*\\nS2",
        f"<{RUN_URL}|Run directory>",
        "|Dashboard>",
        "|Runbook>",
        "<!subteam^S0ONCALL>",
        "no action needed yet",
    ):
        assert expected in body, expected


def test_escalation_is_broadcast_and_mentions_on_call(fake):
    n = notifier(fake, [])
    for ev in incident_events(conclusion="escalated", severity="warn"):
        n.handle(ev)
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()
    assert header(root["blocks"]) == "[ESCALATED] S2 · gpt-1b"
    assert root["text"].startswith("<!subteam^S0ONCALL>")  # a human is needed: always ping
    first = fake.ok_calls("chat.postMessage")[0]
    assert "<!subteam" not in first.params["text"]  # warn severity: no page while recovering
    last = fake.replies(root["ts"])[-1]
    assert last["reply_broadcast"] and "ESCALATED" in last["text"]
    assert "<!subteam^S0ONCALL>" in all_text(last["blocks"])
    assert "Runbook" in all_text(last["blocks"])


def test_restarted_notifier_keeps_posting_into_the_same_thread(fake):
    journal: list[dict] = []  # one journal: the supervisor's events and the notifier's own
    events = incident_events()
    first = SlackNotifier(make_settings(fake), run="gpt-1b", journal=journal.append)
    for ev in events[:3]:
        journal.append(ev)
        first.handle(ev)
    assert first.flush(30)
    first.close(5)
    (root,) = fake.roots()

    second = SlackNotifier(make_settings(fake), run="gpt-1b", journal=journal.append)
    second.restore(list(journal))
    for ev in events[3:]:
        journal.append(ev)
        second.handle(ev)
    assert second.flush(30)
    second.close(5)
    assert fake.roots() == [root]
    assert len(fake.replies(root["ts"])) == 7
    assert header(root["blocks"]) == "[RESOLVED] S2 · gpt-1b"
    assert [e["kind"] for e in journal].count("notify_thread") == 1
    assert fake.replies(root["ts"])[-1]["reply_broadcast"]


def test_a_root_that_never_got_through_is_created_by_the_next_message(fake):
    journal: list[dict] = []
    events = incident_events()
    fake.outage(None)
    first = SlackNotifier(
        make_settings(fake, max_retries=1, backoff_s=0.01), run="gpt-1b", journal=journal.append
    )
    for ev in events[:3]:
        journal.append(ev)
        first.handle(ev)
    assert first.flush(30)
    first.close(5)
    lost = [e["what"] for e in journal if e["kind"] == "notify_undelivered"]
    assert lost == ["inc-001 root", "inc-001 chart", "inc-001 kill", "inc-001 rollback"]
    fake.outage(0)
    second = SlackNotifier(make_settings(fake), run="gpt-1b", journal=journal.append)
    second.restore(list(journal))
    for ev in events[3:]:
        second.handle(ev)
    assert second.flush(30)
    second.close(5)
    (root,) = fake.roots()
    assert "Done so far:* killed ranks 0–3" in all_text(
        fake.ok_calls("chat.postMessage")[0].params["blocks"]
    )
    assert len(fake.replies(root["ts"])) == 5  # lr_cut .. the conclusion
    assert header(root["blocks"]) == "[RESOLVED] S2 · gpt-1b"


def alert(t: int, rank: int = 3, severity: str = "warn", incident: str | None = None) -> dict:
    return {
        "kind": "alert",
        "time": f"2024-05-01T04:{t // 60:02d}:{t % 60:02d}+00:00",
        "incident": incident,
        "run": "gpt-1b",
        "rule": "max-logit",
        "severity": severity,
        "signal": "max_logit",
        "value": 81.5,
        "rank": rank,
        "layer": "blocks.2.attn",
        "step": 5000 + t,
        "reason": "max logit 81.5 > 50 & rising",
    }


def test_repeated_alerts_are_deduplicated_within_the_repeat_interval(fake):
    n = notifier(fake, [], repeat_interval_s=60)
    for t, rank in ((0, 3), (10, 3), (20, 3), (30, 5), (59, 3), (61, 3)):
        n.handle(alert(t, rank))
    assert n.flush(30)
    posts = fake.ok_calls("chat.postMessage")
    assert len(posts) == 3  # t=0 rank 3, t=30 rank 5 (another place), t=61 after the interval
    assert header(posts[0].params["blocks"]) == "[WARN] max-logit · gpt-1b"
    assert "repeated 3×" in all_text(json.loads(json.dumps(posts[2].params["blocks"])))
    assert "&gt; 50 &amp; rising" in all_text(posts[0].params["blocks"])  # mrkdwn-escaped
    n.close(5)
    # a restarted supervisor remembers the window
    again = notifier(fake, [], repeat_interval_s=60)
    again.restore([alert(61)])
    again.handle(alert(100))
    again.handle(alert(130, severity="page"))
    assert again.flush(30)
    again.close(5)
    posts = fake.ok_calls("chat.postMessage")
    assert len(posts) == 4 and posts[3].params["text"].startswith("<!subteam^S0ONCALL> [PAGE]")


def test_a_resolved_alert_is_sent_once_even_inside_the_repeat_interval(fake):
    n = notifier(fake, [], repeat_interval_s=3600)
    n.handle(alert(0))
    n.handle({**alert(10), "resolved": True, "reason": "resolved: max-logit no longer holds"})
    n.handle({**alert(20), "resolved": True, "reason": "resolved: max-logit no longer holds"})
    assert n.flush(30)
    n.close(5)
    posts = fake.ok_calls("chat.postMessage")
    assert len(posts) == 2 and "resolved" in posts[1].params["text"]


def test_the_routes_keep_a_severity_off_slack(fake):
    n = notifier(fake, [], severities=("warn", "page"))  # routes: info -> [console]
    n.handle(alert(0, severity="info"))
    n.handle(alert(1, severity="warn"))
    info_incident = [
        {**e, "severity": "info"} if e["kind"] == "incident" else e for e in incident_events()
    ]
    for ev in info_incident:
        n.handle(ev)
    n.handle(
        {
            "kind": "completed",
            "time": "2024-05-01T05:00:00+00:00",
            "run": "gpt-1b",
            "incident": None,
            "reason": "all ranks finished",
            "final_loss": 1.5,
        }
    )
    assert n.flush(30)
    n.close(5)
    texts = [p.params["text"] for p in fake.ok_calls("chat.postMessage")]
    # the warn alert and the run's outcome; no info alert, no thread for an info incident
    assert len(texts) == 2 and "[WARN]" in texts[0] and "COMPLETED" in texts[1].upper()


def test_alert_of_an_open_incident_goes_into_its_thread(fake):
    n = notifier(fake, [])
    events = incident_events()
    for ev in events[:2]:
        n.handle(ev)
    n.handle(alert(5, incident="inc-001"))
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()
    assert "WARN" in fake.replies(root["ts"])[-1]["text"]


def test_probation_progress_is_rate_limited(fake):
    n = notifier(fake, [], progress_interval_s=60)
    events = incident_events()
    for ev in events[:7]:
        n.handle(ev)
    for t in range(0, 130, 10):
        n.handle(
            {
                **events[6],
                "kind": "probation_progress",
                "step": 1101 + t,
                "until_step": 1400,
                "time": f"2024-05-01T03:{1 + t // 60:02d}:{t % 60:02d}+00:00",
            }
        )
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()
    progress = [r for r in fake.replies(root["ts"]) if "at step" in r["text"]]
    assert len(progress) == 3  # t = 0, 60, 120


def test_long_and_hostile_texts_stay_within_block_kit_limits(fake):
    ev = incident_events()[0]
    ev.update(reason="<script> & " + "x" * 5000, layer="L" * 300, rule="r" * 200)
    n = SlackNotifier(make_settings(fake), run="run-" + "n" * 59, journal=[].append)
    n.handle(ev)
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()  # fakeslack enforced the limits; the fixture checks no violations
    assert len(header(root["blocks"])) <= 150
    assert "&lt;script&gt; &amp;" in all_text(root["blocks"])


def test_webhook_mode_sends_standalone_messages(fake):
    env = {"SPIKEGUARD_SLACK_WEBHOOK_URL": fake.webhook_url}
    s = SlackSettings.from_env(mention="<@U0ONCALL>", environ=env, min_interval_s=0.0)
    assert s.mode == "webhook"
    n = SlackNotifier(s, run="gpt-1b", journal=[].append)
    for ev in incident_events():
        n.handle(ev)
    assert n.flush(30)
    n.close(5)
    posts = fake.webhook_posts
    assert len(posts) == 8 and all("thread_ts" not in p for p in posts)
    assert not fake.ok_calls("chat.update") and not fake.files
    assert header(posts[0]["blocks"]) == "[RECOVERING] S2 · gpt-1b"
    assert posts[0]["text"].startswith("<@U0ONCALL>")
    assert "inc-001" in all_text(posts[1]["blocks"]) and "Killed" in posts[1]["text"]
    assert header(posts[-1]["blocks"]) == "[RESOLVED] S2 · gpt-1b"  # the whole story at the end


def test_a_second_spike_in_probation_stays_in_the_same_thread(fake):
    events = incident_events()
    again = [
        {
            **events[0],
            "kind": "probation_failed",
            "step": 1250,
            "reason": "entropy-collapse fired again",
        },
        {**events[0], "attempt": 2, "step": 1250, "context": None},
        *events[1:],
    ]
    n = notifier(fake, [])
    for ev in events[:7] + again:
        n.handle(ev)
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()
    texts = [r["text"] for r in fake.replies(root["ts"])]
    assert any("Probation failed at step 1,250" in t for t in texts)
    assert any("fired (attempt 2)" in t for t in texts)
    assert [t for t in texts if "RESOLVED" in t] == [texts[-1]] and len(fake.files) == 1
    assert header(root["blocks"]) == "[RESOLVED] S2 · gpt-1b"
    assert "fired again at step 1,250" in all_text(root["blocks"])


def test_an_incident_id_reused_after_its_conclusion_opens_a_new_thread(fake):
    journal: list[dict] = []
    n = notifier(fake, journal)
    for ev in incident_events() + incident_events(t0=600):
        journal.append(ev)
        n.handle(ev)
    assert n.flush(30)
    n.close(5)
    first, second = fake.roots()
    assert len(fake.replies(first["ts"])) == len(fake.replies(second["ts"])) == 7
    restored = notifier(fake, [])
    restored.restore(journal)  # the id maps to the newest thread
    restored.handle({**incident_events()[1], "kind": "stopped", "reason": "stopped by user"})
    assert restored.flush(30)
    restored.close(5)
    assert "Run stopped" in fake.replies(second["ts"])[-1]["text"]


def test_batch_forensics_are_a_reply_in_the_incident_thread_with_count_and_path(fake, tmp_path):
    from spikeguard.supervisor.intake import forensics

    answers = forensics.Answers(incident="inc-001", attempt=1, generation=1, asked=[0, 1, 2, 3])
    for rank in (0, 1, 3):  # rank 2 hung: it cannot answer
        entries = [[s, [s * 4 + rank]] for s in range(1031, 1231)]
        answers.add({"rank": rank, "step": 1230, "window": 200, "entries": entries})
    path = forensics.batch_ids_path(tmp_path, "inc-001", 1)
    event = forensics.event(answers.document(incident_step=1230, waited_s=1.2), path)
    events = incident_events()
    kill = next(i for i, e in enumerate(events) if e["kind"] == "kill")
    events.insert(kill, {**events[kill], "seq": 99, **event})  # asked right before the kill
    journal: list[dict] = []
    n = notifier(fake, journal)
    for ev in events:
        n.handle(ev)
    assert n.flush(30)
    n.close(5)
    (root,) = fake.roots()
    replies = fake.replies(root["ts"])
    texts = [r["text"] for r in replies]
    assert "Batch forensics" in texts[0] and "Killed" in texts[1]
    reply = all_text(replies[0]["blocks"])
    assert "600 batch ids of steps 1,031–1,230 from ranks 0–1, 3 (3 of 4)" in reply
    assert str(path) in reply
