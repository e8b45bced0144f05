"""Every condition type on synthetic streams: fires at the boundary, not just inside it."""

from __future__ import annotations

import math

import pytest
from spikeguard.policies import Engine, load_policy_text
from spikeguard.policies.testing import exit_, hang, heartbeat, hello, report


def policy(rule: str, *, warm_in: str = "0 steps", extra: str = "") -> object:
    """A one-rule policy; ``rule`` is the YAML body of the rule (without name/action)."""
    body = "\n".join("    " + line for line in rule.strip().splitlines())
    return load_policy_text(
        f"version: 1\nname: t\nwarm_in: {warm_in}\n{extra}rules:\n  - name: r\n"
        f"    action: recover\n{body}\n"
    )


def fired(pol, msgs) -> list:
    engine = Engine(pol)
    return [d for m in msgs for d in engine.observe(m)]


# --- thresholds ---------------------------------------------------------------------------


@pytest.mark.parametrize("grade,fires", [(2, True), (3, False), (7, False), (0, True)])
def test_grade_below_is_strict(grade, fires):
    pol = policy("when: grade < S3")
    out = fired(pol, [report(0, 10, grade=grade)])
    assert bool(out) is fires
    if fires:
        assert out[0].signal == "grade" and out[0].value == grade and out[0].layer == "blocks.0"
        assert f"S{grade} is below S3" in out[0].reason


@pytest.mark.parametrize("value,fires", [(40.0, False), (40.0001, True)])
def test_above_threshold_boundary_mapping_form(value, fires):
    pol = policy("when: {signal: max_logit, above: 40}")
    assert bool(fired(pol, [report(0, 10, max_logit=value)])) is fires


def test_threshold_on_step_signal_reads_heartbeats():
    pol = policy("when: {signal: lr, below: 1e-5}")
    assert fired(pol, [heartbeat(0, 1, lr=1e-5)]) == []
    out = fired(pol, [heartbeat(0, 1, lr=9.9e-6)])
    assert out and out[0].signal == "lr" and out[0].layer is None


def test_missing_or_null_value_never_fires():
    pol = policy("when: {signal: loss, above: 3}")
    assert fired(pol, [heartbeat(0, 1, loss=None), report(0, 2, grade=7, loss=None)]) == []


# --- change (drops / rises) ---------------------------------------------------------------


@pytest.mark.parametrize("after,fires", [(4, True), (5, False), (3, True)])
def test_grade_drop_by_at_least(after, fires):
    pol = policy("when: grade drops by 3 within 2 samples")
    out = fired(pol, [report(0, 100, grade=7), report(0, 125, grade=after)])
    assert bool(out) is fires
    if fires:
        assert f"fell from S7 to S{after}" in out[0].reason and "steps 100→125" in out[0].reason


def test_drop_compares_consecutive_samples_only():
    # 7 -> 5 -> 3: each step drops 2; within 2 samples no drop of 3, within 3 samples there is
    two = policy("when: grade drops by 3 within 2 samples")
    three = policy("when: grade drops by 3 within 3 samples")
    msgs = [report(0, 0, grade=7), report(0, 25, grade=5), report(0, 50, grade=3)]
    assert fired(two, msgs) == []
    assert [d.step for d in fired(three, msgs)] == [50]


def test_drop_within_steps_window():
    pol = policy("when: {signal: grade, drops_by: 3, within: 30 steps}")
    msgs = [report(0, 0, grade=7), report(0, 25, grade=6), report(0, 50, grade=4)]
    # at 50 the window [20, 50) holds only step 25 (grade 6): a drop of 2
    assert fired(pol, msgs) == []
    msgs = [report(0, 0, grade=7), report(0, 25, grade=7), report(0, 50, grade=4)]
    assert [d.step for d in fired(pol, msgs)] == [50]


