"""What a framework integration calls (``Session.framework``), beyond what a training script
does.

A script that owns its loop calls ``resume()`` and ``save_checkpoint()``; a framework (the
Hugging Face ``Trainer``, Lightning) owns its loop, loads its own checkpoints and writes its own,
so its integration (:mod:`spikeguard.workers.integrations`) needs the pieces of those calls
instead: the plan, the step to count from, the LR scale, a rank's grade, a commit's fence and
report, a collective. This object is that list, and nothing else; each method delegates to the
part that owns the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import checkpoint as ckpt
from .. import contract
from .checkpoints import Checkpoints
from .reports import Fence
from .resume import LaunchPlan, LrScale, Resume
from .sampling import Sampler


class FrameworkApi:
    """The integration-facing API of one rank's session (see the module docstring)."""

    def __init__(
        self,
        *,
        rank: int,
        launch: LaunchPlan,
        resume: Resume,
        lr: LrScale,
        sampler: Sampler,
        checkpoints: Checkpoints,
        fence: Fence,
    ) -> None:
        self._rank = rank
        self._launch = launch
        self._resume = resume
        self._lr = lr
        self._sampler = sampler
        self._checkpoints = checkpoints
        self._fence = fence

    # -- the plan ----------------------------------------------------------------------------
    def launch_plan(self) -> contract.ResumePlan | None:
        """The supervisor's plan for this launch (a standby process waits for its release
        here), or None without one. For integrations that resume through their framework."""
        return self._launch.get()

    def start_at(self, step: int) -> None:
        """The next ``Session.step`` will be ``step``: arm the probes for it if it is
        sampled."""
        self._sampler.start_at(step)

    def resumed(
        self,
        start: int,
        *,
        optimizer: torch.optim.Optimizer | None,
        checkpoint: str | None,
        optimizer_reset: bool,
    ) -> None:
        """Say the plan was applied: install its LR scale on ``optimizer`` (step hooks, so that
        it survives any schedule), count steps from ``start``, send ``resumed``.
        ``Session.resume`` ends with it; an integration whose framework loaded ``checkpoint``
        (and reset the optimizer state, when ``optimizer_reset``) calls it itself. Nothing
        without a plan."""
        plan = self._launch.current
        if plan is None:
            return
        self._resume.announce(
            plan, start, optimizer=optimizer, checkpoint=checkpoint, optimizer_reset=optimizer_reset
        )

    def resumed_by_framework(
        self, start: int, optimizers: Sequence[torch.optim.Optimizer], *, loaded: bool
    ) -> None:
        """Apply the rest of the plan after a training framework restored the plan's checkpoint
        itself (Lightning's ``trainer.fit(ckpt_path=...)``), model, optimizer and scheduler state.

        ``start`` is the first step the framework will train; ``loaded`` says whether it loaded
        the plan's checkpoint (a plan that names one which was not loaded raises
        :class:`~spikeguard.workers.checkpoint.CheckpointError`: training from scratch would
        pass for a rollback). When the plan resets the optimizer, the state the framework
        restored into each of ``optimizers`` is dropped (its hyper-parameters, and the
        scheduler's state, stay); the LR scale is installed as step hooks on each (see
        :meth:`scale_lr`). Then the supervisor is told, as ``Session.resume`` tells it. Without
        a plan, only the step count is set.
        """
        self._resume.by_framework(start, optimizers, loaded=loaded)

    def scale_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the plan's LR scale to ``optimizer``'s steps (pre/post step hooks: the scale
        survives any LR schedule). Once per optimizer; nothing at scale 1."""
        self._lr.apply(optimizer)

    def show_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """Until ``optimizer``'s next step (or :meth:`hide_lr`), its param groups hold the LR
        that step will use, the plan's scale applied, so a framework's own LR logging (which
        reads them between steps) shows the applied LR; the step's hooks take it from there and
        put the schedule's value back after the step, before any scheduler reads it. Nothing at
        scale 1."""
        self._lr.show(optimizer)

    def hide_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo :meth:`show_lr` (the schedule's values back) when the step it was for may not
        come (a step the AMP grad scaler skips), so that a scheduler never reads the scaled
        value."""
        self._lr.hide(optimizer)

    def lr_multiplier(self) -> float:
        """The multiplier the latest optimizer step used (before any: the next one's): the
        plan's scale, its re-warm-up, a cut being given back. A framework whose logs read the
        LR from its scheduler multiplies that by this."""
        return self._lr.in_force

    # -- a framework's own checkpoints -------------------------------------------------------
    def check_fence(self) -> None:
        """Raise :class:`~spikeguard.workers.session.StaleGenerationError` if this rank's
        generation was replaced."""
        self._fence.check()

    def grade_meta(self) -> dict[str, Any]:
        """This rank's grade, loss and signals of its latest sample (what a checkpoint records)."""
        return {"rank": self._rank, **self._sampler.grade_meta()}

    def checkpoint_meta(self) -> dict[str, Any]:
        """The run's fields of a checkpoint's metadata (LR scale, run id)."""
        return self._checkpoints.run_meta()

    def report_checkpoint(self, info: ckpt.CheckpointInfo) -> None:
        """Tell the supervisor about a checkpoint committed outside ``Session.save_checkpoint``
        (a framework's own, committed by an integration); it answers the pending requests."""
        self._checkpoints.report(info)

    # -- collectives ---------------------------------------------------------------------------
    def agree_max(self, value: int) -> int:
        """The largest ``value`` any rank passes (a collective on spikeguard's own gloo group:
        every rank calls it at the same point)."""
        return self._checkpoints.agree_max(value)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, by rank (a collective on spikeguard's own gloo group)."""
        return self._checkpoints.gather(obj)
