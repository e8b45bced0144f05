"""``median_of``: a trailing test on the median of the latest values (a climb that noise hides
step by step, with a blip of a step or two ignored)."""

from __future__ import annotations

import random

import pytest
from spikeguard.policies import PolicyError, load_policy_text, replay
from spikeguard.policies.explain import explain
from spikeguard.policies.testing import heartbeat, hello

CLIMB = """
version: 1
name: climb
rules:
  - name: loss-climb
    when: {signal: loss, above_median: 1.1, median_of: 20 steps, window: 200 steps}
    action: recover
"""


def noisy(steps: int, level=lambda s: 2.0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [hello(0)] + [
        heartbeat(0, s, loss=level(s) * (1 + rng.gauss(0, 0.08))) for s in range(steps)
    ]


def decisions(msgs: list[dict]) -> list[tuple[str, int]]:
    return [(d.rule, d.step) for d in replay(load_policy_text(CLIMB, "t"), msgs)]


def test_a_climb_hidden_in_step_noise_fires_once_its_median_has_moved() -> None:
    # 8 % noise per step; from step 400 the level rises 0.3 nats over 100 steps
    msgs = noisy(600, lambda s: 2.0 + max(0.0, min(0.3, (s - 400) * 0.003)))
    (rule, step), *_ = decisions(msgs)
    assert rule == "loss-climb" and 450 <= step <= 520


def test_a_blip_of_two_steps_moves_no_median() -> None:
    msgs = noisy(600)
    for m in msgs:
        if m.get("step") in (400, 401):
            m["loss"] *= 5
    assert decisions(msgs) == []


def test_flat_noise_never_fires() -> None:
    for seed in range(5):
        assert decisions(noisy(1500, seed=seed)) == []


def test_the_window_before_the_recent_values_must_be_full() -> None:
    msgs = [hello(0)] + [heartbeat(0, s, loss=2.0 if s < 150 else 3.0) for s in range(215)]
    assert decisions(msgs) == []  # 215 steps: never 200 steps before a full 20-step span
    msgs += [heartbeat(0, s, loss=3.0) for s in range(215, 240)]
    assert decisions(msgs)[0][0] == "loss-climb"


def test_median_of_counts_in_the_window_s_unit() -> None:
    bad = CLIMB.replace("median_of: 20 steps", "median_of: 2 samples")
    with pytest.raises(PolicyError, match="median_of"):
        load_policy_text(bad, "t")


def test_explain_says_it_is_a_median_of_the_latest_values() -> None:
    text = explain(load_policy_text(CLIMB, "t"))
    assert "the median of the loss over the last 20 steps" in text
    assert "the median over the 200 steps before them" in text
