"""The rank-side API: ``attach()``, ``step()``, ``save_checkpoint()``, ``resume()``.

A training script adopts spikeguard in a few lines::

    sg = spikeguard.workers.attach(model, report="jsonl:///tmp/run.jsonl")
    start = sg.resume(model, optimizer)          # what the supervisor decided
    for step in range(start, total):
        if sg.should_skip(step):
            continue
        ...forward/backward/optimizer.step()...
        sg.step(step=step, loss=loss.item(), grad_norm=gn, lr=lr, batch_ids=ids)
        if sg.should_checkpoint(step, every=100) and rank == 0:
            sg.save_checkpoint({"model": model.state_dict(),
                                "optimizer": optimizer.state_dict()}, step=step)
    sg.close()

A sharded job (FSDP2, tensor parallel) saves on every rank instead, with
``torch.distributed.checkpoint`` (see :meth:`Session.save_checkpoint`)::

        if sg.should_checkpoint(step, every=100, collective=True):
            msd, osd = get_state_dict(model, optimizer)
            sg.save_checkpoint({"model": msd, "optimizer": osd}, step=step, sharded=True)

Under the supervisor everything is configured by environment variables
(:mod:`spikeguard.workers.contract`); without one the same script runs and
reports to a local JSONL file or nowhere.

Probes are armed for the *next* step when that step is a sampled one, so
the forward hooks do their work during that step's forward pass and
``step()`` collects the result; on other steps the hooks return at once.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import batches, contract
from . import checkpoint as ckpt
from .channel import open_channel
from .contract.signals import summarize
from .probes import Probes
from .standby import wait_for_release


class StaleGenerationError(RuntimeError):
    """This rank belongs to a generation the supervisor has already replaced."""


def _num(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.detach()
        x = x.item() if x.numel() == 1 else float("nan")
    return float(x)


class Session:
    """One rank's connection to spikeguard. Create it with :func:`attach`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        report: str | None,
        sample_every: int,
        ckpt_dir: str | None,
        run_id: str | None,
        probe_patterns: dict[str, Iterable[str]] | None,
        batch_ids_window: int,
        queue_size: int,
    ) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.generation = contract.env_int(contract.ENV_GENERATION, 0)
        self.run_id = os.environ.get(contract.ENV_RUN_ID) or run_id or "local"
        self.sample_every = contract.env_int(contract.ENV_SAMPLE_EVERY, sample_every)
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        self.ckpt_dir = os.environ.get(contract.ENV_CKPT_DIR) or ckpt_dir
        self._fence_file = os.environ.get(contract.ENV_FENCE_FILE)
        spec = os.environ.get(contract.ENV_REPORT) or report
        self.channel = open_channel(spec, maxsize=queue_size)
        agent = os.environ.get(contract.ENV_STANDBY, "")
        self._standby = agent.isdigit()
        """A standby process: waits for its release before anything that needs the plan."""
        self._parent = int(agent) if self._standby else os.getppid()
        self._standby_wait_s: float | None = None
        self.plan = None if self._standby else contract.ResumePlan.from_env()
        self.lr_scale = 1.0
        self.probes = Probes(model, **(probe_patterns or {}))
        self._qk_capture = _install_qk_capture(model)
        """Whether the Hugging Face attention capture was installed for this model."""
        self.batch_ids: collections.deque[tuple[int, Any]] = collections.deque(
            maxlen=batch_ids_window
        )
        self._step = 0
        self._last_loss: float | None = None
        self._last_sample: dict[str, Any] | None = None
        self._hook_handles: list[Any] = []
        self._scaled: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        """Optimizers whose steps carry the LR scale's hooks."""
        self._checkpoint_requests: list[int] = []
        """Ids of the supervisor's checkpoint requests not yet seen by should_checkpoint."""
        self._answering: list[int] = []
        """Ids should_checkpoint said yes to: the next save_checkpoint answers them."""
        self._seen_requests: set[tuple[str, int]] = set()
        """(type, id) of every request taken (ids are numbered per request type)."""
        self._batch_requests: list[int] = []
        """Ids of ``batch_ids`` requests not answered yet (answered at the end of a step)."""
        self._skip_keys: set[str] | None = None
        """The batches the plan skips by id (loaded on first use); None: not loaded yet."""
        self._skip_by_steps = False
        """The plan's batch-ids file could not be read: its step window is skipped instead."""
        self._agreed_request = 0
        """The newest checkpoint request id the ranks agreed to answer
        (``should_checkpoint(collective=True)``: the same on every rank, as it only ever comes
        from a collective)."""
        self._sharded: ckpt.ShardedWriter | None = None
        self._send_lock = threading.Lock()
        self._send(
            "hello",
            world_size=self.world_size,
            pid=os.getpid(),
            host=socket.gethostname(),
            sample_every=self.sample_every,
        )
        self._arm(0)

    # -- messages -----------------------------------------------------------------------
    def _send(self, type_: str, step: int | None = None, **fields: Any) -> bool:
        msg = {
            "v": contract.FORMAT_VERSION,
            "type": type_,
            "run": self.run_id,
            "gen": self.generation,
            "rank": self.rank,
            "step": self._step if step is None else step,
            "t": time.time(),
        }
        msg.update(fields)
        with self._send_lock:  # an asynchronous save's commit reports from its own thread
            refused = getattr(self.channel, "dropped_unencodable", 0)
            if self.channel.send(msg):
                return True
            if "extra" in msg and getattr(self.channel, "dropped_unencodable", 0) > refused:
                # the user's extra metrics could not be encoded: keep the heartbeat (a rank whose
                # every step is refused would look hung), say what was left out
                del msg["extra"]
                msg["extra_dropped"] = str(getattr(self.channel, "last_unencodable", "unencodable"))
                return self.channel.send(msg)
            return False

    def _arm(self, step: int) -> None:
        if step % self.sample_every == 0:
            self.probes.arm(step)
        else:
            self.probes.disarm()

    # -- per step ------------------------------------------------------------------------
    def step(
        self,
        *,
        step: int | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        lr: float | None = None,
        batch_ids: Any = None,
        extra: dict[str, Any] | None = None,
        tokens: int | None = None,
        total_steps: int | None = None,
    ) -> None:
        """Record one finished training step: a heartbeat, and a full report on sampled steps.

        Never blocks on I/O. ``loss``/``grad_norm`` may be floats or scalar tensors
        (a tensor costs a device sync; pass floats if you already have them).
        ``batch_ids``: what identifies this step's batch (sample indices, a shard and offset...):
        kept in a ring buffer, sent only when the supervisor asks at an incident.
        ``extra``: more JSON-able metrics, sent in the message under ``extra``.
        ``tokens``: the tokens this rank processed in this step (the live view's tokens/s).
        ``total_steps``: how many steps the script trains (the live view's ETA).
        """
        self._await_release()
        self._take_requests()
        s = self._step if step is None else int(step)
        loss_f, gn_f = _num(loss), _num(grad_norm)
        eff_lr = None if lr is None else float(lr) * self.lr_scale
        self._last_loss = loss_f
        if batch_ids is not None:
            self.batch_ids.append((s, batch_ids))
        fields: dict[str, Any] = {"loss": loss_f, "lr": eff_lr, "grad_norm": gn_f}
        if tokens is not None:
            fields["tokens"] = int(tokens)
        if total_steps is not None:
            fields["total_steps"] = int(total_steps)
        if extra is not None:
            fields["extra"] = extra
        if self.probes.armed_step == s:
            layers = (
                self.probes.collect()
            )  # the _arm() below disarms (or re-arms for the next step)
            summary = summarize(layers)
            self._last_sample = {"step": s, "layers": layers, "summary": summary, "loss": loss_f}
            self._send(
                "report", step=s, layers=layers, summary=summary, lr_scale=self.lr_scale, **fields
            )
        else:
            self._send("heartbeat", step=s, **fields)
        self._step = s + 1
        self._arm(self._step)
        self._answer_batch_requests()

    def pause_sampling(self) -> None:
        """Stop the probes until :meth:`resume_sampling`: a framework's validation (or sanity
        check) runs forward passes between training steps, which must not count as the next
        step's sample."""
        self.probes.disarm()

    def resume_sampling(self) -> None:
        """Arm the probes again for the next step, if it is a sampled one."""
        self._arm(self._step)

    def _await_release(self) -> None:
        """In a standby process, wait here until the supervisor releases it (see
        :mod:`spikeguard.workers.standby`); elsewhere a flag check."""
        if not self._standby:
            return
        released = wait_for_release(
            self.channel,
            generation=self.generation,
            rank=self.rank,
            fence_file=self._fence_file,
            parent_pid=self._parent,
        )
        self._standby = False
        self.plan = released.plan
        self._standby_wait_s = released.waited_s

    def _take_requests(self) -> None:
        """Move the supervisor's new requests off the channel (a queue check; never blocks)."""
        for req in self.channel.poll_requests():
            rid, kind = req.get("id"), req.get("type")
            if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(kind, str):
                continue
            if (kind, rid) in self._seen_requests:
                continue
            if kind == "checkpoint" and rid <= self._agreed_request:
                continue  # answered already: another rank saw it first
            self._seen_requests.add((kind, rid))
            if kind == "checkpoint":
                self._checkpoint_requests.append(rid)
            elif kind == "batch_ids":
                self._batch_requests.append(rid)

    def _answer_batch_requests(self) -> None:
        """Send the ring buffer of batch ids for each pending ``batch_ids`` request (an incident:
        the supervisor stores it for forensics and for skipping those batches)."""
        self._take_requests()
        if not self._batch_requests:
            return
        entries, truncated = batches.answer_entries(self.batch_ids)
        for rid in self._batch_requests:
            self._send(
                "batch_ids",
                step=self._step - 1,
                request=rid,
                window=self.batch_ids.maxlen,
                entries=entries,
                truncated=truncated,
            )
        self._batch_requests = []

    def should_checkpoint(
        self, step: int | None = None, *, every: int | None = None, collective: bool = False
    ) -> bool:
        """True when a checkpoint is due at ``step``: every ``every`` steps (from step ``every``
        on), or because the supervisor asked for one (a policy ``checkpoint`` rule, or an
        emergency checkpoint before a preemption). Call it at the end of every step, on every
        rank; save when it says so::

            if sg.should_checkpoint(step, every=500) and rank == 0:
                sg.save_checkpoint(state, step=step)

        The next :meth:`save_checkpoint` answers the pending requests. Never blocks, unless
        ``collective``.

        ``collective=True`` (for sharded saves, where every rank must save at the same step):
        the ranks agree on the supervisor's requests, so every rank gets the same answer at the
        same step even though a request reaches the ranks at different times. It costs one
        all-reduce of one integer per call on spikeguard's own gloo group (a few tens of
        microseconds on one host), and every rank must call it at every step.
        """
        self._await_release()
        self._answer_batch_requests()  # takes the new requests too
        if collective:
            return self._should_checkpoint_collective(step, every)
        if self._checkpoint_requests:
            self._answering += self._checkpoint_requests
            self._checkpoint_requests = []
            return True
        s = self._step - 1 if step is None else int(step)
        return bool(every) and s > 0 and s % int(every) == 0

    def _should_checkpoint_collective(self, step: int | None, every: int | None) -> bool:
        """The ranks agree on the newest request any of them has seen; answer every request up
        to it (ids are the supervisor's request numbers: they only grow)."""
        newest = max(self._checkpoint_requests, default=0)
        agreed = self._sharded_writer().agree_max(newest)
        if agreed > self._agreed_request:
            self._answering += [r for r in self._checkpoint_requests if r <= agreed]
            if agreed not in self._answering:
                self._answering.append(agreed)  # another rank saw it first
            self._checkpoint_requests = [r for r in self._checkpoint_requests if r > agreed]
            self._agreed_request = agreed
            return True
        s = self._step - 1 if step is None else int(step)
        return bool(every) and s > 0 and s % int(every) == 0

    def should_skip(self, step: int, batch_ids: Any = None) -> bool:
        """True when the supervisor asked to skip this batch (an incident's data).

        By step (``recovery.skip_by: steps``): the steps of the plan's ``skip_ranges``. By batch
        (``skip_by: batch_ids``): a batch whose ``batch_ids`` equal those a rank recorded for a
        step of the incident's window, wherever it comes up again (pass the ids you will pass
        to :meth:`step`); without ``batch_ids``, or when the supervisor's batch-ids file cannot
        be read, the window's steps are skipped instead.
        """
        self._await_release()
        plan = self.plan
        if plan is None:
            return False
        by = "steps" if any(a <= step <= b for a, b in plan.skip_ranges) else None
        window = plan.skip_batches_steps
        if by is None and window is not None:
            keys = None if batch_ids is None else self._skip_set(plan.skip_batches, window)
            if keys is None:
                by = "steps" if window[0] <= step <= window[1] else None
            elif batches.batch_key(batch_ids) in keys:
                by = "batch_ids"
        if by is None:
            return False
        self._send("skipped", step=step, by=by)
        self._step = step + 1
        self._arm(self._step)
        return True

    def _skip_set(self, path: str | None, window: tuple[int, int]) -> set[str] | None:
        """The batches the plan skips by id, loaded once; None when they cannot be known."""
        if self._skip_keys is None and not self._skip_by_steps:
            try:
                if path is None:
                    raise ValueError("the plan names no batch-ids file")
                self._skip_keys = batches.load_skip_set(path, window)
            except ValueError as e:
                self._skip_by_steps = True
                print(f"spikeguard: {e}; skipping steps {window[0]}..{window[1]} instead")
        return self._skip_keys

    def recent_batch_ids(self) -> list[tuple[int, Any]]:
        """The last ~200 steps' ``batch_ids`` (oldest first), for incident forensics."""
        return list(self.batch_ids)

    # -- checkpoints ---------------------------------------------------------------------
    def _check_fence(self) -> None:
        if not self._fence_file:
            return
        try:
            with open(self._fence_file, encoding="utf-8") as f:
                current = int(f.read().strip() or 0)
        except FileNotFoundError:
            return
        if current > self.generation:
            raise StaleGenerationError(
                f"rank {self.rank} of generation {self.generation} was fenced "
                f"(current generation {current}); checkpoint refused"
            )

    def _sharded_writer(self) -> ckpt.ShardedWriter:
        if self._sharded is None:
            self._sharded = ckpt.ShardedWriter()
        return self._sharded

    def _grade_meta(self) -> dict[str, Any]:
        """This rank's grade, loss and signals of its latest sample, for a checkpoint."""
        sample = self._last_sample or {}
        summary = sample.get("summary", {})
        grade = summary.get("grade")
        return {
            "loss": self._last_loss,
            "grade": None if grade is None else int(grade),
            "signals_step": sample.get("step"),
            "summary": summary,
        }

    def save_checkpoint(
        self,
        state: dict[str, Any],
        *,
        step: int,
        sharded: bool = False,
        async_save: bool = False,
        **meta: Any,
    ) -> ckpt.CheckpointInfo | ckpt.PendingSave:
        """Atomically write ``state`` with the grade metadata of the latest sample.

        The metadata records the per-layer grades/signals of the most recent
        sampled step (``signals_step``), the loss, the LR scale and the
        generation. Refused with :class:`StaleGenerationError` if fenced.

        **Replicated** (the default): one rank (rank 0) writes ``state`` with ``torch.save``;
        returns its :class:`~.checkpoint.CheckpointInfo`.

        **Sharded** (``sharded=True``): every rank calls it at the same step with its own part
        of the state (``{"model": msd, "optimizer": osd}`` from
        ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` for FSDP2;
        ``resume`` loads the keys ``model``, ``optimizer`` and ``scheduler``), and one
        ``torch.distributed.checkpoint`` directory is written, each rank its shard. Each rank
        contributes its own grade and loss; the checkpoint's grade is the worst rank's. The
        checkpoint exists for the supervisor once rank 0 has written its commit marker, last,
        with the sha256 of every file (see :mod:`.checkpoint.dcp_write`). Use
        ``should_checkpoint(step, every=N, collective=True)`` to decide, so that a request of
        the supervisor is answered by every rank at the same step. Returns the committed
        :class:`~.checkpoint.CheckpointInfo` on every rank.

        ``async_save=True`` (sharded only): ``torch.distributed.checkpoint.async_save`` copies
        the state to CPU memory and returns; the write and the commit go on in a background
        thread over spikeguard's own gloo group (created at the first sharded call, so the
        background collectives never interleave with the training's), and a
        :class:`~.checkpoint.PendingSave` is returned. Only one save is in flight: the next
        ``save_checkpoint``, :meth:`wait_checkpoint` and :meth:`close` wait for it and raise its
        error. The supervisor hears of the checkpoint when it is committed.
        """
        self._await_release()
        if not self.ckpt_dir:
            raise ValueError(
                "no checkpoint directory: pass ckpt_dir= to attach() or set SPIKEGUARD_CKPT_DIR"
            )
        if async_save and not sharded:
            raise ValueError("async_save needs sharded=True (a replicated save is synchronous)")
        if sharded:
            return self._save_sharded(state, step=step, async_save=async_save, meta=meta)
        self._check_fence()
        os.makedirs(self.ckpt_dir, exist_ok=True)
        graded = self._grade_meta()
        full_meta = {
            **graded,
            "layers": (self._last_sample or {}).get("layers", {}),
            "lr_scale": self.lr_scale,
            "run": self.run_id,
            **meta,
        }
        info = ckpt.write_checkpoint(
            self.ckpt_dir,
            state,
            step=step,
            generation=self.generation,
            rank=self.rank,
            meta=full_meta,
            fence=self._check_fence,
        )
        self._take_requests()  # a save after a request answers it, whatever prompted the save
        answered = self._answering + self._checkpoint_requests
        self._answering, self._checkpoint_requests = [], []
        self._send(
            "checkpoint",
            step=step,
            path=info.path,
            sha256=info.sha256,
            grade=full_meta["grade"],
            loss=self._last_loss,
            requests=answered,
        )
        return info

    def _save_sharded(
        self, state: dict[str, Any], *, step: int, async_save: bool, meta: dict[str, Any]
    ) -> ckpt.CheckpointInfo | ckpt.PendingSave:
        """Every rank's part of a sharded save; rank 0 reports it once it is committed."""
        assert self.ckpt_dir is not None
        answered = self._answering + self._checkpoint_requests
        self._answering, self._checkpoint_requests = [], []

        def report(info: ckpt.CheckpointInfo) -> None:
            self._send_checkpoint(info, answered)

        return self._sharded_writer().save(
            self.ckpt_dir,
            state,
            step=step,
            generation=self.generation,
            rank_meta=self._grade_meta(),
            meta={"lr_scale": self.lr_scale, "run": self.run_id, **meta},
            fence=self._check_fence,
            async_save=async_save,
            on_commit=report,
        )

    def wait_checkpoint(self) -> ckpt.CheckpointInfo | None:
        """Wait for the asynchronous sharded save in flight, if any: its checkpoint, or its
        error (:class:`~.checkpoint.CheckpointError`)."""
        if self._sharded is None:
            return None
        return self._sharded.wait()

    def resume(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> int:
        """Apply the supervisor's plan for this launch; returns the step to start from.

        Loads the chosen checkpoint (checksum verified, ``weights_only=True``),
        keeps or resets the optimizer state, loads the scheduler state if the
        checkpoint has one, and installs the LR scale as optimizer step hooks so
        that it survives any LR schedule (manual or ``torch.optim.lr_scheduler``).

        A sharded checkpoint (a ``.dcp`` directory) is loaded on every rank (call ``resume``
        on every rank) into the FSDP2 model and optimizer as they are now sharded, whatever the
        world size it was written with: its commit marker and every file are verified and its
        ``.metadata`` scanned before ``torch.distributed.checkpoint`` reads anything (see
        :mod:`.checkpoint.dcp_load`), then ``set_state_dict`` applies it.

        In a standby process (the job's ``standby: true``) this is where it waits for the
        supervisor's release, which brings the plan.
        """
        self._await_release()
        plan = self.plan
        if plan is None:
            return 0
        start = 0
        if plan.checkpoint and ckpt.is_sharded_path(plan.checkpoint):
            info = ckpt.load_sharded(
                plan.checkpoint,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                reset_optimizer=plan.reset_optimizer,
                expected_sha256=plan.sha256,
                writer=self._sharded_writer(),
            )
            start = info.step + 1
        elif plan.checkpoint:
            state = ckpt.load_checkpoint(plan.checkpoint, expected_sha256=plan.sha256)
            model.load_state_dict(state["model"])
            if optimizer is not None and not plan.reset_optimizer and "optimizer" in state:
                optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None and "scheduler" in state:
                scheduler.load_state_dict(state["scheduler"])
            start = (
                int(
                    state.get(
                        "step", plan.checkpoint_step if plan.checkpoint_step is not None else -1
                    )
                )
                + 1
            )
        self.resumed(
            start,
            optimizer=optimizer,
            checkpoint=plan.checkpoint,
            optimizer_reset=bool(plan.reset_optimizer and optimizer is not None),
        )
        return start

    # -- for framework integrations (spikeguard.workers.integrations) ------------------------
    def launch_plan(self) -> contract.ResumePlan | None:
        """The supervisor's plan for this launch (a standby process waits for its release
        here), or None without one. For integrations that resume through their framework."""
        self._await_release()
        return self.plan

    def start_at(self, step: int) -> None:
        """The next :meth:`step` will be ``step``: arm the probes for it if it is sampled."""
        self._step = int(step)
        self._arm(self._step)

    def resumed(
        self,
        start: int,
        *,
        optimizer: torch.optim.Optimizer | None,
        checkpoint: str | None,
        optimizer_reset: bool,
    ) -> None:
        """Say the plan was applied: install its LR scale on ``optimizer`` (step hooks, so that
        it survives any schedule), count steps from ``start``, send ``resumed``. :meth:`resume`
        ends with it; an integration whose framework loaded ``checkpoint`` (and reset the
        optimizer state, when ``optimizer_reset``) calls it itself."""
        plan = self.plan
        if plan is None:
            return
        if optimizer is not None:
            self._install_lr_scale(optimizer, plan.lr_scale)
        self.start_at(start)
        self._send(
            "resumed",
            step=start,
            from_step=start,
            checkpoint=checkpoint,
            lr_scale=self.lr_scale,
            optimizer_reset=optimizer_reset,
            skip_ranges=[list(r) for r in plan.skip_ranges],
            **({} if self._standby_wait_s is None else {"standby_wait_s": self._standby_wait_s}),
        )

    def resumed_by_framework(
        self, start: int, optimizers: Sequence[torch.optim.Optimizer], *, loaded: bool
    ) -> None:
        """Apply the rest of the plan after a training framework restored the plan's checkpoint
        itself (Lightning's ``trainer.fit(ckpt_path=...)``), model, optimizer and scheduler state.

        ``start`` is the first step the framework will train; ``loaded`` says whether it loaded
        the plan's checkpoint (a plan that names one which was not loaded raises
        :class:`~.checkpoint.CheckpointError`: training from scratch would pass for a rollback).
        When the plan resets the optimizer, the state the framework restored into each of
        ``optimizers`` is dropped (its hyper-parameters, and the scheduler's state, stay); the LR
        scale is installed as step hooks on each (see :meth:`scale_lr`). Then the supervisor is
        told, as :meth:`resume` tells it. Without a plan, only the step count is set.
        """
        self._await_release()
        plan = self.plan
        self.start_at(start)
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
        self.lr_scale = float(plan.lr_scale)
        for optimizer in optimizers:
            self.scale_lr(optimizer)
        self.resumed(
            start,
            optimizer=None,
            checkpoint=plan.checkpoint,
            optimizer_reset=bool(plan.reset_optimizer and optimizers),
        )

    def check_fence(self) -> None:
        """Raise :class:`StaleGenerationError` if this rank's generation was replaced."""
        self._check_fence()

    def grade_meta(self) -> dict[str, Any]:
        """This rank's grade, loss and signals of its latest sample (what a checkpoint records)."""
        return {"rank": self.rank, **self._grade_meta()}

    def checkpoint_meta(self) -> dict[str, Any]:
        """The run's fields of a checkpoint's metadata (LR scale, run id)."""
        return {"lr_scale": self.lr_scale, "run": self.run_id}

    def report_checkpoint(self, info: ckpt.CheckpointInfo) -> None:
        """Tell the supervisor about a checkpoint committed outside :meth:`save_checkpoint` (a
        framework's own, committed by an integration); it answers the pending requests."""
        self._take_requests()
        answered = self._answering + self._checkpoint_requests
        self._answering, self._checkpoint_requests = [], []
        self._send_checkpoint(info, answered)

    def _send_checkpoint(self, info: ckpt.CheckpointInfo, answered: list[int]) -> None:
        """The ``checkpoint`` message of a committed directory (sharded or a framework's)."""
        self._send(
            "checkpoint",
            step=info.step,
            path=info.path,
            sha256=info.sha256,
            grade=info.grade,
            loss=info.meta.get("loss"),
            requests=answered,
            kind=info.kind,
            world_size=info.world_size,
        )

    def agree_max(self, value: int) -> int:
        """The largest ``value`` any rank passes (a collective on spikeguard's own gloo group:
        every rank calls it at the same point)."""
        return self._sharded_writer().agree_max(value)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, by rank (a collective on spikeguard's own gloo group)."""
        writer = self._sharded_writer()
        return writer._all_gather(obj, writer._groups()[0])

    def _install_lr_scale(self, optimizer: torch.optim.Optimizer, scale: float) -> None:
        self.lr_scale = float(scale)
        self.scale_lr(optimizer)

    def scale_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the plan's LR scale to ``optimizer``'s steps: step pre/post hooks multiply each
        group's ``lr`` for the step and put the schedule's value back after it, so the scale
        survives any LR schedule. Once per optimizer (a second call does nothing); nothing at
        scale 1."""
        if self.lr_scale == 1.0 or optimizer in self._scaled:
            return
        self._scaled.add(optimizer)
        saved: list[Any] = []

        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            saved[:] = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * self.lr_scale

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for g, lr in zip(opt.param_groups, saved):
                g["lr"] = lr

        self._hook_handles += [
            optimizer.register_step_pre_hook(pre),
            optimizer.register_step_post_hook(post),
        ]

    def close(self, timeout: float = 5.0) -> None:
        """Wait for an asynchronous save in flight, say ``done``, flush the channel and remove
        hooks; then raise that save's error, if it failed."""
        failed: BaseException | None = None
        if self._sharded is not None:
            try:
                self._sharded.close()
            except Exception as e:
                failed = e
        self._send("done")
        self.probes.remove()
        if self._qk_capture:
            from .integrations import hf_attention

            hf_attention.uninstall()
            self._qk_capture = False
        for h in self._hook_handles:
            h.remove()
        self.channel.close(timeout)
        if failed is not None:
            raise failed


def _install_qk_capture(model: torch.nn.Module) -> bool:
    """For a Hugging Face model, capture the exact Q and K its attention kernel receives (after
    RoPE and QK-norm; see :mod:`.integrations.hf_attention`). False for any other model."""
    if "transformers" not in sys.modules:
        return False  # then it is no transformers model
    from .integrations import hf_attention

    if not hf_attention.is_hf_model(model):
        return False
    hf_attention.install()
    return True


def attach(
    model: torch.nn.Module,
    *,
    report: str | None = None,
    sample_every: int = 200,
    ckpt_dir: str | None = None,
    run_id: str | None = None,
    probe_patterns: dict[str, Iterable[str]] | None = None,
    batch_ids_window: int = 200,
    queue_size: int = 1024,
) -> Session:
    """Attach spikeguard to ``model`` in this rank. See :class:`Session`.

    Args:
        report: where reports go without a supervisor: ``"off"`` (default) or
            ``"jsonl:///path/file.jsonl"``. ``SPIKEGUARD_REPORT`` overrides it.
        sample_every: probe activations every N steps (``SPIKEGUARD_SAMPLE_EVERY`` overrides).
        ckpt_dir: checkpoint directory (``SPIKEGUARD_CKPT_DIR`` overrides).
        run_id: a name echoed in every message (``SPIKEGUARD_RUN_ID`` overrides).
        probe_patterns: keyword arguments for :class:`~spikeguard.workers.probes.Probes`.
        batch_ids_window: how many steps of ``batch_ids`` to keep for forensics.
        queue_size: bound of the report queue; beyond it messages are dropped and counted.
    """
    return Session(
        model,
        report=report,
        sample_every=sample_every,
        ckpt_dir=ckpt_dir,
        run_id=run_id,
        probe_patterns=probe_patterns,
        batch_ids_window=batch_ids_window,
        queue_size=queue_size,
    )
