"""The console: the story as it is journaled, and the live view of what status.json holds."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.decide.events import STORY_KINDS
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.observe.status import live_status
from spikeguard.supervisor.sinks.console import ConsoleNotifier, LiveView, render_status

DEMO = Path(__file__).parent / "data" / "demo_run" / "journal.jsonl"


def test_console_prints_the_story_kinds_only():
    events = [json.loads(line) for line in DEMO.read_text().splitlines() if line.strip()]
    out = io.StringIO()
    console = ConsoleNotifier(out)
    for ev in events:
        console.handle(ev)
    for kind in ("notify_thread", "probation_progress", "supervisor_start"):
        console.handle({"kind": kind, "mono": 1.0, "reason": "bookkeeping"})
    lines = out.getvalue().splitlines()
    assert len(lines) == len([e for e in events if e["kind"] in STORY_KINDS]) == 18
    incident = next(e for e in events if e["kind"] == "incident")
    when = re.escape(f"{incident['mono']:.1f}s")
    assert re.fullmatch(
        rf"\[spikeguard +{when}\] entropy-collapse fired at step 775 → .*", lines[1]
    )
    assert "bookkeeping" not in out.getvalue()


def controller() -> SimpleNamespace:
    """A machine state and a collector as a controller holds them in probation."""
    state = rc.State(
        phase=rc.Phase.PROBATION,
        generation=2,
        lr_scale=0.5,
        incident=rc.Incident(id="inc-001", rule="r", reason="x", step=900, settings=rc.Settings()),
        probation_until=1400,
    )
    collector = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    collector.new_generation(2, now=0.0)
    rank = collector.ranks[0]
    rank.step, rank.loss = 1210, float("nan")
    rank.summary = {"grade": 5, "attn_entropy_min": 1.25, "attn_entropy_min_norm": 0.3125}
    return SimpleNamespace(state=state, collector=collector)


def test_live_view_renders_what_status_json_holds():
    out = io.StringIO()
    view = LiveView(every_s=60.0, out=out)
    view(controller())
    view(controller())  # within every_s: nothing more
    ctl = controller()
    status = live_status(ctl.state, ctl.collector)
    assert out.getvalue() == render_status(status) + "\n"
    assert out.getvalue() == (
        "PROBATION    gen 2  LR x0.5  probation until step 1400\n"
        "  1 rank · step 1210\n"
        "    r0    step 1210  S5  H_min/max 0.312  loss nan\n"
    )
    assert render_status(json.loads(json.dumps(status))) == out.getvalue().rstrip("\n")


def test_the_console_never_prints_a_secret(monkeypatch):
    token = "gw-7f3a9c2e5b8d1f4a"  # a gateway's token: only the supervisor's environment knows it
    monkeypatch.setenv("SLACK_BOT_TOKEN", token)
    out = io.StringIO()
    ConsoleNotifier(out).handle(
        {
            "kind": "failed",
            "mono": 3.0,
            "exit_code": 1,
            "reason": f"rank 0 crashed: auth {token} at https://hooks.slack-gov.com/services/T/B/x",
        }
    )
    line = out.getvalue()
    assert token not in line and "hooks.slack-gov.com" not in line
    assert "Run FAILED (exit code 1): rank 0 crashed: auth [redacted] at https://[redacted]" in line