def test_rises_by_boundary():
    pol = policy("when: max_logit rises by 10 within 2 samples")
    assert fired(pol, [report(0, 0, max_logit=5.0), report(0, 1, max_logit=14.99)]) == []
    assert fired(pol, [report(0, 0, max_logit=5.0), report(0, 1, max_logit=15.0)])


def test_drop_needs_a_previous_sample():
    pol = policy("when: grade drops by 3 within 2 samples")
    assert fired(pol, [report(0, 0, grade=2)]) == []


# --- trailing median ratio and z-score ----------------------------------------------------


def _losses(values, start=0):
    return [heartbeat(0, start + i, loss=v) for i, v in enumerate(values)]


def test_ratio_to_trailing_median_boundary():
    pol = policy("when: loss > 1.5 * median(10 steps)")
    base = _losses([2.0] * 10)
    assert fired(pol, base + [heartbeat(0, 10, loss=3.0)]) == []  # exactly 1.5x: not above
    out = fired(pol, base + [heartbeat(0, 10, loss=3.0001)])
    assert [d.step for d in out] == [10] and "1.50× its trailing median 2" in out[0].reason


def test_ratio_needs_a_full_window():
    pol = policy("when: loss > 1.5 * median(10 steps)")
    # 9 steps of history (1..9) only cover 9 of the 10 steps before step 10
    assert fired(pol, _losses([2.0] * 9, start=1) + [heartbeat(0, 10, loss=9.0)]) == []
    assert fired(pol, _losses([2.0] * 10, start=0) + [heartbeat(0, 10, loss=9.0)])


def test_samples_window_for_layer_signal_below_median():
    pol = policy("when: attn_entropy_min_norm < 0.5 * median(4)")  # bare 4: samples (layer signal)
    hist = [report(0, s * 25, attn_entropy_min_norm=v) for s, v in enumerate([0.8, 0.9, 0.7, 0.8])]
    assert fired(pol, hist[:3] + [report(0, 75, attn_entropy_min_norm=0.1)]) == []  # 3 samples only
    assert fired(pol, hist + [report(0, 100, attn_entropy_min_norm=0.4)]) == []  # 0.4 = 0.5 x 0.8
    out = fired(pol, hist + [report(0, 100, attn_entropy_min_norm=0.39)])
    assert out and out[0].signal == "attn_entropy_min_norm" and out[0].value == 0.39


def test_robust_z_score_boundary():
    noisy = [2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.0]  # median 2.0, MAD 0.1
    scale = 1.4826 * 0.1
    pol = policy("when: zscore(loss, 10 steps) > 4")
    assert fired(pol, _losses(noisy) + [heartbeat(0, 10, loss=2.0 + 3.99 * scale)]) == []
    assert fired(pol, _losses(noisy) + [heartbeat(0, 10, loss=2.0 + 4.01 * scale)])


def test_ratio_and_z_must_both_hold():
    pol = policy("when: {signal: loss, above_median: 1.2, z_above: 50, window: 10 steps}")
    noisy = [2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.0]
    assert fired(pol, _losses(noisy) + [heartbeat(0, 10, loss=3.0)]) == []  # 1.5x but z ~ 6.7
    assert fired(pol, _losses(noisy) + [heartbeat(0, 10, loss=12.0)])


def test_z_below_on_constant_window_is_infinite():
    pol = policy("when: zscore(attn_entropy_min, 3 samples) < -3")
    msgs = [report(0, s, attn_entropy_min=1.0) for s in range(3)]
    assert fired(pol, msgs + [report(0, 3, attn_entropy_min=1.0)]) == []
    assert fired(pol, msgs + [report(0, 3, attn_entropy_min=0.99)])


def test_trailing_ignores_non_finite_history():
    pol = policy("when: loss > 2 * median(5 steps)")
    msgs = _losses([2.0, math.nan, 2.0, 2.0, 2.0]) + [heartbeat(0, 5, loss=5.0)]
    assert [d.step for d in fired(pol, msgs)] == [5]


# --- non-finite, crash, hang --------------------------------------------------------------


