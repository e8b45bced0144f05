"""deploy/prometheus and deploy/grafana: the alert rules pass ``promtool check rules`` and their
unit tests (``promtool test rules``), the example Prometheus config loads them, and every query
of the Grafana dashboard names a metric the exporter really exposes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_metrics import demo_controller, exporter_of, samples

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "spikeguard.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
KEYWORDS |= {"unless", "bool", "offset", "inf", "nan"}


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests():
    res = promtool("check", "rules", "spikeguard-alerts.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 5 rules found" in res.stdout
    res = promtool("test", "rules", "spikeguard-alerts.test.yaml")
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    res = promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_rule_tests_can_fail(tmp_path):
    """A rule unit test that expects the wrong thing fails: promtool's verdict is real."""
    shutil.copy(PROM / "spikeguard-alerts.yaml", tmp_path)
    text = (PROM / "spikeguard-alerts.test.yaml").read_text()
    (tmp_path / "t.yaml").write_text(text.replace("for 5 minutes and its run", "for 4 minutes"))
    res = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert res.returncode != 0 and "SpikeguardSupervisorDown" in res.stdout + res.stderr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, keywords or labels)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        before = e[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent of a number (1e5)
        if e[m.end() :].lstrip().startswith("(") or m.group().lower() in KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_the_promql_parser_bites():
    expr = 'sum by (rank, le) (rate(a_total{x="b}", y=~"$run"}[5m])) > 1e5 and on (run) b == 1'
    assert metric_names(expr) == {"a_total", "b"}
    assert metric_names("histogram_quantile(0.95, sum by (le) (rate(h_bucket[1h])))") == {
        "h_bucket"
    }


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, annotation and template variable."""
    board = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in board["panels"] for t in p["targets"]]
    out += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in board["annotations"]["list"]
        if "expr" in a
    ]
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", v["query"]["query"])
            assert m, v["query"]
            out.append((f"variable {v['name']!r}", m.group(1)))
    return out


def exposed_names() -> set[str]:
    """Every series name the exporter's registry exposes, from its ``# TYPE`` lines (a family
    with no sample yet included: the recorded demo reports no tokens)."""
    text = exporter_of(demo_controller()).exposition().decode()
    out = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M):
        if kind == "histogram":
            out |= {name + "_bucket", name + "_count", name + "_sum"}
        else:
            out.add(name)
    assert out >= {name for name, _ in samples(text.encode())}
    return out


def test_every_dashboard_query_names_metrics_the_exporter_exposes(tmp_path):
    exposed = exposed_names()
    queries = dashboard_queries()
    assert len(queries) >= 15
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: {expr} selects no metric"
        assert names <= exposed, f"{where}: {sorted(names - exposed)} are not exposed"
    # ... and each one is valid PromQL (promtool parses them as recording rules)
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$run", ".*")}
        for i, (_, expr) in enumerate(queries)
    ]
    (tmp_path / "q.yaml").write_text(json.dumps({"groups": [{"name": "q", "rules": rules}]}))
    res = promtool("check", "rules", "q.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_dashboard_has_the_panels_on_call_needs():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "spikeguard"  # the README's dashboard_url: /d/spikeguard
    titles = {p["title"]: p for p in board["panels"]}
    for title in (
        "Effective-rank ratio (worst layer)",
        "Grade S0–S7 (worst layer)",
        "Attention entropy: mean / lowest head (nats)",
        "Grad norm with loss",
        "Per-layer grade (worst rank)",
        "Heartbeat age per rank",
        "Step time per rank",  # a straggler, before any rule fires (test_step_time_views.py)
        "Step time / peers' median",
    ):
        assert title in titles
    assert titles["Per-layer grade (worst rank)"]["type"] == "heatmap"
    mapping = titles["Grade S0–S7 (worst layer)"]["fieldConfig"]["defaults"]["mappings"][0]
    assert mapping["options"]["0"]["text"] == "S0" and mapping["options"]["7"]["text"] == "S7"
    # the datasource is a template variable everywhere: the board imports into any Grafana
    (ds,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    uses = [p["datasource"] for p in board["panels"]]
    uses += [t["datasource"] for p in board["panels"] for t in p["targets"]]
    uses += [a["datasource"] for a in board["annotations"]["list"] if "expr" in a]
    assert all(u == {"type": "prometheus", "uid": "${datasource}"} for u in uses)
    recovery = [a["name"] for a in board["annotations"]["list"] if "expr" in a]
    assert recovery == ["Incidents", "Relaunches", "Outcomes"]
