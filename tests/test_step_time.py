"""Per-rank compute time in every step message (``step_time``, ``phases``).

In synchronous data parallelism the time between two ``step()`` calls is the slowest rank's on
every rank; what tells a straggler apart is the time each rank spends on its own work. The
real-DDP test runs two gloo ranks of ``tests/scripts/straggler_rank.py`` and shows both sides:
the pace is the same on both ranks, ``step_time`` is not. The rest checks the sums (with a
clock the test advances) and the supervisor's side (validation and the collector's view).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, read_jsonl, run_ranks
from spikeguard.supervisor.intake import validate
from spikeguard.supervisor.intake.collector import STEP_TIME_WINDOW, Collector
from spikeguard.workers import attach
from spikeguard.workers.contract.messages import MAX_PHASES, MAX_STEP_TIME_S
from spikeguard.workers.rank.timing import StepTimer
from torch import nn

SLOW_FROM = 12
STEPS = 30


def _steps(messages: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {m["step"]: m for m in messages if m["type"] in ("heartbeat", "report")}


@pytest.mark.slow
def test_a_rank_slowed_inside_its_model_differs_in_step_time_not_in_pace(tmp_path: Path) -> None:
    """Two real gloo DDP ranks; from step 12 rank 1's forward sleeps 50 ms inside the model.
    Rank 0 then waits in the all-reduce, so the time between steps (the naive measure, from the
    messages' own clock) is the same on both ranks, before and after; ``step_time`` is about
    equal before and far apart after. The collector, fed the real lines, keeps the latest value
    and the recent median of each rank."""
    runs = run_ranks(
        SCRIPTS / "straggler_rank.py",
        [str(tmp_path), "--steps", str(STEPS), "--slow-from", str(SLOW_FROM)],
        2,
        timeout=300,
    )
    assert all(r.returncode == 0 for r in runs), [r.stdout[-3000:] for r in runs]
    lines = [(tmp_path / f"rank{r}.jsonl").read_bytes().splitlines() for r in range(2)]
    msgs = [_steps([json.loads(line) for line in rank_lines]) for rank_lines in lines]
    assert all(sorted(m) == list(range(STEPS)) for m in msgs)

    def median(rank: int, key: str, steps: range) -> float:
        if key == "pace":
            values = [msgs[rank][s]["t"] - msgs[rank][s - 1]["t"] for s in steps]
        else:
            values = [msgs[rank][s]["step_time"] for s in steps]
        return statistics.median(values)

    before, after = range(2, SLOW_FROM), range(SLOW_FROM + 1, STEPS)
    for steps in (before, after):  # the naive measure cannot tell the ranks apart
        assert 0.67 < median(1, "pace", steps) / median(0, "pace", steps) < 1.5
    assert median(0, "pace", after) > 2 * median(0, "pace", before)  # rank 0 waits for rank 1
    assert 0.33 < median(1, "step_time", before) / median(0, "step_time", before) < 3
    assert median(1, "step_time", after) / median(0, "step_time", after) > 5
    assert median(1, "step_time", after) >= 0.05  # the sleep is inside the timed forward
    for s in range(STEPS):
        for r in range(2):
            m = msgs[r][s]
            assert m["step_time"] >= m["phases"]["data"] > 0  # the data phase is in it
            assert validate.problem(m) is None

    collector = Collector(world_size=2, hang_timeout_s=60, first_heartbeat_timeout_s=60)
    collector.new_generation(0, now=0.0)
    for r in range(2):
        for line in lines[r]:
            collector.ingest(r, line, now=1.0)
    assert collector.dropped == {}
    views = collector.ranks
    assert views[1].step_time == msgs[1][STEPS - 1]["step_time"]
    assert len(views[1].step_times) == STEP_TIME_WINDOW
    assert views[1].step_time_median() > 5 * views[0].step_time_median()
    assert set(views[0].phases) == {"data"}


class _Clocked(nn.Module):
    """A model whose forward advances the test's clock by ``cost`` seconds."""

    def __init__(self, clock: list[float], cost: float) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.clock, self.cost = clock, cost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock[0] += self.cost
        return self.lin(x)


def test_forwards_and_the_data_phase_sum_into_step_time_and_phases() -> None:
    """With a clock the test advances: two forwards of a step (gradient accumulation) sum, the
    ``data`` phase entered twice sums and counts into ``step_time``, another phase is reported
    but not counted, a paused forward (validation) is not counted, and each step starts from
    zero; a step with no forward and no phase has no timing."""
    now = [100.0]
    model = _Clocked(now, cost=0.25)
    timer = StepTimer(model, clock=lambda: now[0])
    x = torch.zeros(1, 2)
    for load in (0.5, 0.125):
        with timer.phase("data"):
            now[0] += load
        model(x)
    timer.phase_start("opt")
    now[0] += 2.0
    timer.phase_stop("opt")
    timer.phase_stop("never-started")
    timer.pause()
    model(x)  # validation: not this step's compute
    timer.resume()
    assert timer.take() == {"step_time": 0.25 * 2 + 0.625, "phases": {"data": 0.625, "opt": 2.0}}
    model(x)
    assert timer.take() == {"step_time": 0.25}
    assert timer.take() == {}
    timer.remove()
    model(x)
    assert timer.take() == {}


def test_a_forward_that_raises_is_timed_and_the_next_one_too() -> None:
    """The post-hook runs after a raising forward: the clock does not stay open, the next
    forward is timed alone."""
    now = [0.0]
    model = _Clocked(now, cost=1.0)
    timer = StepTimer(model, clock=lambda: now[0])
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 3))  # a shape error after the clock advanced
    model(torch.zeros(1, 2))
    assert timer.take() == {"step_time": 2.0}


