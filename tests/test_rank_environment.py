"""What a rank's process inherits: the agent's environment without the supervisor's secrets, plus
the job's and the launcher's variables (no Ray; the Ray end-to-end proof is test_rank_env_ray)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from spikeguard.supervisor.launch import agent as agent_mod
from spikeguard.supervisor.launch.environment import rank_environment
from spikeguard.supervisor.launch.interface import NodeInfo
from spikeguard.supervisor.redaction import held_secrets, withheld
from spikeguard.supervisor.sinks.slack.settings import SlackSettings

SECRETS = {
    # secret by name (the one scanner's secret_key)
    "SLACK_BOT_TOKEN": "xoxb-1111-2222-abcdefabcdef",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz012345",
    "MY_DB_PASSWORD": "correct-horse-battery",
    "PAGERDUTY_ROUTING_KEY": "R0123456789abcdefABCDEF0123456789",
    # secret by value (the one scanner's secret_value), under innocent names
    "ALERT_TARGET": "https://hooks.slack-gov.com/services/T000/B000/XXXXXXXX",
    "SOCKET_MODE": "xapp-1-A0123456789-1234567890123-abcdef",
    "REFRESH": "xoxe.xoxp-1-Mi0yLTEyMzQ1Njc4OQ",
    "DEPLOY_KEY_PEM": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXkt\n",
    "GH": "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    # the supervisor's own notification settings: not secrets, still none of a rank's business
    "SPIKEGUARD_SLACK_CHANNEL": "#ml-oncall",
    "SPIKEGUARD_SLACK_MENTION": "S0ONCALL",
    "SPIKEGUARD_SLACK_API_URL": "https://slack-gateway.example.com/api/",
    "SPIKEGUARD_SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T0/B0/hook",
    "SPIKEGUARD_PAGERDUTY_SERVICE": "PABC123",
}
ORDINARY = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/alice",
    "OMP_NUM_THREADS": "4",
    "HF_HOME": "/data/hf",
    "TOKENIZERS_PARALLELISM": "false",
    "MAX_TOKENS": "2048",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "NCCL_SOCKET_IFNAME": "eth0",
    "SPIKEGUARD_RUN_ID": "stale-from-the-shell",
}


def test_the_supervisors_secrets_never_reach_a_rank():
    base = {**ORDINARY, **SECRETS}
    env = rank_environment(base, {}, {})
    assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
    assert env == ORDINARY
    for value in SECRETS.values():
        assert value not in json.dumps(env)


def test_the_job_and_the_launcher_add_their_variables_and_win():
    base = {**ORDINARY, **SECRETS}
    job = {"OMP_NUM_THREADS": "8", "MY_FLAG": "1"}
    launcher = {"RANK": "3", "SPIKEGUARD_RUN_ID": "pretrain", "MY_FLAG": "launcher"}
    env = rank_environment(base, job, launcher)
    assert env["OMP_NUM_THREADS"] == "8" and env["RANK"] == "3"
    assert env["MY_FLAG"] == "launcher" and env["SPIKEGUARD_RUN_ID"] == "pretrain"
    assert env["PATH"] == ORDINARY["PATH"] and "SLACK_BOT_TOKEN" not in env
    assert base == {**ORDINARY, **SECRETS}  # pure: the inputs are not touched


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_withheld_says_why(name):
    assert withheld(name, SECRETS[name])
    assert withheld("PATH", "/usr/bin") is None


class _Recording(Mapping[str, str]):
    """An environment that remembers every name read from it."""

    def __init__(self) -> None:
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        raise KeyError(key)

    def get(self, key, default=None):  # type: ignore[override]
        self.read.add(key)
        return default

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def test_every_variable_the_slack_settings_read_is_withheld():
    env = _Recording()
    SlackSettings.from_env(environ=env)
    assert env.read, "from_env read no variable?"
    for name in env.read:
        assert withheld(name, "x"), f"{name} would reach the ranks"


def test_held_secrets_are_the_values_to_redact_and_never_file_paths():
    env = {
        **ORDINARY,
        **SECRETS,
        "GOOGLE_APPLICATION_CREDENTIALS": "/home/alice/key.json",
        "SHORT_TOKEN": "abc",
    }
    held = held_secrets(env)
    assert SECRETS["SLACK_BOT_TOKEN"] in held and SECRETS["MY_DB_PASSWORD"] in held
    assert SECRETS["ALERT_TARGET"] in held  # a credential by value
    assert "#ml-oncall" not in held and "S0ONCALL" not in held  # settings, not secrets
    # a path names where a secret is, it is none: blanking it would garble checkpoint paths
    assert "/home/alice/key.json" not in held and "abc" not in held


def test_the_rank_agent_starts_its_process_with_the_filtered_environment(tmp_path, monkeypatch):
    """RankAgent.start (a plain class; Ray only wraps it) hands the rank the filtered env."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HOME", "/data/hf")
    monkeypatch.setattr(
        agent_mod.RankAgent,
        "node_info",
        lambda self: NodeInfo(node_id="n", ip="127.0.0.1", host="h", pid=1),
    )
    out = tmp_path / "env.json"
    code = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    agent = agent_mod.RankAgent(0)
    agent.start(
        generation=1,
        cmd=[sys.executable, "-c", code],
        env={"RANK": "0", "MY_JOB_VAR": "1"},
        cwd=str(tmp_path),
        log_path=str(tmp_path / "logs" / "gen001-rank0.log"),
    )
    deadline = time.monotonic() + 60
    while agent.poll().exit_code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    agent.kill()
    env = json.loads(Path(out).read_text())
    assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
    assert env["RANK"] == "0" and env["MY_JOB_VAR"] == "1" and env["HF_HOME"] == "/data/hf"
    assert env["SPIKEGUARD_REPORT"].startswith("unix://") and "PATH" in env


def test_a_job_can_pass_a_named_credential_but_never_the_supervisors_own():
    base = {
        "WANDB_API_KEY": "0123456789abcdef0123456789abcdef",
        "HF_TOKEN": "hf_" + "a" * 34,
        "SLACK_BOT_TOKEN": "xoxb-1-2-3",
        "PATH": "/usr/bin",
    }
    env = rank_environment(base, {}, {}, passed=("WANDB_API_KEY", "SLACK_BOT_TOKEN"))
    assert env["WANDB_API_KEY"] == base["WANDB_API_KEY"]  # named by the job: passed
    assert "HF_TOKEN" not in env and "SLACK_BOT_TOKEN" not in env  # not named / never passed
    assert env["PATH"] == "/usr/bin"


def test_the_job_file_refuses_to_pass_a_notification_setting(tmp_path):
    from spikeguard.policies import PolicyError
    from spikeguard.supervisor.job import load_job

    p = tmp_path / "job.yaml"
    p.write_text("name: j\nentrypoint: t.py\npass_env: [WANDB_API_KEY, SLACK_BOT_TOKEN]\n")
    with pytest.raises(PolicyError, match="SLACK_BOT_TOKEN is a notification setting"):
        load_job(p)
    p.write_text("name: j\nentrypoint: t.py\npass_env: [WANDB_API_KEY]\n")
    assert load_job(p).pass_env == ["WANDB_API_KEY"]
