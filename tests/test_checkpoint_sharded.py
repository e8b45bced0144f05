"""Sharded checkpoints on real gloo: FSDP2 ranks save with torch.distributed.checkpoint through
the SDK, a rank killed mid-save leaves nothing selectable, the rollback takes the previous
complete one, and a job of another world size resumes from it (DCP resharding).

Every multi-rank test runs ``tests/scripts/sharded_rank.py`` as real processes (2 or 3 ranks,
a small MLP under ``fully_shard``); the in-process tests write a one-rank sharded checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, read_jsonl, run_ranks
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import commit, pickle_scan
from spikeguard.workers.checkpoint.format import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from spikeguard.workers.contract import ResumePlan

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "sharded_rank.py"


def _job(
    tmp: Path,
    world: int,
    *args: str,
    plan: ResumePlan | None = None,
    ckpt_dir: str | None = None,
    **env: str,
):
    """Run the script with ``world`` ranks, checkpointing to ``ckpt_dir`` (default
    ``tmp/ck``); returns (results, [rank results JSON or None])."""
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    if plan is not None:
        plan_path = tmp / "plan.json"
        plan_path.write_text(plan.to_json())
        env["SPIKEGUARD_RESUME"] = str(plan_path)
    argv = ["--ckpt-dir", ckpt_dir or str(tmp / "ck"), "--out", str(out), *args]
    runs = run_ranks(SCRIPT, argv, world, timeout=180, **env)
    results = []
    for r in range(world):
        path = out / f"result-rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return runs, results


def _plan(info: ckpt.CheckpointInfo) -> ResumePlan:
    return ResumePlan(
        checkpoint=info.path, checkpoint_step=info.step, sha256=info.sha256, generation=1
    )


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _assert_same_state(saved: dict[str, Any], resumed: dict[str, Any]) -> None:
    """The full model and optimizer state, tensor by tensor."""
    assert sorted(saved["model"]) == sorted(resumed["model"])
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    assert sorted(saved["optimizer"]) == sorted(resumed["optimizer"])
    for name, moments in saved["optimizer"].items():
        for key, value in moments.items():
            assert torch.equal(value, resumed["optimizer"][name][key]), (name, key)


# -- the story of the issue: save, kill mid-save, roll back, resume with another world size ----


def test_killed_mid_save_is_never_selected_and_the_rollback_reshards(tmp_path: Path) -> None:
    runs, results = _job(
        tmp_path / "a", 2, "--save-at", "4,8", "--kill-rank", "1", "--kill-at", "8"
    )
    assert runs[1].returncode == -9, runs[1].stdout[-2000:]  # killed in the middle of the save
    assert runs[0].returncode != 0  # its peer failed in a collective
    ck = tmp_path / "a" / "ck"
    listed = ckpt.list_checkpoints(ck)
    assert [(i.step, i.kind, i.world_size) for i in listed] == [(4, "sharded", 2)]
    assert [(i.step, i.kind) for i in listed.incomplete] == [(8, "sharded")]
    assert "no commit marker" in dict(listed.problems)[str(ck / ckpt.sharded_name(8, 0))]
    assert sorted(os.listdir(ck / ckpt.sharded_name(8, 0)))  # the shard rank 0 wrote is there

    chosen, skipped = ckpt.select_checkpoint(listed, min_grade=None, before_step=None)
    assert chosen is not None and chosen.step == 4 and skipped == []
    ckpt.verify(chosen)  # every file against the marker, .metadata scanned

    runs, results = _job(tmp_path / "b", 3, "--steps", "6", plan=_plan(chosen))
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    assert [r["start"] for r in results] == [5, 5, 5]
    saved = _load(tmp_path / "a" / "out" / "saved-step4.pt")
    _assert_same_state(saved, _load(tmp_path / "b" / "out" / "resumed.pt"))


def test_async_saves_commit_what_was_staged_with_the_worst_grade(tmp_path: Path) -> None:
    report = tmp_path / "a" / "rep"
    runs, results = _job(
        tmp_path / "a",
        2,
        "--async",
        "--save-at",
        "4,8",
        "--steps",
        "12",
        "--low-rank",
        "1",
        "--report",
        f"jsonl://{report}",
    )
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    listed = ckpt.list_checkpoints(tmp_path / "a" / "ck")
    assert [i.step for i in listed] == [4, 8] and not listed.problems
    for info in listed:
        ckpt.verify(info)
        ranks = info.meta["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(isinstance(r["grade"], int) for r in ranks)
        assert ranks[1]["grade"] < ranks[0]["grade"]  # rank 1 trains on rank-one inputs
        assert info.grade == ranks[1]["grade"] and info.meta["worst_rank"] == 1
    assert results[0]["last_async"]["path"] == listed[1].path
    # rank 0 reports each committed checkpoint once; the other ranks report none
    mine = [m for m in read_jsonl(Path(f"{report}.rank0.jsonl")) if m["type"] == "checkpoint"]
    theirs = [m for m in read_jsonl(Path(f"{report}.rank1.jsonl")) if m["type"] == "checkpoint"]
    assert [(m["step"], m["path"], m["sha256"]) for m in mine] == [
        (i.step, i.path, i.sha256) for i in listed
    ]
    assert all(m["kind"] == "sharded" and m["grade"] == i.grade for m, i in zip(mine, listed))
    assert theirs == []
    # training went on while the shards were written: what was committed is what was staged
    runs, results = _job(tmp_path / "b", 1, "--steps", "5", plan=_plan(listed[0]))
    assert runs[0].returncode == 0, runs[0].stdout[-2000:]
    _assert_same_state(
        _load(tmp_path / "a" / "out" / "saved-step4.pt"),
        _load(tmp_path / "b" / "out" / "resumed.pt"),
    )
    # the plan's optimizer reset and LR scale, as on the replicated path
    plan = dataclasses.replace(_plan(listed[0]), reset_optimizer=True, lr_scale=0.5)
    report = tmp_path / "c" / "rep"
    runs, _ = _job(tmp_path / "c", 1, "--steps", "5", "--report", f"jsonl://{report}", plan=plan)
    assert runs[0].returncode == 0, runs[0].stdout[-2000:]
    saved = _load(tmp_path / "a" / "out" / "saved-step4.pt")
    fresh = _load(tmp_path / "c" / "out" / "resumed.pt")
    assert all(torch.equal(t, fresh["model"][k]) for k, t in saved["model"].items())
    for moments in fresh["optimizer"].values():  # never loaded: as a fresh optimizer has them
        assert not moments["exp_avg"].any() and not moments["exp_avg_sq"].any()
    (resumed,) = [m for m in read_jsonl(Path(f"{report}.rank0.jsonl")) if m["type"] == "resumed"]
    assert resumed["optimizer_reset"] is True and resumed["lr_scale"] == 0.5
    assert resumed["from_step"] == 5 and resumed["checkpoint"] == listed[0].path


def test_a_request_the_ranks_see_at_different_steps_is_answered_at_one_step(
    tmp_path: Path,
) -> None:
    """Request 1 reaches rank 0 before step 3 and rank 1 before step 5; request 2 reaches only
    rank 1, before step 7. Every rank saves at steps 3 and 7, and nowhere else (a rank saving
    alone would hang its peers in the collective)."""
    report = tmp_path / "rep"
    runs, results = _job(
        tmp_path,
        2,
        "--steps",
        "10",
        "--report",
        f"jsonl://{report}",
        *("--request", "0:3:1", "--request", "1:5:1", "--request", "1:7:2"),
    )
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    assert [sorted(r["saved"]) for r in results] == [["3", "7"], ["3", "7"]]
    assert [i.step for i in ckpt.list_checkpoints(tmp_path / "ck")] == [3, 7]
    answers = [m for m in read_jsonl(Path(f"{report}.rank0.jsonl")) if m["type"] == "checkpoint"]
    assert [(m["step"], m["requests"]) for m in answers] == [(3, [1]), (7, [2])]


def test_a_fenced_generation_cannot_commit(tmp_path: Path) -> None:
    fence = tmp_path / "FENCE"
    fence.write_text("0")
    runs, results = _job(
        tmp_path, 2, "--save-at", "4,8", "--fence-at", "8", SPIKEGUARD_FENCE_FILE=str(fence)
    )
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    listed = ckpt.list_checkpoints(tmp_path / "ck")
    assert [i.step for i in listed] == [4] and not listed.problems
    assert not (tmp_path / "ck" / ckpt.sharded_name(8, 0)).exists()  # removed after the refusal
    # the fence appeared while the shards were written: rank 0 refused to commit; every rank
    # (reading the same FENCE) is told it was fenced
    errors = [r["saved"]["8"]["error"] for r in results]
    for rank, error in enumerate(errors):
        assert error.startswith("StaleGenerationError"), error
        assert f"rank {rank} of generation 0 was fenced (current generation 99)" in error


# -- one rank, in this process: tampering and hostile files -----------------------------------


def _save_one(tmp_path: Path, step: int = 3, **state: Any) -> ckpt.CheckpointInfo:
    """A real one-rank sharded checkpoint of a small Linear and its AdamW state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    info = ckpt.ShardedWriter().save(
        tmp_path,
        {"model": msd, "optimizer": osd, **state},
        step=step,
        generation=1,
        rank_meta={"grade": 6, "loss": 1.0},
        meta={},
    )
    assert isinstance(info, ckpt.CheckpointInfo)
    return info


