"""The run directory's small files, each written atomically: FENCE, plans, status.json, the lock.

Layout (``RUN_DIR``)::

    journal.jsonl        the event log (journal.py)
    reports.jsonl        every accepted rank message, as the rank sent it plus the
                         supervisor's ``at``, in the order it was evaluated
    status.json          the current state, rewritten every poll
    FENCE                the current generation; older ranks may not publish checkpoints
    STOP                 written by ``spikeguard stop``
    supervisor.lock      held (flock) by the live supervisor: pid and host
    plans/genNNN.json    the resume plan of each relaunch
    logs/genNNN-rankR.log each rank's stdout/stderr
    checkpoints/         what the ranks save
    incidents/<id>/batch_ids-<attempt>.json   the ranks' recent batch ids at an incident
    metrics.url          where this run's /metrics is served
    report.html          the post-mortem (``spikeguard report``; the demo writes it)

The directory is private: ``RUN_DIR`` (and ``plans/``, ``logs/``, ``incidents/``) mode 0700,
every file the supervisor writes there 0600, whatever the umask (a ``RUN_DIR`` that exists
already keeps its mode: only what spikeguard creates is changed). Nothing is written through a
symlink planted in it: a file rewritten whole (:func:`write_atomic`: status.json, FENCE, STOP,
plans, batch ids, metrics.url, report.html) is a ``mkstemp`` file in the same directory renamed
over the path, which replaces a link and leaves its target untouched; a file opened for appending
(the journal, reports.jsonl, the lock, the ranks' logs) is opened with ``O_NOFOLLOW`` and a link
there is refused (:class:`UnsafePath`, ``submit`` exits 2).

The journal and reports.jsonl are appended whole records at a time, unbuffered
(:class:`LineFile`): a write that fails (a full disk) is truncated away, so no fragment reaches
the disk later, and a torn last line left by a crash is ended before the next record.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import IO, Any, BinaryIO, NoReturn

from spikeguard.workers.contract.logs import logger

log = logger(__name__)
_GEN_RE = re.compile(r"^gen(\d+)")
APPEND_ONLY = ("journal.jsonl", "reports.jsonl", "supervisor.lock")
"""The files opened for appending (or locking), where a planted symlink is refused."""


class UnsafePath(RuntimeError):
    """A path in the run directory is a symbolic link (or not a regular file) where the
    supervisor would write: refused rather than written through."""


JOB_RECORD = "job.json"
"""The job as its supervisor runs it (``RUN_DIR/job.json``): what ``spikeguard resume`` supervises
again when no supervisor is alive."""


def _refuse(path: Path, what: str) -> UnsafePath:
    return UnsafePath(
        f"{path} is {what}: the supervisor refuses to write through it. The run directory holds "
        "only the supervisor's own files: remove it, or use another --run-dir."
    )


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if missing, ``path`` itself mode 0700 whatever the umask.

    A directory that is already there keeps its mode: ``--run-dir`` may name one the user owns
    or shares (a 1777 scratch directory), and only what spikeguard creates is spikeguard's to
    change. What it writes inside is private anyway (every file 0600).

    An existing one must be this user's (a symlink: the link and the directory it names): one
    another user made is :class:`UnsafePath` (in a shared 1777 directory anyone may create
    ``RUN_DIR/plans`` before the run does, and then swap its plans)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        for st in (os.lstat(path), os.stat(path)):  # a link of ours to a directory of ours
            if st.st_uid != os.geteuid():
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory"
                raise _refuse(path, f"{what} of another user (uid {st.st_uid})") from None
        if not path.is_dir():
            raise
        return path
    os.chmod(path, 0o700)  # the umask may have taken bits of 0700 away
    return path


def _open_private(path: Path, flags: int) -> int:
    """An fd of ``path`` (created 0600 if missing) opened with ``flags``, never through a symlink;
    :class:`UnsafePath` for a link or anything but a regular file."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, "not a regular file")
    if st.st_uid != os.geteuid():  # planted beforehand in a directory others can write
        os.close(fd)
        raise _refuse(path, f"a file of another user (uid {st.st_uid})")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    return fd