@pytest.mark.parametrize(
    "value,fires",
    [(math.nan, True), (math.inf, True), (-math.inf, True), (1e308, False), (None, False)],
)
def test_nonfinite(value, fires):
    pol = policy("when: grad_norm is nonfinite")
    out = fired(pol, [heartbeat(0, 3, grad_norm=value)])
    assert bool(out) is fires


def test_nonfinite_is_not_caught_by_threshold_rules():
    pol = policy("when: loss > 3")
    assert fired(pol, [heartbeat(0, 1, loss=math.inf), heartbeat(0, 2, loss=math.nan)]) == []


@pytest.mark.parametrize("code,fires", [(0, False), (1, True), (-9, True), (137, True)])
def test_crash_on_nonzero_exit(code, fires):
    pol = policy("when: crash")
    out = fired(pol, [hello(0), heartbeat(0, 40), exit_(0, code)])
    assert bool(out) is fires
    if fires:
        assert out[0].signal == "exit_code" and out[0].value == code
        assert out[0].step == 40  # step -1 in the exit message: the rank's last known step


def test_crash_before_any_step_is_not_hidden_by_warm_in():
    pol = policy("when: crash", warm_in="300 steps")
    assert fired(pol, [exit_(1, 1)])


@pytest.mark.parametrize("age,fires", [(299.0, False), (300.0, True)])
def test_hang_minimum_age(age, fires):
    pol = policy("when: hang > 5m")
    assert bool(fired(pol, [hang(0, age)])) is fires


def test_hang_true_fires_on_any_hang_message():
    out = fired(policy("when: hang"), [heartbeat(1, 7), hang(1, 61.0)])
    assert out and out[0].rank == 1 and out[0].signal == "heartbeat_age" and "61 s" in out[0].reason


# --- all / any ----------------------------------------------------------------------------


def test_all_needs_every_condition_on_the_same_message():
    pol = policy("when: {all: [{signal: grade, below: S4}, {signal: loss, above: 3}]}")
    assert fired(pol, [report(0, 1, grade=3, loss=2.0)]) == []
    assert fired(pol, [report(0, 1, grade=5, loss=4.0)]) == []
    out = fired(pol, [report(0, 1, grade=3, loss=4.0)])
    assert out and " and " in out[0].reason


def test_any_fires_on_whichever_message_carries_its_condition():
    pol = policy("when: crash or loss is nonfinite")
    assert [d.signal for d in fired(pol, [heartbeat(0, 1, loss=math.nan)])] == ["loss"]
    assert [d.signal for d in fired(pol, [exit_(0, 3)])] == ["exit_code"]
    assert fired(pol, [heartbeat(0, 1), exit_(0, 0)]) == []


def test_nested_groups_in_compact_form():
    pol = policy("when: (grade < S2 or max_logit > 100) and loss > 5")
    assert fired(pol, [report(0, 1, grade=1, loss=4.0)]) == []
    assert fired(pol, [report(0, 1, grade=6, max_logit=101.0, loss=6.0)])


# --- layers -------------------------------------------------------------------------------

LAYERS = {
    "blocks.0.attn": {"attn_entropy_min_norm": 0.9},
    "blocks.1.attn": {"attn_entropy_min_norm": 0.2},
    "blocks.0": {"grade": 6},
    "blocks.1": {"grade": 2},
}


def test_layer_glob_selects_layers():
    assert (
        fired(
            policy("when: attn_entropy_min_norm < 0.5\nlayers: 'blocks.0.*'"),
            [report(0, 1, LAYERS)],
        )
        == []
    )
    out = fired(
        policy("when: attn_entropy_min_norm < 0.5\nlayers: ['blocks.1.*']"), [report(0, 1, LAYERS)]
    )
    assert [d.layer for d in out] == ["blocks.1.attn"]


