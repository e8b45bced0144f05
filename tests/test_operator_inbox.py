"""The operator inbox (RUN_DIR/operator/): requests written whole, taken oldest first and removed;
anything else in it is refused with the reason, never acted on, never a crash."""

from __future__ import annotations

import json
import os

import pytest
from spikeguard.supervisor.intake import operator as op


def req(action: str = "ack", **kw) -> op.OperatorRequest:
    return op.OperatorRequest(action=action, who="alice@host", via="cli", **kw)


def test_requests_round_trip_oldest_first_and_are_removed(tmp_path):
    a = op.write_request(tmp_path, req("hold", note="why"))
    choice = op.ResumeChoice(checkpoint="/c/1.pt", lr_scale=0.25, skip_steps=(3, 9))
    b = op.write_request(tmp_path, req("resume", resume=choice))
    assert oct((tmp_path / op.INBOX).stat().st_mode & 0o777) == "0o700"
    assert op.pending_actions(tmp_path) == ["hold", "resume"]
    taken = op.take_requests(tmp_path)
    assert [t.id for t in taken] == [a.id, b.id]
    assert taken[1] == b and taken[1].resume == choice
    assert op.take_requests(tmp_path) == [] and os.listdir(tmp_path / op.INBOX) == []
    obs = op.observation(taken[1])
    assert (obs.checkpoint, obs.lr_scale, obs.skip_steps) == ("/c/1.pt", 0.25, (3, 9))


@pytest.mark.parametrize(
    "content, why",
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (json.dumps({"action": "rm -rf", "who": "x", "via": "cli"}).encode(), "action must"),
        (json.dumps({"action": "ack", "who": "", "via": "cli"}).encode(), "who is missing"),
        (json.dumps({"action": "ack", "who": "x", "via": "cli", "x": 1}).encode(), "unknown"),
        (
            json.dumps(
                {"action": "resume", "who": "x", "via": "cli", "resume": {"lr_scale": 1e9}}
            ).encode(),
            "lr_scale must be in",
        ),
        (b"x" * (op.MAX_REQUEST_BYTES + 1), "more than"),
    ],
)
def test_what_is_not_a_request_is_refused_with_its_reason_and_removed(tmp_path, content, why):
    inbox = tmp_path / op.INBOX
    inbox.mkdir()
    (inbox / "1-bad.json").write_bytes(content)
    (taken,) = op.take_requests(tmp_path)
    assert isinstance(taken, op.Refused) and why in taken.reason, taken
    assert os.listdir(inbox) == []


def test_a_symlink_or_a_half_written_file_is_never_read(tmp_path):
    inbox = tmp_path / op.INBOX
    inbox.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"action": "stop", "who": "x", "via": "cli"}))
    (inbox / "1-link.json").symlink_to(secret)
    (inbox / ".2-temp.json.tmp").write_text("{")  # a writer's temp file: not taken
    (taken,) = op.take_requests(tmp_path)
    assert isinstance(taken, op.Refused) and "unreadable" in taken.reason
    assert secret.exists() and os.listdir(inbox) == [".2-temp.json.tmp"]


def test_the_journals_latest_answer_is_found_and_a_pending_one_is_marked():
    evs = [
        {"kind": "operator", "request": "r1", "code": "resume_asked"},
        {"kind": "launch"},
        {"kind": "operator", "request": "r1", "code": "operator_resumed"},
    ]
    assert op.answer_in(evs[:1], "r1")["code"] in op.PENDING_CODES
    assert op.answer_in(evs, "r1")["code"] == "operator_resumed"
    assert op.answer_in(evs, "r2") is None


def test_who_comes_from_the_environment():
    assert op.who_from_env({"SPIKEGUARD_OPERATOR": " bob "}) == "bob"
    assert "@" in op.who_from_env({})
