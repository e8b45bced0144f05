"""The supervisor's plan for this launch, and applying it: the checkpoint to load, the optimizer
reset, the LR scale and the batches to skip.

* :class:`LaunchPlan` is the plan (``SPIKEGUARD_RESUME``); a warm standby has none until the
  supervisor releases it (:mod:`spikeguard.workers.standby`), and waits for that release the
  first time anything needs the plan;
* :class:`LrScale` installs the plan's LR scale as optimizer step hooks, so that it survives any
  LR schedule (with its re-warm-up after an optimizer reset, and the cut given back after
  probation);
* :class:`BatchSkips` says whether a batch is one the plan skips (by step, or by its ids);
* :class:`Resume` applies the plan: loads the checkpoint (or lets a framework load it), installs
  the scale, counts steps from the right one and tells the supervisor (``resumed``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import batches, contract
from .. import checkpoint as ckpt
from ..contract.logs import logger
from ..standby import wait_for_release
from .reports import Reporter
from .sampling import Sampler

log = logger(__name__)


class LaunchPlan:
    """The plan this process was launched with, or, in a standby, the one its release brings."""

    def __init__(
        self,
        reporter: Reporter,
        *,
        generation: int,
        rank: int,
        fence_file: str | None,
        standby_agent: int | None,
    ) -> None:
        self._reporter = reporter
        self._generation = generation
        self._rank = rank
        self._fence_file = fence_file
        self._agent = standby_agent
        """The agent of a standby still waiting for its release; None once released (or never
        a standby)."""
        self._plan = None if standby_agent is not None else contract.ResumePlan.from_env()
        self.waited_s: float | None = None
        """How long a standby waited for its release (None: no standby)."""

    @property
    def current(self) -> contract.ResumePlan | None:
        """The plan as known now, without waiting (None in a standby not yet released)."""
        return self._plan

    def get(self) -> contract.ResumePlan | None:
        """The plan, after the release in a standby (see :meth:`await_release`)."""
        self.await_release()
        return self._plan

    def await_release(self) -> None:
        """In a standby process, wait here until the supervisor releases it (or exit, when it
        is fenced or orphaned); elsewhere a flag check."""
        if self._agent is None:
            return
        released = wait_for_release(
            self._reporter,
            generation=self._generation,
            rank=self._rank,
            fence_file=self._fence_file,
            parent_pid=self._agent,
        )
        self._agent = None
        self._plan = released.plan
        self.waited_s = released.waited_s


class LrScale:
    """The plan's LR multiplier, applied to optimizer steps by pre/post hooks: its scale, ramped
    up over a re-warm-up after an optimizer reset (``rewarm_steps``, counted in this generation's
    optimizer steps) and, once the incident's probation is over, returning to the scale before
    the cut (``lr_restore_*``, against the training step :meth:`feed` gives it)."""

    def __init__(self) -> None:
        self.value = 1.0
        """The plan's LR scale (1.0 until a plan says otherwise); the multiplier in force
        without a re-warm-up or a restore."""
        self._plan: contract.ResumePlan | None = None
        """The plan whose re-warm-up and restore apply (None: :attr:`value` alone)."""
        self.optimizer_steps = 0
        """Optimizer steps taken since launch (the most of any scaled optimizer)."""
        self._next_step = 0
        """The training step the next optimizer step belongs to."""
        self._used: float | None = None
        """The multiplier the latest optimizer step used (None: no step yet)."""
        self._scaled: weakref.WeakKeyDictionary[torch.optim.Optimizer, _ScaledSteps] = (
            weakref.WeakKeyDictionary()
        )
        """Optimizers whose steps carry the hooks, each with its hooks' state."""
        self._handles: list[Any] = []

    def configure(self, plan: contract.ResumePlan, start: int) -> None:
        """Take ``plan``'s scale, re-warm-up and restore; training resumes at step ``start``."""
        self.value = float(plan.lr_scale)
        self._plan = plan if plan.rewarm_steps or plan.lr_restore_from is not None else None
        self._next_step = start

    def feed(self, step: int) -> None:
        """Training step ``step`` finished (``Session.step``): the next one is ``step + 1``."""
        self._next_step = step + 1

    def multiplier(self, optimizer_steps: int | None = None) -> float:
        """The multiplier of the next optimizer step (after ``optimizer_steps`` of them; None:
        :attr:`optimizer_steps`)."""
        if self._plan is None:
            return self.value
        taken = self.optimizer_steps if optimizer_steps is None else optimizer_steps
        ramp = self._plan.rewarm_factor(taken)
        restoring = self._plan.lr_restore_from is not None
        return ramp * (self._plan.scale_at(self._next_step) if restoring else self.value)

    def stepping(self, optimizer_steps: int) -> float:
        """An optimizer step after ``optimizer_steps`` of them begins: its multiplier (now the
        one :attr:`in_force`)."""
        self._used = self.multiplier(optimizer_steps)
        return self._used

    @property
    def in_force(self) -> float:
        """The multiplier the latest optimizer step used (before any: the next one's): what
        ``Session.step`` multiplies the script's LR by to report the effective LR."""
        return self.multiplier() if self._used is None else self._used

    @property
    def idle(self) -> bool:
        """Nothing to apply: scale 1, no re-warm-up, no restore."""
        return self.value == 1.0 and self._plan is None

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Scale ``optimizer``'s steps: a pre hook multiplies each group's ``lr`` for the step
        and a post hook puts the schedule's value back after it, so the scale survives any LR
        schedule. Once per optimizer (a second call does nothing); nothing when :attr:`idle`.
        Each optimizer counts its own steps for the re-warm-up."""
        if self.idle or optimizer in self._scaled:
            return
        scaled = _ScaledSteps(self)
        self._scaled[optimizer] = scaled
        self._handles += [
            optimizer.register_step_pre_hook(scaled.pre),
            optimizer.register_step_post_hook(scaled.post),
        ]

    def show(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the LR the next step of ``optimizer`` will use into its param groups now, before
        that step, so that whatever reads them in between (Lightning's ``LearningRateMonitor``,
        a module's own ``self.log``) sees the applied LR, not the schedule's. :meth:`hide` (or
        the step's own hooks) puts the schedule's value back before any scheduler reads it.
        Nothing for an optimizer without the scale's hooks."""
        scaled = self._scaled.get(optimizer)
        if scaled is not None:
            scaled.show(optimizer)

    def hide(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo :meth:`show`: the schedule's values back in the param groups (a group whose
        ``lr`` was set anew since, by a schedule of the script's own, keeps that value)."""
        scaled = self._scaled.get(optimizer)
        if scaled is not None:
            scaled.hide(optimizer)

    def remove(self) -> None:
        """Remove every hook installed."""
        for h in self._handles:
            h.remove()


class _ScaledSteps:
    """The step hooks of one optimizer scaled by an :class:`LrScale`, and their state: the
    schedule's LRs while a step (or a :meth:`show`) runs at the scaled ones, and the optimizer
    steps taken (for the re-warm-up). Holds no reference to the optimizer."""

    def __init__(self, scale: LrScale) -> None:
        self._scale = scale
        self.taken = 0
        """Optimizer steps this optimizer took with the hooks."""
        self._saved: list[Any] = []
        """The schedule's LR of each group during a step (restored after it)."""
        self._shown: tuple[list[Any], list[Any]] | None = None
        """While :meth:`show` is in force: (the schedule's LRs, the scaled values put in)."""

    def _schedule(self, opt: torch.optim.Optimizer) -> list[Any]:
        """The schedule's LR of each group now: a group still holding the value :meth:`show`
        put in has the one it replaced; one set anew since (a schedule of the script's own)
        has that new value."""
        groups = [g["lr"] for g in opt.param_groups]
        if self._shown is None:
            return groups
        saved, put = self._shown
        return [s if lr is p else lr for lr, s, p in zip(groups, saved, put)] + groups[len(put) :]

    def show(self, opt: torch.optim.Optimizer) -> None:
        if self._shown is not None:
            return
        factor = self._scale.multiplier(self.taken)
        schedule = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * factor
        self._shown = (schedule, [g["lr"] for g in opt.param_groups])

    def hide(self, opt: torch.optim.Optimizer) -> None:
        if self._shown is None:
            return
        for g, lr in zip(opt.param_groups, self._schedule(opt)):
            g["lr"] = lr
        self._shown = None

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        factor = self._scale.stepping(self.taken)
        self._saved = self._schedule(opt)
        self._shown = None
        for g, lr in zip(opt.param_groups, self._saved):
            g["lr"] = lr * factor

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g, lr in zip(opt.param_groups, self._saved):
            g["lr"] = lr
        self.taken += 1
        self._scale.optimizer_steps = max(self._scale.optimizer_steps, self.taken)


class BatchSkips:
    """Which batches a plan skips: the steps of its ``skip_ranges``, and the batches recorded
    in its batch-ids file for the incident's window (loaded once, on first use)."""

    def __init__(self) -> None:
        self._keys: set[str] | None = None
        """The batches the plan skips by id; None: not loaded (yet)."""
        self._by_steps = False
        """The plan's batch-ids file could not be read: its step window is skipped instead."""

    def reason(self, plan: contract.ResumePlan, step: int, batch_ids: Any) -> str | None:
        """Why ``plan`` skips ``step`` with ``batch_ids``: ``"steps"``, ``"batch_ids"``, or None
        (not skipped). Without ``batch_ids``, or when the batch-ids file cannot be read, the
        incident window's steps are skipped instead."""
        if any(a <= step <= b for a, b in plan.skip_ranges):
            return "steps"
        window = plan.skip_batches_steps
        if window is None:
            return None
        keys = None if batch_ids is None else self._skip_set(plan.skip_batches, window)
        if keys is None:
            return "steps" if window[0] <= step <= window[1] else None
        return "batch_ids" if batches.batch_key(batch_ids) in keys else None

    def _skip_set(self, path: str | None, window: tuple[int, int]) -> set[str] | None:
        """The batches the plan skips by id, loaded once; None when they cannot be known."""
        if self._keys is None and not self._by_steps:
            try:
                if path is None:
                    raise ValueError("the plan names no batch-ids file")
                self._keys = batches.load_skip_set(path, window)
            except ValueError as e:
                self._by_steps = True
                log.warning(f"{e}; skipping steps {window[0]}..{window[1]} instead")
        return self._keys


def restore(
    plan: contract.ResumePlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    writer: Callable[[], ckpt.ShardedWriter],
) -> int:
    """Load ``plan``'s checkpoint, if it names one, into ``model`` (and ``optimizer`` unless the
    plan resets it, and ``scheduler``); the step to start from. A sharded checkpoint is loaded
    collectively over ``writer()``'s groups; a single file is verified and loaded weights-only."""
    if not plan.checkpoint:
        return 0
    if ckpt.is_sharded_path(plan.checkpoint):
        info = ckpt.load_sharded(
            plan.checkpoint,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            reset_optimizer=plan.reset_optimizer,
            expected_sha256=plan.sha256,
            writer=writer(),
        )
        return info.step + 1
    state = ckpt.load_checkpoint(plan.checkpoint, expected_sha256=plan.sha256)
    model.load_state_dict(state["model"])
    if optimizer is not None and not plan.reset_optimizer and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    fallback = plan.checkpoint_step if plan.checkpoint_step is not None else -1
    return int(state.get("step", fallback)) + 1


class Resume:
    """Applies the launch's plan to this rank's training (see the module docstring)."""

    def __init__(
        self,
        *,
        launch: LaunchPlan,
        lr: LrScale,
        sampler: Sampler,
        reporter: Reporter,
        writer: Callable[[], ckpt.ShardedWriter],
    ) -> None:
        self._launch = launch
        self._lr = lr
        self._sampler = sampler
        self._reporter = reporter
        self._writer = writer
        self._skips = BatchSkips()

    def apply(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> int:
        """Load the plan's checkpoint and apply the rest of it; the step to start from (see
        :meth:`~spikeguard.workers.session.Session.resume`)."""
        plan = self._launch.get()
        if plan is None:
            return 0
        start = restore(plan, model, optimizer, scheduler, self._writer)
        self.announce(
            plan,
            start,
            optimizer=optimizer,
            checkpoint=plan.checkpoint,
            optimizer_reset=bool(plan.reset_optimizer and optimizer is not None),
        )
        return start

    def announce(
        self,
        plan: contract.ResumePlan,
        start: int,
        *,
        optimizer: torch.optim.Optimizer | None,
        checkpoint: str | None,
        optimizer_reset: bool,
    ) -> None:
        """``plan`` was applied: install its LR scale on ``optimizer``, count steps from
        ``start``, send ``resumed``."""
        if optimizer is not None:
            self._lr.configure(plan, start)
            self._lr.apply(optimizer)
        self._sampler.start_at(start)
        waited = self._launch.waited_s
        self._reporter.send(
            "resumed",
            start,
            from_step=start,
            checkpoint=checkpoint,
            lr_scale=self._lr.value,
            optimizer_reset=optimizer_reset,
            skip_ranges=[list(r) for r in plan.skip_ranges],
            **({} if waited is None else {"standby_wait_s": waited}),
        )

    def by_framework(
        self, start: int, optimizers: Sequence[torch.optim.Optimizer], *, loaded: bool
    ) -> None:
        """The rest of the plan after a framework restored its checkpoint itself (see
        :meth:`.framework.FrameworkApi.resumed_by_framework`)."""
        plan = self._launch.get()
        self._sampler.start_at(start)
        if plan is None:
            return
        if plan.checkpoint and not loaded:
            raise ckpt.CheckpointError(
                f"the supervisor's plan resumes from {plan.checkpoint}, which the framework did "
                "not load (pass the integration's checkpoint path to its resume call)"
            )
        if plan.reset_optimizer:
            for optimizer in optimizers:
                optimizer.state.clear()
        self._lr.configure(plan, start)
        for optimizer in optimizers:
            self._lr.apply(optimizer)
        self.announce(
            plan,
            start,
            optimizer=None,
            checkpoint=plan.checkpoint,
            optimizer_reset=bool(plan.reset_optimizer and optimizers),
        )

    def skip(self, step: int, batch_ids: Any) -> bool:
        """Whether the plan skips this batch; a skip is reported (``skipped``) and the next
        step is ``step + 1`` (see :meth:`~spikeguard.workers.session.Session.should_skip`)."""
        plan = self._launch.get()
        if plan is None:
            return False
        by = self._skips.reason(plan, step, batch_ids)
        if by is None:
            return False
        self._reporter.send("skipped", step, by=by)
        self._sampler.start_at(step + 1)
        return True
