"""The journal -> state fold, restarts, fail-fast, launch failures and backoff: the pure machine, no
Ray."""

from __future__ import annotations

import json
from typing import Any

import pytest
from spikeguard.supervisor.decide import recovery as rc

S = rc.Settings(lr_factors=(0.5, 0.3), probation_steps=100, max_attempts=2, min_grade=4)
CRASH = rc.Settings(lr_factors=(1.0,), reset_optimizer=False, probation_steps=100, max_attempts=2)
RANKS = (
    {"rank": 0, "pid": 101, "node_id": "n0", "host": "h"},
    {"rank": 1, "pid": 102, "node_id": "n1", "host": "h"},
)


def recover(step: int, rule: str = "loss-spike", settings: rc.Settings = S) -> rc.Recover:
    return rc.Recover(rule=rule, reason=f"{rule} at {step}", step=step, settings=settings)


def ckpt(step: int, grade: int = 6) -> rc.CheckpointChosen:
    return rc.CheckpointChosen(f"/c/{step}.pt", step=step, sha256="ab" * 32, grade=grade)


class Run:
    """Drives the machine like the controller does (effects answered by the script) and journals."""

    def __init__(self) -> None:
        self.state = rc.State()
        self.journal: list[dict[str, Any]] = []
        self.checked = 0

    def feed(self, obs: rc.Observation) -> rc.Transition:
        t = rc.step(self.state, obs)
        self.state = t.state
        # what the journal holds is JSON: fold must work from the round trip
        self.journal += [json.loads(json.dumps(e)) for e in t.events]
        if t.events:
            assert rc.fold(self.journal) == self.state, (
                f"fold differs after {[e['kind'] for e in t.events]}"
            )
            self.checked += 1
        return t

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.journal]


def launched(gen: int) -> rc.Launched:
    return rc.Launched(gen, ranks=RANKS, port=29500 + gen)


def test_fold_equals_the_live_state_after_every_journaled_transition():
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    r.feed(recover(250))  # inc-001
    r.feed(rc.Killed((0, 1), 0.2, forced=(1,)))
    r.feed(ckpt(200))
    r.feed(launched(2))
    r.feed(rc.LaunchFailed("rank 1 exited 1 before its first heartbeat", rank=1, exit_code=1))
    r.feed(rc.Killed((0, 1), 0.1))  # ignored while relaunching
    r.feed(launched(3))
    r.feed(recover(260))  # probation fails: attempt 2
    r.feed(rc.Killed((0, 1), 0.1))
    r.feed(ckpt(200))
    r.feed(launched(4))
    r.feed(rc.Progress(301))  # passes
    r.feed(recover(900, rule="crash", settings=CRASH))  # inc-002
    r.feed(rc.Killed((0, 1), 0.1, unreachable=(0,)))
    r.feed(ckpt(880))
    r.feed(launched(5))
    r.feed(rc.Finished(1.5))
    assert r.state.phase is rc.Phase.COMPLETED and r.checked >= 15
    assert r.state.lr_scale == pytest.approx(0.5 * 0.3) and r.state.incidents_seen == 2
    kill = next(e for e in r.journal if e["kind"] == "kill" and e["unreachable"])
    assert kill["unreachable"] == [0] and "unreachable" in kill["reason"]
    first = r.journal[0]
    assert first["kind"] == "launch" and first["pids"] == [101, 102] and first["cause"] == "initial"


