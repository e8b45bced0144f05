"""A full disk, for real: the run directory on a small tmpfs that fills up.

``status.json`` and ``reports.jsonl`` are best effort: a healthy run goes on while they cannot be
written and completes once there is room again, nothing lost. A journal append or a ``FENCE``
that cannot be written stops the supervisor cleanly (exit 143, the ranks killed, the reason
journaled, or printed when the journal is what cannot be written), never a traceback; the run
is left resumable. A journal append that fails leaves nothing in the file and takes no ``seq``.

The tmpfs needs a mount namespace: each tmpfs test runs itself again inside ``unshare -rm`` (a
user and mount namespace of its own: no root on the machine needed, nothing mounted outside it)
with a 1 MiB tmpfs mounted there, and skips with the reason when the machine allows no such
namespace. ``RLIMIT_FSIZE`` (EFBIG, the same short write then failure as ENOSPC) needs nothing
and always runs. The controller runs on a scripted group (no Ray: what is under test is the
supervisor's writes)."""

from __future__ import annotations

import errno
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, SpyEngine
from spikeguard.supervisor import rundir
from spikeguard.supervisor.controller import STATUS_EVERY_S
from spikeguard.supervisor.journal import Journal, read_journal
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll
from spikeguard.supervisor.runner import finished_outcome
from spikeguard.workers.contract.exitcodes import ExitCode

DISK_ENV = "SPIKEGUARD_TEST_SMALL_DISK"
"""Set inside the namespace: the tmpfs the test body uses."""
DISK_SIZE = "1m"


@functools.cache
def _no_tmpfs_because(probe_dir: str) -> str | None:
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', probe_dir],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        return f"no tmpfs in a user+mount namespace here (unshare -rm): {res.stderr.strip()}"
    return None


def on_small_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Path | None:
    """Inside the namespace: the tmpfs. Outside: runs the calling test in one (its assertions
    there, their failure here) and gives None: the test body then has nothing left to do."""
    inside = os.environ.get(DISK_ENV)
    if inside:
        return Path(inside)
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        reason = _no_tmpfs_because(str(probe))
    except FileNotFoundError:
        reason = "no unshare(1) on this machine"
    if reason:
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f'mount -t tmpfs -o size={DISK_SIZE} tmpfs "$0" && exec "$@"'
    test = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, str(disk), *test, request.node.nodeid],
        cwd=ROOT,
        env={**os.environ, DISK_ENV: str(disk)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout, res.stdout[-3000:]
    return None


def fill(disk: Path) -> Path:
    """Take every free block of the tmpfs (unbuffered writes until ENOSPC); the filler file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler


def assert_whole(run: Path) -> list[dict[str, Any]]:
    """Every line of the journal is a whole event, their seqs 1, 2, 3, ... with no gap."""
    data = (run / "journal.jsonl").read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    read = read_journal(run)
    assert read.problems == [], read.problems
    assert [e["seq"] for e in read.events] == list(range(1, len(read.events) + 1))
    return read.events


def test_a_journal_append_on_a_full_disk_leaves_nothing_and_takes_no_seq(request, tmp_path):
    small_disk = on_small_disk(request, tmp_path)
    if small_disk is None:
        return  # it ran on the tmpfs, in a namespace of its own
    run = small_disk / "run"
    j = Journal(run, run="r", secrets=())
    j.append("launch", generation=1)
    filler = fill(small_disk)
    with pytest.raises(rundir.Unwritable, match=r"journal\.jsonl \(No space left on device"):
        for i in range(10_000):  # the journal's last page fills, then an append fails
            j.append("alert", reason=f"note {i} " + "x" * 300)
    n = len(assert_whole(run))
    filler.unlink()
    assert j.append("alert", reason="room again")["seq"] == n + 1
    assert assert_whole(run)[-1]["reason"] == "room again"


RLIMIT_SCRIPT = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from spikeguard.supervisor import rundir
    from spikeguard.supervisor.intake.tick import ReportLog
    from spikeguard.supervisor.journal import Journal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not a kill
    run = Path(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out = {}
    j = Journal(run, run="r", secrets=())
    j.append("launch", generation=1)
    resource.setrlimit(resource.RLIMIT_FSIZE, ((run / "journal.jsonl").stat().st_size + 1000, hard))
    try:
        for i in range(100):
            j.append("alert", reason=f"note {i} " + "x" * 300)
    except rundir.Unwritable as e:
        out["journal_error"] = str(e)
    out["journal_whole"] = (run / "journal.jsonl").read_bytes().endswith(b"\\n")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    out["seq_after"] = j.append("alert", reason="room again")["seq"]

    log = ReportLog(run / "reports.jsonl")
    log.write({"type": "heartbeat", "step": 0})
    log.flush()
    resource.setrlimit(resource.RLIMIT_FSIZE, ((run / "reports.jsonl").stat().st_size + 500, hard))
    for step in range(1, 40):
        log.write({"type": "heartbeat", "step": step, "pad": "x" * 100})
    log.flush()  # fails: kept in memory
    out["reports_whole"] = (run / "reports.jsonl").read_bytes().endswith(b"\\n")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    log.flush()
    log.close()
    print(json.dumps(out))
    """
)


