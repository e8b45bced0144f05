"""The test Slack server really validates (else the other tests prove little); charts; blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakeslack import SPEC_PATH, TOKEN, FakeSlack, incident_events, load_spec
from spikeguard.supervisor.decide.events import Kind
from spikeguard.supervisor.decide.lifecycle import INCIDENT_STATE, IncidentState
from spikeguard.supervisor.sinks.charts import has_chart_data, render_incident_chart
from spikeguard.supervisor.sinks.slack.render import IncidentView, Links, root_message


@pytest.fixture
def fake():
    with FakeSlack() as f:
        yield f


def client(fake: FakeSlack, token: str | None = TOKEN) -> WebClient:
    return WebClient(token=token, base_url=fake.api_url, retry_handlers=[])


def rejected(fake: FakeSlack, call, needle: str) -> None:
    """``call`` must get invalid_arguments, and a violation containing ``needle``."""
    with pytest.raises(SlackApiError) as err:
        call()
    assert err.value.response["error"] == "invalid_arguments"
    assert any(needle in v for v in fake.violations), fake.violations
    fake.violations.clear()


def test_the_spec_is_slacks_and_is_read():
    assert SPEC_PATH.exists(), "CI needs ../shared/reference/slack beside the checkout"
    spec = load_spec()
    assert spec["chat.postMessage"]["channel"] == ("string", True)
    assert spec["chat.postMessage"]["reply_broadcast"] == ("boolean", False)
    assert spec["chat.update"]["ts"] == ("string", True)
    assert spec["files.getUploadURLExternal"]["length"] == ("integer", True)


def test_block_kit_limits_are_enforced(fake):
    c = client(fake)
    head = [{"type": "header", "text": {"type": "plain_text", "text": "h" * 151}}]
    rejected(
        fake,
        lambda: c.chat_postMessage(channel="C0ALERTS", text="t", blocks=head),
        "151 chars > 150",
    )
    many = [{"type": "divider"}] * 51
    rejected(
        fake,
        lambda: c.chat_postMessage(channel="C0ALERTS", text="t", blocks=many),
        "51 blocks > 50",
    )
    long = [{"type": "section", "text": {"type": "mrkdwn", "text": "x" * 3001}}]
    rejected(
        fake,
        lambda: c.chat_postMessage(channel="C0ALERTS", text="t", blocks=long),
        "3001 chars > 3000",
    )
    fields = [{"type": "section", "fields": [{"type": "mrkdwn", "text": "f"}] * 11}]
    rejected(
        fake, lambda: c.chat_postMessage(channel="C0ALERTS", text="t", blocks=fields), "1..10 items"
    )
    big = [{"type": "section", "fields": [{"type": "mrkdwn", "text": "f" * 2001}]}]
    rejected(
        fake,
        lambda: c.chat_update(channel="C0ALERTS", ts="1.2", text="t", blocks=big),
        "2001 chars > 2000",
    )
    plain_header = [{"type": "header", "text": {"type": "mrkdwn", "text": "*h*"}}]
    rejected(
        fake,
        lambda: c.chat_postMessage(channel="C0ALERTS", text="t", blocks=plain_header),
        "plain_text",
    )


def test_parameters_are_checked_against_the_spec(fake):
    c = client(fake)
    rejected(
        fake,
        lambda: c.api_call("chat.postMessage", json={"text": "no channel"}),
        "required parameter 'channel' missing",
    )
    rejected(
        fake,
        lambda: c.api_call("chat.update", json={"channel": "C0ALERTS", "text": "x"}),
        "required parameter 'ts' missing",
    )
    rejected(
        fake,
        lambda: c.api_call(
            "chat.postMessage", json={"channel": "C0ALERTS", "text": "x", "reply_broadcast": "yes"}
        ),
        "boolean expected",
    )
    rejected(
        fake,
        lambda: c.api_call(
            "chat.postMessage", json={"channel": "C0ALERTS", "text": "x", "thread_tss": "1.2"}
        ),
        "unknown parameter 'thread_tss'",
    )
    rejected(
        fake,
        lambda: c.api_call(
            "chat.postMessage", params={"channel": "C0ALERTS", "blocks": "[{not json"}
        ),
        "does not parse as JSON",
    )
    rejected(
        fake,
        lambda: c.api_call(
            "files.getUploadURLExternal", params={"filename": "a.png", "length": "many"}
        ),
        "integer expected",
    )
    rejected(
        fake,
        lambda: client(fake, token=None).chat_postMessage(channel="C0ALERTS", text="x"),
        "token missing from the Authorization header",
    )


def test_a_good_request_passes_and_threads_are_checked(fake):
    c = client(fake)
    root = c.chat_postMessage(channel="#ml-alerts", text="root")
    c.chat_postMessage(
        channel=root["channel"], thread_ts=root["ts"], text="reply", reply_broadcast=True
    )
    assert fake.violations == [] and len(fake.messages) == 2
    with pytest.raises(SlackApiError):  # a reply to a reply is a client bug
        c.chat_postMessage(channel="C0ALERTS", thread_ts=fake.messages[1]["ts"], text="x")
    assert "is no root message" in fake.violations.pop()
    with pytest.raises(SlackApiError) as err:  # chat.update wants the channel ID, as Slack does
        c.chat_update(channel="#ml-alerts", ts=root["ts"], text="edit")
    assert err.value.response["error"] == "channel_not_found"


def test_faults_are_served(fake):
    c = client(fake)
    fake.rate_limit(1, retry_after=7)
    with pytest.raises(SlackApiError) as err:
        c.auth_test()
    assert err.value.response.status_code == 429
    assert err.value.response.headers["Retry-After"] == "7"
    fake.outage(5)
    with pytest.raises(SlackApiError) as err:
        c.auth_test()
    assert err.value.response.status_code == 500
    fake.outage(0)
    assert c.auth_test()["user"] == "spikeguard"
    fake.force_error("auth.test", "account_inactive")
    with pytest.raises(SlackApiError, match="account_inactive"):
        c.auth_test()


def test_chart_is_a_small_png_and_tolerates_gaps():
    ctx = incident_events()[0]["context"]
    ctx["loss"][55] = "nan"
    ctx["attn_entropy_min"][3] = None
    png = render_incident_chart(ctx, step=1230, title="inc-001 · gpt-1b")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(png) < 150_000
    assert has_chart_data(ctx)
    assert not has_chart_data({"steps": [1, 2], "loss": [1.0]})  # mismatched lengths
    assert not has_chart_data(None)
    with pytest.raises(ValueError):
        render_incident_chart({"steps": []})


def test_root_message_in_every_state():
    view = IncidentView(run="gpt-1b", incident="inc-001")
    headers, pings = [], []
    for ev in incident_events(conclusion="escalated", severity="page"):
        view.apply(ev)
        msg = root_message(view, Links(), "<@U0ONCALL>")
        headers.append(msg.blocks[0]["text"]["text"])
        pings.append(msg.text.startswith("<@U0ONCALL>"))
        assert len(json.dumps(msg.blocks)) < 10_000
    assert headers[0] == "[RECOVERING] S2 · gpt-1b" and headers[6] == "[PROBATION] S2 · gpt-1b"
    assert headers[-1] == "[ESCALATED] S2 · gpt-1b"
    assert pings[0] and not pings[6] and pings[-1]  # page while recovering and when escalated


def test_the_incident_state_follows_the_journals_table():
    for kind in Kind:
        view = IncidentView(run="gpt-1b", incident="inc-001")
        view.apply({"kind": "probation_start", "until_step": 1400})
        changed = view.apply({"kind": kind.value, "reason": "r"})
        expected = INCIDENT_STATE.get(kind, IncidentState.PROBATION)
        assert view.state is expected and changed == (expected is not IncidentState.PROBATION)
    assert not view.apply({"kind": ["not", "a", "kind"]})  # a malformed event changes nothing
    assert view.state is IncidentState.PROBATION and not view.concluded
