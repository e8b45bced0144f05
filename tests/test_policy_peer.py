"""The peer comparison (``above_peer_median``) and the built-ins' ``straggler`` rule, on synthetic
streams of 2 and 4 ranks (pure: no Ray, no clock)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from spikeguard.policies import BUILTINS, Engine, PolicyError, load_policy, load_policy_text, replay
from spikeguard.policies.engine import Decision
from spikeguard.policies.explain import explain
from spikeguard.policies.testing import heartbeat, hello, report

BASE = 0.1
"""A healthy rank's step time (seconds)."""


def _policy(rule: str = "", **extra: str) -> str:
    when = extra.get("when", "{signal: step_time, above_peer_median: 1.3}")
    return (
        "version: 1\nname: peers\nrules:\n  - name: straggler\n"
        f"    when: {when}\n    for: 50 steps\n    action: {extra.get('action', 'notify')}\n" + rule
    )


POLICY = load_policy_text(_policy(), "peers.yaml")


def stream(
    ranks: int,
    steps: int,
    time_of=lambda rank, step: BASE,
    *,
    gen: int = 0,
    start: int = 0,
    hosts: bool = True,
    skip=lambda rank, step: False,
) -> list[dict]:
    """``ranks`` ranks of one generation, each step's heartbeats in rank order (a report every
    25 steps), with ``time_of(rank, step)`` as their step_time (None: not measured)."""
    out = [
        {**hello(r, world_size=ranks, step=start, gen=gen), "host": f"node-{r}"}
        for r in range(ranks)
        if hosts
    ]
    t = 1.7e9
    for s in range(start, start + steps):
        # the job's pace: every rank waits for the slowest, whose forward is half its step
        t += 2 * max((time_of(r, s) or BASE) for r in range(ranks))
        for r in range(ranks):
            if skip(r, s):
                continue
            make = report if s % 25 == 0 else heartbeat
            out.append({**make(r, s, step_time=time_of(r, s), gen=gen), "t": t})
    return out


def slow_from(rank: int, n: int, factor: float):
    return lambda r, s: BASE * (factor if r == rank and s >= n else 1.0)


def fired(decisions: list[Decision]) -> list[tuple[int | None, int]]:
    return [(d.rank, d.step) for d in decisions if not d.resolved and not d.repeated]


@pytest.mark.parametrize("ranks,slow", [(2, 1), (4, 2), (4, 0)])
@pytest.mark.parametrize("name", ["peers", *BUILTINS])
def test_a_rank_at_1_5x_fires_once_for_that_rank_naming_it_and_its_host(ranks, slow, name):
    pol = POLICY if name == "peers" else load_policy(name)
    n = 200
    out = [
        d for d in replay(pol, stream(ranks, 600, slow_from(slow, n, 1.5))) if d.rule == "straggler"
    ]
    assert fired(out) == [(slow, out[0].step)]
    # 50 steps of persistence, after the 5-step median has moved (3 of its 5 values slow)
    assert n + 49 <= out[0].step <= n + 50 + 5
    d = out[0]
    assert d.action == "notify" and d.severity == "warn" and d.signal == "step_time"
    assert f"rank {slow}:" in d.reason and f"on host node-{slow}" in d.reason
    assert "1.50×" in d.reason
    assert ("its one peer" if ranks == 2 else f"its {ranks - 1} peers'") in d.reason
    assert d.value == pytest.approx(BASE * 1.5)


def test_the_straggler_resolves_when_it_catches_up():
    times = lambda r, s: BASE * (1.5 if r == 1 and 100 <= s < 300 else 1.0)  # noqa: E731
    out = replay(POLICY, stream(4, 500, times))
    assert [(d.rank, d.resolved) for d in out] == [(1, False), (1, True)]
    assert 300 <= out[1].step <= 305


def test_equal_ranks_never_fire():
    assert replay(POLICY, stream(4, 600)) == []
    # nor does a job that is slower as a whole (every rank at once)
    assert replay(POLICY, stream(4, 600, lambda r, s: BASE * (3 if s >= 100 else 1))) == []


def test_a_rank_at_1_25x_does_not_fire_at_1_3():
    assert replay(POLICY, stream(4, 600, slow_from(3, 100, 1.25))) == []
    assert replay(POLICY, stream(2, 600, slow_from(0, 100, 1.25))) == []
    # the test is >=: exactly 1.3x holds (and fires)
    assert fired(replay(POLICY, stream(2, 600, slow_from(0, 100, 1.3))))[0][0] == 0


