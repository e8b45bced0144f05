"""The ``spikeguard`` logger hierarchy: diagnostics of every room, one line each.

Every module logs to ``logging.getLogger(__name__)`` (``spikeguard.supervisor.runner``,
``spikeguard.workers.session``, ...), all below the ``spikeguard`` logger. :func:`logger` returns
that logger after giving the hierarchy its one handler: ``spikeguard: <message>`` on the
process's standard output *at the time of the call* (a rank's stdout is its log file; the
supervisor's is the terminal or the Ray job's log), which is what the command has always printed.
An application that configures logging itself can remove it (``logging.getLogger("spikeguard")
.handlers.clear()``) and route the records where it likes; the level is INFO unless it sets one.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "spikeguard"


class _Stdout(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler on whatever ``sys.stdout`` is when a record is emitted."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value: object) -> None:
        pass

    def handleError(self, record: logging.LogRecord) -> None:
        """A closed pipe (``spikeguard ... | head``) is not a logging error: later records go
        to /dev/null instead of a "--- Logging error ---" block on stderr each."""
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError):
                sys.stdout = open(os.devnull, "w")  # lives as long as stdout
            finally:
                os.close(devnull)
            return
        super().handleError(record)


def logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module's ``__name__``), the hierarchy's handler installed once."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stdout) for h in root.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter(f"{ROOT}: %(message)s"))
        root.addHandler(handler)
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)
