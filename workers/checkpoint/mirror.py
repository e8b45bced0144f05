"""Committed checkpoint directories between a local disk and a remote store. Torch-free.

A training framework writes its checkpoint directory with ``os`` (a Hugging Face ``Trainer``'s
``checkpoint-N``): it cannot write to ``s3://``. So under a remote checkpoint directory the
framework writes into a local *staging* directory, spikeguard commits it there as it always does
(:mod:`.trainer_commit`), and then:

* :func:`publish_tree` uploads the committed directory to the store: every file its commit marker
  lists, each written once (:meth:`~.storage.Storage.create`: on an object store an upload that
  completes when the file is whole, conditional on the name being free) and hashed as it streams
  against the marker, then the marker itself, last (:meth:`~.storage.Storage.publish_bytes`).
  The remote checkpoint exists once its marker does: an upload that fails, or is killed, leaves
  no marker (and a failure removes what it uploaded), so no listing offers it. What it uploaded
  is the committed checkpoint byte for byte, marker included: its checksum (the sha256 of the
  marker) is the same, and :func:`~.choose.verify_sharded` passes on the store.
* :func:`pull_tree` downloads one back on a resume: the marker first, checked against the resume
  plan's checksum, then the store's directory is refused if it holds anything the marker does
  not list (:func:`~.commit.refuse_unlisted`), then each listed file is hashed as it streams to a
  temp name and compared with the marker (:func:`~.integrity.check_hashed`) before it is renamed
  into place, the marker last. The ranks of one node pull into the same directory, one at a
  time (a lock beside it): the first downloads, the others find it there and verify it; a copy
  an earlier generation kept on the node (``keep_staged``) is moved into place and verified
  instead of downloaded.

A replicated checkpoint (one ``.pt`` and its sidecar, :mod:`.write`) needs none of this: it is
written straight to the store through the :class:`~.storage.Storage`.

The staging directory (:func:`staging_dir`) is one per run, remote directory and generation, so
that the ranks of a node share it (a Trainer's ranks each write their ``rng_state_R.pth`` into the
same ``checkpoint-N``) and a replaced generation never writes into the next one's; what is left
in it is removed by :func:`prune_staging` and :func:`prune_generations`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from . import choose, commit
from .format import CheckpointError, CheckpointInfo, CorruptCheckpointError
from .integrity import check_hashed
from .storage import (
    NotRegularFile,
    PosixStorage,
    Storage,
    hash_stream,
    remove_quietly,
    scheme_of,
    stat_file,
    storage_for,
    temp_name,
)

__all__ = [
    "LOCK_PREFIX",
    "STAGE_SUBDIR",
    "prune_generations",
    "prune_staging",
    "publish_tree",
    "pull_tree",
    "staged_to_remove",
    "staging_dir",
]

STAGE_SUBDIR = "spikeguard-stage"
"""The directory under the default staging root (the temp directory: ``$TMPDIR``) that holds
every run's staging directories."""
LOCK_PREFIX = ".spikeguard-pull-"
"""The start of the lock file's name beside a directory being pulled (``.spikeguard-pull-
checkpoint-20.lock``): the ranks of a node take turns."""
_GEN_RE = re.compile(r"^gen(\d{3,})$")
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]+")


