"""The machine on crashes, hangs, preemption and requests to the ranks: one transition at a time,
no Ray. Every journaled transition is also checked to fold back to the live state (Run)."""

from __future__ import annotations

import pytest
from spikeguard.supervisor.decide import recovery as rc
from test_faults_fold import Run, ckpt, launched, recover

CRASH = rc.Settings(
    min_grade=4, min_steps_back=200, lr_factors=(1.0,), reset_optimizer=False, max_attempts=3
)


def crash(step: int, furthest: int | None = None) -> rc.Recover:
    return rc.Recover("crash", "rank 1 exited 9", step, CRASH, fault=True, furthest_step=furthest)


def running() -> Run:
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    return r


def test_a_crash_rolls_back_whatever_the_grade_to_the_furthest_step_any_rank_reached():
    r = running()
    r.feed(crash(243, furthest=251))  # the dead rank last said 243; its peer got to 251
    t = r.feed(rc.Killed((0, 1), 0.1))
    (select,) = t.effects
    # no min_grade, no min_steps_back: a crash is not a numerical incident
    assert select == rc.SelectCheckpoint(None, 251, 0, ((1, None),), True)
    t = r.feed(ckpt(250, grade=2))  # an S2 checkpoint is fine for a crash
    (launch,) = t.effects
    assert launch.plan.checkpoint_step == 250 and launch.plan.lr_scale == 1.0
    assert launch.backoff_attempt == 1  # a crash loop waits; see below for numerical incidents
    assert "any grade" in r.journal[-2]["reason"] and r.journal[-2]["code"] == "checkpoint_chosen"


def test_a_crash_before_any_checkpoint_starts_over_from_step_0_within_the_budget():
    r = running()
    r.feed(crash(30))
    r.feed(rc.Killed((0, 1), 0.1))
    t = r.feed(rc.CheckpointChosen(None))
    (launch,) = t.effects
    assert launch.plan.checkpoint is None and launch.plan.start_step == 0
    assert launch.plan.generation == 2 and r.state.phase is rc.Phase.RELAUNCHING
    rollback = next(e for e in r.journal if e["kind"] == "rollback")
    assert rollback["code"] == "restart_from_start" and "step 0" in rollback["reason"]
    r.feed(launched(2))
    assert r.state.phase is rc.Phase.PROBATION and r.state.incident.attempts == 1
    # crashing again in probation spends the budget like any failed attempt
    for gen in (3, 4):
        r.feed(crash(20 * gen))
        r.feed(rc.Killed((0, 1), 0.1))
        r.feed(rc.CheckpointChosen(None))
        r.feed(launched(gen))
    t = r.feed(crash(90))
    assert r.kinds()[-1] == "escalated" and "budget of 3 attempts" in r.journal[-1]["reason"]


def test_a_numerical_incident_relaunches_without_backoff_and_escalates_without_a_checkpoint():
    r = running()
    r.feed(recover(500))
    t = r.feed(rc.Killed((0, 1), 0.1))
    assert t.effects[0].min_grade == 4  # the policy's grade rule holds for numerical incidents
    t = r.feed(ckpt(300))
    assert t.effects[0].backoff_attempt == 0
    r2 = running()
    r2.feed(recover(500))
    r2.feed(rc.Killed((0, 1), 0.1))
    r2.feed(rc.CheckpointChosen(None))
    assert r2.state.phase is rc.Phase.ESCALATED
    assert r2.journal[-1]["code"] == "no_healthy_checkpoint"


def test_a_corrupt_checkpoint_escalates_when_the_policy_does_not_fall_back():
    no_fallback = rc.Settings(fallback_on_corrupt=False)
    r = running()
    r.feed(rc.Recover("loss-spike", "x", 500, no_fallback))
    t = r.feed(rc.Killed((0, 1), 0.1))
    assert t.effects[0].fallback_on_corrupt is False
    r.feed(
        rc.CheckpointChosen(
            None, skipped=(("/c/400.pt", "failed verification: sha"),), corrupt="/c/400.pt"
        )
    )
    assert r.state.phase is rc.Phase.ESCALATED
    esc = r.journal[-1]
    assert esc["code"] == "corrupt_checkpoint" and "/c/400.pt" in esc["reason"]
    assert "fallback_on_corrupt: false" in esc["reason"]


def test_a_checkpoint_rule_asks_the_ranks_for_a_checkpoint():
    r = running()
    t = r.feed(rc.CheckpointWanted("max_logit grew 3x", details={"rule": "logit-growth"}))
    assert t.effects == (rc.RequestCheckpoint(1, "policy: logit-growth"),)
    assert r.kinds()[-1] == "alert" and r.journal[-1]["request_id"] == 1
    t = r.feed(rc.CheckpointWanted("again", details={"rule": "logit-growth"}))
    assert t.effects[0].request_id == 2 and r.state.phase is rc.Phase.RUNNING


