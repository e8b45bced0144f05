"""The controller: the loop intake -> engine -> decide -> journal -> act. It decides nothing.

Its loop is :meth:`Controller.step`: poll the ranks once; the tick reader (:mod:`.intake.tick`)
validates what they sent and hands each accepted message to :meth:`Controller._evaluate`, which
asks the policy engine for decisions and turns each into the machine's observation
(:mod:`.decide.observation`, pure); :meth:`Controller._apply` steps the pure recovery machine,
journals the events it returns, tells every sink, and carries out the effects it asks for
(:mod:`.act.effects`), whose outcomes are observations again. Classifying exits and hangs is the
collector's, what they mean is the engine's and the machine's; retention, the warm standby and
reaping are upkeep (:mod:`.act.upkeep`) that only journals what it did.

Timeouts use monotonic clocks only (the journal's ``mono``); a wall-clock jump cannot fire a hang.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from spikeguard.workers.contract.exitcodes import ExitCode
from spikeguard.workers.contract.logs import logger

from . import rundir
from .act import upkeep
from .act.effects import Effects
from .decide import events, health
from .decide import recovery as rc
from .decide.observation import observation_of, observations_of
from .intake import operator
from .intake.collector import Collector
from .intake.tick import ReportLog, TickReader
from .journal import Journal
from .launch.interface import Group, RankPoll
from .observe.status import live_status
from .settings import ControllerSettings, RunPaths

log = logger(__name__)


class Sink(Protocol):
    """What the controller tells of every journaled event (see :mod:`.sinks`)."""

    def handle(self, event: dict[str, Any]) -> None: ...


STATUS_EVERY_S = 1.0
"""How often ``status.json`` is rewritten while nothing but the ranks' progress changes."""
STANDBY_CHECK_S = 1.0
"""How often the warm standby is looked after (started, replaced, discarded)."""
FULL_GC_EVERY_S = 60.0
"""How often :meth:`Controller.run` collects cyclic garbage of every generation, between two
ticks. Left to the interpreter, a full collection comes every few seconds at a thousand ranks
and stops the loop for as long as it scans every live object (100-200 ms on a 2-core machine):
in the middle of a tick, that is a decision's latency."""


@contextlib.contextmanager
def _writing(what: str) -> Iterator[None]:
    """An ``OSError`` inside (a write to the run directory that failed: a full disk) becomes
    :class:`~.rundir.Unwritable`, saying ``what`` was being done; one already is passes."""
    try:
        yield
    except rundir.Unwritable:
        raise
    except OSError as e:
        raise rundir.Unwritable(f"{what}: {e}") from e


