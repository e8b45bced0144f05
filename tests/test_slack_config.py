"""Slack settings: secrets only from the environment; a token written in a job file is refused
(by the job loader, which scans with the one secret scanner, ``contract.secrets``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakeslack import TOKEN
from spikeguard.policies import PolicyError
from spikeguard.supervisor.job import load_job
from spikeguard.supervisor.sinks.slack import SlackNotifier, SlackSettings
from spikeguard.workers.contract.secret_scan import find_secret

SECRET = "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp"
HOOK = "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXX"


def test_from_env_takes_secrets_and_defaults_from_the_environment():
    env = {
        "SLACK_BOT_TOKEN": SECRET,
        "SPIKEGUARD_SLACK_CHANNEL": "#ml-oncall",
        "SPIKEGUARD_SLACK_API_URL": "http://127.0.0.1:9/api",
    }
    s = SlackSettings.from_env(mention="<!subteam^S0ONCALL>", environ=env, repeat_interval_s=30)
    assert (s.mode, s.token, s.channel, s.api_url) == (
        "bot",
        SECRET,
        "#ml-oncall",
        "http://127.0.0.1:9/api/",
    )
    assert s.repeat_interval_s == 30 and s.min_interval_s == 1.0 and s.problems() == []
    assert SECRET not in repr(s)
    assert SlackSettings.from_env(channel="C0ARG", environ=env).channel == "C0ARG"


def test_default_api_url_and_webhook_mode():
    s = SlackSettings.from_env(channel="#x", environ={"SLACK_BOT_TOKEN": TOKEN})
    assert s.api_url == "https://slack.com/api/"
    w = SlackSettings.from_env(environ={"SPIKEGUARD_SLACK_WEBHOOK_URL": HOOK})
    assert w.mode == "webhook" and w.problems() == [] and HOOK not in repr(w)


@pytest.mark.parametrize("key", ["token", "webhook_url", "api_url"])
def test_secrets_cannot_be_passed_as_arguments(key):
    with pytest.raises(ValueError, match="only come from the environment"):
        SlackSettings.from_env(channel="#x", environ={}, **{key: "x"})


def test_problems_explain_what_is_missing():
    assert SlackSettings.from_env(environ={}).problems() == [
        "SLACK_BOT_TOKEN is not set",
        "no channel: set slack.channel in the job file or SPIKEGUARD_SLACK_CHANNEL",
    ]
    s = SlackSettings.from_env(mode="webhook", environ={})
    assert s.problems() == ["webhook mode needs SPIKEGUARD_SLACK_WEBHOOK_URL"]
    with pytest.raises(ValueError, match="SLACK_BOT_TOKEN is not set"):
        SlackNotifier(
            SlackSettings.from_env(channel="#x", environ={}), run="r", journal=lambda e: None
        )


@pytest.mark.parametrize(
    "given, expected",
    [
        ("U0ABC123", "<@U0ABC123>"),
        ("S0ONCALL", "<!subteam^S0ONCALL>"),
        ("<@U0ABC123>", "<@U0ABC123>"),
        ("<!subteam^S0ONCALL|ml-oncall>", "<!subteam^S0ONCALL|ml-oncall>"),
        ("<!here>", "<!here>"),
        (None, None),
    ],
)
def test_mentions_are_normalised(given, expected):
    assert SlackSettings(mention=given).mention == expected


def test_a_mention_that_would_page_nobody_is_refused():
    with pytest.raises(ValueError, match="would notify nobody"):
        SlackSettings(mention="@ml-oncall")


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="mode"):
        SlackSettings(mode="email")
    with pytest.raises(ValueError, match="min_interval_s"):
        SlackSettings(min_interval_s=-1)
    with pytest.raises(ValueError, match="unknown or secret"):
        SlackSettings().with_options(token="x")
    assert SlackSettings().with_options(max_retries=1).max_retries == 1


JOB = "name: gpt-1b\nentrypoint: train.py\n"  # lines 1-2 of every job file below
JOB_WITH_TOKEN = (
    JOB
    + f"""\
notify:
  slack:
    channel: "#ml-oncall"
    token: {SECRET}
"""
)


def write_job(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    """``text`` as a job file under ``tmp_path`` (the entrypoint need not exist)."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_token_in_a_job_file_is_refused_without_echoing_it(tmp_path):
    path = write_job(tmp_path, JOB_WITH_TOKEN, "jobs/gpt-1b.yaml")
    with pytest.raises(PolicyError) as err:
        load_job(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:6:") and ": notify.slack.token: " in msg
    assert "SLACK_BOT_TOKEN" in msg and SECRET not in msg


@pytest.mark.parametrize(
    "doc, line, path, secret",
    [
        (f"notify:\n  slack:\n    webhook_url: {HOOK}\n", 5, "notify.slack.webhook_url", HOOK),
        (f"env:\n  SLACK_BOT_TOKEN: {SECRET}\n", 4, "env.SLACK_BOT_TOKEN", SECRET),
        (f'args: ["--hook", "{HOOK}"]\n', 3, "args[1]", HOOK),
        (
            "slack_token: redacted-but-still-a-secret\n",
            3,
            "slack_token",
            "redacted-but-still-a-secret",
        ),
        (
            "notify:\n  slack:\n    token: not-an-xox-token\n",
            5,
            "notify.slack.token",
            "not-an-xox-token",
        ),
    ],
)
def test_secrets_anywhere_in_a_job_file_are_refused(tmp_path, doc, line, path, secret):
    job = write_job(tmp_path, JOB + doc)
    with pytest.raises(PolicyError) as err:
        load_job(job)
    msg = str(err.value)
    assert msg.startswith(f"{job}:{line}:") and f": {path}: " in msg, msg
    assert "secrets never go in a job file" in msg and secret not in msg


ORDINARY = """\
name: gpt-1b
entrypoint: train.py
args: ["--max-tokens", "2048", "--tokenizer", "gpt2"]
env: {TOKENIZERS_PARALLELISM: "false", max_tokens: "2048"}
notify: {slack: {channel: "#ml-oncall", mention: "<!subteam^S0ONCALL>"}}
"""


def test_ordinary_ml_keys_are_not_mistaken_for_secrets(tmp_path):
    job = load_job(write_job(tmp_path, ORDINARY))
    assert job.env == {"TOKENIZERS_PARALLELISM": "false", "max_tokens": "2048"}
    assert job.args == ["--max-tokens", "2048", "--tokenizer", "gpt2"]
    assert job.notify.slack is not None and job.notify.slack.channel == "#ml-oncall"
    # the job model has no slack token field at all; as data, an empty one is no secret either
    doc = yaml.safe_load(ORDINARY.replace('"#ml-oncall",', '"#ml-oncall", token: null,'))
    assert doc["notify"]["slack"]["token"] is None and find_secret(doc) is None
