"""Escalation is written once: every way automatic recovery gives up honours ``on_exhausted``.

Before, only a spent budget (and its kin: too many incidents, a recurring fault) could hold;
nothing to roll back to, a corrupt checkpoint with ``fallback_on_corrupt: false`` and a restart
whose generation's checkpoint no longer verifies always stopped the job, whatever the policy
said. Every transition here is also folded back from its journal (:class:`Run`).
"""

from __future__ import annotations

import pytest
from spikeguard.supervisor.decide import recovery as rc
from test_faults_fold import Run, ckpt, launched, recover

STOP = rc.Settings(probation_steps=100, max_attempts=2)
HOLD = rc.Settings(probation_steps=100, max_attempts=2, on_exhausted="hold")


def killed_for_incident(settings: rc.Settings) -> Run:
    """A run whose first incident's ranks are dead: the machine is choosing a checkpoint."""
    r = Run()
    for obs in (rc.Start(), launched(1), recover(250, settings=settings), rc.Killed((0, 1), 0.1)):
        r.feed(obs)
    assert r.state.phase is rc.Phase.ROLLING_BACK
    return r


def resumed_from_a_checkpoint(settings: rc.Settings) -> Run:
    """A run that recovered from a checkpoint and passed probation (no incident open)."""
    r = killed_for_incident(settings)
    for obs in (ckpt(200), launched(2), rc.Progress(301)):
        r.feed(obs)
    assert r.state.phase is rc.Phase.RUNNING and r.state.incident is None
    assert r.state.plan is not None and r.state.plan.checkpoint == "/c/200.pt"
    return r


NO_CHECKPOINT = rc.CheckpointChosen(None)
CORRUPT = rc.CheckpointChosen(None, corrupt="/c/200.pt")


def assert_holds(r: rc.Transition, run: Run, code: str) -> None:
    escalated = run.journal[-1]
    assert run.state.phase is rc.Phase.HOLDING and run.state.exit_code is None
    assert escalated["kind"] == "escalated" and escalated["hold"] is True
    assert escalated["code"] == code and escalated["reason"].endswith("; holding for a human")
    assert r.effects == ()  # the ranks are dead already: nothing to kill, and no shutdown


def assert_stops(r: rc.Transition, run: Run, code: str) -> None:
    escalated = run.journal[-1]
    assert run.state.phase is rc.Phase.ESCALATED and run.state.exit_code == 3
    assert escalated["kind"] == "escalated" and escalated["hold"] is False
    assert escalated["code"] == code and "holding" not in escalated["reason"]
    assert r.effects == (rc.Shutdown(3),)


@pytest.mark.parametrize(
    "answer, settings, code",
    [
        (NO_CHECKPOINT, HOLD, "no_healthy_checkpoint"),
        (
            CORRUPT,
            rc.Settings(fallback_on_corrupt=False, on_exhausted="hold"),
            "corrupt_checkpoint",
        ),
    ],
    ids=["nothing-qualifies", "corrupt-without-fallback"],
)
def test_a_rollback_with_nothing_to_roll_back_to_holds_when_the_policy_says_hold(
    answer, settings, code
):
    run = killed_for_incident(settings)
    t = run.feed(answer)
    assert run.kinds()[-2:] == ["rollback", "escalated"]
    assert_holds(t, run, code)
    assert run.state.incident is not None and run.state.incident.id == "inc-001"


@pytest.mark.parametrize(
    "answer, settings, code",
    [
        (NO_CHECKPOINT, STOP, "no_healthy_checkpoint"),
        (CORRUPT, rc.Settings(fallback_on_corrupt=False), "corrupt_checkpoint"),
    ],
    ids=["nothing-qualifies", "corrupt-without-fallback"],
)
def test_a_rollback_with_nothing_to_roll_back_to_still_stops_by_default(answer, settings, code):
    run = killed_for_incident(settings)
    assert_stops(run.feed(answer), run, code)


