"""Rebuilding the recovery state after a restart is replaying the journal through the machine.

Every journal a supervised test run writes is checked the same way after its test (the autouse
fixture in conftest.py); here: the recorded runs under tests/data, and a journal cut at every
event (the supervisor died right after writing it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_journal_replays, read_jsonl
from spikeguard.supervisor.decide import recovery as rc

DATA = Path(__file__).parent / "data"
JOURNALS = sorted(DATA.rglob("journal.jsonl"))


def test_there_are_recorded_journals():
    assert len(JOURNALS) >= 2


@pytest.mark.parametrize("path", JOURNALS, ids=lambda p: str(p.relative_to(DATA)))
def test_a_recorded_journal_replays_to_the_live_state_at_every_transition(path):
    assert assert_journal_replays(path) >= 2


@pytest.mark.parametrize("path", JOURNALS, ids=lambda p: str(p.relative_to(DATA)))
def test_a_journal_cut_anywhere_folds_to_a_state_the_machine_continues_from(path):
    evs = read_jsonl(path)
    final = rc.fold(evs)
    assert final.phase in rc.TERMINAL  # the recordings are finished runs
    for i in range(len(evs) + 1):
        st = rc.fold(evs[:i])
        # a restarted supervisor takes over: the machine answers with the effect that continues
        # the run (or, finished or holding, with nothing), never with an error
        t = rc.step(st, rc.Restarted(rc.Settings(), highest_generation=st.max_generation))
        if st.phase in rc.TERMINAL:
            assert t.state == st and t.effects == ()
        else:
            assert t.effects, f"cut after event {i}: {st.phase} has nothing to do on restart"


def test_a_tampered_digest_is_caught(tmp_path):
    evs = read_jsonl(JOURNALS[0])
    i = next(i for i, e in enumerate(evs) if "obs" in e and e["kind"] == "rollback")
    evs[i]["obs"][-1]["grade"] = 3  # the rollback target's grade, as if another one was chosen
    evs[i]["obs"][-1]["path"] = "/elsewhere.pt"
    bad = tmp_path / "journal.jsonl"
    bad.write_text("".join(json.dumps(e) + "\n" for e in evs))
    with pytest.raises(AssertionError, match="replaying up to event"):
        assert_journal_replays(bad)
    bad.unlink()  # the autouse check must not see it
