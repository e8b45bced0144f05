"""spikeguard.workers — the part of spikeguard that lives inside each training rank.

Nothing here knows about Ray or the supervisor. The shared vocabulary (environment variables,
messages, grades, the resume plan) is :mod:`.contract`, which needs no torch; everything else
imports torch, so it is loaded on first use: ``import spikeguard.workers`` alone stays cheap and
torch-free (the supervisor imports the contract on a head node without torch).
"""

from __future__ import annotations

from .contract import ResumePlan, format_grade, grade_of, parse_grade
from .lazy import lazy_attributes

_LAZY = {
    "attach": "session",
    "Session": "session",
    "StaleGenerationError": "session",
    "attention_stats": "measure",
    "effective_rank": "measure",
    "effective_rank_ratio": "measure",
    "logz_stats": "measure",
}

__all__ = [
    "ResumePlan",
    "Session",
    "StaleGenerationError",
    "attach",
    "attention_stats",
    "effective_rank",
    "effective_rank_ratio",
    "format_grade",
    "grade_of",
    "logz_stats",
    "parse_grade",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
