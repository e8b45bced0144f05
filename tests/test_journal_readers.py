"""Journal readers take odd but parseable lines: a supervisor continues a journal whose last line
has no ``seq`` (or a string one, or a string ``mono``), ``status`` never tracebacks (a mid-file
line with an unknown observation type is named, and the state shown is the one before it), and
every reader says what is wrong with which line. Real files, the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from spikeguard.supervisor import rundir
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.journal import Journal, read_events, read_journal

DEMO = Path(__file__).parent / "data" / "demo_run"


def demo_events() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DEMO / "journal.jsonl").read_text().splitlines()]


def write_journal(run: Path, events: list[Any], tail: bytes = b"") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / "journal.jsonl"
    path.write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in events) + tail)
    return path


@pytest.fixture
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for journals no machine can replay (outside ``tmp_path``, whose journals
    conftest replays after each test)."""
    return tmp_path_factory.mktemp("odd-journal")


@pytest.mark.parametrize(
    ("last", "problem", "seq"),
    [
        ({"kind": "alert", "reason": "hand-written"}, "line 6: no seq", 6),
        ({"kind": "alert", "seq": "6", "reason": "x"}, "line 6: seq is '6', not an integer", 6),
        ({"kind": "alert", "seq": 6, "mono": "late", "reason": "x"}, "mono is 'late', not a", 7),
    ],
    ids=["no seq", "string seq", "string mono"],
)
def test_a_supervisor_continues_a_journal_whose_last_line_is_odd(
    tmp_path, capsys, last, problem, seq
):
    first = demo_events()[:5]
    write_journal(tmp_path, [*first, last])
    j = Journal(tmp_path, run="demo", secrets=())
    ev = j.append("alert", reason="after")
    j.close()
    assert ev["seq"] == seq  # after the highest integer seq
    assert isinstance(ev["mono"], float) and ev["mono"] >= first[-1]["mono"]
    assert problem in capsys.readouterr().out  # the supervisor's log names the line
    assert read_events(tmp_path)[-1]["reason"] == "after"


def _with_unknown_observation(run: Path, at: int = 3) -> list[dict[str, Any]]:
    evs = demo_events()
    evs[at - 1] = {**evs[at - 1], "obs": [{"type": "Teleported", "to": "mars"}]}
    write_journal(run, evs)
    return evs


def test_status_names_a_line_it_cannot_replay_and_never_tracebacks(scratch, capsys):
    _with_unknown_observation(scratch, at=3)
    assert main(["status", str(scratch)]) == 0
    out, err = capsys.readouterr()
    assert "line 3 (seq 3) cannot be replayed" in err and "'Teleported'" in err
    assert "the state shown is the one before it" in err
    assert out.splitlines()[0].startswith("KILLING")  # lines 1-2: launched, incident opened
    assert main(["status", "--json", str(scratch)]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["phase"] == "KILLING" and "line 3" in st["replay_problem"]
    assert st["events"] == 29 and st["finished"] is None


def test_submit_refuses_a_journal_it_cannot_replay(scratch, capsys):
    run = scratch / "run"
    _with_unknown_observation(run, at=10)
    job = scratch / "job.yaml"
    job.write_text(f"name: demo\nentrypoint: train.py\nworkers: 1\nrun_dir: {run}\n")
    assert main(["submit", str(job), "--quiet"]) == 2
    out = capsys.readouterr().out
    assert "line 10 (seq 10) cannot be replayed" in out and "cannot be continued" in out
    assert rundir.lock_holder(run) is None  # the lock it took was given back


ODD = [
    {"kind": "launch", "generation": 1},  # no seq, no time
    {"kind": "alert", "seq": "7", "time": None, "reason": "seq as a string"},
    {"kind": 7, "seq": 3.5, "time": 12},
    ["not", "an", "event"],
    {"seq": 4, "reason": "no kind"},
    {"kind": "party", "seq": 5},
    {"kind": "stopped", "seq": 6, "time": "2026-01-01T00:00:00Z", "reason": "by user", "obs": 3},
]


def _odd_journal(run: Path) -> None:
    path = write_journal(run, ODD[:3], tail=b"{not json\n")
    with open(path, "ab") as f:
        f.write(b"".join(json.dumps(e).encode() + b"\n" for e in ODD[3:]))
        f.write(b'{"seq": 8, "kind": "ale')  # torn: the supervisor died mid-write


EXPECTED = [
    "line 1: no seq",
    "line 2: seq is '7', not an integer",
    "line 2: time is None, not a string",
    "line 3: kind is 7, not a string",
    "line 3: seq is 3.5, not an integer",
    "line 3: time is 12, not a string",
    "line 4: not JSON: skipped",
    "line 5: a JSON list, not an event: skipped",
    "line 6: no kind: not an event, skipped",
    "line 7: unknown kind 'party'",
    "line 8: obs is int, not a list",
    "line 9: cut short (a write that did not finish): ignored",
]


def test_the_reader_says_what_is_wrong_with_which_line(scratch):
    _odd_journal(scratch)
    read = read_journal(scratch)
    assert [str(p) for p in read.problems] == EXPECTED
    assert read.lines == [1, 2, 3, 7, 8] and len(read.events) == 5


@pytest.mark.parametrize(
    "args",
    [["events"], ["events", "--json"], ["status"], ["status", "--json"], ["stop"]]
    + [["checkpoints", "--no-verify"]],
    ids=" ".join,
)
def test_every_command_reading_the_journal_says_which_lines_are_odd(scratch, capsys, args):
    _odd_journal(scratch)
    code = main([*args, str(scratch)])
    out, err = capsys.readouterr()
    assert code in (0, 2), (code, out, err)  # stop: there is no live supervisor to ask
    for problem in EXPECTED:
        assert f"journal.jsonl {problem}" in err, (problem, err)
    if args[0] == "events":
        assert len(out.splitlines()) == 5  # shown as they are, odd or not


@pytest.mark.parametrize(
    "live",
    [
        [1, 2],
        {"ranks": {"x": {"step": 1}}},
        {"ranks": {"0": "fast"}},
        {"ranks": [1], "updated": "x"},
    ],
    ids=["a list", "a rank that is not a number", "a rank view that is a string", "odd types"],
)
def test_status_never_tracebacks_on_an_odd_status_json(tmp_path, capsys, live):
    write_journal(tmp_path, demo_events())
    (tmp_path / "status.json").write_text(json.dumps(live))
    assert main(["status", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("COMPLETED")
    assert main(["status", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["phase"] == "COMPLETED"
