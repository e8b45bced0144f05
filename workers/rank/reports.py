"""What a rank says to the supervisor, what the supervisor asks of it, and the fence.

* :class:`Reporter` puts every message on the report channel with its header (format version,
  run, generation, rank, step, time), from any thread (an asynchronous save's commit reports
  from its own);
* :class:`Requests` keeps the supervisor's requests (a checkpoint now, the batch ids of an
  incident) until the rank answers them, and the ring buffer of ``batch_ids`` those answers
  come from;
* :class:`Fence` refuses a checkpoint of a generation the supervisor has replaced.

Torch-free: none of it looks at a tensor.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import batches, contract
from ..channel import Channel, NullChannel


class StaleGenerationError(RuntimeError):
    """This rank belongs to a generation the supervisor has already replaced."""


class Reporter:
    """One rank's messages, on ``channel`` (see :mod:`spikeguard.workers.channel`)."""

    def __init__(
        self, channel: Channel | NullChannel, *, run_id: str, generation: int, rank: int
    ) -> None:
        self.channel = channel
        """The report channel (its ``poll_requests`` brings the supervisor's requests)."""
        self._header = {"run": run_id, "gen": generation, "rank": rank}
        self._lock = threading.Lock()

    def send(self, type_: str, step: int, **fields: Any) -> bool:
        """Send a ``type_`` message of ``step``; never blocks (see :meth:`Channel.send`).

        When the user's ``extra`` metrics cannot be encoded, the message goes without them
        (``extra_dropped`` says why): a rank whose every step is refused would look hung."""
        msg = {
            "v": contract.FORMAT_VERSION,
            "type": type_,
            **self._header,
            "step": step,
            "t": time.time(),
        }
        msg.update(fields)
        with self._lock:
            refused = getattr(self.channel, "dropped_unencodable", 0)
            if self.channel.send(msg):
                return True
            if "extra" in msg and getattr(self.channel, "dropped_unencodable", 0) > refused:
                del msg["extra"]
                msg["extra_dropped"] = str(getattr(self.channel, "last_unencodable", "unencodable"))
                return self.channel.send(msg)
            return False

    def poll_requests(self) -> list[dict[str, Any]]:
        """The supervisor's requests received since the last call (never blocks)."""
        return self.channel.poll_requests()

    def close(self, timeout: float) -> None:
        """Flush what is queued (up to ``timeout`` seconds) and stop the channel."""
        self.channel.close(timeout)


class Requests:
    """The supervisor's ``checkpoint`` and ``batch_ids`` requests, from arrival to answer.

    Request ids are numbered per request type and only grow; a request seen once is never
    taken again. A checkpoint request is *pending* until :meth:`claim` (or
    :meth:`claim_agreed`) says a checkpoint is due, then *answering* until the next checkpoint
    message lists it (:meth:`answered`)."""

    def __init__(self, reporter: Reporter, *, batch_ids_window: int) -> None:
        self._reporter = reporter
        self.ring: collections.deque[tuple[int, Any]] = collections.deque(maxlen=batch_ids_window)
        """The last steps' ``(step, batch_ids)``, oldest first: what a ``batch_ids`` request is
        answered with."""
        self._pending: list[int] = []
        """Ids of checkpoint requests not yet claimed by a checkpoint decision."""
        self._answering: list[int] = []
        """Ids claimed: the next checkpoint message answers them."""
        self._seen: set[tuple[str, int]] = set()
        """(type, id) of every request taken."""
        self._batch: list[int] = []
        """Ids of ``batch_ids`` requests not answered yet (answered at the end of a step)."""
        self._agreed = 0
        """The newest checkpoint request id the ranks agreed to answer (the same on every
        rank: it only ever comes from a collective)."""

    def record(self, step: int, batch_ids: Any) -> None:
        """Keep ``batch_ids`` of ``step`` in the ring (the oldest entry falls out)."""
        self.ring.append((step, batch_ids))

    def take(self) -> None:
        """Move the supervisor's new requests off the channel (a queue check; never blocks)."""
        for req in self._reporter.poll_requests():
            rid, kind = req.get("id"), req.get("type")
            if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(kind, str):
                continue
            if (kind, rid) in self._seen:
                continue
            if kind == "checkpoint" and rid <= self._agreed:
                continue  # answered already: another rank saw it first
            self._seen.add((kind, rid))
            if kind == "checkpoint":
                self._pending.append(rid)
            elif kind == "batch_ids":
                self._batch.append(rid)

    def answer_batch_ids(self, step: int) -> None:
        """Take new requests, then send the ring for each pending ``batch_ids`` request (an
        incident: the supervisor stores it for forensics and for skipping those batches);
        ``step`` is the step just finished."""
        self.take()
        if not self._batch:
            return
        entries, truncated = batches.answer_entries(self.ring)
        for rid in self._batch:
            self._reporter.send(
                "batch_ids",
                step,
                request=rid,
                window=self.ring.maxlen,
                entries=entries,
                truncated=truncated,
            )
        self._batch = []

    def claim(self) -> bool:
        """Whether a checkpoint request is pending; if so the next checkpoint answers it."""
        if not self._pending:
            return False
        self._answering += self._pending
        self._pending = []
        return True

    def claim_agreed(self, agree_max: Callable[[int], int]) -> bool:
        """The collective form of :meth:`claim`: the ranks agree (``agree_max``, a collective
        max) on the newest request any of them has seen, and every request up to it is
        claimed, so every rank says yes at the same step."""
        newest = max(self._pending, default=0)
        agreed = agree_max(newest)
        if agreed <= self._agreed:
            return False
        self._answering += [r for r in self._pending if r <= agreed]
        if agreed not in self._answering:
            self._answering.append(agreed)  # another rank saw it first
        self._pending = [r for r in self._pending if r > agreed]
        self._agreed = agreed
        return True

    def answered(self) -> list[int]:
        """The ids a checkpoint made now answers (claimed or pending), forgotten from here."""
        answered = self._answering + self._pending
        self._answering, self._pending = [], []
        return answered


class Fence:
    """Refuses writes of a generation the FENCE file says was replaced (a frozen node that
    wakes up after its replacement must not overwrite anything)."""

    def __init__(self, fence_file: str | None, *, generation: int, rank: int) -> None:
        self._file = fence_file
        self._generation = generation
        self._rank = rank

    def check(self) -> None:
        """Raise :class:`StaleGenerationError` if this rank's generation was replaced."""
        if not self._file:
            return
        try:
            with open(self._file, encoding="utf-8") as f:
                current = int(f.read().strip() or 0)
        except FileNotFoundError:
            return
        if current > self._generation:
            raise StaleGenerationError(
                f"rank {self._rank} of generation {self._generation} was fenced "
                f"(current generation {current}); checkpoint refused"
            )
