"""The checkpoint storage seam (workers/checkpoint/storage.py): a throw-away in-memory backend
registered for a made-up ``mem://`` scheme holds a run's checkpoints, and listing, verification,
selection, loading, retention, removal and the publication of a commit marker all go through it.
The checkpoints exist only in the backend (the files they were made from are deleted first), so
any code path that bypassed the seam and used ``os`` would find nothing."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import choose, commit, remove, retention, storage, trainer_commit
from spikeguard.workers.checkpoint.format import CorruptCheckpointError

ROOT = "mem://bucket/run/checkpoints"


class MemStorage:
    """A place that is a dict: {url: bytes} for files, a set of directories, and entries of
    another kind (a symlink, a FIFO) to be hostile with. Records every call, in order."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = set()
        self.odd: dict[str, storage.Kind] = {}
        self.calls: list[tuple[str, str]] = []

    def _call(self, method: str, path: str) -> None:
        self.calls.append((method, path))

    def _is_dir(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return path in self.dirs or any(p.startswith(prefix) for p in [*self.files, *self.dirs])

    def _absent(self, path: str) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, "No such object", path)

    def listdir(self, directory: str) -> list[storage.Entry]:
        self._call("listdir", directory)
        if directory in self.files:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", directory)
        if not self._is_dir(directory):
            raise self._absent(directory)
        prefix = directory.rstrip("/") + "/"
        names = {
            p[len(prefix) :].split("/", 1)[0]
            for p in [*self.files, *self.dirs, *self.odd]
            if p.startswith(prefix)
        }
        return [storage.Entry(name=n, **vars(self._stat(prefix + n))) for n in sorted(names)]

    def _stat(self, path: str) -> storage.Stat:
        if path in self.files:
            return storage.Stat(kind="file", size=len(self.files[path]))
        if path in self.odd:
            return storage.Stat(kind=self.odd[path])
        if self._is_dir(path):
            return storage.Stat(kind="dir")
        raise self._absent(path)

    def stat(self, path: str) -> storage.Stat:
        self._call("stat", path)
        return self._stat(path)

    def exists(self, path: str) -> bool:
        self._call("exists", path)
        return path in self.files or path in self.odd or self._is_dir(path)

    def open_read(self, path: str) -> BinaryIO:
        self._call("open_read", path)
        storage.require_file(path, self._stat(path))
        return io.BytesIO(self.files[path])

    def read_bytes(self, path: str, limit: int) -> bytes:
        with self.open_read(path) as f:
            return f.read(limit)

    def sha256(self, path: str) -> tuple[str, int]:
        with self.open_read(path) as f:
            return storage.hash_stream(f)

    def make_dirs(self, directory: str) -> None:
        self.dirs.add(directory)

    @contextlib.contextmanager
    def create(self, path: str) -> Iterator[BinaryIO]:
        self._call("create", path)
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, "exists", path)
        buffer = io.BytesIO()
        yield buffer
        self.files[path] = buffer.getvalue()

    def publish(self, temp: str, final: str) -> None:
        self._call("publish", final)
        if final in self.files:
            raise FileExistsError(errno.EEXIST, "exists", final)
        self.files[final] = self.files.pop(temp)

    def publish_bytes(self, final: str, data: bytes) -> None:
        self._call("publish_bytes", final)
        if final in self.files:
            raise FileExistsError(errno.EEXIST, "exists", final)
        self.files[final] = data

    def remove_file(self, path: str) -> bool:
        self._call("remove_file", path)
        return self.files.pop(path, None) is not None or self.odd.pop(path, None) is not None

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> None:
        self._call("remove_tree", path)
        prefix = path.rstrip("/") + "/"
        for p in [p for p in self.files if p.startswith(prefix)]:
            del self.files[p]
        self.dirs = {d for d in self.dirs if d != path and not d.startswith(prefix)}

    def sync(self, directory: str) -> None:
        self._call("sync", directory)

    def names(self) -> list[str]:
        """Every file, relative to :data:`ROOT`."""
        return sorted(p[len(ROOT) + 1 :] for p in self.files)


