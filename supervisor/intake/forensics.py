"""Batch forensics: the ranks' recent batch ids, asked for at an incident and kept with it.

At an incident's kill the controller sends every rank a ``batch_ids`` request and waits a short,
bounded time (job ``timeouts.batch_ids_s``) for the answers: each rank replies with the ring
buffer of the ``batch_ids`` its script passed to ``step()`` (the last 200 steps by default). This
module is the pure part: which file an incident's answers go to, the document written there, and
the event that tells the journal (and Slack) about it. The controller does the asking and the
writing (through :mod:`.rundir`: 0600, never through a symlink); ``spikeguard report`` reads the
files back (:func:`read_batch_ids`).

The file (``RUN_DIR/incidents/<incident>/batch_ids-<attempt>.json``)::

    {"incident": "inc-001", "attempt": 1, "generation": 1, "incident_step": 775,
     "asked": [0, 1], "answered": [0, 1], "waited_s": 0.4,
     "ranks": {"0": {"step": 776, "window": 200, "truncated": 0,
                     "entries": [[577, <batch ids>], ..., [776, <batch ids>]]}, ...}}

A policy with ``recovery.skip_by: batch_ids`` hands the file to the relaunched ranks, which skip
the batches recorded for the incident's window wherever they come up again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from spikeguard.workers import batches

from ..decide.events import Kind

INCIDENTS_DIR = "incidents"
_INCIDENT_RE = re.compile(r"^inc-\d{1,9}$")


def batch_ids_path(run_dir: str | os.PathLike[str], incident: str, attempt: int) -> Path:
    """Where the answers of ``incident``'s attempt ``attempt`` are kept. ``ValueError`` for an
    incident id that is not the machine's ``inc-NNN`` (it becomes a directory name)."""
    if not _INCIDENT_RE.match(incident) or attempt < 1:
        raise ValueError(f"not an incident and attempt: {incident!r}, {attempt!r}")
    return Path(run_dir) / INCIDENTS_DIR / incident / f"batch_ids-{attempt}.json"


class Answers:
    """The answers to one ``batch_ids`` request, as they come in."""

    def __init__(
        self, *, incident: str, attempt: int, generation: int | None, asked: list[int]
    ) -> None:
        self.incident, self.attempt, self.generation = incident, attempt, generation
        self.asked = sorted(asked)
        self.ranks: dict[int, dict[str, Any]] = {}

    def add(self, msg: dict[str, Any]) -> None:
        """Keep a validated ``batch_ids`` message (the first answer of a rank counts)."""
        rank = msg["rank"]
        if rank in self.ranks:
            return
        self.ranks[rank] = {
            "step": msg.get("step"),
            "window": msg.get("window"),
            "truncated": msg.get("truncated") or 0,
            "entries": msg.get("entries") or [],
        }

    def document(self, *, incident_step: int | None, waited_s: float) -> dict[str, Any]:
        """What the incident's file holds (see the module docstring)."""
        return {
            "incident": self.incident,
            "attempt": self.attempt,
            "generation": self.generation,
            "incident_step": incident_step,
            "asked": self.asked,
            "answered": sorted(self.ranks),
            "waited_s": round(waited_s, 3),
            "ranks": {str(r): self.ranks[r] for r in sorted(self.ranks)},
        }


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """How many batches a document records, over which steps, and how many were left out."""
    steps: list[int] = []
    truncated = 0
    for answer in _answers(doc):
        left_out = answer.get("truncated") if isinstance(answer, dict) else None
        if isinstance(left_out, int) and not isinstance(left_out, bool):
            truncated += left_out
        for entry in _entries(answer):
            steps.append(entry[0])
    return {
        "batches": len(steps),
        "steps": [min(steps), max(steps)] if steps else None,
        "truncated": truncated,
    }


def holds_no_ids(summary_: dict[str, Any]) -> bool:
    """Whether a document's :func:`summary` (or a ``forensics`` event) records no batch id at
    all: the ranks answered, but the script passes none to ``sg.step()`` (the HF and Lightning
    callbacks do not): nothing to file or say."""
    return summary_.get("batches") == 0 and not summary_.get("truncated")


def event(doc: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The ``forensics`` journal event for a document (``path`` None: nothing was written)."""
    s = summary(doc)
    answered, asked = doc["answered"], doc["asked"]
    if answered:
        why = (
            f"at the kill of {doc['incident']} (attempt {doc['attempt']}), {len(answered)} of "
            f"{len(asked)} ranks sent their recent batch ids within {doc['waited_s']:.2f} s"
        )
    else:
        why = (
            f"at the kill of {doc['incident']} (attempt {doc['attempt']}), no rank sent its "
            f"batch ids within {doc['waited_s']:.2f} s (ranks that hang or crashed cannot)"
        )
    return {
        "kind": Kind.FORENSICS.value,
        "incident": doc["incident"],
        "reason": why,
        "attempt": doc["attempt"],
        "path": None if path is None else str(path),
        "ranks_asked": asked,
        "ranks_answered": answered,
        "waited_s": doc["waited_s"],
        **s,
    }


def read_batch_ids(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A batch-ids file read back (the ranks read it with the same code); ``ValueError`` (with
    the reason) for one that is too large, unreadable or not a batch-ids document."""
    return batches.read_batch_ids(path)


def _answers(doc: dict[str, Any]) -> list[Any]:
    ranks = doc.get("ranks")
    return list(ranks.values()) if isinstance(ranks, dict) else []


def _entries(answer: Any) -> list[list[Any]]:
    entries = answer.get("entries") if isinstance(answer, dict) else None
    if not isinstance(entries, list):
        return []
    out = []
    for e in entries:
        if isinstance(e, list) and len(e) == 2 and type(e[0]) is int:
            out.append(e)
    return out
