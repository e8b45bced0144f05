"""Per-rank step time in every view: the live view, ``spikeguard status`` (text and ``--json``,
from the ``status.json`` the controller writes), the metrics the Grafana board charts, and the
HTML report (from the ``reports.jsonl`` the controller records), so a straggler is visible
before any rule fires.

A real :class:`~spikeguard.supervisor.controller.Controller` (a scripted group, no Ray) runs the
built-in ``default`` policy over five ranks for 30 steps, fewer than its ``straggler`` rule's
50: ranks 0-3 send ``step_time``, rank 1 twice the others' (or the same, as the control), rank 4
none. Every view is read from what the controller wrote to disk or from the controller itself.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import scripted_controller
from spikeguard.policies import BUILTINS, Engine, load_policy
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll
from spikeguard.supervisor.observe import rundata
from spikeguard.supervisor.observe.exporter import MetricsExporter
from spikeguard.supervisor.observe.metrics import STRAGGLER_RATIO, peer_ratios
from spikeguard.supervisor.observe.report import MAX_STEP_TIME_LINES, render
from spikeguard.supervisor.observe.rundata import load_run
from spikeguard.supervisor.observe.status import live_status
from spikeguard.supervisor.sinks.console import LiveView, render_status
from test_deploy_observe import DASHBOARD, metric_names
from test_metrics import samples, value

WORLD = 5
STEPS = 30
BASE = 0.1
UNTIMED = 4
"""The rank that sends no ``step_time`` (its loop does not measure it)."""
SLOW = 1


def line(gen: int, rank: int, step: int, **fields: Any) -> bytes:
    msg = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": 2.0, **fields}).encode()


class Ranks:
    """Five scripted ranks, one heartbeat a tick for ``STEPS`` ticks, then all exit 0. Rank
    ``SLOW`` computes ``factor`` times as long as ranks 0, 2 and 3; rank ``UNTIMED`` sends no
    ``step_time``. ``extra``: tick -> more lines of rank ``SLOW`` that tick, each with that raw
    JSON text as its ``step_time`` (hostile ones)."""

    def __init__(self, factor: float, extra: dict[int, list[str]] | None = None) -> None:
        self.factor, self.extra = factor, extra or {}
        self.gen = 0
        self.tick = 0

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(WORLD)
        ]

    def poll(self, timeout_s: float = 0.5) -> list[RankPoll]:
        self.tick += 1
        out = []
        for r in range(WORLD):
            if self.tick > STEPS:
                out.append(RankPoll(rank=r, generation=self.gen, exit_code=0))
                continue
            timed = {} if r == UNTIMED else {"step_time": BASE * (self.factor if r == SLOW else 1)}
            lines = [line(self.gen, r, self.tick - 1, **timed)]
            if r == SLOW:
                for raw in self.extra.get(self.tick, []):
                    base = line(self.gen, r, self.tick - 1)[:-1]  # without its closing brace
                    lines.append(base + b', "step_time": ' + raw.encode() + b"}")
            out.append(RankPoll(rank=r, generation=self.gen, lines=tuple(lines)))
        return out

    def kill(self, grace_s: float = 0.0) -> KillReport:
        return KillReport(duration_s=0.0)

    def request(self, payload: dict[str, Any], timeout_s: float = 5.0) -> int:
        return 0


class Seen:
    """What the run showed while it ran, at its last running tick: the live view's text and
    the metrics' exposition."""

    live = ""
    metrics = b""


