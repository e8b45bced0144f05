"""The root message's buttons: a press over Socket Mode becomes an operator request.

The decision is pure (:func:`~spikeguard.supervisor.sinks.slack.buttons.decide`, tested on its
own, hostile payloads included); the rest runs a real :class:`SlackNotifier` and its listener
(slack-sdk's Socket Mode client) against tests/fakeslack.py, whose websocket side pushes the
envelopes Slack pushes when a button is clicked, and records the acks. The last test presses
Hold in a real supervised run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakeslack import APP_TOKEN, TOKEN, FakeSlack, incident_events
from spikeguard.supervisor.decide.lifecycle import IncidentState
from spikeguard.supervisor.intake.operator import (
    OperatorRequest,
    ResumeChoice,
    pending_actions,
    take_requests,
)
from spikeguard.supervisor.observe.describe import describe
from spikeguard.supervisor.sinks.slack import SlackNotifier, SlackSettings
from spikeguard.supervisor.sinks.slack.buttons import (
    Accepted,
    Refused,
    decide,
    refused_event,
)
from spikeguard.supervisor.sinks.slack.render import (
    IncidentView,
    Links,
    button_value,
    offered,
    root_message,
    step_message,
)

RUN = "gpt-1b"
VALUE = button_value(RUN, "inc-001")
ALICE, MALLORY = "U0ALICE", "U0MALLORY"


def press_payload(
    action_id: str = "spikeguard_ack", value: Any = VALUE, user: Any = ALICE, **extra: Any
) -> dict[str, Any]:
    """A ``block_actions`` payload as Slack sends it for one click."""
    return {
        "type": "block_actions",
        "user": {"id": user, "username": "alice"},
        "channel": {"id": "C0ALERTS", "name": "ml-alerts"},
        "container": {"type": "message", "message_ts": "1700000001.000100"},
        "message": {"ts": "1700000001.000100"},
        "actions": [{"type": "button", "action_id": action_id, "value": value}],
        **extra,
    }


# ------------------------------------------------------------------------- the pure decision
@pytest.mark.parametrize(
    ("action_id", "action", "resume"),
    [
        ("spikeguard_ack", "ack", None),
        ("spikeguard_hold", "hold", None),
        ("spikeguard_resume", "resume", ResumeChoice(lr_factor=0.5)),
        ("spikeguard_stop", "stop", None),
    ],
)
def test_an_operator_press_becomes_their_request(action_id, action, resume):
    got = decide(press_payload(action_id), run=RUN, operators=(ALICE,))
    assert isinstance(got, Accepted)
    assert got.request == OperatorRequest(
        action=action, who="U0ALICE (alice)", via="slack", incident="inc-001", resume=resume
    )
    assert got.presser.channel == "C0ALERTS"


def test_a_press_by_someone_not_listed_is_refused_and_says_why():
    got = decide(press_payload(user=MALLORY), run=RUN, operators=(ALICE,))
    assert isinstance(got, Refused) and got.presser is not None
    assert got.presser.user == MALLORY and (got.action, got.incident) == ("ack", "inc-001")
    assert "U0MALLORY (alice) is not in SPIKEGUARD_SLACK_OPERATORS" in got.reason
    nobody = decide(press_payload(), run=RUN, operators=())
    assert isinstance(nobody, Refused) and "SPIKEGUARD_SLACK_OPERATORS is empty" in nobody.reason
    ev = refused_event(got)
    assert (ev["kind"], ev["code"], ev["via"], ev["incident"]) == (
        "operator",
        "button_refused",
        "slack",
        "inc-001",
    )
    assert describe(ev).startswith("Slack button press refused: U0MALLORY (alice) is not in")


def test_another_runs_button_is_refused():
    value = button_value("other-run", "inc-001")
    got = decide(press_payload(value=value), run=RUN, operators=(ALICE,))
    assert isinstance(got, Refused) and "of run 'other-run'" in got.reason


HOSTILE: list[Any] = [
    None,
    "block_actions",
    [],
    {},
    {"type": "view_submission", "user": {"id": ALICE}},
    press_payload(user=None),
    press_payload(user="alice"),  # a name, not an ID
    press_payload(user="U0ALICE\n"),
    press_payload(user={"id": ALICE}),
    press_payload(user=ALICE, actions="spikeguard_ack"),
    press_payload(user=ALICE, actions=[]),
    press_payload(actions=[{"action_id": "spikeguard_ack", "value": VALUE}] * 2),
    press_payload(actions=[None]),
    press_payload("spikeguard_delete_everything"),
    press_payload(["spikeguard_ack"]),
    press_payload(value=None),
    press_payload(value=17),
    press_payload(value="inc-001"),
    press_payload(value="[1, 2]"),
    press_payload(value=json.dumps({"run": RUN, "incident": "inc-001", "extra": 1})),
    press_payload(value=json.dumps({"run": RUN, "incident": 1})),
    press_payload(value=json.dumps({"run": RUN, "incident": "../../etc"})),
    press_payload(value=json.dumps({"run": RUN, "incident": "inc-" + "1" * 3000})),
    press_payload(value="[" * 100_000),
    press_payload(value=" " * 5000 + VALUE),
]


@pytest.mark.parametrize("payload", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_payload_is_refused_without_raising(payload):
    got = decide(payload, run=RUN, operators=(ALICE,))
    assert isinstance(got, Refused), got
    assert len(got.reason) < 400  # an oversized value is not echoed back
    if got.presser is not None:
        assert describe(refused_event(got))


def test_a_hostile_name_is_reduced_to_plain_characters():
    payload = press_payload()
    payload["user"]["username"] = "<!channel> *alice*" + "x" * 500
    got = decide(payload, run=RUN, operators=(ALICE,))
    assert isinstance(got, Accepted)
    assert got.request.who.startswith("U0ALICE (channelalice") and len(got.request.who) < 100


# ------------------------------------------------------------------------- which buttons show
def names(view: IncidentView) -> list[str]:
    return [b.action for b in offered(view)]


def test_the_buttons_follow_the_incident():
    view = IncidentView(run=RUN, incident="inc-001")
    events = incident_events()
    view.apply(events[0], buttons=True)
    assert names(view) == ["ack", "hold", "stop"]
    who = {"kind": "operator", "incident": "inc-001", "who": "U0ALICE (alice)", "via": "slack"}
    assert view.apply({**who, "code": "acknowledged"}, buttons=True)
    assert names(view) == ["hold", "stop"] and view.acknowledged_by == "U0ALICE (alice) via slack"
    assert view.apply({**who, "code": "hold_set"}, buttons=True)
    assert names(view) == ["stop"]
    assert view.apply({**who, "code": "recovery_held", "reason": "loss-spike fired"}, buttons=True)
    assert view.state is IncidentState.ESCALATED and names(view) == ["resume", "stop"]
    assert view.apply({**who, "code": "operator_resumed"}, buttons=True)
    assert view.state is IncidentState.RECOVERING and view.ended is None
    assert names(view) == ["hold", "stop"]
    for ev in events[1:]:
        view.apply(ev, buttons=True)
    assert view.state is IncidentState.RESOLVED and names(view) == []


def test_no_buttons_once_the_run_is_over_and_resume_while_it_waits():
    for hold, expected in ((True, ["ack", "resume", "stop"]), (False, [])):
        view = IncidentView(run=RUN, incident="inc-001")
        for ev in incident_events(conclusion="escalated"):
            view.apply({**ev, "hold": hold} if ev["kind"] == "escalated" else ev)
        assert names(view) == expected
    view = IncidentView(run=RUN, incident="inc-001")
    view.apply(incident_events()[0])
    assert view.apply({"kind": "stopped", "incident": "inc-001"}, buttons=True)
    assert names(view) == []
    assert not IncidentView(run=RUN, incident="x").apply({"kind": "stopped"})  # no buttons shown


def test_a_held_recovery_moves_the_thread_to_escalated():
    view = IncidentView(run=RUN, incident="inc-001")
    view.apply(incident_events()[0])
    held = {
        "kind": "operator",
        "code": "recovery_held",
        "incident": "inc-001",
        "who": "U0ALICE (alice)",
        "reason": "loss-spike fired while recovery is on hold (set by U0ALICE (alice))",
    }
    view.apply(held)
    reply = step_message(held, view, Links(), "<@U0ONCALL>")
    assert "*ESCALATED*" in reply.blocks[0]["text"]["text"] and reply.text.startswith("<@U0ONCALL>")
    root = root_message(view, Links(), None)
    assert root.blocks[0]["text"]["text"].startswith("[ESCALATED]")


# ------------------------------------------------------------------------- over Socket Mode
def settings(fake: FakeSlack, *, app: bool = True, operators: str = ALICE) -> SlackSettings:
    env = {
        "SLACK_BOT_TOKEN": TOKEN,
        "SPIKEGUARD_SLACK_API_URL": fake.api_url,
        "SPIKEGUARD_SLACK_OPERATORS": operators,
    }
    if app:
        env["SLACK_APP_TOKEN"] = APP_TOKEN
    return SlackSettings.from_env(
        channel="#ml-alerts", environ=env, min_interval_s=0.0, backoff_s=0.05, max_retries=2
    )


def wait_until(what: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """``what()`` once it is truthy (polled), else its last falsy value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def actions_of(message: dict[str, Any]) -> dict[str, str]:
    """The root message's buttons: action_id -> value."""
    blocks = [b for b in message["blocks"] if b["type"] == "actions"]
    return {e["action_id"]: e["value"] for b in blocks for e in b["elements"]}


