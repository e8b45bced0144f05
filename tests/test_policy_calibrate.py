"""``spikeguard policy calibrate``: the search's direction per knob shape on tiny synthetic
streams, and the whole command on the recorded runs (tests/data/stable_run, demo_run).

The synthetic streams have one excursion each, of a size the test knows, so the tightest silent
value is known to within the search's tolerance: a search that moved a knob the wrong way would
bracket nothing (or the wrong side) and miss it. The recorded runs take about 4 s for the whole
command (a dozen replays per rule, each a few tens of ms); the search is bounded by
``Settings.max_iterations`` (12) and ``max_expansions`` (12), so it stays there.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from spikeguard.policies import load_policy, load_policy_text, replay
from spikeguard.policies.calibrate import (
    Run,
    Settings,
    calibrate,
    calibrate_rule,
    knobs,
    render_policy,
)
from spikeguard.policies.testing import heartbeat, report
from spikeguard.supervisor.cli import main

DATA = Path(__file__).resolve().parent / "data"
STABLE, DEMO = DATA / "stable_run", DATA / "demo_run"
SETTINGS = Settings()
TOL = SETTINGS.tolerance


def policy(when: str, **rule: str):
    extra = "".join(f"\n    {k}: {v}" for k, v in rule.items())
    return load_policy_text(
        f"""
version: 1
name: synthetic
warm_in: 0 steps
rules:
  - name: r
    when: "{when}"
    action: recover{extra}
"""
    )


def one(pol, messages, **settings):
    """Calibrate the policy's one rule on one stable stream: (knob result, rule result)."""
    res = calibrate_rule(pol, 0, [Run("s", messages)], [], Settings(**settings))
    assert len(res.knobs) == 1
    return res.knobs[0], res


def silent_on(pol, messages) -> bool:
    return not [d for d in replay(pol, messages) if not d.resolved]


def with_rule(pol, rule):
    return pol.model_copy(update={"rules": [rule]})


def entropy_stream(values):
    return [report(0, 10 * i, attn_entropy_min_norm=v) for i, v in enumerate(values)]


# --- the direction of each knob shape -------------------------------------------------------


@pytest.mark.parametrize("base", [0.7, 0.3])  # too tight (fires on the dip), and too loose
def test_below_median_is_looser_when_smaller(base):
    msgs = entropy_stream([1.0] * 8 + [0.6] + [1.0] * 8)  # one dip to 0.6x its median
    pol = policy(f"attn_entropy_min_norm < {base} * median(5 samples)")
    k, res = one(pol, msgs)
    assert k.search.status == "calibrated"
    assert (k.search.base_firing is not None) == (base > 0.6)
    assert 0.6 * (1 - TOL) <= k.silent <= 0.6  # v < k * median fires for k > 0.6 only
    assert k.proposed == pytest.approx(k.silent / 1.25, rel=0.01) and k.proposed < k.silent
    assert res.verified and silent_on(with_rule(pol, res.rule), msgs)


@pytest.mark.parametrize("base", [1.2, 2.0])
def test_above_median_is_looser_when_larger(base):
    losses = [2.0] * 30 + [2.8] + [2.0] * 30  # one spike to 1.4x the median
    msgs = [heartbeat(0, s, loss=v) for s, v in enumerate(losses)]
    pol = policy(f"loss > {base} * median(10 steps)")
    k, res = one(pol, msgs)
    assert k.search.status == "calibrated"
    assert 1.4 <= k.silent <= 1.4 * (1 + TOL)
    assert k.proposed == pytest.approx(1 + (k.silent - 1) * 1.25, rel=0.01)
    assert k.proposed > k.silent
    assert res.verified and silent_on(with_rule(pol, res.rule), msgs)


def test_z_above_is_looser_when_larger():
    losses = [2.0 + 0.2 * (s % 2) for s in range(60)]
    losses[40] = 2.6
    msgs = [heartbeat(0, s, loss=v) for s, v in enumerate(losses)]
    worst = 0.0  # the largest robust z-score over a 20-step window, computed here
    for s in range(20, len(losses)):
        window = losses[s - 20 : s]
        med = statistics.median(window)
        mad = 1.4826 * statistics.median(abs(x - med) for x in window)
        worst = max(worst, (losses[s] - med) / mad)
    assert 3 < worst < 4
    pol = policy("zscore(loss, 20 steps) > 2")
    k, res = one(pol, msgs)
    assert k.search.status == "calibrated" and k.search.base_firing is not None
    assert worst < k.silent <= worst * (1 + TOL)  # z >= k fires: silent just above the worst
    assert k.proposed == pytest.approx(k.silent * 1.25, rel=0.01)
    assert res.verified and silent_on(with_rule(pol, res.rule), msgs)


