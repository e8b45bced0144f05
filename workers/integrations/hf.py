"""spikeguard inside a Hugging Face ``transformers.Trainer`` (extra ``spikeguard[hf]``).

Two lines in a Trainer script::

    from spikeguard.workers.integrations.hf import SpikeguardCallback

    sg = SpikeguardCallback()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[sg])
    trainer.train(resume_from_checkpoint=sg.resume_from_checkpoint())

What the callback does, on every rank:

* **Reports every step** (``on_step_end``): this rank's loss as the Trainer counts it for its own
  log (the sum of what ``training_step`` returned over the step's micro-batches: the model's loss
  after the Trainer's scaling for ``average_tokens_across_devices``, gradient accumulation and
  ``num_items_in_batch``, whatever those settings are), so the mean over the ranks, which the
  supervisor shows, is the ``loss`` the Trainer logs at ``logging_steps=1``; the learning rate the
  optimizer stepped with (times the plan's LR scale), and the gradient norm on the Trainer's
  logging steps (from its logs: the Trainer computes it but hands it to no callback otherwise).
  A non-finite loss is reported as it is (the Trainer's log replaces it with the running mean,
  ``logging_nan_inf_filter``). The probes sample every ``sample_every`` steps (the Hugging Face
  attention capture included: true entropies on RoPE / QK-norm models). Steps are the Trainer's
  ``global_step`` (the first is 1).
* **The Trainer logs the applied LR**: its ``learning_rate`` (read from the scheduler, which never
  sees the plan's scale) is multiplied by the multiplier the step used, so the Trainer's own logs
  (the console, ``log_history``, every ``report_to`` integration) show an LR cut. The callback
  finds its Trainer when the Trainer is created (``on_init_end``, called from its
  ``__init__``) and wraps that instance's ``training_step`` and ``_get_learning_rate``.
* **The job's ``checkpoint_every``** (``SPIKEGUARD_CKPT_EVERY``), when the job sets it, becomes
  the Trainer's ``save_steps`` (``save_strategy="steps"``), with a warning when the script had
  another interval: checkpoints are the Trainer's, so its interval is the one to set.
* **Grades the Trainer's own checkpoints**: after the Trainer saved ``checkpoint-N`` (``on_save``),
  the ranks gather their grades and rank 0 commits the directory with spikeguard's commit marker
  (:mod:`spikeguard.workers.checkpoint.trainer_commit`: every file's sha256, the worst rank's
  grade), unless its generation was fenced. The supervisor lists and verifies these directories
  like any checkpoint; one without a marker, or whose files no longer match it, is never chosen.
  Under the supervisor the Trainer's ``output_dir`` is pointed at the run's checkpoint directory.
* **A remote checkpoint directory** (``SPIKEGUARD_CKPT_DIR=s3://bucket/prefix``, or an
  ``output_dir`` that is a URL): the Trainer cannot write there, so its ``output_dir`` becomes a
  local staging directory (:func:`~spikeguard.workers.checkpoint.mirror.staging_dir`: under
  ``SPIKEGUARD_STAGE_DIR``, else ``stage_dir=``, else ``$TMPDIR/spikeguard-stage``; one per
  run and generation, shared by the ranks of a node). Each ``checkpoint-N`` is committed there as
  above, then rank 0 publishes it to ``PREFIX/checkpoint-N`` (every file, then the marker last:
  :func:`~spikeguard.workers.checkpoint.mirror.publish_tree`) and reports the remote path, so the
  supervisor's listing, retention and rollback see the store; the staged copy is removed then
  (``keep_staged`` keeps the newest ones). A rollback pulls the plan's checkpoint into staging,
  verified against its checksum (:func:`~spikeguard.workers.checkpoint.mirror.pull_tree`; a copy
  an earlier generation kept on the node is reused), and the Trainer resumes from that local
  copy. A final ``trainer.save_model()`` without a directory goes to the staging directory.
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

import enum
import functools
import inspect
import os
import tempfile
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..checkpoint import commit as _commit
from ..checkpoint import mirror, trainer_commit
from ..checkpoint.format import CheckpointError
from ..checkpoint.storage import scheme_of
from ..contract.env import ENV_CKPT_DIR, ENV_CKPT_EVERY, ENV_STAGE_DIR
from ..contract.logs import logger
from ..session import Session, StaleGenerationError, attach

__all__ = ["SpikeguardCallback"]

log = logger(__name__)


_TRAINER_GET_LR = "_get_learning_rate"
"""The Trainer's method that reads the LR it logs (``lr_scheduler.get_last_lr()``, or the param
groups for ``ReduceLROnPlateau``), in transformers 4.x and 5.x: transformers' own internals,
which the callback wraps on its Trainer instance (it has no public hook for the logged LR)."""


def _inner(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under accelerate's wrapper (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _calling_trainer(callback: TrainerCallback) -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` is calling ``callback.on_init_end``:
    the frame up the stack whose ``self`` is a Trainer holding ``callback`` (the Trainer hands
    callbacks its model, optimizer and scheduler, never itself). None when there is none."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(32):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if isinstance(candidate, Trainer) and any(
                cb is callback for cb in getattr(handler, "callbacks", ())
            ):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


_WRAPPED_BY = "spikeguard_callback"
"""The attribute of spikeguard's ``training_step`` wrapper naming the callback that wrapped it
(a Trainer is wrapped once, whoever announces it)."""


def _save_every(args: TrainingArguments, every: int | None) -> None:
    """The job's ``checkpoint_every`` as the Trainer's save interval (the Trainer writes the
    checkpoints, at ``save_steps`` when ``save_strategy`` is ``"steps"``); a warning when that
    replaces the script's own. Nothing when the job sets none."""
    if every is None:
        return
    strategy = args.save_strategy
    name = getattr(strategy, "value", strategy)
    if name == "steps" and args.save_steps == every:
        return
    if getattr(args, "load_best_model_at_end", False):
        # the Trainer checked save against eval when the arguments were made; a changed
        # interval would break its best-model tracking without a word
        evaluation = getattr(args, "eval_strategy", None)
        eval_name = getattr(evaluation, "value", evaluation)
        eval_steps = getattr(args, "eval_steps", None) or getattr(args, "logging_steps", None)
        if eval_name != "steps" or not eval_steps or every % int(eval_steps) != 0:
            raise ValueError(
                f"SpikeguardCallback: the job's checkpoint_every={every} ({ENV_CKPT_EVERY}) "
                "would replace the Trainer's save interval, but load_best_model_at_end=True "
                f"needs saves aligned with evaluation (eval_strategy={eval_name!r}, "
                f"eval_steps={eval_steps}): make checkpoint_every a multiple of eval_steps "
                "with eval_strategy='steps', or remove checkpoint_every from the job"
            )
    was = f"save_steps={args.save_steps}" if name == "steps" else f"save_strategy={name!r}"
    log.warning(
        f"the job's checkpoint_every={every} ({ENV_CKPT_EVERY}) replaces the Trainer's {was}: "
        f"save_strategy='steps', save_steps={every}"
    )
    args.save_strategy = type(strategy)("steps") if isinstance(strategy, enum.Enum) else "steps"
    args.save_steps = every