class _Tee:
    """A readable view of ``source`` that writes every chunk it reads to ``sink``: what
    :func:`~.storage.hash_stream` reads, so that one pass copies and hashes."""

    def __init__(self, source: BinaryIO, sink: BinaryIO) -> None:
        self._source = source
        self._sink = sink

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes of ``source``, written to ``sink`` too."""
        chunk = self._source.read(size)
        if chunk:
            self._sink.write(chunk)
        return chunk


def _check_names(source: str, destination: str) -> str:
    """The checkpoint directory's name, the last component of both ``source`` and
    ``destination`` (its marker names it); :class:`CheckpointError` otherwise."""
    name = os.path.basename(source.rstrip("/"))
    if os.path.basename(destination.rstrip("/")) != name or not commit.is_committed_dir_name(name):
        raise CheckpointError(
            f"{source} -> {destination}: both must be the same committed directory name "
            "(checkpoint-N, ckpt-step...-gen....dcp)"
        )
    return name


def _local_storage(path: str) -> Storage:
    """The storage of the local directory ``path`` (a plain path); :class:`CheckpointError`
    for a URL."""
    if scheme_of(path):
        raise CheckpointError(f"{path}: the local side of a mirror must be a plain path")
    return PosixStorage()


# -- publishing ---------------------------------------------------------------------------------
def _clear_remote(remote: Storage, remote_dir: str, generation: int) -> None:
    """Make room at ``remote_dir`` for the checkpoint of ``generation``: nothing there is
    nothing to do; objects without a marker (an upload that was killed) are removed; a
    committed checkpoint of an older generation (an abandoned one's save of the same step: what
    the Trainer overwrites in its own directory too) is retracted, marker first, then removed.
    One of this generation or a newer one, or one whose marker cannot be read, is refused."""
    try:
        st = remote.stat(remote_dir)
    except FileNotFoundError:
        return
    if st.kind != "dir":
        raise CheckpointError(f"refusing to replace {remote_dir}: it is {st.what}")
    try:
        raw = commit.read_marker_bytes(remote_dir, storage=remote)
    except FileNotFoundError:
        remote.remove_tree(remote_dir)  # an interrupted upload: never listed, never verified
        return
    existing = commit.parse_marker(remote_dir, raw)  # CorruptCheckpointError: left alone
    if existing.generation >= generation:
        raise CheckpointError(
            f"refusing to overwrite {remote_dir}: committed by generation "
            f"{existing.generation} (publishing generation {generation})"
        )
    remote.remove_file(existing.meta_path)  # unlisted from here on
    remote.remove_tree(remote_dir)


def _upload(local: Storage, remote: Storage, src: str, dst: str, sha256: str, size: int) -> None:
    """Write the local file ``src`` once as ``dst``, hashed as it streams; an upload whose bytes
    are not the marker's (``sha256``, ``size``) is aborted inside the write (never completed)."""
    with local.open_read(src) as f, remote.create(dst) as out:
        actual, n_bytes = hash_stream(_Tee(f, out))  # type: ignore[arg-type]
        check_hashed(src, actual, n_bytes, [("commit marker", sha256)], size)


def publish_tree(
    local_dir: str | os.PathLike[str],
    remote_dir: str | os.PathLike[str],
    *,
    fence: Callable[[], None] | None = None,
) -> CheckpointInfo:
    """Upload the committed local checkpoint directory ``local_dir`` to ``remote_dir`` (same
    last component: ``…/checkpoint-20``); see the module docstring. Returns the remote
    checkpoint (its path the URL, its checksum the local one's).

    The local directory must hold a valid marker and nothing it does not list. What is at
    ``remote_dir`` already: see :func:`_clear_remote`. ``fence`` is called right before the
    marker is published; its exception propagates unchanged and nothing is published. Any other
    failure raises :class:`CheckpointError` naming the URL, after removing what this call
    uploaded (best effort: a killed process leaves objects without a marker, which no listing
    offers and the next publication of the same directory removes).
    """
    local_dir, remote_dir = os.fspath(local_dir), os.fspath(remote_dir).rstrip("/")
    _check_names(local_dir, remote_dir)
    local = _local_storage(local_dir)
    try:
        raw = commit.read_marker_bytes(local_dir, storage=local)
    except FileNotFoundError:
        raise CheckpointError(f"{local_dir} is not committed: no commit marker") from None
    staged = commit.parse_marker(local_dir, raw)
    commit.refuse_unlisted(staged, storage=local)
    remote = storage_for(remote_dir)
    created: list[str] = []
    fenced = False
    try:
        _clear_remote(remote, remote_dir, staged.generation)
        remote.make_dirs(remote_dir)
        for name, sha256, size in staged.files:
            dst = os.path.join(remote_dir, name)
            created.append(dst)  # a failed create may leave it (POSIX): removed below
            _upload(local, remote, os.path.join(local_dir, name), dst, sha256, size)
        info = commit.parse_marker(remote_dir, raw)
        commit.refuse_unlisted(info, storage=remote)  # nobody else's object beside ours
        if fence is not None:
            fenced = True
            fence()
            fenced = False
        remote.publish_bytes(info.meta_path, raw)  # (on POSIX it fsyncs the directory too)
        return info
    except BaseException as e:
        for path in reversed(created):
            remove_quietly(remote, path)
        if fenced or not isinstance(e, Exception):
            raise
        if isinstance(e, FileExistsError):
            raise CheckpointError(
                f"publishing {remote_dir} failed: {e.filename} appeared meanwhile (another "
                "writer of the same checkpoint)"
            ) from None
        raise CheckpointError(f"publishing {remote_dir} failed: {e}") from e