def test_a_single_slow_step_every_10_never_fires():
    # a checkpoint, a data stall: one step in ten at 5x, on one rank, then on every rank by turns
    one = lambda r, s: BASE * (5 if r == 1 and s % 10 == 0 else 1)  # noqa: E731
    turns = lambda r, s: BASE * (5 if s % 10 == r else 1)  # noqa: E731
    assert replay(POLICY, stream(4, 800, one)) == []
    assert replay(POLICY, stream(4, 800, turns)) == []
    # two slow steps in a row are still a blip for a 5-step median
    two = lambda r, s: BASE * (5 if r == 1 and s % 10 in (0, 1) else 1)  # noqa: E731
    assert replay(POLICY, stream(2, 800, two)) == []


def test_a_single_rank_job_never_fires():
    assert replay(POLICY, stream(1, 400, lambda r, s: BASE * (1 + s))) == []


def test_a_rank_that_stops_reporting_makes_no_other_rank_fire():
    # rank 1 of 2 stops at step 100: rank 0 goes on alone, and slows down once rank 1's last
    # value is more than peers_within (100) steps old: it has no peer left to be slower than
    gone = lambda r, s: r == 1 and s >= 100  # noqa: E731
    assert replay(POLICY, stream(2, 600, skip=gone)) == []
    slow0 = slow_from(0, 200, 1.5)
    assert replay(POLICY, stream(2, 600, slow0, skip=gone)) == []
    # of 4 ranks, rank 3 stops: the others compare with each other and stay quiet
    assert replay(POLICY, stream(4, 600, skip=lambda r, s: r == 3 and s >= 100)) == []
    # a rank that keeps its heartbeats but stops measuring step_time drops out as well
    unmeasured = lambda r, s: None if r == 1 and s >= 100 else slow0(r, s)  # noqa: E731
    assert replay(POLICY, stream(2, 600, unmeasured)) == []


def test_a_rank_that_stopped_reporting_drops_out_after_peers_within():
    # 3 ranks; rank 2 was fast in its last steps (0.5x from 95) and stops at 100: ranks 0 and 1
    # (the median of their peers' is now 0.075) count it as a peer for peers_within steps
    times = lambda r, s: BASE * (0.5 if r == 2 and s >= 95 else 1.0)  # noqa: E731
    msgs = stream(3, 400, times, skip=lambda r, s: r == 2 and s >= 100)
    assert sorted(r for r, _ in fired(replay(POLICY, msgs))) == [0, 1]  # 100 steps > for: 50
    pol = load_policy_text(
        _policy(when="{signal: step_time, above_peer_median: 1.3, peers_within: 10 steps}"), "p"
    )
    assert replay(pol, msgs) == []  # gone after 10 steps, long before 50 are held


def test_below_peer_median():
    pol = load_policy_text(
        _policy(when="{signal: step_time, below_peer_median: 0.5, median_of: 3 steps}"), "p"
    )
    out = replay(pol, stream(4, 400, slow_from(2, 100, 0.4)))
    assert fired(out) == [(2, out[0].step)] and 100 + 49 <= out[0].step <= 100 + 52
    assert replay(pol, stream(4, 400, slow_from(2, 100, 0.6))) == []


def test_the_decision_is_made_whatever_the_ranks_arrival_order():
    # the supervisor reads each rank's messages of a tick together: rank 1's batch of 8 steps
    # before rank 0's, every tick
    msgs = stream(2, 600, slow_from(1, 200, 1.5))
    hellos, beats = msgs[:2], msgs[2:]
    batched: list[dict] = []
    for tick in range(0, 600, 8):
        batch = [m for m in beats if tick <= m["step"] < tick + 8]
        batched += sorted(batch, key=lambda m: -m["rank"])  # stable: steps stay in order
    out = replay(POLICY, hellos + batched)
    assert fired(out)[0][0] == 1 and len(fired(out)) == 1


