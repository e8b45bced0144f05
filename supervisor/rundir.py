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
every file the supervisor writes there 0600, whatever the umask. Nothing is written through a
symlink planted in it: a file rewritten whole (:func:`write_atomic`: status.json, FENCE, STOP,
plans, batch ids, metrics.url, report.html) is a ``mkstemp`` file in the same directory renamed
over the path, which replaces a link and leaves its target untouched; a file opened for appending
(the journal, reports.jsonl, the lock) is opened with ``O_NOFOLLOW`` and a link there is refused
(:class:`UnsafePath`, ``submit`` exits 2).
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
from typing import IO, Any, BinaryIO

_GEN_RE = re.compile(r"^gen(\d+)")
APPEND_ONLY = ("journal.jsonl", "reports.jsonl", "supervisor.lock")
"""The files opened for appending (or locking), where a planted symlink is refused."""


class UnsafePath(RuntimeError):
    """A path in the run directory is a symbolic link (or not a regular file) where the
    supervisor would write: refused rather than written through."""


def _refuse(path: Path, what: str) -> UnsafePath:
    return UnsafePath(
        f"{path} is {what}: the supervisor refuses to write through it. The run directory holds "
        "only the supervisor's own files: remove it, or use another --run-dir."
    )


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if missing; make ``path`` itself mode 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(os.stat(path).st_mode) != 0o700:
        os.chmod(path, 0o700)
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
    target untouched)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
    f.seek(0)
    f.truncate()
    f.write(
        f"pid {os.getpid()} on {socket.gethostname()} "
        f"since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
    )
    f.flush()
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
