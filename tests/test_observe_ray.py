"""What the supervisor shows, on real Ray + gloo with 2 ranks: ``/metrics`` scraped during the
run (promtool's verdict, the values against the ranks' own reports), and an incident's batch
forensics (the file, the journal, the relaunch skipping exactly those batches, the report)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import read_jsonl, toy_job
from test_metrics import check_metrics, samples

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


class Scraper(threading.Thread):
    """Scrapes the run's ``/metrics`` (its URL from ``RUN_DIR/metrics.url``) every 0.2 s, like a
    Prometheus would, until stopped; keeps every exposition."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.stop, self.texts = run_dir, threading.Event(), []
        self.start()

    def run(self) -> None:
        url = None
        while not self.stop.is_set():
            if url is None and (self.run_dir / "metrics.url").exists():
                url = (self.run_dir / "metrics.url").read_text().strip()
            if url is not None:
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        self.texts.append(r.read())
                except OSError:
                    pass
            time.sleep(0.2)


def phase(text: bytes) -> str:
    (current,) = [
        dict(ls)["phase"] for (n, ls), v in samples(text).items() if n == "spikeguard_phase" and v
    ]
    return current


def series(text: bytes, name: str) -> dict[str, float]:
    """``name``'s samples by their labels other than ``run``, as ``k=v,...``."""
    out = {}
    for (n, ls), v in samples(text).items():
        if n == name:
            out[",".join(f"{k}={x}" for k, x in ls if k != "run")] = v
    return out


def test_metrics_scraped_during_a_real_run_match_the_ranks_reports(ray_local, tmp_path, fail_at):
    fail_at(0, 60, "collapse")  # an incident: counters, a recovery, a probation
    job = toy_job(
        tmp_path, policy=POLICY, faults=fail_at, steps=150, extra_args=["--step-sleep", "0.02"]
    )
    run_dir = Path(job.run_dir)
    scraper = Scraper(run_dir)
    assert run(job) == 0  # waits for a scrape of the final state: the scraper is watching
    scraper.stop.set()
    scraper.join(10)
    texts = scraper.texts
    by_phase: dict[str, list[bytes]] = {}
    for text in texts:
        by_phase.setdefault(phase(text), []).append(text)
    assert {"RUNNING", "PROBATION", "COMPLETED"} <= set(by_phase), list(by_phase)
    for text in (by_phase["RUNNING"][-1], by_phase["PROBATION"][-1], texts[-1]):
        verdict = check_metrics(text)
        assert verdict.returncode == 0 and not verdict.stdout.strip(), verdict.stdout

    # while generation 1 ran: every rank's values are those of its own report at that step
    msgs = read_jsonl(run_dir / "reports.jsonl")
    running = [
        t
        for t in by_phase["RUNNING"]
        if series(t, "spikeguard_generation") == {"": 1.0} and series(t, "spikeguard_rank_step")
    ]
    text = running[-1]
    steps = series(text, "spikeguard_rank_step")
    assert set(steps) == {"rank=0", "rank=1"}
    for rank in (0, 1):
        step = int(steps[f"rank={rank}"])
        (m,) = [
            m
            for m in msgs
            if m["gen"] == 1
            and m["rank"] == rank
            and m["step"] == step
            and m["type"] in ("heartbeat", "report")
        ]
        for name, key in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "lr")):
            assert series(text, f"spikeguard_rank_{name}")[f"rank={rank}"] == pytest.approx(m[key])
        assert series(text, "spikeguard_rank_tokens_total")[f"rank={rank}"] == 64 * (step + 1)
        age = series(text, "spikeguard_rank_heartbeat_age_seconds")[f"rank={rank}"]
        assert 0 <= age < job.timeouts.heartbeat_s
        sampled = [
            m
            for m in msgs
            if m["gen"] == 1 and m["rank"] == rank and m["type"] == "report" and m["step"] <= step
        ][-1]
        grade = series(text, "spikeguard_rank_grade")[f"rank={rank}"]
        assert grade == sampled["summary"]["grade"]
        layer_grades = series(text, "spikeguard_layer_grade")
        for layer, signals in sampled["layers"].items():
            if "grade" in signals:
                assert layer_grades[f"layer={layer},rank={rank}"] == signals["grade"]

    # in probation: the incident, counted, and how long its recovery took
    text = by_phase["PROBATION"][-1]
    assert series(text, "spikeguard_generation") == {"": 2.0}
    assert series(text, "spikeguard_incidents_total") == {"rule=loss-spike": 1.0}
    assert series(text, "spikeguard_recovery_attempts_total") == {"rule=loss-spike": 1.0}
    assert series(text, "spikeguard_recovery_duration_seconds_count") == {"rule=loss-spike": 1.0}
    assert series(text, "spikeguard_lr_scale") == {"": 0.5}

    # the final scrape: the run completed, the incident resolved
    final = texts[-1]
    assert phase(final) == "COMPLETED"
    assert series(final, "spikeguard_recoveries_total") == {"outcome=resolved,rule=loss-spike": 1.0}
    assert series(final, "spikeguard_rank_step") == {"rank=0": 149.0, "rank=1": 149.0}


