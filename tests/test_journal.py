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
