"""Where checkpoints live: the one interface through which the checkpoint code lists, reads,
verifies, publishes and removes them. Torch-free.

A checkpoint directory is a *place*: a POSIX directory today, an object-store prefix
(``s3://bucket/prefix``) next. Every module of :mod:`spikeguard.workers.checkpoint` that touches
one goes through a :class:`Storage`, found for a path or URL by :func:`storage_for` from its
scheme, so that a second kind of place is one new class and its :func:`register` line, and none
of the rules (names, sidecars, markers, size and sha256 checks, retention) is written twice.

The protocol speaks in strings (a path, or a URL with its scheme: the checkpoint code joins and
splits them with ``os.path``, which keeps a URL's ``scheme://`` intact) and file objects, never
file descriptors, so that an fsspec filesystem can implement it: ``ls(detail=True)`` gives
:meth:`~Storage.listdir`, ``info`` :meth:`~Storage.stat`, ``open`` :meth:`~Storage.open_read`
and :meth:`~Storage.create`, ``rm`` the removals. Publication is write-once: a file is written
under a temp name (:meth:`~Storage.create`, durable when its block ends), then
:meth:`~Storage.publish` gives it its final name without ever replacing one (on an object store:
an upload, atomic there); a checkpoint's sidecar or commit marker is published last, so a
checkpoint exists once it does. :meth:`~Storage.sync` makes a directory's entries durable (a
no-op where a write is durable when it returns).

:class:`PosixStorage` (schemes ``""``, a plain path, and ``file``) never follows a symlink,
never blocks on a FIFO (the checks of :mod:`.files`), fsyncs what it publishes and the directory
entries it changes. The object stores of :data:`OBJECT_STORE_SCHEMES` (``s3://``...) are served by
:class:`~.fsspec_storage.FsspecStorage`, imported with fsspec on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import BinaryIO, Protocol, TypeVar

from . import files
from .files import Kind, NotRegularFile

__all__ = [
    "CHUNK_BYTES",
    "LOCAL_SCHEMES",
    "OBJECT_STORE_SCHEMES",
    "TMP_PREFIX",
    "Entry",
    "Kind",
    "NotRegularFile",
    "PosixStorage",
    "Stat",
    "Storage",
    "UnknownScheme",
    "hash_stream",
    "local_path",
    "register",
    "remove_quietly",
    "require_file",
    "scheme_of",
    "schemes",
    "stat_file",
    "storage_for",
    "temp_name",
    "unregister",
]

CHUNK_BYTES = 1 << 20
"""How much of a file is read at a time while hashing it."""
TMP_PREFIX = ".tmp-"
"""The start of a file's name while a writer works on it (``.tmp-<final name>-<pid>``)."""

_WORDS: dict[Kind, str] = {
    "file": "a regular file",
    "dir": "a directory",
    "symlink": "a symbolic link",
    "other": "not a plain file",
}
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stat:
    """What is at a path (never through a symlink)."""

    kind: Kind
    """``"file"`` (a regular file, an object), ``"dir"`` (a directory, a prefix), ``"symlink"``
    (never followed) or ``"other"`` (a FIFO, a device, a socket; or an entry that could not be
    looked at)."""
    size: int = 0
    """Bytes, for a file (0 for anything else)."""
    mtime: float = 0.0
    """When it was last modified, in seconds since the epoch (0 where unknown)."""
    detail: str = ""
    """The kind in words where :attr:`kind` says too little (``"a FIFO"``), for messages."""

    @property
    def what(self) -> str:
        """The kind in words: ``"a directory"``, ``"a FIFO"``..."""
        return self.detail or _WORDS[self.kind]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry(Stat):
    """One entry of a directory listing."""

    name: str
    """Its name in the directory (no path)."""