SKIPPING_POLICY = """
recovery:
  min_grade: S4
  lr_factors: [0.5]
  probation_steps: 30
  max_attempts: 2
  skip_window: 5 steps
  skip_by: batch_ids
"""


def test_an_incident_files_the_batch_ids_and_the_relaunch_skips_exactly_those(
    ray_local, tmp_path, fail_at
):
    policy = tmp_path / "policy.yaml"
    text = POLICY.read_text()
    policy.write_text(text[: text.index("recovery:")] + SKIPPING_POLICY)
    fail_at(0, 60, "collapse")
    shift = 7  # after the rollback, step S trains on the batch of step S - 7
    job = toy_job(
        tmp_path, policy=policy, faults=fail_at, steps=110, extra_args=["--data-shift", str(shift)]
    )
    assert run(job) == 0
    run_dir = Path(job.run_dir)
    evs = read_jsonl(run_dir / "journal.jsonl")
    kinds = [e["kind"] for e in evs]
    assert kinds[1:4] == ["incident", "forensics", "kill"], kinds  # asked before the kill
    inc, fx = evs[1], evs[2]
    path = Path(fx["path"])
    assert path == run_dir / "incidents" / "inc-001" / "batch_ids-1.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert fx["ranks_asked"] == fx["ranks_answered"] == [0, 1]
    doc = json.loads(path.read_text())
    for rank in ("0", "1"):
        entries = doc["ranks"][rank]["entries"]
        last = entries[-1][0]
        assert last >= inc["step"] and [e[0] for e in entries] == list(range(0, last + 1))
        assert all(e[1] == [e[0], int(rank)] for e in entries)  # what the script passed
    rollback = next(e for e in evs if e["kind"] == "rollback")
    window = [inc["step"] - 4, inc["step"]]
    assert rollback["skip_batches"] == str(path) and rollback["skip_batches_steps"] == window
    assert rollback["skip_ranges"] == []
    # generation 2 skipped those batches where they came again: 7 steps later, on both ranks
    msgs = read_jsonl(run_dir / "reports.jsonl")
    for rank in (0, 1):
        skipped = [
            (m["step"], m["by"])
            for m in msgs
            if m["gen"] == 2 and m["rank"] == rank and m["type"] == "skipped"
        ]
        expect = list(range(window[0] + shift, window[1] + shift + 1))
        assert skipped == [(s, "batch_ids") for s in expect], skipped
    # ... and the post-mortem lists them
    from spikeguard.supervisor.observe.report import write_report

    page = write_report(run_dir, tmp_path / "report.html").read_text()
    assert str(path) in page and f"{fx['batches']} batch ids" in page
    assert "Generation 2 skipped 5 batches by id" in page
