"""The controller: collector -> engine -> recovery -> effects.

Its loop is :meth:`Controller.step`: poll the ranks once, feed every
accepted message to the policy engine, turn decisions into observations for
the pure recovery machine (:mod:`.recovery`), journal what the machine says
and carry out the effects it asks for (kill, choose a checkpoint, launch,
shut down). Every side effect lives here or below (workers, journal,
notifiers, reaper); every decision lives in the engine or the machine.

Timeouts use monotonic clocks only (the journal's ``mono``); a wall-clock jump
cannot fire a hang.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.contract.exitcodes import ExitCode

from . import reaper, rundir
from . import recovery as rc
from .collector import Collector, is_finite
from .errors import LaunchError
from .journal import Journal


class Group(Protocol):
    def launch(
        self,
        *,
        generation: int,
        cmd: list[str],
        env: dict[str, str],
        plan_path: str | None,
        fence_file: str,
        ckpt_dir: str,
    ) -> list[dict[str, Any]]: ...
    def poll(self) -> list[dict[str, Any]]: ...
    def kill(self, grace_s: float = 0.0) -> dict[str, Any] | float: ...


class Notifier(Protocol):
    def handle(self, event: dict[str, Any]) -> None: ...


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
        notifiers: list[Notifier] | None = None,
        poll_interval_s: float = 0.25,
        on_tick: Callable[[Controller], None] | None = None,
        backoff_base_s: float = 0.0,
        backoff_max_s: float = 60.0,
        launch_retries: int = 3,
        reap_interval_s: float = 30.0,
        default_settings: rc.Settings | None = None,
        remote_reap: bool = True,
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
        self.notifiers = list(notifiers or [])
        self.poll_interval_s = poll_interval_s
        self.on_tick = on_tick
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.launch_retries = launch_retries
        self.reap_interval_s = reap_interval_s
        self.remote_reap = remote_reap
        self.default_settings = default_settings or rc.Settings()
        self.state = rc.State()
        self.lineage: list[tuple[int, int | None]] = []
        """(generation, step it branched from) for every launch; checkpoints off this path are ignored."""
        self._reports = open(self.run_dir / "reports.jsonl", "ab")
        self._last_reap = self.journal.mono()

    # -- the loop -------------------------------------------------------------------------------
    def run(self, resume_events: list[dict[str, Any]] | None = None) -> int:
        """Run to the end. ``resume_events``: the journal of a run a dead supervisor left unfinished."""
        self._write_status()
        if resume_events:
            self.restart(resume_events)
        else:
            self._apply(rc.Start())
        while self.state.phase not in rc.TERMINAL:
            self.step()
            time.sleep(self.poll_interval_s)
        self._write_status()
        return self.state.exit_code or 0

    def restart(self, events: list[dict[str, Any]]) -> None:
        """Take over from a dead supervisor: state from the journal, fence, reap survivors, go on."""
        self.state = rc.fold(events)
        self.lineage = rc.lineage(events)
        st = self.state
        self._event(
            {
                "kind": "supervisor_start",
                "incident": st.incident.id if st.incident else None,
                "reason": f"restarted on an unfinished journal: phase {st.phase.value}, generation "
                f"{st.generation}, LR scale {st.lr_scale:.4g}, "
                f"{st.incident.id if st.incident else 'no open incident'}",
                "resumed": True,
                "phase": st.phase.value,
                "generation": st.generation,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        )
        nxt = max(rc.next_generation(st), rundir.highest_generation(self.run_dir) + 1)
        self._write_fence(nxt)  # before anything else: survivors may no longer publish checkpoints
        self._reap(nxt, "ranks left by the previous supervisor")
        self._apply(rc.Restarted(self.default_settings, rundir.highest_generation(self.run_dir)))

    def step(self) -> rc.State:
        """One pass: poll ranks, evaluate, transition. Returns the (new) state."""
        now = self.journal.mono()
        if self.stop_file.exists() and self.state.phase not in rc.TERMINAL:
            self._apply(
                rc.StopRequested(
                    self.stop_file.read_text(errors="replace").strip() or "stop requested"
                )
            )
            return self.state
        if self.state.phase in (rc.Phase.RUNNING, rc.Phase.PROBATION):
            for res in self.group.poll():
                for line in res["lines"]:
                    msg = self.collector.ingest(res["rank"], line, now)
                    if msg is not None:
                        self._feed(msg)
                for k, why in (("overflow", "agent_overflow"), ("oversize", "oversize")):
                    if res.get(k):
                        self.collector.dropped[why] += res[k]
                if res["exit"] is not None:
                    msg = self.collector.exit(res["rank"], res["exit"], res.get("generation"), now)
                    if msg is not None:
                        msg.update({k: res[k] for k in ("lost", "log_tail", "host") if res.get(k)})
                        self._feed(msg)
            for msg in self.collector.check_hangs(now):
                self._feed(msg)
            if now - self._last_reap >= self.reap_interval_s and self.state.phase in (
                rc.Phase.RUNNING,
                rc.Phase.PROBATION,
            ):
                self._reap(
                    self.state.generation, "rank processes of replaced generations, now reachable"
                )
        if self.state.phase is rc.Phase.PROBATION and (s := self.collector.min_step()) is not None:
            self._apply(rc.Progress(s))
        if (
            self.state.phase in (rc.Phase.RUNNING, rc.Phase.PROBATION)
            and self.collector.all_finished()
        ):
            self._apply(rc.Finished(self.collector.final_loss()))
        if self.on_tick:
            self.on_tick(self)
        self._write_status()
        return self.state

    # -- messages -> decisions -> observations --------------------------------------------------
    def _feed(self, msg: dict[str, Any]) -> None:
        gen = self.collector.generation
        if gen is None or msg.get("gen") != gen:
            return  # fenced (or replaced) while handling an earlier message of this poll
        if msg["type"] in ("exit", "hang") and msg["step"] == -1:
            if msg["type"] == "exit" and msg["code"] != 0:  # died before its first heartbeat
                self._write_report(msg)
                self._launch_failed(msg)
                return
            msg["step"] = rc.start_step(
                self.state.plan
            )  # the step this generation was to begin with
        self._write_report(msg)
        if msg.get("teardown_code"):
            self._event(
                {
                    "kind": "alert",
                    "severity": "info",
                    "rule": None,
                    "rank": msg["rank"],
                    "layer": None,
                    "step": msg["step"],
                    "incident": None,
                    "reason": f"rank {msg['rank']} finished training, then exited with code "
                    f"{msg['teardown_code']} during teardown; counted as finished",
                }
            )
        for d in self.engine.observe(msg):
            self._decide(d, msg)
            if self.collector.generation != gen:
                return  # acted upon: the generation was fenced (and maybe replaced)
        if msg["type"] == "exit" and msg["code"] != 0:
            # a dead rank breaks the gang; without a rule that recovers it, the job has failed
            self._apply(
                rc.Failed(
                    f"rank {msg['rank']} exited with code {msg['code']} and no policy rule "
                    "recovers crashes",
                    exit_code=ExitCode.FAILED,
                    details={
                        "rank": msg["rank"],
                        "rank_exit_code": msg["code"],
                        **{k: v for k, v in _exit_details(msg).items() if k != "exit_code"},
                    },
                )
            )

    def _write_report(self, msg: dict[str, Any]) -> None:
        self._reports.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        self._reports.flush()

    def _launch_failed(self, msg: dict[str, Any]) -> None:
        why = f"rank {msg['rank']} exited with code {msg['code']} before its first heartbeat"
        if msg.get("lost"):
            why += f" (agent lost: {msg['lost']})"
        self._apply(
            rc.LaunchFailed(
                why,
                self.launch_retries,
                rank=msg["rank"],
                exit_code=msg["code"],
                details={"log_tail": msg.get("log_tail", "")},
            )
        )

    def _decide(self, d: Any, msg: dict[str, Any]) -> None:
        details = {
            "rule": d.rule,
            "action": d.action,
            "severity": d.severity,
            "signal": d.signal,
            "value": d.value if d.value is None or is_finite(d.value) else str(d.value),
            "rank": d.rank,
            "layer": d.layer,
            "step": d.step,
        }
        if d.action == "recover":
            view = self.collector.ranks.get(d.rank) if d.rank is not None else None
            details.update(
                loss=_jsonable(view.loss if view else msg.get("loss")),
                grad_norm=_jsonable(view.grad_norm if view else msg.get("grad_norm")),
                grade=(view.summary.get("grade") if view else None),
                context=self._context(d.rank),
            )
            if msg["type"] == "exit":
                details.update(_exit_details(msg))
            elif msg["type"] == "hang":
                details.update(
                    first_heartbeat=bool(msg.get("first")),
                    heartbeat_age_s=msg.get("age_s"),
                    timeout_s=(
                        self.collector.first_heartbeat_timeout_s
                        if msg.get("first")
                        else self.collector.hang_timeout_s
                    ),
                )
            details.pop("rule")
            details.pop("step")
            self._apply(
                rc.Recover(
                    rule=d.rule,
                    reason=d.reason,
                    step=d.step,
                    settings=rc.Settings.from_policy(d.recovery),
                    details=details,
                )
            )
        elif d.action == "stop":
            self._apply(rc.StopRequested(f"policy rule {d.rule}: {d.reason}"))
        else:  # notify / checkpoint (no rank-side request channel yet): an alert for the notifiers
            resolved = bool(getattr(d, "resolved", False))
            self._event(
                {
                    "kind": "alert",
                    "reason": d.reason,
                    "incident": None,
                    "resolved": resolved,
                    **details,
                }
            )

    def _context(self, rank: int | None) -> dict[str, list[Any]]:
        """The recent samples of the rank that fired (rank 0 for run-wide rules), for the chart."""
        want = 0 if rank is None else rank
        hist = [h for h in self.collector.history if h["rank"] == want] or list(
            self.collector.history
        )
        keys = ("step", "grade", "attn_entropy_min", "loss", "max_logit")
        return {
            k + ("s" if k == "step" else ""): [_jsonable(h.get(k)) for h in hist[-60:]]
            for k in keys
        }

    # -- the state machine and its effects -------------------------------------------------------
    def _apply(self, obs: rc.Observation) -> None:
        queue: list[rc.Observation] = [obs]
        while queue:
            t = rc.step(self.state, queue.pop(0))
            self.state = t.state
            for ev in t.events:
                self._event(ev)
            for eff in t.effects:
                nxt = self._effect(eff)
                if nxt is not None:
                    queue.append(nxt)

    def _effect(self, eff: rc.Effect) -> rc.Observation | None:
        if isinstance(eff, rc.Kill):
            if self.collector.generation is not None and hasattr(self.engine, "retire"):
                self.engine.retire(self.collector.generation)
            self.collector.fence()
            self._write_fence(rc.next_generation(self.state))
            res = self.group.kill(self.kill_grace_s)
            if not isinstance(res, dict):
                res = {"duration_s": float(res)}
            return rc.Killed(
                tuple(range(self.collector.world_size)),
                res["duration_s"],
                tuple(res.get("forced", ())),
                tuple(res.get("unreachable", ())),
            )
        if isinstance(eff, rc.SelectCheckpoint):
            return self._select(eff)
        if isinstance(eff, rc.Launch):
            return self._launch(eff.plan, eff.backoff_attempt)
        if isinstance(eff, rc.Shutdown):
            self.collector.fence()
            return None
        raise TypeError(eff)

    def _select(self, eff: rc.SelectCheckpoint) -> rc.CheckpointChosen:
        infos = [
            i
            for i in ckpt.list_checkpoints(self.ckpt_dir)
            if self._on_lineage(i.generation, i.step)
        ]
        chosen, skipped = ckpt.select_checkpoint(
            infos,
            min_grade=eff.min_grade,
            before_step=eff.before_step,
            min_steps_back=eff.min_steps_back,
        )
        sk = tuple((s.path, why) for s, why in skipped)
        if chosen is None:
            return rc.CheckpointChosen(None, skipped=sk)
        return rc.CheckpointChosen(
            chosen.path, step=chosen.step, sha256=chosen.sha256, grade=chosen.grade, skipped=sk
        )

    def _on_lineage(self, gen: int, step: int) -> bool:
        """A checkpoint counts only if it lies on the path the current generation descends from."""
        limit: float = float("inf")
        for g, branched_at in reversed(self.lineage):
            if gen == g:
                return step <= limit
            if branched_at is not None:
                limit = min(limit, branched_at)
        return False

    def _launch(self, plan: rc.ResumePlan, backoff_attempt: int = 0) -> rc.Observation | None:
        delay = rc.backoff_delay(backoff_attempt, self.backoff_base_s, self.backoff_max_s)
        if delay and self._sleep(delay):
            return rc.StopRequested(
                self.stop_file.read_text(errors="replace").strip() or "stop requested"
            )
        gen = plan.generation
        self._reap(gen, "rank processes that outlived their generation")
        plan_path = None
        if plan != rc.ResumePlan(
            generation=gen
        ):  # anything but a plain fresh start travels as a plan file
            plan_path = str(self.run_dir / "plans" / f"gen{gen:03d}.json")
            rundir.write_atomic(Path(plan_path), plan.to_json(), fsync=True)
        self._write_fence(gen)
        try:
            infos = self.group.launch(
                generation=gen,
                cmd=self.cmd,
                env=self.env,
                plan_path=plan_path,
                fence_file=str(self.fence_file),
                ckpt_dir=str(self.ckpt_dir),
            )
        except LaunchError as e:
            return rc.LaunchFailed(f"launching generation {gen} failed: {e}", self.launch_retries)
        self.lineage.append((gen, plan.checkpoint_step))
        self.collector.new_generation(gen, self.journal.mono())
        port = infos[0].get("port") if infos and isinstance(infos[0], dict) else None
        ranks = tuple(i for i in infos if isinstance(i, dict))
        return rc.Launched(gen, ranks=ranks, port=port, backoff_s=delay)

    def _sleep(self, seconds: float) -> bool:
        """Sleep on the monotonic clock; True if a stop was requested meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.stop_file.exists():
                return True
            time.sleep(min(left, 0.2))
        return self.stop_file.exists()

    def _reap(self, below_generation: int, why: str) -> None:
        self._last_reap = self.journal.mono()
        found = reaper.reap(str(self.ckpt_dir), below_generation, remote=self.remote_reap)
        if found:
            gens = sorted({p["generation"] for p in found})
            self._event(
                {
                    "kind": "reaped",
                    "incident": self.state.incident.id if self.state.incident else None,
                    "reason": f"killed {len(found)} {why} (generations {gens}) by pid",
                    "processes": found,
                }
            )

    def _write_fence(self, gen: int) -> None:
        rundir.write_atomic(self.fence_file, str(gen))

    def _event(self, ev: dict[str, Any]) -> None:
        rec = self.journal.record(ev)
        for n in self.notifiers:
            try:
                n.handle(rec)
            except Exception as e:  # a notifier must never stop a recovery
                print(f"spikeguard: notifier {type(n).__name__} failed: {e}")

    def _write_status(self) -> None:
        rundir.write_status(self.run_dir, rundir.status_dict(self))

    def close(self) -> None:
        self._reports.close()
        self.journal.close()


def _exit_details(msg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"exit_code": msg.get("code"), "log_tail": msg.get("log_tail", "")}
    if msg.get("lost"):
        out["lost"] = msg["lost"]
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not is_finite(x):
        return str(x)
    return x
