"""Committing a training framework's own checkpoint directory (a Hugging Face ``Trainer``'s
``checkpoint-N``) with spikeguard's commit marker: the graded, checksummed manifest of
:mod:`.commit` (layout :data:`~.commit.TRAINER_LAYOUT`).

The framework writes its files as it always does; then rank 0 hashes every file in the directory
and publishes the marker (through the directory's :class:`~.storage.Storage`: on POSIX a temp
file, fsync, rename, directory fsync), after the fence check: a rank
of a replaced generation never publishes one. The supervisor lists, verifies and chooses such a
directory exactly as a sharded checkpoint (:mod:`.choose`), and a rank verifies it against its
resume plan's checksum before the framework loads it (:func:`verify_for_resume`).

Only a flat directory is committed (what the Trainer writes for a single-device or DDP model):
a subdirectory (FSDP's or DeepSpeed's sharded states), a symlink or any other non-regular entry
refuses the commit with :class:`~.format.CheckpointError`, so that no marker ever covers less
than the directory holds; and one added after the commit refuses the checkpoint at verification
(:func:`~.commit.refuse_unlisted`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

from . import commit
from .choose import verify_sharded
from .dcp_write import _marker_meta, _publish_marker
from .format import CheckpointError, CheckpointInfo
from .storage import Storage, storage_for


def retract(directory: str) -> bool:
    """Remove ``directory``'s commit marker, if any (before the framework writes into it again,
    e.g. a step an abandoned generation had saved too). Returns whether there was one."""
    storage = storage_for(directory)
    if not storage.remove_file(os.path.join(directory, commit.COMMIT_NAME)):
        return False
    storage.sync(directory)
    return True


def _hash_files(directory: str, storage: Storage) -> dict[str, tuple[str, int]]:
    """{name: (sha256, size)} of every file in ``directory`` but the marker and its temp files
    (:func:`~.commit.expected_unlisted`: exactly what verification lets a committed directory
    hold unlisted, so that what is committed verifies)."""
    files: dict[str, tuple[str, int]] = {}
    for entry in sorted(storage.listdir(directory), key=lambda e: e.name):
        name = entry.name
        path = os.path.join(directory, name)
        if commit.expected_unlisted(name, entry.kind):
            continue
        if entry.kind != "file":
            what = "a subdirectory" if entry.kind == "dir" else "not a regular file"
            raise CheckpointError(
                f"{path} is {what}: only flat checkpoint directories are committed"
            )
        if not commit.valid_file_name(name):
            raise CheckpointError(f"{path}: a file name the commit marker cannot list")
        files[name] = storage.sha256(path)
    if not files:
        raise CheckpointError(f"{directory} holds no file to commit")
    return files


def commit_trainer_dir(
    directory: str,
    *,
    step: int,
    generation: int,
    world_size: int,
    ranks: list[dict[str, Any]],
    meta: dict[str, Any],
    fence: Callable[[], None] | None = None,
) -> CheckpointInfo:
    """Publish the commit marker of the Trainer checkpoint ``directory`` (rank 0, after every
    rank finished writing into it).

    ``ranks``: each rank's ``{"rank", "grade", "loss", "summary", "signals_step"}`` (the
    checkpoint's grade is the worst rank's, as for a sharded save); ``meta``: more fields of
    the marker's ``meta`` (LR scale, run...). ``fence`` raises when this rank's generation was
    replaced: then nothing is published. A marker already there (an older save of the same
    step) is replaced. Returns the committed checkpoint; raises :class:`CheckpointError`.
    """
    name = os.path.basename(os.path.normpath(directory))
    if commit.parse_trainer_name(name) != step:
        raise CheckpointError(f"{directory} is not named {commit.TRAINER_PREFIX}{step}")
    storage = storage_for(directory)
    retract(directory)
    try:
        files = _hash_files(directory, storage)
    except OSError as e:
        raise CheckpointError(f"{directory}: {e}") from e
    if fence is not None:
        fence()
    text = commit.marker_text(
        directory_name=name,
        step=step,
        generation=generation,
        world_size=world_size,
        files=files,
        meta=_marker_meta(ranks, meta),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        layout=commit.TRAINER_LAYOUT,
    )
    storage.remove_file(os.path.join(directory, commit.COMMIT_NAME))  # a racing older publish
    _publish_marker(directory, text)
    return commit.parse_marker(directory, text.encode())


def verify_for_resume(directory: str, expected_sha256: str | None) -> CheckpointInfo:
    """Check a Trainer checkpoint before the framework loads it: its marker must have the plan's
    checksum, the directory must hold nothing the marker does not list (the Trainer would load
    it unchecked) and every file it lists its recorded size and sha256. Returns the marker;
    raises :class:`~.format.CheckpointError` (corrupt, altered, incomplete, added to)."""
    marker = commit.read_marker(directory)
    if marker.kind != commit.TRAINER_LAYOUT:
        raise CheckpointError(f"{directory} is not a Trainer checkpoint")
    if expected_sha256 is None:
        raise CheckpointError(f"no checksum for {directory} in the resume plan")
    return verify_sharded(
        CheckpointInfo(
            path=marker.path,
            meta_path=marker.meta_path,
            step=marker.step,
            generation=marker.generation,
            rank=0,
            sha256=expected_sha256,
            size=marker.size,
            kind=marker.kind,
        )
    )
