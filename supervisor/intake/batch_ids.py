"""The batch-ids wait: at an incident's kill, the ranks' answers to a ``batch_ids`` request.

A short, bounded read of its own beside the tick's: the generation is being killed, so what
else arrives meanwhile is recorded in ``reports.jsonl`` and not evaluated. Storing the answers
with the incident is the kill's (:mod:`..act.effects`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..launch.interface import Group
from . import forensics
from .collector import Collector

POLL_S = 0.05
"""Between two polls of the ranks while answers are awaited."""


def wait_for_batch_ids(
    *,
    group: Group,
    collector: Collector,
    request_id: int,
    incident: str,
    attempt: int,
    wait_s: float,
    clock: Callable[[], float],
    record: Callable[[dict[str, Any]], None],
) -> tuple[forensics.Answers, float]:
    """Ask the ranks still running for their ring buffers of batch ids and wait for the answers
    up to ``wait_s`` (a rank that exited or fell silent is not waited for). ``clock``: the
    journal's monotonic clock, for the messages' arrival; ``record``: where every other message
    that arrives meanwhile goes. Returns the answers and how long it waited."""
    views = collector.ranks
    asked = [r for r, v in views.items() if v.exit_code is None and not v.done]
    waiting = {r for r in asked if views[r].hang_reported_at is None}
    answers = forensics.Answers(
        incident=incident, attempt=attempt, generation=collector.generation, asked=asked
    )
    t0 = time.monotonic()
    if waiting and group.request({"type": "batch_ids", "id": request_id, "incident": incident}):
        while waiting and time.monotonic() - t0 < wait_s:
            now = clock()
            for poll in group.poll():
                for msg in collector.ingest_poll(poll, now):
                    if msg["type"] == "batch_ids" and msg.get("request") == request_id:
                        answers.add(msg)
                    else:
                        record(msg)
                    if msg["type"] in ("batch_ids", "exit"):
                        waiting.discard(msg["rank"])
            time.sleep(POLL_S)
    return answers, time.monotonic() - t0