# -- pulling ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _turn(local_dir: str) -> Iterator[None]:
    """Hold the lock of ``local_dir`` (a file beside it): the ranks of one node pull it one at
    a time."""
    parent = os.path.dirname(local_dir) or "."
    os.makedirs(parent, exist_ok=True)
    lock = os.path.join(parent, f"{LOCK_PREFIX}{os.path.basename(local_dir)}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _already_there(local: Storage, local_dir: str, expected_sha256: str) -> bool:
    """Whether ``local_dir`` already is the checkpoint of ``expected_sha256`` (pulled by another
    rank of this node, or staged here by this generation), verified as the supervisor verifies
    one. Anything else there is removed."""
    if not os.path.lexists(local_dir):
        return False
    try:
        raw = commit.read_marker_bytes(local_dir, storage=local)
        if hashlib.sha256(raw).hexdigest() == expected_sha256.lower():
            choose.verify_sharded(commit.parse_marker(local_dir, raw), storage=local)
            return True
    except (CheckpointError, OSError):
        pass
    if os.path.islink(local_dir) or not os.path.isdir(local_dir):
        os.unlink(local_dir)
    else:
        local.remove_tree(local_dir)
    return False


def _download(remote: Storage, local: Storage, src: str, dst: str, sha256: str, size: int) -> None:
    """The object ``src`` to the local file ``dst``: its size checked first (no download of an
    object of the wrong size), then streamed to a temp name while hashed, compared with the
    marker, and only then renamed into place."""
    try:
        st = stat_file(remote, src)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{src}, listed in its commit marker, is missing") from None
    except NotRegularFile as e:
        raise CorruptCheckpointError(str(e)) from None
    if st.size != size:
        raise CorruptCheckpointError(
            f"size mismatch: {src} has {st.size} bytes, its commit marker says {size}"
        )
    temp = temp_name(dst)
    try:
        with remote.open_read(src) as f, local.create(temp) as out:
            actual, n_bytes = hash_stream(_Tee(f, out))  # type: ignore[arg-type]
        check_hashed(src, actual, n_bytes, [("commit marker", sha256)], size)
        local.publish(temp, dst)
    except BaseException:
        remove_quietly(local, temp)
        raise


def _remote_marker(remote: Storage, remote_dir: str) -> bytes:
    """The bytes of ``remote_dir``'s commit marker; :class:`CorruptCheckpointError` naming it
    when there is none, or it cannot be read (:func:`~.commit.read_marker_bytes`)."""
    try:
        return commit.read_marker_bytes(remote_dir, storage=remote)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{remote_dir} has no commit marker (an interrupted or unfinished upload)"
        ) from None


def _adopt(reuse: Sequence[str], local_dir: str, expected_sha256: str) -> None:
    """Move the first of the local directories ``reuse`` whose marker has ``expected_sha256``
    to ``local_dir`` (a rename: the same filesystem), if any; it is verified there."""
    for candidate in reuse:
        try:
            raw = commit.read_marker_bytes(candidate, storage=PosixStorage())
            if hashlib.sha256(raw).hexdigest() == expected_sha256.lower():
                os.rename(candidate, local_dir)
                return
        except (CheckpointError, OSError):
            continue


def pull_tree(
    remote_dir: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    expected_sha256: str | None,
    *,
    reuse: Sequence[str] = (),
) -> str:
    """Download the committed checkpoint ``remote_dir`` into ``local_dir`` (a plain path, same
    last component), verified against ``expected_sha256`` (the resume plan's checksum); see the
    module docstring. Returns ``local_dir``.

    A ``local_dir`` that already holds that checkpoint and verifies is used as it is; so is the
    first of the local directories ``reuse`` (copies an earlier generation kept on this node:
    :func:`earlier_copies`) that holds it, moved there; anything else at ``local_dir`` is
    removed first. Raises :class:`CorruptCheckpointError` (no marker, another
    checksum, an unlisted object, a listed one missing, of the wrong size or bytes) or
    :class:`CheckpointError` (no checksum; the store cannot be read: naming the URL), leaving
    nothing at ``local_dir``.
    """
    remote_dir, local_dir = os.fspath(remote_dir).rstrip("/"), os.fspath(local_dir)
    _check_names(remote_dir, local_dir)
    if expected_sha256 is None:
        raise CheckpointError(f"no checksum for {remote_dir} in the resume plan")
    local = _local_storage(local_dir)
    remote = storage_for(remote_dir)
    try:
        with _turn(local_dir):
            if not os.path.lexists(local_dir):
                _adopt(reuse, local_dir, expected_sha256)
            if not _already_there(local, local_dir, expected_sha256):
                _pull(remote, local, remote_dir, local_dir, expected_sha256)
    except CheckpointError:
        raise
    except OSError as e:  # the store or the local disk: not the checkpoint's fault
        raise CheckpointError(f"pulling {remote_dir} into {local_dir} failed: {e}") from e
    return local_dir