def _remark(info: ckpt.CheckpointInfo) -> ckpt.CheckpointInfo:
    """Rewrite the commit marker so it matches the files as they are now (what someone with
    write access to the checkpoint directory can do); the new marker's description."""
    from spikeguard.workers.checkpoint.integrity import hash_file

    files = {name: hash_file(os.path.join(info.path, name)) for name, _, _ in info.files}
    text = commit.marker_text(
        directory_name=os.path.basename(info.path),
        step=info.step,
        generation=info.generation,
        world_size=info.world_size,
        files=files,
        meta=info.meta,
        created=info.created,
    )
    Path(info.meta_path).write_text(text)
    return ckpt.read_marker(info.path)


class _CreatesFile:
    """Unpickling it creates ``path`` (``open(path, "w")``): proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_a_crafted_metadata_is_refused_before_anything_is_unpickled(tmp_path: Path) -> None:
    good = _save_one(tmp_path, step=3)
    bad = _save_one(tmp_path, step=5)
    created = tmp_path / "pwned"
    (Path(bad.path) / ".metadata").write_bytes(pickle.dumps(_CreatesFile(created), protocol=4))
    # altered, marker unchanged: the checksum refuses it
    with pytest.raises(CorruptCheckpointError, match=r"(size|sha256) mismatch"):
        ckpt.verify(bad)
    # altered and re-marked: the checksums agree, the scan refuses it
    bad = _remark(bad)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata needs globals .*open"):
        ckpt.verify(bad)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(UnsafeCheckpointError, match="open"):
        ckpt.load_sharded(bad.path, model=model, expected_sha256=bad.sha256)
    chosen, skipped = ckpt.select_checkpoint(
        ckpt.list_checkpoints(tmp_path), min_grade=4, before_step=None
    )
    assert chosen == good and skipped[0][0] == bad and "failed verification" in skipped[0][1]
    assert not created.exists()
    # the payload is live: torch's own reader runs it (which is why nothing above may read it)
    code = f"""
        import torch, torch.distributed.checkpoint as dcp
        try:
            dcp.load({{"model": torch.nn.Linear(4, 3).state_dict()}}, checkpoint_id={bad.path!r})
        except BaseException:
            pass
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=120)
    assert created.exists()