@pytest.fixture
def mem() -> Iterator[MemStorage]:
    backend = MemStorage()
    storage.register("mem")(lambda: backend)
    try:
        yield backend
    finally:
        storage.unregister("mem")


def _upload(local: Path, backend: MemStorage) -> None:
    """Copy the checkpoint directory ``local`` into ``backend`` under :data:`ROOT`, then delete
    it: from then on the checkpoints exist only in the backend."""
    for path in sorted(local.rglob("*")):
        url = f"{ROOT}/{path.relative_to(local).as_posix()}"
        if path.is_dir():
            backend.dirs.add(url)
        else:
            backend.files[url] = path.read_bytes()
    shutil.rmtree(local)


@pytest.fixture
def run(tmp_path: Path, mem: MemStorage) -> MemStorage:
    """Two replicated checkpoints (steps 10 and 20, graded 6 and 3), a sharded one (step 30,
    graded 5) and an unfinished sharded save of an older generation, in the backend only."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    local = tmp_path / "checkpoints"
    local.mkdir()
    for step, grade in ((10, 6), (20, 3)):
        ckpt.write_checkpoint(
            local,
            {"w": torch.full((4,), float(step))},
            step=step,
            generation=2,
            meta={"grade": grade},
        )
    msd, _ = get_state_dict(torch.nn.Linear(2, 2), [])
    ckpt.ShardedWriter().save(
        local, {"model": msd}, step=30, generation=2, rank_meta={"grade": 5, "loss": 1.5}, meta={}
    )
    unfinished = local / ckpt.sharded_name(25, 1)
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"z" * 10)
    _upload(local, mem)
    mem.calls.clear()
    return mem


def test_storage_is_found_by_url_scheme(tmp_path: Path) -> None:
    for plain in (str(tmp_path), "relative/dir", f"file://{tmp_path}", f"FILE://{tmp_path}"):
        assert isinstance(storage.storage_for(plain), storage.PosixStorage), plain
    assert storage.scheme_of("s3://bucket/prefix") == "s3"
    with pytest.raises(storage.UnknownScheme, match="nope://"):
        storage.storage_for("nope://bucket/x")
    listed = choose.list_checkpoints("nope://bucket/x")  # never raises: a problem instead
    assert listed == [] and "no checkpoint storage" in listed.problems[0][1]


def test_a_file_url_is_a_posix_directory(tmp_path: Path) -> None:
    info = ckpt.write_checkpoint(tmp_path, {"w": torch.ones(2)}, step=1, generation=1, meta={})
    for scheme in ("file", "FILE"):
        listed = choose.list_checkpoints(f"{scheme}://{tmp_path}")
        assert [i.path for i in listed] == [f"{scheme}://{info.path}"]
        choose.verify(listed[0])


def test_listing_goes_through_the_backend(run: MemStorage) -> None:
    listed = choose.list_checkpoints(ROOT)
    assert [(i.step, i.kind) for i in listed] == [
        (10, "replicated"),
        (20, "replicated"),
        (30, "sharded"),
    ]
    assert all(i.path.startswith(ROOT + "/") for i in listed)
    assert [(i.step, i.kind, i.size) for i in listed.incomplete] == [(25, "sharded", 10)]
    assert ("listdir", ROOT) in run.calls
    assert ("open_read", listed[0].meta_path) in run.calls  # the sidecar was read from it
    assert ckpt.list_checkpoints(f"{ROOT}/absent") == []  # an absent prefix holds nothing


def test_verify_select_and_load_go_through_the_backend(run: MemStorage) -> None:
    listed = choose.list_checkpoints(ROOT)
    for info in listed:
        choose.verify(info)
    state = ckpt.load_checkpoint(listed[0])  # a rank's load, read from the backend
    assert torch.equal(state["w"], torch.full((4,), 10.0))
    shard = f"{listed[2].path}/__0_0.distcp"
    run.files[shard] = b"\x00" + run.files[shard][1:]  # same size, other bytes
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch"):
        choose.verify(listed[2])
    chosen, skipped = choose.select_checkpoint(listed, min_grade=4, before_step=None)
    assert chosen is not None and chosen.step == 10
    assert [(i.step, why.split(":")[0]) for i, why in skipped] == [
        (30, "failed verification"),
        (20, "grade 3 < min_grade 4"),
    ]


def test_hostile_entries_in_the_backend_are_problems(run: MemStorage) -> None:
    first = f"{ROOT}/{ckpt.checkpoint_name(10, 2)}"
    del run.files[first]
    run.odd[first] = "other"  # a FIFO where the data file was: refused, never opened
    second = f"{ROOT}/{ckpt.checkpoint_name(20, 2)}.json"
    del run.files[second]
    run.odd[second] = "symlink"  # never followed
    listed = choose.list_checkpoints(ROOT)
    problems = dict(listed.problems)
    assert [i.step for i in listed] == [30]
    assert problems[first + ".json"] == f"data file {first} is not a plain file, not a regular file"
    assert "symbolic link" in problems[second]
    assert ("open_read", first) not in run.calls


def test_retention_and_removal_go_through_the_backend(run: MemStorage) -> None:
    listed = choose.list_checkpoints(ROOT)
    verdicts = retention.decide(
        listed,
        listed.incomplete,
        retention.RetentionSettings(keep_last=1, keep_healthy=0),
        protected=(),
        lineage=None,
        generation=2,
    )
    deleted = [v.path for v in verdicts if not v.keep]
    assert sorted(os.path.basename(p) for p in deleted) == [
        ckpt.checkpoint_name(10, 2),
        ckpt.checkpoint_name(20, 2),
        ckpt.sharded_name(25, 1),
    ]
    run.calls.clear()
    for path in deleted:
        remove.remove_checkpoint(path)
    assert run.names() == sorted(
        f"{ckpt.sharded_name(30, 2)}/{n}" for n in ("__0_0.distcp", ".metadata", commit.COMMIT_NAME)
    )
    removals = [(m, p) for m, p in run.calls if m.startswith("remove")]
    data = f"{ROOT}/{ckpt.checkpoint_name(10, 2)}"
    assert removals.index(("remove_file", data + ".json")) < removals.index(("remove_file", data))
    sharded = f"{ROOT}/{ckpt.sharded_name(30, 2)}"
    remove.remove_checkpoint(sharded)
    assert run.calls[-4:] == [
        ("remove_file", f"{sharded}/{commit.COMMIT_NAME}"),  # the marker first
        ("sync", sharded),
        ("remove_tree", sharded),
        ("sync", ROOT),
    ]
    assert run.files == {} and choose.list_checkpoints(ROOT) == []


def test_a_commit_marker_is_published_through_the_backend(mem: MemStorage) -> None:
    directory = f"{ROOT}/checkpoint-7"
    mem.files[f"{directory}/model.safetensors"] = b"weights" * 100
    mem.files[f"{directory}/trainer_state.json"] = b"{}"
    info = trainer_commit.commit_trainer_dir(
        directory,
        step=7,
        generation=1,
        world_size=1,
        ranks=[{"rank": 0, "grade": 6, "loss": 0.5}],
        meta={},
    )
    assert ("publish_bytes", f"{directory}/{commit.COMMIT_NAME}") in mem.calls
    [listed] = choose.list_checkpoints(ROOT)
    assert listed.kind == commit.TRAINER_LAYOUT and listed.sha256 == info.sha256
    assert trainer_commit.verify_for_resume(directory, info.sha256).step == 7
    assert trainer_commit.retract(directory)
    assert choose.list_checkpoints(ROOT) == []


def test_temp_files_are_cleaned_through_the_backend(mem: MemStorage) -> None:
    stale = f"{ROOT}/{storage.TMP_PREFIX}{ckpt.checkpoint_name(3, 1)}-12345"
    mem.files[stale] = b"partial"
    mem.files[f"{ROOT}/{ckpt.checkpoint_name(3, 1)}"] = b"kept"
    assert ckpt.clean_temp_files(ROOT) == [stale]
    assert mem.names() == [ckpt.checkpoint_name(3, 1)]
