"""How big a policy or job file may be: its size, its nesting, its integers.

A policy or job file is input from a person or a generator, and it is read on the control plane:
a file of 50 MB, a list nested 20,000 deep or a 5,000-digit integer must cost one clear error
(``FILE:LINE:COL: field: message``), never a stall, a ``RecursionError`` or a traceback. The
loader (:mod:`.loader`) applies these limits before and while it composes the YAML.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 1 << 20
"""The largest policy or job file read (the built-in policies are a few KiB)."""

MAX_DEPTH = 64
"""The deepest nesting of lists and mappings (the document's top-level mapping is level 1)."""

MAX_INT = 2**53
"""The largest magnitude of an integer in a policy or job file: beyond it a float cannot hold it
exactly, and the engine does float arithmetic with counts and durations."""

_MAX_DIGITS = 20  # any integer written with more significant digits is beyond MAX_INT


def too_large_text(n_bytes: int | None) -> str:
    """The error for a file of ``n_bytes`` bytes (None: more than the cap, size unknown)."""
    size = "larger than 1 MiB"
    if n_bytes is not None:
        size = f"{n_bytes / (1 << 20):.1f} MiB"
    return f"the file is {size}; policies and job files are at most 1 MiB"


def read_capped(path: str | Path) -> str:
    """The text of ``path`` (UTF-8), read no further than :data:`MAX_FILE_BYTES`.

    Raises ``ValueError`` (with :func:`too_large_text`'s message) for a larger file, measured
    before reading when the file says its size, otherwise by reading one byte more than the cap
    (a pipe); ``OSError`` and ``UnicodeDecodeError`` as reading raises them.
    """
    with open(path, "rb") as f:
        size = _regular_size(f.fileno())
        if size is not None and size > MAX_FILE_BYTES:
            raise ValueError(too_large_text(size))
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(too_large_text(None))
    return raw.decode("utf-8")


def _regular_size(fd: int) -> int | None:
    """The size of the open file ``fd`` if it is a regular file (a pipe does not know its own)."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    return None


def int_problem(text: str) -> str | None:
    """Why the YAML integer ``text`` (decimal, ``0x`` hex or ``0o`` octal, optionally signed) is
    out of range, or None. Never converts more than :data:`_MAX_DIGITS` digits."""
    digits = text.lstrip("+-")
    base = 10
    if digits.startswith("0x"):
        base, digits = 16, digits[2:]
    elif digits.startswith("0o"):
        base, digits = 8, digits[2:]
    digits = digits.lstrip("0")
    if len(digits) > _MAX_DIGITS or abs(int(digits or "0", base)) > MAX_INT:
        return f"{abbreviate(text)} is too large: integers are at most 2^53 ({MAX_INT}) in size"
    return None


def abbreviate(text: str, keep: int = 24) -> str:
    """``text``, or its start and its length when it is longer than ``keep`` characters."""
    if len(text) <= keep:
        return text
    return f"{text[:keep]}... ({len(text)} characters)"
