"""Recovery semantics that do not throw a rescue away (issue 23, item 3): the pure machine and the
pure checkpoint choice, one transition each, no Ray.

* a rollback target's health is judged against the run's own baseline when the absolute
  ``min_grade`` is out of reach (``grade_baseline``);
* a recurrence is the same rule at the same step *measuring the same* (``recur_window_steps``,
  ``recur_tolerance``);
* an optimizer reset plans an LR re-warm-up (``rewarm_steps``);
* a fault of the other kind in probation opens its own incident, another rule of the same kind
  is the next attempt under its own settings (``probation_kinds``);
* an LR cut is given back once probation passes (``lr_restore_steps``);
* journals written before these settings replay to their digests, and new ones do too.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_journal_replays, read_jsonl
from spikeguard.supervisor.act import effects
from spikeguard.supervisor.decide import lifecycle, wording
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.decide.events import Code, Kind
from spikeguard.supervisor.decide.recovery import model
from spikeguard.supervisor.decide.recovery.model import LEGACY
from spikeguard.supervisor.observe.metrics import MetricsFold
from spikeguard.workers.checkpoint import CheckpointInfo, choose

# the default policy's numbers: a numerical rule cuts and resets, a crash or hang rule does not
NUM = rc.Settings(min_grade=4, min_steps_back=200, lr_factors=(0.5,), probation_steps=1000)
HANG = rc.Settings(
    min_grade=4, min_steps_back=200, lr_factors=(1.0,), reset_optimizer=False, probation_steps=1000
)


def legacy(s: rc.Settings) -> rc.Settings:
    """``s`` as an older supervisor journaled it: without the settings added since."""
    return rc.Settings.from_dict({k: v for k, v in s.to_dict().items() if k not in LEGACY})


class Run:
    """The machine driven like the controller drives it; the journal kept as JSON."""

    def __init__(self) -> None:
        self.state = rc.State()
        self.journal: list[dict[str, Any]] = []
        self.last = self.feed(rc.Launched(1))

    def feed(self, *observations: rc.Observation) -> rc.Transition:
        for obs in observations:
            self.last = rc.step(self.state, obs)
            self.state = self.last.state
            self.journal += [json.loads(json.dumps(e)) for e in self.last.events]
        return self.last

    def events(self, kind: Kind) -> list[dict[str, Any]]:
        return [e for e in self.journal if e["kind"] == kind.value]


def divergence(step: int, value: Any = 0.12, s: rc.Settings = NUM, rule: str = "entropy-collapse"):
    details = {"signal": "attn_entropy_min", "value": value}
    return rc.Recover(rule, f"{rule} at {step}", step, s, details=details, furthest_step=step)


def hang(step: int, s: rc.Settings = HANG) -> rc.Recover:
    return rc.Recover("hang", "no heartbeat for 60 s", step, s, fault=True, furthest_step=step)


def ckpt(step: int, grade: int | None = 4, **kw: Any) -> rc.CheckpointChosen:
    return rc.CheckpointChosen(f"/c/{step}.pt", step=step, sha256="ab" * 32, grade=grade, **kw)


def rolled_back(run: Run, rule: rc.Recover, at: int, gen: int) -> None:
    """Open (or fail into) an incident with ``rule`` and relaunch generation ``gen`` from ``at``."""
    run.feed(rule, rc.Killed((0, 1), 0.1), ckpt(at), rc.Launched(gen))
    assert run.state.phase is rc.Phase.PROBATION


# ---- 1. healthy relative to the run's own baseline ---------------------------------------------
def info(step: int, grade: int | None, generation: int = 1) -> CheckpointInfo:
    meta = {} if grade is None else {"grade": grade}
    return CheckpointInfo(f"/ck/{step}-{generation}", "", step, generation, 0, "0" * 64, 1, meta)


SMALL_MODEL = [info(100, 3), info(200, 2), info(300, 3), info(400, 3), info(500, 2)]
"""A healthy small model: its checkpoints grade S2-S3, never the absolute S4."""


def no_verify(_: CheckpointInfo) -> None:
    pass


def test_run_baseline_is_the_median_of_the_graded_checkpoints_before_the_incident():
    infos = [*SMALL_MODEL, info(350, None), info(600, 6), info(250, 7, generation=9)]
    # ungraded, after the incident, off the lineage: none counts; the lower median of 3,2,3,3,2
    assert choose.run_baseline(infos, before_step=600, lineage=[(1, None)]) == (3, 5)
    assert choose.run_baseline([info(100, None)], before_step=600, lineage=None) is None


def test_under_run_a_small_models_checkpoints_qualify_at_its_own_baseline():
    found = choose.select_rollback(
        SMALL_MODEL, min_grade=4, before_step=700, min_steps_back=200, verify_fn=no_verify,
        grade_baseline="run",
    )  # fmt: skip
    assert (found.chosen.step, found.grade_rule, found.grade_bar, found.baseline_of) == (
        400, "run baseline", 3, 5,
    )  # fmt: skip
    assert [(i.step, why) for i, why in found.skipped] == [
        (500, "grade 2 < min_grade 3 (the run's baseline)")
    ]


def test_under_absolute_the_same_checkpoints_escalate():
    found = choose.select_rollback(
        SMALL_MODEL, min_grade=4, before_step=700, verify_fn=no_verify, grade_baseline="absolute"
    )
    assert found.chosen is None and found.grade_rule == "absolute" and found.grade_bar == 4


def test_the_baseline_is_capped_at_min_grade_and_never_used_when_min_grade_is_met():
    strong = [info(100, 6), info(200, 6), info(300, 3)]
    found = choose.select_rollback(
        strong, min_grade=4, before_step=400, min_steps_back=150, verify_fn=no_verify,
        grade_baseline="run",
    )  # fmt: skip
    assert found.chosen.step == 200 and found.grade_rule == "absolute"
    # the baseline (S6) is above min_grade: capped, the bar stays S4; nothing is older than 100
    found = choose.select_rollback(
        [info(300, 6), info(350, 6), info(380, 2)], min_grade=4, before_step=400,
        min_steps_back=300, verify_fn=no_verify, grade_baseline="run",
    )  # fmt: skip
    assert found.chosen is None and found.grade_rule == "absolute" and found.baseline_of == 3


def test_a_failed_verification_under_the_baseline_is_not_verified_twice():
    seen: list[str] = []

    def corrupt_s4(i: CheckpointInfo) -> None:
        seen.append(i.path)
        if i.grade == 4:
            raise choose.CorruptCheckpointError("bad")

    found = choose.select_rollback(
        [info(100, 2), info(200, 3), info(300, 4)], min_grade=4, before_step=400,
        verify_fn=corrupt_s4, grade_baseline="run",
    )  # fmt: skip
    assert found.chosen.step == 200 and found.grade_rule == "run baseline"
    assert seen == ["/ck/300-1", "/ck/200-1"]  # 300 failed under S4: not hashed again under S3
    assert "failed verification" in found.skipped[0][1]


def select_with(infos: list[CheckpointInfo], eff: rc.SelectCheckpoint, monkeypatch):
    """The real select effect over ``infos`` (listed and verified without files)."""
    monkeypatch.setattr(effects.choose, "list_checkpoints", lambda d: infos)
    monkeypatch.setattr(effects.choose, "verify", no_verify)
    host = types.SimpleNamespace(paths=types.SimpleNamespace(ckpt_dir="/ck"))
    return effects.Effects.select(host, eff)  # type: ignore[arg-type]


@pytest.mark.parametrize("rule", ["run", "absolute"])
def test_a_first_incident_never_escalates_only_because_of_the_grade_scale(rule, monkeypatch):
    s = rc.Settings(**{**NUM.to_dict(), "grade_baseline": rule})
    run = Run()
    (select,) = run.feed(divergence(700, s=s), rc.Killed((0, 1), 0.1)).effects
    assert select.grade_baseline == rule and select.min_grade == 4
    t = run.feed(select_with(SMALL_MODEL, select, monkeypatch))
    (rollback, *_) = t.events
    if rule == "absolute":
        assert run.state.phase is rc.Phase.ESCALATED and rollback["code"] == "no_healthy_checkpoint"
        return
    assert run.state.phase is rc.Phase.RELAUNCHING and rollback["checkpoint_step"] == 400
    assert (rollback["grade_rule"], rollback["grade_bar"], rollback["baseline_of"]) == (
        "run baseline", 3, 5,
    )  # fmt: skip
    assert "this run's own baseline" in rollback["reason"] and "median" in rollback["reason"]


def test_the_rollback_event_says_the_absolute_rule_chose():
    run = Run()
    t = run.feed(divergence(700), rc.Killed((0, 1), 0.1), ckpt(500, 5, grade_rule="absolute"))
    rollback = t.events[0]
    assert (rollback["grade_rule"], rollback["grade_bar"]) == ("absolute", 4)
    assert "baseline_of" not in rollback and "S5 >= S4" in rollback["reason"]


def test_nothing_even_at_the_baseline_words_both_bars():
    run = Run()
    none = rc.CheckpointChosen(None, grade_rule="run baseline", grade_bar=2, baseline_of=4)
    t = run.feed(divergence(700), rc.Killed((0, 1), 0.1), none)
    assert run.state.phase is rc.Phase.ESCALATED
    assert "nor >= S2 (this run's baseline, the median of 4" in t.events[-1]["reason"]


def test_legacy_settings_select_by_the_absolute_grade():
    run = Run()
    (select,) = run.feed(divergence(700, s=legacy(NUM)), rc.Killed((0, 1), 0.1)).effects
    assert select.grade_baseline == "absolute"


# ---- 2. a recurrence is judged on what the rank measured ---------------------------------------
def in_probation(first: rc.Recover) -> Run:
    run = Run()
    rolled_back(run, first, 400, 2)
    return run


def test_the_same_rule_at_the_same_step_measuring_the_same_fails_fast():
    run = in_probation(divergence(725, 0.12))
    t = run.feed(divergence(725, 0.12 * (1 + 1e-4)))
    assert run.state.phase is rc.Phase.ESCALATED and t.events[-1]["code"] == "recurring_fault"


def test_the_same_step_measuring_another_value_is_a_new_attempt_not_a_fail_fast():
    run = in_probation(divergence(725, 0.12))
    t = run.feed(divergence(725, 0.31))
    assert run.state.phase is rc.Phase.KILLING and run.state.incident.id == "inc-001"
    failed, incident = t.events
    assert failed["code"] == Code.SAME_STEP_OTHER_VALUE.value and failed["value"] == 0.31
    assert "not the same fault, so a new attempt" in failed["reason"]
    assert incident["attempt"] == 2 and run.state.incident.value == 0.31  # counts on the budget


@pytest.mark.parametrize(
    ("first", "again"), [("nan", "inf"), ("nan", "nan"), (float("inf"), "-inf")]
)
def test_two_non_finite_measurements_are_the_same_fault(first, again):
    run = in_probation(divergence(725, first, rule="loss-nonfinite"))
    run.feed(divergence(725, again, rule="loss-nonfinite"))
    assert run.state.phase is rc.Phase.ESCALATED


def test_a_finite_and_a_non_finite_measurement_are_not():
    run = in_probation(divergence(725, 3.2, rule="loss-spike"))
    run.feed(divergence(725, "nan", rule="loss-spike"))
    assert run.state.phase is rc.Phase.KILLING


def test_two_crashes_or_hangs_measure_nothing_and_recur():
    run = in_probation(hang(570))
    run.feed(hang(571))
    assert run.state.phase is rc.Phase.ESCALATED


def test_the_window_is_a_setting():
    s = rc.Settings(**{**NUM.to_dict(), "recur_window_steps": 0})
    run = in_probation(divergence(725, 0.12, s=s))
    run.feed(divergence(726, 0.12, s=s))  # one step on: outside a window of 0
    assert run.state.phase is rc.Phase.KILLING
    s = rc.Settings(**{**NUM.to_dict(), "recur_window_steps": 5})
    run = in_probation(divergence(725, 0.12, s=s))
    run.feed(divergence(730, 0.12, s=s))
    assert run.state.phase is rc.Phase.ESCALATED


def test_legacy_settings_do_not_compare_the_value():
    run = in_probation(divergence(725, 0.12, s=legacy(NUM)))
    run.feed(divergence(725, 0.31, s=legacy(NUM)))
    assert run.state.phase is rc.Phase.ESCALATED


def test_the_measured_value_is_journaled_and_replayed():
    obs = divergence(725, float("nan"))
    assert obs.value == "nan"  # strict JSON, as the details carry it
    again = rc.codec.decode(json.loads(json.dumps(rc.codec.encode(obs))))
    assert again.value == "nan" and again.details == {}


# ---- 3. an optimizer reset plans an LR re-warm-up ----------------------------------------------
def test_a_reset_plans_a_re_warm_up_and_the_event_says_so():
    run = Run()
    t = run.feed(divergence(700), rc.Killed((0, 1), 0.1), ckpt(500))
    (launch,) = t.effects
    assert launch.plan.rewarm_steps == 50 and launch.plan.to_dict()["rewarm_steps"] == 50
    reset = run.events(Kind.OPTIMIZER_RESET)[0]
    assert reset["rewarm_steps"] == 50 and "re-warms over the first 50 steps" in reset["reason"]


@pytest.mark.parametrize("s", [HANG, legacy(NUM)], ids=["no reset", "legacy"])
def test_no_re_warm_up_without_a_reset_or_under_legacy_settings(s):
    run = Run()
    obs = hang(700, s) if s is HANG else divergence(700, s=s)
    (launch,) = run.feed(obs, rc.Killed((0, 1), 0.1), ckpt(500)).effects
    assert launch.plan.rewarm_steps == 0 and "rewarm_steps" not in launch.plan.to_dict()


# ---- 4. an incident of another kind in probation gets its own rule's settings -------------------
def test_the_demo_a_collapse_in_a_hangs_probation_opens_its_own_incident_and_is_rescued():
    run = Run()
    rolled_back(run, hang(570), 550, 2)  # a rank SIGSTOPped at ~570: rollback to 550 at x1
    assert run.state.lr_scale == 1.0 and not run.state.plan.reset_optimizer
    t = run.feed(divergence(725))  # the natural entropy collapse, in the hang's probation
    superseded, incident = t.events
    assert superseded["kind"] == "probation_superseded" and superseded["incident"] == "inc-001"
    assert "opens its own incident" in superseded["reason"]
    assert incident["incident"] == "inc-002" and incident["attempt"] == 1
    assert run.state.phase is rc.Phase.KILLING and run.state.incident.settings == NUM
    (select,) = run.feed(rc.Killed((0, 1), 0.1)).effects
    assert select.min_grade == 4 and select.before_step == 725  # a numerical rollback target
    (launch,) = run.feed(ckpt(500)).effects
    assert launch.plan.lr_scale == 0.5 and launch.plan.reset_optimizer  # its rule's settings
    run.feed(rc.Launched(3), rc.Progress(1501))
    assert run.state.phase is rc.Phase.RUNNING
    assert [e["kind"] for e in run.journal if e["kind"].startswith("probation")] == [
        "probation_start", "probation_superseded", "probation_start", "probation_passed",
    ]  # fmt: skip
    lives = lifecycle.fold(run.journal)
    assert lives["inc-001"].outcome is lifecycle.Outcome.SUPERSEDED
    assert lives["inc-002"].outcome is lifecycle.Outcome.RESOLVED


def test_the_demo_under_legacy_settings_escalates_as_before():
    run = Run()
    rolled_back(run, hang(570, legacy(HANG)), 550, 2)
    rolled_back(run, divergence(725, s=legacy(NUM)), 500, 3)  # attempt 2, at the hang's x1
    assert run.state.incident.id == "inc-001" and run.state.plan.lr_scale == 1.0
    t = run.feed(divergence(725, s=legacy(NUM)))
    assert run.state.phase is rc.Phase.ESCALATED and t.events[-1]["code"] == "recurring_fault"


def test_a_crash_in_a_divergences_probation_opens_a_crash_incident():
    run = in_probation(divergence(700))
    assert run.state.lr_scale == 0.5
    t = run.feed(hang(760))
    assert [e["kind"] for e in t.events] == ["probation_superseded", "incident"]
    (select,) = run.feed(rc.Killed((0, 1), 0.1)).effects
    assert select.min_grade is None  # a crash's target: any grade that verifies
    (launch,) = run.feed(ckpt(600)).effects
    assert launch.plan.lr_scale == 0.5 and not launch.plan.reset_optimizer  # kept, not cut again


def test_the_superseding_incident_counts_toward_max_incidents():
    s = rc.Settings(**{**NUM.to_dict(), "max_incidents": 1})
    run = Run()
    rolled_back(run, hang(570, rc.Settings(**{**HANG.to_dict(), "max_incidents": 1})), 550, 2)
    t = run.feed(divergence(725, s=s))
    assert run.state.phase is rc.Phase.ESCALATED and t.events[-1]["code"] == "too_many_incidents"


def test_another_rule_of_the_same_kind_is_the_next_attempt_under_its_own_settings():
    spike = rc.Settings(**{**NUM.to_dict(), "lr_factors": [0.25]})
    run = in_probation(divergence(700, rule="entropy-collapse"))
    t = run.feed(divergence(760, 9.0, s=spike, rule="loss-spike"))
    failed, incident = t.events
    assert failed["code"] == Code.OTHER_RULE_IN_PROBATION.value and incident["attempt"] == 2
    assert "uses loss-spike's recovery settings" in failed["reason"]
    assert run.state.incident.id == "inc-001" and run.state.incident.settings == spike
    (launch,) = run.feed(rc.Killed((0, 1), 0.1), ckpt(500)).effects
    assert launch.plan.lr_scale == pytest.approx(0.5 * 0.25)


def test_legacy_settings_keep_the_incidents_settings_for_another_rule():
    old = legacy(NUM)
    spike = rc.Settings(**{**old.to_dict(), "lr_factors": [0.25]})
    run = in_probation(divergence(700, s=old))
    run.feed(divergence(760, 9.0, s=spike, rule="loss-spike"))
    assert run.state.incident.settings == old


def test_a_superseded_incident_is_one_outcome_the_metrics_count():
    run = Run()
    rolled_back(run, hang(570), 550, 2)
    run.feed(divergence(725))
    fold = MetricsFold(run="r")
    for ev in run.journal:
        fold.handle(ev)
    assert fold.recoveries == {("hang", "superseded"): 1}
    assert lifecycle.leads_to("probation_superseded") is lifecycle.IncidentState.RESOLVED


# ---- 5. an LR cut can be given back ------------------------------------------------------------
RESTORE = rc.Settings(**{**NUM.to_dict(), "lr_restore_steps": 200})


def test_probation_passing_gives_the_cut_back_and_a_later_incident_cuts_from_there():
    run = Run()
    (launch,) = run.feed(divergence(700, s=RESTORE), rc.Killed((0, 1), 0.1), ckpt(500)).effects
    plan = launch.plan
    assert (plan.lr_scale, plan.lr_restore_from, plan.lr_restore_steps, plan.lr_restore_to) == (
        0.5, 501 + 1000, 200, 1.0,
    )  # fmt: skip
    t = run.feed(rc.Launched(2), rc.Progress(1501))
    (passed,) = t.events
    assert run.state.phase is rc.Phase.RUNNING and run.state.lr_scale == 1.0
    assert (passed["lr_scale"], passed["lr_restored_from"], passed["lr_restore_steps"]) == (
        1.0, 0.5, 200,
    )  # fmt: skip
    assert "returns from 0.5 to 1 over 200 steps from step 1501" in passed["reason"]
    (launch,) = run.feed(divergence(2000, s=RESTORE), rc.Killed((0,), 0.1), ckpt(1800)).effects
    assert launch.plan.lr_scale == 0.5


def test_without_lr_restore_steps_a_cut_is_permanent():
    run = Run()
    run.feed(divergence(700), rc.Killed((0, 1), 0.1), ckpt(500), rc.Launched(2))
    assert run.state.plan.lr_restore_from is None
    (passed,) = run.feed(rc.Progress(1501)).events
    assert run.state.lr_scale == 0.5 and "lr_restored_from" not in passed


def test_a_restart_in_probation_keeps_the_cut_to_give_back():
    run = Run()
    run.feed(divergence(700, s=RESTORE), rc.Killed((0, 1), 0.1), ckpt(500), rc.Launched(2))
    run.feed(rc.Restarted(RESTORE, highest_generation=2))
    (launch,) = run.feed(ckpt(900)).effects
    assert (launch.plan.lr_restore_from, launch.plan.lr_restore_to) == (1501, 1.0)


# ---- journals: the old ones replay, and so do new ones -----------------------------------------
PREVIOUS = sorted((Path(__file__).parent / "data" / "previous_version").rglob("journal.jsonl"))


@pytest.mark.parametrize("path", PREVIOUS, ids=lambda p: p.parent.name)
def test_an_older_journal_replays_under_the_legacy_meaning_of_the_new_settings(path):
    assert assert_journal_replays(path) >= 2
    for ev in read_jsonl(path):
        for obs in ev.get("obs") or ():
            if "settings" in obs:
                s = rc.codec.decode(obs).settings
                assert all(getattr(s, k) == v for k, v in LEGACY.items())


def test_a_missing_setting_means_the_older_behaviour_and_a_present_one_its_value():
    assert rc.Settings.from_dict({}).grade_baseline == "absolute"
    assert rc.Settings.from_dict(NUM.to_dict()) == NUM and NUM.grade_baseline == "run"
    assert set(LEGACY) <= set(rc.Settings.model_fields)
    # the class defaults are the new behaviour wherever a legacy value differs
    assert {k for k, v in LEGACY.items() if rc.Settings.model_fields[k].default != v} == {
        "grade_baseline", "recur_tolerance", "rewarm_steps", "probation_kinds",
    }  # fmt: skip


def test_the_digest_leaves_out_legacy_values_and_covers_new_ones():
    # what an older supervisor digested: the settings it knew, those at their default left out
    assert not set(model._non_default(legacy(NUM))) & set(LEGACY)
    assert set(model._non_default(NUM)) & set(LEGACY) == {
        "grade_baseline", "recur_tolerance", "rewarm_steps", "probation_kinds",
    }  # fmt: skip
    a = rc.State(incident=rc.Incident(id="i", rule="r", reason="", step=1, settings=legacy(NUM)))
    b = rc.State(incident=rc.Incident(id="i", rule="r", reason="", step=1, settings=NUM))
    assert rc.state_digest(a) != rc.state_digest(b)


def test_a_new_journal_with_every_new_behaviour_replays_to_its_digests(tmp_path):
    run = Run()
    rolled_back(run, hang(570, RESTORE), 550, 2)
    run.feed(divergence(725, s=RESTORE), rc.Killed((0, 1), 0.1))
    run.feed(ckpt(400, 3, grade_rule="run baseline", grade_bar=3, baseline_of=4))
    run.feed(rc.Launched(3), divergence(725, 0.31, s=RESTORE))  # another value: a new attempt
    run.feed(rc.Killed((0, 1), 0.1), ckpt(300), rc.Launched(4), rc.Progress(1301))
    run.feed(rc.Finished(1.5))
    assert run.state.phase is rc.Phase.COMPLETED and run.state.lr_scale == 0.5
    path = tmp_path / "journal.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in run.journal))
    assert assert_journal_replays(path) >= 8
    assert rc.fold(run.journal) == run.state
    assert {e["kind"] for e in run.journal} >= {"probation_superseded", "probation_passed"}


def test_every_new_code_is_worded():
    for key in [
        (Kind.PROBATION_FAILED, Code.OTHER_RULE_IN_PROBATION),
        (Kind.PROBATION_FAILED, Code.SAME_STEP_OTHER_VALUE),
        (Kind.PROBATION_SUPERSEDED, Code.OTHER_KIND_IN_PROBATION),
    ]:
        assert key in wording.WORDING


def test_policy_explain_words_every_new_setting():
    from spikeguard.policies.explain import explain_recovery
    from spikeguard.policies.schema import RecoverySettings

    new = explain_recovery(RecoverySettings(lr_restore_steps=200))
    for words in (
        "the run's own healthy baseline",
        "re-warm the LR over its first 50 steps",
        "opens its own incident with its rule's settings",
        "within 2 steps of the last attempt's step, measuring the same (within 0.001",
        "give the LR cut back over 200 steps",
    ):
        assert words in new
    old = explain_recovery(RecoverySettings(**LEGACY))
    for words in (
        "escalating when none is",
        "(the full LR at once)",
        "the incident's next attempt, with its settings",
        "whatever it measures",
        "an LR cut is permanent",
    ):
        assert words in old


def test_a_run_whose_checkpoints_are_all_ungraded_rolls_back_by_step_alone():
    # a model whose blocks no probe found: no checkpoint carries a grade, so no grade can judge
    ungraded = [info(100, None), info(200, None), info(300, None)]
    found = choose.select_rollback(
        ungraded,
        min_grade=4,
        before_step=400,
        min_steps_back=150,
        grade_baseline="run",
        verify_fn=no_verify,
    )
    assert found.chosen.step == 200 and found.grade_rule == "ungraded" and found.grade_bar is None
    absolute = choose.select_rollback(
        ungraded,
        min_grade=4,
        before_step=400,
        min_steps_back=150,
        grade_baseline="absolute",
        verify_fn=no_verify,
    )
    assert absolute.chosen is None  # the legacy rule still escalates
    # one graded checkpoint is a baseline: the ungraded ones do not qualify under it
    mixed = choose.select_rollback(
        [info(100, 2), info(200, None)],
        min_grade=4,
        before_step=400,
        grade_baseline="run",
        verify_fn=no_verify,
    )
    assert mixed.chosen.step == 100 and mixed.grade_rule == "run baseline"
