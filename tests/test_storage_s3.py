"""Checkpoints on S3 (workers/checkpoint/fsspec_storage.py behind the storage seam), through the
real s3fs and botocore clients against a real S3-compatible server on 127.0.0.1 (moto in server
mode, tests/s3server.py), a bucket per test: written with the ordinary write path, listed,
verified, loaded back bit for bit, damaged behind the code's back (with boto3's own client) and
refused, deleted by retention; a throttling store (503 SlowDown) is retried, then a failure is an
error naming the URL and never the credentials."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from s3server import SECRET_KEY, Bucket, Throttle, s3, s3_server, s3_throttle
from spikeguard.supervisor.observe.checkpoint_table import render, rows
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import choose, commit, remove, retention, storage, trainer_commit
from spikeguard.workers.checkpoint.format import CheckpointError, CorruptCheckpointError

__all__ = ["s3", "s3_server", "s3_throttle"]  # the fixtures, used by name

RUN = "run/checkpoints"


def _state(step: int) -> dict:
    """A state dict with tensors of several dtypes and plain values (what a rank saves)."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.arange(7, dtype=torch.int64) * step,
            "h": torch.randn(5, generator=g).to(torch.bfloat16),
        },
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3, generator=g)}}, "lr": 1e-3},
        "step": step,
        "rng": torch.tensor([1, 2, 3], dtype=torch.uint8),
    }