def test_summary_is_used_without_layers_and_names_the_worst_layer():
    out = fired(policy("when: grade < S3"), [report(0, 1, LAYERS)])
    assert out and out[0].layer == "blocks.1" and out[0].value == 2


def test_per_layer_drop_is_seen_even_when_the_summary_does_not_move():
    a = {"blocks.0": {"grade": 7}, "blocks.1": {"grade": 4}}
    b = {"blocks.0": {"grade": 4}, "blocks.1": {"grade": 4}}
    msgs = [report(0, 0, a), report(0, 25, b)]
    assert fired(policy("when: grade drops by 3 within 2 samples"), msgs) == []
    out = fired(policy("when: grade drops by 3 within 2 samples\nlayers: '*'"), msgs)
    assert [d.layer for d in out] == ["blocks.0"]


@pytest.mark.parametrize(
    "rule",
    [
        "{signal: loss, above_median: 1.3, window: 6 steps}",
        "{signal: loss, above_median: 1.3, z_above: 2, window: 6 steps}",
        "{signal: loss, below_median: 0.5, window: 6 steps}",
        "{signal: loss, below_median: 0.7, z_below: 1, window: 6 steps}",
        "{signal: loss, z_above: 3, window: 6 steps}",
    ],
)
def test_the_min_max_quick_exit_never_changes_a_decision(rule, monkeypatch):
    """Random streams (negative, zero, constant and spiking values included) give the same
    decisions, with the same reasons, with and without the quick exit on the window's min/max."""
    import random

    from spikeguard.policies import evaluate as ev

    rng = random.Random(7)
    streams = []
    for _ in range(60):
        base = rng.choice([2.0, 0.0, -1.0, 1e-9])
        vals = [
            rng.choice([base, base * rng.uniform(0.2, 3.0) + rng.gauss(0, 0.3)]) for _ in range(40)
        ]
        streams.append([heartbeat(0, s, loss=v) for s, v in enumerate(vals)])
    pol = policy(f"when: {rule}")

    def decisions() -> list[tuple[int, str]]:
        return [(d.step, d.reason) for msgs in streams for d in fired(pol, msgs)]

    quick = decisions()
    monkeypatch.setattr(ev, "_beyond_median_impossible", lambda *a: False)
    assert quick == decisions()
    assert quick  # the streams do fire: the comparison is not vacuous


def test_a_series_gives_exactly_the_points_before_a_step():
    import random

    from spikeguard.policies.evaluate import Series

    rng = random.Random(7)
    for _ in range(300):
        s = Series(rng.randint(1, 12))
        step = rng.randint(-3, 5)
        for _ in range(rng.randint(0, 20)):
            step += rng.randint(0, 3)  # repeated steps are dropped by add()
            s.add(step, rng.random())
        for query in range(step - 15, step + 3):
            assert s.before(query) == [p for p in s.points if p[0] < query], (list(s.points), query)


def test_a_series_window_holds_the_finite_values_of_the_window_points():
    """The values a trailing rule reads (:meth:`Series.window`, sliced from the value deque) are
    the finite values of the window's points as :func:`_window` selects them from the (step,
    value) pairs, with the same None while the window is not full; NaN and infinities that come
    in and leave the deque included."""
    import math
    import random

    from spikeguard.policies.evaluate import Series, _window

    rng = random.Random(11)
    checked = 0
    for _ in range(400):
        s = Series(rng.randint(1, 12))
        step = rng.randint(-3, 5)
        for _ in range(rng.randint(0, 25)):
            step += rng.randint(0, 3)
            s.add(step, rng.choice([rng.random(), rng.random(), math.nan, math.inf, -math.inf]))
        assert s.nonfinite == sum(not math.isfinite(v) for _, v in s.points)
        for query in range(step - 15, step + 3):
            for size, unit, full in [
                (rng.randint(1, 10), rng.choice(["steps", "samples"]), rng.random() < 0.5)
                for _ in range(3)
            ]:
                pts = _window(s, query, size, unit, full)
                want = None if pts is None else [v for _, v in pts if math.isfinite(v)]
                assert s.window(query, size, unit, full) == want, (s.points, query, size, unit)
                checked += want is not None and len(want) > 1
    assert checked > 1000  # most windows are not empty: the comparison is not vacuous


