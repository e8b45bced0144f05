"""The Prometheus exporter: a fold over the journal plus the collector's views, checked by
promtool, bounded in its labels, served over real HTTP."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.journal import read_events
from spikeguard.supervisor.observe.exporter import MetricsExporter
from spikeguard.supervisor.observe.metrics import OTHER_LAYERS

DEMO = Path(__file__).parent / "data" / "demo_run"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    return path


def check_metrics(text: bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), "check", "metrics"], input=text.decode(), capture_output=True, text=True
    )


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: bytes, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples(text).items() if n == name and dict(ls) == labels]
    assert len(found) == 1, (name, labels, [k for k in samples(text) if k[0] == name])
    return found[0]


def demo_controller(now: float = 120.0) -> SimpleNamespace:
    """The recorded demo's final state: the journal folded, generation 3's reports collected."""
    events = read_events(DEMO)
    col = Collector(world_size=2, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(3, 60.0, start_step=701)
    with gzip.open(DEMO / "reports.jsonl.gz", "rb") as f:
        for i, line in enumerate(f):
            msg = json.loads(line)
            if msg.get("gen") == 3 and msg["type"] not in ("exit", "hang"):
                col.ingest(msg["rank"], line, 61.0 + i * 0.001)
    return SimpleNamespace(state=rc.fold(events), collector=col, events=events)


def exporter_of(ctl: SimpleNamespace, *, clock: float = 120.0, **kw) -> MetricsExporter:
    ex = MetricsExporter(run="demo", clock=lambda: clock, **kw)
    ex.restore(ctl.events)
    ex.tick(ctl)
    return ex


def test_the_demo_run_s_metrics_pass_promtool_and_say_what_happened():
    ctl = demo_controller()
    text = exporter_of(ctl).exposition()
    res = check_metrics(text)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr
    assert value(text, "spikeguard_phase", run="demo", phase="COMPLETED") == 1
    assert value(text, "spikeguard_phase", run="demo", phase="RUNNING") == 0
    assert value(text, "spikeguard_generation", run="demo") == 3
    assert value(text, "spikeguard_lr_scale", run="demo") == 0.25
    rule = {"run": "demo", "rule": "entropy-collapse"}
    assert value(text, "spikeguard_incidents_total", **rule) == 1
    assert value(text, "spikeguard_recovery_attempts_total", **rule) == 2
    assert value(text, "spikeguard_recoveries_total", **rule, outcome="resolved") == 1
    assert value(text, "spikeguard_recovery_duration_seconds_count", **rule) == 2
    # the incident's first event at mono 39.257, resolved at 112.714
    took = value(text, "spikeguard_incident_duration_seconds_sum", **rule, outcome="resolved")
    assert took == pytest.approx(112.714 - 39.257)
    # the ranks as their last reports say
    last = {}
    with gzip.open(DEMO / "reports.jsonl.gz", "rb") as f:
        for line in f:
            m = json.loads(line)
            if m.get("gen") == 3 and m["type"] == "report":
                last[m["rank"]] = m
    for rank, m in last.items():
        r = {"run": "demo", "rank": str(rank)}
        assert value(text, "spikeguard_rank_grade", **r) == m["summary"]["grade"]
        got = value(text, "spikeguard_rank_attn_entropy_min_nats", **r)
        assert got == pytest.approx(m["summary"]["attn_entropy_min"])
        for layer, signals in m["layers"].items():
            if "grade" in signals:
                assert value(text, "spikeguard_layer_grade", **r, layer=layer) == signals["grade"]


def test_each_kind_of_event_is_counted_by_its_code_not_its_prose():
    """The recovery machine's own events (an incident that escalates after a failed probation,
    then a new one that resolves), and the notes other parts journal."""
    from spikeguard.supervisor.observe.metrics import MetricsFold

    s = rc.Settings(max_attempts=1)
    state, events = rc.State(), []
    for obs in (
        rc.Launched(1),
        rc.Recover("nan", "prose that changes", 100, s),
        rc.Killed((0,), 0.1),
        rc.CheckpointChosen("/c", step=50, grade=6),
        rc.Launched(2),
        rc.Recover("nan", "again", 120, s),  # in probation, budget spent: escalated
    ):
        t = rc.step(state, obs)
        state = t.state
        events += t.events
    for i, ev in enumerate(events):
        ev["mono"] = 10.0 * i
    events += [
        {"kind": "alert", "rule": "slow", "severity": "warn", "resolved": False},
        {"kind": "alert", "rule": "slow", "severity": "warn", "resolved": True},
        {"kind": "notify_undelivered", "what": "reply", "error": "ratelimited"},
        {"kind": "notify_undelivered", "sink": "pagerduty", "what": "trigger", "error": "503"},
        {"kind": "notify_undelivered", "sink": "\ud800junk", "what": "x", "error": "?"},
        {"kind": "launch_failed", "code": "launch_failed"},
    ]
    fold = MetricsFold(run="r")
    for ev in events:
        fold.handle(ev)
    assert fold.incidents == {"nan": 1} and fold.attempts == {"nan": 1}
    assert fold.recoveries == {("nan", "escalated"): 1}
    assert fold.alerts == {("slow", "warn"): 1}  # the resolution is not a firing
    # by sink; one the supervisor does not know is "other" (a label's values stay bounded)
    assert fold.undelivered == {"slack": 1, "pagerduty": 1, "other": 1}
    assert fold.launch_failures == 1
    incident = next(e for e in events if e["kind"] == "incident")
    launch = next(e for e in events if e.get("code") == "relaunch_after_rollback")
    assert fold.durations == {"nan": [launch["mono"] - incident["mono"]]}
    escalated = next(e for e in events if e["kind"] == "escalated")
    took = escalated["mono"] - incident["mono"]
    assert fold.incident_durations == {("nan", "escalated"): [took]}


def test_layer_labels_are_bounded_and_user_text_is_escaped():
    col = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    odd = 'blocks.0"\n\\attn'
    layers = {odd: {"grade": 0, "max_logit": 3.0}}  # the worst grade: exported as it is
    layers |= {f"blocks.{i}": {"grade": 7 - i % 7, "max_logit": float(i)} for i in range(1, 99)}
    layers["x" * 500] = {"grade": 5}
    msg = {"v": 1, "type": "report", "run": "r", "gen": 1, "rank": 0, "step": 5, "t": 0}
    col.ingest(0, json.dumps({**msg, "layers": layers, "summary": {"grade": 0}}), 1.0)
    ctl = SimpleNamespace(state=rc.State(phase=rc.Phase.RUNNING, generation=1), collector=col)
    ex = MetricsExporter(run="r", max_layers=8, clock=lambda: 2.0)
    ex.tick(ctl)
    text = ex.exposition()
    res = check_metrics(text)
    assert res.returncode == 0, res.stdout + res.stderr
    grades = {
        dict(ls)["layer"]: v
        for (n, ls), v in samples(text).items()
        if n == "spikeguard_layer_grade"
    }
    assert len(grades) == 9 and OTHER_LAYERS in grades  # 8 layers, then one for the rest
    assert grades[odd] == 0  # a quote, a newline and a backslash survive the round trip
    worst = sorted(layers, key=lambda n: layers[n]["grade"])[:8]  # ties: the order reported
    assert set(grades) == {*worst, OTHER_LAYERS}  # the worst layers, not the first reported
    folded = [n for n in layers if n not in worst]
    assert grades[OTHER_LAYERS] == min(layers[n]["grade"] for n in folded)  # the worst of them
    logits = {
        dict(ls)["layer"]: v
        for (n, ls), v in samples(text).items()
        if n == "spikeguard_layer_max_attn_logit"
    }
    assert {logits[f"blocks.{i}"] for i in range(91, 99)} == {float(i) for i in range(91, 99)}
    assert logits[OTHER_LAYERS] == 90.0  # the highest logit among the rest
    assert value(text, "spikeguard_layers_folded", run="r") == 100 - 8


def test_a_long_layer_name_is_shortened_and_kept_apart():
    col = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    a, b = "m" * 300 + ".a", "m" * 300 + ".b"
    msg = {"v": 1, "type": "report", "run": "r", "gen": 1, "rank": 0, "step": 5, "t": 0}
    layers = {a: {"grade": 3}, b: {"grade": 4}}
    col.ingest(0, json.dumps({**msg, "layers": layers, "summary": {}}), 1.0)
    ex = MetricsExporter(run="r", clock=lambda: 2.0)
    ex.tick(SimpleNamespace(state=rc.State(), collector=col))
    labels = {
        dict(ls)["layer"]: v
        for (n, ls), v in samples(ex.exposition()).items()
        if n == "spikeguard_layer_grade"
    }
    assert sorted(labels.values()) == [3, 4] and all(len(k) <= 120 for k in labels)


def test_heartbeat_ages_grow_at_scrape_time_and_tokens_count_across_generations():
    now = [10.0]
    col = Collector(world_size=2, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    hb = {"v": 1, "type": "heartbeat", "run": "r", "gen": 1, "step": 3, "t": 0, "tokens": 1000}
    col.ingest(0, json.dumps({**hb, "rank": 0}), 8.0)
    ctl = SimpleNamespace(state=rc.State(phase=rc.Phase.RUNNING, generation=1), collector=col)
    ex = MetricsExporter(run="r", clock=lambda: now[0])
    ex.tick(ctl)
    now[0] = 100.0  # the controller's loop is stuck: no tick since
    text = ex.exposition()
    assert value(text, "spikeguard_rank_heartbeat_age_seconds", run="r", rank="0") == 92.0
    assert value(text, "spikeguard_rank_heartbeat_age_seconds", run="r", rank="1") == 100.0
    assert value(text, "spikeguard_tick_age_seconds", run="r") == 90.0
    assert value(text, "spikeguard_rank_tokens_total", run="r", rank="0") == 1000
    col.new_generation(2, 100.0)  # a relaunch: the ranks count from 0 again
    col.ingest(0, json.dumps({**hb, "rank": 0, "gen": 2, "tokens": 200}), 101.0)
    ex.tick(ctl)
    assert value(ex.exposition(), "spikeguard_rank_tokens_total", run="r", rank="0") == 1200


def test_metrics_are_served_over_http_and_wait_for_one_final_scrape():
    ex = exporter_of(demo_controller())
    assert ex.final_scrape(60.0) is False  # nobody ever scraped: no waiting at all
    url = ex.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            body = r.read()
        assert b'spikeguard_phase{phase="COMPLETED",run="demo"} 1.0' in body
        later = threading.Timer(0.3, lambda: urllib.request.urlopen(url, timeout=10).read())
        later.start()
        assert ex.final_scrape(60.0) is True  # returns once Prometheus saw the final state
        later.join()
    finally:
        ex.close()
        ex.close()  # idempotent (the runner closes it again among the notifiers)


def test_a_busy_port_costs_the_metrics_not_the_run(tmp_path, capsys):
    from conftest import toy_job
    from spikeguard.supervisor.runner import start_metrics

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        job = toy_job(tmp_path, policy="default", metrics={"port": port})
        (tmp_path / "run").mkdir()
        assert start_metrics(job, tmp_path / "run") is None
    assert f"no /metrics: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().out
    job = toy_job(tmp_path, policy="default", metrics={"enabled": False})
    assert start_metrics(job, tmp_path / "run") is None
    job = toy_job(tmp_path, policy="default")  # port 0: any free one, written down
    ex = start_metrics(job, tmp_path / "run")
    try:
        url = (tmp_path / "run" / "metrics.url").read_text().strip()
        assert url == ex.url and url.startswith("http://127.0.0.1:")
        assert (tmp_path / "run" / "metrics.url").stat().st_mode & 0o777 == 0o600
    finally:
        ex.close()


def test_each_rank_s_step_time_and_its_ratio_to_its_peers_are_exported():
    col = Collector(world_size=3, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    slow = {0: 0.10, 1: 0.10, 2: 0.15}  # rank 2 computes 1.5x as long as its peers
    for step in range(5):
        for rank, seconds in slow.items():
            hb = {"v": 1, "type": "heartbeat", "run": "r", "gen": 1, "rank": rank, "step": step}
            col.ingest(rank, json.dumps({**hb, "t": step, "step_time": seconds}), 1.0 + step)
    ctl = SimpleNamespace(state=rc.State(phase=rc.Phase.RUNNING, generation=1), collector=col)
    ex = MetricsExporter(run="r", clock=lambda: 10.0)
    ex.tick(ctl)
    text = ex.exposition()
    assert check_metrics(text).returncode == 0
    assert value(text, "spikeguard_rank_step_seconds", run="r", rank="2") == 0.15
    assert value(text, "spikeguard_rank_step_ratio", run="r", rank="2") == pytest.approx(1.5)
    assert value(text, "spikeguard_rank_step_ratio", run="r", rank="0") == pytest.approx(0.8)
