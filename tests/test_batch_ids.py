"""Batch forensics, rank side and pure parts: a rank answers a ``batch_ids`` request over its
real report socket, the supervisor validates the answer and files it, and a relaunched rank skips
exactly the batches on file (by their ids, wherever they come again)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import spikeguard.workers as sgw
import torch
from spikeguard.supervisor.intake import forensics, validate
from spikeguard.supervisor.observe.describe import describe
from spikeguard.workers import contract
from spikeguard.workers.batches import answer_entries, batch_key, load_skip_set


def tiny() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4))


class Agent:
    """A real Unix-socket listener standing in for the rank's agent: it records every line the
    rank sends and can write requests back on the connection."""

    def __init__(self, path: Path) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(1)
        self.conn: socket.socket | None = None
        self.lines: list[dict] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.conn, _ = self.srv.accept()
        buf = b""
        while True:
            chunk = self.conn.recv(65536)
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            self.lines += [json.loads(x) for x in lines]

    def wait(self, pred, timeout: float = 10.0) -> list[dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = [m for m in self.lines if pred(m)]
            if found:
                return found
            time.sleep(0.01)
        raise AssertionError(f"no such message among {[m['type'] for m in self.lines]}")

    def request(self, **payload) -> None:
        assert self.conn is not None
        self.conn.sendall((json.dumps(payload) + "\n").encode())

    def close(self) -> None:
        self.srv.close()


def test_a_rank_answers_a_batch_ids_request_with_its_ring_buffer(tmp_path, monkeypatch):
    agent = Agent(tmp_path / "r.sock")
    monkeypatch.setenv(contract.ENV_REPORT, f"unix://{tmp_path / 'r.sock'}")
    sg = sgw.attach(tiny(), sample_every=10**9, batch_ids_window=5)
    sg.step(step=0, loss=1.0, batch_ids=[0, 100])
    agent.wait(lambda m: m["type"] == "report")  # connected: requests can come back
    for s in range(1, 8):
        sg.step(step=s, loss=1.0, batch_ids=torch.tensor([s, 100 + s]))  # a tensor: converted
    agent.request(type="batch_ids", id=1, incident="inc-001")
    agent.request(type="checkpoint", id=1)  # ids are per request type: both are taken
    deadline = time.monotonic() + 10
    answers: list[dict] = []
    step = 8
    while not answers and time.monotonic() < deadline:  # the reader thread takes a moment
        sg.step(step=step, loss=1.0, batch_ids=[step, 100 + step])
        step += 1
        answers = [m for m in agent.lines if m["type"] == "batch_ids"]
        time.sleep(0.02)
    (answer,) = agent.wait(lambda m: m["type"] == "batch_ids")
    assert validate.problem(answer) is None
    assert answer["request"] == 1 and answer["window"] == 5 and answer["truncated"] == 0
    # the last 5 steps, oldest first, the step just finished included
    last = answer["step"]
    assert [e[0] for e in answer["entries"]] == list(range(last - 4, last + 1))
    assert all(e[1] == [e[0], 100 + e[0]] for e in answer["entries"])
    assert sg.should_checkpoint(step)  # the checkpoint request with the same id number
    agent.request(type="batch_ids", id=1)  # a request seen before is not answered twice
    for s in range(step, step + 20):
        sg.step(step=s, loss=1.0, batch_ids=[s])
        time.sleep(0.01)
    sg.close()
    agent.wait(lambda m: m["type"] == "done")
    assert len([m for m in agent.lines if m["type"] == "batch_ids"]) == 1
    agent.close()


def test_an_answer_keeps_the_newest_entries_that_fit_one_line():
    ring = [(s, list(range(s, s + 50))) for s in range(100)]
    entries, left_out = answer_entries(ring, budget=2000)
    assert entries and left_out == 100 - len(entries)
    assert [e[0] for e in entries] == list(range(100 - len(entries), 100))
    assert len(json.dumps(entries, separators=(",", ":"))) <= 2000
    # a value with no JSON form is said, not sent
    (entry,), _ = answer_entries([(3, object())])
    assert entry[0] == 3 and "unencodable" in entry[1]


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"request": "1"}, "wrong_type"),
        ({"entries": {"1": [1]}}, "wrong_type"),
        ({"entries": [[1, [1], "extra"]]}, "wrong_type"),
        ({"entries": [["1", [1]]]}, "wrong_type"),
        ({"entries": [[2**60, [1]]]}, "out_of_range"),
        ({"truncated": -1}, "wrong_type"),
        ({"window": 1.5}, "wrong_type"),
    ],
)
def test_a_malformed_answer_is_dropped_with_its_reason(change, reason):
    ok = {
        "v": 1,
        "type": "batch_ids",
        "run": "r",
        "gen": 1,
        "rank": 0,
        "step": 9,
        "t": 0.0,
        "request": 1,
        "window": 200,
        "truncated": 0,
        "entries": [[8, [1, 2]], [9, {"shard": "a", "offset": 3}]],
    }
    assert validate.problem(ok) is None
    with pytest.raises(validate.Rejected) as e:
        validate.parse(json.dumps({**ok, **change}))
    assert e.value.reason == reason


@pytest.mark.parametrize("field", ["tokens", "total_steps"])
def test_step_counts_are_counts(field):
    hb = {"v": 1, "type": "heartbeat", "run": "r", "gen": 1, "rank": 0, "step": 1, "t": 0.0}
    assert validate.problem({**hb, field: 512}) is None
    for bad in (-1, 1.5, "512", True):
        assert validate.problem({**hb, field: bad}) == "wrong_type"


def filed(tmp_path: Path) -> Path:
    """An incident's batch-ids file as the controller writes it (two ranks, steps 6..10)."""
    answers = forensics.Answers(incident="inc-001", attempt=1, generation=1, asked=[0, 1])
    for rank in (0, 1):
        entries = [[s, [s, rank]] for s in range(6, 11)]
        answers.add({"rank": rank, "step": 10, "window": 200, "truncated": 0, "entries": entries})
    answers.add({"rank": 1, "step": 11, "entries": [[11, "late"]]})  # a second answer: ignored
    doc = answers.document(incident_step=10, waited_s=0.25)
    path = forensics.batch_ids_path(tmp_path, "inc-001", 1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    return path


def test_the_forensics_file_its_summary_and_its_journal_line(tmp_path):
    path = filed(tmp_path)
    doc = forensics.read_batch_ids(path)
    assert doc["answered"] == [0, 1] and doc["ranks"]["1"]["entries"][-1] == [10, [10, 1]]
    assert forensics.summary(doc) == {"batches": 10, "steps": [6, 10], "truncated": 0}
    ev = forensics.event(doc, path)
    assert ev["kind"] == "forensics" and ev["batches"] == 10
    assert describe(ev) == (
        f"Batch forensics: 10 batch ids of steps 6–10 from ranks 0–1 (2 of 2) → {path}"
    )
    nobody = forensics.Answers(incident="inc-002", attempt=2, generation=3, asked=[0, 1])
    ev = forensics.event(nobody.document(incident_step=5, waited_s=2.0), None)
    assert ev["path"] is None and ev["batches"] == 0
    assert describe(ev) == "Batch forensics: no rank answered within 2 s (of 2 asked)"
    with pytest.raises(ValueError, match="not an incident"):
        forensics.batch_ids_path(tmp_path, "../../etc", 1)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a batch-ids file"):
        forensics.read_batch_ids(tmp_path / "bad.json")


def test_a_relaunched_rank_skips_exactly_the_batches_on_file(tmp_path, monkeypatch, capsys):
    path = filed(tmp_path)
    assert load_skip_set(str(path), (8, 10)) == {
        batch_key([s, r]) for s in (8, 9, 10) for r in (0, 1)
    }
    plan = contract.ResumePlan(
        checkpoint_step=3, skip_batches=str(path), skip_batches_steps=(8, 10), generation=2
    )
    assert contract.ResumePlan.from_json(plan.to_json()) == plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    monkeypatch.setenv(contract.ENV_RESUME, str(tmp_path / "plan.json"))
    out = tmp_path / "r.jsonl"
    sg = sgw.attach(tiny(), report=f"jsonl://{out}")
    # the data order changed after the rollback: step s now trains on the batch of step s - 3
    shifted = [s for s in range(4, 20) if sg.should_skip(s, batch_ids=[s - 3, 0])]
    assert shifted == [11, 12, 13]  # the batches of steps 8..10, wherever they come now
    # a script that passes no batch ids skips the window's steps instead
    assert [s for s in range(4, 20) if sg.should_skip(s)] == [8, 9, 10]
    sg.close()
    skipped = [json.loads(x) for x in out.read_text().splitlines() if '"skipped"' in x]
    assert [(m["step"], m["by"]) for m in skipped] == [
        (11, "batch_ids"),
        (12, "batch_ids"),
        (13, "batch_ids"),
        (8, "steps"),
        (9, "steps"),
        (10, "steps"),
    ]
    # the file is gone (a run directory moved, a shared FS not mounted): the window's steps
    path.unlink()
    sg = sgw.attach(tiny(), report="off")
    assert [s for s in range(4, 20) if sg.should_skip(s, batch_ids=[s - 3, 0])] == [8, 9, 10]
    assert "cannot read batch ids" in capsys.readouterr().out
    sg.close()