class Storage(Protocol):
    """What the checkpoint code needs of a place (see the module docstring). Paths are strings;
    a missing one raises ``FileNotFoundError``, any other failure an ``OSError``."""

    def listdir(self, directory: str) -> list[Entry]:
        """The entries directly in ``directory``, in no particular order. An entry removed while
        it is listed is left out; one that cannot be looked at is of kind ``"other"``."""
        ...

    def stat(self, path: str) -> Stat:
        """What is at ``path``, never following a symlink."""
        ...

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (a symlink counts, and is not followed)."""
        ...

    def open_read(self, path: str) -> BinaryIO:
        """``path`` opened for binary, seekable reading if it is a regular file (the caller
        closes it): never through a symlink, never blocking (a FIFO). Raises
        :class:`NotRegularFile` for anything else."""
        ...

    def read_bytes(self, path: str, limit: int) -> bytes:
        """At most the first ``limit`` bytes of the regular file ``path`` (as
        :meth:`open_read`): a small file (a sidecar, a marker) read whole, an oversized one
        never."""
        ...

    def sha256(self, path: str) -> tuple[str, int]:
        """(hex sha256, size in bytes) of the regular file ``path``, streamed."""
        ...

    def make_dirs(self, directory: str) -> None:
        """Create ``directory`` and its parents where missing."""
        ...

    def create(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A new file ``path`` (never an existing one: ``FileExistsError``) to write in a
        ``with`` block; durable when the block ends without an error. After an error it may be
        left behind: the caller, who knows it created it, removes it."""
        ...

    def publish(self, temp: str, final: str) -> None:
        """Give the file ``temp`` the name ``final`` durably, never replacing an existing
        ``final`` (``FileExistsError`` naming ``final``). On a failure nothing is left under
        ``final`` (best effort)."""
        ...

    def publish_bytes(self, final: str, data: bytes) -> None:
        """Publish ``data`` as the new file ``final`` (a sidecar, a commit marker), write-once
        as :meth:`publish`, leaving nothing behind on a failure. ``FileExistsError`` names the
        path that existed: ``final``, or this process's temp name for it."""
        ...

    def remove_file(self, path: str) -> bool:
        """Remove the file (or symlink) ``path``; False if there was none."""
        ...

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> None:
        """Remove the directory ``path`` and everything under it (a symlink is refused)."""
        ...

    def sync(self, directory: str) -> None:
        """Make the entries of ``directory`` (new, renamed, removed) durable."""
        ...


def require_file(path: str, st: Stat) -> None:
    """Raise :class:`NotRegularFile` unless ``st`` (of ``path``) is a regular file's."""
    files.check_regular(path, st.kind, st.what)


def stat_file(storage: Storage, path: str) -> Stat:
    """``storage.stat(path)``, or :class:`NotRegularFile` if it is not a regular file (a symlink
    is not); any other ``OSError`` propagates."""
    st = storage.stat(path)
    require_file(path, st)
    return st


def remove_quietly(storage: Storage, path: str) -> None:
    """``storage.remove_file(path)``, best effort: the error being handled matters more."""
    with contextlib.suppress(OSError):
        storage.remove_file(path)


def hash_stream(f: BinaryIO) -> tuple[str, int]:
    """The hex sha256 of what is left to read in ``f``, and how many bytes that was, read in
    :data:`CHUNK_BYTES` chunks."""
    digest = hashlib.sha256()
    n_bytes = 0
    while True:
        chunk = f.read(CHUNK_BYTES)
        if not chunk:
            break
        digest.update(chunk)
        n_bytes += len(chunk)
    return digest.hexdigest(), n_bytes


def temp_name(final: str) -> str:
    """This process's temp name for ``final``: ``.tmp-<final name>-<pid>`` beside it, which
    ``clean_temp_files`` removes once a writer died."""
    return os.path.join(
        os.path.dirname(final), f"{TMP_PREFIX}{os.path.basename(final)}-{os.getpid()}"
    )


def _exists(path: str) -> FileExistsError:
    return FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)


def _local(path: str) -> str:
    """A ``file://`` URL's path; a plain path as it is."""
    return path[len("file://") :] if path[:7].lower() == "file://" else path


LOCAL_SCHEMES = ("", "file")
"""The schemes of a place on a filesystem: a plain path (``""``) and ``file://``."""


def local_path(path_or_url: str | os.PathLike[str]) -> str | None:
    """The local path of a plain path or a ``file://`` URL; None for any other URL (an object
    store's, served by another storage)."""
    path = os.fspath(path_or_url)
    return _local(path) if scheme_of(path) in LOCAL_SCHEMES else None


def _stat_of(st: os.stat_result) -> Stat:
    what = files.kind_of(st.st_mode)
    return Stat(
        kind=what,
        size=st.st_size if what == "file" else 0,
        mtime=st.st_mtime,
        detail="" if what == "file" else files.kind(st.st_mode),
    )


class UnknownScheme(ValueError):
    """No storage is registered for a URL's scheme."""


_Factory = TypeVar("_Factory", bound=Callable[[], Storage])
_REGISTRY: dict[str, Callable[[], Storage]] = {}


def register(*schemes: str) -> Callable[[_Factory], _Factory]:
    """Make the decorated :class:`Storage` class (or function returning one) the storage of the
    URLs of ``schemes`` (``""``: plain paths): ``@register("s3", "gs")``. A later registration
    of a scheme replaces the earlier one."""

    def decorate(factory: _Factory) -> _Factory:
        for scheme in schemes:
            _REGISTRY[scheme.lower()] = factory
        return factory

    return decorate


def schemes() -> tuple[str, ...]:
    """The schemes a storage is registered for, in the order they were registered (``""``:
    plain paths)."""
    return tuple(_REGISTRY)


def unregister(scheme: str) -> None:
    """Forget the storage of ``scheme`` (a test's throw-away backend)."""
    _REGISTRY.pop(scheme.lower(), None)


def scheme_of(path_or_url: str | os.PathLike[str]) -> str:
    """The URL scheme of ``path_or_url``, lower case (``"s3"``); ``""`` for a plain path."""
    match = _SCHEME_RE.match(os.fspath(path_or_url))
    return "" if match is None else match[1].lower()


