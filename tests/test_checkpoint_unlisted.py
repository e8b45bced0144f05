"""A committed checkpoint directory holds what its commit marker lists and nothing else.

A file, a symlink (pointing out of the directory) or a subdirectory added after the commit to a
Trainer's ``checkpoint-N`` or to a DCP directory would be read by the framework without ever
being checked (the Trainer loads a ``pytorch_model_fsdp_0/`` it finds and crashes on every
resume; a symlink takes the load outside): verification refuses such a checkpoint, naming the
entry, and the chooser falls back to the older one. What spikeguard itself leaves there (the
marker, a leftover of the marker's temp file) is allowed; a rank that DCP gave nothing to write
leaves no empty shard behind, so a real multi-rank save still verifies.

Real files, real one-rank DCP saves in this process, and a real two-rank gloo save.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl, run_ranks
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import choose, commit, trainer_commit

FILES = {
    "model.safetensors": b"weights" * 100,
    "optimizer.pt": b"moments" * 50,
    "trainer_state.json": b'{"global_step": 1}',
}
RANKS = [{"rank": 0, "grade": 6, "loss": 2.5, "summary": {}, "signals_step": 0}]


def _trainer_checkpoint(root: Path, step: int) -> ckpt.CheckpointInfo:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    return trainer_commit.commit_trainer_dir(
        str(d), step=step, generation=1, world_size=1, ranks=RANKS, meta={}
    )


def _sharded_checkpoint(root: Path, step: int) -> ckpt.CheckpointInfo:
    """A real one-rank DCP checkpoint of a small Linear and its AdamW state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    info = ckpt.ShardedWriter().save(
        root,
        {"model": msd, "optimizer": osd},
        step=step,
        generation=1,
        rank_meta={"grade": 6, "loss": 1.0},
        meta={},
    )
    assert isinstance(info, ckpt.CheckpointInfo)
    return info


def _add_file(d: Path, outside: Path) -> str:
    (d / "extra.bin").write_bytes(b"never verified")
    return "extra.bin which its commit marker does not list"


def _add_symlink(d: Path, outside: Path) -> str:
    (d / "adapter_model.bin").symlink_to(outside)
    return "adapter_model.bin (a symbolic link) which its commit marker does not list"


def _add_subdirectory(d: Path, outside: Path) -> str:
    (d / "pytorch_model_fsdp_0").mkdir()
    (d / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"sharded weights")
    return "pytorch_model_fsdp_0/ which its commit marker does not list"


ADDITIONS = [_add_file, _add_symlink, _add_subdirectory]
Addition = Callable[[Path, Path], str]


def _outside(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "secret.bin"
    target.parent.mkdir()
    target.write_bytes(b"outside the checkpoint")
    return target


def _assert_refused_and_older_chosen(root: Path, older: str, newer: str, why: str) -> None:
    """The newer checkpoint is still listed (retention still sees it) but fails verification,
    naming the entry, and the chooser takes the older one."""
    listed = ckpt.list_checkpoints(root)
    assert [i.path for i in listed] == [older, newer], listed.problems
    chosen, skipped = choose.select_checkpoint(list(listed), min_grade=4, before_step=None)
    assert chosen is not None and chosen.path == older
    assert [s.path for s, _ in skipped] == [newer]
    assert skipped[0][1] == f"failed verification: {newer} holds {why}" + (
        " (added after the commit: never verified, so the checkpoint is refused)"
    )
    with pytest.raises(ckpt.CorruptCheckpointError, match="which its commit marker does not"):
        ckpt.verify(listed[1])


@pytest.mark.parametrize("add", ADDITIONS, ids=lambda f: f.__name__)
def test_a_trainer_checkpoint_holding_an_unlisted_entry_is_refused(
    tmp_path: Path, add: Addition
) -> None:
    root = tmp_path / "ck"
    older = _trainer_checkpoint(root, 100)
    newer = _trainer_checkpoint(root, 200)
    ckpt.verify(newer)  # as committed, it verifies
    why = add(Path(newer.path), _outside(tmp_path))
    _assert_refused_and_older_chosen(root, older.path, newer.path, why)
    # the rank's own check before the Trainer loads the directory refuses it too
    with pytest.raises(ckpt.CorruptCheckpointError, match="checkpoint-200 holds"):
        trainer_commit.verify_for_resume(newer.path, newer.sha256)
    assert trainer_commit.verify_for_resume(older.path, older.sha256).step == 100


@pytest.mark.parametrize("add", ADDITIONS, ids=lambda f: f.__name__)
def test_a_dcp_checkpoint_holding_an_unlisted_entry_is_refused(
    tmp_path: Path, add: Addition
) -> None:
    root = tmp_path / "ck"
    older = _sharded_checkpoint(root, 3)
    newer = _sharded_checkpoint(root, 5)
    ckpt.verify(newer)
    why = add(Path(newer.path), _outside(tmp_path))
    _assert_refused_and_older_chosen(root, older.path, newer.path, why)
    # the ranks' check before DCP reads the directory refuses it, before anything is loaded
    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CorruptCheckpointError, match="which its commit marker does not"):
        ckpt.load_sharded(newer.path, model=model, expected_sha256=newer.sha256)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ckpt.load_sharded(older.path, model=model, expected_sha256=older.sha256).step == 3


