"""The `spikeguard` command tells the truth: --version, stop on a finished / dead / live run,
events with a bad --kind or odd journal lines (no Ray)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from spikeguard.supervisor import rundir
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.decide.events import Kind

DEMO = Path(__file__).parent / "data" / "demo_run"


def demo_journal(run: Path, events: int | None = None) -> None:
    """The recorded demo's journal in ``run``, whole (a completed run) or its first ``events``
    (a run whose supervisor died then)."""
    run.mkdir(parents=True, exist_ok=True)
    lines = (DEMO / "journal.jsonl").read_text().splitlines(keepends=True)
    (run / "journal.jsonl").write_text("".join(lines[:events]))


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"spikeguard {importlib.metadata.version('spikeguard')}"
    )


def test_version_as_a_command():
    r = subprocess.run(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.startswith("spikeguard ") and not r.stderr


def test_stop_on_a_finished_run_says_how_it_finished_and_writes_nothing(tmp_path, capsys):
    demo_journal(tmp_path)
    assert main(["stop", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "already finished: completed (exit code 0)" in out and "nothing to stop" in out
    assert not (tmp_path / "STOP").exists()


@pytest.mark.parametrize("lock_file", [False, True])
def test_stop_without_a_live_supervisor_says_so_and_writes_nothing(tmp_path, capsys, lock_file):
    demo_journal(tmp_path, events=6)  # the dead supervisor was rolling back
    if lock_file:  # the dead supervisor's lock file stays; nobody holds it
        (tmp_path / "supervisor.lock").write_text("pid 12345 on somehost since then\n")
    assert main(["stop", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no supervisor is running" in err and "spikeguard submit" in err and "resumes" in err
    assert not (tmp_path / "STOP").exists()


def test_stop_asks_a_live_supervisor_to_stop(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPIKEGUARD_OPERATOR", "carol@oncall")
    demo_journal(tmp_path, events=6)
    lock = rundir.acquire_lock(tmp_path)  # the live supervisor (an open file of its own)
    try:
        assert main(["stop", str(tmp_path), "--reason", "maintenance"]) == 0
    finally:
        lock.close()
    out = capsys.readouterr().out
    assert "asked the supervisor" in out and f"pid {os.getpid()}" in out
    # what the supervisor journals as the stop's reason: why, and who asked
    assert (tmp_path / "STOP").read_text() == "maintenance (asked by carol@oncall via cli)"
    assert stat.S_IMODE(os.stat(tmp_path / "STOP").st_mode) == 0o600


def test_stop_without_a_run_is_bad_input(tmp_path, capsys):
    assert main(["stop", str(tmp_path)]) == 2
    assert "no run" in capsys.readouterr().err


def test_events_with_an_unknown_kind_lists_the_valid_ones(tmp_path, capsys):
    shutil.copy(DEMO / "journal.jsonl", tmp_path / "journal.jsonl")
    assert main(["events", str(tmp_path), "--kind", "launch", "--kind", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "'bogus'" in err and all(k.value in err for k in Kind)


def test_events_filters_by_kind(tmp_path, capsys):
    shutil.copy(DEMO / "journal.jsonl", tmp_path / "journal.jsonl")
    assert main(["events", str(tmp_path), "--kind", "kill", "--json"]) == 0
    kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
    assert kinds == ["kill", "kill"]


def test_events_never_raises_on_odd_journal_lines(tmp_path, capsys):
    lines = [
        {"kind": "launch", "generation": 1},  # no seq, no time
        {"kind": "alert", "seq": "7", "time": None, "reason": "seq as a string"},
        {"kind": 7, "seq": 3.5, "time": 12},
        {"kind": ["launch"], "seq": None, "incident": {"id": 1}},
        {"kind": "stopped", "seq": 5, "time": "2026-01-01T00:00:00Z", "reason": "by user"},
    ]
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert main(["events", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5
    assert out[0].split()[:2] == ["-", "-"] and "Launched generation 1" in out[0]
    assert "seq as a string" in out[1] and out[-1].endswith("Run stopped: by user")


def test_events_and_status_never_show_a_secret_an_older_journal_holds(
    tmp_path, capsys, monkeypatch
):
    token = "gw-7f3a9c2e5b8d1f4a"  # only the environment knows this one
    monkeypatch.setenv("SLACK_BOT_TOKEN", token)
    hook = "https://hooks.slack.com/services/T0/B0/s3cr3tPath"
    ev = {"seq": 1, "kind": "failed", "time": "t", "exit_code": 1, "reason": f"{token} {hook}"}
    ev["log_tail"] = f"token={token}"
    (tmp_path / "journal.jsonl").write_text(json.dumps(ev) + "\n")  # written before redaction
    for args in (["events"], ["events", "--json"], ["status"], ["status", "--json"]):
        assert main([*args, str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert token not in out and "s3cr3tPath" not in out and "[redacted]" in out, args
    assert main(["events", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["log_tail"] == "token=[redacted]"
