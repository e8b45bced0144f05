"""Opening a checkpoint's files on POSIX: regular files only, never through a symlink, never
blocking. The primitives behind :class:`~.storage.PosixStorage`; nothing else uses them.

A checkpoint directory is shared with whatever else can write to it, so a name shaped like a
checkpoint may be a FIFO (opening it for reading would wait for a writer forever), a device, a
directory, or a symlink (to a file elsewhere, or in a loop). :func:`open_regular` opens without
following a symlink and without blocking, then checks on the open descriptor that it is a
regular file, so what is checked is what is read. Torch-free; it knows nothing of checkpoints.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO, Literal

_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_LINK_ERRNOS = {errno.ELOOP, errno.EMLINK}  # EMLINK: O_NOFOLLOW on a link, on FreeBSD

Kind = Literal["file", "dir", "symlink", "other"]
"""What a storage entry is: a regular file (an object), a directory (a prefix), a symbolic link
(never followed) or anything else (a FIFO, a device, a socket)."""


class NotRegularFile(OSError):
    """The path is a symlink, a FIFO, a directory, a device or a socket."""


def kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO"``)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def kind_of(mode: int) -> Kind:
    """The :data:`Kind` of a file of ``st_mode`` ``mode``."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def check_regular(path: str, what: Kind, words: str) -> None:
    """Raise :class:`NotRegularFile` unless ``what`` is ``"file"`` (``words``: the kind in
    words, for the message). Every storage refuses a non-regular file with these words."""
    if what == "symlink":
        raise NotRegularFile(f"{path} is a symbolic link, not a regular file (never followed)")
    if what != "file":
        raise NotRegularFile(f"{path} is {words}, not a regular file")


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file (the caller closes it).

    Never blocks (a FIFO is opened non-blocking and refused) and never follows a symlink in the
    last component. Raises :class:`NotRegularFile` for anything but a regular file, or the
    ``OSError`` of the open (``FileNotFoundError``, EACCES, EIO, ENAMETOOLONG...).
    """
    try:
        fd = os.open(path, _FLAGS)
    except OSError as e:
        if e.errno in _LINK_ERRNOS and _is_link(path):
            raise NotRegularFile(
                f"{path} is a symbolic link, not a regular file (never followed)"
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        check_regular(path, kind_of(mode), kind(mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def fsync_directory(directory: str) -> None:
    """Make the entries of ``directory`` (a new, renamed or removed file) durable."""
    fd = os.open(directory or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_link(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False
