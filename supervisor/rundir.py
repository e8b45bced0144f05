"""The run directory's small files, each written atomically: FENCE, plans, status.json, the lock.

Layout (``RUN_DIR``)::

    journal.jsonl        the event log (journal.py)
    reports.jsonl        every accepted rank message
    status.json          the current state, rewritten every poll
    FENCE                the current generation; older ranks may not publish checkpoints
    STOP                 written by ``spikeguard stop``
    supervisor.lock      held (flock) by the live supervisor: pid and host
    plans/genNNN.json    the resume plan of each relaunch
    logs/genNNN-rankR.log each rank's stdout/stderr
    checkpoints/         what the ranks save
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import IO, Any

_GEN_RE = re.compile(r"^gen(\d+)")


def write_atomic(path: Path, text: str, *, fsync: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


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


class LockHeld(RuntimeError):
    pass


def acquire_lock(run_dir: Path) -> IO[str]:
    """Hold ``RUN_DIR/supervisor.lock`` for this process's lifetime (the kernel releases it on
    any exit).

    Raises :class:`LockHeld` naming the holder when another supervisor runs this run directory.
    """
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / "supervisor.lock", "a+", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise LockHeld(
            f"another supervisor holds {run_dir / 'supervisor.lock'} ({holder})"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(
        f"pid {os.getpid()} on {socket.gethostname()} "
        f"since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
    )
    f.flush()
    return f


def write_status(run_dir: Path, data: dict[str, Any]) -> None:
    write_atomic(run_dir / "status.json", json.dumps(data))
