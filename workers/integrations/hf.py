"""spikeguard inside a Hugging Face ``transformers.Trainer`` (extra ``spikeguard[hf]``).

Two lines in a Trainer script::

    from spikeguard.workers.integrations.hf import SpikeguardCallback

    sg = SpikeguardCallback()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[sg])
    trainer.train(resume_from_checkpoint=sg.resume_from_checkpoint())

What the callback does, on every rank:

* **Reports every step** (``on_step_end``): this rank's loss (the mean of the ``loss`` its model
  returned over the step's micro-batches, read by a forward hook), the learning rate the optimizer
  stepped with (times the plan's LR scale), and the gradient norm on the Trainer's logging steps
  (from its logs: the Trainer computes it but hands it to no callback otherwise). The probes sample
  every ``sample_every`` steps (the Hugging Face attention capture included: true entropies on
  RoPE / QK-norm models). Steps are the Trainer's ``global_step`` (the first is 1).
* **Grades the Trainer's own checkpoints**: after the Trainer saved ``checkpoint-N`` (``on_save``),
  the ranks gather their grades and rank 0 commits the directory with spikeguard's commit marker
  (:mod:`spikeguard.workers.checkpoint.trainer_commit`: every file's sha256, the worst rank's
  grade), unless its generation was fenced. The supervisor lists and verifies these directories
  like any checkpoint; one without a marker, or whose files no longer match it, is never chosen.
  Under the supervisor the Trainer's ``output_dir`` is pointed at the run's checkpoint directory.
* **Honours the supervisor's checkpoint requests**: ``should_checkpoint`` is asked collectively
  at every step (one all-reduce of an integer on spikeguard's own gloo group), so every rank sets
  ``control.should_save`` at the same step.
* **Rolls back through the Trainer's resume**: :meth:`SpikeguardCallback.resume_from_checkpoint`
  returns the plan's ``checkpoint-N`` (verified against the plan's checksum first) or None; the
  Trainer loads weights, optimizer, scheduler, RNG and ``global_step`` as it always does; then at
  ``on_train_begin`` the callback empties the optimizer state when the plan resets it (after
  the Trainer loaded ``optimizer.pt``) and installs the plan's LR scale as optimizer step hooks
  (over whatever the scheduler sets).

What a Trainer user gives up: the supervisor's batch skipping (``skip_window``, ``skip_by``: the
Trainer owns the data order), checkpoints of FSDP / DeepSpeed runs (sharded subdirectories are not
committed: such a ``checkpoint-N`` is never a rollback target), and ``save_total_limit`` (the
Trainer's rotation may delete a rollback target: use the job's ``checkpoints:`` retention).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..checkpoint import commit as _commit
from ..checkpoint import trainer_commit
from ..checkpoint.format import CheckpointError
from ..contract.env import ENV_CKPT_DIR
from ..contract.logs import logger
from ..session import Session, StaleGenerationError, attach

__all__ = ["SpikeguardCallback"]

log = logger(__name__)


def _inner(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under accelerate's wrapper (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


class SpikeguardCallback(TrainerCallback):
    """Connects a ``transformers.Trainer`` to spikeguard; see the module docstring.

    Args:
        sample_every: probe every N steps (``SPIKEGUARD_SAMPLE_EVERY`` overrides).
        report: where reports go without a supervisor (``"jsonl:///path"``; default off).
        probe_patterns: keyword arguments of :class:`~spikeguard.workers.probes.Probes`.
        session_kwargs: more keyword arguments of :func:`~spikeguard.workers.attach`.
    """

    def __init__(
        self,
        *,
        sample_every: int = 200,
        report: str | None = None,
        probe_patterns: dict[str, Any] | None = None,
        **session_kwargs: Any,
    ) -> None:
        self._attach_kwargs = {
            "sample_every": sample_every,
            "report": report,
            "probe_patterns": probe_patterns,
            **session_kwargs,
        }
        self.session: Session | None = None
        """The rank's :class:`Session`, created when the Trainer is (``on_init_end``)."""
        self._resume_dir: str | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._lr: float | None = None
        self._pending: dict[str, Any] | None = None
        self._hook: Any = None

    # -- the user's one call -----------------------------------------------------------------
    def resume_from_checkpoint(self) -> str | None:
        """The ``checkpoint-N`` directory the supervisor's plan rolls back to, verified against
        the plan's checksum, or None (a fresh start). Pass it to ``trainer.train``. Create the
        Trainer (with this callback) first. Raises
        :class:`~spikeguard.workers.checkpoint.CheckpointError` when the directory does not match
        the plan (the rank exits; the supervisor falls back to an older checkpoint)."""
        plan = self._sg().framework.launch_plan()
        self._resume_dir = None
        if plan is None or not plan.checkpoint:
            return None
        name = os.path.basename(os.path.normpath(plan.checkpoint))
        if _commit.parse_trainer_name(name) is None:
            raise CheckpointError(
                f"the plan's checkpoint {plan.checkpoint} is not a Trainer checkpoint directory"
            )
        trainer_commit.verify_for_resume(plan.checkpoint, plan.sha256)
        self._resume_dir = plan.checkpoint
        return plan.checkpoint

    def _sg(self) -> Session:
        if self.session is None:
            raise RuntimeError("SpikeguardCallback: create the Trainer with this callback first")
        return self.session

    # -- Trainer events ----------------------------------------------------------------------
    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None or self.session is not None:
            return
        ckpt_dir = os.environ.get(ENV_CKPT_DIR)
        if ckpt_dir and os.path.abspath(args.output_dir or "") != os.path.abspath(ckpt_dir):
            # the supervisor scans the run's checkpoint directory for checkpoint-N
            args.output_dir = ckpt_dir
        self.session = attach(model, ckpt_dir=args.output_dir, **self._attach_kwargs)
        self._hook = model.register_forward_hook(self._on_forward)

    def _on_forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """Add up the loss the model returns in training (one tensor op; no sync)."""
        if not module.training:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            d = loss.detach().float()
            self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
            self._loss_n += 1

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        api = self._sg().framework
        plan = api.launch_plan()
        start = state.global_step + 1
        inner = _inner(optimizer)
        if plan is None:
            api.start_at(start)
            return
        reset = bool(plan.reset_optimizer and self._resume_dir and inner is not None)
        if reset and inner is not None:
            inner.state.clear()  # after the Trainer loaded optimizer.pt: the plan's reset wins
        api.resumed(start, optimizer=inner, checkpoint=self._resume_dir, optimizer_reset=reset)

    def on_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        inner = _inner(optimizer)
        if inner is not None and inner.param_groups:
            self._lr = float(inner.param_groups[0]["lr"])  # the schedule's (scale hooks undone)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        sg = self._sg()
        loss = None
        if self._loss_sum is not None and self._loss_n:
            loss = float(self._loss_sum) / self._loss_n
        self._loss_sum, self._loss_n = None, 0
        self._pending = {
            "step": state.global_step,
            "loss": loss,
            "lr": self._lr,
            "total_steps": state.max_steps or None,
        }
        if not control.should_log:
            self._flush()
        if sg.should_checkpoint(state.global_step, collective=True):
            control.should_save = True
        if control.should_save and state.is_world_process_zero:
            # a directory of this step from an abandoned generation: uncommitted while the
            # Trainer writes into it again (committed anew in on_save)
            directory = os.path.join(
                str(args.output_dir), f"{_commit.TRAINER_PREFIX}{state.global_step}"
            )
            if os.path.isdir(directory):
                trainer_commit.retract(directory)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._flush(grad_norm=(logs or {}).get("grad_norm"))

    def _flush(self, grad_norm: Any = None) -> None:
        """Send the finished step's report (once; the probes' sample is collected here)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._sg().step(
            step=pending["step"],
            loss=pending["loss"],
            grad_norm=grad_norm,
            lr=pending["lr"],
            total_steps=pending["total_steps"],
        )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush()
        sg = self._sg()
        api = sg.framework
        step = state.global_step
        directory = os.path.join(str(args.output_dir), f"{_commit.TRAINER_PREFIX}{step}")
        ranks = api.gather(api.grade_meta())  # also waits for every rank's part of the save
        if not state.is_world_process_zero:
            return
        try:
            info = trainer_commit.commit_trainer_dir(
                directory,
                step=step,
                generation=sg.generation,
                world_size=sg.world_size,
                ranks=ranks,
                meta=api.checkpoint_meta(),
                fence=api.check_fence,
            )
        except (CheckpointError, StaleGenerationError, OSError) as e:
            log.warning(f"{directory} not committed: {e}")
            return
        api.report_checkpoint(info)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.session is not None:
            self.session.close()
            self.session = None
