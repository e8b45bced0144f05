"""The pagers wired into a real supervised run (real Ray, gloo ranks): the toy job diverges,
spikeguard recovers it, and the incident reaches Debian's real Alertmanager (firing, then
resolved, at its receiver), a PagerDuty Events v2 server (trigger then resolve, each valid by the
schema, the first tries answered 503) and a signed webhook. Then the same run with every pager
stuck: it recovers and completes all the same, and the journal says what was not delivered."""

from __future__ import annotations

from pathlib import Path

import pytest
from alertmanager_server import Alertmanager
from conftest import assert_journal_replays, read_jsonl, toy_job
from fakepagers import PagerDutyServer, Receiver
from spikeguard.supervisor.sinks.pagers.pagerduty import dedup_key
from spikeguard.supervisor.sinks.pagers.webhook import SIGNATURE, TIMESTAMP, verify_signature

pytestmark = pytest.mark.slow
TOY = Path(__file__).parent / "data" / "toy_policy.yaml"
KEY = "R0UT1NGKEY0123456789abcdefABCDEF"
SECRET = "whsec-test-0123"


def paging_policy(tmp_path: Path) -> Path:
    """The toy policy with its loss spike at page severity (so PagerDuty is paged) and the
    built-in routes (each configured pager on pages)."""
    text = TOY.read_text().replace(
        "    for: 2 steps\n    action: recover\n",
        "    for: 2 steps\n    action: recover\n    severity: page\n",
        1,
    )
    assert "severity: page" in text
    path = tmp_path / "paging.yaml"
    path.write_text(text)
    return path


def test_an_incident_reaches_every_pager_and_resolves_there(
    ray_local, tmp_path, fail_at, monkeypatch
):
    from spikeguard.supervisor.runner import run_job

    fail_at(0, 60, "collapse")
    pd, hook = PagerDutyServer(), Receiver()
    pd.fail(503, 2)  # PagerDuty is briefly unwell: retried
    try:
        with Alertmanager(tmp_path) as am:
            monkeypatch.setenv("SPIKEGUARD_ALERTMANAGER_URL", am.url)
            monkeypatch.setenv("SPIKEGUARD_PAGERDUTY_ROUTING_KEY", KEY)
            monkeypatch.setenv("SPIKEGUARD_PAGERDUTY_URL", pd.url)
            monkeypatch.setenv("SPIKEGUARD_WEBHOOK_URL", hook.url + "/hook")
            monkeypatch.setenv("SPIKEGUARD_WEBHOOK_SECRET", SECRET)
            job = toy_job(tmp_path, policy=paging_policy(tmp_path), faults=fail_at, steps=120)
            assert run_job(job, live=False) == 0
            assert am.wait_for_status("firing", incident="inc-001", run="toy"), am.notifications()
            assert am.wait_for_status("resolved", incident="inc-001"), am.notifications()
    finally:
        pd.close()
        hook.close()
    journal = read_jsonl(Path(job.run_dir) / "journal.jsonl")
    assert not [e for e in journal if e["kind"] == "notify_undelivered"]
    assert pd.invalid == []
    actions = [(e["event_action"], e["dedup_key"]) for e in pd.events()]
    key = dedup_key("toy", "inc-001")
    assert actions == [("trigger", key), ("resolve", key)]
    assert pd.alerts == {key: "resolved"}
    assert [r.status for r in pd.requests][:2] == [503, 503]
    kinds = [r.json["event"]["kind"] for r in hook.requests]
    assert kinds[0] == "incident" and "probation_passed" in kinds and kinds[-1] == "completed"
    journaled = {e["seq"] for e in journal}
    assert {r.json["event"]["seq"] for r in hook.requests} <= journaled
    for r in hook.requests:
        assert verify_signature(SECRET, r.headers[TIMESTAMP], r.body, r.headers[SIGNATURE])
    assert KEY not in (Path(job.run_dir) / "journal.jsonl").read_text()
    assert_journal_replays(Path(job.run_dir) / "journal.jsonl")


def test_stuck_pagers_never_delay_the_recovery_and_what_they_missed_is_journaled(
    ray_local, tmp_path, fail_at, monkeypatch
):
    from spikeguard.supervisor.runner import run_job

    fail_at(0, 60, "collapse")
    stuck = Receiver()
    stuck.hang()  # every pager request is held until the test ends
    try:
        monkeypatch.setenv("SPIKEGUARD_ALERTMANAGER_URL", stuck.url)
        monkeypatch.setenv("SPIKEGUARD_PAGERDUTY_ROUTING_KEY", KEY)
        monkeypatch.setenv("SPIKEGUARD_PAGERDUTY_URL", stuck.url)
        monkeypatch.setenv("SPIKEGUARD_WEBHOOK_URL", stuck.url + "/hook")
        job = toy_job(tmp_path, policy=paging_policy(tmp_path), faults=fail_at, steps=120)
        assert run_job(job, live=False) == 0
    finally:
        stuck.close()
    journal = read_jsonl(Path(job.run_dir) / "journal.jsonl")
    kinds = [e["kind"] for e in journal]
    # the recovery went through every step while the pagers held their first request
    for kind in ("incident", "kill", "rollback", "probation_passed", "completed"):
        assert kind in kinds, kind
    missed = [e for e in journal if e["kind"] == "notify_undelivered"]
    assert {e["sink"] for e in missed} == {"alertmanager", "pagerduty", "webhook"}
    assert any(e["incident"] == "inc-001" for e in missed)
    assert KEY not in (Path(job.run_dir) / "journal.jsonl").read_text()
