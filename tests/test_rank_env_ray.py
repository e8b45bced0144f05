"""On real Ray: `spikeguard submit` started with secrets in its environment runs a job whose rank
dumps the environment it got. No secret reaches the rank, ordinary variables do, nothing the
supervisor prints or journals holds a secret, and the run directory it leaves is private."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"

SECRETS = {
    "SLACK_BOT_TOKEN": "xoxb-1111-2222-SECRETabcdef",
    "SPIKEGUARD_SLACK_MENTION": "S0ONCALL",  # a setting (no channel: Slack stays off)
    "SPIKEGUARD_SLACK_API_URL": "https://slack-gateway.example.com/api/",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-SECRETEXAMPLEKEY",
    "MY_SERVICE_PASSWORD": "correct-horse-SECRET-staple",
    "ALERT_TARGET": "https://hooks.slack-gov.com/services/T000/B000/SECRETxx",  # by value
}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_no_secret_of_the_supervisor_reaches_a_rank_and_the_run_dir_is_private(tmp_path):
    out, run = tmp_path / "env", tmp_path / "run"
    out.mkdir()
    job = tmp_path / "job.yaml"
    job.write_text(
        json.dumps(  # JSON is YAML
            {
                "name": "envcheck",
                "entrypoint": str(SCRIPTS / "toy_rank.py"),
                "args": ["--steps", "25", "--env-out", str(out)],
                "workers": 1,
                "policy": str(POLICY),
                "run_dir": str(run),
                "env": {"MY_JOB_VAR": "from-the-job"},
            }
        )
    )
    env = {
        **os.environ,
        **SECRETS,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    r = subprocess.run(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(job), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        umask=0o022,  # what CI runs with: private modes must not depend on it
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    rank_env = json.loads((out / "rank0.json").read_text())
    assert not set(SECRETS) & set(rank_env), sorted(set(SECRETS) & set(rank_env))
    assert "SECRET" not in json.dumps(rank_env)
    assert rank_env["PATH"] == os.environ["PATH"] and rank_env["OMP_NUM_THREADS"] == "1"
    assert rank_env["HF_HOME"] == str(tmp_path / "hf")
    assert rank_env["MY_JOB_VAR"] == "from-the-job" and rank_env["RANK"] == "0"

    for text in (r.stdout, r.stderr, (run / "journal.jsonl").read_text()):
        assert "SECRET" not in text

    assert mode(run) == 0o700
    for sub in ("plans", "logs"):
        assert mode(run / sub) == 0o700, sub
    written = ["journal.jsonl", "reports.jsonl", "status.json", "supervisor.lock"]
    written += [f"logs/{p.name}" for p in (run / "logs").iterdir()]
    written += [n for n in ("FENCE", "STOP") if (run / n).exists()]
    written += [f"plans/{p.name}" for p in (run / "plans").iterdir()]
    assert "logs/gen001-rank0.log" in written
    assert {name: mode(run / name) for name in written} == dict.fromkeys(written, 0o600)
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
