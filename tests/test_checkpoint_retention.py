"""Checkpoint retention: the pure decision (workers/checkpoint/retention.py) and the deletion
that carries it out (workers/checkpoint/remove.py), on real files."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import commit, remove
from spikeguard.workers.checkpoint.format import CheckpointError, CheckpointInfo, Incomplete
from spikeguard.workers.checkpoint.retention import RetentionSettings, Verdict, decide


def _info(step: int, generation: int = 1, grade: int | None = 6, kind: str = "sharded"):
    if kind == "sharded":
        path = f"/ck/{ckpt.sharded_name(step, generation)}"
    else:
        path = f"/ck/{ckpt.checkpoint_name(step, generation)}"
    return CheckpointInfo(
        path=path,
        meta_path="",
        step=step,
        generation=generation,
        rank=0,
        sha256="0" * 64,
        size=100,
        meta={"grade": grade},
        kind=kind,
    )


def _kept(verdicts: list[Verdict]) -> list[int]:
    return sorted(v.step for v in verdicts if v.keep)


def _decide(
    infos, settings=None, *, protected=(), lineage=((1, None),), generation=1, incomplete=()
):
    return decide(
        infos,
        list(incomplete),
        settings or RetentionSettings(),
        protected=set(protected),
        lineage=list(lineage),
        generation=generation,
    )


def test_the_defaults_bound_the_disk_use() -> None:
    infos = [_info(s) for s in range(50, 2001, 50)]  # 40 healthy checkpoints
    verdicts = _decide(infos)
    assert _kept(verdicts) == [1900, 1950, 2000]  # keep_last 3 covers keep_healthy 2
    deleted = [v for v in verdicts if not v.keep]
    assert len(deleted) == 37 and all("beyond keep_last 3" in v.reason for v in deleted)


def test_keep_healthy_keeps_graded_ones_and_looks_min_steps_back() -> None:
    grades = {50: 6, 100: 6, 150: 2, 200: 6, 250: 3, 300: 3, 350: 3, 400: 2}
    infos = [_info(s, grade=g) for s, g in grades.items()]
    settings = RetentionSettings(keep_last=2, keep_healthy=1, min_steps_back=200)
    verdicts = {v.step: v for v in _decide(infos, settings)}
    assert _kept(list(verdicts.values())) == [200, 350, 400]
    assert verdicts[200].reason == "keep_healthy 1: graded S6 >= S4"
    # 200 is also the newest healthy at least 200 steps back (<= 400 - 200): kept once
    settings = RetentionSettings(keep_last=1, keep_healthy=1, min_steps_back=300)
    verdicts = {v.step: v for v in _decide(infos, settings)}
    assert _kept(list(verdicts.values())) == [100, 200, 400]
    assert "min_steps_back 300 before step 400" in verdicts[100].reason


def test_keep_every_archives_and_off_lineage_is_deleted() -> None:
    # generation 1 wrote up to 750; generation 2 resumed from step 550 of it
    infos = [_info(s, 1) for s in range(100, 751, 50)] + [_info(s, 2) for s in (600, 650)]
    lineage = [(1, None), (2, 550)]
    settings = RetentionSettings(keep_last=3, keep_healthy=0, keep_every=200)
    verdicts = _decide(infos, settings, lineage=lineage, generation=2)
    kept = {(v.step, v.generation): v.reason for v in verdicts if v.keep}
    assert kept == {
        (650, 2): "keep_last 3",
        (600, 2): "keep_every 200",  # (also one of the last 3)
        (550, 1): "keep_last 3",
        (600, 1): "keep_every 200",  # off the lineage, but archived
        (400, 1): "keep_every 200",
        (200, 1): "keep_every 200",
    }
    abandoned = [v for v in verdicts if v.generation == 1 and v.step in (650, 700, 750)]
    assert all(not v.keep and "off the current lineage" in v.reason for v in abandoned)


def test_unfinished_saves_are_deleted_only_when_nothing_can_still_write_them() -> None:
    infos = [_info(100, 2), _info(150, 3)]
    incomplete = [
        Incomplete("/ck/a", 120, 2, "sharded", 7),  # generation 2 was replaced
        Incomplete("/ck/b", 140, 3, "sharded", 7),  # generation 3 completed step 150 since
        Incomplete("/ck/c", 200, 3, "sharded", 7),  # the newest save of the running generation
        Incomplete("/ck/d", 90, 3, "replicated", 7),
    ]
    lineage = [(1, None), (2, None), (3, 100)]
    verdicts = {
        v.path: v for v in _decide(infos, lineage=lineage, generation=3, incomplete=incomplete)
    }
    assert not verdicts["/ck/a"].keep and "generation 2, since replaced" in verdicts["/ck/a"].reason
    assert not verdicts["/ck/b"].keep and "step 150" in verdicts["/ck/b"].reason
    assert not verdicts["/ck/d"].keep
    assert verdicts["/ck/c"].keep and "may still be running" in verdicts["/ck/c"].reason
    assert all(not verdicts[p].complete for p in ["/ck/a", "/ck/b", "/ck/c", "/ck/d"])


@pytest.mark.parametrize("seed", range(200))
def test_a_rollback_target_is_never_deleted(seed: int) -> None:
    """Random listings, lineages and settings: the protected checkpoint always stays, and
    whatever step the next incident fires at, its rollback chooses what it would have chosen
    without retention."""
    rng = random.Random(seed)
    generations = rng.randint(1, 4)
    lineage: list[tuple[int, int | None]] = [(1, None)]
    infos = []
    for gen in range(1, generations + 1):
        start = 0 if gen == 1 else lineage[-1][1] or 0
        for step in range(start + 50, start + 50 * rng.randint(1, 15), 50):
            infos.append(_info(step, gen, grade=rng.choice([None, 1, 3, 4, 5, 6, 7])))
        if gen < generations:
            mine = [i.step for i in infos if i.generation == gen]
            lineage.append((gen + 1, rng.choice(mine) if mine else None))
    if not infos:
        return
    protected = rng.choice(infos).path
    settings = RetentionSettings(
        keep_last=rng.randint(1, 4),
        keep_healthy=rng.randint(0, 3),
        keep_every=rng.choice([None, 200, 300]),
        min_grade=rng.choice([3, 4, 6]),
        min_steps_back=rng.choice([0, 100, 200]),
    )
    verdicts = _decide(
        infos, settings, protected=[protected], lineage=lineage, generation=generations
    )
    by_path = {v.path: v for v in verdicts}
    assert len(by_path) == len(infos)
    assert by_path[protected].keep
    kept = [i for i in infos if by_path[i.path].keep]
    on = [i for i in infos if ckpt.on_lineage(lineage, i.generation, i.step)]
    if not on or settings.keep_healthy == 0:
        return  # keep_healthy 0 keeps no graded history: a rollback may find nothing
    newest = max(i.step for i in on)

    def rollback(candidates: list[CheckpointInfo], before: int) -> CheckpointInfo | None:
        chosen, _ = ckpt.select_checkpoint(
            candidates,
            min_grade=settings.min_grade,
            before_step=before,
            min_steps_back=settings.min_steps_back,
            lineage=lineage,
            verify_fn=lambda _: None,
        )
        return chosen

    for before in (newest, newest + 1, newest + 49, newest + 137, newest + 1000):
        full, after = rollback(infos, before), rollback(kept, before)
        assert after == full, (seed, before, full, after)
    # a crash rolls back to the newest checkpoint on the lineage: always kept
    assert by_path[max(on, key=lambda i: (i.step, i.generation)).path].keep


def test_bad_settings_are_refused() -> None:
    for bad in ({"keep_last": 0}, {"keep_every": 0}, {"keep_healthy": -1}, {"min_grade": 8}):
        with pytest.raises(ValueError):
            RetentionSettings(**bad)


# -- deleting, on real files --------------------------------------------------------------------


def _sharded_dir(root: Path, step: int) -> Path:
    path = root / ckpt.sharded_name(step, 1)
    path.mkdir()
    (path / ".metadata").write_bytes(b"x")
    (path / "__0_0.distcp").write_bytes(b"y" * 10)
    (path / commit.COMMIT_NAME).write_text(json.dumps({"placeholder": True}))
    return path


def test_remove_deletes_a_sharded_directory_and_a_replicated_pair(tmp_path: Path) -> None:
    sharded = _sharded_dir(tmp_path, 100)
    data = tmp_path / ckpt.checkpoint_name(50, 1)
    data.write_bytes(b"d")
    Path(f"{data}.json").write_text("{}")
    remove.remove_checkpoint(str(sharded))
    remove.remove_checkpoint(str(data))
    assert os.listdir(tmp_path) == []
    remove.remove_checkpoint(str(sharded))  # already gone: nothing to do


def test_remove_never_follows_a_link_or_touches_other_names(tmp_path: Path) -> None:
    target = _sharded_dir(tmp_path, 100)
    link = tmp_path / ckpt.sharded_name(200, 1)
    link.symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        remove.remove_checkpoint(str(link))
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    with pytest.raises(CheckpointError, match="not named like a checkpoint"):
        remove.remove_checkpoint(str(other))
    assert sorted(os.listdir(target)) == [".metadata", "__0_0.distcp", commit.COMMIT_NAME]
    assert other.read_text() == "mine"