def test_phase_names_are_checked_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """An invalid name raises at its first use (a script's bug); past ``MAX_PHASES`` names in a
    step the new ones are not reported (one warning) and the step's message stays valid."""
    timer = StepTimer(nn.Linear(1, 1))
    for bad in ("", "a b", "9lives", "x" * 33, "data\n"):
        with pytest.raises(ValueError, match="phase name"):
            timer.phase_start(bad)
    for i in range(MAX_PHASES + 3):
        with timer.phase(f"p{i}"):
            pass
    fields = timer.take()
    assert sorted(fields["phases"]) == sorted(f"p{i}" for i in range(MAX_PHASES))
    assert "step_time" not in fields  # no forward, no data phase: nothing measured
    assert "not reported" in caplog.text
    assert validate.problem({**_heartbeat(), **fields}) is None


def test_the_session_sends_them_in_its_messages(tmp_path: Path) -> None:
    """Through ``attach``: ``step_time`` and ``phases`` in the step's heartbeat, at least the
    time slept in the data phase; ``step_timing=False`` sends neither."""
    import time

    for timing in (True, False):
        path = tmp_path / f"{timing}.jsonl"
        model = nn.Linear(4, 4)
        sg = attach(model, report=f"jsonl://{path}", step_timing=timing)
        for step in range(2):
            with sg.phase("data"):
                time.sleep(0.01)
            sg.phase_start("data")
            time.sleep(0.01)
            sg.phase_stop("data")
            model(torch.zeros(1, 4))
            sg.step(step=step, loss=1.0)
        sg.close()
        msgs = _steps(read_jsonl(path))
        for m in msgs.values():
            if timing:
                assert m["phases"]["data"] >= 0.02
                assert m["step_time"] > m["phases"]["data"]
            else:
                assert "step_time" not in m and "phases" not in m


def _heartbeat(**fields: Any) -> dict[str, Any]:
    return {"v": 1, "type": "heartbeat", "run": "r", "gen": 0, "rank": 0, "step": 3, **fields}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"step_time": math.nan}, "out_of_range"),
        ({"step_time": math.inf}, "out_of_range"),
        ({"step_time": -0.001}, "out_of_range"),
        ({"step_time": MAX_STEP_TIME_S * 2}, "out_of_range"),
        ({"step_time": 10**400}, "out_of_range"),
        ({"step_time": "0.1"}, "wrong_type"),
        ({"step_time": True}, "wrong_type"),
        ({"step_time": [0.1]}, "wrong_type"),
        ({"phases": [["data", 0.1]]}, "wrong_type"),
        ({"phases": "data"}, "wrong_type"),
        ({"phases": {"a b": 0.1}}, "wrong_type"),
        ({"phases": {"x" * 33: 0.1}}, "wrong_type"),
        ({"phases": {"\ufffd": 0.1}}, "wrong_type"),
        ({"phases": {"data": None}}, "wrong_type"),
        ({"phases": {"data": {"s": 1}}}, "wrong_type"),
        ({"phases": {"data": math.nan}}, "out_of_range"),
        ({"phases": {"data": -1}}, "out_of_range"),
        ({"phases": {f"p{i}": 0.1 for i in range(MAX_PHASES + 1)}}, "out_of_range"),
    ],
)
def test_hostile_timings_are_refused_and_counted(fields: dict[str, Any], reason: str) -> None:
    """Validation refuses a timing that is not a finite number in [0, MAX_STEP_TIME_S] and a
    ``phases`` that is not a bounded map of phase names to timings; the collector drops such a
    line and counts it under the reason, and the rank's view keeps its previous timing."""
    msg = _heartbeat(**fields)
    assert validate.problem(msg) == reason
    collector = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=60)
    collector.new_generation(0, now=0.0)
    good = json.dumps(_heartbeat(step_time=0.5, phases={"data": 0.25}))
    assert collector.ingest(0, good.encode(), now=1.0) is not None
    assert collector.ingest(0, json.dumps(msg).encode(), now=2.0) is None
    assert collector.dropped == {reason: 1}
    view = collector.ranks[0]
    assert (view.step_time, list(view.step_times), view.phases) == (0.5, [0.5], {"data": 0.25})


def test_valid_timings_pass_and_null_means_absent() -> None:
    """Zero, an integer, the cap and null are accepted; a message without a timing leaves the
    view's latest ``step_time`` as it was, and the median is over the recent ones only."""
    for fields in (
        {"step_time": 0},
        {"step_time": MAX_STEP_TIME_S},
        {"step_time": None, "phases": None},
        {"phases": {"data": 0.0, "_x.y-z": 3}},
    ):
        assert validate.problem(_heartbeat(**fields)) is None, fields
    collector = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=60)
    collector.new_generation(0, now=0.0)
    for i in range(STEP_TIME_WINDOW + 5):
        collector.ingest(0, json.dumps(_heartbeat(step=i, step_time=float(i))).encode(), now=1.0)
    collector.ingest(0, json.dumps(_heartbeat(step=99)).encode(), now=2.0)
    view = collector.ranks[0]
    assert view.step_time == STEP_TIME_WINDOW + 4
    assert view.step_time_median() == statistics.median(range(5, STEP_TIME_WINDOW + 5))