def preempted_run(saved: bool = True) -> Run:
    r = running()
    r.feed(recover(250))
    r.feed(rc.Killed((0, 1), 0.1))
    r.feed(ckpt(200))
    r.feed(launched(2))  # probation from 201, LR x0.5, one attempt spent
    t = r.feed(rc.Preempt("SIGTERM"))
    assert r.state.phase is rc.Phase.PREEMPTING
    assert t.effects == (rc.RequestCheckpoint(1, "SIGTERM", wait=True),)
    if saved:
        t = r.feed(rc.CheckpointSaved(1, "/c/230.pt", 230))
        assert isinstance(t.effects[0], rc.Kill)
    else:  # the ranks are killed, then the newest usable checkpoint is named
        kill, select = r.feed(rc.GraceExpired(1)).effects
        assert isinstance(kill, rc.Kill) and isinstance(select, rc.SelectCheckpoint)
        t = r.feed(ckpt(200))
    assert r.state.phase is rc.Phase.PREEMPTED and r.state.exit_code == 143
    assert t.effects[-1] == rc.Shutdown(143)
    return r


@pytest.mark.parametrize("saved", [True, False])
def test_preemption_asks_for_an_emergency_checkpoint_then_stops_resumably(saved):
    r = preempted_run(saved)
    pre = r.journal[-1]
    assert pre["kind"] == "preempted" and pre["interrupted"] == "PROBATION"
    assert pre["checkpoint_step"] == (230 if saved else None)
    assert pre["resume_step"] == (230 if saved else 200)
    assert rc.Phase.PREEMPTED not in rc.TERMINAL  # a preempted run is not finished


def test_an_old_answer_does_not_end_the_preemption():
    r = running()
    r.feed(rc.CheckpointWanted("x", details={"rule": "r"}))  # request 1
    r.feed(rc.Preempt("SIGTERM"))  # request 2
    r.feed(rc.CheckpointSaved(1, "/c/10.pt", 10))
    assert r.state.phase is rc.Phase.PREEMPTING
    r.feed(rc.CheckpointSaved(2, "/c/12.pt", 12))
    assert r.state.phase is rc.Phase.PREEMPTED


def test_a_resumed_preemption_keeps_the_incident_budget_lr_and_lineage():
    r = preempted_run(saved=True)
    folded = rc.fold(r.journal)
    assert folded.phase is rc.Phase.PREEMPTED
    t = rc.step(folded, rc.Restarted(rc.Settings(min_grade=6), highest_generation=2))
    assert t.state.phase is rc.Phase.RESUMING and t.state.resume_to is rc.Phase.PROBATION
    # the emergency checkpoint counts whatever its grade (min_grade None)
    assert t.effects == (rc.SelectCheckpoint(None, None, 0, ((1, None), (2, 200))),)
    t2 = rc.step(t.state, ckpt(230, grade=3))
    (launch,) = t2.effects
    assert launch.plan.checkpoint_step == 230 and launch.plan.generation == 3
    assert launch.plan.lr_scale == pytest.approx(0.5)
    assert t2.events[0]["kind"] == "resume" and t2.events[0]["code"] == "resume_after_preemption"
    t3 = rc.step(t2.state, launched(3))
    st = t3.state
    assert st.phase is rc.Phase.PROBATION and st.incident.id == "inc-001"
    assert st.incident.attempts == 1 and st.lineage[-1] == (3, 230)
    assert st.preempted_from is None and st.exit_code is None


def test_a_preemption_mid_recovery_resumes_the_recovery():
    r = running()
    r.feed(recover(250))
    r.feed(rc.Killed((0, 1), 0.1))
    t = r.feed(rc.Preempt("SIGTERM"))  # while rolling back: nothing to save
    assert r.state.phase is rc.Phase.PREEMPTED and r.journal[-1]["interrupted"] == "ROLLING_BACK"
    assert r.journal[-1]["code"] == "preempted_without_checkpoint"
    folded = rc.fold(r.journal)
    t = rc.step(folded, rc.Restarted(rc.Settings()))
    assert t.state.phase is rc.Phase.ROLLING_BACK and isinstance(t.effects[0], rc.SelectCheckpoint)
    assert t.effects[0].before_step == 250 and t.effects[0].min_grade == 4


def test_a_run_that_finishes_during_the_grace_period_is_completed():
    r = running()
    r.feed(rc.Preempt("SIGTERM"))
    r.feed(rc.Finished(1.2))
    assert r.state.phase is rc.Phase.COMPLETED and r.state.exit_code == 0
