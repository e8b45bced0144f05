"""The controller: collector -> engine -> recovery -> effects.

Its loop is :meth:`Controller.step`: poll the ranks once, feed every
accepted message to the policy engine, turn decisions into observations for
the pure recovery machine (:mod:`.recovery`), journal what the machine says
and carry out the effects it asks for (kill, choose a checkpoint, launch,
shut down). Every side effect lives here or below (workers, journal,
notifiers); every decision lives in the engine or the machine.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from spikeguard.workers import checkpoint as ckpt

from . import recovery as rc
from .collector import Collector, is_finite
from .journal import Journal


class Group(Protocol):
    def launch(self, *, generation: int, cmd: list[str], env: dict[str, str], plan_path: str | None,
               fence_file: str, ckpt_dir: str) -> list[dict[str, Any]]: ...
    def poll(self) -> list[dict[str, Any]]: ...
    def kill(self, grace_s: float = 0.0) -> float: ...


class Notifier(Protocol):
    def handle(self, event: dict[str, Any]) -> None: ...


class Controller:
    """Runs one job until it completes, fails, escalates or is stopped."""

    def __init__(self, *, run_dir: str, run_id: str, group: Group, engine: Any, cmd: list[str],
                 env: dict[str, str], world_size: int, hang_timeout_s: float, first_heartbeat_timeout_s: float,
                 kill_grace_s: float = 0.0, notifiers: list[Notifier] | None = None,
                 poll_interval_s: float = 0.25, on_tick: Callable[["Controller"], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.ckpt_dir.mkdir(exist_ok=True)
        (self.run_dir / "plans").mkdir(exist_ok=True)
        self.fence_file = self.run_dir / "FENCE"
        self.stop_file = self.run_dir / "STOP"
        self.group, self.engine, self.cmd, self.env = group, engine, cmd, env
        self.journal = Journal(run_dir, run=run_id)
        self.collector = Collector(world_size=world_size, hang_timeout_s=hang_timeout_s,
                                   first_heartbeat_timeout_s=first_heartbeat_timeout_s)
        self.kill_grace_s = kill_grace_s
        self.notifiers = list(notifiers or [])
        self.poll_interval_s = poll_interval_s
        self.on_tick = on_tick
        self.state = rc.State()
        self.lineage: list[tuple[int, int | None]] = []
        """(generation, step it branched from) for every launch; checkpoints off this path are ignored."""
        self._reports = open(self.run_dir / "reports.jsonl", "ab")
        self._pending_details: dict[str, Any] = {}

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        self._write_status()
        self._launch(rc.ResumePlan(generation=1), initial=True)
        while self.state.phase not in rc.TERMINAL:
            self.step()
            time.sleep(self.poll_interval_s)
        self._write_status()
        return self.state.exit_code or 0

    def step(self) -> rc.State:
        """One pass: poll ranks, evaluate, transition. Returns the (new) state."""
        now = self.journal.mono()
        if self.stop_file.exists() and self.state.phase not in rc.TERMINAL:
            self._apply(rc.StopRequested(self.stop_file.read_text(errors="replace").strip() or "stop requested"))
            return self.state
        if self.state.phase in (rc.Phase.RUNNING, rc.Phase.PROBATION):
            for res in self.group.poll():
                for line in res["lines"]:
                    msg = self.collector.ingest(res["rank"], line, now)
                    if msg is not None:
                        self._feed(msg)
                if res.get("overflow"):
                    self.collector.dropped["agent_overflow"] += res["overflow"]
                if res["exit"] is not None:
                    msg = self.collector.exit(res["rank"], res["exit"], res.get("generation"), now)
                    if msg is not None:
                        self._feed(msg)
            for msg in self.collector.check_hangs(now):
                self._feed(msg)
        if self.state.phase is rc.Phase.PROBATION and (s := self.collector.min_step()) is not None:
            self._apply(rc.Progress(s))
        if self.state.phase in (rc.Phase.RUNNING, rc.Phase.PROBATION) and self.collector.all_finished():
            self._apply(rc.Finished(self.collector.final_loss()))
        if self.on_tick:
            self.on_tick(self)
        self._write_status()
        return self.state

    # -- messages -> decisions -> observations --------------------------------------------------
    def _feed(self, msg: dict[str, Any]) -> None:
        if self.collector.generation is None:
            return  # fenced while handling an earlier message of this poll
        gen = self.collector.generation
        self._reports.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        self._reports.flush()
        for d in self.engine.observe(msg):
            self._decide(d, msg)
            if self.collector.generation != gen:
                return  # acted upon: the generation was fenced (and maybe replaced)
        if msg["type"] == "exit" and msg["code"] != 0:
            # a dead rank breaks the gang; without a rule that recovers it, the job has failed
            self._apply(rc.Failed(f"rank {msg['rank']} exited with code {msg['code']} and no policy rule "
                                  "recovers crashes", exit_code=1))

    def _decide(self, d: Any, msg: dict[str, Any]) -> None:
        details = {"rule": d.rule, "action": d.action, "severity": d.severity, "signal": d.signal,
                   "value": d.value if d.value is None or is_finite(d.value) else str(d.value),
                   "rank": d.rank, "layer": d.layer, "step": d.step}
        if d.action == "recover":
            view = self.collector.ranks.get(d.rank) if d.rank is not None else None
            details.update(loss=_jsonable(view.loss if view else msg.get("loss")),
                           grad_norm=_jsonable(view.grad_norm if view else msg.get("grad_norm")),
                           grade=(view.summary.get("grade") if view else None),
                           context=self._context())
            details.pop("rule")
            details.pop("step")
            self._apply(rc.Recover(rule=d.rule, reason=d.reason, step=d.step,
                                   settings=rc.Settings.from_policy(d.recovery), details=details))
        elif d.action == "stop":
            self._apply(rc.StopRequested(f"policy rule {d.rule}: {d.reason}"))
        else:  # notify / checkpoint (no rank-side request channel yet): an alert for the notifiers
            resolved = bool(getattr(d, "resolved", False))
            self._event({"kind": "alert", "reason": d.reason, "incident": None, "resolved": resolved, **details})

    def _context(self) -> dict[str, list[Any]]:
        hist = [h for h in self.collector.history if h["rank"] == 0] or list(self.collector.history)
        keys = ("step", "grade", "attn_entropy_min", "loss", "max_logit")
        return {k + ("s" if k == "step" else ""): [_jsonable(h.get(k)) for h in hist[-60:]] for k in keys}

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
            self.collector.fence()
            self._write_fence(self.state.generation + 1)
            dur = self.group.kill(self.kill_grace_s)
            return rc.Killed(tuple(range(self.collector.world_size)), dur)
        if isinstance(eff, rc.SelectCheckpoint):
            return self._select(eff)
        if isinstance(eff, rc.Launch):
            return self._launch(eff.plan)
        if isinstance(eff, rc.Shutdown):
            self.collector.fence()
            return None
        raise TypeError(eff)

    def _select(self, eff: rc.SelectCheckpoint) -> rc.CheckpointChosen:
        infos = [i for i in ckpt.list_checkpoints(self.ckpt_dir) if self._on_lineage(i.generation, i.step)]
        chosen, skipped = ckpt.select_checkpoint(infos, min_grade=eff.min_grade, before_step=eff.before_step,
                                                 min_steps_back=eff.min_steps_back)
        sk = tuple((s.path, why) for s, why in skipped)
        if chosen is None:
            return rc.CheckpointChosen(None, skipped=sk)
        return rc.CheckpointChosen(chosen.path, step=chosen.step, sha256=chosen.sha256, grade=chosen.grade,
                                   skipped=sk)

    def _on_lineage(self, gen: int, step: int) -> bool:
        """A checkpoint counts only if it lies on the path the current generation descends from."""
        limit: float = float("inf")
        for g, branched_at in reversed(self.lineage):
            if gen == g:
                return step <= limit
            if branched_at is not None:
                limit = min(limit, branched_at)
        return False

    def _launch(self, plan: rc.ResumePlan, initial: bool = False) -> rc.Observation | None:
        gen = plan.generation
        plan_path = None
        if not initial:
            plan_path = str(self.run_dir / "plans" / f"gen{gen:03d}.json")
            with open(plan_path, "w", encoding="utf-8") as f:
                f.write(plan.to_json())
                f.flush()
                os.fsync(f.fileno())
        self._write_fence(gen)
        self.group.launch(generation=gen, cmd=self.cmd, env=self.env, plan_path=plan_path,
                          fence_file=str(self.fence_file), ckpt_dir=str(self.ckpt_dir))
        self.lineage.append((gen, plan.checkpoint_step))
        self.collector.new_generation(gen, self.journal.mono())
        if initial:
            self._apply(rc.Launched(gen))
            return None
        return rc.Launched(gen)

    def _write_fence(self, gen: int) -> None:
        tmp = self.fence_file.with_suffix(".tmp")
        tmp.write_text(str(gen))
        os.replace(tmp, self.fence_file)

    def _event(self, ev: dict[str, Any]) -> None:
        rec = self.journal.record(ev)
        for n in self.notifiers:
            try:
                n.handle(rec)
            except Exception as e:  # a notifier must never stop a recovery
                print(f"spikeguard: notifier {type(n).__name__} failed: {e}")

    def _write_status(self) -> None:
        st = self.state
        c = self.collector
        data = {"phase": st.phase.value, "generation": st.generation, "lr_scale": st.lr_scale,
                "incident": st.incident.id if st.incident else None, "probation_until": st.probation_until,
                "exit_code": st.exit_code, "dropped": dict(c.dropped), "rank_dropped": c.rank_dropped,
                "ranks": {r: {"step": v.step, "loss": _jsonable(v.loss), "grade": v.summary.get("grade"),
                              "attn_entropy_min": _jsonable(v.summary.get("attn_entropy_min")),
                              "exit_code": v.exit_code} for r, v in c.ranks.items()},
                "updated": time.time()}
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.run_dir / "status.json")

    def close(self) -> None:
        self._reports.close()
        self.journal.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not is_finite(x):
        return str(x)
    return x
