"""Sharded checkpoints: every rank writes its shard with ``torch.distributed.checkpoint`` (DCP),
then rank 0 commits them. Needs torch.

:class:`ShardedWriter` is one rank's side of it; every rank calls :meth:`ShardedWriter.save` at
the same step with its own state dict (an FSDP2 model's DTensors, usually from
``torch.distributed.checkpoint.state_dict.get_state_dict``). A save goes through four stages,
each one collective, so every rank gets the same outcome:

1. **Pre-flight** (control group): each rank checks its state dict (non-tensor values must load
   with ``weights_only=True``), its metadata and the fence; the outcomes are gathered, and if any
   rank cannot save, every rank raises before anything is written. An existing directory of the
   same name is never overwritten.
2. **Write**: ``dcp.save`` (or ``dcp.async_save``) into ``ckpt-step…-gen….dcp/`` through
   :func:`.dcp_storage.writer_for`: on a plain path each rank writes and fsyncs its shard, rank 0
   the ``.metadata``; on an object store (``s3://``) each file is one write-once upload straight
   from the rank. Every byte goes through sha256 on its way out.
3. **Gather**: each rank removes the data files DCP opened for it but left empty and
   unreferenced (a rank with nothing to write); the hashes of the files it wrote itself
   (``__{rank}_*.distcp``; rank 0 also ``.metadata``), taken as it wrote them, the rank's grade
   and loss are gathered on rank 0 (one small gather). Nothing is read back: not from the page
   cache, not over the network.
4. **Commit** (rank 0): every file DCP's metadata refers to must have been hashed; the fence is
   checked once more (a replaced generation never commits); the commit marker (:mod:`.commit`)
   is published write-once, last (on POSIX a temp file, fsync, a link, the directory fsynced; on
   an object store one conditional PUT). Its text is broadcast, so every rank returns the same
   :class:`~.format.CheckpointInfo`; a directory without a marker is never listed or chosen.

A failure after the write started (a rank's write failed, a disk filled up, hashing failed, the
fence) raises :class:`CheckpointError` on every rank, and rank 0 removes the directory: every
rank has reached the gather by then, so no rank is still writing into it. A rank that dies
mid-save leaves its peers failing in a collective (the job crashes; the supervisor rolls back):
the directory stays without a marker, is never selected, and the supervisor removes it once that
generation is replaced (:mod:`.retention`). Nobody else removes a directory without a marker: a
save may still be running in it.

Two dedicated gloo groups carry spikeguard's own collectives, created on every rank at the first
sharded call (all ranks make that call at the same step): the *control* group for the pre-flight,
synchronous saves and coordinated checkpoint requests, on the training thread; the *background*
group for ``dcp.async_save`` and its commit, on a background thread. So spikeguard's collectives
never interleave with the training's (NCCL or gloo), nor the background ones with the
foreground ones. At most one asynchronous save is in flight: the next save (and
:meth:`ShardedWriter.wait`, called by ``Session.close``) waits for it and raises its error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.tensor import DTensor

from . import commit
from . import write as _write
from .dcp_storage import Written, writer_for
from .format import CheckpointError, CheckpointInfo
from .integrity import hash_file
from .storage import storage_for

_CHECKPOINT_EXCEPTION = getattr(
    getattr(dcp, "api", None), "CheckpointException", None
)  # a BaseException in torch 2.13


class PendingSave:
    """An asynchronous sharded save in flight; :meth:`result` waits for its commit."""

    def __init__(self, future: concurrent.futures.Future[CheckpointInfo], path: str) -> None:
        self._future = future
        self.path = path
        """The checkpoint's directory."""

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """The committed checkpoint; raises what the save raised (:class:`CheckpointError`)."""
        return self._future.result(timeout)


