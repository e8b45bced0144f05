"""Batch ids for incident forensics, rank side: the answer to a ``batch_ids`` request, and the
set of batches a resume plan says to skip. Torch-free (tensors are converted by duck typing).

The session keeps the ``batch_ids`` of the last steps in a ring buffer. When the supervisor asks
(a ``batch_ids`` request at an incident), :func:`answer_entries` turns the ring into JSON
``[step, ids]`` pairs that fit one report line, newest kept first. After the rollback, a plan with
``skip_batches`` names the file the supervisor stored those answers in; :func:`load_skip_set`
reads the batches of the incident's step window from it, and :func:`batch_key` is how a batch is
recognised again: its ids as canonical JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from .contract.messages import MAX_LINE_BYTES
from .encode import Unencodable, plain

ANSWER_BUDGET = MAX_LINE_BYTES - 4096
"""Bytes the entries of one answer may take (the rest of the line is its header)."""
MAX_SKIP_FILE_BYTES = 256 << 20
"""A batch-ids file larger than this is not read (a real one is at most a few MiB per rank)."""


def plain_ids(ids: Any) -> Any:
    """``ids`` as JSON data: a tensor or an array of any size as a list (batch ids, not weights),
    anything else as :func:`~.encode.plain` converts it; what has no JSON form reads
    ``{"unencodable": reason}``."""
    try:
        tolist = getattr(ids, "tolist", None)
        if callable(tolist) and not isinstance(ids, (list, tuple, dict, str)):
            ids = tolist()
        return plain(ids)
    except Unencodable as e:
        return {"unencodable": e.reason}
    except Exception as e:  # a user type whose tolist() raises
        return {"unencodable": f"{type(e).__name__}: {e}"[:200]}


def batch_key(ids: Any) -> str:
    """How a batch is recognised: its ids as canonical JSON (sorted keys, no spaces)."""
    return json.dumps(plain_ids(ids), sort_keys=True, separators=(",", ":"))


def answer_entries(
    ring: Iterable[tuple[int, Any]], budget: int = ANSWER_BUDGET
) -> tuple[list[list[Any]], int]:
    """The ring's ``(step, ids)`` pairs as ``[step, ids]`` lists, oldest first, and how many of
    the oldest were left out so that the entries fit ``budget`` bytes of JSON."""
    items = list(ring)
    kept: list[list[Any]] = []
    used = 0
    for step, ids in reversed(items):
        entry = [int(step), plain_ids(ids)]
        size = len(json.dumps(entry, separators=(",", ":"))) + 1
        if used + size > budget:
            break
        kept.append(entry)
        used += size
    kept.reverse()
    return kept, len(items) - len(kept)


def read_batch_ids(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The batch-ids file at ``path`` (the supervisor's record of an incident, see
    ``spikeguard.supervisor.intake.forensics``). Raises ``ValueError`` (with the reason) for a file
    that is missing, too large, unreadable or not a batch-ids document (no ``ranks`` object)."""
    try:
        size = os.stat(path).st_size
        if size > MAX_SKIP_FILE_BYTES:
            raise ValueError(f"{path} is {size} bytes, more than {MAX_SKIP_FILE_BYTES}")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, RecursionError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read batch ids from {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), dict):
        raise ValueError(f"{path} is not a batch-ids file (no 'ranks' object)")
    return doc


def load_skip_set(path: str, window: tuple[int, int]) -> set[str]:
    """The :func:`batch_key` of every batch the file at ``path`` records for a step in
    ``window`` (inclusive), over all ranks; ``ValueError`` as :func:`read_batch_ids`."""
    ranks = read_batch_ids(path)["ranks"]
    first, last = window
    keys: set[str] = set()
    for answer in ranks.values():
        entries = answer.get("entries") if isinstance(answer, dict) else None
        for entry in entries if isinstance(entries, list) else ():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)):
                continue
            if first <= entry[0] <= last:
                keys.add(json.dumps(entry[1], sort_keys=True, separators=(",", ":")))
    return keys