@pytest.mark.parametrize(
    "end", ["escalated", "hold", "no_checkpoint", "stopped", "failed", "launch_gave_up"]
)
def test_fold_of_every_terminal_outcome(end):
    r = Run()
    r.feed(rc.Start(launch_retries=1 if end == "launch_gave_up" else 3))
    r.feed(launched(1))
    if end == "stopped":
        r.feed(rc.StopRequested("user"))
    elif end == "failed":
        r.feed(rc.RankExited(rank=1, generation=1, code=3))
        assert r.journal[-1]["rank_exit_code"] == 3
    elif end == "launch_gave_up":
        for gen in (2, 3):
            r.feed(rc.LaunchFailed("port in use", rank=0, exit_code=1))
            if gen == 2:
                r.feed(launched(2))
    else:
        settings = rc.Settings(max_attempts=1, on_exhausted="hold") if end == "hold" else S
        r.feed(recover(250, settings=settings))
        r.feed(rc.Killed((0, 1), 0.1))
        if end == "no_checkpoint":
            r.feed(rc.CheckpointChosen(None, skipped=(("/c/200.pt", "grade 2 < 4"),)))
        else:
            r.feed(ckpt(200))
            r.feed(launched(2))
            r.feed(recover(270, settings=settings))
            if end == "escalated":
                r.feed(rc.Killed((0, 1), 0.1))
                r.feed(ckpt(200))
                r.feed(launched(3))
                r.feed(recover(280))
    want = {
        "escalated": rc.Phase.ESCALATED,
        "hold": rc.Phase.HOLDING,
        "no_checkpoint": rc.Phase.ESCALATED,
        "stopped": rc.Phase.STOPPED,
        "failed": rc.Phase.FAILED,
        "launch_gave_up": rc.Phase.FAILED,
    }[end]
    assert r.state.phase is want and rc.fold(r.journal).phase is want
    assert rc.fold(r.journal).exit_code == {
        "hold": None,
        "stopped": 5,
        "failed": 1,
        "launch_gave_up": 1,
    }.get(end, 3)


def test_the_same_rule_at_the_same_step_again_fails_fast_not_after_the_whole_budget():
    r = Run()
    for obs in (
        rc.Start(),
        launched(1),
        recover(30, "crash", CRASH),
        rc.Killed((0, 1), 0.1),
        ckpt(20),
        launched(2),
    ):
        r.feed(obs)
    t = r.feed(
        recover(30, "crash", CRASH)
    )  # budget 2, one attempt used: only the recurrence stops it
    assert r.kinds()[-2:] == ["probation_failed", "escalated"]
    esc = t.events[-1]
    assert esc["fail_fast"] is True and "recurred at step 30" in esc["reason"]
    assert r.state.phase is rc.Phase.ESCALATED and t.effects[-1] == rc.Shutdown(3)
    # reports are asynchronous: a step or two apart is the same recurrence
    r1 = Run()
    for obs in (
        rc.Start(),
        launched(1),
        recover(30, "crash", CRASH),
        rc.Killed((0, 1), 0.1),
        ckpt(20),
        launched(2),
    ):
        r1.feed(obs)
    r1.feed(recover(31, "crash", CRASH))
    assert r1.state.phase is rc.Phase.ESCALATED and "steps 30 and 31" in r1.journal[-1]["reason"]
    # the same rule further on, or another rule at the same step, is an ordinary second attempt
    for obs in (recover(35, "crash", CRASH), recover(30, "hang", CRASH)):
        r2 = Run()
        for o in (
            rc.Start(),
            launched(1),
            recover(30, "crash", CRASH),
            rc.Killed((0, 1), 0.1),
            ckpt(20),
            launched(2),
        ):
            r2.feed(o)
        r2.feed(obs)
        assert r2.state.phase is rc.Phase.KILLING and r2.journal[-1]["attempt"] == 2


def test_launch_failures_are_retried_outside_the_budget_with_backoff_then_fail():
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    attempts = []
    for gen in (2, 3, 4):
        t = r.feed(
            rc.LaunchFailed(
                "rank 0 exited with code 1 before its first heartbeat",
                rank=0,
                exit_code=1,
                details={"log_tail": "EADDRINUSE"},
            )
        )
        kill, launch = t.effects
        assert isinstance(kill, rc.Kill) and launch.plan.generation == gen
        attempts.append(launch.backoff_attempt)
        r.feed(launched(gen))
        assert r.state.phase is rc.Phase.RUNNING and r.state.incident is None
    assert attempts == [1, 2, 3]
    assert r.journal[-2]["log_tail"] == "EADDRINUSE"
    t = r.feed(
        rc.LaunchFailed("rank 0 exited with code 1 before its first heartbeat", rank=0, exit_code=1)
    )
    assert r.state.phase is rc.Phase.FAILED and r.state.exit_code == 1
    assert (
        r.kinds()[-2:] == ["launch_failed", "failed"]
        and "4 consecutive launch failures" in r.journal[-1]["reason"]
    )
    assert "incident" not in r.kinds()


