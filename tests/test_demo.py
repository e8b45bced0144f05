"""`spikeguard demo --steps 1000` end to end: the diverging example, 2 real ranks on an embedded
Ray, recovered; on call, Debian's real Alertmanager and a PagerDuty Events v2 recorder get the
incident's trigger and its resolution, and in its Slack thread (the local Slack-compatible
server, Socket Mode) an allowed user's press of Acknowledge is carried out and an outsider's is
refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from alertmanager_server import Alertmanager, available
from fakepagers import PagerDutyServer
from fakeslack import APP_TOKEN, TOKEN, FakeSlack
from spikeguard.policies import load_policy
from spikeguard.supervisor.sinks.pagers.pagerduty import dedup_key
from test_slack_buttons import ALICE, MALLORY, actions_of, wait_until

pytestmark = pytest.mark.slow

BACK = load_policy("default").recovery.min_steps_back
"""How far before its incident the default policy rolls back (at least)."""


KEY = "D3M0R0UT1NGKEY0123456789abcdefAB"
DEFAULT = Path(__file__).parents[1] / "policies" / "default.yaml"


def paging_default(tmp_path: Path) -> Path:
    """The built-in default with its recoveries paged too (``pagerduty`` added to the warn
    route, as the README says a team that wants them paged does): detection, recovery and
    every other route unchanged."""
    text = DEFAULT.read_text()
    warn = "    warn: [console, slack, alertmanager, webhook]\n"
    assert warn in text
    path = tmp_path / "default-paged.yaml"
    path.write_text(
        text.replace(warn, "    warn: [console, slack, alertmanager, pagerduty, webhook]\n")
    )
    return path


@pytest.mark.timeout(900)  # a few minutes on an idle 2-core machine, much more under load
def test_demo_recovers_the_diverging_example(tmp_path):
    run_dir = tmp_path / "demo"
    pd, slack = PagerDutyServer(), FakeSlack().__enter__()  # the Slack-compatible server
    am = Alertmanager(tmp_path) if available() else None  # its part says so below when absent
    env = {
        **os.environ,
        "SPIKEGUARD_PAGERDUTY_ROUTING_KEY": KEY,
        "SPIKEGUARD_PAGERDUTY_URL": pd.url,
        "SLACK_BOT_TOKEN": TOKEN,
        "SLACK_APP_TOKEN": APP_TOKEN,
        "SPIKEGUARD_SLACK_API_URL": slack.api_url,
        "SPIKEGUARD_SLACK_CHANNEL": "#ml-alerts",
        "SPIKEGUARD_SLACK_OPERATORS": ALICE,
        **({"SPIKEGUARD_ALERTMANAGER_URL": am.url} if am else {}),
    }
    pressed: list[Any] = []

    def acknowledge() -> None:
        """Press Acknowledge on the incident's root as an outsider, then as the on-call."""
        roots = wait_until(lambda: [r for r in slack.roots() if actions_of(r)], 800)
        if roots and slack.socket_mode.wait_connected(60):
            value = actions_of(roots[0])["spikeguard_ack"]
            for user, name in ((MALLORY, "mallory"), (ALICE, "alice")):
                pressed.append(slack.press("spikeguard_ack", value, user, name, timeout_s=60))

    presser = threading.Thread(target=acknowledge, daemon=True)
    presser.start()
    try:
        r, resolved = _demo(run_dir, tmp_path, env), am.wait_for_status("resolved") if am else None
        presser.join(60)
        replies = " ".join(str(m.get("text", "")) for m in slack.messages if m.get("thread_ts"))
        violations, ephemerals = list(slack.violations), list(slack.ephemerals)
    finally:
        pd.close()
        slack.__exit__(None, None, None)
        if am is not None:
            am.close()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = _check_story(run_dir, r)
    # Slack: both presses were answered; the on-call's acknowledged the incident, the outsider's
    # was refused (privately, and journaled)
    assert len(pressed) == 2 and all(p.ack is not None for p in pressed), pressed
    assert violations == []
    acked = [e for e in events if e["kind"] == "operator" and e["code"] == "acknowledged"]
    assert [(e["who"], e["via"]) for e in acked] == [("U0ALICE (alice)", "slack")]
    refused = [e for e in events if e.get("code") == "button_refused"]
    assert refused and "U0MALLORY" in json.dumps(refused[0])
    assert [e["user"] for e in ephemerals] == [MALLORY]
    assert "Acknowledged" in replies, replies
    # PagerDuty: one alert per incident, triggered, acknowledged (the press), resolved
    assert pd.invalid == []
    by_key: dict[str, list[str]] = {}
    for e in pd.events():
        by_key.setdefault(e["dedup_key"], []).append(e["event_action"])
    first = by_key.pop(dedup_key("demo", acked[0]["incident"]), None)
    assert first == ["trigger", "acknowledge", "resolve"], (first, by_key)
    assert all(actions == ["trigger", "resolve"] for actions in by_key.values()), by_key
    assert set(pd.alerts.values()) == {"resolved"}
    if am is None:
        pytest.skip("Slack and PagerDuty passed; Alertmanager is not installed (.ci/run does)")
    notes = am.notifications()
    assert any(n["status"] == "firing" for n in notes), notes
    assert resolved, notes


def _demo(run_dir: Path, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        # the demo's recipe with a 1000-step run instead of 1600: the warm-up (where it diverges,
        # ~step 725) is the same, the cosine tail shorter; the README's full run is `make demo`
        [
            sys.executable,
            "-m",
            "spikeguard.supervisor.cli",
            "demo",
            "--run-dir",
            str(run_dir),
            "--steps",
            "1000",
            "--policy",
            str(paging_default(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def _check_story(run_dir: Path, r: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    ev = subprocess.run(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "events", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,  # a loaded machine: the command is quick, its start-up (imports) is not
        check=True,
    )
    events = [json.loads(line) for line in ev.stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    story = [
        "incident",
        "kill",
        "rollback",
        "lr_cut",
        "optimizer_reset",
        "probation_start",
        "probation_passed",
        "completed",
    ]
    it = iter(kinds)
    assert all(k in it for k in story), (
        kinds
    )  # the story, in order (a failed probation may repeat it)
    rollback = next(e for e in events if e["kind"] == "rollback")
    incident = next(e for e in events if e["kind"] == "incident")
    assert rollback["checkpoint_step"] <= incident["step"] - BACK and rollback["grade"] >= 4
    final = events[-1]["final_loss"]
    # without spikeguard the 1600-step recipe ends at 2.3-2.7 (3 seeds), the x0.1-LR control at
    # ~1.5; this 1000-step one under spikeguard ended at 1.67 (two rollbacks, x0.25)
    assert final < 1.8, final
    page = (run_dir / "report.html").read_text()
    assert page.count('class="series"') >= 4 * 2  # four panels, at least two generations each
    assert "batch_ids-1.json" in page  # the incident's batch forensics
    assert "what happened" in r.stdout
    return events
