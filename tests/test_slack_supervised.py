"""Slack wired into a real supervised run: the toy job collapses, spikeguard recovers it, and the
incident becomes one thread on the local Slack-compatible server (real slack-sdk, real Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import read_jsonl, toy_job
from fakeslack import TOKEN, FakeSlack

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def test_supervised_incident_is_one_slack_thread(ray_local, tmp_path, fail_at, monkeypatch):
    from spikeguard.supervisor.runner import run_job

    fail_at(0, 60, "collapse")
    with FakeSlack() as fake:
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SPIKEGUARD_SLACK_API_URL", fake.api_url)
        job = toy_job(
            tmp_path,
            policy=POLICY,
            faults=fail_at,
            steps=120,
            notify={"slack": {"channel": "#ml-alerts", "mention": "S0ONCALL"}},
        )
        assert run_job(job, live=False) == 0
        assert fake.violations == []
        roots = fake.roots()
        incident_roots = [
            r for r in roots if "RECOVER" in json.dumps(r) or "RESOLVED" in json.dumps(r)
        ]
        assert len(incident_roots) == 1, (
            roots
        )  # one incident, one thread (plus a run-completed post)
        root = incident_roots[0]
        replies = fake.replies(root["ts"])
        texts = " ".join(json.dumps(r) for r in replies)
        for word in ("Killed", "Rolled back", "LR cut", "Optimizer reset", "Probation"):
            assert word in texts, word
        assert any(r.get("reply_broadcast") in (True, "true", "1", 1) for r in replies)
        assert fake.ok_calls("chat.update")
        assert fake.ok_calls("files.completeUploadExternal")
    journal = read_jsonl(Path(job.run_dir) / "journal.jsonl")
    thread = [e for e in journal if e["kind"] == "notify_thread"]
    assert len(thread) == 1 and thread[0]["ts"] == root["ts"]
    assert not [e for e in journal if e["kind"] == "notify_undelivered"]
