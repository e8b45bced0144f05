"""A committed checkpoint directory mirrored between a local disk and S3
(workers/checkpoint/mirror.py), through the real s3fs and botocore clients against moto's real
S3 server on 127.0.0.1 (tests/s3server.py, a bucket per test): published marker last and
write-once, verifiable on the store with the supervisor's own checks, a killed or failed upload
never listed, pulled back verified (a damaged, missing, resized or added object refused before
anything lands in place), a throttling store retried; and the staging directory's pure rules."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from s3server import Bucket, Throttle, s3, s3_server, s3_throttle
from spikeguard.workers.checkpoint import choose, commit, mirror, trainer_commit
from spikeguard.workers.checkpoint.format import CheckpointError, CorruptCheckpointError

__all__ = ["s3", "s3_server", "s3_throttle"]  # the fixtures, used by name

RUN = "run/checkpoints"
FILES = ("model.safetensors", "optimizer.pt", "rng_state_0.pth", "trainer_state.json")


def _staged(root: Path, step: int, *, generation: int = 1) -> Path:
    """A Trainer-shaped ``checkpoint-STEP`` under ``root``, committed as spikeguard commits one
    (its marker lists every file's sha256)."""
    directory = root / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    rng = random.Random(step * 1000 + generation)
    sizes = {"model.safetensors": 300_000, "optimizer.pt": 200_000, "rng_state_0.pth": 1_500}
    for name, size in sizes.items():
        (directory / name).write_bytes(rng.randbytes(size))
    (directory / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    trainer_commit.commit_trainer_dir(
        str(directory),
        step=step,
        generation=generation,
        world_size=1,
        ranks=[{"rank": 0, "grade": 5, "loss": 1.5}],
        meta={"run": "mirror-test"},
    )
    return directory


def _keys(step: int) -> list[str]:
    return sorted(f"{RUN}/checkpoint-{step}/{n}" for n in (*FILES, commit.COMMIT_NAME))


def _same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def test_a_committed_directory_round_trips_through_s3(s3: Bucket, tmp_path: Path) -> None:
    staged = _staged(tmp_path / "stage", 20)
    local = commit.read_marker(staged)
    remote = s3.url(f"{RUN}/checkpoint-20")
    info = mirror.publish_tree(staged, remote)
    assert (info.path, info.sha256, info.kind) == (remote, local.sha256, commit.TRAINER_LAYOUT)
    assert s3.objects() == _keys(20)  # every listed file and the marker, nothing else
    assert (
        s3.get(f"{RUN}/checkpoint-20/{commit.COMMIT_NAME}")
        == (staged / commit.COMMIT_NAME).read_bytes()
    )
    # the supervisor's own listing and verification, on the store
    [listed] = choose.list_checkpoints(s3.url(RUN))
    assert (listed.path, listed.sha256, listed.step, listed.grade) == (remote, info.sha256, 20, 5)
    choose.verify(listed)
    # pulled back with the plan's checksum: the same bytes, verifiable as the rank verifies
    pulled = mirror.pull_tree(remote, str(tmp_path / "pulled" / "checkpoint-20"), info.sha256)
    assert pulled == str(tmp_path / "pulled" / "checkpoint-20")
    assert _same_tree(staged, Path(pulled))
    trainer_commit.verify_for_resume(pulled, info.sha256)
    assert sorted(p.name for p in (tmp_path / "pulled").iterdir()) == [
        ".spikeguard-pull-checkpoint-20.lock",
        "checkpoint-20",
    ]  # no temp file left beside the files


def test_the_marker_is_published_last_after_the_fence(s3: Bucket, tmp_path: Path) -> None:
    staged = _staged(tmp_path / "stage", 20)
    remote = s3.url(f"{RUN}/checkpoint-20")
    seen: dict[str, object] = {}

    def fence() -> None:  # right before the marker: every file is there, no marker yet
        seen["objects"] = s3.objects()
        seen["listed"] = choose.list_checkpoints(s3.url(RUN))

    mirror.publish_tree(staged, remote, fence=fence)
    assert seen["objects"] == sorted(f"{RUN}/checkpoint-20/{n}" for n in FILES)
    listed = seen["listed"]
    assert listed == [] and dict(listed.problems) == {  # type: ignore[attr-defined]
        remote: "no commit marker (not committed by spikeguard)"
    }
    # a fenced generation publishes no marker, and leaves nothing behind
    other = _staged(tmp_path / "stage", 30)

    def stale() -> None:
        raise RuntimeError("generation 1 was replaced")

    with pytest.raises(RuntimeError, match="replaced"):  # the fence's own error, unchanged
        mirror.publish_tree(other, s3.url(f"{RUN}/checkpoint-30"), fence=stale)
    assert s3.objects() == _keys(20)


KILLED = """
import os, signal, sys
from spikeguard.workers.checkpoint import mirror
staged, remote, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
upload, done = mirror._upload, []
def killing_upload(*args):
    if len(done) == after:
        os.kill(os.getpid(), signal.SIGKILL)  # the process dies between two uploads
    upload(*args)
    done.append(args)
mirror._upload = killing_upload
mirror.publish_tree(staged, remote, fence=lambda: os.kill(os.getpid(), signal.SIGKILL))
"""


@pytest.mark.parametrize("after", [2, len(FILES)], ids=["between-files", "before-the-marker"])
def test_a_killed_upload_leaves_no_listed_checkpoint(
    s3: Bucket, tmp_path: Path, after: int
) -> None:
    staged = _staged(tmp_path / "stage", 20)
    remote = s3.url(f"{RUN}/checkpoint-20")
    res = subprocess.run(
        [sys.executable, "-c", KILLED, str(staged), remote, str(after)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),  # the fixture's endpoint and keys
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert len(s3.objects()) == after and commit.COMMIT_NAME not in str(s3.objects())
    listed = choose.list_checkpoints(s3.url(RUN))
    assert listed == [] and [p for p, _ in listed.problems] == [remote]
    # the next publication of the same directory clears what the killed one left, and lands
    info = mirror.publish_tree(staged, remote)
    assert s3.objects() == _keys(20)
    [again] = choose.list_checkpoints(s3.url(RUN))
    choose.verify(again)
    assert again.sha256 == info.sha256


def test_an_upload_that_fails_leaves_nothing_and_names_the_url(s3: Bucket, tmp_path: Path) -> None:
    staged = _staged(tmp_path / "stage", 20)
    remote = s3.url(f"{RUN}/checkpoint-20")
    # the last file (by name) changed on the local disk after the commit: the others are
    # uploaded first, then its upload is aborted by its own hash, and they are removed again
    last = staged / FILES[-1]
    last.write_bytes(last.read_bytes().replace(b"20", b"21"))
    with pytest.raises(CheckpointError) as failed:
        mirror.publish_tree(staged, remote)
    assert remote in str(failed.value) and "sha256 mismatch" in str(failed.value)
    assert s3.objects() == []
    assert s3.client.list_multipart_uploads(Bucket=s3.name).get("Uploads", []) == []
    # a directory that is not committed, or holds more than its marker lists, is refused unsent
    (staged / "extra.bin").write_bytes(b"x")
    with pytest.raises(CorruptCheckpointError, match=r"extra\.bin"):
        mirror.publish_tree(staged, remote)
    (staged / commit.COMMIT_NAME).unlink()
    with pytest.raises(CheckpointError, match="not committed"):
        mirror.publish_tree(staged, remote)
    with pytest.raises(CheckpointError, match="same committed directory name"):
        mirror.publish_tree(staged, s3.url(f"{RUN}/checkpoint-21"))
    assert s3.objects() == []


def test_an_older_generations_checkpoint_is_replaced_never_a_newer_one(
    s3: Bucket, tmp_path: Path
) -> None:
    remote = s3.url(f"{RUN}/checkpoint-20")
    first = mirror.publish_tree(_staged(tmp_path / "gen1", 20, generation=1), remote)
    # generation 2 (resumed from an earlier step) saves step 20 again: gen 1's is off its lineage
    second = mirror.publish_tree(_staged(tmp_path / "gen2", 20, generation=2), remote)
    assert second.sha256 != first.sha256 and s3.objects() == _keys(20)
    [listed] = choose.list_checkpoints(s3.url(RUN))
    assert (listed.generation, listed.sha256) == (2, second.sha256)
    choose.verify(listed)  # no object of generation 1's left under it
    for generation in (2, 1):  # the same generation again, or an older one: refused
        staged = _staged(tmp_path / f"again{generation}", 20, generation=generation)
        with pytest.raises(CheckpointError, match=r"refusing to overwrite.*generation 2"):
            mirror.publish_tree(staged, remote)
    assert commit.read_marker(remote).sha256 == second.sha256


def _published(s3: Bucket, tmp_path: Path) -> tuple[str, str]:
    info = mirror.publish_tree(_staged(tmp_path / "stage", 20), s3.url(f"{RUN}/checkpoint-20"))
    return info.path, info.sha256


def _nothing_pulled(into: Path) -> bool:
    return not any(p.name.startswith("checkpoint-") for p in into.iterdir())


@pytest.mark.parametrize(
    ("damage", "refusal"),
    [
        ("flip", "sha256 mismatch"),
        ("truncate", "model.safetensors has 299999 bytes, its commit marker says 300000"),
        ("delete", "is missing"),
        ("add", "extra.bin which its commit marker does not list"),
        ("add-dir", "pytorch_model_fsdp_0/ which its commit marker does not list"),
        ("no-marker", "has no commit marker"),
        ("other-marker", "not the checkpoint the plan names"),
    ],
)
def test_a_damaged_remote_checkpoint_is_refused_on_pull(
    s3: Bucket, tmp_path: Path, damage: str, refusal: str
) -> None:
    remote, sha256 = _published(s3, tmp_path)
    key = f"{RUN}/checkpoint-20/model.safetensors"
    marker = f"{RUN}/checkpoint-20/{commit.COMMIT_NAME}"
    good = s3.get(key)
    if damage == "flip":  # same size, other bytes: only the hash tells
        s3.put(key, good[:1000] + bytes([good[1000] ^ 0xFF]) + good[1001:])
    elif damage == "truncate":
        s3.put(key, good[:-1])
    elif damage == "delete":
        s3.client.delete_object(Bucket=s3.name, Key=key)
    elif damage == "add":
        s3.put(f"{RUN}/checkpoint-20/extra.bin", b"never verified")
    elif damage == "add-dir":
        s3.put(f"{RUN}/checkpoint-20/pytorch_model_fsdp_0/shard.distcp", b"never verified")
    elif damage == "no-marker":
        s3.client.delete_object(Bucket=s3.name, Key=marker)
    else:  # a marker rewritten (valid, describing the same files): not the plan's
        s3.put(marker, s3.get(marker).replace(b'"grade": 5', b'"grade": 7'))
    into = tmp_path / "pulled"
    into.mkdir()
    with pytest.raises(CorruptCheckpointError, match=re.escape(refusal)):
        mirror.pull_tree(remote, str(into / "checkpoint-20"), sha256)
    assert _nothing_pulled(into)  # nothing in place, no temp file
    assert [p.name for p in into.iterdir()] == [".spikeguard-pull-checkpoint-20.lock"]


def test_a_pull_needs_the_plans_checksum_and_reuses_a_verified_copy(
    s3: Bucket, tmp_path: Path
) -> None:
    remote, sha256 = _published(s3, tmp_path)
    target = tmp_path / "pulled" / "checkpoint-20"
    with pytest.raises(CheckpointError, match="no checksum"):
        mirror.pull_tree(remote, str(target), None)
    mirror.pull_tree(remote, str(target), sha256)
    # a second pull finds it there and verifies it: the store is not read again
    s3.put(f"{RUN}/checkpoint-20/model.safetensors", b"damaged on the store since")
    assert mirror.pull_tree(remote, str(target), sha256) == str(target)
    # a local copy that does not verify is removed and pulled again (here: refused on the store)
    (target / "optimizer.pt").write_bytes(b"damaged on the local disk")
    with pytest.raises(CorruptCheckpointError):
        mirror.pull_tree(remote, str(target), sha256)
    assert not target.exists()


def test_the_ranks_of_a_node_pull_one_at_a_time(s3: Bucket, tmp_path: Path) -> None:
    remote, sha256 = _published(s3, tmp_path)
    target = str(tmp_path / "pulled" / "checkpoint-20")
    results: list[object] = []

    def pull() -> None:
        try:
            results.append(mirror.pull_tree(remote, target, sha256))
        except Exception as e:  # collected, asserted below
            results.append(e)

    threads = [threading.Thread(target=pull) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [target] * 3
    trainer_commit.verify_for_resume(target, sha256)


def test_slowdown_is_retried_both_ways(s3: Bucket, s3_throttle: Throttle, tmp_path: Path) -> None:
    staged = _staged(tmp_path / "stage", 20)
    s3_throttle.fail_next(3)
    info = mirror.publish_tree(staged, s3.url(f"{RUN}/checkpoint-20"))
    assert s3_throttle.throttled == 3 and s3.objects() == _keys(20)
    s3_throttle.fail_next(3)
    pulled = mirror.pull_tree(info.path, str(tmp_path / "pulled" / "checkpoint-20"), info.sha256)
    assert s3_throttle.throttled == 6 and _same_tree(staged, Path(pulled))


def test_a_store_that_keeps_throttling_fails_the_publication_naming_the_url(
    s3: Bucket, s3_throttle: Throttle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3server import SECRET_KEY

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    staged = _staged(tmp_path / "stage", 20)
    remote = s3.url(f"{RUN}/checkpoint-20")
    s3_throttle.fail_next(1000)
    with pytest.raises(CheckpointError) as failed:
        mirror.publish_tree(staged, remote)
    said = str(failed.value)  # the first request is a HEAD: 503 without a body
    assert remote in said and ("Service Unavailable" in said or "reduce your request" in said)
    assert SECRET_KEY not in said
    s3_throttle.fail_next(0)
    assert s3.objects() == []
    mirror.publish_tree(staged, remote)  # the store is back: the same publication goes through
    assert s3.objects() == _keys(20)


# -- the staging directory's rules (pure, and its clean-up on a local disk) ----------------------
def test_staging_directories_are_per_run_remote_and_generation() -> None:
    a = mirror.staging_dir("/scratch", "s3://b/run/checkpoints", run_id="my run/1", generation=2)
    assert a.startswith("/scratch/my_run_1-") and a.endswith("/gen002")
    assert a == mirror.staging_dir(
        "/scratch", "s3://b/run/checkpoints/", run_id="my run/1", generation=2
    )
    assert a != mirror.staging_dir("/scratch", "s3://b/other", run_id="my run/1", generation=2)
    assert os.path.dirname(a) == os.path.dirname(
        mirror.staging_dir("/scratch", "s3://b/run/checkpoints", run_id="my run/1", generation=3)
    )


def test_which_staged_checkpoints_are_removed() -> None:
    staged = [
        ("checkpoint-10", True),
        ("checkpoint-30", True),
        ("checkpoint-20", False),  # a failed commit, or another node's rng files
        ("checkpoint-40", False),  # being written, or published by rank 0 now
        ("runs", False),  # not a checkpoint's: never
    ]
    assert mirror.staged_to_remove(staged, busy=40, keep=0) == [
        "checkpoint-10",
        "checkpoint-20",
        "checkpoint-30",
    ]
    assert mirror.staged_to_remove(staged, busy=40, keep=1) == ["checkpoint-10", "checkpoint-20"]
    assert mirror.staged_to_remove(staged, busy=None, keep=1) == [
        "checkpoint-10",
        "checkpoint-20",
        "checkpoint-40",
    ]
    assert mirror.staged_to_remove([("checkpoint-5", True)], busy=None, keep=0) == ["checkpoint-5"]


def test_pruning_removes_staged_checkpoints_and_older_generations(tmp_path: Path) -> None:
    run = tmp_path / "run-abc"
    stage = run / "gen003"
    _staged(stage, 10)
    (stage / "checkpoint-20").mkdir()
    (stage / "checkpoint-20" / "rng_state_1.pth").write_bytes(b"rng")
    (stage / "runs").mkdir()
    assert mirror.prune_staging(str(stage), busy=20, keep=0) == [str(stage / "checkpoint-10")]
    assert sorted(p.name for p in stage.iterdir()) == ["checkpoint-20", "runs"]
    for old in ("gen001", "gen002", "gen004"):
        (run / old / "checkpoint-5").mkdir(parents=True)
    assert mirror.prune_generations(str(stage)) == [str(run / "gen001"), str(run / "gen002")]
    assert sorted(p.name for p in run.iterdir()) == ["gen003", "gen004"]


def test_mirroring_needs_no_torch(s3: Bucket, tmp_path: Path) -> None:
    from test_architecture import run_blocked

    staged = _staged(tmp_path / "stage", 20)
    remote = s3.url(f"{RUN}/checkpoint-20")
    code = f"""
        import sys
        from spikeguard.workers.checkpoint import choose, mirror
        info = mirror.publish_tree({str(staged)!r}, {remote!r})
        [listed] = choose.list_checkpoints({s3.url(RUN)!r})
        choose.verify(listed)
        mirror.pull_tree({remote!r}, {str(tmp_path / "pulled" / "checkpoint-20")!r}, info.sha256)
        assert "torch" not in sys.modules
    """
    res = run_blocked({"torch"}, code)  # the environment (endpoint, keys) is inherited
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert _same_tree(staged, tmp_path / "pulled" / "checkpoint-20")