def _pull(
    remote: Storage, local: Storage, remote_dir: str, local_dir: str, expected_sha256: str
) -> None:
    """:func:`pull_tree`'s download (its lock held, nothing at ``local_dir``): the marker,
    checked; the listing, checked; each file; the marker last. Whatever it put at
    ``local_dir`` is removed again on a failure."""
    raw = _remote_marker(remote, remote_dir)
    info = commit.parse_marker(remote_dir, raw)
    if info.sha256 != expected_sha256.lower():
        raise CorruptCheckpointError(
            f"commit marker {info.meta_path}: sha256 {info.sha256}, expected "
            f"{expected_sha256} (not the checkpoint the plan names)"
        )
    commit.refuse_unlisted(info, storage=remote)
    os.makedirs(local_dir)
    try:
        for name, sha256, size in info.files:
            src = os.path.join(remote_dir, name)
            try:
                _download(remote, local, src, os.path.join(local_dir, name), sha256, size)
            except CheckpointError:
                raise
            except OSError as e:
                raise CheckpointError(f"pulling {src} failed: {e}") from e
        local.publish_bytes(os.path.join(local_dir, commit.COMMIT_NAME), raw)
    except BaseException:
        local.remove_tree(local_dir, ignore_errors=True)
        raise


# -- the staging directory ----------------------------------------------------------------------
def staging_dir(root: str, remote: str, *, run_id: str, generation: int) -> str:
    """Where a generation's ranks on one node stage the checkpoints of ``remote``:
    ``ROOT/RUN-HASH/genNNN`` (``HASH``: of the remote directory, so that two runs of the same
    name, or a run without a supervisor, never share one). Pure."""
    digest = hashlib.sha256(remote.rstrip("/").encode()).hexdigest()[:12]
    run = _UNSAFE_RE.sub("_", run_id)[:64].strip("._") or "run"
    return os.path.join(root, f"{run}-{digest}", f"gen{generation:03d}")


def _step_of(name: str) -> int | None:
    """The step of a committed directory's name (a Trainer's or a sharded one), or None."""
    trainer = commit.parse_trainer_name(name)
    if trainer is not None:
        return trainer
    sharded = commit.parse_sharded_name(name)
    return None if sharded is None else sharded[0]


def staged_to_remove(
    staged: Sequence[tuple[str, bool]], *, busy: int | None, keep: int
) -> list[str]:
    """Which of the ``staged`` (name, committed) checkpoint directories to remove: all but the
    one of step ``busy`` (being written or published by another rank now; None: none) and the
    newest ``keep`` committed ones. Names that are no checkpoint's are never chosen. Pure."""
    steps = {name: step for name, _ in staged if (step := _step_of(name)) is not None}
    committed = sorted(
        (name for name, done in staged if done and name in steps and steps[name] != busy),
        key=lambda name: steps[name],
        reverse=True,
    )
    kept = set(committed[: max(keep, 0)])
    return sorted(
        (name for name, step in steps.items() if step != busy and name not in kept),
        key=lambda name: steps[name],
    )


def prune_staging(directory: str, *, busy: int | None, keep: int) -> list[str]:
    """Remove the staged checkpoint directories :func:`staged_to_remove` chooses in
    ``directory`` (best effort: another rank of the node may be removing them too). Returns
    their paths."""
    storage = _local_storage(directory)
    try:
        entries = storage.listdir(directory)
    except OSError:
        return []
    staged = [
        (e.name, os.path.lexists(os.path.join(directory, e.name, commit.COMMIT_NAME)))
        for e in entries
        if e.kind == "dir"
    ]
    removed = []
    for name in staged_to_remove(staged, busy=busy, keep=keep):
        path = os.path.join(directory, name)
        storage.remove_tree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _earlier_generations(directory: str) -> list[str]:
    """The staging directories of the generations before the one of ``directory`` (a
    :func:`staging_dir`), newest first."""
    match = _GEN_RE.match(os.path.basename(directory.rstrip("/")))
    if match is None:
        return []
    run_root, current = os.path.dirname(directory.rstrip("/")), int(match[1])
    try:
        names = os.listdir(run_root)
    except OSError:
        return []
    older = [(int(m[1]), name) for name in names if (m := _GEN_RE.match(name)) is not None]
    return [
        os.path.join(run_root, name) for gen, name in sorted(older, reverse=True) if gen < current
    ]


def earlier_copies(directory: str, name: str) -> list[str]:
    """The checkpoint directories ``name`` that earlier generations staged beside the staging
    directory ``directory`` (kept there by ``keep_staged``), newest generation first: what
    :func:`pull_tree` may reuse instead of downloading."""
    return [
        path
        for generation in _earlier_generations(directory)
        if os.path.isdir(path := os.path.join(generation, name))
    ]


def prune_generations(directory: str) -> list[str]:
    """Remove the staging directories of the generations before the one of ``directory`` (a
    :func:`staging_dir`): what a replaced generation left on this node. Call it once this
    generation runs (never in a standby still waiting: the generation before it is training).
    Returns their paths, oldest first."""
    removed = _earlier_generations(directory)[::-1]
    for path in removed:
        PosixStorage().remove_tree(path, ignore_errors=True)
    return removed
