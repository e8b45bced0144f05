"""The ``alertmanager`` sink against Debian's real Prometheus Alertmanager: an incident's alert
fires, Alertmanager notifies its receiver, the incident resolves, the receiver hears that too;
an escalation stays firing; an Alertmanager that is down costs the run nothing but a journaled
``notify_undelivered``."""

from __future__ import annotations

import pytest
from alertmanager_server import Alertmanager
from spikeguard.policies import load_policy_text
from spikeguard.supervisor.sinks.pagers.alertmanager import AlertmanagerSink
from test_pagers import FAST, POLICY, Journal, numbered, story


@pytest.fixture
def policy():
    return load_policy_text(POLICY, "pagers.yaml")


def sink_for(am_url: str, policy, journal) -> AlertmanagerSink:
    return AlertmanagerSink(am_url, run="demo", policy=policy, journal=journal, retry=FAST)


def test_firing_and_resolved_both_reach_the_receiver(tmp_path, policy):
    with Alertmanager(tmp_path) as am:
        journal = Journal()
        sink = sink_for(am.url, policy, journal)
        events = numbered(story())
        sink.handle(events[0])
        assert sink.outbox.flush(30)
        assert am.wait_for_status("firing", incident="inc-001", run="demo"), am.notifications()
        (held,) = am.alerts()
        assert held["labels"]["rule"] == "loss-spike" and held["labels"]["layer"] == "blocks.3.attn"
        assert held["status"]["state"] == "active"
        assert "loss" in held["annotations"]["summary"]
        for ev in events[1:]:
            sink.handle(ev)
        sink.close(ended=True)
        assert am.wait_for_status("resolved", incident="inc-001"), am.notifications()
        assert journal == []
        firing = next(n for n in am.notifications() if n["status"] == "firing")
        assert firing["commonLabels"]["alertname"] == "SpikeguardIncident"


def test_an_escalation_stays_firing_after_the_run_ends(tmp_path, policy):
    with Alertmanager(tmp_path) as am:
        sink = sink_for(am.url, policy, Journal())
        for ev in numbered(story(end="escalated")):
            sink.handle(ev)
        sink.close(ended=True)
        assert am.wait_for_status("firing", incident="inc-001")
        (held,) = am.alerts()
        assert held["status"]["state"] == "active"
        assert held["annotations"]["status"] == "ESCALATED"


def test_a_down_alertmanager_is_journaled_undelivered(policy):
    journal = Journal()
    sink = sink_for("http://127.0.0.1:9", policy, journal)  # nothing listens on port 9
    for ev in numbered(story()):
        sink.handle(ev)  # returns at once, whatever the pager does
    sink.close(timeout_s=30, ended=True)
    assert journal, "nothing was journaled undelivered"
    assert {e["kind"] for e in journal} == {"notify_undelivered"}
    assert {e["sink"] for e in journal} == {"alertmanager"}
    assert any("no answer" in e["error"] or "shut down" in e["error"] for e in journal)


def test_the_shipped_route_pages_page_incidents_and_chats_the_rest():
    import shutil
    import subprocess
    from pathlib import Path

    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool not installed: it comes with Debian's prometheus-alertmanager")
    config = Path(__file__).parents[1] / "deploy" / "alertmanager" / "alertmanager.yml"
    check = subprocess.run(
        [amtool, "check-config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr

    def receiver(*labels: str) -> str:
        r = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={config}", *labels],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    page = ("alertname=SpikeguardIncident", "severity=page", "run=demo", "incident=inc-001")
    assert receiver(*page) == "training-pager"
    assert receiver("alertname=SpikeguardIncident", "severity=warn") == "training-chat"
    assert receiver("alertname=SpikeguardAlert", "severity=page") == "training-chat"
