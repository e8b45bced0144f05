"""The job spec: validation with file:line errors, secrets refused, CLI exit codes (no Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from spikeguard.policies import PolicyError
from spikeguard.supervisor.job import load_job

GOOD = """\
name: pretrain-1b
entrypoint: train.py
args: ["--steps", "100"]
workers: 2
policy: default
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_good_job_resolves_paths_against_the_job_file(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.entrypoint == str(tmp_path / "train.py") and job.workers == 2
    assert job.resolved_backend() == "gloo"
    assert job.resolved_run_dir(tmp_path) == tmp_path / "runs" / "pretrain-1b"


def test_cli_overrides_replace_fields(tmp_path):
    assert load_job(write(tmp_path, GOOD), {"workers": 4}).workers == 4


@pytest.mark.parametrize(
    "text,line,needle",
    [
        (GOOD + "wrokers: 3\n", 6, "wrokers"),
        (GOOD.replace("workers: 2", "workers: two"), 4, "workers"),
        (GOOD.replace("workers: 2", "workers: 0"), 4, "workers"),
        (GOOD + "backend: mpi\n", 6, "backend"),
        (
            GOOD + "notify:\n  slack:\n    channel: '#x'\n    token: xoxb-123-456-abcdef\n",
            9,
            "token",
        ),
        (GOOD + "env:\n  HF_TOKEN: abc\n", 7, "secret"),
        (GOOD + "workers: 3\n", 6, "duplicate"),
        (GOOD + "checkpoints:\n  keep_last: 0\n", 7, "keep_last"),
        (GOOD + "checkpoints:\n  keep_evry: 100\n", 7, "keep_evry"),
        (GOOD + "checkpoints:\n  min_grade: 9\n", 7, "min_grade"),
    ],
)
def test_bad_jobs_name_file_line_and_field(tmp_path, text, line, needle):
    p = write(tmp_path, text)
    with pytest.raises(PolicyError) as e:
        load_job(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}:"), msg
    assert needle in msg.lower(), msg
    assert "xoxb-123" not in msg  # never echo a secret


def test_submit_with_a_bad_job_exits_2_without_a_traceback(tmp_path):
    p = write(tmp_path, GOOD + "wrokers: 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and f"{p}:6:" in r.stderr


HOSTILE_JOBS = {
    "deep": (GOOD + "args: " + "[" * 20_000 + "]" * 20_000 + "\n", 6, "nested more than 64"),
    "bigint": (GOOD.replace("workers: 2", "workers: " + "9" * 5000), 4, "too large"),
    "anchor": (GOOD + "env: &e {A: *e}\n", 6, "nested more than 64"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_JOBS))
def test_hostile_jobs_name_file_line_and_field(tmp_path, name):
    text, line, needle = HOSTILE_JOBS[name]
    p = write(tmp_path, text)
    with pytest.raises(PolicyError) as e:
        load_job(p)
    assert str(e.value).startswith(f"{p}:{line}:") and needle in str(e.value), str(e.value)


def test_submit_exits_2_on_hostile_jobs_and_policies_without_a_traceback(tmp_path):
    deep_policy = tmp_path / "deep.yaml"
    deep_policy.write_text("version: 1\nname: a\nrules: " + "[" * 20_000 + "]" * 20_000 + "\n")
    big = tmp_path / "big.yaml"
    big.write_text(GOOD + "# " + "x" * (50 << 20) + "\n")
    cases = {
        write(tmp_path, HOSTILE_JOBS["deep"][0]): "job.yaml:6:",
        tmp_path / "policy-job.yaml": "deep.yaml:3:",
        big: "big.yaml: the file is 50.0 MiB",
    }
    (tmp_path / "policy-job.yaml").write_text(GOOD.replace("policy: default", "policy: deep.yaml"))
    for path, expected in cases.items():
        r = subprocess.run(
            [sys.executable, "-m", "spikeguard.supervisor.cli", "submit", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and expected in r.stderr, r.stderr[-2000:]


def test_submit_turns_an_unforeseen_load_error_into_one_line(tmp_path, monkeypatch, capsys):
    from spikeguard.supervisor import job
    from spikeguard.supervisor.cli import main

    def broken(path, overrides=None):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(job, "load_job", broken)
    assert main(["submit", str(write(tmp_path, GOOD))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RecursionError" in err and "job.yaml" in err


@pytest.mark.parametrize(
    "value",
    [
        "xapp-1-A0123456789-1234567890123-abcdef",  # an app-level (Socket Mode) token
        "xoxe.xoxp-1-Mi0yLTEyMzQ1Njc4OQ",  # a refresh token
        "xoxe-1-My0xLTEyMzQ1Njc4OTA",  # a configuration token
        "https://hooks.slack-gov.com/services/T0000/B0000/XXXXXXXX",  # a GovSlack webhook
    ],
)
def test_every_slack_credential_shape_in_a_job_file_is_refused(tmp_path, value):
    p = write(tmp_path, GOOD + f'env:\n  SOCKET_MODE: "{value}"\n')
    with pytest.raises(PolicyError) as e:
        load_job(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:7:") and "env.SOCKET_MODE" in msg, msg
    assert "secrets never go in a job file" in msg and value not in msg


def test_checkpoint_retention_comes_from_the_job_and_the_policy(tmp_path):
    from spikeguard.policies import load_policy
    from spikeguard.supervisor.runner import retention_settings

    text = GOOD + "checkpoints: {keep_last: 5, keep_every: 1000, keep_healthy: 1}\n"
    job = load_job(write(tmp_path, text))
    settings = retention_settings(job, load_policy("default"))
    assert settings is not None
    assert (settings.keep_last, settings.keep_every, settings.keep_healthy) == (5, 1000, 1)
    # healthy as the policy says (S4), looking back as far as its rules roll back (150 steps)
    assert (settings.min_grade, settings.min_steps_back) == (4, 150)
    job = load_job(write(tmp_path, GOOD + "checkpoints: {min_grade: 6, enabled: false}\n"))
    assert retention_settings(job, load_policy("default")) is None
    job = load_job(write(tmp_path, GOOD + "checkpoints: {min_grade: 6}\n"))
    assert retention_settings(job, load_policy("default")).min_grade == 6