class Controller:
    """Runs one job until it completes, fails, escalates or is stopped.

    ``checkpoints``: where the ranks' checkpoints are (the job's ``checkpoints.dir``
    resolved; None: ``RUN_DIR/checkpoints``). ``settings`` are
    :class:`~.settings.ControllerSettings`'s fields, as keywords."""

    def __init__(
        self,
        *,
        run_dir: str,
        run_id: str,
        group: Group,
        engine: Any,
        cmd: list[str],
        env: dict[str, str],
        sinks: list[Sink] | None = None,
        on_tick: Callable[[Controller], None] | None = None,
        on_output: Callable[[RankPoll], None] | None = None,
        checkpoints: str | None = None,
        **settings: Any,
    ) -> None:
        self.settings = s = ControllerSettings(**settings)
        self.paths = RunPaths(Path(run_dir), checkpoints).make()
        self.run_dir = self.paths.root
        self.stop_file = self.paths.stop_file
        self.group, self.engine = group, engine
        self.journal = Journal(run_dir, run=run_id)
        self.collector = Collector(
            world_size=s.world_size,
            hang_timeout_s=s.hang_timeout_s,
            first_heartbeat_timeout_s=s.first_heartbeat_timeout_s,
        )
        self.sinks = list(sinks or [])
        self.on_tick = on_tick
        self.on_output = on_output
        """Where the ranks' output lines go besides their logs (the driver's stdout), if set."""
        self.state = rc.State()
        self.waiting: dict[str, Any] | None = None
        """What a launch waits for now (the cluster placing its gang), or None."""
        if hasattr(group, "on_wait"):
            group.on_wait = self._waiting
        self._preempt_reason: str | None = None
        self._standby_checked = float("-inf")
        self._status_key: tuple[Any, ...] | None = None
        self._status_at = float("-inf")
        self._status_failing: OSError | None = None
        self.stopped_because: str | None = None
        """Why the supervisor stopped without the run ending (its run directory could not be
        written), once it did."""
        self.reader = TickReader(
            collector=self.collector,
            screen=engine,
            reports=ReportLog(self.paths.reports),
            evaluate=self._evaluate,
            note=self._event,
        )
        self.effects = Effects(
            paths=self.paths,
            settings=s,
            group=group,
            collector=self.collector,
            engine=engine,
            reader=self.reader,
            cmd=cmd,
            env=env,
            clock=self.journal.mono,
            event=self._event,
            state=lambda: self.state,
            interrupted=lambda: self._preempt_reason,
        )

    # -- the loop -------------------------------------------------------------------------------
    def run(self, resume_events: list[dict[str, Any]] | None = None) -> int:
        """Run to the end. ``resume_events``: the journal of a run a dead supervisor left."""
        self._write_status()
        thresholds = gc.get_threshold()
        gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)  # full collections: ours
        last_full = time.monotonic()
        try:
            if resume_events:
                self.restart(resume_events)
                self.take_requests()  # a resume of an escalated run is what brought it back
            else:
                self._apply(rc.Start(self.settings.launch_retries))
            while self.state.phase not in rc.EXITS:
                self.step()
                if time.monotonic() - last_full >= FULL_GC_EVERY_S:
                    gc.collect()  # between ticks (FULL_GC_EVERY_S)
                    last_full = time.monotonic()
                time.sleep(self.settings.poll_interval_s)
        except rundir.Unwritable as e:
            return self._stop_unwritable(e)
        finally:
            gc.set_threshold(*thresholds)
        self._write_status()
        return self.state.exit_code or 0

    def _stop_unwritable(self, error: rundir.Unwritable) -> int:
        """Stop cleanly when the journal or ``FENCE`` cannot be written (a full disk): without
        them no decision can be recorded nor a generation fenced, so the ranks are killed and
        the supervisor goes away, its reason journaled if the journal can still take it, else
        only printed. The run is not finished: its journal ends where the last append that
        succeeded left it, so ``spikeguard submit`` of the same job resumes it once the disk has
        room, like after a dead supervisor. Exit code 143 (like a preemption: gone, resumable)."""
        self.stopped_because = reason = (
            f"the supervisor stops: {error}. The ranks are killed; the run is not finished: "
            "once the run directory can be written again, `spikeguard submit` of the same job "
            "resumes it"
        )
        log.error("%s", reason)
        self.collector.fence()  # what the ranks still send is no longer evaluated
        try:
            self.group.kill(self.settings.kill_grace_s)
        except Exception as e:  # the ranks go with the supervisor's Ray anyway
            log.warning("killing the ranks failed: %s", e)
        try:
            self._event(
                {
                    "kind": events.Kind.ALERT.value,
                    "incident": self.state.incident.id if self.state.incident else None,
                    "reason": reason,
                    "severity": "page",
                    "error": str(error),
                }
            )
        except rundir.Unwritable as e:
            log.error("the reason could not be journaled either: %s", e)
        self._write_status()
        return ExitCode.PREEMPTED

    def restart(self, events_: list[dict[str, Any]]) -> None:
        """Take over from a dead supervisor: state from the journal, fence, reap survivors, go
        on."""
        self.state = st = rc.fold(events_)
        self._event(
            events.supervisor_start_event(
                phase=st.phase.value,
                generation=st.generation,
                lr_scale=st.lr_scale,
                incident=st.incident.id if st.incident else None,
                pid=os.getpid(),
                host=socket.gethostname(),
            )
        )
        on_disk = rundir.highest_generation(self.run_dir)
        nxt = max(rc.next_generation(st), on_disk + 1)
        with _writing(f"writing {self.paths.fence_file}"):
            self.effects.write_fence(nxt)  # before anything else: survivors may not publish
        self.effects.reap(nxt, "ranks left by the previous supervisor")
        s = self.settings
        self._apply(rc.Restarted(s.default_settings, on_disk, s.launch_retries))

    def preempt(self, reason: str) -> None:
        """Ask the run to go away resumably (call from a signal handler: it only sets a flag)."""
        self._preempt_reason = reason

    def step(self) -> rc.State:
        """One pass: poll ranks, evaluate, transition. Returns the (new) state."""
        now = self.journal.mono()
        self.take_requests()
        if self.state.phase in rc.EXITS:
            return self.state
        if self.stop_file.exists():
            self._apply(rc.StopRequested(self.paths.stop_reason()))
            return self.state
        if self._preempt_reason is not None and self.state.phase not in rc.EXITS:
            self._apply(rc.Preempt(self._preempt_reason))
        if self.state.phase in (*rc.ACTIVE, rc.Phase.PREEMPTING):
            self._read(now)
        if self.state.phase is rc.Phase.PREEMPTING and self.collector.all_done():
            # finished instead of saving (their last step was behind them): completed wins
            self._apply(rc.Finished(self.collector.final_loss()))
        awaited = self.effects.awaited
        if awaited is not None and time.monotonic() >= awaited[1]:
            self.effects.awaited = None
            self._apply(rc.GraceExpired(awaited[0]))
        if self.state.phase is rc.Phase.PROBATION:
            slowest = self.collector.min_step()
            if slowest is not None:
                self._apply(rc.Progress(slowest))
        if self.state.phase in rc.ACTIVE and self.collector.all_finished():
            self._apply(rc.Finished(self.collector.final_loss()))
        if self.on_tick:
            self.on_tick(self)
        self._write_status(every_s=STATUS_EVERY_S)
        return self.state

    def take_requests(self) -> None:
        """A human's requests (``spikeguard ack|hold|resume``, Slack's buttons), oldest first:
        each one the machine's :class:`~.decide.recovery.Operator` observation; a file that is
        not a request is answered as refused (journaled), and the run goes on."""
        try:
            taken = operator.take_requests(self.run_dir)
        except OSError as e:  # an inbox that cannot be read never stops the run
            log.warning("cannot read the operator requests in %s: %s", self.run_dir, e)
            return
        for req in taken:
            if isinstance(req, operator.Refused):
                self._event(events.operator_refused_event(req.id, req.reason, self.state))
                continue
            self._apply(operator.observation(req))

    def _read(self, now: float) -> None:
        """The tick's intake: the ranks' output, their messages, silences; then upkeep."""
        polls = self.group.poll()
        for poll in polls:
            if self.on_output is not None and (poll.output or poll.output_skipped):
                self.on_output(poll)
        for suspect in health.health_suspects(polls, self.state.generation):
            self._apply(suspect)  # before the exits: a relaunch they cause avoids the node
        self.reader.read(polls, now)
        self.reader.feed(self.collector.health_messages(polls, now))  # gpu_* signals, for rules
        self.reader.feed(self.collector.check_hangs(now))
        self.reader.reports.flush()
        active = self.state.phase in rc.ACTIVE
        if active and now - self.effects.last_reap >= self.settings.reap_interval_s:
            self.effects.reap(self.state.generation, "rank processes of replaced generations")
        if active and self.settings.standby and now - self._standby_checked >= STANDBY_CHECK_S:
            self._standby_checked = now
            if self.collector.min_step() is not None:  # every rank trains: the CPUs are free
                ev = upkeep.keep_standby(
                    self.group,
                    paths=self.paths,
                    cmd=self.effects.cmd,
                    env=self.effects.env,
                    state=self.state,
                )
                if ev is not None:
                    self._event(ev)

    # -- messages -> decisions -> observations --------------------------------------------------
    def _evaluate(self, msg: dict[str, Any]) -> None:
        """Evaluate one accepted message (already recorded in ``reports.jsonl``)."""
        gen = self.collector.generation
        if gen is None or msg.get("gen") != gen:
            return  # fenced (or replaced) while handling an earlier message of this poll
        views = self.collector.ranks
        decisions = list(self.engine.observe(msg))
        for suspect in health.suspects_of(msg, decisions, gen):
            self._apply(suspect)  # before the decisions: the relaunch they start avoids the node
        for decision in decisions:
            hist = self.collector.history
            self._apply(
                observation_of(decision, msg, views=views, history=hist, nodes=self.state.nodes)
            )
            if self.collector.generation != gen:
                return  # acted upon: the generation was fenced (and maybe replaced)
        for obs in observations_of(msg, gen):
            awaited = self.effects.awaited
            if isinstance(obs, rc.CheckpointSaved) and awaited and awaited[0] == obs.request_id:
                self.effects.awaited = None
            self._apply(obs)
        if msg["type"] == "checkpoint":
            for ev in upkeep.retain(self.paths, self.settings.retention_settings, self.state):
                self._event(ev)

    # -- the state machine and its effects -------------------------------------------------------
    def _apply(self, obs: rc.Observation) -> None:
        """Step the machine, journal its events, carry out its effects (whose outcomes are the
        next observations) until nothing is left to do."""
        queue: list[rc.Observation] = [obs]
        while queue:
            t = rc.step(self.state, queue.pop(0))
            self.state = t.state
            for ev in t.events:
                self._event(ev)
            for eff in t.effects:
                with _writing(f"carrying out {type(eff).__name__}"):
                    outcome = self.effects.carry_out(eff)
                if outcome is not None:
                    queue.append(outcome)

    def _event(self, ev: dict[str, Any]) -> None:
        rec = self.journal.record(ev)
        for sink in self.sinks:
            try:
                sink.handle(rec)
            except Exception as e:  # a sink must never stop a recovery
                log.warning("notifier %s failed: %s", type(sink).__name__, e)

    def status(self) -> dict[str, Any]:
        """What ``status.json`` and the live view show (:func:`~.observe.status.live_status`),
        with what a launch waits for, if it does."""
        return live_status(self.state, self.collector, waiting=self.waiting)

    def _waiting(self, info: dict[str, Any] | None) -> None:
        """A launch waits (for its placement), or no longer does: shown at once in
        ``status.json`` and the live view, since no tick comes while the launch waits."""
        self.waiting = info
        self._write_status()
        if self.on_tick is not None:
            try:
                self.on_tick(self)
            except Exception as e:  # a view must never stop a launch
                log.warning("the tick hook failed while a launch waits: %s", e)

    def _write_status(self, *, every_s: float = 0.0) -> None:
        """``RUN_DIR/status.json``; with ``every_s``, at most that often unless the phase or
        the generation changed (at a thousand ranks, writing it every poll is a tenth of the
        supervisor's CPU)."""
        now = time.monotonic()
        key = (self.state.phase, self.state.generation)
        if every_s and key == self._status_key and now - self._status_at < every_s:
            return
        self._status_key, self._status_at = key, now
        try:  # best effort: status.json is a view, the journal is the record
            rundir.write_status(self.run_dir, self.status())
        except OSError as e:
            if self._status_failing is None:
                log.warning(f"cannot write {self.run_dir / 'status.json'} ({e}); the run goes on")
            self._status_failing = e
            return
        if self._status_failing is not None:
            self._status_failing = None
            log.info(f"{self.run_dir / 'status.json'} is written again")

    def close(self) -> None:
        self.reader.reports.close()
        self.journal.close()
