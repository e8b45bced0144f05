"""Errors shared by the supervisor's layers (kept free of Ray so the pure parts can import them)."""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A generation could not be launched (placement, agents, the launch calls); retried as a launch failure."""
