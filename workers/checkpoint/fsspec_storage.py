"""Checkpoints on an object store (``s3://bucket/prefix``, and the other URLs of
:data:`.storage.OBJECT_STORE_SCHEMES`): :class:`FsspecStorage`, the :class:`~.storage.Storage`
of an fsspec filesystem. Torch-free. It needs fsspec and the scheme's backend (``s3fs`` for S3:
``pip install 'spikeguard[s3]'``); :func:`.storage.storage_for` imports it on the first use of
such a URL, so nothing else does.

**Where the store is, and who may use it**, comes only from the backend's standard environment,
never from the job file: for S3 ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` (and
``AWS_SESSION_TOKEN``), ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``: MinIO, R2, a local
server), ``AWS_DEFAULT_REGION``, else botocore's own chain (a profile, an instance role). Errors
are ``OSError`` naming the URL; the values of the credential variables are cut out of their text,
and the client's exception is not chained to them.

**Publication is write-once**, so that a checkpoint exists once its sidecar or commit marker
does, and then whole:

* :meth:`~FsspecStorage.create` streams to the temp name (on S3 a multipart upload, or one PUT for
  a small object), completed when the ``with`` block ends, with ``If-None-Match: *``: the object
  appears whole or not at all, never over an existing one. An error in the block aborts the
  upload. A writer killed midway leaves an incomplete multipart upload, listed nowhere (a bucket
  lifecycle rule ``AbortIncompleteMultipartUpload`` reclaims its parts).
* :meth:`~FsspecStorage.publish` checks that the final name is free (a HEAD), copies the temp
  object to it on the server (``CopyObject``, atomic; no byte goes through the client, but the
  store copies the data file once more) and deletes the temp object. The copy is not
  conditional: between the check and the copy another writer of the same name could publish,
  and the copy would replace its object. Within spikeguard a name is a step, a generation and a
  rank, which one writer has by construction (a replaced generation is fenced before it
  publishes).
* :meth:`~FsspecStorage.publish_bytes` (a sidecar, a commit marker: what makes a checkpoint
  exist) is one PUT with ``If-None-Match: *``: atomic and free of that race wherever the store
  honours the condition (AWS S3, MinIO, moto). A backend without conditional writes (anything
  but S3 here) gets a check before the write instead, with the same window as the copy.

**Retries**: botocore retries each request (503 SlowDown, 500, throttling, timeouts, dropped
connections) in its ``adaptive`` mode (exponential backoff with jitter, and a client-side rate
limit after throttling) up to ``AWS_MAX_ATTEMPTS`` attempts (default :data:`MAX_ATTEMPTS`;
``AWS_RETRY_MODE`` may choose ``standard``), and s3fs tries a whole call :data:`S3FS_TRIES`
times (a response body cut off midway): at most ``S3FS_TRIES × AWS_MAX_ATTEMPTS`` requests, then
the ``OSError``.

Listings are never cached: ranks and the supervisor write the same prefix from other processes.
A prefix exists while an object is under it: :meth:`~FsspecStorage.make_dirs` creates nothing
(never a bucket), and :meth:`~FsspecStorage.sync` has nothing to do (a write is durable when it
returns). A missing bucket is an error of the listing, not an empty directory.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from .storage import Entry, Kind, Stat, UnknownScheme, hash_stream, remove_quietly, require_file

__all__ = ["MAX_ATTEMPTS", "S3FS_TRIES", "SECRET_VARIABLES", "FsspecStorage", "storage_of"]

MAX_ATTEMPTS = 8
"""botocore's attempts at one request where ``AWS_MAX_ATTEMPTS`` does not say (its backoff
caps each wait at 20 s: about a minute of a store answering SlowDown before a call fails)."""
S3FS_TRIES = 2
"""How many times s3fs makes one call (each with botocore's retries) before it gives up."""
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
)
"""The environment variables whose values never appear in an error message."""
_S3_SCHEMES = ("s3", "s3a")
_KINDS: dict[str, Kind] = {"file": "file", "directory": "dir"}
_T = TypeVar("_T")