@pytest.fixture
def fake():
    with FakeSlack() as f:
        yield f
        assert f.violations == []


@pytest.fixture
def slack(fake, tmp_path):
    """A notifier with buttons for run RUN in ``tmp_path``, its incident's root posted; its
    journal holds a refused press until ``gate`` is set (set unless a test clears it)."""
    journal: list[dict] = []
    gate = threading.Event()
    gate.set()

    def record(ev: dict) -> None:
        if ev.get("code") == "button_refused":
            assert gate.wait(30)
        journal.append(ev)

    n = SlackNotifier(settings(fake), run=RUN, journal=record, run_dir=tmp_path)
    for ev in incident_events()[:3]:
        n.handle(ev)
    assert n.flush(30) and fake.socket_mode.wait_connected(20)
    n.gate = gate  # type: ignore[attr-defined]
    yield n, journal, fake.roots()[0]
    n.close(5)


def test_the_root_has_buttons_only_with_an_app_token(fake, tmp_path):
    for app in (True, False):
        n = SlackNotifier(settings(fake, app=app), run=RUN, journal=[].append, run_dir=tmp_path)
        n.handle(incident_events()[0])
        assert n.flush(30)
        n.close(5)
        buttons = actions_of(fake.roots()[-1])
        if app:
            assert list(buttons) == ["spikeguard_ack", "spikeguard_hold", "spikeguard_stop"]
            assert set(buttons.values()) == {VALUE}
        else:
            assert buttons == {}
    assert len(fake.ok_calls("apps.connections.open")) == 1  # only the notifier with a token
    assert fake.ok_calls("apps.connections.open")[0].headers["authorization"].endswith(APP_TOKEN)