def test_a_launch_failure_after_a_rollback_keeps_the_incident_and_still_starts_probation():
    r = Run()
    for obs in (rc.Start(), launched(1), recover(250), rc.Killed((0, 1), 0.1), ckpt(200)):
        r.feed(obs)
    t = r.feed(
        rc.LaunchFailed("launching generation 2 failed: placement")
    )  # the Launch effect itself failed
    assert t.effects[-1].plan.generation == 3 and t.effects[-1].plan.lr_scale == pytest.approx(0.5)
    r.feed(launched(3))
    assert r.state.phase is rc.Phase.PROBATION and r.state.probation_until == 301
    assert r.state.incident.attempts == 1 and r.kinds()[-2:] == ["launch", "probation_start"]


def test_backoff_doubles_from_the_base_and_is_capped():
    assert [rc.backoff_delay(n, 2.0, 60.0) for n in range(0, 8)] == [0.0, 2, 4, 8, 16, 32, 60, 60]
    assert rc.backoff_delay(3, 0.0, 60.0) == 0.0


def journal_until(kind: str, nth: int = 1) -> list[dict[str, Any]]:
    """A run's journal cut right after the ``nth`` event of ``kind`` (the supervisor died there)."""
    r = Run()
    for obs in (
        rc.Start(),
        launched(1),
        recover(250),
        rc.Killed((0, 1), 0.1),
        ckpt(200),
        launched(2),
        rc.Progress(301),
        recover(700),
        rc.Killed((0, 1), 0.1),
        ckpt(600),
        launched(3),
    ):
        r.feed(obs)
    seen = 0
    for i, e in enumerate(r.journal):
        if e["kind"] == kind:
            seen += 1
            if seen == nth:
                return r.journal[: i + 1]
    raise AssertionError(kind)


LINEAGE_3 = ((1, None), (2, 200), (3, 600))
"""The lineage after journal_until's three launches: fresh, then from 200, then from 600."""


def restarted(events: list[dict[str, Any]], highest: int = 0) -> tuple[rc.State, rc.Transition]:
    st = rc.fold(events)
    return st, rc.step(st, rc.Restarted(S, highest_generation=highest))


def test_restart_after_the_incident_finishes_the_kill_without_a_second_incident():
    st, t = restarted(journal_until("incident", 2))
    assert st.phase is rc.Phase.KILLING and st.incident.id == "inc-002" and t.events == ()
    assert [type(e) for e in t.effects] == [rc.Kill]
    t2 = rc.step(t.state, rc.Killed((0, 1), 0.0))
    assert [e["kind"] for e in t2.events] == ["kill"] and t2.events[0]["incident"] == "inc-002"


def test_restart_after_the_kill_chooses_the_checkpoint_for_the_same_incident():
    st, t = restarted(journal_until("kill", 2))
    assert st.phase is rc.Phase.ROLLING_BACK
    assert t.effects == (
        rc.SelectCheckpoint(min_grade=4, before_step=700, min_steps_back=0, lineage=LINEAGE_3[:2]),
    )


def test_restart_after_the_rollback_launches_the_journaled_plan_with_the_cut_lr():
    st, t = restarted(journal_until("rollback", 2))
    assert st.phase is rc.Phase.RELAUNCHING and st.lr_scale == pytest.approx(0.25)
    (launch,) = t.effects
    assert (
        launch.plan.checkpoint == "/c/600.pt"
        and launch.plan.generation == 3
        and launch.plan.reset_optimizer
    )
    t2 = rc.step(t.state, launched(3))
    assert [e["kind"] for e in t2.events] == ["launch", "probation_start"]
    assert t2.state.incident.id == "inc-002" and t2.state.incident.attempts == 1


