"""Batch forensics in the recovery machine: every incident kill asks for the ranks' batch ids,
the file they went to arrives as an observation (``Killed.batch_ids``), and with ``skip_by:
batch_ids`` the relaunch plan skips exactly those batches. Pure, and rebuilt by a replay."""

from __future__ import annotations

from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.decide.recovery import codec
from spikeguard.supervisor.observe.describe import describe

BY_IDS = rc.Settings(skip_window=50, skip_by="batch_ids", max_attempts=2)
FILE = "/runs/r/incidents/inc-001/batch_ids-1.json"


def drive(settings: rc.Settings, batch_ids: str | None) -> tuple[list[rc.Transition], rc.State]:
    """Launch, a recover decision at step 1200, the kill (batch ids filed at ``batch_ids``), a
    checkpoint at step 1000: the transitions and the state after them."""
    state, out = rc.State(), []
    for obs in (
        rc.Launched(1),
        rc.Recover("loss-spike", "loss 9.1", 1200, settings),
        rc.Killed((0, 1), 0.2, batch_ids=batch_ids),
        rc.CheckpointChosen("/c/1000.pt", step=1000, sha256="ab", grade=6),
    ):
        t = rc.step(state, obs)
        out.append(t)
        state = t.state
    return out, state


def test_every_incident_kill_asks_for_the_batch_ids_of_its_attempt():
    (_, incident, killed, _), state = drive(BY_IDS, FILE)
    (kill,) = incident.effects
    assert kill == rc.Kill("incident inc-001: loss-spike", batch_ids_for=("inc-001", 1))
    assert killed.state.incident is not None and killed.state.incident.batch_ids == FILE
    # a failed probation is attempt 2: its kill asks again, for a file of its own
    state = rc.step(state, rc.Launched(2)).state
    t = rc.step(state, rc.Recover("loss-spike", "again", 1300, BY_IDS))
    assert t.effects == (rc.Kill("incident inc-001: loss-spike", batch_ids_for=("inc-001", 2)),)
    # the budget is spent: nothing will be relaunched, the escalation ends the journal
    state = rc.step(t.state, rc.Killed((0, 1), 0.1)).state
    state = rc.step(state, rc.CheckpointChosen("/c/1000.pt", step=1000, grade=6)).state
    state = rc.step(state, rc.Launched(3)).state
    t = rc.step(state, rc.Recover("loss-spike", "third", 1400, BY_IDS))
    assert [e["kind"] for e in t.events] == ["probation_failed", "escalated"]
    assert t.effects[0] == rc.Kill("recovery budget of 2 attempts spent")
    # kills that are not an incident attempt's do not ask either
    stop = rc.step(rc.step(rc.State(), rc.Launched(1)).state, rc.StopRequested("by user"))
    assert stop.effects[0] == rc.Kill("by user")


def test_skip_by_batch_ids_hands_the_file_and_the_window_to_the_relaunch():
    transitions, _ = drive(BY_IDS, FILE)
    rollback = transitions[-1]
    plan = rollback.effects[0].plan
    assert plan.skip_batches == FILE and plan.skip_batches_steps == (1151, 1200)
    assert plan.skip_ranges == ()  # not the steps: the batches, wherever they come again
    ev = rollback.events[0]
    assert ev["skip_batches"] == FILE and ev["skip_batches_steps"] == [1151, 1200]
    assert describe(ev).endswith("the batches of steps 1,151–1,200 will be skipped by their ids")


def test_without_batch_ids_on_file_or_by_steps_the_window_s_steps_are_skipped():
    for settings, filed in ((BY_IDS, None), (rc.Settings(skip_window=50), FILE)):
        transitions, _ = drive(settings, filed)
        plan = transitions[-1].effects[0].plan
        assert plan.skip_ranges == ((1151, 1200),) and plan.skip_batches is None
        assert "skip_batches" not in transitions[-1].events[0]


def test_a_restart_keeps_skipping_the_batches_and_the_journal_replays():
    transitions, state = drive(BY_IDS, FILE)
    state = rc.step(state, rc.Launched(2)).state
    restarted = rc.step(state, rc.Restarted(rc.Settings(), highest_generation=2))
    resumed = rc.step(
        restarted.state, rc.CheckpointChosen("/c/1100.pt", step=1100, sha256="cd", grade=6)
    )
    plan = resumed.effects[0].plan
    assert plan.skip_batches == FILE and plan.skip_batches_steps == (1151, 1200)
    # what the journal records rebuilds the same state (Killed.batch_ids included)
    events = [e for t in (*transitions, resumed) for e in t.events]
    obs = [codec.decode(o) for e in events for o in e.get("obs", ())]
    assert rc.Killed((0, 1), 0.2, batch_ids=FILE) in obs
    folded = rc.fold([e for t in transitions for e in t.events])
    assert rc.state_digest(folded) == rc.state_digest(transitions[-1].state)
