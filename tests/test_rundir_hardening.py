"""The run directory, round two: a torn last line of reports.jsonl is ended on restart (the next
record is not glued to it), reports.jsonl and the ranks' logs are never opened through a
symlink, an existing ``--run-dir`` keeps its mode (only what spikeguard creates is 0700), and
``submit`` takes the lock before it reads the journal. Real files, real symlinks, real flock."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from spikeguard.supervisor import rundir
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.intake.tick import ReportLog
from spikeguard.supervisor.journal import Journal

DEMO = Path(__file__).parent / "data" / "demo_run"


@pytest.fixture(autouse=True)
def _umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    p = tmp_path / "elsewhere" / "precious.txt"
    p.parent.mkdir()
    p.write_text("precious")
    return p


def test_a_torn_last_line_of_reports_is_ended_before_the_next_record(tmp_path):
    path = tmp_path / "reports.jsonl"
    path.write_bytes(b'{"type": "heartbeat", "step": 1}\n{"type": "heartbe')  # died mid-write
    log = ReportLog(path)  # a restarted supervisor
    log.write({"type": "exit", "rank": 0, "exit_code": 0})
    log.flush()
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and lines[1] == b'{"type": "heartbe'  # the fragment, on its own
    assert json.loads(lines[2]) == {"type": "exit", "rank": 0, "exit_code": 0}


def test_reports_is_never_opened_through_a_symlink(tmp_path, elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    (run / "reports.jsonl").symlink_to(elsewhere)  # planted after the supervisor's check
    with pytest.raises(rundir.UnsafePath, match=r"reports\.jsonl is a symbolic link"):
        log = ReportLog(run / "reports.jsonl")
        log.write({"type": "exit", "rank": 0})
        log.close()
    assert elsewhere.read_text() == "precious"


def test_a_rank_log_is_never_opened_through_a_symlink(tmp_path, elsewhere):
    from spikeguard.supervisor.launch.agent import _Process

    log = tmp_path / "run" / "logs" / "gen001-rank0.log"
    rundir.private_log(log)  # what the group does before the agent starts the rank
    log.unlink()
    log.symlink_to(elsewhere)  # planted between the two
    proc = _Process(rank=0, generation=1, sock=str(tmp_path / "sock"))
    with pytest.raises(rundir.UnsafePath, match=r"gen001-rank0\.log is a symbolic link"):
        proc.start(["sh", "-c", "echo written"], {}, str(tmp_path), str(log))
    if proc.proc is not None:  # the old agent started the rank, writing through the link
        proc.proc.wait(timeout=60)
    assert elsewhere.read_text() == "precious"


def test_an_existing_run_directory_keeps_its_mode(tmp_path):
    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # a shared scratch directory given as --run-dir
    lock = rundir.acquire_lock(shared)
    try:
        rundir.prepare(shared)
        Journal(shared, run="r", secrets=()).append("launch", generation=1)
    finally:
        lock.close()
    assert mode(shared) == 0o1777
    assert mode(shared / "journal.jsonl") == 0o600 and mode(shared / "supervisor.lock") == 0o600
    assert mode(shared / "plans") == 0o700 and mode(shared / "logs") == 0o700  # created here


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root (chown)")
def test_what_another_user_planted_in_a_shared_run_directory_is_refused(tmp_path):
    """In a 1777 run directory anyone may create ``plans/`` or ``journal.jsonl`` before the run
    does: the run refuses them instead of writing its plans where another user can swap them."""
    run = tmp_path / "shared"
    run.mkdir()
    os.chmod(run, 0o1777)
    other = 54321
    (run / "plans").mkdir(mode=0o777)
    os.chown(run / "plans", other, other)
    with pytest.raises(rundir.UnsafePath, match="plans is a directory of another user"):
        rundir.prepare(run)
    os.rmdir(run / "plans")
    (run / "logs").symlink_to(tmp_path)  # a link of another user to a directory of ours
    os.lchown(run / "logs", other, other)
    with pytest.raises(rundir.UnsafePath, match="logs is a symbolic link of another user"):
        rundir.prepare(run)
    (run / "logs").unlink()
    (run / "journal.jsonl").write_text("")
    os.chown(run / "journal.jsonl", other, other)
    with pytest.raises(rundir.UnsafePath, match=r"journal\.jsonl is a file of another user"):
        rundir.prepare(run)
    os.unlink(run / "journal.jsonl")
    rundir.prepare(run)  # only what the run created itself: accepted, the directory keeps 1777
    assert mode(run) == 0o1777 and mode(run / "plans") == 0o700


def test_a_run_directory_spikeguard_creates_is_private_whatever_the_umask(tmp_path):
    os.umask(0o277)  # would take the owner's write and search bits away
    try:
        run = tmp_path / "runs" / "new"
        rundir.private_dir(run)
    finally:
        os.umask(0o022)
    assert mode(run) == 0o700


def _finished_run(run: Path) -> Path:
    run.mkdir()
    (run / "journal.jsonl").write_bytes((DEMO / "journal.jsonl").read_bytes())  # completed
    job = run.parent / "job.yaml"
    job.write_text(f"name: demo\nentrypoint: train.py\nworkers: 1\nrun_dir: {run}\n")
    return job


def test_submit_takes_the_lock_before_it_reads_the_journal(tmp_path, capsys):
    """A live supervisor that has just journaled ``completed`` still holds the lock (its sinks
    are closing): a second submit must not have read the journal before that - it would then
    resume a run whose end it never saw. Lock first: it is told another supervisor holds it."""
    run = tmp_path / "run"
    job = _finished_run(run)
    live = rundir.acquire_lock(run)  # the first supervisor, not gone yet
    try:
        assert main(["submit", str(job), "--quiet"]) == 2
        out = capsys.readouterr().out
        assert "another supervisor holds" in out and "already finished" not in out
    finally:
        live.close()
    assert main(["submit", str(job), "--quiet"]) == 0  # gone: the run's own exit code
    assert "already finished: completed" in capsys.readouterr().out
    assert rundir.lock_holder(run) is None
