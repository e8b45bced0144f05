"""Engine state: rank scopes, for:, cooldown, warm-in, generations, replay, determinism."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from spikeguard.policies import (
    Decision,
    Engine,
    RecoverySettings,
    load_policy,
    load_policy_text,
    replay,
)
from spikeguard.policies.testing import checkpoint, done, exit_, hang, heartbeat, hello, report


def policy(rule: str, *, action: str = "recover", warm_in: str = "0 steps", head: str = ""):
    body = "\n".join("    " + line for line in rule.strip().splitlines())
    return load_policy_text(
        f"version: 1\nname: t\nwarm_in: {warm_in}\n{head}rules:\n  - name: r\n"
        f"    action: {action}\n{body}\n"
    )


def run(pol, msgs) -> list[Decision]:
    engine = Engine(pol)
    return [d for m in msgs for d in engine.observe(m)]


def hellos(n: int, gen: int = 0) -> list[dict]:
    return [hello(r, world_size=n, gen=gen) for r in range(n)]


# --- rank scope ---------------------------------------------------------------------------


def test_scope_any_decides_per_rank():
    out = run(
        policy("when: grade < S3"), hellos(4) + [report(1, 10, grade=2), report(3, 10, grade=1)]
    )
    assert [(d.rank, d.step) for d in out] == [(1, 10), (3, 10)]


def test_scope_all_needs_every_rank_of_the_world():
    pol = policy("when: grade < S3\nranks: all")
    msgs = hellos(3) + [report(0, 10, grade=2), report(1, 10, grade=2)]
    assert run(pol, msgs) == []
    out = run(pol, msgs + [report(2, 10, grade=1)])
    assert len(out) == 1 and out[0].rank is None and "3 of 3 ranks (0, 1, 2)" in out[0].reason


def test_scope_all_resets_when_a_rank_recovers():
    pol = policy("when: grade < S3\nranks: all")
    msgs = hellos(2) + [
        report(0, 10, grade=2),
        report(1, 10, grade=5),
        report(0, 20, grade=2),
        report(1, 20, grade=2),
    ]
    assert [d.step for d in run(pol, msgs)] == [20]


@pytest.mark.parametrize(
    "world,holding,fires", [(4, 1, False), (4, 2, True), (3, 1, False), (3, 2, True)]
)
def test_scope_fraction_rounds_up(world, holding, fires):
    pol = policy("when: grade < S3\nranks: {fraction: 0.5}")
    msgs = hellos(world) + [report(r, 10, grade=2) for r in range(holding)]
    assert bool(run(pol, msgs)) is fires


@pytest.mark.parametrize("holding,fires", [(2, False), (3, True)])
def test_scope_at_least(holding, fires):
    pol = policy("when: loss is nonfinite\nranks: {at_least: 3}")
    msgs = hellos(8) + [heartbeat(r, 5, loss=math.nan) for r in range(holding)]
    out = run(pol, msgs)
    assert bool(out) is fires
    if fires:
        assert len(out) == 1 and "3 of 8 ranks" in out[0].reason


def test_scope_without_hello_uses_the_ranks_seen():
    pol = policy("when: grade < S3\nranks: all")
    assert len(run(pol, [report(1, 1, grade=6), report(0, 1, grade=1)])) == 0
    assert len(run(pol, [report(1, 1, grade=1), report(0, 1, grade=1)])) == 1


# --- for: persistence ---------------------------------------------------------------------


def test_for_samples_counts_consecutive_evaluations():
    pol = policy("when: grade < S3\nfor: 2 samples")
    assert run(pol, [report(0, 0, grade=2), report(0, 25, grade=4), report(0, 50, grade=2)]) == []
    out = run(pol, [report(0, 0, grade=2), report(0, 25, grade=2)])
    assert [d.step for d in out] == [25] and "held for 2 samples" in out[0].reason


def test_for_steps_spans_steps_on_heartbeats():
    pol = policy("when: loss > 3\nfor: 3 steps")
    msgs = [heartbeat(0, 10, loss=4.0), heartbeat(0, 11, loss=4.0)]
    assert run(pol, msgs) == []
    assert [d.step for d in run(pol, msgs + [heartbeat(0, 12, loss=4.0)])] == [12]
    assert run(pol, msgs + [heartbeat(0, 12, loss=2.0), heartbeat(0, 13, loss=4.0)]) == []


def test_a_rank_part_way_through_a_for_window_is_not_quiet():
    """A rank whose rule held on its latest message (part-way through ``for:``, or holding) is
    never quiet: its next message may decide. It is again once the condition breaks. Only a
    rank part-way through ``for:`` is pending (read before the rest of its tick is validated)."""
    engine = Engine(policy("when: loss > 3\nfor: 3 steps"))
    seen = []
    for m in [
        heartbeat(0, 10, loss=4.0),
        heartbeat(1, 10, loss=2.0),
        heartbeat(0, 11, loss=4.0),
        heartbeat(1, 11, loss=4.0),
        heartbeat(0, 12, loss=4.0),  # rank 0 fires: it holds
        heartbeat(1, 12, loss=2.0),  # rank 1's streak breaks
    ]:
        fired = engine.observe(m)
        calm = [engine.quiet([heartbeat(r, m["step"] + 1, loss=2.0)]) for r in (0, 1)]
        seen.append((m["rank"], m["step"], bool(fired), calm))
    assert seen == [
        (0, 10, False, [False, True]),
        (1, 10, False, [False, True]),
        (0, 11, False, [False, True]),
        (1, 11, False, [False, False]),
        (0, 12, True, [False, False]),
        (1, 12, False, [False, True]),
    ]
    assert engine.pending_ranks() == set()  # rank 0 holds (fired), rank 1 broke off
    engine.observe(heartbeat(1, 13, loss=4.0))
    assert engine.pending_ranks() == {1}  # part-way through for: again
    assert not engine.quiet([heartbeat(1, 14, loss=2.0)])
    engine.observe(heartbeat(1, 14, loss=2.0))
    assert not engine.quiet([heartbeat(1, 15, loss=3.5)])  # the value itself may hold
    assert engine.quiet([heartbeat(1, 15, loss=3.0)])  # strictly above 3: cannot
    assert not engine.quiet([heartbeat(1, 15, loss=2.0, gen=1)])  # a relaunch: not foreseen
    assert not engine.quiet([report(1, 15, grade=7)])  # only heartbeats are screened


@pytest.mark.parametrize(
    "rule, bounded",
    [
        ("when: loss > 3", True),
        ("when: loss > 3\nfor: 2 steps", True),
        ("when: loss is nonfinite", True),
        ("when: grad_norm < 0.5", True),
        ("when: grad_norm < 0.5\nranks: {at_least: 2}", True),
        (
            "when: {signal: loss, above_median: 1.3, z_above: 3, window: 6 steps}\nfor: 2 steps",
            True,
        ),
        ("when: {signal: loss, above_median: 1.3, window: 6 steps}", True),
        ("when: {signal: loss, below_median: 0.7, window: 4 samples}", True),
        ("when: {any: [loss > 3, {signal: loss, above_median: 1.5, window: 5 steps}]}", True),
        ("when: {all: [loss > 2.2, grad_norm is nonfinite]}", True),
        ("when: loss > 3\ncooldown: 4 steps", True),
        ("when: {signal: loss, z_above: 2, window: 5 steps}", False),  # no bound
        ("when: {signal: loss, rises_by: 1, within: 3 steps}", False),
    ],
)
def test_a_quiet_screen_is_never_wrong_on_random_streams(rule, bounded):
    """Whatever the engine says is quiet decides nothing when it is observed: random streams of
    four ranks (spikes, dips, NaNs, skipped steps, several steps in one poll, a relaunch), each
    poll screened just before it is observed. And the screen is not vacuous: where the
    condition has a bound, a good share of the polls is quiet."""
    rng = random.Random(3)
    engine = Engine(policy(rule, action="notify"))
    quiet = screened = 0
    step = {r: 0 for r in range(4)}
    for tick in range(1000):
        gen = 0 if tick < 600 else 1
        if tick == 600:
            step = {r: 120 for r in range(4)}
        for r in rng.sample(range(4), 4):
            poll = []
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                step[r] += rng.choice([1, 1, 1, 2])
                loss = rng.choice(
                    [2.0 + rng.gauss(0, 0.05)] * 8
                    + [rng.uniform(0.5, 4.5), rng.uniform(1.2, 3.0), 4.0, 0.5, math.nan]
                )
                grad = rng.choice([1.0] * 8 + [rng.uniform(0.1, 1.0), math.inf])
                poll.append(heartbeat(r, step[r], loss=loss, grad_norm=grad, gen=gen))
            said_quiet = engine.quiet(poll)
            decided = [d for m in poll for d in engine.observe(m)]
            screened += 1
            if said_quiet:
                quiet += 1
                assert decided == [], (rule, tick, r, poll, decided)
    # unbounded: only polls whose values the test ignores (NaN) are quiet
    assert quiet > screened * 0.3 if bounded else quiet < screened * 0.1, (quiet, screened)


def test_for_time_uses_the_supervisor_clock():
    pol = policy("when: loss > 3\nfor: 30s")
    msgs = [heartbeat(0, s, loss=4.0, at=100.0 + 10 * s) for s in range(4)]  # at 100, 110, 120, 130
    assert [d.step for d in run(pol, msgs)] == [3]
    # 't' (the rank's wall clock) is only the fallback: 'at' wins when both are present
    skewed = [{**m, "t": 0.0} for m in msgs]
    assert [d.step for d in run(pol, skewed)] == [3]


def test_time_falls_back_to_t_without_at():
    pol = policy("when: loss > 3\nfor: 30s")
    msgs = [
        {k: v for k, v in heartbeat(0, s, loss=4.0).items() if k != "at"} | {"t": 1000.0 + 15 * s}
        for s in range(4)
    ]
    assert [d.step for d in run(pol, msgs)] == [2]


def test_heartbeat_and_report_of_the_same_step_count_once():
    pol = policy("when: loss > 3\nfor: 2 samples")
    msgs = [heartbeat(0, 10, loss=4.0), report(0, 10, grade=7, loss=4.0)]
    assert run(pol, msgs) == []
    assert run(pol, msgs + [heartbeat(0, 11, loss=4.0)])


# --- edge triggering, resolved, cooldown --------------------------------------------------


def test_fires_once_per_episode_and_resolves():
    pol = policy("when: grade < S3", action="notify")
    msgs = [report(0, s * 25, grade=g) for s, g in enumerate([2, 2, 2, 5, 2])]
    out = run(pol, msgs)
    assert [(d.step, d.resolved) for d in out] == [(0, False), (75, True), (100, False)]
    assert out[1].action == "notify" and out[1].reason.startswith("resolved:")


def test_no_resolved_messages_when_disabled():
    pol = policy("when: grade < S3", action="notify", head="notify: {send_resolved: false}\n")
    msgs = [report(0, s * 25, grade=g) for s, g in enumerate([2, 5, 2])]
    assert [d.resolved for d in run(pol, msgs)] == [False, False]


def test_cooldown_in_steps():
    pol = policy("when: grade < S3\ncooldown: 100 steps", action="notify")
    msgs = [report(0, s, grade=g) for s, g in [(0, 2), (25, 5), (50, 2), (75, 5), (100, 2)]]
    assert [d.step for d in run(pol, msgs) if not d.resolved] == [0, 100]


def test_cooldown_in_time_holds_a_still_true_condition_until_it_ends():
    pol = policy("when: grade < S3\ncooldown: 60s", action="notify")
    msgs = [
        report(0, 0, grade=2, at=0.0),
        report(0, 1, grade=5, at=10.0),
        report(0, 2, grade=2, at=20.0),
        report(0, 3, grade=2, at=59.0),
        report(0, 4, grade=2, at=60.0),
    ]
    assert [d.step for d in run(pol, msgs) if not d.resolved] == [0, 4]


def test_cooldown_is_per_rule_across_ranks():
    pol = policy("when: grade < S3\ncooldown: 10m", action="notify")
    assert [d.rank for d in run(pol, [report(0, 1, grade=1), report(1, 1, grade=1)])] == [0]


# --- warm-in ------------------------------------------------------------------------------


def test_policy_warm_in_applies_to_layer_signal_rules():
    pol = policy("when: grade < S3", warm_in="300 steps")
    assert run(pol, [report(0, 299, grade=1)]) == []
    assert [d.step for d in run(pol, [report(0, 299, grade=1), report(0, 300, grade=1)])] == [300]


def test_policy_warm_in_does_not_apply_to_loss_rules():
    pol = policy("when: loss is nonfinite", warm_in="300 steps")
    assert run(pol, [heartbeat(0, 3, loss=math.nan)])


def test_rule_warm_in_overrides_the_policy():
    pol = policy("when: grade < S3\nwarm_in: 0 steps", warm_in="300 steps")
    assert run(pol, [report(0, 0, grade=1)])
    pol = policy("when: loss > 3\nwarm_in: 50 steps")
    assert [d.step for d in run(pol, [heartbeat(0, 49, loss=4.0), heartbeat(0, 50, loss=4.0)])] == [
        50
    ]


def test_persistence_does_not_start_during_warm_in():
    pol = policy("when: grade < S3\nfor: 2 samples", warm_in="100 steps")
    msgs = [report(0, 75, grade=1), report(0, 100, grade=1), report(0, 125, grade=1)]
    assert [d.step for d in run(pol, msgs)] == [125]


# --- generations --------------------------------------------------------------------------


def test_messages_of_an_older_generation_are_ignored():
    pol = policy("when: grade < S3")
    engine = Engine(pol)
    assert engine.observe(report(0, 500, grade=6, gen=1)) == []
    assert engine.observe(report(0, 400, grade=1, gen=0)) == []
    assert engine.ignored == 1
    out = engine.observe(report(0, 525, grade=1, gen=1))
    assert out and out[0].generation == 1


def test_trailing_windows_restart_when_the_resume_is_before_all_history():
    pol = policy("when: loss > 1.5 * median(10 steps)")
    gen0 = [heartbeat(0, s, loss=2.0) for s in range(100, 120)]
    resumed = [heartbeat(0, 90 + i, loss=2.0, gen=1) for i in range(5)]
    spike = heartbeat(0, 95, loss=9.0, gen=1)
    assert run(pol, gen0 + resumed + [spike]) == []  # only 5 steps of gen 1 history
    refilled = [heartbeat(0, 90 + i, loss=2.0, gen=1) for i in range(10)]
    assert [
        d.generation for d in run(pol, gen0 + refilled + [heartbeat(0, 100, loss=9.0, gen=1)])
    ] == [1]


def test_a_spike_coming_back_right_after_a_rollback_is_measured_against_the_history_before_it():
    """Rolled back to step 30 after a spike at 41: the trailing window keeps steps < 31 (what the
    checkpoint was trained through) and drops the abandoned 31..45 (the spike), so the same
    spike two steps after the resume fires; a steady resume does not."""
    pol = policy("when: loss > 1.5 * median(10 steps)\nfor: 2 steps")
    gen0 = [heartbeat(0, s, loss=2.0) for s in range(0, 41)]
    gen0.insert(31, checkpoint(0, 30))  # saved after step 30; the window holds 11 points only
    gen0 += [heartbeat(0, s, loss=20.0) for s in range(41, 56)]
    assert [d.step for d in run(pol, gen0)] == [42]
    resumed = [heartbeat(0, 31, loss=2.0, gen=1), heartbeat(0, 32, loss=2.0, gen=1)]
    again = [heartbeat(0, s, loss=20.0, gen=1) for s in (33, 34, 35)]
    out = run(pol, gen0 + resumed + again)
    assert [(d.generation, d.step) for d in out] == [(0, 42), (1, 34)]
    assert "median 2" in out[-1].reason  # the baseline is the healthy history, not the spike
    steady = [heartbeat(0, s, loss=2.0, gen=1) for s in range(31, 60)]
    assert [d.generation for d in run(pol, gen0 + steady)] == [0]
    # without the checkpoint's snapshot the window's history is gone: the spike goes unseen
    no_ckpt = [m for m in gen0 if m["type"] != "checkpoint"]
    assert [d.generation for d in run(pol, no_ckpt + resumed + again)] == [0]


def test_only_the_last_checkpoints_are_kept_to_rewind_to():
    from spikeguard.policies.engine import SNAPSHOTS

    pol = policy("when: loss > 1.5 * median(10 steps)")
    gen0 = []
    for s in range(0, 200):
        gen0.append(heartbeat(0, s, loss=2.0))
        if s % 20 == 19:
            gen0.append(checkpoint(0, s))
    spike = [heartbeat(0, 3, loss=2.0, gen=1), heartbeat(0, 4, loss=2.0, gen=1)]
    spike += [heartbeat(0, 5, loss=20.0, gen=1)]
    engine = Engine(pol)
    for m in gen0:
        engine.observe(m)
    assert sorted(engine._snapshots) == [199 - 20 * i for i in range(SNAPSHOTS)][::-1]
    recent = 199 - 20 * (SNAPSHOTS - 1)  # the oldest checkpoint kept: a spike after it fires
    late = [heartbeat(0, recent + 1 + i, loss=2.0, gen=1) for i in range(2)]
    late.append(heartbeat(0, recent + 3, loss=20.0, gen=1))
    assert [d.generation for d in run(pol, gen0 + late)] == [1]
    assert run(pol, gen0 + spike) == []  # step 5 is before every kept checkpoint: no history


def test_a_restart_from_step_0_keeps_no_history():
    pol = policy("when: loss > 1.5 * median(10 steps)")
    gen0 = [heartbeat(0, s, loss=2.0) for s in range(0, 30)]
    restart = [heartbeat(0, s, loss=9.0 if s == 3 else 2.0, gen=1) for s in range(0, 5)]
    assert run(pol, gen0 + restart) == []  # 3 steps of history: the window is not full


def test_firing_state_restarts_but_cooldown_carries_over():
    pol = policy("when: grade < S3\ncooldown: 100 steps", action="notify")
    msgs = [report(0, 500, grade=1), report(0, 525, grade=1, gen=1)]
    assert [d.step for d in run(pol, msgs)] == [500]  # 25 steps seen since: still cooling
    pol = policy("when: grade < S3", action="notify")
    assert [d.generation for d in run(pol, msgs)] == [0, 1]  # a new generation fires afresh


def test_step_cooldown_counts_training_seen_not_the_step_number():
    pol = policy("when: grade < S3\ncooldown: 100 steps", action="notify")
    # fired at 500, rolled back to 400: 60 + 30 = 90 steps of training seen at step 430,
    # 60 + 40 = 100 at step 440 (the step number itself never got 100 past 500)
    msgs = [
        report(0, 500, grade=1),
        report(0, 560, grade=7),
        hello(0, step=0, gen=1),
        report(0, 400, grade=7, gen=1),
        report(0, 430, grade=1, gen=1),
        report(0, 440, grade=1, gen=1),
    ]
    assert [(d.generation, d.step) for d in run(pol, msgs) if not d.resolved] == [
        (0, 500),
        (1, 440),
    ]


def test_exit_before_any_step_of_a_relaunch_uses_no_stale_step():
    pol = policy("when: crash")
    msgs = [heartbeat(0, 900), hello(0, step=0, gen=1), exit_(0, 1, gen=1)]
    out = run(pol, msgs)
    assert [(d.generation, d.step) for d in out] == [(1, 0)]


def test_retire_ignores_the_killed_generation():
    engine = Engine(policy("when: crash"))
    engine.retire(0)
    assert engine.observe(exit_(0, -9, gen=0)) == []
    assert engine.observe(exit_(0, 1, gen=1))


# --- replay -------------------------------------------------------------------------------


def test_replay_stops_a_generation_at_its_first_recover():
    pol = load_policy("default")
    msgs = (
        [hello(0, world_size=1)]
        + [heartbeat(0, s) for s in range(10)]
        + [heartbeat(0, 10, loss=math.nan), heartbeat(0, 11, loss=math.nan), exit_(0, -9)]
        + [hello(0, world_size=1, step=5, gen=1)]
        + [heartbeat(0, s, gen=1) for s in range(5, 20)]
        + [done(0, 20, gen=1), exit_(0, 0, gen=1)]
    )
    out = replay(pol, msgs)
    assert [(d.rule, d.step, d.generation) for d in out] == [("non-finite-loss", 10, 0)]
    live = run(pol, msgs)  # without the kill, the dead generation would keep deciding
    assert len(live) > len(out)


def test_replay_is_deterministic_and_json_round_trips():
    pol = load_policy("aggressive")
    rng = random.Random(7)
    msgs = []
    for s in range(0, 1200):
        msgs.append(heartbeat(s % 2, s, loss=2 + rng.random() * (3 if 900 < s < 910 else 0.1)))
        if s % 25 == 0:
            msgs.append(
                report(
                    s % 2,
                    s,
                    grade=rng.choice([5, 6, 7]),
                    attn_entropy_min_norm=0.5 + rng.random() / 10,
                )
            )
    recorded = [json.loads(json.dumps(m)) for m in msgs]
    first, second = replay(pol, msgs), replay(pol, recorded)
    assert first == second and first  # something fired, identically


def test_decision_carries_effective_recovery_settings():
    pol = load_policy_text("""
