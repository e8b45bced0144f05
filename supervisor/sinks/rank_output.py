"""The ranks' output on the supervisor's stdout, where Ray users look (``ray job logs``, the
submitter pod's log, the terminal that ran ``spikeguard submit``).

Every rank's stdout and stderr go to ``RUN_DIR/logs/genNNN-rankR.log`` in full; a copy of each
line also reaches the supervisor's stdout, prefixed ``[gen 2 rank 1]``, at most
``max_bytes_per_s`` per rank (a chatty rank cannot drown the supervisor's own story): what is
left out is counted on a line of its own, which names the log that has it all.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import TextIO

from spikeguard.workers.contract.secret_scan import redact

from ..launch.interface import RankPoll
from ..redaction import held_secrets
from .console import say

MAX_LINE_CHARS = 2000
"""A longer line is cut (and says so)."""


class RankOutput:
    """Forwards the ranks' output lines from each poll; see the module docstring."""

    def __init__(
        self,
        *,
        out: TextIO | None = None,
        max_bytes_per_s: float = 16384.0,
        clock: Callable[[], float] = time.monotonic,
        secrets: Iterable[str] | None = None,
    ) -> None:
        self.out = out or sys.stdout
        self.rate = max_bytes_per_s
        self.clock = clock
        self.secrets = tuple(held_secrets(os.environ) if secrets is None else secrets)
        self._budget: dict[int, tuple[float, float]] = {}  # rank -> (allowance, at)
        self._left_out: dict[int, int] = {}

    def __call__(self, poll: RankPoll) -> None:
        """Print ``poll``'s new output lines (within the rank's allowance)."""
        rank, now = poll.rank, self.clock()
        allowance, at = self._budget.get(rank, (self.rate, now))
        allowance = min(self.rate, allowance + (now - at) * self.rate)
        prefix = f"[gen {poll.generation} rank {rank}] "
        shown = []
        for line in poll.output:
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS] + f" … ({len(line) - MAX_LINE_CHARS} chars cut)"
            cost = len(line) + 1
            if cost > allowance:
                self._left_out[rank] = self._left_out.get(rank, 0) + cost
                continue
            allowance -= cost
            shown.append(prefix + redact(line, self.secrets))
        left = self._left_out.get(rank, 0) + poll.output_skipped
        if left and allowance >= 200:
            shown.append(
                f"{prefix}… {left} bytes of output not shown here "
                f"(all of it: RUN_DIR/logs/gen{poll.generation or 0:03d}-rank{rank}.log)"
            )
            self._left_out[rank] = 0
        elif poll.output_skipped:
            self._left_out[rank] = left
        self._budget[rank] = (allowance, now)
        if shown:
            say("\n".join(shown), self.out)  # a closed pipe silences it, never the run
