"""Every command that prints behaves in a pipe: ``spikeguard events RUN | head`` ends quietly
(exit 0, or 141 when the reader was gone before the output was all written), never a
``BrokenPipeError`` traceback. Real processes, real pipes: each command writes to a pipe whose
reader is closed before it starts (so its first write meets the closed pipe, deterministically),
and to a real ``head -1``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tests" / "data" / "demo_run"

COMMANDS = [
    ["events", "{run}"],
    ["events", "--json", "{run}"],
    ["status", "{run}"],
    ["status", "--json", "{run}"],
    ["checkpoints", "--no-verify", "{run}"],
    ["report", "{run}"],
    ["policy", "check", "default"],
    ["policy", "explain", "default"],
    ["policy", "schema"],
    ["policy", "replay", "default", "{run}"],
    ["--help"],
    ["--version"],
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recorded demo run, its journal long enough (more than a pipe holds) that ``head -1``
    is gone while the command still writes."""
    run = tmp_path_factory.mktemp("pipes") / "run"
    shutil.copytree(DEMO, run)
    events = [json.loads(line) for line in (DEMO / "journal.jsonl").read_text().splitlines()]
    story = [e for e in events if "obs" not in e]  # extra lines that change no state
    with open(run / "journal.jsonl", "a") as f:
        for i in range(400):
            for e in story:
                f.write(json.dumps({**e, "seq": 10_000 + i * len(story) + e["seq"]}) + "\n")
    assert (run / "journal.jsonl").stat().st_size > 1 << 20
    return run


def _argv(cmd: list[str], run: Path) -> list[str]:
    return [sys.executable, "-m", "spikeguard.supervisor.cli"] + [a.format(run=run) for a in cmd]


def _clean(stderr: str) -> None:
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr[-3000:]
    assert "Exception ignored" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_a_command_writing_to_a_closed_pipe_ends_quietly(cmd, run, tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes anything
    try:
        res = subprocess.run(
            _argv(cmd, run),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=240,
        )
    finally:
        os.close(write_end)
    _clean(res.stderr)
    assert res.returncode in (0, 141), (res.returncode, res.stderr[-3000:])


@pytest.mark.parametrize("cmd", [["events", "{run}"], ["events", "--json", "{run}"]], ids=" ".join)
def test_events_into_head_prints_its_first_line_and_no_traceback(cmd, run):
    producer = subprocess.Popen(
        _argv(cmd, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=run
    )
    head = subprocess.run(["head", "-1"], stdin=producer.stdout, capture_output=True, timeout=240)
    assert producer.stdout is not None and producer.stderr is not None
    producer.stdout.close()
    stderr = producer.stderr.read().decode()
    producer.stderr.close()
    code = producer.wait(timeout=240)
    _clean(stderr)
    assert code in (0, 141), (code, stderr[-3000:])
    first = head.stdout.decode().splitlines()
    assert len(first) == 1 and ("launch" in first[0] or "Launched" in first[0]), first
