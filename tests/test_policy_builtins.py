"""The built-in policies on recorded runs of the example and on synthetic incidents."""

from __future__ import annotations

import gzip
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from spikeguard.policies import BUILTINS, RecoverySettings, load_policy, replay
from spikeguard.policies.explain import explain
from spikeguard.policies.testing import exit_, hang, heartbeat, hello, report
from spikeguard.workers.contract.signals import LAYER_SIGNALS

DATA = Path(__file__).resolve().parent / "data" / "policies"


def recorded(name: str) -> list[dict]:
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_policy_signals_are_the_worker_contract():
    import typing

    from spikeguard.policies.values import Signal
    from spikeguard.workers.contract import signals as contract

    # the policy language accepts exactly the signals the contract names, in its order
    literal = typing.get_args(Signal)[0]
    assert typing.get_args(literal) == contract.SIGNALS
    assert LAYER_SIGNALS is contract.LAYER_SIGNALS


def test_policies_import_neither_ray_nor_torch_nor_the_supervisor():
    # from the workers, only their torch-free contract (the shared vocabulary) may be imported,
    # with the package itself (which loads its torch modules lazily)
    code = (
        "import sys, spikeguard.policies, spikeguard.policies.commands, "
        "spikeguard.policies.testing; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'torch') "
        "or m.startswith('spikeguard.supervisor') or (m.startswith('spikeguard.workers') "
        "and m not in ('spikeguard.workers', 'spikeguard.workers.lazy') "
        "and not m.startswith('spikeguard.workers.contract'))]; "
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_recovery_defaults_are_the_supervisor_contract():
    assert RecoverySettings().model_dump() == {
        "min_grade": 4,
        "min_steps_back": 0,
        "fallback_on_corrupt": True,
        "lr_factors": [0.5],
        "reset_optimizer": True,
        "skip_window": 0,
        "skip_by": "steps",
        "probation_steps": 1000,
        "max_attempts": 3,
        "max_incidents": 10,
        "on_exhausted": "stop",
        "grade_baseline": "run",
        "recur_window_steps": 2,
        "recur_tolerance": 0.001,
        "rewarm_steps": 50,
        "probation_kinds": "own",
        "lr_restore_steps": 0,
    }


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_loads_and_explains(name):
    pol = load_policy(name)
    assert pol.name == name and pol.description
    text = explain(pol)
    assert all(rule.name in text for rule in pol.rules)
    # every built-in reacts to NaNs, crashes and hangs by recovering
    recover_signals = {s for r in pol.rules if r.action == "recover" for s in r.when.signals()}
    assert "loss" in recover_signals
    cadences = set().union(*(r.when.cadence() for r in pol.rules if r.action == "recover"))
    assert {"exit", "hang"} <= cadences


def test_default_does_not_rely_on_the_grade_alone():
    pol = load_policy("default")
    recover = {s for r in pol.rules if r.action == "recover" for s in r.when.signals()}
    assert {"grade", "attn_entropy_min_norm", "loss", "grad_norm"} <= recover
    assert 200 <= pol.warm_in.value <= 500


# --- recorded runs of examples/gpt_diverge.py ---------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_no_builtin_fires_on_the_stable_control(name):
    msgs = recorded("gpt_diverge_stable_seed0.jsonl.gz")
    assert len(msgs) > 2000
    assert replay(load_policy(name), msgs) == []


def test_default_recovers_the_diverging_run_as_its_loss_rises():
    msgs = recorded("gpt_diverge_seed0.jsonl.gz")
    out = [d for d in replay(load_policy("default"), msgs) if d.action == "recover"]
    assert len(out) == 1
    d = out[0]
    # on this recording the heads were already sharp (entropy 0.24 -> 0.09): the entropy only
    # warned (entropy-low), and the loss climb recovered
    assert (d.rule, d.action, d.signal) == ("loss-climb", "recover", "loss")
    warned = [w for w in replay(load_policy("default"), msgs) if w.rule == "entropy-low"]
    assert warned and warned[0].step < d.step
    # where the loss starts to rise: the 50-step mean exceeds its best so far by 0.3 nats
    losses = [(m["step"], m["loss"]) for m in msgs if m["type"] in ("heartbeat", "report")]
    best, rise = math.inf, None
    for i in range(50, len(losses)):
        mean = sum(v for _, v in losses[i - 50 : i]) / 50
        if mean > best + 0.3:
            rise = losses[i][0]
            break
        best = min(best, mean)
    # the loss climb trails the rise of the 50-step mean by less than the 50 steps it spans
    assert rise is not None and rise - 50 < d.step < rise + 50, (d.step, rise)


# --- synthetic incidents ------------------------------------------------------------------


def healthy(steps: int, seed: int, ranks: int = 2, sample_every: int = 25) -> list[dict]:
    """Noisy but healthy: loss decays with 5 % noise, entropy drifts down slowly, grade 5..7."""
    rng = random.Random(seed)
    msgs = [hello(r, world_size=ranks) for r in range(ranks)]
    for s in range(steps):
        for r in range(ranks):
            loss = (2.0 + 3.0 * math.exp(-s / 300)) * (1 + rng.gauss(0, 0.05))
            if s % sample_every == 0:
                layers = {
                    f"blocks.{i}": {
                        "grade": rng.choice([5, 6, 7]) if s > 200 else rng.choice([2, 7]),
                        "erank_ratio": 0.7,
                    }
                    for i in range(3)
                }
                layers.update(
                    {
                        f"blocks.{i}.attn": {
                            "attn_entropy_min_norm": max(0.3, 1 - s / 5000)
                            * rng.uniform(0.85, 1.0),
                            "max_logit": 5 + s / 100,
                        }
                        for i in range(3)
                    }
                )
                msgs.append(report(r, s, layers, loss=loss))
            else:
                msgs.append(heartbeat(r, s, loss=loss))
    return msgs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_is_quiet_on_healthy_noise(seed):
    assert replay(load_policy("default"), healthy(1500, seed)) == []


def _first(msgs: list[dict]) -> tuple[str, int, int | None]:
    out = replay(load_policy("default"), msgs)
    assert out, "nothing fired"
    return out[0].rule, out[0].step, out[0].rank


def test_default_catches_a_loss_spike():
    msgs = healthy(1000, 0)
    for m in msgs:
        if m.get("rank") == 1 and m.get("step", 0) >= 900 and m.get("loss") is not None:
            m["loss"] *= 1.6
    assert _first(msgs) == ("loss-spike", 902, 1)


def test_default_ignores_a_single_step_blip():
    msgs = healthy(1000, 0)
    for m in msgs:
        if m.get("step") in (900, 901) and m.get("loss") is not None:
            m["loss"] *= 3
    assert replay(load_policy("default"), msgs) == []


def test_default_warns_on_an_entropy_collapse_alone_and_recovers_when_the_loss_agrees():
    msgs = healthy(1000, 1)
    for m in msgs:
        if m["type"] == "report" and m["rank"] == 0 and m["step"] >= 800:
            m["layers"]["blocks.2.attn"]["attn_entropy_min_norm"] = 0.05
    out = replay(load_policy("default"), msgs)
    assert (out[0].rule, out[0].action, out[0].step, out[0].rank) == (
        "entropy-low",
        "notify",
        825,
        0,
    )
    assert {d.action for d in out} == {"notify"}  # healthy heads sharpen: alone it only warns
    rng = random.Random(7)
    for m in msgs:  # a flat, noisy loss from step 500 that turns 4 % upward at 760 (no climb yet)
        if m["rank"] == 0 and m.get("step", 0) >= 500 and m.get("loss") is not None:
            m["loss"] = 2.3 * (1.04 if m["step"] >= 760 else 1.0) * (1 + rng.gauss(0, 0.02))
    first = next(d for d in replay(load_policy("default"), msgs) if d.action == "recover")
    assert (first.rule, first.step, first.rank) == ("entropy-collapse", 825, 0)
    msgs = healthy(1000, 1)
    for m in msgs:
        if m["type"] == "report" and m["rank"] == 1 and m["step"] >= 800:
            m["layers"]["blocks.1"]["grade"] = 2
    assert _first(msgs)[0] == "grade-drop"


def test_default_grade_alarm_waits_for_warm_in():
    msgs = [report(0, s, grade=2) for s in range(0, 300, 25)]
    assert replay(load_policy("default"), msgs) == []
    rule = [
        d.rule
        for d in replay(
            load_policy("default"), msgs + [report(0, 300, grade=2), report(0, 325, grade=2)]
        )
    ]
    assert rule == ["grade-low"]


def test_default_nan_and_inf():
    assert _first([heartbeat(0, 10, loss=math.nan)]) == ("non-finite-loss", 10, 0)
    one_inf = [heartbeat(0, 10, grad_norm=math.inf), heartbeat(0, 11)]
    assert replay(load_policy("default"), one_inf) == []  # a loss scaler's skipped step
    assert _first([heartbeat(0, s, grad_norm=math.inf) for s in range(10, 13)]) == (
        "non-finite-grad-norm",
        12,
        0,
    )


def test_default_crash_and_hang():
    assert _first([hello(0, world_size=2), hello(1, world_size=2), exit_(1, 1)])[0] == "crash"
    assert _first([hello(0), heartbeat(0, 3), hang(0, 65.0)]) == ("hang", 3, 0)


def test_the_readme_example_is_a_valid_policy_using_every_condition_kind():
    import re

    from spikeguard.policies import load_policy_text

    text = (Path(__file__).resolve().parents[1] / "policies" / "README.md").read_text()
    pol = load_policy_text(re.search(r"```yaml\n(.*?)```", text, re.S).group(1), "README.md")
    kinds = {type(leaf).__name__ for r in pol.rules for leaf in r.when.leaves()}
    assert kinds == {"Threshold", "Change", "Trailing", "NonFinite", "Crash", "Hang"}
    assert {r.action for r in pol.rules} == {"notify", "recover", "checkpoint", "stop"}
    assert explain(pol)