def _scrub(text: str) -> str:
    """``text`` with the value of every :data:`SECRET_VARIABLES` set (4 characters or more)
    replaced by ``***``."""
    for name in SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _failure(url: str, e: BaseException) -> OSError:
    """The ``OSError`` that a failed call of the filesystem on ``url`` raises: the same kind for
    a missing object (``FileNotFoundError``), a taken name (``FileExistsError``), a refusal
    (``PermissionError``); any other error (a botocore one: retries exhausted, no credentials,
    an unreachable endpoint) an ``OSError`` with its errno or ``EIO``, its text scrubbed."""
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, "no such object", url)
    if isinstance(e, FileExistsError):
        return FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), url)
    if isinstance(e, OSError) and e.strerror:  # s3fs's translation of the store's answer
        why = _scrub(e.strerror)
    else:  # botocore's own (no credentials, endpoint unreachable...)
        why = _scrub(f"{type(e).__name__}: {e}")
    if isinstance(e, PermissionError):
        return PermissionError(errno.EACCES, why, url)
    number = e.errno if isinstance(e, OSError) and isinstance(e.errno, int) else errno.EIO
    return OSError(number, why, url)


def _call(url: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``, any exception turned into :func:`_failure`'s (not chained)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        failure = _failure(url, e)
    raise failure


def _mtime(info: dict[str, Any]) -> float:
    """When the object of fsspec's ``info`` was last modified (seconds since the epoch; 0 where
    the backend does not say)."""
    for key in ("LastModified", "last_modified", "mtime", "updated"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def _stat_of(info: dict[str, Any]) -> Stat:
    """fsspec's ``info`` (or a listing's entry) as a :class:`~.storage.Stat`."""
    kind = _KINDS.get(str(info.get("type")), "other")
    size = info.get("size") if kind == "file" else 0
    return Stat(
        kind=kind,
        size=size if isinstance(size, int) else 0,
        mtime=_mtime(info),
        detail="" if kind != "other" else f"an entry of type {info.get('type')!r}",
    )


class _Reader(io.RawIOBase):
    """A readable, seekable view of an fsspec file that raises only ``OSError`` (naming the URL):
    what ``torch.load``, the hashing and the pickle scan read."""

    def __init__(self, f: Any, url: str) -> None:
        super().__init__()
        self._f = f
        self._url = url

    def readable(self) -> bool:
        """Always."""
        return True

    def seekable(self) -> bool:
        """Always."""
        return True

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (all that is left for -1 or None)."""
        return _call(self._url, self._f.read, -1 if size is None else size)

    def readall(self) -> bytes:
        """All that is left."""
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` as far as the object goes; how many bytes that was."""
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` (from ``whence``); the new position."""
        return _call(self._url, self._f.seek, offset, whence)

    def tell(self) -> int:
        """The position."""
        return self._f.tell()

    def close(self) -> None:
        """Close the fsspec file too."""
        try:
            if not self.closed:
                self._f.close()
        finally:
            super().close()


class FsspecStorage:
    """Checkpoints on the fsspec filesystem ``fs``, paths given as URLs (``s3://bucket/key``).

    ``conditional``: the backend writes with ``If-None-Match: *`` (s3fs's ``"xb"`` mode and
    ``mode="create"``), so a write never replaces an object; without it a check comes first.
    ``flat``: an object store, whose prefixes are not created (:meth:`make_dirs` does nothing)
    and where a missing bucket is an error. See the module docstring for what each method costs.
    """

    def __init__(self, fs: Any, *, conditional: bool, flat: bool = True) -> None:
        self.fs = fs
        """The fsspec filesystem."""
        self.conditional = conditional
        """Writes are conditional on the name being free (see the class docstring)."""
        self.flat = flat
        """An object store: prefixes, not directories (see the class docstring)."""

    # -- reading ---------------------------------------------------------------------------------
    def listdir(self, directory: str) -> list[Entry]:
        """See :meth:`.storage.Storage.listdir`: one listing (``ls``, delimited by ``/``).
        ``FileNotFoundError`` for a prefix with nothing under it; ``NotADirectoryError`` for an
        object; an ``OSError`` (not ``FileNotFoundError``) when the bucket does not exist."""
        try:
            listed = _call(directory, self.fs.ls, directory, detail=True)
        except FileNotFoundError:
            if self.flat and not self._bucket_exists(directory):
                raise OSError(errno.ENODEV, "the bucket does not exist", directory) from None
            raise
        own = self.fs._strip_protocol(directory).rstrip("/")
        out = []
        for info in listed:
            name = str(info.get("name", "")).rstrip("/")
            if name == own:
                if info.get("type") == "file":
                    raise NotADirectoryError(errno.ENOTDIR, "an object, not a prefix", directory)
                continue  # the prefix's own marker object
            out.append(Entry(name=name.rsplit("/", 1)[-1], **vars(_stat_of(info))))
        return out

    def _bucket_exists(self, url: str) -> bool:
        """Whether the bucket of ``url`` exists (True when that cannot be told)."""
        bucket = self.fs._strip_protocol(url).split("/", 1)[0]
        try:
            return bool(self.fs.exists(bucket))
        except Exception:
            return True

    def stat(self, path: str) -> Stat:
        """See :meth:`.storage.Storage.stat`: ``info`` (a HEAD; a listing for a prefix)."""
        return _stat_of(_call(path, self.fs.info, path))

    def exists(self, path: str) -> bool:
        """See :meth:`.storage.Storage.exists`: :meth:`stat`, so that a store that cannot be
        reached is an ``OSError``, never "absent"."""
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def open_read(self, path: str) -> BinaryIO:
        """See :meth:`.storage.Storage.open_read`: :meth:`stat`, then the object opened for
        ranged reads (s3fs pins its ETag: an object replaced while it is read fails the read)."""
        st = self.stat(path)
        require_file(path, st)
        f = _call(path, self.fs.open, path, "rb", size=st.size)
        return _Reader(f, path)  # type: ignore[return-value]

    def read_bytes(self, path: str, limit: int) -> bytes:
        """See :meth:`.storage.Storage.read_bytes`: one ranged GET after :meth:`stat`."""
        st = self.stat(path)
        require_file(path, st)
        if st.size == 0 or limit <= 0:
            return b""
        return _call(path, self.fs.cat_file, path, start=0, end=min(limit, st.size))

    def sha256(self, path: str) -> tuple[str, int]:
        """See :meth:`.storage.Storage.sha256`: the object streamed through the hash."""
        with self.open_read(path) as f:
            return _call(path, hash_stream, f)

    # -- writing ---------------------------------------------------------------------------------
    def make_dirs(self, directory: str) -> None:
        """See :meth:`.storage.Storage.make_dirs`: nothing on an object store (a prefix exists
        once an object is under it; a bucket is never created), ``makedirs`` elsewhere."""
        if not self.flat:
            _call(directory, self.fs.makedirs, directory, exist_ok=True)

    def _refuse_taken(self, path: str) -> None:
        """``FileExistsError`` naming ``path`` if something is there."""
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)

    @contextlib.contextmanager
    def create(self, path: str) -> Iterator[BinaryIO]:
        """See :meth:`.storage.Storage.create`: an upload completed (conditionally, see the class
        docstring) when the block ends, aborted on an error in it. ``FileExistsError`` names
        ``path`` when it is taken, at the start or when the upload completes."""
        if not self.conditional:
            self._refuse_taken(path)
        f = _call(path, self.fs.open, path, "xb" if self.conditional else "wb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # abort the multipart upload: nothing is published
            f.closed = True  # never completed by a later close or by the garbage collector
            raise
        _call(path, f.close)

    def publish(self, temp: str, final: str) -> None:
        """See :meth:`.storage.Storage.publish`: a check, a server-side copy, the temp object
        deleted (the copy removed again if that fails). Not atomic against another writer of
        the same name: see the module docstring."""
        self._refuse_taken(final)
        _call(final, self.fs.cp_file, temp, final)
        try:
            _call(temp, self.fs.rm_file, temp)
        except BaseException:
            remove_quietly(self, final)
            raise

    def publish_bytes(self, final: str, data: bytes) -> None:
        """See :meth:`.storage.Storage.publish_bytes`: one conditional PUT (a check first where
        the backend has no conditional write). ``FileExistsError`` names ``final``."""
        if self.conditional:
            _call(final, self.fs.pipe_file, final, data, mode="create")
            return
        self._refuse_taken(final)
        _call(final, self.fs.pipe_file, final, data)

    # -- removing --------------------------------------------------------------------------------
    def remove_file(self, path: str) -> bool:
        """See :meth:`.storage.Storage.remove_file`: a HEAD (False if nothing is there), then a
        DELETE. ``IsADirectoryError`` for a prefix."""
        try:
            st = self.stat(path)
        except FileNotFoundError:
            return False
        if st.kind == "dir":
            raise IsADirectoryError(errno.EISDIR, "a prefix, not an object", path)
        _call(path, self.fs.rm_file, path)
        return True

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> None:
        """See :meth:`.storage.Storage.remove_tree`: every object under ``path/`` deleted in
        bulk (never one under a longer name beside it). ``FileNotFoundError`` when nothing is
        there, ``NotADirectoryError`` for an object, unless ``ignore_errors``."""
        try:
            st = self.stat(path)
            if st.kind != "dir":
                raise NotADirectoryError(errno.ENOTDIR, "an object, not a prefix", path)
            prefix = self.fs._strip_protocol(path).rstrip("/") + "/"
            keys = [k for k in _call(path, self.fs.find, path) if k.startswith(prefix)]
            if keys:
                _call(path, self.fs.rm, keys)
        except OSError:
            if not ignore_errors:
                raise

    def sync(self, directory: str) -> None:
        """See :meth:`.storage.Storage.sync`: nothing (a write is durable when it returns)."""


def _s3_options() -> dict[str, Any]:
    """s3fs's options, from the standard environment: the endpoint and region (so that the
    cached client is the one of the current ones), botocore's retries; no listing cache."""
    client: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        client["region_name"] = region
    try:
        attempts = max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", "")))
    except ValueError:
        attempts = MAX_ATTEMPTS
    mode = os.environ.get("AWS_RETRY_MODE") or "adaptive"
    return {
        "client_kwargs": client,
        "config_kwargs": {"retries": {"total_max_attempts": attempts, "mode": mode}},
        "use_listings_cache": False,
    }


def storage_of(scheme: str) -> FsspecStorage:
    """The storage of ``scheme``'s URLs (one of :data:`.storage.OBJECT_STORE_SCHEMES`): its
    fsspec filesystem (fsspec caches it per set of options and thread). Raises
    :class:`~.storage.UnknownScheme`, saying what to install, when fsspec or the backend is
    missing."""
    hint = "pip install 'spikeguard[s3]'" if scheme in _S3_SCHEMES else "install its fsspec backend"
    try:
        import fsspec

        fs = fsspec.filesystem(scheme, **(_s3_options() if scheme in _S3_SCHEMES else {}))
    except ImportError as e:
        raise UnknownScheme(
            f"{scheme}:// checkpoints need fsspec and its {scheme} backend ({hint}): {e}"
        ) from None
    if scheme in _S3_SCHEMES:
        fs.retries = S3FS_TRIES
    return FsspecStorage(fs, conditional=scheme in _S3_SCHEMES)
