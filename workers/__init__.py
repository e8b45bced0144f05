"""spikeguard.workers — the part of spikeguard that lives inside each training rank.

Torch only; nothing here knows about Ray or the supervisor. The launcher
contract (environment variables and message format) is in :mod:`.contract`.
"""

from .contract import ResumePlan
from .session import Session, StaleGenerationError, attach
from .signals import (
    attention_stats,
    effective_rank,
    effective_rank_ratio,
    format_grade,
    grade_of,
    logz_stats,
    parse_grade,
)

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
