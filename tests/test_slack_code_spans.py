"""What a rank named reaches Slack inside code spans: a layer called ``http://evil.example`` (or
``<http://evil.example|click here>``, ``<!channel>``, ``*bold*``) is shown as text, never as a
link, a mention or markup, in the blocks and in the fallback text, whether it comes as the
event's ``layer`` field or quoted in the policy engine's reason. And an incident whose script
passes no batch ids says nothing of "0 batch ids"."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakeslack import TOKEN, FakeSlack, incident_events
from spikeguard.supervisor.intake import forensics
from spikeguard.supervisor.observe.describe import SPAN_BACKTICK, code, describe
from spikeguard.supervisor.observe.report import render
from spikeguard.supervisor.observe.rundata import load_run
from spikeguard.supervisor.sinks.slack import SlackNotifier, SlackSettings
from spikeguard.supervisor.sinks.slack.render import (
    IncidentView,
    Links,
    alert_message,
    rollback_detail,
    root_message,
    step_message,
)

EVIL = "http://evil.example/x <http://evil.example|click here> <!channel> *bold* `tick`\nnext"
SPAN = re.compile(r"`[^`\n]*`")


def mrkdwn_texts(obj: Any) -> list[str]:
    """Every string of a message's blocks (and its fallback ``text``)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in mrkdwn_texts(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in mrkdwn_texts(v)]
    return []


def assert_only_in_spans(texts: list[str]) -> None:
    """Outside code spans no trace of the evil name: no link, no mention, no markup from it."""
    seen = False
    for text in texts:
        outside = SPAN.sub("", text)
        assert "evil.example" not in outside, text
        assert "<!channel>" not in text and "<http://evil" not in text, text
        for span in SPAN.findall(text):
            if "evil.example" in span:
                seen = True
                assert "&lt;http://evil.example|click here&gt; &lt;!channel&gt;" in span
                assert f"{SPAN_BACKTICK}tick{SPAN_BACKTICK} next" in span  # no backtick, no \n
    assert seen, "the name is shown (in a span)"


def evil_incident() -> list[dict[str, Any]]:
    evs = incident_events()
    reason = f"rank 3 layer {EVIL}: attn_entropy_min 0.15 is below 0.3"
    evs[0].update(layer=EVIL, reason=reason)
    return evs


def test_code_spans_escape_and_neutralise():
    assert code("blocks.7.attn") == "`blocks.7.attn`"
    assert code("a`b\nc & <d>") == f"`a{SPAN_BACKTICK}b c &amp; &lt;d&gt;`"
    assert code("") == "—"
    ev = {"kind": "alert", "severity": "warn", "rule": "r", "layer": EVIL, "step": 3}
    assert describe(ev) == f"WARN r at step 3: on layer {EVIL}"  # plain text: as it is
    assert_only_in_spans([describe(ev, "mrkdwn")])


def test_every_message_of_an_incident_keeps_the_layer_in_code_spans():
    evs = evil_incident()
    view = IncidentView(run="gpt-1b", incident="inc-001")
    texts: list[str] = []
    for ev in evs:
        view.apply(ev)
        msg = step_message(ev, view, Links(), "S0ONCALL")
        texts += mrkdwn_texts(msg.blocks) + [msg.text]
    root = root_message(view, Links(), "S0ONCALL")
    texts += mrkdwn_texts(root.blocks) + [root.text]
    alert = {**evs[0], "kind": "alert", "severity": "page"}
    msg = alert_message(alert, "gpt-1b", Links(), None)
    texts += mrkdwn_texts(msg.blocks) + [msg.text]
    assert_only_in_spans(texts)
    assert f"layer {code(EVIL)} (fell first)" in json.dumps(root.blocks, ensure_ascii=False)


def test_a_rank_supplied_checkpoint_path_is_one_span():
    ev = {"kind": "rollback", "checkpoint_step": 5, "checkpoint_path": "ckpt/`x`/<http://e.x>"}
    ev["skipped"] = [{"path": "a`b", "reason": "graded S3 < S5"}]
    detail = rollback_detail(ev)
    assert detail == (
        f"checkpoint `ckpt/{SPAN_BACKTICK}x{SPAN_BACKTICK}/&lt;http://e.x&gt;`; "
        f"passed over: `a{SPAN_BACKTICK}b` (`graded S3 &lt; S5`)"
    )


@pytest.fixture
def fake():
    with FakeSlack() as f:
        yield f
        assert f.violations == []


def test_through_the_real_notifier_and_slack_sdk(fake):
    env = {"SLACK_BOT_TOKEN": TOKEN, "SPIKEGUARD_SLACK_API_URL": fake.api_url}
    settings = SlackSettings.from_env(
        channel="#ml-alerts", mention="S0ONCALL", environ=env, min_interval_s=0.0
    )
    n = SlackNotifier(settings, run="gpt-1b", journal=[].append)
    for ev in evil_incident():
        n.handle(ev)
    assert n.flush(30)
    n.close(5)
    calls = fake.ok_calls("chat.postMessage") + fake.ok_calls("chat.update")
    assert len(calls) >= 8
    texts = []
    for c in calls:
        blocks = c.params.get("blocks")
        blocks = json.loads(blocks) if isinstance(blocks, str) else blocks
        texts += mrkdwn_texts(blocks) + [str(c.params.get("text"))]
    assert_only_in_spans(texts)


def no_ids_forensics(run: Path) -> dict[str, Any]:
    """What a HF or Lightning run's kill leaves: both ranks answered, with no batch id."""
    answers = forensics.Answers(incident="inc-001", attempt=1, generation=1, asked=[0, 1])
    for rank in (0, 1):
        answers.add({"rank": rank, "step": 40, "window": 200, "entries": []})
    doc = answers.document(incident_step=40, waited_s=0.2)
    path = forensics.batch_ids_path(run, "inc-001", 1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    return forensics.event(doc, path)


def test_a_script_that_passes_no_batch_ids_gets_no_0_batch_ids_line(tmp_path):
    run = tmp_path / "run"
    ev = no_ids_forensics(run)
    assert ev["batches"] == 0
    for markup in ("plain", "mrkdwn"):
        line = describe(ev, markup)  # type: ignore[arg-type]
        assert "0 batch ids" not in line and "passes no batch ids" in line
    msg = step_message(ev, IncidentView(run="r", incident="inc-001"), Links(), None)
    assert "0 batch ids" not in json.dumps(msg.blocks) + msg.text
    (run / "reports.jsonl").write_text("")
    page = render(load_run(run), secrets=())
    assert "0 batch ids" not in page and "inc-001, attempt 1" not in page
    assert "No batch ids on file" in page