def test_a_restart_whose_checkpoint_is_gone_holds_when_the_policy_says_hold():
    run = resumed_from_a_checkpoint(STOP)
    run.feed(rc.Restarted(HOLD, highest_generation=2))  # the policy's settings (no incident)
    assert run.state.phase is rc.Phase.RESUMING
    t = run.feed(NO_CHECKPOINT)
    assert run.kinds()[-2:] == ["resume", "escalated"]
    assert_holds(t, run, "resume_checkpoint_gone")
    assert run.state.incident is None


def test_a_restart_in_probation_follows_the_incidents_settings_not_the_policys():
    run = killed_for_incident(HOLD)  # the rule's effective settings say hold
    run.feed(ckpt(200))
    run.feed(launched(2))
    assert run.state.phase is rc.Phase.PROBATION
    run.feed(rc.Restarted(STOP, highest_generation=2))
    assert_holds(run.feed(NO_CHECKPOINT), run, "resume_checkpoint_gone")

    run = killed_for_incident(STOP)
    run.feed(ckpt(200))
    run.feed(launched(2))
    run.feed(rc.Restarted(HOLD, highest_generation=2))
    assert_stops(run.feed(NO_CHECKPOINT), run, "resume_checkpoint_gone")


def test_a_restart_whose_checkpoint_is_gone_still_stops_by_default():
    run = resumed_from_a_checkpoint(STOP)
    run.feed(rc.Restarted(STOP, highest_generation=2))
    assert_stops(run.feed(NO_CHECKPOINT), run, "resume_checkpoint_gone")


@pytest.mark.parametrize("path", ["rollback", "resume"])
def test_a_held_run_folds_from_its_journal_and_a_restart_keeps_holding(path):
    if path == "rollback":
        run = killed_for_incident(HOLD)
    else:
        run = resumed_from_a_checkpoint(STOP)
        run.feed(rc.Restarted(HOLD, highest_generation=2))
    run.feed(NO_CHECKPOINT)
    folded = rc.fold(run.journal)
    assert folded == run.state and folded.phase is rc.Phase.HOLDING
    assert rc.state_digest(folded) == run.journal[-2]["state_digest"]
    t = rc.step(folded, rc.Restarted(STOP, highest_generation=folded.max_generation))
    assert t.state.phase is rc.Phase.HOLDING and t.effects == () and t.events == ()
    stopped = rc.step(folded, rc.StopRequested("a human decided"))
    assert stopped.state.phase is rc.Phase.STOPPED


def test_a_spent_budget_still_holds_and_kills_the_training_ranks():
    run = Run()
    hold = rc.Settings(max_attempts=1, on_exhausted="hold", probation_steps=100)
    for obs in (rc.Start(), launched(1), recover(250, settings=hold), rc.Killed((0, 1), 0.1)):
        run.feed(obs)
    run.feed(ckpt(200))
    run.feed(launched(2))
    t = run.feed(recover(260, settings=hold))  # fails probation: the budget of 1 is spent
    assert run.state.phase is rc.Phase.HOLDING
    assert [type(e) for e in t.effects] == [rc.Kill]  # these ranks were training: killed


def test_every_live_phase_has_a_restart_answer():
    from spikeguard.supervisor.decide.recovery.machine import LIVE, RESTART

    # a preempted run restarts as the phase the preemption interrupted
    assert set(RESTART) == set(LIVE) - {rc.Phase.PREEMPTING, rc.Phase.PREEMPTED}


def test_the_machines_settings_are_the_policys():
    from spikeguard.policies import RecoverySettings
    from spikeguard.policies.schema import RecoveryOverrides

    assert issubclass(rc.Settings, RecoverySettings)
    assert rc.Settings().to_dict() == RecoverySettings().model_dump()
    assert list(RecoveryOverrides.model_fields) == list(RecoverySettings.model_fields)
    assert RecoveryOverrides().model_dump() == dict.fromkeys(RecoverySettings.model_fields)
