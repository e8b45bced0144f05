"""The controller: collector -> engine -> recovery machine -> effects.

Its loop is :meth:`Controller.step`: poll the ranks once, validate what they sent (the
collector), feed every accepted message to the policy engine, hand the engine's decisions and the
ranks' exits to the pure recovery machine as observations, journal the events the machine
returns, and carry out the effects it asks for (kill, choose a checkpoint, launch, shut down),
whose outcomes are observations again. The controller decides nothing: classifying exits and
hangs is the collector's, what they mean is the engine's and the machine's. Every seam is typed
(:mod:`.launch.types`).

Timeouts use monotonic clocks only (the journal's ``mono``); a wall-clock jump cannot fire a hang.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from spikeguard.workers.checkpoint import choose, remove, retention

from . import rundir
from .act import forensics
from .decide import recovery as rc
from .decide.events import Kind
from .intake.collector import Accepted, Collector, is_finite
from .journal import Journal
from .launch import reaper
from .launch.interface import Group, LaunchError, RankPoll
from .observe.status import live_status


class Sink(Protocol):
    """Anything that wants every journaled event (console, Slack)."""

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


class Controller:
    """Runs one job until it completes, fails, escalates or is stopped."""

    def __init__(
        self,
        *,
        run_dir: str,
        run_id: str,
        group: Group,
        engine: Any,
        cmd: list[str],
        env: dict[str, str],
        world_size: int,
        hang_timeout_s: float,
        first_heartbeat_timeout_s: float,
        kill_grace_s: float = 0.0,
        sinks: list[Sink] | None = None,
        poll_interval_s: float = 0.25,
        on_tick: Callable[[Controller], None] | None = None,
        backoff_base_s: float = 0.0,
        backoff_max_s: float = 60.0,
        launch_retries: int = 3,
        reap_interval_s: float = 30.0,
        default_settings: rc.Settings | None = None,
        remote_reap: bool = True,
        preempt_grace_s: float = 30.0,
        on_output: Callable[[RankPoll], None] | None = None,
        standby: bool = False,
        batch_ids_wait_s: float = 10.0,
        retention_settings: retention.RetentionSettings | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.ckpt_dir.mkdir(exist_ok=True)
        (self.run_dir / "plans").mkdir(exist_ok=True)
        self.fence_file = self.run_dir / "FENCE"
        self.stop_file = self.run_dir / "STOP"
        self.group, self.engine, self.cmd, self.env = group, engine, cmd, env
        self.journal = Journal(run_dir, run=run_id)
        self.collector = Collector(
            world_size=world_size,
            hang_timeout_s=hang_timeout_s,
            first_heartbeat_timeout_s=first_heartbeat_timeout_s,
        )
        self.kill_grace_s = kill_grace_s
        self.sinks = list(sinks or [])
        self.poll_interval_s = poll_interval_s
        self.on_tick = on_tick
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.launch_retries = launch_retries
        self.reap_interval_s = reap_interval_s
        self.remote_reap = remote_reap
        self.default_settings = default_settings or rc.Settings()
        self.preempt_grace_s = preempt_grace_s
        self.on_output = on_output
        """Where the ranks' output lines go besides their logs (the driver's stdout), if set."""
        self.standby = standby
        """Keep the next generation's processes warm (the job's ``standby``)."""
        self._standby_checked = float("-inf")
        self._status_key: tuple[Any, ...] | None = None
        self._status_at = float("-inf")
        self.batch_ids_wait_s = batch_ids_wait_s
        """How long an incident's kill waits for the ranks' batch ids (0: it does not ask)."""
        self._batch_ids_requests = 0
        self.retention = retention_settings
        """None: never delete a checkpoint."""
        self.state = rc.State()
        self._preempt_reason: str | None = None
        self._awaited: tuple[int, float] | None = None
        """(request id, monotonic deadline) of a checkpoint request the machine waits for."""
        self._unread_polls: collections.deque[tuple[RankPoll, float]] = collections.deque()
        """The current tick's polls (with the time they came) not validated yet."""
        self._unread: collections.deque[tuple[RankPoll, list[Accepted], float]] = (
            collections.deque()
        )
        """The current tick's polls validated but not evaluated yet (with their messages and
        the time they came), in the order :meth:`_read_tick` chose."""
        self._screen_failed = False
        self._unfed: collections.deque[dict[str, Any]] = collections.deque()
        """Accepted messages of the rank being evaluated not recorded and evaluated yet."""
        self._reports = open(self.run_dir / "reports.jsonl", "ab")
        self._last_reap = self.journal.mono()
        self._effects: dict[type, Callable[[Any], rc.Observation | None]] = {
            rc.Kill: self._kill,
            rc.SelectCheckpoint: self._select,
            rc.Launch: self._launch,
            rc.RequestCheckpoint: self._request_checkpoint,
            rc.Shutdown: self._shutdown,
        }

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
            else:
                self._apply(rc.Start(self.launch_retries))
            while self.state.phase not in rc.EXITS:
                self.step()
                if time.monotonic() - last_full >= FULL_GC_EVERY_S:
                    gc.collect()  # between ticks (FULL_GC_EVERY_S)
                    last_full = time.monotonic()
                time.sleep(self.poll_interval_s)
        finally:
            gc.set_threshold(*thresholds)
        self._write_status()
        return self.state.exit_code or 0

    def restart(self, events: list[dict[str, Any]]) -> None:
        """Take over from a dead supervisor: state from the journal, fence, reap survivors, go
        on."""
        self.state = rc.fold(events)
        st = self.state
        inc = st.incident.id if st.incident else None
        self._event(
            {
                "kind": Kind.SUPERVISOR_START.value,
                "incident": inc,
                "reason": f"restarted on an unfinished journal: phase {st.phase.value}, "
                f"generation {st.generation}, LR scale {st.lr_scale:.4g}, "
                f"{inc or 'no open incident'}",
                "resumed": True,
                "phase": st.phase.value,
                "generation": st.generation,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        )
        on_disk = rundir.highest_generation(self.run_dir)
        nxt = max(rc.next_generation(st), on_disk + 1)
        self._write_fence(nxt)  # before anything else: survivors may no longer publish
        self._reap(nxt, "ranks left by the previous supervisor")
        self._apply(rc.Restarted(self.default_settings, on_disk, self.launch_retries))

    def preempt(self, reason: str) -> None:
        """Ask the run to go away resumably (call from a signal handler: it only sets a flag)."""
        self._preempt_reason = reason

    def step(self) -> rc.State:
        """One pass: poll ranks, evaluate, transition. Returns the (new) state."""
        now = self.journal.mono()
        if self.stop_file.exists():
            self._apply(rc.StopRequested(self._stop_reason()))
            return self.state
        if self._preempt_reason is not None and self.state.phase not in rc.EXITS:
            self._apply(rc.Preempt(self._preempt_reason))
        if self.state.phase in (*rc.ACTIVE, rc.Phase.PREEMPTING):
            polls = self.group.poll()
            for poll in polls:
                if self.on_output is not None and (poll.output or poll.output_skipped):
                    self.on_output(poll)
            self._read_tick(polls, now)
            self._feed_all(self.collector.check_hangs(now))
            self._reports.flush()
            if now - self._last_reap >= self.reap_interval_s and self.state.phase in rc.ACTIVE:
                self._reap(self.state.generation, "rank processes of replaced generations")
            if self.standby and self.state.phase in rc.ACTIVE:
                self._keep_standby(now)
        if self._awaited is not None and time.monotonic() >= self._awaited[1]:
            request_id, self._awaited = self._awaited[0], None
            self._apply(rc.GraceExpired(request_id))
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

    def _read_tick(self, polls: list[RankPoll], now: float) -> None:
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
        pending = self.engine.pending_ranks()
        first = [p for p in polls if p.rank in pending]
        self._unread_polls.extend((p, now) for p in first)
        self._unread_polls.extend((p, now) for p in polls if p.rank not in pending)
        for _ in first:  # 1.
            if not self._unread_polls:
                break  # a decision fenced the generation: the kill recorded the rest
            poll, at = self._unread_polls.popleft()
            self._feed_all(self.collector.ingest_poll(poll, at))
        quiet: list[tuple[RankPoll, list[Accepted], float]] = []
        while self._unread_polls:  # 2. and 3.: validated first, taken in when evaluated
            poll, at = self._unread_polls.popleft()
            msgs = self.collector.read_poll(poll)
            may_decide = poll.exit_code is not None or (msgs and not self._quiet(msgs))
            (self._unread if may_decide else quiet).append((poll, msgs, at))
        self._unread.extend(quiet)
        while self._unread:
            self._feed_all(self.collector.accept_poll(*self._unread.popleft()))

    def _quiet(self, msgs: list[Accepted]) -> bool:
        """``Engine.quiet``; a screen that fails costs the order of the tick (its messages are
        taken as ones that may decide), never the supervisor."""
        try:
            return bool(self.engine.quiet(msgs))
        except Exception as e:
            if not self._screen_failed:
                self._screen_failed = True
                print(f"spikeguard: the policy engine's screen failed ({e!r}); read in order")
            return False

    # -- messages -> decisions -> observations --------------------------------------------------
    def _feed_all(self, msgs: list[dict[str, Any]]) -> None:
        """Record and evaluate accepted messages one by one, in arrival order (a decision comes
        as soon as its message is read, not after the rest of the poll). When a decision fences
        the generation, the kill records what is left of them first (:meth:`_record_unfed`):
        every accepted message reaches ``reports.jsonl``, in order, evaluated or not."""
        self._unfed.extend(msgs)
        while self._unfed:
            msg = self._unfed.popleft()
            self._write_report(msg)
            self._feed(msg)

    def _record_unfed(self) -> None:
        """Record, without evaluating, what this tick brought and was not fed yet (the
        generation is being fenced: the rest of the tick, such as the steps a slower rank had
        queued)."""
        while self._unfed:
            self._write_report(self._unfed.popleft())
        while self._unread:
            for msg in self.collector.accept_poll(*self._unread.popleft()):
                self._write_report(msg)
        while self._unread_polls:
            poll, at = self._unread_polls.popleft()
            for msg in self.collector.ingest_poll(poll, at):
                self._write_report(msg)
        self._reports.flush()

    def _feed(self, msg: dict[str, Any]) -> None:
        """Evaluate one accepted message (already recorded in ``reports.jsonl``)."""
        gen = self.collector.generation
        if gen is None or msg.get("gen") != gen:
            return  # fenced (or replaced) while handling an earlier message of this poll
        for decision in self.engine.observe(msg):
            self._apply(self._observation(decision, msg))
            if self.collector.generation != gen:
                return  # acted upon: the generation was fenced (and maybe replaced)
        if msg["type"] == "checkpoint":
            for request_id in msg.get("requests") or ():
                saved = rc.CheckpointSaved(request_id, str(msg.get("path")), msg["step"])
                if self._awaited is not None and self._awaited[0] == request_id:
                    self._awaited = None
                self._apply(saved)
            self._retain()
        if msg["type"] == "exit":
            keys = ("step", "log_tail", "lost", "host")
            details: dict[str, Any] = {k: msg[k] for k in keys if k in msg}
            self._apply(
                rc.RankExited(
                    rank=msg["rank"],
                    generation=gen,
                    code=msg["code"],
                    first=bool(msg.get("first")),
                    teardown_code=msg.get("teardown_code"),
                    details=details,
                )
            )

    def _observation(self, d: Any, msg: dict[str, Any]) -> rc.Observation:
        """The machine's observation for an engine decision, with what the events should say."""
        details: dict[str, Any] = {
            "action": d.action,
            "severity": d.severity,
            "signal": d.signal,
            "value": _jsonable(d.value),
            "rank": d.rank,
            "layer": d.layer,
        }
        if d.action == "stop":
            return rc.StopRequested(f"policy rule {d.rule}: {d.reason}")
        if d.action == "checkpoint" and not d.resolved:
            details.update(rule=d.rule, step=d.step)
            return rc.CheckpointWanted(d.reason, details=details)
        if d.action != "recover":  # notify (or a checkpoint rule that resolved): an alert
            details.update(rule=d.rule, step=d.step, repeated=bool(d.repeated))
            return rc.Notify(d.reason, resolved=bool(d.resolved), details=details)
        view = self.collector.ranks.get(d.rank) if d.rank is not None else None
        details.update(
            loss=_jsonable(view.loss if view else msg.get("loss")),
            grad_norm=_jsonable(view.grad_norm if view else msg.get("grad_norm")),
            grade=view.summary.get("grade") if view else None,
            context=self._context(d.rank),
        )
        if msg["type"] == "exit":
            details.update(exit_code=msg.get("code"), log_tail=msg.get("log_tail", ""))
            if msg.get("lost"):
                details["lost"] = msg["lost"]
        elif msg["type"] == "hang":
            details.update(
                first_heartbeat=bool(msg.get("first")),
                heartbeat_age_s=msg.get("age_s"),
                timeout_s=msg.get("timeout_s"),
            )
        settings = rc.Settings.from_policy(d.recovery)
        steps = [v.step for v in self.collector.ranks.values() if v.step is not None]
        return rc.Recover(
            d.rule,
            d.reason,
            d.step,
            settings,
            details=details,
            fault=msg["type"] in ("exit", "hang"),  # a crash or a hang, not a training signal
            furthest_step=max(steps) if steps else None,
        )

    def _context(self, rank: int | None) -> dict[str, list[Any]]:
        """The recent samples of the rank that fired (rank 0 for run-wide rules), for the chart."""
        want = 0 if rank is None else rank
        hist = [h for h in self.collector.history if h["rank"] == want]
        hist = hist or list(self.collector.history)
        keys = ("step", "grade", "attn_entropy_min", "loss", "max_logit")
        return {
            k + ("s" if k == "step" else ""): [_jsonable(h.get(k)) for h in hist[-60:]]
            for k in keys
        }

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
                outcome = self._effects[type(eff)](eff)
                if outcome is not None:
                    queue.append(outcome)

    def _kill(self, eff: rc.Kill) -> rc.Killed:
        """Fence the generation (supervisor side, then FENCE for the ranks) and kill it; at an
        incident, first ask the ranks for their recent batch ids (a short, bounded wait)."""
        self._record_unfed()  # ahead of what arrives while waiting for the batch ids
        batch_ids = None
        if eff.batch_ids_for is not None and self.collector.generation is not None:
            batch_ids = self._collect_batch_ids(*eff.batch_ids_for)
        if self.collector.generation is not None:
            self.engine.retire(self.collector.generation)
        self.collector.fence()
        self._write_fence(rc.next_generation(self.state))
        report = self.group.kill(self.kill_grace_s)
        ranks = tuple(range(self.collector.world_size))
        return rc.Killed(ranks, report.duration_s, report.forced, report.unreachable, batch_ids)

    def _collect_batch_ids(self, incident: str, attempt: int) -> str | None:
        """Ask the ranks still running for their ring buffers of batch ids, wait for the answers
        up to ``batch_ids_wait_s`` (a rank that exited or fell silent is not waited for), store
        them with the incident and journal a ``forensics`` event. Returns the file's path, or
        None when no rank answered. The other messages that arrive meanwhile are recorded in
        ``reports.jsonl`` but not evaluated: the generation is being killed."""
        if self.batch_ids_wait_s <= 0:
            return None
        views = self.collector.ranks
        asked = [r for r, v in views.items() if v.exit_code is None and not v.done]
        waiting = {r for r in asked if views[r].hang_reported_at is None}
        self._batch_ids_requests += 1
        rid = self._batch_ids_requests
        answers = forensics.Answers(
            incident=incident, attempt=attempt, generation=self.collector.generation, asked=asked
        )
        t0 = time.monotonic()
        if waiting and self.group.request({"type": "batch_ids", "id": rid, "incident": incident}):
            while waiting and time.monotonic() - t0 < self.batch_ids_wait_s:
                now = self.journal.mono()
                for poll in self.group.poll():
                    for msg in self.collector.ingest_poll(poll, now):
                        if msg["type"] == "batch_ids" and msg.get("request") == rid:
                            answers.add(msg)
                        else:
                            self._write_report(msg)
                        if msg["type"] in ("batch_ids", "exit"):
                            waiting.discard(msg["rank"])
                time.sleep(0.05)
        inc = self.state.incident
        doc = answers.document(
            incident_step=inc.step if inc is not None else None, waited_s=time.monotonic() - t0
        )
        path = None
        if answers.ranks:
            path = forensics.batch_ids_path(self.run_dir, incident, attempt)
            rundir.private_dir(path.parent.parent)
            rundir.private_dir(path.parent)
            rundir.write_atomic(path, json.dumps(doc, separators=(",", ":")), fsync=True)
        self._event(forensics.event(doc, path))
        return None if path is None else str(path)

    def _select(self, eff: rc.SelectCheckpoint) -> rc.CheckpointChosen:
        """The newest checkpoint that qualifies and verifies (read from the sidecars)."""
        failed: list[str] = []

        def verify(info: choose.CheckpointInfo) -> None:
            try:
                choose.verify(info)
            except choose.CheckpointError:
                failed.append(info.path)
                raise

        chosen, skipped = choose.select_checkpoint(
            choose.list_checkpoints(self.ckpt_dir),
            min_grade=eff.min_grade,
            before_step=eff.before_step,
            min_steps_back=eff.min_steps_back,
            lineage=eff.lineage,
            verify_fn=verify,
            fallback_on_corrupt=eff.fallback_on_corrupt,
        )
        passed_over = tuple((s.path, why) for s, why in skipped)
        if chosen is None:
            corrupt = failed[-1] if failed and not eff.fallback_on_corrupt else None
            return rc.CheckpointChosen(None, skipped=passed_over, corrupt=corrupt)
        return rc.CheckpointChosen(
            chosen.path,
            step=chosen.step,
            sha256=chosen.sha256,
            grade=chosen.grade,
            skipped=passed_over,
        )

    def _retain(self) -> None:
        """Delete what the retention settings do not keep (a pure decision over the listing;
        the resume plan's checkpoint is never deleted), journaling each deletion."""
        if self.retention is None:
            return
        listed = choose.list_checkpoints(self.ckpt_dir)
        plan = self.state.plan
        protected = {plan.checkpoint} if plan is not None and plan.checkpoint else set()
        verdicts = retention.decide(
            listed,
            listed.incomplete,
            self.retention,
            protected=protected,
            lineage=self.state.lineage,
            generation=self.state.generation,
        )
        inc = self.state.incident
        for verdict in verdicts:
            if verdict.keep:
                continue
            try:
                remove.remove_checkpoint(verdict.path)
            except (OSError, choose.CheckpointError) as e:
                print(f"spikeguard: could not delete checkpoint {verdict.path}: {e}", flush=True)
                continue
            self._event(
                {
                    "kind": Kind.CHECKPOINT_DELETED.value,
                    "incident": inc.id if inc else None,
                    "reason": verdict.reason,
                    "path": verdict.path,
                    "step": verdict.step,
                    "generation": verdict.generation,
                    "checkpoint_kind": verdict.kind,
                    "complete": verdict.complete,
                    "grade": verdict.grade,
                    "loss": _jsonable(verdict.loss),
                    "ranks": verdict.ranks,
                    "bytes": verdict.size,
                }
            )

    def _launch(self, eff: rc.Launch) -> rc.Observation:
        """Wait the backoff, reap leftovers, write the plan and the fence, start the ranks."""
        delay = rc.backoff_delay(eff.backoff_attempt, self.backoff_base_s, self.backoff_max_s)
        if delay and self._sleep(delay):
            if self._preempt_reason is not None and not self.stop_file.exists():
                return rc.Preempt(self._preempt_reason)
            return rc.StopRequested(self._stop_reason())
        plan = eff.plan
        gen = plan.generation
        self._reap(gen, "rank processes that outlived their generation")
        plan_path = None
        if plan != rc.ResumePlan(generation=gen):  # anything but a fresh start travels as a file
            plan_path = str(self.run_dir / "plans" / f"gen{gen:03d}.json")
            rundir.write_atomic(Path(plan_path), plan.to_json(), fsync=True)
        self._write_fence(gen)
        try:
            ranks = self.group.launch(
                generation=gen,
                cmd=self.cmd,
                env=self.env,
                plan_path=plan_path,
                fence_file=str(self.fence_file),
                ckpt_dir=str(self.ckpt_dir),
            )
        except LaunchError as e:
            return rc.LaunchFailed(f"launching generation {gen} failed: {e}")
        self.collector.new_generation(gen, self.journal.mono(), start_step=plan.start_step)
        port = ranks[0].port if ranks else None
        return rc.Launched(gen, ranks=tuple(r.to_dict() for r in ranks), port=port, backoff_s=delay)

    def _keep_standby(self, now: float) -> None:
        """Once every rank of the generation trains, have the next generation's processes
        waiting (checked every :data:`STANDBY_CHECK_S`); journal what changed."""
        if now - self._standby_checked < STANDBY_CHECK_S:
            return
        self._standby_checked = now
        if self.collector.min_step() is None:
            return  # not every rank is training yet: leave it the machine's CPUs
        change = self.group.standby(
            generation=rc.next_generation(self.state),
            cmd=self.cmd,
            env=self.env,
            fence_file=str(self.fence_file),
            ckpt_dir=str(self.ckpt_dir),
        )
        if change is None:
            return
        inc = self.state.incident
        ev: dict[str, Any] = {
            "kind": Kind.STANDBY.value,
            "code": f"standby_{change.what}",
            "incident": inc.id if inc else None,
            "reason": change.reason,
            "generation": change.generation,
        }
        if change.pids:
            ev.update(pids=list(change.pids), port=change.port)
        if change.rank is not None:
            ev.update(rank=change.rank, exit_code=change.exit_code, log_tail=change.log_tail)
        self._event(ev)

    def _request_checkpoint(self, eff: rc.RequestCheckpoint) -> rc.Observation | None:
        """Ask every rank to save at its next step boundary; with ``wait``, the machine hears
        back when a rank publishes the checkpoint, or when the grace period is over."""
        payload = {"type": "checkpoint", "id": eff.request_id, "reason": eff.reason}
        delivered = self.group.request(payload)
        if not eff.wait:
            return None
        if delivered == 0:
            return rc.GraceExpired(eff.request_id)  # nobody to ask: do not wait for nothing
        self._awaited = (eff.request_id, time.monotonic() + self.preempt_grace_s)
        return None

    def _shutdown(self, eff: rc.Shutdown) -> None:
        self._record_unfed()
        self.collector.fence()

    # -- the run directory ---------------------------------------------------------------------
    def _stop_reason(self) -> str:
        try:
            text = self.stop_file.read_text(errors="replace").strip()
        except OSError:
            text = ""
        return text or "stop requested"

    def _sleep(self, seconds: float) -> bool:
        """Sleep on the monotonic clock; True if a stop was requested meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.stop_file.exists() or self._preempt_reason is not None:
                return True
            time.sleep(min(left, 0.2))
        return self.stop_file.exists() or self._preempt_reason is not None

    def _reap(self, below_generation: int, why: str) -> None:
        self._last_reap = self.journal.mono()
        found = reaper.reap(str(self.ckpt_dir), below_generation, remote=self.remote_reap)
        if found:
            gens = sorted({p["generation"] for p in found})
            inc = self.state.incident
            self._event(
                {
                    "kind": Kind.REAPED.value,
                    "incident": inc.id if inc else None,
                    "reason": f"killed {len(found)} {why} (generations {gens}) by pid",
                    "processes": found,
                }
            )

    def _write_fence(self, gen: int) -> None:
        rundir.write_atomic(self.fence_file, str(gen))

    def _write_report(self, msg: dict[str, Any]) -> None:
        """Append ``msg`` to ``reports.jsonl`` (flushed once a tick, and before a kill waits)."""
        if isinstance(msg, Accepted):
            self._reports.write(msg.record())  # the rank's own line, with ``at``
        else:  # an exit or hang the collector made
            self._reports.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())

    def _event(self, ev: dict[str, Any]) -> None:
        rec = self.journal.record(ev)
        for n in self.sinks:
            try:
                n.handle(rec)
            except Exception as e:  # a notifier must never stop a recovery
                print(f"spikeguard: notifier {type(n).__name__} failed: {e}")

    def _write_status(self, *, every_s: float = 0.0) -> None:
        """``RUN_DIR/status.json``; with ``every_s``, at most that often unless the phase or
        the generation changed (at a thousand ranks, writing it every poll is a tenth of the
        supervisor's CPU)."""
        now = time.monotonic()
        key = (self.state.phase, self.state.generation)
        if every_s and key == self._status_key and now - self._status_at < every_s:
            return
        self._status_key, self._status_at = key, now
        rundir.write_status(self.run_dir, live_status(self.state, self.collector))

    def close(self) -> None:
        self._reports.close()
        self.journal.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not is_finite(x):
        return str(x)
    return x