def test_an_operators_press_writes_their_request_and_is_acked(slack, fake, tmp_path):
    _, journal, root = slack
    env = fake.press("spikeguard_ack", actions_of(root)["spikeguard_ack"], ALICE, "alice")
    assert env.ack == {"envelope_id": env.envelope_id}
    assert wait_until(lambda: pending_actions(tmp_path)) == ["ack"]
    (req,) = take_requests(tmp_path)
    assert isinstance(req, OperatorRequest)
    assert (req.action, req.via, req.who, req.incident) == (
        "ack",
        "slack",
        "U0ALICE (alice)",
        "inc-001",
    )
    fake.press("spikeguard_resume", VALUE, ALICE, "alice")
    (resume,) = wait_until(lambda: take_requests(tmp_path))
    assert resume.action == "resume" and resume.resume == ResumeChoice(lr_factor=0.5)
    assert fake.ephemerals == [] and {e["kind"] for e in journal} == {"notify_thread"}


def test_anyone_elses_press_writes_nothing_and_is_answered_privately(slack, fake, tmp_path):
    n, journal, root = slack
    n.gate.clear()  # the journal of the refusal blocks until the press was acked
    fake.press("spikeguard_hold", actions_of(root)["spikeguard_hold"], MALLORY, "mallory")
    n.gate.set()
    assert wait_until(lambda: fake.ephemerals)
    (told,) = fake.ephemerals
    assert (told["channel"], told["user"]) == ("C0ALERTS", MALLORY)
    assert "not in SPIKEGUARD_SLACK_OPERATORS" in told["text"]
    assert not (tmp_path / "operator").exists() or not list((tmp_path / "operator").iterdir())
    (refused,) = [e for e in journal if e["kind"] == "operator"]
    assert (refused["code"], refused["who"], refused["action"]) == (
        "button_refused",
        "U0MALLORY (mallory)",
        "hold",
    )


