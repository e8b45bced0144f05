"""The journal: append-only, survives a torn last line, sequence continues across restarts."""

from __future__ import annotations

import json

import pytest
from spikeguard.supervisor.journal import Journal, read_events


def test_append_is_durable_and_ordered(tmp_path):
    j = Journal(tmp_path, run="r")
    j.append("launch", reason="initial", generation=1)
    j.record({"kind": "incident", "reason": "spike", "incident": "inc-001", "step": 7})
    evs = read_events(tmp_path)  # read back while still open: each append was flushed + fsynced
    assert [(e["seq"], e["kind"]) for e in evs] == [(1, "launch"), (2, "incident")]
    assert evs[1]["incident"] == "inc-001" and evs[1]["step"] == 7 and evs[1]["run"] == "r"


def test_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError):
        Journal(tmp_path, run="r").append("party")


def test_torn_last_line_is_ignored_and_the_next_append_starts_clean(tmp_path):
    j = Journal(tmp_path, run="r")
    j.append("launch", generation=1)
    j.close()
    with open(tmp_path / "journal.jsonl", "ab") as f:
        f.write(b'{"seq": 2, "kind": "inci')  # the supervisor died mid-write
    assert len(read_events(tmp_path)) == 1
    j2 = Journal(tmp_path, run="r")  # a restarted supervisor
    ev = j2.append("incident", reason="x")
    assert ev["seq"] == 2
    assert [e["kind"] for e in read_events(tmp_path)] == ["launch", "incident"]
    lines = (tmp_path / "journal.jsonl").read_bytes().splitlines()
    assert json.loads(lines[-1])["kind"] == "incident"


def test_monotonic_time_continues_across_restarts(tmp_path):
    j = Journal(tmp_path, run="r")
    a = j.append("launch")["mono"]
    j.close()
    b = Journal(tmp_path, run="r").append("completed")["mono"]
    assert b >= a


GATEWAY_TOKEN = "gw-7f3a9c2e5b8d1f4a"  # a Slack-compatible gateway's token: no pattern knows it
HOOK = "https://hooks.slack.com/services/T0000/B0000/XXXXs3cr3t"


def test_every_string_field_is_journaled_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("SLACK_BOT_TOKEN", GATEWAY_TOKEN)  # what the supervisor holds
    j = Journal(tmp_path, run="r")
    ev = j.append(
        "notify_undelivered",
        reason=f"slack-sdk: Invalid URL detected: {HOOK}",
        what="inc-001 kill",
        error=f"invalid_auth for token {GATEWAY_TOKEN}",
    )
    j.append(
        "incident",
        incident="inc-001",
        reason="rank 1 crashed",
        log_tail=f"Traceback ...\nos.environ['SLACK_BOT_TOKEN'] = '{GATEWAY_TOKEN}'\n",
        context={"ranks": [{"log_tail": f"sent to {HOOK}", "exit_code": 1}], "steps": [1, 2]},
    )
    j.close()
    text = (tmp_path / "journal.jsonl").read_text()
    assert GATEWAY_TOKEN not in text and "XXXXs3cr3t" not in text and "hooks.slack.com" not in text
    assert text.count("[redacted]") == 4
    # what the notifiers get is what was written
    assert GATEWAY_TOKEN not in json.dumps(ev) and "[redacted]" in ev["error"]
    inc = read_events(tmp_path)[1]
    assert inc["log_tail"].startswith("Traceback ...") and inc["context"]["steps"] == [1, 2]
    assert inc["context"]["ranks"][0]["exit_code"] == 1
    assert inc["kind"] == "incident" and inc["incident"] == "inc-001"


def test_the_secrets_to_redact_can_be_given(tmp_path):
    j = Journal(tmp_path, run="r", secrets=["hunter2-and-more"])
    ev = j.append("alert", reason="password hunter2-and-more leaked; xoxp-1-2-3 too")
    assert ev["reason"] == "password [redacted] leaked; [redacted] too"


def test_what_a_restart_replays_is_written_verbatim(tmp_path):
    # a checkpoint path that happens to look like a token must still name the checkpoint when a
    # restarted supervisor replays the observation; the prose around it is redacted
    odd = "/runs/hf_" + "a" * 30 + "/ckpt.pt"
    j = Journal(tmp_path, run="r", secrets=())
    ev = j.append("rollback", reason=f"rolled back to {odd}", obs=[{"type": "X", "path": odd}])
    j.close()
    assert ev["obs"][0]["path"] == odd and odd not in ev["reason"]
    (line,) = read_events(tmp_path)
    assert line["obs"][0]["path"] == odd and "[redacted]" in line["reason"]
    (tmp_path / "journal.jsonl").unlink()  # a made-up observation: not for the replay check
