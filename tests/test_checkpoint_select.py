"""Tests for spikeguard.workers.checkpoint.choose: the lineage filter, and the supervisor's path
(list, verify, select) in a process where torch cannot be imported."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import CheckpointInfo, on_lineage, select_checkpoint


def _info(step: int, generation: int, grade: int = 6) -> CheckpointInfo:
    return CheckpointInfo(
        path=f"/ck/{ckpt.checkpoint_name(step, generation)}",
        meta_path="",
        step=step,
        generation=generation,
        rank=0,
        sha256="0" * 64,
        size=1,
        meta={"grade": grade},
    )


def _reference_on_lineage(
    lineage: list[tuple[int, int | None]], generation: int, step: int
) -> bool:
    """The controller's rule, as it was specified."""
    limit = float("inf")
    for g, branched_at in reversed(lineage):
        if generation == g:
            return step <= limit
        if branched_at is not None:
            limit = min(limit, branched_at)
    return False


# Generation 1 ran from scratch; 2 resumed from step 30 of generation 1; 3 from step 20 of 2;
# 4 was a launch retry without a checkpoint.
_LINEAGE = [(1, None), (2, 30), (3, 20), (4, None)]


@pytest.mark.parametrize(
    ("generation", "step", "expected"),
    [
        (4, 10**9, True),  # the current generation's own checkpoints, at any step
        (3, 500, True),  # 4 set no bound: 3's checkpoints all count
        (2, 20, True),  # 3 branched from step 20 of 2
        (2, 21, False),  # what 2 wrote after that was abandoned
        (1, 20, True),  # the earliest branch point below 1 is 20, not 30
        (1, 25, False),
        (1, 0, True),
        (5, 0, False),  # not launched (yet): not on the lineage
        (0, 0, False),
    ],
)
def test_on_lineage(generation: int, step: int, expected: bool) -> None:
    assert on_lineage(_LINEAGE, generation, step) is expected
    assert _reference_on_lineage(_LINEAGE, generation, step) is expected


def test_on_lineage_matches_the_reference_exhaustively() -> None:
    lineages = [
        [],
        [(1, None)],
        [(1, None), (2, 30)],
        [(1, None), (2, 30), (3, 40)],  # 3 resumed from 2's step 40: 1 is still bound by 30
        [(1, None), (2, 30), (2, 10)],  # a generation relaunched from an earlier step
        [(1, None), (2, None), (3, 15)],
        [(5, 0), (7, 3)],
    ]
    for lineage in lineages:
        for generation in range(9):
            for step in range(0, 50, 5):
                expected = _reference_on_lineage(lineage, generation, step)
                assert on_lineage(lineage, generation, step) is expected, (lineage, generation)
    assert not on_lineage([], 1, 0)


def _no_verify(info: CheckpointInfo) -> None:
    pass


def test_select_with_lineage_skips_abandoned_branches() -> None:
    infos = [_info(10, 1), _info(25, 1), _info(40, 1), _info(18, 2), _info(22, 2), _info(15, 3)]

    chosen, skipped = select_checkpoint(
        infos, min_grade=5, before_step=None, lineage=_LINEAGE, verify_fn=_no_verify
    )
    assert chosen is not None and (chosen.generation, chosen.step) == (2, 18)
    assert [(s.generation, s.step, why) for s, why in skipped] == [
        (1, 40, "generation 1 step 40 is off the current lineage"),
        (1, 25, "generation 1 step 25 is off the current lineage"),
        (2, 22, "generation 2 step 22 is off the current lineage"),
    ]
    # Without a lineage, the newest step wins whatever branch wrote it.
    chosen, skipped = select_checkpoint(infos, min_grade=5, before_step=None, verify_fn=_no_verify)
    assert chosen is not None and (chosen.generation, chosen.step, skipped) == (1, 40, [])
    # The lineage composes with the other rules: 2's step 18 is above this bound.
    chosen, skipped = select_checkpoint(
        infos, min_grade=5, before_step=17, lineage=_LINEAGE, verify_fn=_no_verify
    )
    assert chosen is not None and (chosen.generation, chosen.step) == (3, 15)
    assert [why for _, why in skipped][-1] == "step 18 > 17 = before_step - min_steps_back 0"
    assert len(skipped) == 4
    # An empty lineage admits nothing.
    assert select_checkpoint(infos, min_grade=0, before_step=None, lineage=[]) == (
        None,
        [
            (i, f"generation {i.generation} step {i.step} is off the current lineage")
            for i in sorted(infos, key=lambda i: i.step, reverse=True)
        ],
    )


