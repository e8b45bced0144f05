"""Checking a data file's bytes against its recorded size and sha256. Torch-free.

:func:`open_checked` is shared by :func:`~.choose.verify` (the supervisor's check before it picks a
checkpoint) and :func:`~.load.load_checkpoint` (the rank's check before it unpickles one): both
hash the file in one streamed pass and then read the same open file, so what they go on to read is
what was hashed. The file is opened through its :class:`~.storage.Storage` (a plain path: never
through a symlink, never blocking on a FIFO).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from .format import CheckpointError, CorruptCheckpointError
from .storage import NotRegularFile, Storage, hash_stream, storage_for


@contextlib.contextmanager
def open_checked(
    path: str,
    sha256s: Sequence[tuple[str, str]],
    size: int | None,
    *,
    storage: Storage | None = None,
) -> Iterator[BinaryIO]:
    """Open ``path``, hash it in 1 MiB chunks and yield it rewound to its start.

    ``sha256s`` holds (source, hex digest) pairs, e.g. ``("sidecar", info.sha256)``: the file must
    match each. ``size`` is the expected size in bytes, or None for no size check. ``storage``:
    where ``path`` is (default: :func:`~.storage.storage_for` it).

    Raises :class:`CorruptCheckpointError` if the file is missing, not a regular file (a symlink,
    never followed; a FIFO, refused without blocking), empty, or differs from ``size`` or any of
    ``sha256s``; :class:`CheckpointError` if it cannot be opened or read for another reason
    (EACCES, EIO...: not the file's fault).
    """
    storage = storage or storage_for(path)
    try:
        f = storage.open_read(path)
    except NotRegularFile as e:
        raise CorruptCheckpointError(str(e)) from e
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{path}: {e}") from e
    with f:
        try:
            actual, n_bytes = hash_stream(f)
        except OSError as e:
            raise CheckpointError(f"{path}: reading failed: {e}") from e
        check_hashed(path, actual, n_bytes, sha256s, size)
        f.seek(0)
        yield f


def check_hashed(
    path: str, actual: str, n_bytes: int, sha256s: Sequence[tuple[str, str]], size: int | None
) -> None:
    """Raise :class:`CorruptCheckpointError` unless the file at ``path``, whose bytes hashed to
    ``actual`` (hex sha256) and numbered ``n_bytes``, is not empty and matches ``size`` (None:
    no size check) and each (source, hex digest) of ``sha256s``. What :func:`open_checked`
    checks, for a caller that hashed the bytes as they streamed elsewhere (a download, an
    upload: :mod:`.mirror`)."""
    if n_bytes == 0:
        raise CorruptCheckpointError(f"{path} is empty")
    if size is not None and n_bytes != size:
        raise CorruptCheckpointError(
            f"{path}: size mismatch: {n_bytes} bytes, expected {size} (truncated?)"
        )
    for source, want in sha256s:
        if actual != want.lower():
            raise CorruptCheckpointError(f"{path}: sha256 mismatch: file {actual}, {source} {want}")


def hash_file(path: str, *, storage: Storage | None = None) -> tuple[str, int]:
    """(hex sha256, size in bytes) of the regular file at ``path``, streamed in 1 MiB chunks.

    Raises :class:`~.storage.NotRegularFile` (a symlink, never followed; a FIFO...) or the
    ``OSError`` of the open or a read.
    """
    return (storage or storage_for(path)).sha256(path)
