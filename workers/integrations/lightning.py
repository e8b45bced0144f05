"""spikeguard in a Lightning ``Trainer``: one callback, one argument to ``fit``.

Needs torch and ``lightning`` 2.x (the extra ``spikeguard[lightning]``; the ``lightning`` package,
``import lightning as L``, not the older standalone ``pytorch_lightning``)::

    from spikeguard.workers.integrations.lightning import SpikeguardCallback

    sg = SpikeguardCallback()
    trainer = L.Trainer(callbacks=[sg], strategy="ddp", ...)
    trainer.fit(model, datamodule=dm, ckpt_path=sg.ckpt_path(model))

What the callback does, per hook:

* ``setup``: attaches a :class:`~spikeguard.workers.session.Session` to the ``LightningModule``
  (probes on its blocks, attention and head, by the SDK's default name patterns) and wraps the
  strategy's ``CheckpointIO`` in :class:`~.lightning_io.SpikeguardCheckpointIO`, so spikeguard's
  checkpoints are written and read through spikeguard's checksummed, fenced, weights-only path.
* ``on_train_start``: Lightning has restored the plan's checkpoint by now (weights, optimizer and
  scheduler state, loop progress: ``global_step``); the plan's optimizer reset drops the optimizer
  state it restored and the LR scale is installed as optimizer step hooks (on top of any
  scheduler), then the supervisor is told (``resumed``).
* every optimizer step: a report with the loss of ``training_step``'s output, the gradient norm
  (before clipping, over every optimizer's parameters) and the LR the step used (the first param
  group's, times the LR scale); the probes
  sample every ``sample_every`` steps (never during validation or the sanity check).
* the LR Lightning logs is the applied one: from each batch's start until its optimizer step,
  the param groups hold the LR that step uses (the plan's scale applied), so the
  ``LearningRateMonitor`` and a module's own ``self.log`` of ``param_groups[0]["lr"]`` show the
  cut; the step's hooks put the schedule's value back after the step, before the scheduler steps
  (and ``on_before_optimizer_step`` does, for a step the AMP grad scaler skips). The callback
  moves itself first in ``trainer.callbacks`` so its batch start comes before any monitor's.
* checkpoints: every ``checkpoint_every`` steps (the job's ``checkpoint_every`` overrides the
  argument, as ``SPIKEGUARD_*`` variables override the SDK's arguments) and whenever the
  supervisor asks, decided by all ranks together (one all-reduce of one integer per step),
  ``trainer.save_checkpoint`` writes a Lightning checkpoint into the run's checkpoint directory
  under spikeguard's name, graded with the latest sample. Only global rank 0 writes (Lightning's
  rule); a rank of a replaced generation cannot publish. The directory may be an object store
  (``SPIKEGUARD_CKPT_DIR=s3://bucket/prefix``): the file is written straight to it and a
  rollback loads it from there (``ckpt_path`` is the plan's URL), verified, with no local copy.

Steps are counted as spikeguard counts them: the step a report or checkpoint is of is
``trainer.global_step - 1`` after the optimizer step (the first optimizer step is step 0), and a
checkpoint of step ``s`` holds ``global_step = s + 1``, where the resumed fit goes on.

Not applied: the plan's ``skip_window`` / ``skip_by`` (Lightning has no per-batch skip that all
ranks of a DDP job can take together; a warning says so when a plan asks for it) and batch ids
for forensics (the callback does not know what identifies a batch).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from .. import contract
from ..checkpoint.format import checkpoint_name
from ..session import Session, attach
from .lightning_io import SpikeguardCheckpointIO

DEFAULT_CHECKPOINT_EVERY = 500
"""Steps between checkpoints when neither ``checkpoint_every`` nor ``SPIKEGUARD_CKPT_EVERY``
says."""


def _loss_of(outputs: Any) -> Any:
    """The loss in a ``training_step`` output: a tensor, ``{"loss": ...}``, or None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return outputs


