"""``spikeguard checkpoints RUN_DIR``: the table of a run's checkpoints (supervisor/cli.py and the
pure formatter supervisor/observe/checkpoint_table.py), on real checkpoint files, without torch
in the command's process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spikeguard.supervisor.observe.checkpoint_table import Row, render, rows
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint.format import CheckpointInfo, Incomplete


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spikeguard.supervisor.cli", "checkpoints", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory: two replicated checkpoints (one altered), one sharded, one unfinished
    sharded save, and a journal with a launch from the first and a deletion."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ck = tmp_path / "checkpoints"
    ck.mkdir()
    first = ckpt.write_checkpoint(
        ck, {"w": torch.ones(3)}, step=50, generation=1, meta={"grade": 6, "loss": 2.5}
    )
    second = ckpt.write_checkpoint(
        ck, {"w": torch.ones(3)}, step=100, generation=1, meta={"grade": 3}
    )
    with open(second.path, "r+b") as f:  # same size, other bytes: only a hash tells
        f.seek(second.size - 30)
        f.write(b"\x00" * 8)
    model = torch.nn.Linear(2, 2)
    msd, _ = get_state_dict(model, [])
    ckpt.ShardedWriter().save(
        ck, {"model": msd}, step=150, generation=2, rank_meta={"grade": 5, "loss": 1.25}, meta={}
    )
    unfinished = ck / ckpt.sharded_name(200, 2)
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"z" * 10)
    plan = {"checkpoint": first.path, "checkpoint_step": 50}
    journal = [
        {"seq": 1, "kind": "launch", "generation": 1, "plan": {"checkpoint": None}},
        {"seq": 2, "kind": "launch", "generation": 2, "plan": plan},
        {
            "seq": 3,
            "kind": "checkpoint_deleted",
            "path": str(ck / ckpt.checkpoint_name(25, 1)),
            "step": 25,
            "generation": 1,
            "checkpoint_kind": "replicated",
            "bytes": 2048,
            "grade": 6,
            "reason": "beyond keep_last 3 and keep_healthy 2 (S>=4)",
        },
    ]
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in journal))
    return tmp_path


def test_the_table_shows_every_checkpoint_and_why_it_is_there(run: Path) -> None:
    res = _cli(str(run))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split() == [
        "step", "gen", "kind", "ranks", "grade", "loss", "size", "status", "retention"
    ]  # fmt: skip
    by_step = {line.split()[0]: line for line in lines[1:-1]}
    assert list(by_step) == ["25", "50", "100", "150", "200"]
    assert "deleted: beyond keep_last 3" in by_step["25"] and "2.0 KiB" in by_step["25"]
    assert "verified" in by_step["50"] and "2.5000" in by_step["50"]
    assert "kept: rollback target (generation 2 resumed from it)" in by_step["50"]
    assert "corrupt (" in by_step["100"] and "sha256 mismatch" in by_step["100"]
    assert "sharded" in by_step["150"] and " 1 " in by_step["150"] and "S5" in by_step["150"]
    assert "incomplete" in by_step["200"]
    assert (
        lines[-1].startswith("4 on disk (")
        and "1 deleted by retention (2.0 KiB freed)" in lines[-1]
    )


def test_json_and_no_verify(run: Path) -> None:
    res = _cli(str(run), "--json", "--no-verify")
    assert res.returncode == 0, res.stderr
    table = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["step"], r["status"]) for r in table] == [
        (25, "deleted"),
        (50, "listed"),
        (100, "listed"),  # not hashed: the alteration is not seen
        (150, "listed"),
        (200, "incomplete"),
    ]
    assert table[3]["kind"] == "sharded" and table[3]["ranks"] == 1 and table[3]["grade"] == 5


def test_the_command_needs_neither_torch_nor_a_journal(run: Path) -> None:
    from test_architecture import run_blocked

    (run / "journal.jsonl").unlink()
    code = f"""
        import sys
        from spikeguard.supervisor.cli import main
        assert main(["checkpoints", {str(run)!r}]) == 0
        assert "torch" not in sys.modules
    """
    res = run_blocked({"torch"}, code)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "kept: rollback target" not in res.stdout and "corrupt" in res.stdout


def test_no_run_is_bad_input(tmp_path: Path) -> None:
    res = _cli(str(tmp_path / "nothing"))
    assert res.returncode == 2 and "no run in" in res.stderr


def test_rows_from_a_listing_alone() -> None:
    info = CheckpointInfo(
        path="/ck/ckpt-step00000010-gen001.dcp",
        meta_path="",
        step=10,
        generation=1,
        rank=0,
        sha256="0" * 64,
        size=3 * 2**20,
        meta={"grade": 7, "loss": float("nan")},
        kind="sharded",
        world_size=4,
    )
    odd = ("/ck/ckpt-step00000005-gen001-rank0.pt.json", "sidecar: malformed JSON")
    table = rows([info], [odd], [Incomplete("/x", 1, 1, "sharded")], None, [])
    assert table[0] == Row(5, 1, "replicated", None, None, None, None, "corrupt", "kept", *odd)
    listed = table[1]
    assert (listed.step, listed.kind, listed.ranks, listed.grade, listed.status) == (
        10,
        "sharded",
        4,
        7,
        "listed",
    )
    assert listed.loss != listed.loss  # NaN, as recorded
    assert len(table) == 2  # an incomplete save not among the problems is not invented
    text = render(table)
    assert "3.0 MiB" in text and "nan" in text and "S7" in text
