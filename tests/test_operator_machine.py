"""A human's hand in the recovery machine: ack, hold, resume, stop (pure; each run folded back
from its journal after every transition, so a restarted supervisor replays the operator's
actions exactly)."""

from __future__ import annotations

from spikeguard.supervisor.decide import recovery as rc
from test_faults_fold import Run, ckpt, launched, recover

HOLD = rc.Settings(probation_steps=100, max_attempts=1, on_exhausted="hold")
STOP = rc.Settings(probation_steps=100, max_attempts=1)


def op(action: str, **kw: object) -> rc.Operator:
    return rc.Operator(action, "alice@host", "cli", note="on call", request="r1", **kw)  # type: ignore[arg-type]


def running() -> Run:
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    assert r.state.phase is rc.Phase.RUNNING
    return r


def exhausted(settings: rc.Settings) -> Run:
    """A run whose one attempt failed its probation: held, or escalated (exit 3)."""
    r = running()
    for obs in (recover(250, settings=settings), rc.Killed((0, 1), 0.1), ckpt(200), launched(2)):
        r.feed(obs)
    r.feed(recover(270, rule="grade-drop", settings=settings))
    return r


def last(r: Run) -> dict:
    return r.journal[-1]


def test_ack_names_who_and_marks_the_incident():
    r = running()
    r.feed(recover(250))
    t = r.feed(op("ack"))
    ev = t.events[0]
    assert ev["kind"] == "operator" and ev["code"] == "acknowledged"
    assert ev["incident"] == "inc-001" and ev["who"] == "alice@host" and ev["request"] == "r1"
    assert r.state.incident is not None and r.state.incident.acknowledged_by == "alice@host"


def test_ack_without_an_incident_or_of_an_unknown_one_is_refused():
    r = running()
    t = r.feed(op("ack"))
    assert t.events[0]["code"] == "operator_refused"
    assert "no incident" in t.events[0]["reason"]
    r.feed(recover(250))
    t = r.feed(op("ack", incident="inc-007"))
    assert t.events[0]["code"] == "operator_refused" and "inc-007" in t.events[0]["reason"]


def test_hold_makes_the_next_recover_decision_kill_and_wait_instead_of_rolling_back():
    r = running()
    r.feed(op("hold"))
    assert last(r)["code"] == "hold_set" and r.state.hold == "alice@host"
    t = r.feed(recover(250))
    assert r.state.phase is rc.Phase.HOLDING
    assert [e["kind"] for e in t.events] == ["incident", "operator"]
    assert t.events[1]["code"] == "recovery_held"
    assert [type(e) for e in t.effects] == [rc.Kill]  # no SelectCheckpoint: no rollback
    # a second hold on a held run is refused
    assert r.feed(op("hold")).events[0]["code"] == "operator_refused"


def test_hold_in_probation_holds_at_the_failed_attempt():
    r = running()
    for obs in (recover(250), rc.Killed((0, 1), 0.1), ckpt(200), launched(2), op("hold")):
        r.feed(obs)
    assert r.state.phase is rc.Phase.PROBATION
    t = r.feed(recover(260))
    assert [e["kind"] for e in t.events] == ["probation_failed", "operator"]
    assert r.state.phase is rc.Phase.HOLDING


def test_resume_of_a_held_run_verifies_the_choice_then_relaunches_with_the_humans_settings():
    r = exhausted(HOLD)
    assert r.state.phase is rc.Phase.HOLDING
    scale_before = r.state.lr_scale
    t = r.feed(op("resume", checkpoint="/c/200.pt", lr_scale=0.25, reset_optimizer=True))
    assert r.state.phase is rc.Phase.OPERATOR_RESUME
    assert t.events[0]["code"] == "resume_asked" and t.events[0]["checkpoint"] == "/c/200.pt"
    (select,) = t.effects
    assert isinstance(select, rc.SelectCheckpoint) and select.exact == "/c/200.pt"
    t = r.feed(ckpt(200))
    ev = t.events[0]
    assert ev["code"] == "operator_resumed" and ev["lr_scale"] == 0.25
    assert ev["lr_scale_before"] == scale_before and ev["reset_optimizer"] is True
    assert "alice@host" in ev["reason"] and "step 200" in ev["reason"]
    (launch,) = t.effects
    assert isinstance(launch, rc.Launch)
    assert launch.plan.lr_scale == 0.25 and launch.plan.reset_optimizer
    assert launch.plan.checkpoint == "/c/200.pt"
    r.feed(launched(3))
    assert r.state.phase is rc.Phase.PROBATION and r.state.incident is not None
    r.feed(rc.Progress(301))
    assert r.state.phase is rc.Phase.RUNNING and last(r)["kind"] == "probation_passed"


def test_resume_of_an_escalated_run_reopens_it_and_a_refused_choice_escalates_again():
    r = exhausted(STOP)
    assert r.state.phase is rc.Phase.ESCALATED and r.state.exit_code == 3
    r.feed(op("resume", checkpoint="/c/999.pt"))
    assert r.state.phase is rc.Phase.OPERATOR_RESUME and r.state.exit_code is None
    t = r.feed(rc.CheckpointChosen(None, skipped=(("/c/999.pt", "no such checkpoint"),)))
    assert t.events[0]["code"] == "operator_refused"
    assert "no such checkpoint" in str(t.events[0]["skipped"])
    assert r.state.phase is rc.Phase.ESCALATED and r.state.exit_code == 3
    assert t.effects == (rc.Shutdown(3),)
    # the newest healthy one instead: the rollback's own choice
    t = r.feed(op("resume", lr_factor=0.5))
    (select,) = t.effects
    assert select.exact is None and select.min_grade == STOP.min_grade
    t = r.feed(ckpt(200))
    assert t.events[0]["lr_scale"] == r.state.lr_scale
    assert r.state.phase is rc.Phase.RELAUNCHING


def test_resume_on_a_training_run_lifts_a_hold_and_refuses_settings():
    r = running()
    assert r.feed(op("resume")).events[0]["code"] == "operator_refused"
    r.feed(op("hold"))
    t = r.feed(op("resume", lr_scale=0.5))
    assert t.events[0]["code"] == "operator_refused" and r.state.hold is not None
    t = r.feed(op("resume"))
    assert t.events[0]["code"] == "hold_released" and r.state.hold is None
    r.feed(recover(250))
    assert r.state.phase is rc.Phase.KILLING  # automatic recovery again


def test_stop_by_a_human_says_who_then_stops():
    r = running()
    t = r.feed(op("stop"))
    assert [e["kind"] for e in t.events] == ["operator", "stopped"]
    assert "alice@host" in t.events[1]["reason"]
    assert r.state.phase is rc.Phase.STOPPED
    assert r.feed(op("stop")).events[0]["code"] == "operator_refused"


def test_a_supervisor_restarted_mid_resume_verifies_the_same_choice_again():
    r = exhausted(HOLD)
    r.feed(op("resume", checkpoint="/c/200.pt", lr_scale=0.25))
    folded = rc.fold(r.journal)
    assert folded == r.state  # the request is in the journal with its choice
    t = rc.step(folded, rc.Restarted(STOP))
    (select,) = t.effects
    assert select.exact == "/c/200.pt"