def test_hostile_envelopes_are_acked_and_the_listener_goes_on(slack, fake, tmp_path):
    _, journal, root = slack
    for payload in ("not a dict", {"type": "block_actions", "actions": "x" * 100_000}, [1, 2]):
        env = fake.push_interactive(payload)
        assert env.ack == {"envelope_id": env.envelope_id}
    fake.press("spikeguard_nope", VALUE, ALICE)
    fake.socket_mode.disconnect()  # Slack asks for a reconnect now and then
    assert wait_until(lambda: fake.socket_mode.connects >= 2)
    fake.press("spikeguard_stop", actions_of(root)["spikeguard_stop"], ALICE)
    assert wait_until(lambda: pending_actions(tmp_path)) == ["stop"]
    refused = [e for e in journal if e.get("code") == "button_refused"]
    assert [e["reason"] for e in refused] == ["unknown button 'spikeguard_nope'"]


def test_what_a_human_did_shows_in_the_thread_and_on_the_root(slack, fake):
    n, _, root = slack
    ts = root["ts"]
    reminder = {
        "kind": "alert",
        "incident": "inc-001",
        "rule": "entropy-low",
        "severity": "warn",
        "step": 1240,
        "repeated": True,
        "reason": "still low",
    }
    n.handle(reminder)
    assert n.flush(30)
    before = len(fake.replies(ts))
    assert "still low" in json.dumps(fake.replies(ts)[-1])  # a reminder before the ack is posted
    ack = {
        "kind": "operator",
        "code": "acknowledged",
        "incident": "inc-001",
        "action": "ack",
        "who": "U0ALICE (alice)",
        "via": "slack",
        "note": "",
        "request": "r1",
        "reason": "acknowledged by U0ALICE (alice) (slack); its reminders stop",
    }
    n.handle(ack)
    n.handle({**reminder, "step": 1250, "reason": "still low, later"})
    assert n.flush(30)
    replies = fake.replies(ts)
    assert len(replies) == before + 1 and "Acknowledged" in replies[-1]["text"]
    assert "still low, later" not in json.dumps(replies)
    latest = fake.roots()[0]
    assert "Acknowledged* by U0ALICE (alice) via slack" in json.dumps(latest["blocks"])
    assert list(actions_of(latest)) == ["spikeguard_hold", "spikeguard_stop"]


# ------------------------------------------------------------------------- a supervised run
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


@pytest.mark.slow
def test_hold_pressed_in_slack_holds_the_supervised_run(ray_local, tmp_path, fail_at, monkeypatch):
    from conftest import read_jsonl, toy_job
    from spikeguard.supervisor.runner import run_job

    fail_at(0, 60, "collapse")
    with FakeSlack() as fake:
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SLACK_APP_TOKEN", APP_TOKEN)
        monkeypatch.setenv("SPIKEGUARD_SLACK_OPERATORS", f"U0BOB,{ALICE}")
        monkeypatch.setenv("SPIKEGUARD_SLACK_API_URL", fake.api_url)
        job = toy_job(
            tmp_path,
            policy=POLICY,
            faults=fail_at,
            steps=300,
            extra_args=["--step-sleep", "0.05"],  # the relaunch trains long enough to press
            notify={"slack": {"channel": "#ml-alerts"}},
        )
        pressed: list[Any] = []

        def press_hold() -> None:
            root = wait_until(lambda: [r for r in fake.roots() if actions_of(r)], 240)
            if root and fake.socket_mode.wait_connected(30):
                value = actions_of(root[0])["spikeguard_hold"]
                pressed.append(fake.press("spikeguard_hold", value, ALICE, "alice"))

        presser = threading.Thread(target=press_hold, daemon=True)
        presser.start()
        assert run_job(job, live=False) == 0
        presser.join(5)
        assert pressed and pressed[0].ack is not None
        assert fake.violations == []
        replies = fake.replies(fake.roots()[0]["ts"])
    journal = read_jsonl(Path(job.run_dir) / "journal.jsonl")
    (held,) = [e for e in journal if e["kind"] == "operator"]
    assert (held["code"], held["via"], held["who"], held["incident"]) == (
        "hold_set",
        "slack",
        "U0ALICE (alice)",
        "inc-001",
    )
    assert any("Recovery on hold" in r["text"] for r in replies)