def test_a_crafted_non_tensor_value_is_refused_by_the_weights_only_planner(tmp_path: Path) -> None:
    """DCP loads non-tensor values with weights_only=False; spikeguard's planner does not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    msd, osd = get_state_dict(model, optimizer)
    created = tmp_path / "pwned"
    osd["param_groups"][0]["lr"] = _CreatesFile(created)
    path = tmp_path / ckpt.sharded_name(7, 1)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))  # not through spikeguard
    files = {}
    from spikeguard.workers.checkpoint.integrity import hash_file

    for name in os.listdir(path):
        files[name] = hash_file(str(path / name))
    text = commit.marker_text(
        directory_name=path.name,
        step=7,
        generation=1,
        world_size=1,
        files=files,
        meta={"grade": 7},
        created="",
    )
    (path / commit.COMMIT_NAME).write_text(text)
    info = ckpt.read_marker(path)
    ckpt.verify(info)  # the metadata is DCP's own: the supervisor cannot see inside the values
    fresh = torch.nn.Linear(4, 3)
    with pytest.raises(UnsafeCheckpointError, match="weights-only"):
        ckpt.load_sharded(path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert not created.exists()
    # the model alone (reset_optimizer) does not read the optimizer's values
    ckpt.load_sharded(path, model=torch.nn.Linear(4, 3), reset_optimizer=True)


def test_the_sdk_refuses_to_save_what_weights_only_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot be loaded with weights_only"):
        _save_one(tmp_path, step=2, note=_CreatesFile(tmp_path / "x"))
    assert os.listdir(tmp_path) == []  # refused before anything was written


def test_an_existing_directory_is_never_overwritten(tmp_path: Path) -> None:
    _save_one(tmp_path, step=3)
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        _save_one(tmp_path, step=3)
    assert [i.step for i in ckpt.list_checkpoints(tmp_path)] == [3]


def test_a_stack_global_with_a_computed_name_is_refused() -> None:
    # "os" and "system" joined from pieces on the stack, never as literals
    payload = b"\x80\x04\x8c\x01o\x94\x8c\x01s\x94\x93\x94."  # not even that: 'o'.'s' is no global
    with pytest.raises(UnsafeCheckpointError, match=r"\['o\.s'\]"):
        pickle_scan.scan_dcp_metadata(payload)
    computed = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x85\x94\x93\x94."  # a tuple, then
    with pytest.raises(UnsafeCheckpointError, match="other than string literals"):
        pickle_scan.scan_dcp_metadata(computed)


def test_the_dcp_allowlist_is_exactly_what_torch_writes(tmp_path: Path) -> None:
    """Every dtype DCP can save, odd tensors, non-tensor values and an optimizer: the globals
    their .metadata names are exactly the allowlist."""
    import warnings

    import torch.distributed.checkpoint as dcp

    states: list[dict[str, Any]] = [
        {
            "channels_last": torch.ones(1, 2, 3, 4).to(memory_format=torch.channels_last),
            "empty": torch.empty(0),
            "scalar": torch.tensor(3),
            "param": torch.nn.Parameter(torch.ones(2)),
            "values": {"int": 5, "float": 1.5, "tuple": (1, 2), "none": None, "str": "x"},
        }
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                states.append({"t": torch.zeros(3, dtype=dtype)})
            except (RuntimeError, TypeError):
                continue
    seen: set[str] = set()
    for i, state in enumerate(states):
        path = tmp_path / str(i)
        try:
            dcp.save(state, checkpoint_id=str(path))
        except BaseException:  # DCP cannot plan sub-byte and quantized dtypes
            continue
        seen |= pickle_scan.scan_dcp_metadata((path / ".metadata").read_bytes())
    assert seen == pickle_scan.DCP_METADATA_GLOBALS


def test_hostile_sharded_entries_are_listed_as_problems(tmp_path: Path) -> None:
    good = _save_one(tmp_path, step=3)
    name = os.path.basename(good.path)

    def variant(step: int, change) -> Path:
        target = tmp_path / ckpt.sharded_name(step, 1)
        os.system(f"cp -r {good.path} {target}")
        marker = json.loads((target / commit.COMMIT_NAME).read_text())
        marker["step"] = step
        marker["directory"] = target.name
        change(target, marker)
        return target

    def traversal(target: Path, marker: dict) -> None:
        marker["files"]["../escape"] = marker["files"].pop("__0_0.distcp")
        (target / commit.COMMIT_NAME).write_text(json.dumps(marker))

    def no_metadata(target: Path, marker: dict) -> None:
        del marker["files"][".metadata"]
        (target / commit.COMMIT_NAME).write_text(json.dumps(marker))

    def fifo_marker(target: Path, marker: dict) -> None:
        (target / commit.COMMIT_NAME).unlink()
        os.mkfifo(target / commit.COMMIT_NAME)

    def symlinked_marker(target: Path, marker: dict) -> None:
        (target / commit.COMMIT_NAME).unlink()
        (target / commit.COMMIT_NAME).symlink_to(Path(good.meta_path))

    def deep(target: Path, marker: dict) -> None:
        marker["meta"]["deep"] = json.loads("[" * 100 + "]" * 100)
        (target / commit.COMMIT_NAME).write_text(json.dumps(marker))

    def truncated_shard(target: Path, marker: dict) -> None:
        (target / commit.COMMIT_NAME).write_text(json.dumps(marker))
        with open(target / "__0_0.distcp", "r+b") as f:
            f.truncate(10)

    cases = [traversal, no_metadata, fifo_marker, symlinked_marker, deep, truncated_shard]
    paths = [variant(10 + i, change) for i, change in enumerate(cases)]
    (tmp_path / ckpt.sharded_name(30, 1)).symlink_to(good.path)  # a directory, through a link
    listed = ckpt.list_checkpoints(tmp_path)
    assert [os.path.basename(i.path) for i in listed] == [name]
    problems = dict(listed.problems)
    assert "not a plain file name" in problems[str(paths[0])]
    assert "does not list .metadata" in problems[str(paths[1])]
    assert "FIFO" in problems[str(paths[2])]
    assert "symbolic link" in problems[str(paths[3])]
    assert "nested more than" in problems[str(paths[4])]
    assert "size mismatch" in problems[str(paths[5])]
    assert "symbolic link" in problems[str(tmp_path / ckpt.sharded_name(30, 1))]
    assert listed.incomplete == []  # each has a marker: broken, not unfinished


def test_the_supervisor_verifies_sharded_checkpoints_without_torch(tmp_path: Path) -> None:
    info = _save_one(tmp_path, step=3)
    from test_architecture import run_blocked

    code = f"""
        import sys
        from spikeguard.workers.checkpoint import list_checkpoints, select_checkpoint, verify
        listed = list_checkpoints({str(tmp_path)!r})
        chosen, _ = select_checkpoint(listed, min_grade=4, before_step=None)
        verify(chosen)
        assert chosen.kind == "sharded" and chosen.sha256 == {info.sha256!r}, chosen
        assert "torch" not in sys.modules
    """
    res = run_blocked({"torch"}, code)
    assert res.returncode == 0, res.stderr[-3000:]
