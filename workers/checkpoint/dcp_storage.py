"""What ``torch.distributed.checkpoint`` writes and reads through: spikeguard's
:class:`~.storage.Storage`, for a plain path and an object store alike, and the sha256 of every
file a rank writes, taken as it writes it. Needs torch.

* **A plain path** (or ``file://``): DCP's own ``FileSystemWriter`` and ``FileSystemReader``
  (each file fsynced as DCP does it).
* **An object store** (``s3://``...): :class:`StoreFileSystem`, DCP's ``FileSystemBase`` over the
  URL's storage. Each file DCP writes is one write-once upload
  (:meth:`~.storage.Storage.create`: whole or nothing, aborted when DCP raises while writing it);
  ``.metadata``, which DCP writes as ``.metadata.tmp`` and renames, is published
  (:meth:`~.storage.Storage.publish`: never over an existing one); a read is a ranged read of the
  object. Nothing is fsynced (a write is durable when it returns); no file goes through the local
  disk: DCP stages an asynchronous save in memory.

**Hashed as written** (:func:`writer_for`): every stream DCP opens for writing is wrapped so that
its bytes go through sha256 on their way out; when the stream has been completed (the file
closed, the upload finished) its digest and size are recorded under the file's name (``.metadata``
under its final name once renamed). A rank's hashes for the commit marker are those records:
nothing it wrote is read back, from the page cache or over the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase

from .storage import Storage, local_path, storage_for

__all__ = ["StoreFileSystem", "Written", "reader_for", "writer_for"]


class Written:
    """What a writer wrote: {file name: (hex sha256, size)}, recorded once each file is
    complete. Thread-safe (DCP may write with several threads)."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    def record(self, name: str, sha256: str, size: int) -> None:
        """``name`` was completed with these bytes."""
        with self._lock:
            self._files[name] = (sha256, size)

    def rename(self, old: str, new: str) -> None:
        """``old`` was renamed ``new``: its record follows (none if it had none)."""
        with self._lock:
            if old in self._files:
                self._files[new] = self._files.pop(old)

    def get(self, name: str) -> tuple[str, int] | None:
        """(sha256, size) of ``name``, or None if this writer did not complete it."""
        with self._lock:
            return self._files.get(name)

    def files(self) -> dict[str, tuple[str, int]]:
        """A copy of every record."""
        with self._lock:
            return dict(self._files)


class _HashingStream(io.RawIOBase):
    """A write-only stream that passes every byte to ``raw`` and through sha256."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self.digest = hashlib.sha256()
        """The sha256 of what was written so far."""
        self.size = 0
        """How many bytes were written."""

    def writable(self) -> bool:
        """Always."""
        return True

    def write(self, b: Any) -> int:
        """Write ``b`` to ``raw``; hash what ``raw`` took."""
        view = memoryview(b).cast("B")
        n = self._raw.write(view)
        n = len(view) if n is None else n
        self.digest.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        """The position: how many bytes were written (DCP records each item's offset)."""
        return self.size

    def fileno(self) -> int:
        """``raw``'s (DCP fsyncs a local file through it)."""
        return int(self._raw.fileno())

    def flush(self) -> None:
        """Flush ``raw``."""
        if not self.closed:
            self._raw.flush()

    def close(self) -> None:
        """Flush ``raw`` and stop taking writes; ``raw`` itself is completed by the
        ``create_stream`` block it came from (DCP closes the stream inside that block)."""
        if not self.closed:
            with contextlib.suppress(ValueError):  # raw closed already
                self._raw.flush()
        super().close()


class _Recording(FileSystemBase):
    """``inner`` (a DCP ``FileSystemBase``), with the streams it opens for writing hashed into
    ``written``."""

    def __init__(self, inner: FileSystemBase, written: Written) -> None:
        self.inner = inner
        self.written = written

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        """``inner``'s stream; for writing, hashed, and recorded once ``inner`` completed it."""
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self.inner.create_stream(path, mode) as raw:
            hashing = _HashingStream(raw)
            yield hashing
            hashing.close()
        self.written.record(_name(path), hashing.digest.hexdigest(), hashing.size)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        """``inner``'s."""
        return self.inner.concat_path(path, suffix)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """``inner``'s; the record follows the file."""
        self.inner.rename(path, new_path)
        self.written.rename(_name(path), _name(new_path))

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """``inner``'s."""
        return self.inner.init_path(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """``inner``'s."""
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Not used: the writer is always given explicitly."""
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """``inner``'s."""
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """``inner``'s."""
        self.inner.rm_file(path)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        """``inner``'s."""
        return self.inner.ls(path)  # type: ignore[attr-defined,no-any-return]


class StoreFileSystem(FileSystemBase):
    """DCP's ``FileSystemBase`` over a :class:`~.storage.Storage` whose paths are URLs (see the
    module docstring for what each operation is on an object store)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        """``wb``: a new object, completed when the block ends (never over an existing one);
        ``rb``: the object, for ranged reads."""
        url = os.fspath(path)
        if mode == "wb":
            with self.storage.create(url) as f:
                yield f  # type: ignore[misc]
        elif mode == "rb":
            with self.storage.open_read(url) as f:
                yield f  # type: ignore[misc]
        else:
            raise ValueError(f"{url}: DCP opened it with mode {mode!r}, which a store has not")

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        """``path/suffix``."""
        return os.fspath(path).rstrip("/") + "/" + suffix

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Publish ``path`` as ``new_path`` (never over an existing object)."""
        self.storage.publish(os.fspath(path), os.fspath(new_path))

    def init_path(self, path: str | os.PathLike[str]) -> str:
        """The URL as it is."""
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing on an object store (a prefix exists once an object is under it)."""
        self.storage.make_dirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Not used: the writer and reader are always given explicitly."""
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether an object (or a prefix) is there; an unreachable store raises."""
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """Delete the object."""
        self.storage.remove_file(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        """The URLs directly under ``path``."""
        url = os.fspath(path)
        return [self.concat_path(url, e.name) for e in self.storage.listdir(url)]


def _name(path: str | os.PathLike[str]) -> str:
    """The file name of a path or URL."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def writer_for(path: str) -> tuple[dcp.FileSystemWriter, Written]:
    """DCP's writer of the checkpoint directory ``path`` (never overwriting a checkpoint), and
    the record of what it writes, hashed as it goes (see the module docstring)."""
    written = Written()
    local = local_path(path)
    if local is not None:
        writer = dcp.FileSystemWriter(local, sync_files=True, overwrite=False)
        writer.fs = _Recording(writer.fs, written)
        return writer, written
    writer = dcp.FileSystemWriter(path, sync_files=False, overwrite=False)
    writer.fs = _Recording(StoreFileSystem(storage_for(path)), written)
    writer.path = path
    return writer, written


def reader_for(reader: dcp.FileSystemReader, path: str) -> dcp.FileSystemReader:
    """``reader`` (a ``FileSystemReader`` made for ``path``) reading through ``path``'s storage
    when ``path`` is a URL of an object store; DCP's own reading of the local path otherwise."""
    local = local_path(path)
    if local is None:
        reader.fs = StoreFileSystem(storage_for(path))
        reader.path = path
    else:
        reader.path = reader.fs.init_path(local)
    return reader