def open_append(path: Path) -> BinaryIO:
    """``path`` opened for appending bytes: created 0600, made 0600, never through a symlink
    (:class:`UnsafePath`)."""
    return os.fdopen(_open_private(path, os.O_WRONLY | os.O_APPEND), "ab")


def write_atomic(path: Path, text: str | bytes, *, fsync: bool = False) -> None:
    """Replace ``path`` with ``text`` (str as UTF-8, or bytes), mode 0600: written to a
    ``mkstemp`` file beside it, then renamed over it (a symlink at ``path`` is replaced, its
    target untouched). An ``OSError`` (a full disk) leaves ``path`` as it was, no temp file,
    and names ``path``."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        _raise_naming(e, path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            _raise_naming(e, path)
        raise


def _raise_naming(error: OSError, path: Path) -> NoReturn:
    """Raise ``error`` as an ``OSError`` of its errno that names ``path`` (a write's ENOSPC
    names no file)."""
    if error.errno is None:
        raise error
    raise OSError(error.errno, error.strerror or str(error), str(path)) from error


class Unwritable(OSError):
    """A file of the run directory that the supervisor must write (the journal, ``FENCE``, a
    plan) could not be written: a full disk, a quota, an I/O error. The supervisor stops
    cleanly on it (:meth:`~.controller.Controller.run`); the message says which file and why."""


class LineFile:
    """A file of JSON lines the supervisor appends to: the journal, ``reports.jsonl``.

    Opened like :func:`open_append` (0600, ``O_NOFOLLOW``: a planted link is refused). Written
    unbuffered, whole records at a time: :meth:`append` hands the bytes to the kernel at once
    and, when that (or its fsync) fails - a full disk - truncates the file back to where it was,
    so no fragment of a record reaches the disk later, to be glued to the next one. A torn last
    line (a crash mid-write) is ended by the first append after opening, so the record after it
    starts on a line of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = _open_private(path, os.O_RDWR | os.O_APPEND)
        self._torn = self._ends_torn()

    def _ends_torn(self) -> bool:
        size = os.fstat(self._fd).st_size
        return size > 0 and os.pread(self._fd, 1, size - 1) != b"\n"

    def append(self, data: bytes, *, fsync: bool = False) -> None:
        """Append ``data`` (whole lines, each ending in a newline), fsynced with ``fsync``; on
        ``OSError`` none of it stays in the file, and the error is raised."""
        if self._torn:
            data = b"\n" + data
        start = os.fstat(self._fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            if fsync:
                os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass  # the fragment stays: the next append ends it first (a line readers skip)
            self._torn = self._ends_torn()
            raise
        self._torn = False

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


REPORTS_PENDING_MAX = 64 << 20
"""How many bytes of records :class:`RecordLog` keeps in memory while its file cannot be written
(then it drops them, counted)."""
REPORTS_FLUSH_AT = 1 << 20
"""A :class:`RecordLog` holding this many unwritten bytes writes them without waiting for the
tick's :meth:`~RecordLog.flush`."""


class RecordLog:
    """``reports.jsonl``: records kept in memory and appended once a tick, best effort.

    A record of what the ranks sent, read by ``policy replay`` and ``report``; no decision
    depends on it, so a file that cannot be written (a full disk) never stops the run: the
    records wait in memory (up to :data:`REPORTS_PENDING_MAX` bytes, then they are dropped and
    counted), are written once it can be, and the outage is logged once, with its end. Each
    write is whole records or nothing (:class:`LineFile`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = LineFile(path)
        self._pending: list[bytes] = []
        self._bytes = 0
        self.failing: OSError | None = None
        """Why the last write failed, while the file cannot be written."""
        self.lost = 0
        """Records dropped while the file could not be written (this run)."""

    def write(self, record: bytes) -> None:
        """Queue ``record`` (one line, newline included)."""
        self._pending.append(record)
        self._bytes += len(record)
        if self._bytes >= REPORTS_FLUSH_AT and self.failing is None:
            self.flush()

    def flush(self) -> None:
        """Append what is queued; on failure keep it queued (or drop it past the bound)."""
        if not self._pending:
            return
        try:
            self._file.append(b"".join(self._pending))
        except OSError as e:
            if self.failing is None:
                log.warning(
                    f"cannot write {self.path} ({e}): the rank messages it records wait in "
                    "memory and are written when it can be; the run goes on"
                )
            self.failing = e
            if self._bytes > REPORTS_PENDING_MAX:
                self.lost += len(self._pending)
                log.warning(f"{len(self._pending)} records for {self.path} dropped (in memory)")
                self._pending, self._bytes = [], 0
            return
        self._pending, self._bytes = [], 0
        if self.failing is not None:
            self.failing = None
            lost = f" ({self.lost} records were dropped meanwhile)" if self.lost else ""
            log.info(f"{self.path} is written again{lost}")

    def close(self) -> None:
        """Write what is queued (if it can be), then close."""
        self.flush()
        self._file.close()


def refuse_links(run_dir: Path) -> None:
    """Raise :class:`UnsafePath` if a file the supervisor appends to is a symlink (checked before
    anything is read from the run directory; the opens themselves use ``O_NOFOLLOW`` too)."""
    for name in APPEND_ONLY:
        if (run_dir / name).is_symlink():
            raise _refuse(run_dir / name, "a symbolic link")


def prepare(run_dir: Path) -> None:
    """Make the run directory private before a supervisor writes to it: ``RUN_DIR``, ``plans/``
    and ``logs/`` 0700, ``journal.jsonl`` and ``reports.jsonl`` created or made 0600
    (:class:`UnsafePath` if one is a symlink)."""
    private_dir(run_dir)
    for sub in ("plans", "logs"):
        private_dir(run_dir / sub)
    for name in ("journal.jsonl", "reports.jsonl"):
        open_append(run_dir / name).close()


def private_log(path: Path) -> None:
    """Create a rank's log file 0600 in a 0700 directory before its agent appends to it; a
    symlink planted there is removed first (its target untouched)."""
    private_dir(path.parent)
    if path.is_symlink():
        path.unlink()
    open_append(path).close()


def highest_generation(run_dir: Path) -> int:
    """The highest generation with a plan or a log on disk (a launch that began, journaled or
    not)."""
    best = 0
    for sub in ("plans", "logs"):
        try:
            names = os.listdir(run_dir / sub)
        except OSError:
            continue
        for n in names:
            m = _GEN_RE.match(n)
            if m:
                best = max(best, int(m.group(1)))
    return best


LOCK_NAME = "supervisor.lock"


class LockHeld(RuntimeError):
    """Another supervisor holds the run directory's lock."""


def acquire_lock(run_dir: Path) -> IO[str]:
    """Hold ``RUN_DIR/supervisor.lock`` for this process's lifetime (the kernel releases it on
    any exit).

    Raises :class:`LockHeld` naming the holder when another supervisor runs this run directory,
    :class:`UnsafePath` when the lock file is a symlink. Creates ``run_dir`` 0700, the lock 0600.
    """
    import fcntl

    private_dir(run_dir)
    f = os.fdopen(_open_private(run_dir / LOCK_NAME, os.O_RDWR), "r+", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise LockHeld(f"another supervisor holds {run_dir / LOCK_NAME} ({holder})") from None
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    holder = f"pid {os.getpid()} on {socket.gethostname()} since {since}"
    try:  # who holds it is for people (``spikeguard stop``): the flock is the lock
        os.ftruncate(f.fileno(), 0)
        os.pwrite(f.fileno(), (holder + "\n").encode(), 0)
    except OSError as e:
        log.warning(f"cannot write who holds {run_dir / LOCK_NAME} ({e}); the lock is held")
    return f


def lock_holder(run_dir: Path) -> str | None:
    """Who holds ``RUN_DIR/supervisor.lock`` now (the holder's ``pid … on HOST`` line), or None
    when no process does: no supervisor runs this directory (it finished, or it died).

    A non-blocking shared ``flock`` probe that writes nothing; :class:`UnsafePath` when the lock
    is a symlink, ``OSError`` when the file system cannot tell.
    """
    import fcntl

    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(run_dir / LOCK_NAME, "a symbolic link") from None
        raise
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "a process that wrote nothing"
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


def write_status(run_dir: Path, data: dict[str, Any]) -> None:
    """Rewrite ``RUN_DIR/status.json`` (atomically, 0600)."""
    write_atomic(run_dir / "status.json", json.dumps(data))
