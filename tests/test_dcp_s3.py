"""Sharded (DCP) checkpoints on S3, through the real s3fs and botocore clients against a real
S3-compatible server on 127.0.0.1 (moto in server mode, tests/s3server.py), a bucket per test:
every rank writes its shard straight to the store, hashed as it is written (nothing read back,
nothing on local disk), the commit marker last; a rank killed mid-upload leaves nothing
selectable and a job of another world size resumes from the previous checkpoint on S3; a marker
whose objects went missing or changed size is refused; a throttling store is retried, then the
save fails naming the URL. The POSIX path hashes as it writes too (the same writer)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from s3server import Bucket, Throttle, s3, s3_server, s3_throttle
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import choose, commit, dcp_write, remove, retention, storage
from spikeguard.workers.checkpoint.dcp_load import load_sharded
from spikeguard.workers.checkpoint.format import CheckpointError, CorruptCheckpointError
from test_checkpoint_sharded import _assert_same_state, _job, _load, _plan

__all__ = ["s3", "s3_server", "s3_throttle"]  # the fixtures, used by name

RUN = "run/checkpoints"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its Adam after two steps (so the optimizer has moments to save)."""
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def _no_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a save reads a file it wrote back to hash it."""

    def refuse(path: str, **_: object) -> tuple[str, int]:
        raise AssertionError(f"{path} was read back to be hashed")

    monkeypatch.setattr(dcp_write, "hash_file", refuse)


def _save(url: str, model, opt, step: int, **kw) -> ckpt.CheckpointInfo:
    out = ckpt.ShardedWriter().save(
        url, _state(model, opt), step=step, generation=1, rank_meta={"grade": 5}, meta={}, **kw
    )
    return out if isinstance(out, ckpt.CheckpointInfo) else out.result(timeout=120)


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_sharded_checkpoint_goes_to_s3_hashed_as_written(
    s3: Bucket,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    async_save: bool,
) -> None:
    monkeypatch.chdir(tmp_path)  # where a writer taking the URL for a path would have written
    _no_read_back(monkeypatch)
    model, opt = _trained(1)
    info = _save(s3.url(RUN), model, opt, 6, async_save=async_save)
    name = ckpt.sharded_name(6, 1)
    assert info.path == s3.url(f"{RUN}/{name}") and info.kind == "sharded"
    keys = s3.objects(f"{RUN}/{name}/")
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == sorted(
        [commit.COMMIT_NAME, commit.DCP_METADATA_NAME]
        + [n for n, _, _ in info.files if n.endswith(".distcp")]
    )
    # what the marker says each object is, the store has (hashed by the writer, not read back)
    for file_name, sha256, size in info.files:
        data = s3.get(f"{RUN}/{name}/{file_name}")
        assert len(data) == size and hashlib.sha256(data).hexdigest() == sha256
    assert list(tmp_path.iterdir()) == []  # nothing on local disk
    [listed] = choose.list_checkpoints(s3.url(RUN))
    assert listed.sha256 == info.sha256
    ckpt.verify(listed)

    fresh, fresh_opt = _trained(2)
    assert not _same_parameters(model, fresh)
    got = load_sharded(listed.path, model=fresh, optimizer=fresh_opt, expected_sha256=info.sha256)
    assert got.step == 6 and _same_parameters(model, fresh)
    saved_moments = opt.state_dict()["state"]
    for k, moments in fresh_opt.state_dict()["state"].items():
        assert torch.equal(moments["exp_avg"], saved_moments[k]["exp_avg"])


def test_posix_saves_hash_as_written_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_read_back(monkeypatch)
    model, opt = _trained(3)
    info = _save(str(tmp_path / "ck"), model, opt, 4)
    for file_name, sha256, size in info.files:
        assert storage.storage_for(info.path).sha256(os.path.join(info.path, file_name)) == (
            sha256,
            size,
        )
    ckpt.verify(info)


def test_a_marker_whose_objects_went_missing_or_changed_size_is_refused(s3: Bucket) -> None:
    model, opt = _trained(4)
    info = _save(s3.url(RUN), model, opt, 8)
    key = f"{RUN}/{ckpt.sharded_name(8, 1)}/"
    shard = next(n for n, _, _ in info.files if n.endswith(".distcp"))
    data = s3.get(key + shard)
    s3.put(key + shard, data + b"\0")  # one byte more
    with pytest.raises(CorruptCheckpointError, match="size mismatch"):
        ckpt.verify(info)
    with pytest.raises(CorruptCheckpointError):
        load_sharded(info.path, model=_model(5), expected_sha256=info.sha256)
    s3.client.delete_object(Bucket=s3.name, Key=key + shard)
    with pytest.raises(CorruptCheckpointError):
        ckpt.verify(info)
    s3.put(key + shard, data)  # as it was: accepted again
    ckpt.verify(info)


@pytest.mark.slow
def test_a_rank_killed_mid_upload_leaves_nothing_selectable_and_the_rollback_reshards(
    s3: Bucket, tmp_path: Path
) -> None:
    url = s3.url(RUN)
    runs, _ = _job(
        tmp_path / "a", 2, "--save-at", "4,8", "--kill-rank", "1", "--kill-at", "8", ckpt_dir=url
    )
    assert runs[1].returncode == -9, runs[1].stdout[-2000:]  # killed in the middle of its upload
    assert runs[0].returncode != 0  # its peer failed in a collective
    assert not (tmp_path / "a" / "ck").exists()
    listed = ckpt.list_checkpoints(url)
    assert [(i.step, i.kind, i.world_size) for i in listed] == [(4, "sharded", 2)]
    assert [(i.step, i.kind) for i in listed.incomplete] == [(8, "sharded")]
    orphan = s3.url(f"{RUN}/{ckpt.sharded_name(8, 0)}")
    assert "no commit marker" in dict(listed.problems)[orphan]
    chosen, _ = ckpt.select_checkpoint(listed, min_grade=None, before_step=None)
    assert chosen is not None and chosen.step == 4
    ckpt.verify(chosen)

    runs, results = _job(tmp_path / "b", 3, "--steps", "6", plan=_plan(chosen), ckpt_dir=url)
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    assert [r["start"] for r in results] == [5, 5, 5]
    _assert_same_state(
        _load(tmp_path / "a" / "out" / "saved-step4.pt"),
        _load(tmp_path / "b" / "out" / "resumed.pt"),
    )
    # the orphaned objects of the killed save go once nothing can write them any more
    now = ckpt.list_checkpoints(url)
    verdicts = retention.decide(
        now, now.incomplete, retention.RetentionSettings(), protected=(), lineage=None, generation=1
    )
    assert [v.path for v in verdicts if not v.keep] == [orphan]
    remove.remove_checkpoint(orphan)
    assert s3.objects(f"{RUN}/{ckpt.sharded_name(8, 0)}/") == []


def test_a_throttling_store_is_retried_then_the_save_fails_naming_the_url(
    s3: Bucket, s3_throttle: Throttle, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained(6)
    s3_throttle.fail_next(3)
    info = _save(s3.url(RUN), model, opt, 2)  # botocore's adaptive retries absorb the 503s
    assert s3_throttle.throttled == 3
    ckpt.verify(info)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    s3_throttle.fail_next(10_000)
    with pytest.raises(CheckpointError, match=r"s3://") as e:
        _save(s3.url(RUN), model, opt, 3)
    assert "SECRET" not in str(e.value)
    s3_throttle.fail_next(0)
    assert [i.step for i in choose.list_checkpoints(s3.url(RUN))] == [2]