def test_select_with_lineage_matches_filtering_first() -> None:
    """Filtering by lineage first, as the controller does today, chooses the same."""
    grades = {1: 6, 2: 3, 3: 7}
    infos = [_info(s, g, grades[g]) for s in (5, 15, 25, 35) for g in grades]
    lineage = [(1, None), (2, 25), (3, 15)]
    on_path = [i for i in infos if on_lineage(lineage, i.generation, i.step)]
    assert 0 < len(on_path) < len(infos)
    for min_grade in range(9):
        for before_step in (None, 10, 20, 30, 40):
            rules: dict[str, Any] = {"min_grade": min_grade, "before_step": before_step}
            with_lineage = select_checkpoint(infos, lineage=lineage, verify_fn=_no_verify, **rules)
            filtered = select_checkpoint(on_path, verify_fn=_no_verify, **rules)
            assert with_lineage[0] == filtered[0]


# -- the supervisor's path, without torch -------------------------------------------------------

_NO_TORCH = textwrap.dedent("""
    import importlib.abc, json, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this process")
            return None

    sys.meta_path.insert(0, NoTorch())

    import spikeguard.workers.checkpoint
    import spikeguard.workers.checkpoint.choose
    from spikeguard.workers import checkpoint as ckpt
    from spikeguard.workers.checkpoint import choose

    listed = choose.list_checkpoints(sys.argv[1])
    verified = {}
    for info in listed:
        try:
            ckpt.verify(info)
            verified[info.step] = "ok"
        except ckpt.CheckpointError as e:
            verified[info.step] = type(e).__name__ + ": " + str(e)
    chosen, skipped = ckpt.select_checkpoint(listed, min_grade=5, before_step=None)
    lineage = [(1, None), (2, 15)]
    on_lineage, _ = choose.select_checkpoint(listed, min_grade=5, before_step=None, lineage=lineage)
    try:
        ckpt.write_checkpoint
        write = "imported"
    except ImportError as e:
        write = str(e)
    print(json.dumps({
        "torch_loaded": any(m == "torch" or m.startswith("torch.") for m in sys.modules),
        "listed": [i.step for i in listed],
        "problems": [why for _, why in listed.problems],
        "verified": verified,
        "chosen": chosen.step,
        "skipped": [[s.step, why] for s, why in skipped],
        "on_lineage": on_lineage.step,
        "write": write,
    }))
""")


def _malicious_zip() -> bytes:
    """A real torch.save zip whose pickle calls os.system (never run here)."""
    saved = io.BytesIO()
    torch.save({"w": torch.ones(2)}, saved)
    payload = b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R."
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(saved.getvalue())) as src,
        zipfile.ZipFile(out, "w") as dst,
    ):
        for entry in src.infolist():
            data = src.read(entry)
            if entry.filename.endswith("/data.pkl"):
                data = payload
            dst.writestr(entry.filename, data)
    return out.getvalue()


def test_list_verify_select_without_torch(tmp_path: Path) -> None:
    def write(step: int, grade: int, generation: int = 1) -> CheckpointInfo:
        state = {"w": torch.full((8,), float(step)), "s": {step}, "b": b"x"}
        meta = {"grade": grade}
        return ckpt.write_checkpoint(tmp_path, state, step=step, generation=generation, meta=meta)

    write(10, 6)
    write(20, 6)
    write(30, 2)  # graded too low
    malicious = write(40, 7)
    data = _malicious_zip()
    Path(malicious.path).write_bytes(data)  # a forged sidecar to match: only the content tells
    side = json.loads(Path(malicious.meta_path).read_text())
    side.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    Path(malicious.meta_path).write_text(json.dumps(side))
    flipped = write(50, 7)
    raw = bytearray(Path(flipped.path).read_bytes())
    raw[-100] ^= 1
    Path(flipped.path).write_bytes(raw)
    write(12, 6, generation=2)
    (tmp_path / ckpt.checkpoint_name(60, 1)).write_bytes(pickle.dumps({}))  # no sidecar

    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["torch_loaded"] is False
    assert "torch is blocked" in result["write"]  # the blocker works: write needs torch
    assert result["listed"] == [10, 12, 20, 30, 40, 50]
    assert result["problems"] == ["data file without sidecar (interrupted write?)"]
    verified = result["verified"]
    assert [verified[step] for step in ("10", "12", "20", "30")] == ["ok"] * 4
    assert verified["40"].startswith("UnsafeCheckpointError: ")
    assert "['posix.system']" in verified["40"]
    assert verified["50"].startswith("CorruptCheckpointError: ") and "sha256" in verified["50"]
    assert result["chosen"] == 20
    assert [(step, why.split(":")[0]) for step, why in result["skipped"]] == [
        (50, "failed verification"),
        (40, "failed verification"),
        (30, "grade 2 < min_grade 5"),
    ]
    assert result["on_lineage"] == 12  # generation 2 branched from step 15 of generation 1