def test_drops_by_is_looser_when_larger():
    msgs = entropy_stream([0.9] * 5 + [0.6] + [0.9] * 5)  # one drop of 0.3
    pol = policy("attn_entropy_min_norm drops by 0.1 within 2 samples")
    k, res = one(pol, msgs)
    assert k.search.status == "calibrated" and k.search.base_firing is not None
    assert 0.3 < k.silent <= 0.3 * (1 + TOL)
    assert k.proposed == pytest.approx(k.silent * 1.25, rel=0.01)
    assert res.verified


def test_a_grade_drop_is_whole_grades():
    msgs = [report(0, 10 * i, grade=g) for i, g in enumerate([7] * 4 + [5] + [7] * 4)]
    k, res = one(policy("grade drops by 1 within 2 samples"), msgs)
    assert k.search.status == "calibrated"
    assert k.silent == 3  # a drop of 2 is the largest: 3 is the tightest whole grade silent
    assert k.proposed == 4  # 3 x 1.25 = 3.75, rounded up: the loose way
    assert res.verified


@pytest.mark.parametrize("base", ["S5", "S2"])
def test_a_grade_threshold_below_is_looser_when_lower(base):
    msgs = [report(0, 10 * i, grade=g) for i, g in enumerate([6] * 4 + [4] + [6] * 4)]
    pol = policy(f"grade < {base}")
    k, _ = one(pol, msgs)
    assert k.search.status == "calibrated"
    assert k.silent == 4  # grade < S4 never holds; grade < S5 holds on the dip
    assert k.proposed == 3  # 4 - 4 x 0.25 = 3
    text = render_policy(_one_rule_calibration(pol, msgs), None, [])
    assert "S3" in text and load_policy_text(text).rules[0].when.below == 3


def test_a_threshold_above_is_looser_when_higher():
    msgs = [report(0, 10 * i, max_logit=30.0 if i == 5 else 10.0) for i in range(10)]
    k, res = one(policy("max_logit > 20"), msgs)
    assert k.search.status == "calibrated" and k.search.base_firing is not None
    assert 30 <= k.silent <= 30 * (1 + TOL)
    assert k.silent * 1.25 <= k.proposed <= k.silent * 1.25 * 1.01
    assert res.verified


def test_two_knobs_of_one_test_end_silent_together():
    losses = [2.0 + 0.2 * (s % 2) for s in range(60)]
    losses[40] = 2.6
    msgs = [heartbeat(0, s, loss=v) for s, v in enumerate(losses)]
    pol = policy("loss > 1.05 * median(20 steps) and zscore(loss, 20 steps) > 1")
    res = calibrate_rule(pol, 0, [Run("s", msgs)], [], SETTINGS)
    assert [k.knob.field for k in res.knobs] == ["above_median", "z_above"]
    assert res.verified and silent_on(with_rule(pol, res.rule), msgs)


def test_a_rule_the_runs_never_exercise_keeps_its_base():
    msgs = [heartbeat(0, s, loss=2.0) for s in range(50)]
    k, res = one(policy("loss > 3", warm_in="1000 steps"), msgs)
    assert k.search.status == "never fires" and k.proposed == 3 and k.silent is None
    assert not res.changed


def test_a_rule_its_knob_cannot_silence_says_so():
    msgs = [heartbeat(0, s, loss=2.0) for s in range(20)] + [heartbeat(0, 20, loss=math.nan)]
    k, res = one(policy("loss > 3 or loss is nonfinite"), msgs)
    assert k.search.status == "cannot be silenced" and k.proposed == 3
    assert not res.verified


def test_rules_without_a_knob_are_kept():
    pol = load_policy("default")
    counts = {r.name: len(knobs(r.when)) for r in pol.rules}
    assert counts["crash"] == counts["hang"] == counts["non-finite-loss"] == 0


def _one_rule_calibration(pol, msgs):
    return calibrate(pol, [Run("s", msgs)], settings=SETTINGS)


