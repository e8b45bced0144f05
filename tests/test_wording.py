"""The describer: the machine's events are typed, their prose comes from one place."""

from __future__ import annotations

import json

from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.decide import wording
from spikeguard.supervisor.decide.events import Code, Kind, MachineEvent


def running() -> rc.State:
    return rc.step(rc.State(), rc.Launched(1)).state


def test_a_record_has_the_journals_keys_in_order_and_no_context():
    ev = MachineEvent(
        Kind.STOPPED, Code.STOP_REQUESTED, "inc-001", {"extra": 1}, {"reason": "asked to stop"}
    )
    record = wording.to_record(ev)
    assert json.dumps(record, sort_keys=False) == json.dumps(
        {
            "kind": "stopped",
            "code": "stop_requested",
            "reason": "asked to stop",
            "incident": "inc-001",
            "extra": 1,
        }
    )


def test_a_teardown_exit_is_worded_as_before():
    t = rc.step(running(), rc.RankExited(rank=2, generation=1, code=0, teardown_code=139))
    (ev,) = t.events
    assert ev["code"] == "teardown_exit"
    assert ev["reason"] == (
        "rank 2 finished training, then exited with code 139 during teardown; counted as finished"
    )


def test_a_resolved_notify_rule_keeps_its_own_reason():
    t = rc.step(running(), rc.Notify("grad norm back under 10", resolved=True, details={"x": 1}))
    (ev,) = t.events
    assert (ev["code"], ev["reason"], ev["resolved"], ev["x"]) == (
        "rule_resolved",
        "grad norm back under 10",
        True,
        1,
    )


def test_giving_up_words_the_event_and_the_kill_from_one_text():
    for hold, event_suffix, kill_suffix in (
        (True, "; holding for a human", "; holding"),
        (False, "", ""),
    ):
        ev = MachineEvent(
            Kind.ESCALATED, Code.BUDGET_SPENT, None, {"hold": hold}, {"max_attempts": 2}
        )
        why = "recovery budget of 2 attempts spent"
        assert wording.describe(ev) == why + event_suffix
        assert wording.kill_reason(ev) == why + kill_suffix


def test_every_escalation_code_is_worded_for_both_its_events():
    """An escalation's reason is also the reason of the event that led to it (a rollback or a
    resume that found nothing): both come from the same function."""
    for code in wording.GIVING_UP:
        assert (Kind.ESCALATED, code) in wording.WORDING
    for kind, code in wording.WORDING:
        if kind in (Kind.ROLLBACK, Kind.RESUME) and code in wording.GIVING_UP:
            assert wording.WORDING[(kind, code)] is wording.GIVING_UP[code]