def supervise(run: Path, factor: float, extra: dict[int, list[str]] | None = None) -> Seen:
    """Run the controller to the end (``STEPS`` ticks, then the ranks' exits) with the live
    view on its tick hook; the metrics exporter reads it at the last running tick."""
    ctl = scripted_controller(
        run, Ranks(factor, extra), Engine(load_policy("default")), world_size=WORLD
    )
    out = io.StringIO()
    ctl.on_tick = LiveView(every_s=0.0, out=out)
    seen = Seen()
    for _ in range(STEPS):
        out.seek(0)
        out.truncate()
        ctl.step()
    assert ctl.state.phase.value == "RUNNING"
    seen.live = out.getvalue()
    exporter = MetricsExporter(run="t", clock=lambda: 100.0)
    exporter.tick(ctl)
    seen.metrics = exporter.exposition()
    ctl.step()  # the exits: COMPLETED, status.json written at the change of phase
    assert ctl.state.phase.value == "COMPLETED"
    ctl.close()
    kinds = [json.loads(x)["kind"] for x in (run / "journal.jsonl").read_text().splitlines()]
    assert "alert" not in kinds and "incident" not in kinds, kinds  # no rule fired
    return seen


def rank_line(text: str, rank: int) -> str:
    (found,) = re.findall(rf"^    r{rank} .*$", text, re.M)
    return found