# --- the command on the recorded runs ---------------------------------------------------------


def first_incident_step(run_dir: Path) -> int:
    """The onset of the recorded divergence: the step of the first incident its journal has."""
    for line in (run_dir / "journal.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "incident":
            return int(event["step"])
    raise AssertionError("the demo run's journal has no incident")


def messages(run_dir: Path) -> list[dict]:
    with gzip.open(run_dir / "reports.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """``spikeguard policy calibrate`` run once, as a user runs it (the entry point)."""
    out = tmp_path_factory.mktemp("calibrate") / "my-policy.yaml"
    onset = first_incident_step(DEMO)
    cli = Path(sys.executable).with_name("spikeguard")
    res = subprocess.run(
        [str(cli), "policy", "calibrate", "--stable", str(STABLE)]
        + ["--diverging", f"{DEMO}@{onset}", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res, out, onset


def test_calibrate_writes_a_policy_that_checks_and_loads(calibrated, capsys):
    res, out, _ = calibrated
    assert res.returncode == 0, res.stderr
    assert main(["policy", "check", str(out)]) == 0
    assert "ok" in capsys.readouterr().out
    proposed = load_policy(str(out))
    assert proposed.name == "default-calibrated"
    assert [r.name for r in proposed.rules] == [r.name for r in load_policy("default").rules]
    text = out.read_text()
    assert "calibrated by `spikeguard policy calibrate`" in text
    # a progress line per rule, and the proposed policy's replay of each input
    progress = [line for line in res.stderr.splitlines() if re.match(r"\[\d+/\d+\] ", line)]
    assert len(progress) == len(proposed.rules)
    assert f"{STABLE} (stable): silent" in res.stdout


def test_the_proposal_is_silent_on_the_stable_run_and_fires_on_the_divergence(calibrated):
    res, out, onset = calibrated
    assert res.returncode == 0, res.stderr
    proposed = load_policy(str(out))
    assert [d for d in replay(proposed, messages(STABLE)) if not d.resolved] == []
    demo = messages(DEMO)
    first_gen = min(m["gen"] for m in demo if isinstance(m.get("gen"), int))
    acted = [d for d in replay(proposed, demo) if d.action in ("recover", "stop")]
    assert acted, res.stdout
    # the recorded first generation ends where the supervisor recovered it (the onset): a
    # recovery in it is one at or before the onset, on the divergence itself
    assert acted[0].generation == first_gen and acted[0].step <= onset
    assert f"diverging, onset {onset}" in res.stdout


def test_an_existing_out_file_is_kept_unless_forced(tmp_path, capsys):
    msgs = [heartbeat(0, s, loss=v) for s, v in enumerate([2.0] * 30 + [2.8] + [2.0] * 30)]
    stream = tmp_path / "stable.jsonl"
    stream.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    base = tmp_path / "base.yaml"
    base.write_text(
        "version: 1\nname: mine\nwarm_in: 0 steps\nrules:\n"
        "  - name: spike\n    when: loss > 1.2 * median(10 steps)\n    action: recover\n"
    )
    out = tmp_path / "out.yaml"
    out.write_text("keep me")
    args = ["policy", "calibrate", str(base), "--stable", str(stream), "--out", str(out)]
    assert main(args) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "keep me"
    assert main([*args, "--force"]) == 0
    written = load_policy(str(out))
    assert 1.5 <= written.rules[0].when.above_median <= 1.52  # 1 + (1.4 - 1) x 1.25
    assert "above_median: base 1.2" in out.read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--diverging", f"{DEMO}@soon"], "RUN@ONSET"),
        (["--diverging", str(DEMO)], "RUN@ONSET"),
        (["--diverging", f"{DATA / 'nowhere'}@100"], "no such file"),
        (["--margin", "0.5"], "--margin"),
    ],
)
def test_bad_input_exits_2(extra, message, tmp_path, capsys):
    args = ["policy", "calibrate", "--stable", str(STABLE), "--out", str(tmp_path / "p.yaml")]
    assert main([*args, *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


def test_a_missing_stable_run_exits_2(tmp_path, capsys):
    args = ["policy", "calibrate", "--stable", str(tmp_path / "none"), "--out", str(tmp_path / "p")]
    assert main(args) == 2
    assert "no such file" in capsys.readouterr().err