@pytest.mark.parametrize(
    "rules",
    [
        "  - {name: r, when: {signal: loss, above_median: 1.3, z_above: 3, window: 6 steps},"
        " for: 2 steps, action: notify}",
        "  - {name: r, when: {signal: loss, below_median: 0.8, window: 4 samples}, action: notify}",
        "  - {name: r, when: loss is nonfinite, ranks: {fraction: 0.5}, action: notify}\n"
        "  - {name: q, when: loss > 2.5, ranks: {at_least: 2}, for: 2 samples, action: notify}",
        "  - {name: r, when: loss > 2.5, ranks: all, action: notify}",
    ],
)
def test_the_engine_decides_as_its_straightforward_form_on_random_streams(rules, monkeypatch):
    """Random streams of several ranks (NaNs, spikes, steps skipped, a relaunch) give the same
    decisions with the engine's fast paths (window values sliced in C, the ranks that hold a
    rule kept up to date per message) and with their straightforward forms (the points
    filtered in Python; every rank's instances scanned on every message)."""
    import math
    import random

    from spikeguard.policies import engine as eng
    from spikeguard.policies import evaluate as ev
    from spikeguard.policies.loader import load_policy_text

    pol = load_policy_text(f"version: 1\nname: t\nwarm_in: 0 steps\nrules:\n{rules}\n", "t.yaml")
    rng = random.Random(5)
    msgs = []
    for gen, steps in ((0, range(0, 60)), (1, range(30, 70))):
        for s in steps:
            if rng.random() < 0.1:
                continue
            for r in range(4):
                v = rng.choice([2.0 + rng.gauss(0, 0.1)] * 6 + [4.0, 1.0, math.nan])
                msgs.append(dict(heartbeat(r, s, loss=v), gen=gen))

    def decisions() -> list[tuple]:
        return [(d.rule, d.rank, d.step, d.reason) for d in eng.replay(pol, msgs)]

    fast = decisions()

    def slow_window(self, step, size, unit, need_full):
        pts = ev._window(self, step, size, unit, need_full)
        return None if pts is None else [v for _, v in pts if math.isfinite(v)]

    monkeypatch.setattr(ev.Series, "window", slow_window)
    original = eng.Engine._evaluate

    def evaluate_scanning(self, c, m):
        out = original(self, c, m)
        holding = self._holding.get(c.index)
        if holding is not None:  # recomputed from every rank's instances: must be the same
            scanned = {}
            for r in sorted(self._ranks):
                ready = [i for i in self._instances.get((c.index, r), {}).values() if i.ready]
                if ready:
                    scanned[r] = ready[0].hit
            assert holding == scanned
        return out

    monkeypatch.setattr(eng.Engine, "_evaluate", evaluate_scanning)
    assert decisions() == fast
    assert fast  # the streams do fire: the comparison is not vacuous


def test_a_series_extremes_bound_its_finite_values_and_are_exact_when_asked():
    import math
    import random

    from spikeguard.policies.evaluate import Series

    rng = random.Random(13)
    for _ in range(300):
        s = Series(rng.randint(1, 10))
        for step in range(rng.randint(0, 40)):
            s.add(step, rng.choice([rng.uniform(-5, 5), rng.uniform(-5, 5), math.nan, math.inf]))
            finite = [v for _, v in s.points if math.isfinite(v)]
            kept = s.extremes()
            if not finite:  # bounds of values let go may remain: still bounds of a superset
                assert s.extremes(exact=True) is None
                continue
            assert kept is not None and kept[0] <= min(finite) and kept[1] >= max(finite)
            if rng.random() < 0.3:
                assert s.extremes(exact=True) == (min(finite), max(finite)) and s.exact