def _grad_sq_sum(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The sum of squares of every gradient ``optimizer`` steps (None: no gradient)."""
    norms = [
        torch.linalg.vector_norm(p.grad.detach(), 2.0).float()
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if not norms:
        return None
    device = norms[0].device
    return torch.stack([n.to(device) for n in norms]).square().sum()


class SpikeguardCallback(pl.Callback):
    """spikeguard for ``lightning.Trainer``: reports, graded checkpoints, supervised resumes.

    Args:
        sample_every: probe activations every N steps (``SPIKEGUARD_SAMPLE_EVERY`` overrides).
        checkpoint_every: save a checkpoint every N steps (0: only when the supervisor asks);
            default 500. The job's ``checkpoint_every`` (``SPIKEGUARD_CKPT_EVERY``) overrides
            it (with a warning when they differ).
        ckpt_dir: where checkpoints go without a supervisor (``SPIKEGUARD_CKPT_DIR`` overrides);
            with neither, no checkpoints are saved.
        report: where reports go without a supervisor (``"off"`` or ``"jsonl:///path"``;
            ``SPIKEGUARD_REPORT`` overrides).
        run_id: a name echoed in every message (``SPIKEGUARD_RUN_ID`` overrides).
        probe_patterns: keyword arguments for :class:`~spikeguard.workers.probes.Probes`
            (module name patterns are matched against the ``LightningModule``'s module names).
    """

    def __init__(
        self,
        *,
        sample_every: int = 200,
        checkpoint_every: int | None = None,
        ckpt_dir: str | None = None,
        report: str | None = None,
        run_id: str | None = None,
        probe_patterns: dict[str, Iterable[str]] | None = None,
    ) -> None:
        super().__init__()
        self.sample_every = sample_every
        if checkpoint_every is None:
            checkpoint_every = contract.env_int(contract.ENV_CKPT_EVERY, DEFAULT_CHECKPOINT_EVERY)
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self._attach_kwargs: dict[str, Any] = {
            "report": report,
            "ckpt_dir": ckpt_dir,
            "run_id": run_id,
            "probe_patterns": probe_patterns,
        }
        self._session: Session | None = None
        self._io: SpikeguardCheckpointIO | None = None
        self._grad_sq: torch.Tensor | None = None
        self._lr: float | None = None
        """The first param group's LR (unscaled) as the step began."""
        self._reported: int | None = None
        """The last step reported (several batches make one step under gradient accumulation)."""

    # -- the user's surface --------------------------------------------------------------------
    @property
    def session(self) -> Session:
        """The rank's session (attached at ``ckpt_path`` in a standby, else at ``setup``)."""
        if self._session is None:
            raise RuntimeError("SpikeguardCallback is attached when the Trainer sets up")
        return self._session

    def ckpt_path(self, model: pl.LightningModule, default: str | None = None) -> str | None:
        """The checkpoint ``trainer.fit(..., ckpt_path=...)`` must resume from: the one the
        supervisor's plan names (a rollback), else ``default`` (None: a fresh start, or
        whatever Lightning resumes from by itself).

        In a warm standby (the job's ``standby: true``) this attaches to ``model`` and waits for
        the supervisor's release, which brings the plan.
        """
        if self._session is None and os.environ.get(contract.ENV_STANDBY):
            self._attach(model)
        if self._session is not None:
            plan = self._session.framework.launch_plan()
        else:
            plan = contract.ResumePlan.from_env()
        if plan is not None and plan.checkpoint:
            return plan.checkpoint
        return default

    # -- set-up --------------------------------------------------------------------------------
    def _attach(self, model: pl.LightningModule) -> Session:
        self._session = attach(model, sample_every=self.sample_every, **self._attach_kwargs)
        return self._session

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach to the module and wrap the strategy's ``CheckpointIO`` (before Lightning loads
        ``ckpt_path``: the load goes through it)."""
        if stage != "fit":
            return
        # Lightning's own launchers do not always export the torchrun variables the SDK reads
        os.environ.setdefault("RANK", str(trainer.global_rank))
        os.environ.setdefault("WORLD_SIZE", str(trainer.world_size))
        session = self._session or self._attach(pl_module)
        # first among the callbacks: its batch start puts the applied LR into the param groups
        # before a LearningRateMonitor (or any other callback) reads them
        if trainer.callbacks and trainer.callbacks[0] is not self and self in trainer.callbacks:
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)
        strategy = trainer.strategy
        current = strategy.checkpoint_io
        if isinstance(current, SpikeguardCheckpointIO):
            current.session = session
            self._io = current
        else:
            self._io = SpikeguardCheckpointIO(session, current)
            strategy.checkpoint_io = self._io
        if session.ckpt_dir is None and self.checkpoint_every:
            warnings.warn(
                "spikeguard: no checkpoint directory (ckpt_dir= or SPIKEGUARD_CKPT_DIR): "
                "no graded checkpoints will be saved",
                stacklevel=2,
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply the plan to what Lightning restored: optimizer reset, LR scale; say resumed."""
        api = self.session.framework
        plan = api.launch_plan()
        if plan is not None and (plan.skip_ranges or plan.skip_batches_steps):
            warnings.warn(
                "spikeguard: the plan skips the incident's batches, which the Lightning "
                "callback does not do; training goes on over the same data",
                stacklevel=2,
            )
        loaded = self._io is not None and self._io.loaded_plan_checkpoint()
        api.resumed_by_framework(trainer.global_step, trainer.optimizers, loaded=loaded)
        self._reported = trainer.global_step - 1

    # -- every step ----------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The applied LR in the param groups for an epoch-interval ``LearningRateMonitor``."""
        self._show_lr(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Note the LR this step will use (Lightning steps the schedulers before
        ``on_train_batch_end``); optimizers (re)created since get the LR scale too; then put the
        applied LR into the param groups until the step (what Lightning's LR logging reads)."""
        self._show_lr(trainer)

    def _show_lr(self, trainer: pl.Trainer) -> None:
        api = self.session.framework
        optimizers = trainer.optimizers
        for optimizer in optimizers:
            api.scale_lr(optimizer)
            api.hide_lr(optimizer)  # the schedule's LR to note (shown already, accumulating)
        self._lr = float(optimizers[0].param_groups[0]["lr"]) if optimizers else None
        for optimizer in optimizers:
            api.show_lr(optimizer)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Add this optimizer's gradients to the step's norm (after accumulation and unscaling,
        before clipping); the schedule's LR back in its param groups (the step's own hooks
        apply the scale; a step the AMP grad scaler skips must leave the schedule's value for
        the scheduler)."""
        self.session.framework.hide_lr(optimizer)
        sq = _grad_sq_sum(optimizer)
        if sq is not None:
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq.to(self._grad_sq)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Report the step that just finished; checkpoint when all ranks agree it is due."""
        for optimizer in trainer.optimizers:  # a batch that only accumulated: nothing scaled
            self.session.framework.hide_lr(optimizer)  # stays in what a checkpoint saves
        step = trainer.global_step - 1
        if step < 0 or step == self._reported:
            return  # accumulating: no optimizer step yet
        self._reported = step
        session = self.session
        grad_sq, self._grad_sq = self._grad_sq, None
        session.step(
            step=step,
            loss=_loss_of(outputs),
            grad_norm=None if grad_sq is None else math.sqrt(float(grad_sq)),
            lr=self._lr,
            total_steps=trainer.max_steps if trainer.max_steps > 0 else None,
        )
        if session.ckpt_dir is None:
            return
        if session.should_checkpoint(step, every=self.checkpoint_every, collective=True):
            name = checkpoint_name(step, session.generation, rank=0)
            # Lightning's weights_only=False *saves* the optimizer and loop state too (a rollback
            # needs them); loading is always torch.load(weights_only=True), see lightning_io
            trainer.save_checkpoint(os.path.join(session.ckpt_dir, name), weights_only=False)

    # -- no samples outside training steps -----------------------------------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation (and the sanity check) runs forwards between steps: not a sample."""
        if self._session is not None:
            self._session.pause_sampling()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sample again from the next training step."""
        if self._session is not None:
            self._session.resume_sampling()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training finished: say ``done`` and flush the report channel."""
        if self._session is not None:
            self._session.close()
