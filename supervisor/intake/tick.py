"""What a tick reads first, and every accepted message recorded in ``reports.jsonl`` in order.

:class:`TickReader` takes a tick's polls and hands their accepted messages, one at a time, to the
controller's ``evaluate`` callback, in the order that decides soonest (:meth:`TickReader.read`).
Which ranks may decide is the policy engine's to say (``Engine.pending_ranks``,
``Engine.quiet``): the reader only orders. When a decision fences the generation, the effect
that kills it calls :meth:`TickReader.record_rest`: what the tick brought and was not evaluated
yet is recorded, never evaluated. Ranks whose layer names passed the collector's cap are
journaled once each, through ``note`` (one ``alert`` a tick that found any).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from spikeguard.workers.contract.logs import logger

from .. import rundir
from ..decide import events
from ..launch.interface import RankPoll
from .collector import Accepted, Collector

log = logger(__name__)


class Screen(Protocol):
    """What the reader asks the policy engine (``spikeguard.policies.Engine``)."""

    def pending_ranks(self) -> set[int]: ...

    def quiet(self, msgs: list[Any]) -> bool: ...


class ReportLog:
    """``RUN_DIR/reports.jsonl``: every accepted message, in the order it was evaluated."""

    def __init__(self, path: Path) -> None:
        self._file = rundir.RecordLog(path)  # no symlink, torn line ended, best effort

    def write(self, msg: dict[str, Any]) -> None:
        """Append ``msg`` (flushed once a tick, and before a kill waits)."""
        if isinstance(msg, Accepted):
            self._file.write(msg.record())  # the rank's own line, with ``at``
        else:  # an exit or hang the collector made
            self._file.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TickReader:
    """Reads a tick's polls through the collector, records each accepted message, evaluates it."""

    def __init__(
        self,
        *,
        collector: Collector,
        screen: Screen,
        reports: ReportLog,
        evaluate: Callable[[dict[str, Any]], None],
        note: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.collector, self.screen, self.reports = collector, screen, reports
        self.evaluate = evaluate
        """Evaluate one accepted message (already recorded)."""
        self.note = note
        """Journal an event of the intake's own (the controller's ``_event``); None: logged
        only."""
        self._polls: collections.deque[tuple[RankPoll, float]] = collections.deque()
        """The current tick's polls (with the time they came) not validated yet."""
        self._read: collections.deque[tuple[RankPoll, list[Accepted], float]] = collections.deque()
        """The current tick's polls validated but not evaluated yet (with their messages and
        the time they came), in the order :meth:`read` chose."""
        self._unfed: collections.deque[dict[str, Any]] = collections.deque()
        """Accepted messages of the rank being evaluated not recorded and evaluated yet."""
        self._screen_failed = False

    def read(self, polls: list[RankPoll], now: float) -> None:
        """Read, record and evaluate a tick's polls, in the order that decides soonest:

        1. the ranks a rule is part-way to firing on (its ``for:`` not reached yet,
           ``Engine.pending_ranks``): their next message may fire it whatever it says, so each
           is read and evaluated before anything else is validated (a rank a rule already
           holds on is not among them: a thousand ranks holding a warning would make this the
           whole tick);
        2. the other polls are validated, and those whose messages may decide something
           (``Engine.quiet`` says no: a rule active on the rank, a value a rule's condition may
           hold on, a message that is not a heartbeat) are evaluated next, in poll order;
        3. then the quiet ones, which decide nothing.

        In lockstep every rank's heartbeat arrives in the same tick; a decision no longer waits
        for the evaluation of every rank read before it (a thousand ranks: a whole tick). The
        order within a tick is the supervisor's to choose (a tick's polls come in rank order,
        not in arrival order); a rank's own messages keep theirs, and ``reports.jsonl`` records
        the messages in the order they were evaluated, so a replay decides the same. The order
        never changes a decision, only when in the tick it is made (one case the screen does
        not foresee: a rule scoped over ranks that ranks evaluated in between bring to the edge
        of firing; it is then decided in its turn, later in the tick)."""
        pending = self.screen.pending_ranks()
        first = [p for p in polls if p.rank in pending]
        self._polls.extend((p, now) for p in first)
        self._polls.extend((p, now) for p in polls if p.rank not in pending)
        for _ in first:  # 1.
            if not self._polls:
                break  # a decision fenced the generation: the kill recorded the rest
            poll, at = self._polls.popleft()
            self.feed(self.collector.ingest_poll(poll, at))
        quiet: list[tuple[RankPoll, list[Accepted], float]] = []
        while self._polls:  # 2. and 3.: validated first, taken in when evaluated
            poll, at = self._polls.popleft()
            msgs = self.collector.read_poll(poll)
            may_decide = poll.exit_code is not None or (msgs and not self._quiet(msgs))
            (self._read if may_decide else quiet).append((poll, msgs, at))
        self._read.extend(quiet)
        while self._read:
            self.feed(self.collector.accept_poll(*self._read.popleft()))
        self.note_capped()

    def note_capped(self) -> None:
        """Journal (once a rank) the ranks whose layer names passed the collector's cap since
        the last call: at the end of a tick's reading, never from inside an effect (a kill's
        :meth:`record_rest` leaves them to the next tick)."""
        capped = self.collector.take_capped()
        if not capped:
            return
        ev = events.layers_capped_event(capped, self.collector.layer_gate.limit)
        log.warning("%s", ev["reason"])
        if self.note is not None:
            self.note(ev)

    def _quiet(self, msgs: list[Accepted]) -> bool:
        """``Engine.quiet``; a screen that fails costs the order of the tick (its messages are
        taken as ones that may decide), never the supervisor."""
        try:
            return bool(self.screen.quiet(msgs))
        except Exception as e:
            if not self._screen_failed:
                self._screen_failed = True
                log.warning("the policy engine's screen failed (%r); read in order", e)
            return False

    def feed(self, msgs: list[dict[str, Any]]) -> None:
        """Record and evaluate accepted messages one by one, in arrival order (a decision comes
        as soon as its message is read, not after the rest of the poll). When a decision fences
        the generation, the kill records what is left of them first (:meth:`record_rest`):
        every accepted message reaches ``reports.jsonl``, in order, evaluated or not."""
        self._unfed.extend(msgs)
        while self._unfed:
            msg = self._unfed.popleft()
            self.reports.write(msg)
            self.evaluate(msg)

    def record_rest(self) -> None:
        """Record, without evaluating, what this tick brought and was not fed yet (the
        generation is being fenced: the rest of the tick, such as the steps a slower rank had
        queued)."""
        while self._unfed:
            self.reports.write(self._unfed.popleft())
        while self._read:
            for msg in self.collector.accept_poll(*self._read.popleft()):
                self.reports.write(msg)
        while self._polls:
            poll, at = self._polls.popleft()
            for msg in self.collector.ingest_poll(poll, at):
                self.reports.write(msg)
        self.reports.flush()