# --- validation, explain ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "when,extra,where,message",
    [
        (
            "{signal: step_time, above_peer_median: 1}",
            "",
            "when.above_peer_median",
            "greater than 1",
        ),
        (
            "{signal: step_time, above_peer_median: 0.8}",
            "",
            "when.above_peer_median",
            "greater than 1",
        ),
        (
            "{signal: step_time, below_peer_median: 1.2}",
            "",
            "when.below_peer_median",
            "less than 1",
        ),
        ("{signal: grade, above_peer_median: 1.3}", "", "when.signal", "per-rank signal"),
        (
            "{signal: attn_entropy_min, below_peer_median: 0.5}",
            "",
            "when.signal",
            "'attn_entropy_min' is per layer",
        ),
        ("{signal: step_time, above_peer_median: 1.3}", "    layers: '*'\n", "layers", "peer"),
        (
            "{all: [{signal: grade, below: S3}, {signal: step_time, above_peer_median: 1.3}]}",
            "    layers: 'blocks.*'\n",
            "layers",
            "does not apply to a peer comparison",
        ),
        (
            "{signal: step_time, above_peer_median: 1.3, below_peer_median: 0.5}",
            "",
            "when.below_peer_median",
            "either",
        ),
        (
            "{signal: step_time, above_peer_median: 1.3, median_of: 5 samples}",
            "",
            "when.median_of",
            "steps",
        ),
        (
            "{signal: step_time, above_peer_median: 1.3, peers_within: 0 steps}",
            "",
            "when.peers_within",
            "at least 1 step",
        ),
        (
            "{signal: step_time, above_peer_median: 1.3, above_median: 2, window: 5 steps}",
            "",
            "when.above_peer_median",
            "tests one thing",
        ),
        (
            "{signal: step_time, below_peer_median: 0.5, min_step_share: 0.05}",
            "",
            "when",
            "use it with above_peer_median",
        ),
        (
            "{signal: step_time, above_peer_median: 1.3, min_step_share: 1.5}",
            "",
            "when.min_step_share",
            "less than 1",
        ),
        (
            "{signal: step_tme, above_peer_median: 1.3}",
            "",
            "when.signal",
            "did you mean 'step_time'",
        ),
    ],
)
def test_validation_names_the_file_line_and_field(when, extra, where, message):
    text = _policy(extra, when=when)
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "mine.yaml")
    line = str(e.value).splitlines()[0]
    assert line.startswith("mine.yaml:") and f"rules[0].{where}:" in line and message in line, line


def test_explain_says_it_in_words():
    text = explain(POLICY)
    assert (
        "a rank's step time (its median over the last 5 steps) is at least 1.3× the median of its "
        "peers' (the other ranks that reported it within the last 100 steps; never on a single "
        "rank), on any rank (one decision per rank), held for 50 steps." in text
    )
    assert "afresh after every relaunch" in text
    for name in BUILTINS:
        assert "1.3× the median of its peers'" in explain(load_policy(name))


def test_the_builtin_rule_is_the_issue_s():
    for name in BUILTINS:
        (rule,) = [r for r in load_policy(name).rules if r.name == "straggler"]
        assert (rule.action, rule.severity, str(rule.for_)) == ("notify", "warn", "50 steps")
        assert (rule.when.signal, rule.when.above_peer_median) == ("step_time", 1.3)


SHARE = load_policy_text(
    _policy(when="{signal: step_time, above_peer_median: 1.3, min_step_share: 0.05}"), "share"
)


def _paced(msgs: list[dict], pace: float) -> list[dict]:
    """The stream with every step ``pace`` seconds apart on the messages' own clock."""
    return [{**m, "t": 1.7e9 + m["step"] * pace} for m in msgs]


def test_a_ratio_that_costs_the_job_little_is_not_a_straggler():
    """1.5x a 0.1 s compute is 0.05 s: 25 % of a 0.2 s step (fires), 2.5 % of a 2 s step (quiet:
    the peers wait 2.5 % of the time); the same streams without min_step_share fire both."""
    slow = stream(2, 600, slow_from(1, 200, 1.5))
    assert fired(replay(SHARE, _paced(slow, 0.2))) == [(1, 251)]
    assert fired(replay(SHARE, _paced(slow, 2.0))) == []
    assert fired(replay(POLICY, _paced(slow, 2.0))) == [(1, 251)]
    d = replay(SHARE, _paced(slow, 0.2))[0]
    assert "(25% of its 0.2 s steps)" in d.reason, d.reason
    for name in BUILTINS:  # the built-ins weigh the cost: quiet on the long steps
        assert [
            x for x in replay(load_policy(name), _paced(slow, 2.0)) if x.rule == "straggler"
        ] == []