def _world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def quiet_single_process(distributed: bool) -> Iterator[None]:
    """Without torch.distributed, DCP warns on every call that it assumes a single process:
    that is the intent here, so the warning is not repeated."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _is_checkpoint_exception(e: BaseException) -> bool:
    return _CHECKPOINT_EXCEPTION is not None and isinstance(e, _CHECKPOINT_EXCEPTION)


def failures(e: BaseException) -> list[tuple[int | None, BaseException]]:
    """The exceptions behind ``e``: DCP gathers each rank's into a ``CheckpointException``
    (``failures``: {rank: (exception, traceback)}); anything else is its own."""
    found = getattr(e, "failures", None) if _is_checkpoint_exception(e) else None
    if not isinstance(found, dict):
        return [(None, e)]
    out: list[tuple[int | None, BaseException]] = []
    for rank, pair in sorted(found.items()):
        inner = pair[0] if isinstance(pair, tuple) and pair else pair
        if isinstance(inner, BaseException):
            out.append((rank, inner))
    return out or [(None, e)]


def describe_error(e: BaseException) -> str:
    """``e`` in one line (each rank's own error, for a ``CheckpointException``)."""
    parts = []
    for rank, inner in failures(e):
        text = str(inner).strip().splitlines()
        where = "" if rank is None else f"rank {rank}: "
        parts.append(f"{where}{type(inner).__name__}: {text[0] if text else ''}")
    return "; ".join(parts)


class ShardedWriter:
    """One rank's side of sharded saves: the dedicated gloo groups and the save in flight."""

    def __init__(self) -> None:
        self.rank, self.world_size = _world()
        self._control: Any = None
        self._background: Any = None
        self._pending: PendingSave | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- groups and small collectives ----------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Whether the ranks are joined by torch.distributed (with more than one rank)."""
        return self.world_size > 1

    def _groups(self) -> tuple[Any, Any]:
        """The control and background gloo groups, created on first use (a collective call)."""
        if self._control is None and self.distributed:
            self._control = dist.new_group(backend="gloo")
            self._background = dist.new_group(backend="gloo")
        return self._control, self._background

    def agree_max(self, value: int) -> int:
        """The largest ``value`` any rank passes (every rank must call it at the same point)."""
        if not self.distributed:
            return value
        control, _ = self._groups()
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
        return int(t.item())

    def all_gather(self, obj: Any, group: Any = None) -> list[Any]:
        """``obj`` of every rank, by rank, over ``group`` (default: the control group)."""
        if not self.distributed:
            return [obj]
        group = self._groups()[0] if group is None else group
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    # -- saving ----------------------------------------------------------------------------------
    def save(
        self,
        directory: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        step: int,
        generation: int,
        rank_meta: dict[str, Any],
        meta: dict[str, Any],
        fence: Callable[[], None] | None = None,
        async_save: bool = False,
        on_commit: Callable[[CheckpointInfo], None] | None = None,
    ) -> CheckpointInfo | PendingSave:
        """Save ``state`` (this rank's part) as the sharded checkpoint of ``step``.

        ``rank_meta``: this rank's ``grade``, ``loss``, ``signals_step`` and ``summary`` (the
        marker keeps every rank's grade and loss, and the worst rank's summary; its ``grade`` is
        the worst rank's, None if any rank has none). ``meta``: JSON-able fields the marker
        keeps as they are (rank 0's are used). ``fence`` raises when this rank's generation was
        replaced: checked in the pre-flight and by rank 0 right before the commit; its
        exception propagates unchanged. ``on_commit(info)`` runs on rank 0 once the marker is
        durable (on the background thread for an asynchronous save).

        Synchronous: returns the committed checkpoint. ``async_save``: returns a
        :class:`PendingSave` once the state is staged (copied to CPU memory); the write and the
        commit go on in the background. Raises :class:`CheckpointError` (on every rank) if any
        rank cannot save; a previous asynchronous save's error is raised first.
        """
        self.wait()
        directory = os.fspath(directory)
        path = os.path.join(directory, commit.sharded_name(step, generation))
        prepared, meta = self._preflight(path, state, step, generation, meta, fence)
        control, background = self._groups()
        storage_writer, written = writer_for(path)
        if not async_save:
            metadata = self._dcp(dcp.save, path, prepared, control, "writing", storage_writer)
            info = self._commit(
                path, metadata, written, step, generation, rank_meta, meta, fence, control
            )
            if on_commit is not None and self.rank == 0:
                on_commit(info)
            return info
        upload = self._dcp(dcp.async_save, path, prepared, background, "staging", storage_writer)
        upload_future = getattr(upload, "upload_completion", upload)

        def finish() -> CheckpointInfo:
            try:
                metadata = upload_future.result()
            except BaseException as e:
                if not _is_checkpoint_exception(e) and not isinstance(e, Exception):
                    raise
                self._cleanup_after_failure(path, background)
                raise CheckpointError(f"writing {path} failed: {describe_error(e)}") from e
            info = self._commit(
                path, metadata, written, step, generation, rank_meta, meta, fence, background
            )
            if on_commit is not None and self.rank == 0:
                on_commit(info)
            return info

        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="spikeguard-commit"
            )
        pending = PendingSave(self._executor.submit(finish), path)
        with self._lock:
            self._pending = pending
        return pending

    def wait(self) -> CheckpointInfo | None:
        """Wait for the asynchronous save in flight, if any; return it or raise its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.result()

    def close(self) -> None:
        """Wait for the save in flight (its error propagates) and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # -- the stages ------------------------------------------------------------------------------
    def _preflight(
        self,
        path: str,
        state: Any,
        step: int,
        generation: int,
        meta: Any,
        fence: Callable[[], None] | None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stage 1: check locally, agree collectively; every rank raises if any rank cannot."""
        problem: str | None = None
        fenced: BaseException | None = None
        prepared: Any = state
        try:
            _write._check_arguments(state, meta, step, generation, 0)
            prepared = _write._prepare(state, "state", _write._safe_classes() | {DTensor})
            meta = json.loads(json.dumps(meta, default=_write._json_default, allow_nan=True))
            if storage_for(path).exists(path):
                raise CheckpointError(f"refusing to overwrite existing {path}")
            if fence is not None:
                try:
                    fence()
                except Exception as e:
                    fenced = e
                    raise CheckpointError(f"fenced: {e}") from e
            storage_for(path).make_dirs(os.path.dirname(path) or ".")
        except RecursionError:
            problem = "state or meta contains a reference cycle (or is nested too deep)"
        except (TypeError, ValueError) as e:
            problem = f"meta is not JSON-serialisable: {e}"
        except (CheckpointError, OSError) as e:
            problem = str(e)
        problems = self.all_gather(problem, self._groups()[0])
        if fenced is not None:
            raise fenced
        failed = [(r, p) for r, p in enumerate(problems) if p is not None]
        if failed:
            where = "; ".join(f"rank {r}: {p}" for r, p in failed)
            raise CheckpointError(f"sharded checkpoint {path} not saved: {where}")
        return prepared, meta

    def _dcp(
        self,
        call: Callable[..., Any],
        path: str,
        state: dict[str, Any],
        group: Any,
        what: str,
        storage_writer: Any,
    ) -> Any:
        """``dcp.save`` or ``dcp.async_save`` of ``state`` into ``path`` over ``group`` with
        ``storage_writer`` (:func:`.dcp_storage.writer_for`'s); DCP's errors (a
        ``CheckpointException``, a ``BaseException``) become a :class:`CheckpointError`, after
        the clean-up when the write itself failed."""
        try:
            with quiet_single_process(self.distributed):
                return call(
                    state,
                    storage_writer=storage_writer,
                    process_group=group,
                    no_dist=not self.distributed,
                )
        except BaseException as e:
            if not _is_checkpoint_exception(e) and not isinstance(e, Exception):
                raise
            if what == "writing":
                self._cleanup_after_failure(path, group)
            raise CheckpointError(f"{what} {path} failed: {describe_error(e)}") from e

    def _cleanup_after_failure(self, path: str, group: Any) -> None:
        """After DCP raised on every rank: rank 0 removes the directory once every rank is past
        the write (a barrier). If the barrier fails (a rank died), the directory stays for the
        supervisor, which removes it once this generation is replaced."""
        try:
            if self.distributed:
                dist.barrier(group=group)
        except Exception:
            return
        if self.rank == 0:
            storage_for(path).remove_tree(path, ignore_errors=True)

    def _own_files(self, referenced: set[str]) -> list[str]:
        """The files of ``referenced`` this rank wrote: DCP names a rank's ``__{rank}_…``; rank 0
        also hashes ``.metadata`` and anything not named after a rank."""
        prefixes = [f"__{r}_" for r in range(self.world_size)]
        mine = []
        for name in sorted(referenced):
            owner = next((r for r, p in enumerate(prefixes) if name.startswith(p)), 0)
            if owner == self.rank:
                mine.append(name)
        return mine

    def _drop_empty_buckets(self, path: str, referenced: set[str], written: Written) -> None:
        """Remove this rank's data files that DCP created empty and no metadata refers to.

        ``FileSystemWriter`` opens one file per thread bucket whether or not anything goes in
        it, so a rank with nothing to write (its replicated tensors deduplicated onto another
        rank) leaves an empty ``__{rank}_0.distcp``. A commit marker cannot list an empty file
        (verification refuses one) and a committed directory may hold nothing unlisted
        (:func:`.commit.refuse_unlisted`): the file goes, before the gather, by its own writer,
        so the directory holds exactly what the marker lists."""
        storage = storage_for(path)
        mine = re.compile(rf"__{self.rank}_\d+{re.escape(dcp_filesystem.DEFAULT_SUFFIX)}")
        removed = False
        for name, (_, size) in written.files().items():
            if size == 0 and name not in referenced and mine.fullmatch(name):
                removed = storage.remove_file(os.path.join(path, name)) or removed
        if removed:
            storage.sync(path)

    def _hash_own(
        self, path: str, metadata: Any, written: Written
    ) -> tuple[dict[str, tuple[str, int]], str | None]:
        """Stage 3: {name: (sha256, size)} of this rank's files, or the reason it failed (its
        empty, unreferenced ones removed first: :meth:`_drop_empty_buckets`). The hashes are
        those taken as the files were written; a file this rank owns by its name but did not
        write through ``written``'s writer (a DCP that opened it some other way) is read back."""
        try:
            referenced = {info.relative_path for info in metadata.storage_data.values()}
            referenced.add(commit.DCP_METADATA_NAME)
            self._drop_empty_buckets(path, referenced, written)
            hashes = {}
            for name in self._own_files(referenced):
                if not commit.valid_file_name(name):
                    return {}, f"DCP wrote {name!r}, which a commit marker cannot list"
                hashes[name] = written.get(name) or hash_file(os.path.join(path, name))
            return hashes, None
        except Exception as e:
            return {}, f"hashing failed: {describe_error(e)}"

    def _commit(
        self,
        path: str,
        metadata: Any,
        written: Written,
        step: int,
        generation: int,
        rank_meta: dict[str, Any],
        meta: dict[str, Any],
        fence: Callable[[], None] | None,
        group: Any,
    ) -> CheckpointInfo:
        """Stages 3 and 4: gather the hashes, rank 0 writes the marker, every rank learns the
        outcome."""
        hashes, problem = self._hash_own(path, metadata, written)
        contribution = {"rank": self.rank, "files": hashes, "problem": problem, **rank_meta}
        gathered = self._gather(contribution, group)
        outcome: dict[str, Any] = {}
        if self.rank == 0:
            outcome = self._write_marker(path, metadata, step, generation, gathered, meta, fence)
        outcome = self._broadcast(outcome, group)
        if "error" in outcome:
            if outcome.get("fenced") and fence is not None:
                fence()  # this rank's own fence error, unchanged, if it is fenced too
            raise CheckpointError(outcome["error"])
        return commit.parse_marker(path, outcome["marker"].encode())

    def _gather(self, contribution: dict[str, Any], group: Any) -> list[dict[str, Any]]:
        if not self.distributed:
            return [contribution]
        out: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(contribution, out if self.rank == 0 else None, dst=0, group=group)
        return out

    def _broadcast(self, outcome: dict[str, Any], group: Any) -> dict[str, Any]:
        if not self.distributed:
            return outcome
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def _write_marker(
        self,
        path: str,
        metadata: Any,
        step: int,
        generation: int,
        gathered: list[dict[str, Any]],
        meta: dict[str, Any],
        fence: Callable[[], None] | None,
    ) -> dict[str, Any]:
        """Stage 4 on rank 0: check the gathered hashes, the fence, then publish the marker.

        Returns ``{"marker": text}`` or ``{"error": why}`` (``fenced`` when the fence refused);
        on an error the directory is removed (every rank is past its write).
        """
        problems = [f"rank {c['rank']}: {c['problem']}" for c in gathered if c.get("problem")]
        files: dict[str, tuple[str, int]] = {}
        for c in gathered:
            files.update(c["files"])
        referenced = {info.relative_path for info in metadata.storage_data.values()}
        missing = sorted(referenced - set(files))
        if missing:
            problems.append(f"files DCP wrote that no rank hashed: {missing[:5]}")
        fenced = False
        if not problems and fence is not None:
            try:
                fence()
            except Exception as e:
                fenced = True
                problems.append(f"not committed: {e}")
        if not problems:
            text = commit.marker_text(
                directory_name=os.path.basename(path),
                step=step,
                generation=generation,
                world_size=self.world_size,
                files=files,
                meta=_marker_meta(gathered, meta),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            )
            try:
                _publish_marker(path, text)
                return {"marker": text}
            except (OSError, CheckpointError) as e:
                problems.append(f"writing the commit marker failed: {e}")
        storage_for(path).remove_tree(path, ignore_errors=True)
        error = f"sharded checkpoint {path} not committed: " + "; ".join(problems)
        return {"error": error, "fenced": fenced}


def _marker_meta(gathered: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The marker's ``meta``: the worst rank's grade (None if any rank has none) and summary,
    each rank's grade and loss, rank 0's loss, and ``meta``."""
    ranks = [
        {"rank": c["rank"], "grade": c.get("grade"), "loss": c.get("loss")}
        for c in sorted(gathered, key=lambda c: c["rank"])
    ]
    grades = [c.get("grade") for c in gathered]
    worst = None
    if gathered and all(isinstance(g, int) and not isinstance(g, bool) for g in grades):
        worst = min(gathered, key=lambda c: (c["grade"], c["rank"]))
    first = min(gathered, key=lambda c: c["rank"]) if gathered else {}
    out = {
        **meta,
        "grade": worst["grade"] if worst else None,
        "worst_rank": worst["rank"] if worst else None,
        "summary": (worst or first).get("summary", {}),
        "signals_step": (worst or first).get("signals_step"),
        "loss": first.get("loss"),
        "ranks": ranks,
    }
    return json.loads(json.dumps(out, default=_write._json_default, allow_nan=True))


def _publish_marker(path: str, text: str) -> None:
    """Publish the commit marker write-once (:meth:`.storage.Storage.publish_bytes`: on POSIX a
    temp file, fsync, a link never over an existing marker, directory fsync)."""
    final = os.path.join(path, commit.COMMIT_NAME)
    try:
        storage_for(final).publish_bytes(final, text.encode())
    except FileExistsError as e:
        raise _write.refusal(e, final) from None
