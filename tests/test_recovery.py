"""The recovery state machine, one transition at a time, no Ray."""

from __future__ import annotations

import pytest
from spikeguard.supervisor.decide import recovery as rc

S = rc.Settings(
    lr_factors=(0.5, 0.3), probation_steps=1000, max_attempts=2, min_grade=4, min_steps_back=50
)


def running() -> rc.State:
    t = rc.step(rc.State(), rc.Launched(1))
    assert t.state.phase is rc.Phase.RUNNING and t.state.generation == 1
    assert [e["kind"] for e in t.events] == ["launch"]
    return t.state


def recover(step: int = 1200, settings: rc.Settings = S) -> rc.Recover:
    return rc.Recover(
        rule="loss_spike", reason="loss 9.1 > 1.5x median 2.1", step=step, settings=settings
    )


def kinds(t: rc.Transition) -> list[str]:
    return [e["kind"] for e in t.events]


def test_recover_decision_starts_incident_and_kills():
    t = rc.step(running(), recover())
    assert t.state.phase is rc.Phase.KILLING
    assert kinds(t) == ["incident"]
    assert t.events[0]["incident"] == "inc-001" and t.events[0]["attempt"] == 1
    assert [type(e) for e in t.effects] == [rc.Kill]


def test_killed_asks_for_checkpoint_before_incident_minus_steps_back():
    s = rc.step(running(), recover(1200)).state
    t = rc.step(s, rc.Killed((0, 1), 0.4))
    assert t.state.phase is rc.Phase.ROLLING_BACK
    assert kinds(t) == ["kill"] and t.events[0]["ranks"] == [0, 1]
    # only checkpoints on the lineage of generation 1 (launched from scratch) qualify
    assert t.effects == (
        rc.SelectCheckpoint(min_grade=4, before_step=1200, min_steps_back=50, lineage=((1, None),)),
    )


def to_rolling_back() -> rc.State:
    s = rc.step(running(), recover(1200)).state
    return rc.step(s, rc.Killed((0, 1), 0.1)).state


def test_checkpoint_chosen_cuts_lr_resets_optimizer_and_launches_next_generation():
    t = rc.step(
        to_rolling_back(),
        rc.CheckpointChosen(
            "/c/1000.pt",
            step=1000,
            sha256="ab",
            grade=6,
            skipped=(("/c/1100.pt", "sha256 mismatch"),),
        ),
    )
    assert t.state.phase is rc.Phase.RELAUNCHING
    assert kinds(t) == ["rollback", "lr_cut", "optimizer_reset"]
    assert (
        t.events[0]["checkpoint_step"] == 1000
        and t.events[0]["skipped"][0]["reason"] == "sha256 mismatch"
    )
    (launch,) = t.effects
    assert isinstance(launch, rc.Launch)
    assert launch.plan.checkpoint == "/c/1000.pt" and launch.plan.sha256 == "ab"
    assert launch.plan.lr_scale == pytest.approx(0.5) and launch.plan.reset_optimizer
    assert launch.plan.generation == 2 and launch.plan.checkpoint_step == 1000


def test_no_optimizer_reset_event_when_disabled():
    s = rc.step(running(), recover(1200, rc.Settings(reset_optimizer=False))).state
    s = rc.step(s, rc.Killed((0,), 0.1)).state
    t = rc.step(s, rc.CheckpointChosen("/c.pt", step=1000, grade=5))
    assert kinds(t) == ["rollback", "lr_cut"]
    assert not t.effects[0].plan.reset_optimizer


def test_skip_window_covers_incident_data_but_not_before_checkpoint():
    s = rc.step(running(), recover(1200, rc.Settings(skip_window=100))).state
    s = rc.step(s, rc.Killed((0,), 0.1)).state
    plan = rc.step(s, rc.CheckpointChosen("/c.pt", step=1150, grade=5)).effects[0].plan
    assert plan.skip_ranges == ((1151, 1200),)


def test_no_healthy_checkpoint_escalates_and_shuts_down():
    t = rc.step(
        to_rolling_back(), rc.CheckpointChosen(None, skipped=(("/c/1.pt", "grade S2 < S4"),))
    )
    assert t.state.phase is rc.Phase.ESCALATED and t.state.exit_code == 3
    assert kinds(t) == ["rollback", "escalated"]
    assert t.effects == (rc.Shutdown(3),)


def to_probation() -> rc.State:
    s = rc.step(to_rolling_back(), rc.CheckpointChosen("/c.pt", step=1000, grade=6)).state
    t = rc.step(s, rc.Launched(2))
    assert kinds(t) == ["launch", "probation_start"]
    assert t.events[1]["from_step"] == 1001 and t.events[1]["until_step"] == 2001
    return t.state


def test_launched_enters_probation():
    s = to_probation()
    assert s.phase is rc.Phase.PROBATION and s.generation == 2 and s.probation_until == 2001


