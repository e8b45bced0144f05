"""The recovery machine's effects, carried out: each returns its outcome as the next observation.

:class:`Effects` is what the controller hands every effect to (:meth:`Effects.carry_out`, a table
keyed by the effect's type, like the machine's). Kill fences the generation (supervisor side,
then ``FENCE`` for the ranks) and kills it, asking the ranks for their batch ids first at an
incident; select chooses the checkpoint from the sidecars and commit markers; launch waits its
backoff, writes the plan and the fence and starts the ranks; a checkpoint request asks every rank
to save; shutdown fences what is left. None of them decides anything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spikeguard.workers.checkpoint import choose
from spikeguard.workers.contract.logs import logger

from .. import rundir
from ..decide import recovery as rc
from ..intake import forensics
from ..intake.batch_ids import wait_for_batch_ids
from ..intake.collector import Collector
from ..intake.tick import TickReader
from ..launch.interface import Group, LaunchError
from ..settings import ControllerSettings, RunPaths
from .upkeep import reap

log = logger(__name__)

Event = Callable[[dict[str, Any]], None]


class Effects:
    """Carries out effects against the worker group, the collector and the run directory."""

    def __init__(
        self,
        *,
        paths: RunPaths,
        settings: ControllerSettings,
        group: Group,
        collector: Collector,
        engine: Any,
        reader: TickReader,
        cmd: list[str],
        env: dict[str, str],
        clock: Callable[[], float],
        event: Event,
        state: Callable[[], rc.State],
        interrupted: Callable[[], str | None],
    ) -> None:
        self.paths, self.settings, self.group = paths, settings, group
        self.collector, self.engine, self.reader = collector, engine, reader
        self.cmd, self.env = cmd, env
        self.clock, self.event, self.state = clock, event, state
        self.interrupted = interrupted
        """The preemption's reason once the supervisor was told to go (SIGTERM), else None."""
        self.awaited: tuple[int, float] | None = None
        """(request id, monotonic deadline) of a checkpoint request the machine waits for."""
        self.last_reap = clock()
        """When rank processes of replaced generations were last looked for."""
        self._batch_ids_requests = 0
        self._table: dict[type, Callable[[Any], rc.Observation | None]] = {
            rc.Kill: self.kill,
            rc.SelectCheckpoint: self.select,
            rc.Launch: self.launch,
            rc.RequestCheckpoint: self.request_checkpoint,
            rc.Shutdown: self.shutdown,
        }

    def carry_out(self, effect: Any) -> rc.Observation | None:
        """Carry out ``effect``; its outcome (an observation for the machine) or None."""
        return self._table[type(effect)](effect)

    def kill(self, eff: rc.Kill) -> rc.Killed:
        """Fence the generation (supervisor side, then FENCE for the ranks) and kill it; at an
        incident, first ask the ranks for their recent batch ids (a short, bounded wait)."""
        self.reader.record_rest()  # ahead of what arrives while waiting for the batch ids
        batch_ids = None
        if eff.batch_ids_for is not None and self.collector.generation is not None:
            batch_ids = self._batch_ids(*eff.batch_ids_for)
        if self.collector.generation is not None:
            self.engine.retire(self.collector.generation)
        self.collector.fence()
        self.write_fence(rc.next_generation(self.state()))
        report = self.group.kill(self.settings.kill_grace_s)
        ranks = tuple(range(self.collector.world_size))
        return rc.Killed(ranks, report.duration_s, report.forced, report.unreachable, batch_ids)

    def _batch_ids(self, incident: str, attempt: int) -> str | None:
        """The ranks' batch ids stored with the incident (``forensics`` event journaled); the
        file's path, or None when nobody answered (or the job does not ask)."""
        if self.settings.batch_ids_wait_s <= 0:
            return None
        self._batch_ids_requests += 1
        answers, waited = wait_for_batch_ids(
            group=self.group,
            collector=self.collector,
            request_id=self._batch_ids_requests,
            incident=incident,
            attempt=attempt,
            wait_s=self.settings.batch_ids_wait_s,
            clock=self.clock,
            record=self.reader.reports.write,
        )
        inc = self.state().incident
        doc = answers.document(incident_step=inc.step if inc is not None else None, waited_s=waited)
        if answers.ranks and forensics.holds_no_ids(forensics.summary(doc)):
            return None  # the script passes no batch ids to sg.step(): nothing to file or say
        path = None
        if answers.ranks:
            path = forensics.batch_ids_path(self.paths.root, incident, attempt)
            try:
                rundir.private_dir(path.parent.parent)
                rundir.private_dir(path.parent)
                rundir.write_atomic(path, json.dumps(doc, separators=(",", ":")), fsync=True)
            except OSError as e:  # a full disk: the recovery goes on without its forensics
                log.warning("batch ids not stored (%s): the rollback goes on without them", e)
                path = None
        self.event(forensics.event(doc, path))
        return None if path is None else str(path)

    def select(self, eff: rc.SelectCheckpoint) -> rc.CheckpointChosen:
        """The newest checkpoint that qualifies and verifies (read from the sidecars), and the
        grade rule that chose it (``min_grade``, or the run's own baseline)."""
        if eff.exact is not None:
            return self._select_exact(eff)
        failed: list[str] = []

        def verify(info: choose.CheckpointInfo) -> None:
            try:
                choose.verify(info)
            except choose.CheckpointError:
                failed.append(info.path)
                raise

        found = choose.select_rollback(
            choose.list_checkpoints(self.paths.ckpt_dir),
            min_grade=eff.min_grade,
            before_step=eff.before_step,
            min_steps_back=eff.min_steps_back,
            lineage=eff.lineage,
            verify_fn=verify,
            fallback_on_corrupt=eff.fallback_on_corrupt,
            grade_baseline=eff.grade_baseline,
        )
        chosen = found.chosen
        corrupt = failed[-1] if chosen is None and failed and not eff.fallback_on_corrupt else None
        return rc.CheckpointChosen(
            chosen.path if chosen else None,
            step=chosen.step if chosen else None,
            sha256=chosen.sha256 if chosen else None,
            grade=chosen.grade if chosen else None,
            skipped=tuple((s.path, why) for s, why in found.skipped),
            corrupt=corrupt,
            grade_rule=found.grade_rule,
            grade_bar=found.grade_bar,
            baseline_of=found.baseline_of,
        )

    def _select_exact(self, eff: rc.SelectCheckpoint) -> rc.CheckpointChosen:
        """A human's checkpoint: chosen if it is listed, lies on the lineage and verifies; else
        nothing, with why."""
        wanted = str(eff.exact)
        listed = choose.list_checkpoints(self.paths.ckpt_dir)
        info = next((i for i in listed if i.path == wanted), None)
        if info is None:
            return rc.CheckpointChosen(None, skipped=((wanted, "no such checkpoint"),))
        if eff.lineage and not choose.on_lineage(eff.lineage, info.generation, info.step):
            why = f"generation {info.generation} step {info.step} is off the current lineage"
            return rc.CheckpointChosen(None, skipped=((wanted, why),))
        try:
            choose.verify(info)
        except choose.CheckpointError as e:
            return rc.CheckpointChosen(None, skipped=((wanted, f"does not verify: {e}"),))
        return rc.CheckpointChosen(info.path, step=info.step, sha256=info.sha256, grade=info.grade)

    def launch(self, eff: rc.Launch) -> rc.Observation:
        """Wait the backoff, reap leftovers, write the plan and the fence, start the ranks (off
        the run's excluded nodes, ``eff.avoid``, where the cluster has room elsewhere)."""
        s = self.settings
        delay = rc.backoff_delay(eff.backoff_attempt, s.backoff_base_s, s.backoff_max_s)
        if delay and self.sleep(delay):
            reason = self.interrupted()
            if reason is not None and not self.paths.stop_file.exists():
                return rc.Preempt(reason)
            return rc.StopRequested(self.paths.stop_reason())
        plan = eff.plan
        gen = plan.generation
        self.reap(gen, "rank processes that outlived their generation")
        plan_path = None
        if plan != rc.ResumePlan(generation=gen):  # anything but a fresh start travels as a file
            plan_path = str(self.paths.plans_dir / f"gen{gen:03d}.json")
            rundir.write_atomic(Path(plan_path), plan.to_json(), fsync=True)
        self.write_fence(gen)
        try:
            ranks = self.group.launch(
                generation=gen,
                cmd=self.cmd,
                env=self.env,
                plan_path=plan_path,
                fence_file=str(self.paths.fence_file),
                ckpt_dir=self.paths.ckpt_dir,
                avoid=eff.avoid,
            )
        except LaunchError as e:
            return rc.LaunchFailed(f"launching generation {gen} failed: {e}")
        self.collector.new_generation(gen, self.clock(), start_step=plan.start_step)
        port = ranks[0].port if ranks else None
        placement = getattr(self.group, "placement", None)
        return rc.Launched(
            gen,
            ranks=tuple(r.to_dict() for r in ranks),
            port=port,
            backoff_s=delay,
            nodes=tuple(r.node_id or "" for r in ranks),
            unavoided=placement.unavoided if eff.avoid and placement is not None else None,
        )

    def request_checkpoint(self, eff: rc.RequestCheckpoint) -> rc.Observation | None:
        """Ask every rank to save at its next step boundary; with ``wait``, the machine hears
        back when a rank publishes the checkpoint, or when the grace period is over."""
        payload = {"type": "checkpoint", "id": eff.request_id, "reason": eff.reason}
        delivered = self.group.request(payload)
        if not eff.wait:
            return None
        # nobody alive to ask: no grace to wait, only the tick's read of the exits still due (a
        # run whose ranks all finished completes rather than being preempted)
        grace = self.settings.preempt_grace_s if delivered else 0.0
        self.awaited = (eff.request_id, time.monotonic() + grace)
        return None

    def shutdown(self, eff: rc.Shutdown) -> None:
        self.reader.record_rest()
        self.collector.fence()

    def reap(self, below_generation: int, why: str) -> None:
        """Kill rank processes of generations below ``below_generation`` (journaled)."""
        self.last_reap = self.clock()
        inc = self.state().incident
        ev = reap(self.paths, below_generation, why, remote=self.settings.remote_reap, incident=inc)
        if ev is not None:
            self.event(ev)

    def write_fence(self, gen: int) -> None:
        rundir.write_atomic(self.paths.fence_file, str(gen))

    def sleep(self, seconds: float) -> bool:
        """Sleep on the monotonic clock; True if a stop was requested meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.paths.stop_file.exists() or self.interrupted() is not None:
                return True
            time.sleep(min(left, 0.2))
        return self.paths.stop_file.exists() or self.interrupted() is not None