def test_many_unlisted_entries_are_named_up_to_a_bound(tmp_path: Path) -> None:
    info = _trainer_checkpoint(tmp_path, 10)
    for i in range(8):
        (Path(info.path) / f"added-{i}.bin").write_bytes(b"x")
    with pytest.raises(ckpt.CorruptCheckpointError) as refused:
        ckpt.verify(info)
    assert (
        f"{info.path} holds added-0.bin, added-1.bin, added-2.bin, added-3.bin, added-4.bin "
        "and 3 more which its commit marker does not list"
    ) in str(refused.value)


def test_what_spikeguard_itself_leaves_in_a_committed_directory_is_allowed(
    tmp_path: Path,
) -> None:
    """The marker's temp file, left behind by a publisher that died between its link and its
    unlink (``.tmp-spikeguard-commit.json-<pid>``), is spikeguard's own: the checkpoint still
    verifies. Any other temp-looking name is not, and no longer slips into a commit unlisted."""
    info = _trainer_checkpoint(tmp_path, 10)
    d = Path(info.path)
    leftover = d / f"{ckpt.TMP_PREFIX}{commit.COMMIT_NAME}-4242"
    leftover.write_bytes((d / commit.COMMIT_NAME).read_bytes())
    ckpt.verify(info)
    assert trainer_commit.verify_for_resume(info.path, info.sha256).step == 10
    # the same name as a directory is not the marker's temp file
    leftover.unlink()
    leftover.mkdir()
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"json-4242/ which its commit"):
        ckpt.verify(info)
    leftover.rmdir()
    (d / ".tmp-model.safetensors-77").write_bytes(b"not spikeguard's")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"\.tmp-model\.safetensors-77 which"):
        ckpt.verify(info)
    # committing the directory as it is now would leave that file unlisted: refused
    with pytest.raises(ckpt.CheckpointError, match="a file name the commit marker cannot list"):
        trainer_commit.commit_trainer_dir(
            info.path, step=10, generation=2, world_size=1, ranks=RANKS, meta={}
        )


RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from spikeguard.workers.checkpoint import ShardedWriter

dist.init_process_group("gloo")
# one replicated tensor: DCP's planner writes it from one rank only, the other has nothing
info = ShardedWriter().save(
    sys.argv[1], {"model": {"w": torch.ones(3)}}, step=1, generation=1,
    rank_meta={"grade": 6, "loss": 1.0}, meta={},
)
if dist.get_rank() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"path": info.path, "files": [n for n, _, _ in info.files]}, f)
dist.destroy_process_group()
"""


def test_a_rank_with_nothing_to_write_leaves_no_unlisted_shard(tmp_path: Path) -> None:
    """DCP opens ``__1_0.distcp`` for a rank whose replicated tensors went to rank 0 and leaves
    it empty, referenced by nothing: the commit removes it, so the directory holds exactly what
    the marker lists and verifies."""
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    out = tmp_path / "saved.json"
    runs = run_ranks(script, [str(tmp_path / "ck"), str(out)], 2, timeout=600)
    assert all(r.returncode == 0 for r in runs), [r.stdout[-3000:] for r in runs]
    (saved,) = read_jsonl(out)
    assert sorted(os.listdir(saved["path"])) == sorted([*saved["files"], commit.COMMIT_NAME])
    (info,) = ckpt.list_checkpoints(tmp_path / "ck")
    assert info.world_size == 2
    ckpt.verify(info)


def test_an_empty_dcp_bucket_of_an_older_save_is_allowed_and_anything_else_is_not(
    tmp_path: Path,
) -> None:
    """DCP creates an empty ``__R_K.distcp`` for a rank it gave nothing to write; saves before
    spikeguard dropped them hold one unlisted. Such a directory still verifies (DCP never reads
    an unreferenced file), so an upgrade keeps the run's older checkpoints; the same name with
    content, or in a Trainer's directory, is refused."""
    info = _sharded_checkpoint(tmp_path / "ck", 5)
    bucket = Path(info.path) / "__1_0.distcp"
    bucket.write_bytes(b"")
    ckpt.verify(info)
    bucket.write_bytes(b"planted")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"__1_0\.distcp which its commit"):
        ckpt.verify(info)
    hf = _trainer_checkpoint(tmp_path / "hf", 10)
    (Path(hf.path) / "__1_0.distcp").write_bytes(b"")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"__1_0\.distcp which its commit"):
        ckpt.verify(hf)