@pytest.mark.parametrize("factor", [2.0, 1.0])
def test_every_view_shows_each_rank_s_step_time_and_ratio(tmp_path: Path, capsys, factor):
    """Rank 1 at twice its peers' step time reads x2.00 and SLOW in the live view and in
    ``status``, 2 in ``status --json`` and in the metrics; its peers (and every rank of the
    control, where all are equal) x1.00 and never SLOW; rank 4, which measures nothing, reads
    "—" and has no ratio anywhere. The ``slow`` line names the straggler only."""
    seen = supervise(tmp_path, factor)
    slow = factor >= STRAGGLER_RATIO

    # the live view, at the last running tick
    live = seen.live
    assert rank_line(live, SLOW).endswith(
        f"step time {BASE * factor * 1e3:.3g} ms x{factor:.2f}" + (" SLOW" if slow else "")
    ), live
    for r in (0, 2, 3):
        assert rank_line(live, r).endswith("step time 100 ms x1.00"), live
    assert rank_line(live, UNTIMED).endswith("heartbeat 0.0 s ago  step time —"), live
    assert ("slow (step time / peers' median): r1 x2.00 (200 ms)" in live) is slow, live
    assert live.count("SLOW") == (1 if slow else 0)

    # status.json as the controller's status writer left it
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["phase"] == "COMPLETED"
    ranks = status["ranks"]
    assert ranks[str(SLOW)]["step_time_median"] == pytest.approx(BASE * factor)
    assert ranks[str(SLOW)]["step_time"] == pytest.approx(BASE * factor)
    assert ranks[str(SLOW)]["step_ratio"] == pytest.approx(factor)
    assert ranks["0"]["step_ratio"] == pytest.approx(1.0)
    untimed = ranks[str(UNTIMED)]
    assert (untimed["step_time"], untimed["step_time_median"], untimed["step_ratio"]) == (
        None,
        None,
        None,
    )

    # spikeguard status: --json carries the fields, the text shows them
    assert main(["status", str(tmp_path), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["ranks"][str(SLOW)]["step_ratio"] == pytest.approx(factor)
    assert js["ranks"][str(UNTIMED)]["step_ratio"] is None
    assert main(["status", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("COMPLETED")
    assert rank_line(text, SLOW).endswith(f"x{factor:.2f}" + (" SLOW" if slow else "")), text
    assert "exited 0  step time —" in rank_line(text, UNTIMED), text
    assert "\033[" not in text  # not a terminal: no color codes

    # the metrics (what the Grafana board charts)
    m = seen.metrics
    assert value(m, "spikeguard_rank_step_seconds", run="t", rank="1") == BASE * factor
    assert value(m, "spikeguard_rank_step_ratio", run="t", rank="1") == pytest.approx(factor)
    assert value(m, "spikeguard_rank_step_ratio", run="t", rank="0") == pytest.approx(1.0)
    ratio_ranks = {dict(ls)["rank"] for n, ls in samples(m) if n == "spikeguard_rank_step_ratio"}
    assert ratio_ranks == {"0", "1", "2", "3"}  # none for the rank that measures nothing

    # the report, from the reports.jsonl the controller recorded
    page = render(load_run(tmp_path))
    rows = dict(
        re.findall(r"<tr><td>1</td><td>(\d+)</td><td>[^<]*</td><td[^>]*>([^<]*)</td>", page)
    )
    assert rows == {
        "0": "x1.00",
        "1": f"x{factor:.2f}" + (" SLOW" if slow else ""),
        "2": "x1.00",
        "3": "x1.00",
    }
    assert next(iter(rows)) == "1" or not slow  # the slowest first
    slow_lines = re.findall(r'<path class="rank-step slow"[^>]*><title>([^<]*)</title>', page)
    assert slow_lines == (
        ["generation 1 rank 1: 200 ms, x2.00 its peers&#x27; median; x2.00 over steps 0–4 (SLOW)"]
        if slow
        else []
    )
    assert page.count('<path class="rank-step') == 4
    assert page.count('<path class="step-median"') == 1


def test_the_board_charts_the_step_time_and_the_ratio_with_the_threshold(tmp_path: Path):
    """The Grafana board's two step-time panels query families the exporter really exports,
    with series for the straggler stream's ranks; the ratio panel's threshold line is the
    views' (and the built-in rule's) ratio."""
    seen = supervise(tmp_path, 2.0)
    board = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in board["panels"]}
    exported = {n for n, _ in samples(seen.metrics)}
    for title, metric in (
        ("Step time per rank", "spikeguard_rank_step_seconds"),
        ("Step time / peers' median", "spikeguard_rank_step_ratio"),
    ):
        (target,) = panels[title]["targets"]
        assert metric_names(target["expr"]) == {metric} <= exported
        assert "{{rank}}" in target["legendFormat"]
    defaults = panels["Step time / peers' median"]["fieldConfig"]["defaults"]
    steps = defaults["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, STRAGGLER_RATIO]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    assert panels["Step time per rank"]["fieldConfig"]["defaults"]["unit"] == "s"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_the_views_threshold_is_the_builtin_straggler_rule_s():
    for name in BUILTINS:
        (rule,) = [r for r in load_policy(name).rules if r.name == "straggler"]
        assert rule.when.above_peer_median == STRAGGLER_RATIO


HOSTILE = ["NaN", "Infinity", "1e300", "-1", '"9"', "true", "[0.1]", "1" + "0" * 400]
"""``step_time`` values (as JSON text) validation refuses."""


def test_hostile_step_times_are_dropped_at_intake_and_change_no_view(tmp_path: Path, capsys):
    """NaN, a huge, a negative, a string and a bool ``step_time`` from the straggler: dropped
    and counted as validation bounds them (never recorded); every view reads as without them."""
    seen = supervise(tmp_path, 2.0, extra={10: HOSTILE})
    status = json.loads((tmp_path / "status.json").read_text())
    assert sum(status["dropped"].values()) == len(HOSTILE), status["dropped"]
    assert status["ranks"]["1"]["step_ratio"] == pytest.approx(2.0)
    assert "x2.00 SLOW" in rank_line(seen.live, SLOW)
    assert value(seen.metrics, "spikeguard_rank_step_ratio", run="t", rank="1") == 2.0
    recorded = (tmp_path / "reports.jsonl").read_text()
    assert "NaN" not in recorded and "1e300" not in recorded and "Infinity" not in recorded
    assert main(["status", str(tmp_path)]) == 0
    assert "x2.00 SLOW" in rank_line(capsys.readouterr().out, SLOW)


def test_a_hand_edited_status_json_or_reports_file_never_breaks_a_view(tmp_path: Path, capsys):
    """status.json and reports.jsonl are input too: step-time fields that are not numbers, not
    finite or absurd show "—" (or are left out), never a traceback; the report keeps only the
    timings validation would accept."""
    supervise(tmp_path, 2.0)
    status = json.loads((tmp_path / "status.json").read_text())
    status["ranks"]["0"].update(step_time_median=0.1, step_ratio=1e300)
    for bad in ("NaN", "x", True, [1], {"a": 1}, None, -1.0, "Infinity"):
        for r in ("1", "2", "3", "4"):
            status["ranks"][r].update(step_time=bad, step_time_median=bad, step_ratio=bad)
        (tmp_path / "status.json").write_text(json.dumps(status))
        assert main(["status", str(tmp_path)]) == 0
        out = capsys.readouterr()
        assert "cannot be shown" not in out.err and "Traceback" not in out.err, out.err
        assert rank_line(out.out, 0).endswith("step time 100 ms x1e+300 SLOW"), out.out
        for r in (1, 2, 3, 4):
            assert rank_line(out.out, r).endswith("step time —"), (bad, out.out)
        assert "slow (step time / peers' median): r0 x1e+300 (100 ms)" in out.out
    # the rendering straight from such a dict (the live view's path), with color on a terminal
    text = render_status(status, color=True)
    assert "\033[1;31mx1e+300 SLOW\033[0m" in text and text.count("\033[1;31m") == 2

    with (tmp_path / "reports.jsonl").open("a") as f:
        for bad in ("NaN", "Infinity", "-1", "1e300", '"0.1"', "true", "1" + "0" * 400):
            f.write(f'{{"v":1,"type":"heartbeat","gen":1,"rank":1,"step":5,"step_time":{bad}}}\n')
        f.write('{"v":1,"type":"heartbeat","gen":1,"rank":true,"step":5,"step_time":9}\n')
    run = load_run(tmp_path)
    st = run.generations[1].step_times
    assert set(st.rows) == {0, 1, 2, 3}
    assert st.medians()[1] == pytest.approx(2 * BASE)  # no hostile value counted
    assert all(math.isfinite(v) for r in st.rows for _, v in st.series(r))
    assert "x2.00 SLOW" in render(run)


def test_peer_ratios_leave_out_what_is_no_ratio():
    """A rank alone, a median that is not a number or not finite, peers at zero, and a ratio
    that overflows against a tiny median: no ratio (the views show "—"), never inf or NaN."""
    assert peer_ratios({0: 0.1}) == {}
    assert peer_ratios({0: 0.2, 1: 0.1, 2: 0.1, 3: None}) == {
        0: 2.0,
        1: pytest.approx(2 / 3),
        2: pytest.approx(2 / 3),
    }
    assert peer_ratios({0: math.nan, 1: math.inf, 2: 0.1, 3: 0.1}) == {2: 1.0, 3: 1.0}
    assert peer_ratios({0: 0.1, 1: 0.0, 2: 0.0}) == {1: 0.0, 2: 0.0}  # rank 0's peers: 0
    # rank 0 over its peers' 5e-324 overflows (no ratio); theirs over 5e5 underflow to 0
    assert peer_ratios({0: 1e6, 1: 5e-324, 2: 5e-324}) == {1: 0.0, 2: 0.0}


def test_the_report_s_step_times_stay_bounded_for_many_ranks_and_steps(tmp_path, monkeypatch):
    """Forty ranks over 2000 steps (one straggling from step 1200) and a step far beyond the
    others: each rank keeps at most MAX_STEP_BINS bins, the chart draws the slowest
    MAX_STEP_TIME_LINES ranks and the median, each line at most MAX_STEP_BINS points, and the
    straggler comes first, marked SLOW. Four times the steps: the same size of section."""
    monkeypatch.setattr(rundata, "MAX_STEP_BINS", 32)

    def section(steps: int) -> tuple[str, Any]:
        run = tmp_path / f"run{steps}"
        run.mkdir()
        with (run / "reports.jsonl").open("w") as f:
            for step in range(steps):
                for r in range(40):
                    slow = r == 37 and step >= steps * 0.6
                    seconds = 0.3 if slow else 0.1 + 0.001 * (r % 7)
                    msg = {"v": 1, "type": "heartbeat", "gen": 1, "rank": r, "step": step}
                    f.write(json.dumps({**msg, "step_time": seconds}) + "\n")
        data = load_run(run)
        page = render(data)
        start = page.index('<svg class="step-time"')
        return page[start : page.index("</table>", start)], data.generations[1].step_times

    small, _ = section(500)
    big, st_big = section(2000)
    assert st_big.bins <= 32 and st_big.width >= 2000 // 32
    assert all(len(row) == 2 * 32 for row in st_big.rows.values())
    paths = re.findall(r'<path class="(rank-step[^"]*|step-median)" d="([^"]*)"', big)
    assert len(paths) == MAX_STEP_TIME_LINES + 1
    assert all(d.count("L") + 1 <= 32 for _, d in paths)
    first = re.search(r"<tr><td>1</td><td>(\d+)</td><td>[^<]*</td><td[^>]*>([^<]*)</td>", big)
    assert first is not None and first.group(1) == "37" and first.group(2).endswith("SLOW")
    assert "+34 faster ranks not shown" in big
    assert len(big) < 1.2 * len(small)
    # a step far beyond the rest widens the bins at once (no run of doublings per value)
    st_big.add(3, 10**15, 0.1)
    assert st_big.bins <= 32 and all(len(row) == 64 for row in st_big.rows.values())


def test_peer_ratios_are_each_rank_s_median_over_the_median_of_the_others():
    """The sorted, index-away computation agrees with the definition (the median of every
    other rank's median, by statistics.median) on random worlds with ties, zeros and gaps."""
    rng = random.Random(7)
    for _ in range(500):
        medians = {
            r: rng.choice([None, 0.0, 0.1, 0.2, rng.random(), rng.uniform(0, 1e6)])
            for r in range(rng.randint(0, 12))
        }
        known = {r: m for r, m in medians.items() if m is not None}
        want = {}
        for r, mine in known.items():
            peers = [m for q, m in known.items() if q != r]
            if peers and statistics.median(peers) > 0:
                want[r] = pytest.approx(mine / statistics.median(peers), rel=1e-12)
        assert peer_ratios(medians) == want, medians


def test_among_sixty_four_ranks_the_straggler_is_named_whatever_its_grade():
    """64 ranks through the real collector; five have low grades (the live view's worst five),
    rank 17 is healthy but computes 1.5x as long and rank 40 1.35x: the ``slow`` line names
    both, the slowest first, though neither is among the ranks listed."""
    c = Collector(world_size=64, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    c.new_generation(1, now=0.0)
    factor = {17: 1.5, 40: 1.35}
    for step in range(25):
        for r in range(64):
            summary = {"grade": 2 if r in (1, 2, 3, 4, 5) else 7, "attn_entropy_min_norm": 0.5}
            msg = {"v": 1, "type": "report", "run": "t", "gen": 1, "rank": r, "step": step}
            msg |= {"t": 0.0, "loss": 2.0, "layers": {}, "summary": summary}
            msg["step_time"] = BASE * factor.get(r, 1.0)
            c.ingest(r, json.dumps(msg), 1.0 + step)
    status = json.loads(json.dumps(live_status(rc.State(phase=rc.Phase.RUNNING), c)))
    text = render_status(status)
    lines = text.splitlines()
    assert lines[2] == "  slow (step time / peers' median): r17 x1.50 (150 ms), r40 x1.35 (135 ms)"
    assert [int(m) for m in re.findall(r"^    r(\d+)", text, re.M)] == [1, 2, 3, 4, 5]
    assert all(x.endswith("step time 100 ms x1.00") for x in lines[4:]), text