version: 1
name: t
recovery: {lr_factors: [0.5, 0.25], max_attempts: 4}
rules:
  - name: a
    when: loss is nonfinite
    action: recover
    recovery: {lr_factors: [0.1], skip_window: 20 steps}
  - {name: b, when: crash, action: recover}
""")
    out = run(pol, [heartbeat(0, 1, loss=math.nan), exit_(0, 2)])
    a, b = out
    assert (
        a.recovery.lr_factors == [0.1]
        and a.recovery.skip_window == 20
        and a.recovery.max_attempts == 4
    )
    assert b.recovery == pol.recovery and isinstance(b.recovery, RecoverySettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step = 3  # type: ignore[misc]
    assert json.loads(json.dumps(a.to_dict()))["recovery"]["lr_factors"] == [0.1]


def test_malformed_messages_are_ignored_not_fatal():
    engine = Engine(load_policy("default"))
    for junk in [
        None,
        3,
        {},
        {"type": "report"},
        {"type": "heartbeat", "rank": "0", "step": 1},
        {"type": "heartbeat", "rank": 0},
        {"type": "report", "rank": 0, "step": 5, "layers": [1]},
        {"type": "unknown", "rank": 0, "step": 1},
    ]:
        assert engine.observe(junk) == []  # type: ignore[arg-type]


def test_lr_factors_compound_and_the_last_one_repeats():
    # (when the budget is spent is the recovery machine's: tests/test_recovery.py)
    rs = RecoverySettings(lr_factors=[0.5, 0.3], max_attempts=3)
    assert [rs.lr_factor(i) for i in range(4)] == [0.5, 0.3, 0.3, 0.3]
    assert rs.lr_scale(0) == 1.0 and rs.lr_scale(3) == pytest.approx(0.5 * 0.3 * 0.3)


def test_a_hang_threshold_longer_than_the_timeout_fires_when_the_silence_reaches_it():
    # the collector repeats `hang` every timeout of continued silence, with the growing age
    pol = load_policy_text("""
version: 1
name: t
rules:
  - {name: long-hang, when: hang > 5m, action: recover}
""")
    ages = [60.0, 120.0, 180.0, 240.0, 300.0, 360.0]
    out = replay(pol, [hang(0, age, step=10, at=1000 + age) for age in ages])
    assert [(d.rule, d.value) for d in out] == [("long-hang", 300.0)]  # once, at 5 minutes
