"""Checking a data file's bytes against its recorded size and sha256. Torch-free.

:func:`open_checked` is shared by :func:`~.select.verify` (the supervisor's check before it picks a
checkpoint) and :func:`~.load.load_checkpoint` (the rank's check before it unpickles one): both
hash the file in one streamed pass and then read the same open file, so what they go on to read is
what was hashed.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from .files import NotRegularFile, open_regular
from .format import CheckpointError, CorruptCheckpointError

CHUNK_BYTES = 1 << 20


@contextlib.contextmanager
def open_checked(
    path: str, sha256s: Sequence[tuple[str, str]], size: int | None
) -> Iterator[BinaryIO]:
    """Open ``path``, hash it in 1 MiB chunks and yield it rewound to its start.

    ``sha256s`` holds (source, hex digest) pairs, e.g. ``("sidecar", info.sha256)``: the file must
    match each. ``size`` is the expected size in bytes, or None for no size check.

    Raises :class:`CorruptCheckpointError` if the file is missing, not a regular file (a symlink,
    never followed; a FIFO, refused without blocking), empty, or differs from ``size`` or any of
    ``sha256s``; :class:`CheckpointError` if it cannot be opened or read for another reason
    (EACCES, EIO...: not the file's fault).
    """
    try:
        f = open_regular(path)
    except NotRegularFile as e:
        raise CorruptCheckpointError(str(e)) from e
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{path}: {e}") from e
    with f:
        try:
            actual, n_bytes = _sha256(f)
        except OSError as e:
            raise CheckpointError(f"{path}: reading failed: {e}") from e
        if n_bytes == 0:
            raise CorruptCheckpointError(f"{path} is empty")
        if size is not None and n_bytes != size:
            raise CorruptCheckpointError(
                f"{path}: size mismatch: {n_bytes} bytes, expected {size} (truncated?)"
            )
        for source, want in sha256s:
            if actual != want.lower():
                raise CorruptCheckpointError(
                    f"{path}: sha256 mismatch: file {actual}, {source} {want}"
                )
        f.seek(0)
        yield f


def _sha256(f: BinaryIO) -> tuple[str, int]:
    """The hex sha256 of what is left to read in ``f``, and how many bytes that was."""
    digest = hashlib.sha256()
    n_bytes = 0
    while True:
        chunk = f.read(CHUNK_BYTES)
        if not chunk:
            break
        digest.update(chunk)
        n_bytes += len(chunk)
    return digest.hexdigest(), n_bytes


def hash_file(path: str) -> tuple[str, int]:
    """(hex sha256, size in bytes) of the regular file at ``path``, streamed in 1 MiB chunks.

    Raises :class:`~.files.NotRegularFile` (a symlink, never followed; a FIFO...) or the
    ``OSError`` of the open or a read.
    """
    with open_regular(path) as f:
        return _sha256(f)