def _same(a: object, b: object) -> bool:
    """Equal, tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _write(s3: Bucket, step: int, grade: int = 5, generation: int = 1) -> ckpt.CheckpointInfo:
    return ckpt.write_checkpoint(
        s3.url(RUN),
        _state(step),
        step=step,
        generation=generation,
        meta={"grade": grade, "loss": 2.0 + step / 100},
    )


def test_object_store_schemes_are_fsspecs_and_loaded_lazily() -> None:
    from fsspec.registry import known_implementations

    assert set(storage.OBJECT_STORE_SCHEMES) <= set(known_implementations)
    assert "s3" in storage.OBJECT_STORE_SCHEMES
    # importing the seam, listing a local directory: neither fsspec nor s3fs is imported
    code = """
        import sys
        from spikeguard.workers.checkpoint import choose, storage
        assert choose.list_checkpoints(".") == []
        assert not {"fsspec", "s3fs", "botocore"} & set(sys.modules), sys.modules.keys()
        assert "s3" in storage._REGISTRY
    """
    res = subprocess.run(
        [sys.executable, "-c", "\n".join(line[8:] for line in code.splitlines())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_replicated_checkpoint_round_trips_through_s3(s3: Bucket) -> None:
    from spikeguard.workers.checkpoint.fsspec_storage import FsspecStorage

    assert isinstance(storage.storage_for(s3.url(RUN)), FsspecStorage)
    info = _write(s3, 10)
    name = ckpt.checkpoint_name(10, 1)
    assert info.path == s3.url(f"{RUN}/{name}")
    assert s3.objects() == [f"{RUN}/{name}", f"{RUN}/{name}.json"]  # no temp object left behind
    [listed] = choose.list_checkpoints(s3.url(RUN))
    assert (listed.path, listed.sha256, listed.size) == (info.path, info.sha256, info.size)
    assert listed.size == len(s3.get(f"{RUN}/{name}")) and listed.grade == 5
    choose.verify(listed)
    assert _same(ckpt.load_checkpoint(listed), _state(10))
    # by path, its sidecar read from the store; and with a resume plan's checksum
    assert _same(ckpt.load_checkpoint(info.path), _state(10))
    assert _same(ckpt.load_checkpoint(info.path, expected_sha256=info.sha256), _state(10))


def test_the_supervisor_lists_and_verifies_s3_without_torch(s3: Bucket) -> None:
    from test_architecture import run_blocked

    _write(s3, 10, grade=6)
    _write(s3, 20, grade=3)
    code = f"""
        import sys
        from spikeguard.workers.checkpoint import choose
        listed = choose.list_checkpoints({s3.url(RUN)!r})
        for info in listed:
            choose.verify(info)
        chosen, skipped = choose.select_checkpoint(listed, min_grade=4, before_step=None)
        print(chosen.step, [i.step for i, _ in skipped])
        assert "torch" not in sys.modules
    """
    res = run_blocked({"torch"}, code)  # the environment (endpoint, keys) is inherited
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stdout.split() == ["10", "[20]"]


def test_a_checkpoint_without_its_sidecar_is_never_listed(s3: Bucket) -> None:
    kept = _write(s3, 10)
    orphan = _write(s3, 20)
    s3.client.delete_object(Bucket=s3.name, Key=f"{RUN}/{ckpt.checkpoint_name(20, 1)}.json")
    # and what a writer killed before publishing leaves: temp objects
    stale = f"{RUN}/{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(30, 1)}-4242"
    s3.put(stale, b"half a checkpoint")
    listed = choose.list_checkpoints(s3.url(RUN))
    assert [i.path for i in listed] == [kept.path]
    assert [(i.path, i.step, i.kind) for i in listed.incomplete] == [
        (orphan.path, 20, "replicated")
    ]
    assert dict(listed.problems)[orphan.path] == "data file without sidecar (interrupted write?)"
    assert ckpt.clean_temp_files(s3.url(RUN)) == [s3.url(stale)]
    assert stale not in s3.objects()
    assert ckpt.clean_temp_files(s3.url(RUN), older_than_s=3600) == []  # mtime is the object's


def test_verify_refuses_an_object_of_the_wrong_bytes_or_size(s3: Bucket) -> None:
    info = _write(s3, 10)
    key = f"{RUN}/{ckpt.checkpoint_name(10, 1)}"
    good = s3.get(key)
    s3.put(key, good[:-40] + b"\x00" * 40)  # same size, other bytes: only the hash tells
    [listed] = choose.list_checkpoints(s3.url(RUN))
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch"):
        choose.verify(listed)
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch"):
        ckpt.load_checkpoint(listed)
    s3.put(key, good[:-1])  # truncated: the listing already refuses it
    listed = choose.list_checkpoints(s3.url(RUN))
    assert list(listed) == []
    assert "size mismatch" in dict(listed.problems)[info.meta_path]
    with pytest.raises(CorruptCheckpointError, match="size mismatch"):
        choose.verify(info)  # what a resume plan carries, checked against the object now
    chosen, skipped = choose.select_checkpoint([info], min_grade=None, before_step=None)
    assert chosen is None and "failed verification" in skipped[0][1]


def test_publication_never_replaces_an_object(s3: Bucket) -> None:
    info = _write(s3, 10)
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        _write(s3, 10)
    st = storage.storage_for(s3.url(RUN))
    with pytest.raises(FileExistsError) as taken:
        st.publish_bytes(info.meta_path, b"{}")  # the conditional PUT, refused by the server
    assert taken.value.filename == info.meta_path
    with pytest.raises(FileExistsError) as taken, st.create(info.path) as f:
        f.write(b"other bytes")  # refused when the upload completes
    assert taken.value.filename == info.path
    with pytest.raises(FileExistsError):
        st.publish(info.meta_path, info.path)
    assert _same(ckpt.load_checkpoint(info.path), _state(10))  # all of it untouched
    # an error inside the block publishes nothing
    with pytest.raises(RuntimeError, match="save failed"), st.create(s3.url("new")) as f:
        f.write(b"partial")
        raise RuntimeError("torch.save failed")
    f.close()  # what the garbage collector would do: it must not complete the upload either
    assert s3.objects() == [
        f"{RUN}/{ckpt.checkpoint_name(10, 1)}",
        f"{RUN}/{ckpt.checkpoint_name(10, 1)}.json",
    ]
    assert s3.client.list_multipart_uploads(Bucket=s3.name).get("Uploads", []) == []


def test_retention_and_removal_delete_the_objects(s3: Bucket) -> None:
    for step in (10, 20, 30):
        _write(s3, step)
    # a Trainer's directory beside them, committed on the store, and one whose name extends it
    for directory in ("checkpoint-7", "checkpoint-70"):
        s3.put(f"{RUN}/{directory}/model.safetensors", b"weights" * 100)
        s3.put(f"{RUN}/{directory}/trainer_state.json", b"{}")
    trainer = trainer_commit.commit_trainer_dir(
        s3.url(f"{RUN}/checkpoint-7"),
        step=7,
        generation=1,
        world_size=1,
        ranks=[{"rank": 0, "grade": 6, "loss": 0.5}],
        meta={},
    )
    assert f"{RUN}/checkpoint-7/{commit.COMMIT_NAME}" in s3.objects()
    listed = choose.list_checkpoints(s3.url(RUN))
    assert [(i.step, i.kind) for i in listed] == [
        (7, commit.TRAINER_LAYOUT),
        (10, "replicated"),
        (20, "replicated"),
        (30, "replicated"),
    ]
    choose.verify(listed[0])
    verdicts = retention.decide(
        listed,
        listed.incomplete,
        retention.RetentionSettings(keep_last=1, keep_healthy=0),
        protected=(),
        lineage=None,
        generation=1,
    )
    doomed = sorted(v.path for v in verdicts if not v.keep)
    assert doomed == sorted(
        [trainer.path, *(s3.url(f"{RUN}/{ckpt.checkpoint_name(s, 1)}") for s in (10, 20))]
    )
    for path in doomed:
        remove.remove_checkpoint(path)
    newest = ckpt.checkpoint_name(30, 1)
    assert s3.objects() == [
        f"{RUN}/checkpoint-70/model.safetensors",  # a longer name beside it: untouched
        f"{RUN}/checkpoint-70/trainer_state.json",
        f"{RUN}/{newest}",
        f"{RUN}/{newest}.json",
    ]
    remove.remove_checkpoint(s3.url(f"{RUN}/{newest}"))
    remove.remove_checkpoint(s3.url(f"{RUN}/{newest}"))  # a missing one is no error
    assert [i.step for i in choose.list_checkpoints(s3.url(RUN))] == []


def test_the_checkpoints_table_of_a_prefix_on_s3(s3: Bucket) -> None:
    _write(s3, 10, grade=6)
    bad = _write(s3, 20, grade=4)
    key = f"{RUN}/{ckpt.checkpoint_name(20, 1)}"
    s3.put(key, b"\x00" + s3.get(key)[1:])
    listed = choose.list_checkpoints(s3.url(RUN))
    verified: dict[str, str | None] = {}
    for info in listed:  # what `spikeguard checkpoints` does with RUN_DIR/checkpoints
        try:
            choose.verify(info)
            verified[info.path] = None
        except CheckpointError as e:
            verified[info.path] = str(e)
    table = rows(listed, listed.problems, listed.incomplete, verified, [])
    lines = render(table).splitlines()
    by_step = {line.split()[0]: line for line in lines[1:-1]}
    assert list(by_step) == ["10", "20"]
    assert "verified" in by_step["10"] and "S6" in by_step["10"] and "2.1000" in by_step["10"]
    assert "corrupt (" in by_step["20"] and "sha256 mismatch" in by_step["20"]
    assert [r.path for r in table] == [s3.url(f"{RUN}/{ckpt.checkpoint_name(10, 1)}"), bad.path]


def test_an_absent_prefix_is_empty_and_a_missing_bucket_is_a_problem(s3: Bucket) -> None:
    absent = choose.list_checkpoints(s3.url("no/such/prefix"))
    assert absent == [] and absent.problems == []
    url = f"s3://{s3.name}-missing/run"
    missing = choose.list_checkpoints(url)
    assert missing == [] and missing.problems == [
        (url, f"cannot list the directory: [Errno 19] the bucket does not exist: '{url}'")
    ]


def test_slowdown_is_retried_with_backoff(s3: Bucket, s3_throttle: Throttle) -> None:
    s3_throttle.fail_next(3)
    info = _write(s3, 10)  # botocore's adaptive retries absorb the three 503s
    assert s3_throttle.throttled == 3
    [listed] = choose.list_checkpoints(s3.url(RUN))
    choose.verify(listed)
    assert listed.sha256 == info.sha256


def test_a_store_that_keeps_throttling_fails_naming_the_url(
    s3: Bucket, s3_throttle: Throttle, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spikeguard.workers.checkpoint.fsspec_storage import S3FS_TRIES

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # the standard variable, read by the storage
    url = s3.url(f"{RUN}/{ckpt.checkpoint_name(10, 1)}.json")
    s3_throttle.fail_next(1000)
    with pytest.raises(OSError) as failed:
        storage.storage_for(url).publish_bytes(url, b"{}")
    assert failed.value.filename == url and "reduce your request rate" in str(failed.value)
    assert not isinstance(failed.value, FileExistsError)
    assert SECRET_KEY not in str(failed.value) and failed.value.__cause__ is None
    assert s3_throttle.throttled == 2 * S3FS_TRIES  # each try: botocore's 2 attempts
    with pytest.raises(CheckpointError) as write_failed:
        _write(s3, 10)
    assert s3.url(RUN) in str(write_failed.value) and SECRET_KEY not in str(write_failed.value)
    s3_throttle.fail_next(0)
    assert s3.objects() == []  # nothing was published, nothing left behind
    _write(s3, 10)  # the store is back: the same write goes through


def test_an_unreachable_store_is_an_error_not_an_empty_directory(
    s3: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3server import _free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nobody there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = s3.url(RUN)
    with pytest.raises(OSError) as failed:
        storage.storage_for(url).listdir(url)
    assert not isinstance(failed.value, FileNotFoundError) and failed.value.filename == url
    assert SECRET_KEY not in str(failed.value)
    listed = choose.list_checkpoints(url)
    assert listed == [] and listed.problems[0][0] == url
    assert "cannot list the directory" in listed.problems[0][1]
    with pytest.raises(OSError):
        storage.storage_for(url).exists(url + "/x")  # never "absent" when it cannot tell