def test_restart_never_reuses_a_generation_that_may_have_been_launched():
    _, t = restarted(
        journal_until("rollback", 2), highest=3
    )  # plans/gen003.json exists: it had begun
    assert t.effects[0].plan.generation == 4


def test_restart_in_probation_resumes_from_the_newest_healthy_checkpoint_and_keeps_the_incident():
    events = journal_until("probation_start", 2)
    st, t = restarted(events)
    assert st.phase is rc.Phase.PROBATION and t.state.phase is rc.Phase.RESUMING
    assert t.effects == (
        rc.SelectCheckpoint(min_grade=4, before_step=None, min_steps_back=0, lineage=LINEAGE_3),
    )
    t2 = rc.step(t.state, ckpt(640))
    (launch,) = t2.effects
    assert launch.plan.checkpoint_step == 640 and launch.plan.generation == 4
    assert launch.plan.lr_scale == pytest.approx(0.25) and launch.plan.reset_optimizer is False
    assert [e["kind"] for e in t2.events] == ["resume"] and t2.events[0]["incident"] == "inc-002"
    t3 = rc.step(t2.state, launched(4))
    assert t3.state.phase is rc.Phase.PROBATION and t3.state.probation_until == st.probation_until
    assert [e["kind"] for e in t3.events] == ["launch"] and t3.events[0]["cause"] == "restart"
    # the journal continues: the fold of old + new events is where the live machine is
    assert rc.fold(events + [json.loads(json.dumps(e)) for e in t2.events + t3.events]) == t3.state
    # a later incident continues the numbering
    t4 = rc.step(rc.step(t3.state, rc.Progress(10**6)).state, recover(2000))
    assert t4.events[0]["incident"] == "inc-003"


def test_restart_in_probation_on_the_rollback_checkpoint_keeps_its_optimizer_reset():
    _, t = restarted(journal_until("probation_start", 2))
    t2 = rc.step(t.state, ckpt(600))  # nothing newer: the checkpoint the incident rolled back to
    assert t2.effects[0].plan.reset_optimizer is True


def test_restart_while_running_without_any_checkpoint_starts_over_with_the_lr_scale():
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    _, t = restarted(r.journal)
    t2 = rc.step(t.state, rc.CheckpointChosen(None))
    assert t2.effects[0].plan.checkpoint is None and t2.effects[0].plan.generation == 2
    assert t2.state.phase is rc.Phase.RELAUNCHING


def test_restart_without_the_checkpoint_the_generation_resumed_from_escalates():
    _, t = restarted(journal_until("probation_start", 2))
    t2 = rc.step(t.state, rc.CheckpointChosen(None, skipped=(("/c/600.pt", "sha256 mismatch"),)))
    assert t2.state.phase is rc.Phase.ESCALATED and [e["kind"] for e in t2.events] == [
        "resume",
        "escalated",
    ]


def test_restart_of_a_finished_run_changes_nothing():
    r = Run()
    for obs in (rc.Start(), launched(1), rc.Finished(1.0)):
        r.feed(obs)
    st, t = restarted(r.journal)
    assert st.phase is rc.Phase.COMPLETED and t.state is st and t.effects == ()


def test_restart_of_a_held_run_keeps_holding():
    r = Run()
    for obs in (
        rc.Start(),
        launched(1),
        recover(50, settings=rc.Settings(max_attempts=0, on_exhausted="hold")),
    ):
        r.feed(obs)
    st, t = restarted(r.journal)
    assert st.phase is rc.Phase.HOLDING and t.effects == () and t.events == ()


def test_fold_ignores_bookkeeping_and_unknown_events_and_lineage_follows_launches():
    evs = journal_until("probation_start", 2)
    noisy = [
        {"kind": "notify_thread", "incident": "inc-001", "channel": "C", "ts": "1"},
        {"kind": "reaped", "processes": []},
        {"kind": "from-the-future"},
    ] + evs
    assert rc.fold(noisy) == rc.fold(evs)
    assert rc.fold(evs).lineage == ((1, None), (2, 200), (3, 600))
    assert rc.fold([]) == rc.State()