class SpikeguardCallback(TrainerCallback):
    """Connects a ``transformers.Trainer`` to spikeguard; see the module docstring.

    Args:
        sample_every: probe every N steps (``SPIKEGUARD_SAMPLE_EVERY`` overrides).
        report: where reports go without a supervisor (``"jsonl:///path"``; default off).
        probe_patterns: keyword arguments of :class:`~spikeguard.workers.probes.Probes`.
        stage_dir: where the Trainer's checkpoints are staged on each node while the checkpoint
            directory is remote (``SPIKEGUARD_STAGE_DIR`` overrides; default
            ``$TMPDIR/spikeguard-stage``).
        keep_staged: how many of the newest published checkpoints stay in the staging directory
            (0: each is removed once it is on the store); a rollback to one kept on the node
            skips its download.
        session_kwargs: more keyword arguments of :func:`~spikeguard.workers.attach`.
    """

    def __init__(
        self,
        *,
        sample_every: int = 200,
        report: str | None = None,
        probe_patterns: dict[str, Any] | None = None,
        stage_dir: str | None = None,
        keep_staged: int = 0,
        **session_kwargs: Any,
    ) -> None:
        if keep_staged < 0:
            raise ValueError(f"keep_staged must be >= 0, got {keep_staged}")
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
        """What ``training_step`` returned in this step so far, added up (None: nothing yet)."""
        self._lr: float | None = None
        self._pending: dict[str, Any] | None = None
        self._evaluate_next = False
        """The Trainer evaluates after the step being finished: pause once it is reported."""
        self._paused = False
        """Sampling and the forward timing are paused for the Trainer's evaluation."""
        self._stage_root = stage_dir
        self.keep_staged = keep_staged
        """How many of the newest published checkpoints stay staged (see the class docstring)."""
        self.remote: str | None = None
        """The remote checkpoint directory (a URL) the Trainer's checkpoints are published to;
        None: the Trainer writes into the checkpoint directory itself."""
        self.stage: str | None = None
        """The local staging directory the Trainer writes into while :attr:`remote` is set."""
        self._pruned = False

    # -- the user's one call -----------------------------------------------------------------
    def resume_from_checkpoint(self) -> str | None:
        """The ``checkpoint-N`` directory the supervisor's plan rolls back to, verified against
        the plan's checksum, or None (a fresh start). Pass it to ``trainer.train``. Create the
        Trainer (with this callback) first. A checkpoint on a remote store is pulled into the
        staging directory first, verified as it streams, and that local copy is returned.
        Raises :class:`~spikeguard.workers.checkpoint.CheckpointError` when the directory does
        not match the plan (the rank exits; the supervisor falls back to an older
        checkpoint)."""
        plan = self._sg().framework.launch_plan()
        self._resume_dir = None
        if plan is None or not plan.checkpoint:
            self._prune_generations()
            return None
        name = os.path.basename(os.path.normpath(plan.checkpoint))
        if _commit.parse_trainer_name(name) is None:
            raise CheckpointError(
                f"the plan's checkpoint {plan.checkpoint} is not a Trainer checkpoint directory"
            )
        if scheme_of(plan.checkpoint):
            stage = self.stage or self._staging_for(os.path.dirname(plan.checkpoint.rstrip("/")))
            local = mirror.pull_tree(
                plan.checkpoint,
                os.path.join(stage, name),
                plan.sha256,
                reuse=mirror.earlier_copies(stage, name),
            )
        else:
            trainer_commit.verify_for_resume(plan.checkpoint, plan.sha256)
            local = plan.checkpoint
        self._prune_generations()
        self._resume_dir = plan.checkpoint
        return local

    def _staging_for(self, remote: str) -> str:
        """This rank's staging directory for the remote checkpoint directory ``remote``."""
        sg = self._sg()
        root = os.environ.get(ENV_STAGE_DIR) or self._stage_root
        if not root:
            root = os.path.join(tempfile.gettempdir(), mirror.STAGE_SUBDIR)
        return mirror.staging_dir(root, remote, run_id=sg.run_id, generation=sg.generation)

    def _prune_generations(self) -> None:
        """Once this generation runs (a standby was released), remove what the generations
        before it staged on this node."""
        if self.stage is not None and not self._pruned:
            self._pruned = True
            for path in mirror.prune_generations(self.stage):
                log.info(f"removed {path}: staged by a generation that was replaced")

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
        if model is None:
            return
        if self.session is not None:  # a second Trainer given the same callback (a notebook)
            if self.stage is not None:
                args.output_dir = self.stage
            _save_every(args, self.session.config.checkpoint_every)
            self._wrap_caller()
            return
        ckpt_dir = os.environ.get(ENV_CKPT_DIR)
        remote = ckpt_dir or str(args.output_dir or "")
        if scheme_of(remote):
            # the Trainer writes with os: into staging, from where spikeguard publishes
            self.session = attach(model, ckpt_dir=remote, **self._attach_kwargs)
            self.remote = remote.rstrip("/")
            self.stage = self._staging_for(self.remote)
            os.makedirs(self.stage, exist_ok=True)
            args.output_dir = self.stage
        else:
            if ckpt_dir and os.path.abspath(args.output_dir or "") != os.path.abspath(ckpt_dir):
                # the supervisor scans the run's checkpoint directory for checkpoint-N
                args.output_dir = ckpt_dir
            self.session = attach(model, ckpt_dir=args.output_dir, **self._attach_kwargs)
        _save_every(args, self.session.config.checkpoint_every)
        self._wrap_caller()

    def _wrap_caller(self) -> None:
        """Wrap the Trainer creating this callback, once per Trainer."""
        trainer = _calling_trainer(self)
        if trainer is None:
            log.warning(
                "SpikeguardCallback: no transformers.Trainer is creating this callback: the "
                "loss is not reported and the Trainer's logged LR is the schedule's"
            )
            return
        if getattr(trainer.training_step, _WRAPPED_BY, None) is self:
            return  # the same Trainer announced twice
        self._wrap(trainer)

    def _wrap(self, trainer: Any) -> None:
        """Wrap ``trainer``'s ``training_step`` (its return value, the loss the Trainer adds up
        for its log, is this rank's report) and ``_get_learning_rate`` (what the Trainer logs as
        ``learning_rate``: times the multiplier the step used). Instance attributes: the class,
        and every other Trainer, are untouched."""
        training_step = trainer.training_step

        @functools.wraps(training_step)
        def counted_training_step(*args: Any, **kwargs: Any) -> Any:
            loss = training_step(*args, **kwargs)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                d = loss.detach().float()  # one tensor op; no device sync
                self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
            return loss

        setattr(counted_training_step, _WRAPPED_BY, self)
        trainer.training_step = counted_training_step
        get_lr = getattr(trainer, _TRAINER_GET_LR, None)
        if get_lr is None:
            log.warning(
                f"SpikeguardCallback: this transformers Trainer has no {_TRAINER_GET_LR}: "
                "its logged learning_rate is the schedule's, without the plan's LR scale"
            )
            return

        @functools.wraps(get_lr)
        def applied_learning_rate(*args: Any, **kwargs: Any) -> Any:
            lr = get_lr(*args, **kwargs)
            if self.session is None or not isinstance(lr, (int, float)):
                return lr
            return lr * self.session.framework.lr_multiplier()

        setattr(trainer, _TRAINER_GET_LR, applied_learning_rate)

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
        self._prune_generations()
        start = state.global_step + 1
        inner = _inner(optimizer)
        if plan is None:
            api.start_at(start)
        else:
            reset = bool(plan.reset_optimizer and self._resume_dir and inner is not None)
            if reset and inner is not None:
                inner.state.clear()  # after the Trainer loaded optimizer.pt: the plan's reset wins
            api.resumed(start, optimizer=inner, checkpoint=self._resume_dir, optimizer_reset=reset)
        if getattr(args, "eval_on_start", False):
            self._pause()  # the Trainer evaluates before its first step (after start_at arms)

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
        loss = None if self._loss_sum is None else float(self._loss_sum)
        self._loss_sum = None
        self._pending = {
            "step": state.global_step,
            "loss": loss,
            "lr": self._lr,
            "total_steps": state.max_steps or None,
        }
        # the Trainer evaluates right after this step's log: pause once the step is reported
        self._evaluate_next = bool(control.should_evaluate)
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
        if self._evaluate_next:  # after the step's report: it arms the probes for the next one
            self._pause()

    # -- no samples, no step time, from the Trainer's evaluation -------------------------------
    def _pause(self) -> None:
        """The evaluation's forwards are no training step: not a sample, not compute time."""
        self._evaluate_next = False
        if not self._paused:
            self._paused = True
            self._sg().pause_sampling()

    def _resume(self) -> None:
        """Sample and time again: at the next training step (not at ``on_evaluate``, which a
        dict of eval datasets calls once per dataset, the next one still to come)."""
        if self._paused:
            self._paused = False
            self._sg().resume_sampling()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """``eval_strategy="epoch"`` decides at the epoch's end, after :meth:`on_step_end`: the
        epoch's last step is reported now, then the evaluation is paused."""
        if control.should_evaluate:
            self._evaluate_next = True
            if self._pending is None:
                self._pause()
            elif not control.should_log:
                self._flush()  # pauses after the report

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
            if self.stage is not None:  # rank 0 may be committing this step's directory still
                mirror.prune_staging(self.stage, busy=step, keep=self.keep_staged)
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
            if self.remote is not None:
                directory = os.path.join(self.remote, os.path.basename(directory))
                info = mirror.publish_tree(info.path, directory, fence=api.check_fence)
        except (CheckpointError, StaleGenerationError, OSError) as e:
            log.warning(f"{directory} not committed: {e}")
            return
        finally:
            if self.stage is not None:
                mirror.prune_staging(self.stage, busy=None, keep=self.keep_staged)
        api.report_checkpoint(info)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush()
        self._evaluate_next = False
        self._resume()  # a training step: whatever evaluation ran before it is over

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush()
        if self.session is not None:
            self.session.close()
            self.session = None