def test_a_failed_append_under_a_file_size_limit_leaves_no_fragment(tmp_path):
    """The same short write then failure as a full disk, from ``RLIMIT_FSIZE`` (EFBIG): runs
    anywhere, no namespace needed."""
    res = subprocess.run(
        [sys.executable, "-c", RLIMIT_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert "File too large" in out["journal_error"] and out["journal_whole"]
    events = assert_whole(tmp_path)
    assert out["seq_after"] == len(events) and events[-1]["reason"] == "room again"
    assert out["reports_whole"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "reports.jsonl").open()]
    assert steps == list(range(40))  # kept while the file could not take them, then written


POLICY = """
version: 1
name: spike
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 100, action: recover}
"""


def _line(gen: int, rank: int, step: int, loss: float) -> bytes:
    msg = {"v": 1, "type": "heartbeat", "run": "t", "gen": gen, "rank": rank, "step": step}
    return json.dumps({**msg, "t": 0.0, "loss": loss}).encode()


class Ranks:
    """Two scripted ranks: each tick a heartbeat of the next step. ``at``: tick -> what the
    test does to the disk before that tick's messages arrive; ``spike_at``: the tick rank 0's
    loss is 1000 (the rule recovers); ``end_at``: the tick both ranks exit 0."""

    def __init__(self, *, at: dict[int, Any], spike_at: int = 0, end_at: int = 0) -> None:
        self.at, self.spike_at, self.end_at = at, spike_at, end_at
        self.gen = 0
        self.tick = 0
        self.killed = False
        self.steps: list[tuple[int, int]] = []

    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.gen = generation
        return [
            LaunchedRank(rank=r, pid=1000 + r, generation=generation, report="-", port=1)
            for r in range(2)
        ]

    def poll(self) -> list[RankPoll]:
        if self.killed:
            return []
        self.tick += 1
        if self.tick in self.at:
            self.at[self.tick]()
        out = []
        for r in range(2):
            loss = 1000.0 if (self.tick == self.spike_at and r == 0) else 2.0
            done = self.end_at and self.tick >= self.end_at
            lines = () if done else (_line(self.gen, r, self.tick, loss),)
            if not done:
                self.steps.append((r, self.tick))
            out.append(
                RankPoll(rank=r, generation=self.gen, lines=lines, exit_code=0 if done else None)
            )
        return out

    def kill(self, grace_s: float = 0.0) -> KillReport:
        self.killed = True
        return KillReport(duration_s=0.0)

    def request(self, payload: dict[str, Any]) -> int:
        return 0


def _controller(run: Path, group: Ranks) -> Any:
    from spikeguard.supervisor.controller import Controller

    return Controller(
        run_dir=str(run),
        run_id="t",
        group=group,
        engine=SpyEngine(POLICY),
        cmd=["true"],
        env={},
        world_size=2,
        hang_timeout_s=600.0,
        first_heartbeat_timeout_s=600.0,
        reap_interval_s=1e9,
        remote_reap=False,
        poll_interval_s=0.01,
        batch_ids_wait_s=0.0,
    )


def test_a_healthy_run_goes_on_while_status_and_reports_cannot_be_written(
    request, tmp_path, capsys
):
    small_disk = on_small_disk(request, tmp_path)
    if small_disk is None:
        return  # it ran on the tmpfs, in a namespace of its own
    run = small_disk / "run"
    full: list[tuple[Path, float]] = []

    def fill_the_disk() -> None:
        full.append((fill(small_disk), time.monotonic()))

    def free_it_once_status_was_due() -> None:
        filler, since = full[-1]
        if time.monotonic() - since > 2 * STATUS_EVERY_S:  # a rewrite of status.json failed
            filler.unlink()
            ranks.end_at = ranks.tick + 3
        else:
            ranks.at[ranks.tick + 1] = free_it_once_status_was_due

    ranks = Ranks(at={3: fill_the_disk, 4: free_it_once_status_was_due}, end_at=10**9)
    ctl = _controller(run, ranks)
    try:
        assert ctl.run() == ExitCode.COMPLETED
    finally:
        ctl.close()
    out = capsys.readouterr().out
    assert "status.json (" in out and "No space left on device" in out and "written again" in out
    assert [e["kind"] for e in assert_whole(run)] == ["launch", "completed"]
    reports = [json.loads(line) for line in (run / "reports.jsonl").open()]
    beats = [(m["rank"], m["step"]) for m in reports if m.get("type") == "heartbeat"]
    assert sorted(beats) == sorted(ranks.steps)  # every one, none lost while the disk was full
    assert json.loads((run / "status.json").read_text())["phase"] == "COMPLETED"


def _pad_journal(ctl: Any, *, room: int) -> None:
    """Journal notes until the journal's last page has at least ``room`` bytes free (on a full
    tmpfs, what still fits in it without a new block)."""
    path = ctl.journal.path
    while (-path.stat().st_size) % 4096 < room:
        ctl.journal.append("alert", reason="a note " + "n" * 150)


def test_a_fence_that_cannot_be_written_stops_cleanly_with_the_reason_journaled(request, tmp_path):
    small_disk = on_small_disk(request, tmp_path)
    if small_disk is None:
        return  # it ran on the tmpfs, in a namespace of its own
    run = small_disk / "run"
    ctl: Any = None

    def full_disk_but_a_page_of_journal() -> None:
        _pad_journal(ctl, room=3000)  # the incident and the stop's reason fit, FENCE does not
        fill(small_disk)

    ranks = Ranks(at={4: full_disk_but_a_page_of_journal}, spike_at=4)
    ctl = _controller(run, ranks)
    try:
        assert ctl.run() == ExitCode.PREEMPTED  # gone, resumable: not a failed run
    finally:
        ctl.close()
    assert ranks.killed
    assert (run / "FENCE").read_text() == "1"  # as it was; no temp file left beside it
    assert not [p.name for p in run.iterdir() if p.name.startswith(".FENCE")]
    events = assert_whole(run)
    assert [e["kind"] for e in events[-2:]] == ["incident", "alert"]
    reason = events[-1]["reason"]
    assert "the supervisor stops" in reason and "FENCE" in reason and "No space left" in reason
    assert "resumes it" in reason and events[-1]["severity"] == "page"
    assert finished_outcome(events) is None  # not finished: `spikeguard submit` resumes it


def test_a_journal_that_cannot_be_written_stops_cleanly_and_says_why(request, tmp_path, capsys):
    small_disk = on_small_disk(request, tmp_path)
    if small_disk is None:
        return  # it ran on the tmpfs, in a namespace of its own
    run = small_disk / "run"
    ctl: Any = None

    def full_disk_and_journal() -> None:
        fill(small_disk)
        with pytest.raises(rundir.Unwritable):
            for _ in range(1000):  # the journal's last page fills too
                ctl.journal.append("alert", reason="a note " + "n" * 150)

    ranks = Ranks(at={4: full_disk_and_journal}, spike_at=4)
    ctl = _controller(run, ranks)
    try:
        assert ctl.run() == ExitCode.PREEMPTED
    finally:
        ctl.close()
    assert ranks.killed
    out = capsys.readouterr().out
    assert "the supervisor stops: cannot append to" in out and "No space left on device" in out
    assert "the reason could not be journaled either" in out
    events = assert_whole(run)  # nothing of the incident nor of the reason: no fragment
    assert events[-1]["kind"] == "alert" and events[-1]["reason"].startswith("a note")
    assert (run / "FENCE").read_text() == "1"
    assert finished_outcome(events) is None