def storage_for(path_or_url: str | os.PathLike[str]) -> Storage:
    """The storage of ``path_or_url``, by its scheme. Raises :class:`UnknownScheme` when none is
    registered for it."""
    scheme = scheme_of(path_or_url)
    factory = _REGISTRY.get(scheme)
    if factory is None:
        known = ", ".join(sorted(f"{s}://" for s in _REGISTRY if s)) or "none"
        raise UnknownScheme(
            f"no checkpoint storage for {os.fspath(path_or_url)!r} (scheme {scheme!r}; "
            f"registered: plain paths, {known})"
        )
    return factory()


@register("", "file")
class PosixStorage:
    """A checkpoint directory on a POSIX filesystem (local, or shared across nodes)."""

    def listdir(self, directory: str) -> list[Entry]:
        """See :meth:`Storage.listdir`: ``scandir``, each entry ``lstat``-ed."""
        out = []
        with os.scandir(_local(directory)) as entries:
            for entry in entries:
                try:
                    st = _stat_of(entry.stat(follow_symlinks=False))
                except FileNotFoundError:
                    continue  # removed since it was listed
                except OSError as e:
                    out.append(Entry(name=entry.name, kind="other", detail=f"unreadable ({e})"))
                    continue
                out.append(Entry(name=entry.name, **dataclasses.asdict(st)))
        return out

    def stat(self, path: str) -> Stat:
        """See :meth:`Storage.stat`: ``lstat``."""
        return _stat_of(os.lstat(_local(path)))

    def exists(self, path: str) -> bool:
        """See :meth:`Storage.exists`: ``lexists``."""
        return os.path.lexists(_local(path))

    def open_read(self, path: str) -> BinaryIO:
        """See :meth:`Storage.open_read`: :func:`.files.open_regular`."""
        return files.open_regular(_local(path))

    def read_bytes(self, path: str, limit: int) -> bytes:
        """See :meth:`Storage.read_bytes`."""
        with self.open_read(path) as f:
            return f.read(limit)

    def sha256(self, path: str) -> tuple[str, int]:
        """See :meth:`Storage.sha256`."""
        with self.open_read(path) as f:
            return hash_stream(f)

    def make_dirs(self, directory: str) -> None:
        """See :meth:`Storage.make_dirs`."""
        os.makedirs(_local(directory), exist_ok=True)

    @contextlib.contextmanager
    def create(self, path: str) -> Iterator[BinaryIO]:
        """See :meth:`Storage.create`: ``O_EXCL``; flushed and fsynced at the end."""
        try:
            fd = os.open(_local(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise _exists(path) from None
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def publish(self, temp: str, final: str) -> None:
        """See :meth:`Storage.publish`: a hard link (a check and a rename where the filesystem
        has none), the temp name removed, the directory fsynced."""
        tmp, dest = _local(temp), _local(final)
        try:
            os.link(tmp, dest)
        except FileExistsError:
            raise _exists(final) from None
        except OSError:  # no hard links on this filesystem: check, then rename
            if os.path.lexists(dest):
                raise _exists(final) from None
            os.rename(tmp, dest)
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            files.fsync_directory(os.path.dirname(dest))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise

    def publish_bytes(self, final: str, data: bytes) -> None:
        """See :meth:`Storage.publish_bytes`: :meth:`create` its :func:`temp_name`, then
        :meth:`publish`."""
        temp = temp_name(final)
        created = False
        try:
            with self.create(temp) as f:
                created = True
                f.write(data)
            self.publish(temp, final)
        except BaseException:
            if created:
                remove_quietly(self, temp)
            raise

    def remove_file(self, path: str) -> bool:
        """See :meth:`Storage.remove_file` (the directory is not fsynced: :meth:`sync`)."""
        try:
            os.unlink(_local(path))
        except FileNotFoundError:
            return False
        return True

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> None:
        """See :meth:`Storage.remove_tree` (the parent is not fsynced: :meth:`sync`)."""
        shutil.rmtree(_local(path), ignore_errors=ignore_errors)

    def sync(self, directory: str) -> None:
        """See :meth:`Storage.sync`: fsync the directory."""
        files.fsync_directory(_local(directory))


OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs")
"""The URL schemes of object stores, each one fsspec knows, served by
:class:`~.fsspec_storage.FsspecStorage`. Its module, fsspec and the backend (``s3fs`` for S3:
``pip install 'spikeguard[s3]'``) are imported on the first use of such a URL, never before."""


def _object_store(scheme: str) -> Callable[[], Storage]:
    """The factory of ``scheme``'s storage, importing :mod:`.fsspec_storage` when called."""

    def make() -> Storage:
        from .fsspec_storage import storage_of

        return storage_of(scheme)

    return make


for _scheme in OBJECT_STORE_SCHEMES:
    register(_scheme)(_object_store(_scheme))
