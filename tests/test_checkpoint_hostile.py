"""Checkpoint discovery on a hostile directory: never raises, never blocks, never follows a link.

Real files only (FIFOs, symlink loops, huge and deeply nested sidecars). Every call that could
block runs in a thread with a deadline, so a regression fails here instead of hanging the suite.
No torch: this is the supervisor's side.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import CheckpointError

DATA = b"PK\x03\x04 not really a zip, but the right size and checksum"
DEADLINE_S = 10.0


def forge(d: Path, step: int, *, data: bytes = DATA, **fields: Any) -> tuple[Path, Path]:
    """A data file and a consistent sidecar; ``fields`` override the sidecar's fields."""
    name = ckpt.checkpoint_name(step, 1)
    sidecar = {
        "format": ckpt.CHECKPOINT_FORMAT,
        "version": ckpt.CHECKPOINT_FORMAT_VERSION,
        "file": name,
        "step": step,
        "generation": 1,
        "rank": 0,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "created": "",
        "meta": {"grade": 7},
    }
    sidecar.update(fields)
    (d / name).write_bytes(data)
    (d / (name + ".json")).write_text(json.dumps(sidecar))
    return d / name, d / (name + ".json")


def within(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, failing the test if it has not returned within the deadline."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"{fn.__name__} blocked for {DEADLINE_S} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.fixture
def fifos() -> Iterator[Callable[[Path], Path]]:
    """Makes FIFOs; afterwards opens each for writing once, to free a reader a regression left
    blocked in open()."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def problems(listed: ckpt.CheckpointList) -> dict[str, str]:
    return {os.path.basename(p): why for p, why in listed.problems}


# -- sidecars ------------------------------------------------------------------------------------
def test_a_sidecar_nested_5000_deep_is_a_problem(tmp_path: Path) -> None:
    forge(tmp_path, 1)
    _, side = forge(tmp_path, 2)
    side.write_text(side.read_text()[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert [i.step for i in listed] == [1]
    assert "malformed JSON" in problems(listed)[side.name]


def test_a_sidecar_nested_deeper_than_the_cap_is_a_problem(tmp_path: Path) -> None:
    deep: Any = 7
    for _ in range(100):
        deep = {"x": deep}
    _, side = forge(tmp_path, 1, meta={"grade": 7, "deep": deep})
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == [] and "nested more than" in problems(listed)[side.name]


def test_a_huge_sidecar_is_a_problem_and_not_read_whole(tmp_path: Path) -> None:
    _, side = forge(tmp_path, 1, meta={"grade": 7, "pad": "x" * (2 << 20)})
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == [] and "larger than" in problems(listed)[side.name]


@pytest.mark.parametrize("field", ["step", "generation", "rank", "size"])
def test_a_400_digit_integer_field_is_a_problem(tmp_path: Path, field: str) -> None:
    _, side = forge(tmp_path, 1)
    fields = json.loads(side.read_text())
    fields[field] = 10**400
    side.write_text(json.dumps(fields))
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == [] and side.name in problems(listed)


NOT_GRADES = [10**400, 1e308, 6.5, 8, -1, True, "7", "S7", None, [7], float("inf")]


@pytest.mark.parametrize("grade", NOT_GRADES, ids=[repr(g)[:12] for g in NOT_GRADES])
def test_what_is_not_a_grade_never_qualifies(tmp_path: Path, grade: Any) -> None:
    forge(tmp_path, 1, meta={"grade": 5})
    forge(tmp_path, 2, meta={"grade": grade})
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert [i.step for i in listed] == [1, 2] and listed[1].grade is None
    chosen, skipped = ckpt.select_checkpoint(
        listed, min_grade=5, before_step=None, verify_fn=lambda info: None
    )
    assert chosen is not None and chosen.step == 1
    assert skipped == [(listed[1], "ungraded (no integer 'grade' in meta)")]


def test_grades_0_to_7_qualify(tmp_path: Path) -> None:
    for g in range(8):
        forge(tmp_path, g, meta={"grade": g})
    forge(tmp_path, 8, meta={"grade": 6.0})  # an integral float (write_checkpoint keeps it)
    assert [i.grade for i in ckpt.list_checkpoints(tmp_path)] == [0, 1, 2, 3, 4, 5, 6, 7, 6]


# -- what is not a regular file --------------------------------------------------------------------
def test_a_sidecar_that_is_a_fifo_is_a_problem_not_a_hang(tmp_path: Path, fifos) -> None:
    _, side = forge(tmp_path, 1)
    side.unlink()
    fifos(side)
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == [] and "regular file" in problems(listed)[side.name]


def test_a_data_file_that_is_a_fifo_is_a_problem_and_never_verified(tmp_path: Path, fifos) -> None:
    data, side = forge(tmp_path, 1, size=0)
    data.unlink()
    fifos(data)
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == [] and "regular file" in problems(listed)[side.name]
    info = ckpt.read_sidecar(str(side))
    with pytest.raises(CheckpointError, match="regular file"):
        within(ckpt.verify, info)
    chosen, skipped = within(ckpt.select_checkpoint, [info], min_grade=0, before_step=None)
    assert chosen is None and "regular file" in skipped[0][1]


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real_data, real_side = forge(elsewhere, 1)
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    (ckdir / real_side.name).symlink_to(real_side)  # a linked sidecar
    (ckdir / real_data.name).symlink_to(real_data)
    data2, side2 = forge(ckdir, 2)
    data2.unlink()
    data2.symlink_to(real_data)  # a real sidecar whose data file is a link
    listed = within(ckpt.list_checkpoints, ckdir)
    assert listed == []
    assert "regular file" in problems(listed)[real_side.name]
    assert "regular file" in problems(listed)[side2.name]
    linked = ckpt.read_sidecar(str(side2))  # the sidecar itself is fine
    with pytest.raises(CheckpointError, match="symbolic link"):
        within(ckpt.verify, linked)


def test_symlink_loops_are_problems_not_eloop(tmp_path: Path) -> None:
    name = ckpt.checkpoint_name(1, 1)
    (tmp_path / name).symlink_to(tmp_path / name)  # the data file links to itself
    (tmp_path / (name + ".json")).symlink_to(tmp_path / "a")
    (tmp_path / "a").symlink_to(tmp_path / (name + ".json"))  # a sidecar in a loop
    _, side = forge(tmp_path, 2)
    (tmp_path / ckpt.checkpoint_name(2, 1)).unlink()
    (tmp_path / ckpt.checkpoint_name(2, 1)).symlink_to(tmp_path / ckpt.checkpoint_name(2, 1))
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == []
    assert set(problems(listed)) == {name + ".json", side.name}
    assert "symbolic link" in problems(listed)[name + ".json"]
    assert "symbolic link" in problems(listed)[side.name]
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    listed = within(ckpt.list_checkpoints, loop)  # the directory itself is a loop
    assert listed == [] and len(listed.problems) == 1


def test_a_directory_that_cannot_be_listed_is_a_problem(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    for directory in (a_file, tmp_path / ("x" * 5000)):  # ENOTDIR, ENAMETOOLONG
        listed = within(ckpt.list_checkpoints, directory)
        assert listed == [] and len(listed.problems) == 1
    assert ckpt.list_checkpoints(tmp_path / "nope").problems == []  # absent: simply empty


def test_a_sidecar_that_is_a_directory_is_a_problem(tmp_path: Path) -> None:
    name = ckpt.checkpoint_name(1, 1)
    (tmp_path / name).write_bytes(DATA)
    (tmp_path / (name + ".json")).mkdir()
    listed = within(ckpt.list_checkpoints, tmp_path)
    assert listed == [] and "regular file" in problems(listed)[name + ".json"]
