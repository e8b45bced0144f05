"""A hostile rank on real Ray + gloo: it writes hostile lines onto its own report socket, sends an
unencodable report, plants look-alike checkpoints (a 400-digit grade, a 1e308 grade, deep JSON,
a FIFO, a symlink loop) and crashes. The run completes, rolls back to the real checkpoint, and no
secret the supervisor holds is in the run directory or in the ranks' environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, events, launch_of
from fakeslack import TOKEN, FakeSlack

pytestmark = pytest.mark.slow

POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"

JOB = """\
name: toy
entrypoint: {script}
args: ["--steps", "60", "--ckpt-every", "20"]
workers: 2
policy: {policy}
run_dir: {run_dir}
env: {{SG_FAULT: "1:30:hostile:1", SG_ENV_OUT: "{env_out}"}}
timeouts: {{heartbeat_s: 30, first_heartbeat_s: 120, restart_backoff_s: 0.2, reap_interval_s: 2}}
ray: {{num_cpus: 4, object_store_mb: 80, dashboard: false}}  # a Ray start ~3 CPU-s cheaper
notify: {{slack: {{channel: "#ml-alerts"}}}}
"""

AWS = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
HOOK = "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX"


def test_a_hostile_rank_costs_one_recovery_and_leaks_nothing(tmp_path):
    run_dir = tmp_path / "run"
    env_out = tmp_path / "rank-env.jsonl"
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.format(script=SCRIPTS / "toy_rank.py", policy=POLICY, run_dir=run_dir, env_out=env_out)
    )
    with FakeSlack() as fake:
        env = dict(
            os.environ,
            SLACK_BOT_TOKEN=TOKEN,
            SPIKEGUARD_SLACK_API_URL=fake.api_url,
            AWS_SECRET_ACCESS_KEY=AWS,
            MY_WEBHOOK=HOOK,
        )
        r = subprocess.run(
            [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(job), "--quiet"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evs = events(run_dir)
    kinds = [e["kind"] for e in evs]
    assert kinds[-1] == "completed" and kinds.count("incident") == 1
    inc = next(e for e in evs if e["kind"] == "incident")
    assert inc["rule"] == "crash" and inc["rank"] == 1 and inc["exit_code"] == 3
    # the rollback passed over every look-alike and took the real checkpoint
    rollback = next(e for e in evs if e["kind"] == "rollback")
    assert rollback["checkpoint_step"] == 20, rollback
    assert launch_of(evs, 2)["plan"]["checkpoint_step"] == 20
    # the hostile lines cost a count each, never the supervisor
    status = json.loads((run_dir / "status.json").read_text())
    assert status["dropped"].get("malformed", 0) >= 1, status["dropped"]
    assert status["dropped"].get("out_of_range", 0) >= 3, status["dropped"]
    assert status["dropped"].get("wrong_type", 0) >= 1, status["dropped"]
    # no secret of the supervisor's reached a rank...
    dumped = [json.loads(line) for line in env_out.read_text().splitlines()]
    names, values = set(dumped[0]), set(dumped[1])
    assert not {"SLACK_BOT_TOKEN", "AWS_SECRET_ACCESS_KEY", "MY_WEBHOOK"} & names
    assert not {TOKEN, AWS, HOOK} & values
    assert "SPIKEGUARD_SLACK_API_URL" not in names and "PATH" in names
    # ...or any file in the run directory (journal, reports, logs, status, plans, checkpoints)
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            for secret in (TOKEN, AWS, HOOK):
                assert secret.encode() not in data, f"{secret[:8]}… in {path}"
