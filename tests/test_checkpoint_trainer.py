"""A Trainer's ``checkpoint-N`` committed with spikeguard's commit marker (layout hf-trainer):
listed with its grade, verified file by file, skipped when corrupt or incomplete, never published
by a fenced rank, removable, and shown by the checkpoints table. No torch model: plain files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from spikeguard.supervisor.observe.checkpoint_table import _parse_name
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import choose, commit, remove, trainer_commit
from spikeguard.workers.session import StaleGenerationError

FILES = {
    "model.safetensors": b"weights" * 100,
    "optimizer.pt": b"moments" * 50,
    "trainer_state.json": b'{"global_step": 1}',
}


def _trainer_dir(root: Path, step: int, **extra: bytes) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for name, data in {**FILES, **extra}.items():
        (d / name).write_bytes(data)
    return d


def _commit(d: Path, step: int, grade: int | None = 5, generation: int = 1, **kw):
    ranks = [
        {"rank": 0, "grade": grade, "loss": 2.5, "summary": {"grade": grade}, "signals_step": step},
        {"rank": 1, "grade": 6, "loss": 2.6, "summary": {}, "signals_step": step},
    ]
    return trainer_commit.commit_trainer_dir(
        str(d),
        step=step,
        generation=generation,
        world_size=2,
        ranks=ranks,
        meta={"lr_scale": 1.0, "run": "t"},
        **kw,
    )


def test_a_committed_trainer_dir_is_listed_graded_and_verifies(tmp_path: Path) -> None:
    d = _trainer_dir(tmp_path, 20)
    info = _commit(d, 20, grade=4)
    assert info.kind == "hf-trainer" and info.grade == 4 and info.world_size == 2
    listed = ckpt.list_checkpoints(tmp_path)
    assert [(i.path, i.step, i.generation, i.grade) for i in listed] == [(str(d), 20, 1, 4)]
    assert {name for name, _, _ in listed[0].files} == set(FILES)
    ckpt.verify(listed[0])
    assert trainer_commit.verify_for_resume(str(d), info.sha256).sha256 == info.sha256
    marker = json.loads((d / commit.COMMIT_NAME).read_text())
    assert marker["layout"] == "hf-trainer" and marker["directory"] == "checkpoint-20"
    assert marker["meta"]["ranks"][1]["grade"] == 6 and marker["meta"]["worst_rank"] == 0


def test_a_corrupt_file_fails_verification_and_selection_falls_back(tmp_path: Path) -> None:
    older = _trainer_dir(tmp_path, 10)
    _commit(older, 10)
    newer = _trainer_dir(tmp_path, 20)
    _commit(newer, 20)
    data = bytearray((newer / "optimizer.pt").read_bytes())
    data[3] ^= 0xFF  # same size, other bytes: only the hash tells
    (newer / "optimizer.pt").write_bytes(bytes(data))
    listed = ckpt.list_checkpoints(tmp_path)
    assert [i.step for i in listed] == [10, 20]  # the listing only checks sizes
    chosen, skipped = choose.select_checkpoint(listed, min_grade=4, before_step=100)
    assert chosen is not None and chosen.path == str(older)
    assert "sha256 mismatch" in skipped[0][1]
    with pytest.raises(ckpt.CorruptCheckpointError):
        trainer_commit.verify_for_resume(str(newer), listed[1].sha256)


def test_missing_files_bad_markers_and_uncommitted_dirs_are_skipped(tmp_path: Path) -> None:
    missing = _trainer_dir(tmp_path, 10)
    _commit(missing, 10)
    (missing / "optimizer.pt").unlink()
    garbage = _trainer_dir(tmp_path, 20)
    _commit(garbage, 20)
    (garbage / commit.COMMIT_NAME).write_text("{not json")
    renamed = _trainer_dir(tmp_path, 30)
    _commit(renamed, 30)
    os.rename(renamed, tmp_path / "checkpoint-31")  # the marker describes checkpoint-30
    _trainer_dir(tmp_path, 40)  # the Trainer's save, never committed
    listed = ckpt.list_checkpoints(tmp_path)
    assert list(listed) == []
    problems = dict(listed.problems)
    assert "is missing" in problems[str(missing)]
    assert "commit marker" in problems[str(garbage)]
    assert "describe checkpoint-30" in problems[str(tmp_path / "checkpoint-31")]
    assert "no commit marker" in problems[str(tmp_path / "checkpoint-40")]
    assert listed.incomplete == []  # not spikeguard's own saves: retention leaves them alone


def test_a_fenced_rank_publishes_nothing(tmp_path: Path) -> None:
    d = _trainer_dir(tmp_path, 10)

    def fence() -> None:
        raise StaleGenerationError("generation 1 was replaced by 2")

    with pytest.raises(StaleGenerationError):
        _commit(d, 10, fence=fence)
    assert not (d / commit.COMMIT_NAME).exists()
    assert list(ckpt.list_checkpoints(tmp_path)) == []


def test_a_subdirectory_or_symlink_refuses_the_commit(tmp_path: Path) -> None:
    d = _trainer_dir(tmp_path, 10)
    (d / "pytorch_model_fsdp_0").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="only flat"):
        _commit(d, 10)
    e = _trainer_dir(tmp_path, 20)
    (e / "link.bin").symlink_to(e / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointError, match="not a regular file"):
        _commit(e, 20)
    with pytest.raises(ckpt.CheckpointError, match="not named checkpoint-11"):
        _commit(_trainer_dir(tmp_path, 12), 11)


def test_a_rewritten_step_is_retracted_then_committed_anew(tmp_path: Path) -> None:
    d = _trainer_dir(tmp_path, 30)
    old = _commit(d, 30, generation=1)
    assert trainer_commit.retract(str(d)) and not trainer_commit.retract(str(d))
    (d / "model.safetensors").write_bytes(b"other weights")
    new = _commit(d, 30, generation=2)
    assert new.generation == 2 and new.sha256 != old.sha256
    (info,) = ckpt.list_checkpoints(tmp_path)
    ckpt.verify(info)


def test_removal_and_the_checkpoints_table(tmp_path: Path) -> None:
    d = _trainer_dir(tmp_path, 50)
    _commit(d, 50)
    assert _parse_name(str(d)) == (50, None, "hf-trainer")
    remove.remove_checkpoint(str(d))
    assert not d.exists()
    assert commit.parse_trainer_name("checkpoint-7") == 7
    assert commit.parse_trainer_name("checkpoint-x") is None
    assert commit.parse_trainer_name("checkpoint-07a") is None
