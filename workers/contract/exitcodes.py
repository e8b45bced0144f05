"""The ``spikeguard`` process exit codes, in one place (the README's table mirrors this)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Exit codes of ``spikeguard`` (``submit`` and every other command)."""

    COMPLETED = 0
    """The run completed (for the other commands: done, no problem)."""
    OK = 0
    FAILED = 1
    """A rank crashed with no rule recovering it, or launches kept failing."""
    BAD_INPUT = 2
    """A job or policy file is invalid, the run directory is held by another supervisor (or is
    unsafe: a planted symlink), or a command has nothing to act on (``stop`` without a live
    supervisor)."""
    ESCALATED = 3
    """The recovery budget is spent, no healthy checkpoint exists, or the job is held."""
    STOPPED = 5
    """Stopped by ``spikeguard stop`` or a policy ``stop`` rule."""
    INTERRUPTED = 130
    """Ctrl-C: the run is stopped (a re-submit says so and starts nothing)."""
    PREEMPTED = 143
    """SIGTERM (pod eviction, spot reclaim, ``ray job stop``): after an emergency checkpoint the
    supervisor went away on purpose; ``spikeguard submit`` on the same run directory resumes."""