def test_probation_passes_only_at_the_window_end():
    s = to_probation()
    t = rc.step(s, rc.Progress(2000))
    assert t.state.phase is rc.Phase.PROBATION and kinds(t) == ["probation_progress"]
    assert t.events[0]["reason"] == "probation 90% done: step 2000 of 1001..2001"
    assert rc.step(t.state, rc.Progress(2000)).events == ()  # each tenth is reported once
    t = rc.step(s, rc.Progress(2001))
    assert t.state.phase is rc.Phase.RUNNING and kinds(t) == ["probation_passed"]
    assert t.state.incident is None and t.state.lr_scale == pytest.approx(0.5)


def test_second_drop_in_probation_fails_it_and_compounds_lr():
    s = to_probation()
    t = rc.step(s, recover(1500))
    assert kinds(t) == ["probation_failed", "incident"]
    assert t.events[1]["incident"] == "inc-001" and t.events[1]["attempt"] == 2
    s = rc.step(t.state, rc.Killed((0, 1), 0.1)).state
    t = rc.step(s, rc.CheckpointChosen("/c.pt", step=1000, grade=6))
    assert t.effects[0].plan.lr_scale == pytest.approx(0.5 * 0.3)
    assert t.effects[0].plan.generation == 3


def test_budget_exhausted_escalates():
    s = to_probation()
    s = rc.step(s, recover(1500)).state
    s = rc.step(s, rc.Killed((0,), 0.1)).state
    s = rc.step(s, rc.CheckpointChosen("/c.pt", step=1000, grade=6)).state
    s = rc.step(s, rc.Launched(3)).state
    t = rc.step(s, recover(1400))
    assert kinds(t) == ["probation_failed", "escalated"]
    assert t.state.phase is rc.Phase.ESCALATED and t.state.exit_code == 3
    assert isinstance(t.effects[0], rc.Kill) and t.effects[-1] == rc.Shutdown(3)


def test_budget_exhausted_can_hold_instead():
    hold = rc.Settings(max_attempts=1, on_exhausted="hold")
    s = rc.step(running(), recover(1200, hold)).state
    s = rc.step(s, rc.Killed((0,), 0.1)).state
    s = rc.step(s, rc.CheckpointChosen("/c.pt", step=1000, grade=6)).state
    s = rc.step(s, rc.Launched(2)).state
    t = rc.step(s, recover(1300, hold))
    assert t.state.phase is rc.Phase.HOLDING and t.events[-1]["hold"] is True
    assert not any(isinstance(e, rc.Shutdown) for e in t.effects)


def test_a_later_incident_after_passing_is_new_and_keeps_the_lr_scale():
    s = rc.step(to_probation(), rc.Progress(2001)).state
    t = rc.step(s, recover(2600))
    assert t.events[0]["incident"] == "inc-002" and t.events[0]["attempt"] == 1
    s = rc.step(t.state, rc.Killed((0,), 0.1)).state
    plan = rc.step(s, rc.CheckpointChosen("/c.pt", step=2500, grade=6)).effects[0].plan
    assert plan.lr_scale == pytest.approx(0.5 * 0.5)


def test_finish_during_probation_passes_then_completes():
    t = rc.step(to_probation(), rc.Finished(2.05))
    assert kinds(t) == ["probation_passed", "completed"]
    assert t.state.phase is rc.Phase.COMPLETED and t.state.exit_code == 0
    assert t.events[-1]["final_loss"] == 2.05


def test_failure_and_stop_are_terminal_and_absorbing():
    t = rc.step(running(), rc.RankExited(rank=1, generation=1, code=1))
    assert t.state.phase is rc.Phase.FAILED and kinds(t) == ["failed"]
    assert rc.step(t.state, recover()).state is t.state
    t = rc.step(running(), rc.StopRequested("user"))
    assert t.state.phase is rc.Phase.STOPPED and kinds(t) == ["stopped"]


def test_observations_out_of_phase_change_nothing():
    s = running()
    for obs in (rc.Killed((0,), 0.1), rc.CheckpointChosen("/c.pt", step=1), rc.Progress(10**6)):
        t = rc.step(s, obs)
        assert t.state == s and t.events == () and t.effects == ()
    # while killing, a recover decision from the dying generation is ignored
    k = rc.step(s, recover()).state
    assert rc.step(k, recover(1300)).state == k


def test_lr_factor_last_one_repeats():
    st = rc.Settings(lr_factors=(0.5, 0.3))
    assert [rc.lr_factor(st, i) for i in range(4)] == [0.5, 0.3, 0.3, 0.3]


def test_too_many_incidents_in_one_run_escalate_at_once():
    capped = rc.Settings(max_incidents=2, probation_steps=10)
    s = running()
    for n, at in enumerate((100, 300), start=1):  # two incidents, each recovered and passed
        s = rc.step(s, recover(at, capped)).state
        s = rc.step(s, rc.Killed((0,), 0.1)).state
        s = rc.step(s, rc.CheckpointChosen("/c.pt", step=at - 50, grade=6)).state
        s = rc.step(s, rc.Launched(n + 1)).state
        s = rc.step(s, rc.Progress(at + 100)).state
        assert s.phase is rc.Phase.RUNNING and s.incidents_seen == n
    t = rc.step(s, recover(500, capped))
    assert kinds(t)[-1] == "escalated" and "max_incidents 2" in t.events[-1]["reason"]
    assert t.state.phase is rc.Phase.ESCALATED