def test_a_pause_now_and_then_does_not_hide_what_a_straggler_costs():
    """A 10 s pause every 40 steps (an evaluation, a checkpoint) among 0.2 s steps: the pace is
    the median interval, so the 25 % excess still shows and the rule fires as without pauses."""
    slow = _paced(stream(2, 600, slow_from(1, 200, 1.5)), 0.2)
    paused = [{**m, "t": m["t"] + 10.0 * (m["step"] // 40)} for m in slow]
    assert fired(replay(SHARE, paused)) == fired(replay(SHARE, slow)) == [(1, 251)]


def test_without_the_messages_clock_a_cost_cannot_be_weighed_and_nothing_fires():
    slow = [{k: v for k, v in m.items() if k != "t"} for m in stream(2, 600, slow_from(1, 200, 2))]
    assert fired(replay(SHARE, slow)) == []
    assert fired(replay(POLICY, slow)) == [(1, 251)]


def test_a_policy_can_recover_on_a_straggler_instead():
    pol = load_policy_text(_policy(action="recover"), "p")
    out = replay(pol, stream(4, 600, slow_from(2, 100, 1.5)))
    assert [(d.action, d.rank) for d in out] == [("recover", 2)]


# --- replay, generations, memory -------------------------------------------------------------


NO_FOR = load_policy_text(_policy().replace("    for: 50 steps\n", ""), "no-for.yaml")
"""The rule deciding on the first step it holds: what makes an unsound screen show."""


@pytest.mark.parametrize("pol", [POLICY, NO_FOR], ids=["for", "no-for"])
def test_replay_equals_live_with_quiet_screening(pol):
    """The live supervisor asks :meth:`Engine.quiet` of each rank's batch before it observes it;
    the answer must be sound (never quiet on a batch that decides) and change nothing."""
    msgs = stream(4, 600, slow_from(3, 150, 1.5)) + stream(
        4, 300, slow_from(1, 50, 1.6), gen=1, start=400
    )
    live = Engine(pol)
    decided: list[Decision] = []
    quiet_batches = 0
    i = 0
    while i < len(msgs):  # batches of up to 5 messages of one rank
        j = i + 1
        while j < len(msgs) and j - i < 5 and msgs[j]["rank"] == msgs[i]["rank"]:
            j += 1
        batch = msgs[i:j]
        quiet = live.quiet(batch)
        got = [d for m in batch for d in live.observe(m)]
        assert not (quiet and got), batch
        quiet_batches += quiet
        for d in got:
            decided.append(d)
            if d.action in ("recover", "stop"):
                live.retire(d.generation)
        i = j
    assert decided == replay(pol, msgs)
    assert quiet_batches > 0  # the screen answers the healthy ranks
    assert [(d.generation, d.rank) for d in decided if not d.resolved] == [(0, 3), (1, 1)]


def test_a_relaunch_restarts_persistence():
    # rank 2 is slow from step 100; the job relaunches from a checkpoint at step 120 after 40
    # steps: the new generation starts counting afresh (no decision from gen 0's 40 steps)
    slow = slow_from(2, 100, 1.5)
    gen0 = stream(4, 140, slow)
    gen1 = stream(4, 200, slow, gen=1, start=120)
    out = replay(POLICY, gen0 + gen1)
    assert fired(out) == [(2, out[0].step)] and out[0].generation == 1
    assert 120 + 49 <= out[0].step <= 120 + 55
    # the relaunched rank 2 on a healthy node: nothing, although gen 0's values were slow
    assert replay(POLICY, gen0 + stream(4, 200, gen=1, start=120)) == []
    # messages of the old generation arriving late are ignored
    late = [{**m, "step": m["step"] + 500} for m in stream(4, 100, slow_from(0, 0, 2.0))[4:]]
    assert replay(POLICY, gen0 + gen1[:8] + late + gen1[8:]) == out


def test_memory_is_bounded_by_ranks_times_the_median_span():
    engine = Engine(POLICY)
    for m in stream(8, 2000, lambda r, s: BASE * (1 + (r * s) % 7 / 10)):
        engine.observe(m)
    (table,) = engine._peers.values()
    assert len(table._recent) == 8 and all(len(p) <= 5 for p in table._recent.values())
    assert len(table._sorted) == 8 and len(table._at) <= 8
    assert not any(k[2] == "step_time" for k in engine._series)  # no trailing series kept


# --- the recorded runs the suite replays stay quiet -----------------------------------------


DATA = Path(__file__).resolve().parent / "data"


def _recorded(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_stay_quiet_on_a_stable_run_with_step_times(name):
    """The recorded stable supervised run (2 ranks) with a step_time added to every step: the
    ranks within 15 % of each other, noisy, with a slow step every 50 (a checkpoint)."""
    msgs = _recorded(DATA / "stable_run" / "reports.jsonl.gz")
    out = []
    for m in msgs:
        if m["type"] in ("heartbeat", "report"):
            jitter = ((m["step"] * 7919 + m["rank"] * 104729) % 100) / 100  # 0 .. 0.99
            m = {**m, "step_time": 0.1 * (1 + 0.15 * jitter) * (4 if m["step"] % 50 == 0 else 1)}
        out.append(m)
    assert not [d for d in replay(load_policy(name), out) if d.rule == "straggler"]
    assert replay(load_policy(name), out) == replay(load_policy(name), msgs) == []
