"""The run directory is private: 0700, every file the supervisor writes 0600, temp files from
mkstemp, and never a write through a symlink planted in it (real files, real symlinks)."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from spikeguard.supervisor import rundir
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.journal import Journal


@pytest.fixture(autouse=True)
def _umask_022():
    """What CI runs with: files would come out 0644 and directories 0755 unless made private."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A file outside the run directory that a planted symlink points at."""
    p = tmp_path / "elsewhere" / "precious.txt"
    p.parent.mkdir()
    p.write_text("precious")
    return p


def plant(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def test_write_atomic_makes_a_private_file_from_a_private_temp_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json.tmp").mkdir()  # the fixed temp name of old: in the way, yet no matter
    rundir.write_atomic(run / "status.json", "{}", fsync=True)
    assert (run / "status.json").read_text() == "{}" and mode(run / "status.json") == 0o600
    assert sorted(p.name for p in run.iterdir()) == ["status.json", "status.json.tmp"]


@pytest.mark.parametrize("name", ["status.json", "FENCE", "STOP", "plans/gen002.json"])
def test_a_planted_symlink_is_replaced_never_written_through(tmp_path, elsewhere, name):
    run = tmp_path / "run"
    plant(run / name, elsewhere)
    if name == "status.json":
        rundir.write_status(run, {"phase": "RUNNING"})
    else:
        rundir.write_atomic(run / name, "2")
    assert elsewhere.read_text() == "precious"  # the target is untouched
    assert not (run / name).is_symlink() and mode(run / name) == 0o600
    assert (run / name).read_text() in ("2", json.dumps({"phase": "RUNNING"}))


def test_a_planted_symlink_at_the_old_temp_name_is_not_written_through(tmp_path, elsewhere):
    run = tmp_path / "run"
    plant(run / "FENCE.tmp", elsewhere)
    rundir.write_atomic(run / "FENCE", "3")
    assert elsewhere.read_text() == "precious" and (run / "FENCE").read_text() == "3"


def test_the_lock_creates_a_private_run_directory_and_lock_file(tmp_path):
    run = tmp_path / "runs" / "new"
    lock = rundir.acquire_lock(run)
    try:
        assert mode(run) == 0o700 and mode(run / "supervisor.lock") == 0o600
        assert f"pid {os.getpid()}" in (run / "supervisor.lock").read_text()
    finally:
        lock.close()


def test_an_existing_run_directory_keeps_its_mode_and_its_files_are_made_private(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    (run / "journal.jsonl").write_text("")
    os.chmod(run / "journal.jsonl", 0o644)
    rundir.prepare(run)
    # the directory was the user's (only what spikeguard creates is changed), the files are ours
    assert mode(run) == 0o755 and mode(run / "journal.jsonl") == 0o600
    assert mode(run / "reports.jsonl") == 0o600
    assert mode(run / "plans") == 0o700 and mode(run / "logs") == 0o700


def test_a_planted_symlink_at_the_lock_is_refused(tmp_path, elsewhere):
    run = tmp_path / "run"
    plant(run / "supervisor.lock", elsewhere)
    with pytest.raises(rundir.UnsafePath, match=r"supervisor\.lock is a symbolic link"):
        rundir.acquire_lock(run)
    assert elsewhere.read_text() == "precious"


@pytest.mark.parametrize("name", ["journal.jsonl", "reports.jsonl"])
def test_a_planted_symlink_at_an_append_only_file_is_refused(tmp_path, elsewhere, name):
    run = tmp_path / "run"
    plant(run / name, elsewhere)
    with pytest.raises(rundir.UnsafePath, match=re.escape(f"{name} is a symbolic link")):
        rundir.prepare(run)
    assert elsewhere.read_text() == "precious"


def test_the_journal_is_private_and_never_opened_through_a_symlink(tmp_path, elsewhere):
    run = tmp_path / "run"
    Journal(run, run="r").append("launch", generation=1)
    assert mode(run) == 0o700 and mode(run / "journal.jsonl") == 0o600
    other = tmp_path / "other"
    plant(other / "journal.jsonl", elsewhere)
    with pytest.raises(rundir.UnsafePath, match=r"journal\.jsonl is a symbolic link"):
        Journal(other, run="r")
    assert elsewhere.read_text() == "precious"


def test_a_rank_log_is_created_private_and_a_planted_link_is_replaced(tmp_path, elsewhere):
    log = tmp_path / "run" / "logs" / "gen001-rank0.log"
    plant(log, elsewhere)
    rundir.private_log(log)
    assert elsewhere.read_text() == "precious"
    assert not log.is_symlink() and mode(log) == 0o600
    assert mode(log.parent) == 0o755  # made by the test, not by spikeguard: left as it was
    created = tmp_path / "run2" / "logs" / "gen001-rank0.log"
    rundir.private_log(created)
    assert mode(created) == 0o600 and mode(created.parent) == 0o700
    with open(log, "ab") as f:  # what the agent does: append keeps the mode
        f.write(b"hello\n")
    rundir.private_log(log)  # a second launch of the same path keeps what is there
    assert log.read_bytes() == b"hello\n" and mode(log) == 0o600


@pytest.mark.parametrize("name", ["journal.jsonl", "supervisor.lock", "reports.jsonl"])
def test_submit_refuses_a_run_directory_with_a_planted_symlink(tmp_path, elsewhere, capsys, name):
    run = tmp_path / "run"
    plant(run / name, elsewhere)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: toy\nentrypoint: train.py\nworkers: 1\nrun_dir: {run}\n")
    assert main(["submit", str(job), "--quiet"]) == 2
    err = capsys.readouterr()
    assert f"{name} is a symbolic link" in err.out + err.err
    assert elsewhere.read_text() == "precious"


def test_the_report_is_private_and_replaces_a_planted_link(tmp_path, elsewhere):
    from spikeguard.supervisor.observe.report import write_report

    run, demo = tmp_path / "run", Path(__file__).parent / "data" / "demo_run"
    run.mkdir()
    shutil.copy(demo / "journal.jsonl", run / "journal.jsonl")
    with gzip.open(demo / "reports.jsonl.gz", "rb") as f:
        (run / "reports.jsonl").write_bytes(f.read())
    plant(run / "report.html", elsewhere)
    page = write_report(run, run / "report.html")
    assert elsewhere.read_text() == "precious"
    assert page == run / "report.html" and mode(page) == 0o600
    assert page.read_text().startswith("<!DOCTYPE html>")
