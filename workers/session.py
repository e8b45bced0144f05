"""The rank-side API: ``attach()``, ``step()``, ``save_checkpoint()``, ``resume()``.

A training script adopts spikeguard in a few lines::

    sg = spikeguard.workers.attach(model, report="jsonl:///tmp/run.jsonl")
    start = sg.resume(model, optimizer)          # what the supervisor decided
    for step in range(start, total):
        if sg.should_skip(step):
            continue
        with sg.phase("data"):                   # optional: the rank's own time, see phase()
            batch = next(loader)
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

Every step's message carries ``step_time``, the seconds this rank computed in the step (its
model's forward passes, timed by hooks on the attached model, plus its ``data`` phase; see
:mod:`.rank.timing`): in synchronous data parallelism the time between steps is the slowest
rank's on every rank, and ``step_time`` is what tells a straggler apart.

Probes are armed for the *next* step when that step is a sampled one, so
the forward hooks do their work during that step's forward pass and
``step()`` collects the result; on other steps the hooks return at once.

``Session`` is the one public rank API and holds no state of its own: each method wires the
parts of :mod:`spikeguard.workers.rank` together (the configuration, the report channel and
the supervisor's requests, the probes, checkpoints, the plan applied at resume), and what a
framework integration needs beyond a script's calls is :attr:`Session.framework`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
from collections.abc import Iterable
from typing import Any

import torch

from . import checkpoint as ckpt
from . import contract
from .channel import Channel, NullChannel, open_channel
from .probes import Probes
from .rank.cadence import Cadence
from .rank.checkpoints import Checkpoints
from .rank.config import RankConfig
from .rank.framework import FrameworkApi
from .rank.reports import Fence, Reporter, Requests, StaleGenerationError
from .rank.resume import LaunchPlan, LrScale, Resume
from .rank.sampling import Sampler
from .rank.timing import StepTimer

__all__ = ["Session", "StaleGenerationError", "attach"]


def _num(x: Any) -> float | None:
    """A loss or gradient norm as a float (a tensor of one element costs a device sync)."""
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
        config: RankConfig,
        *,
        probe_patterns: dict[str, Iterable[str]] | None = None,
        step_timing: bool = True,
    ) -> None:
        self.config = config
        """What this rank is and where it reports (the environment, read once)."""
        # a standby knows its agent: it talks to no other server (workers/standby.py)
        channel = open_channel(
            config.report, maxsize=config.queue_size, server_pid=config.standby_agent
        )
        self._reporter = Reporter(
            channel, run_id=config.run_id, generation=config.generation, rank=config.rank
        )
        self._launch = LaunchPlan(
            self._reporter,
            generation=config.generation,
            rank=config.rank,
            fence_file=config.fence_file,
            standby_agent=config.standby_agent,
        )
        self._sampler = Sampler(
            model, sample_every=config.sample_every, probe_patterns=probe_patterns
        )
        self._timer = StepTimer(model) if step_timing else None
        self._requests = Requests(self._reporter, batch_ids_window=config.batch_ids_window)
        self._fence = Fence(config.fence_file, generation=config.generation, rank=config.rank)
        self._lr = LrScale()
        self._cadence = Cadence(config.checkpoint_every)
        self._checkpoints = Checkpoints(
            ckpt_dir=config.ckpt_dir,
            generation=config.generation,
            rank=config.rank,
            run_id=config.run_id,
            reporter=self._reporter,
            requests=self._requests,
            sampler=self._sampler,
            fence=self._fence,
            lr=self._lr,
        )
        self._resume = Resume(
            launch=self._launch,
            lr=self._lr,
            sampler=self._sampler,
            reporter=self._reporter,
            writer=self._checkpoints.writer,
        )
        self.framework = FrameworkApi(
            rank=config.rank,
            launch=self._launch,
            resume=self._resume,
            lr=self._lr,
            sampler=self._sampler,
            checkpoints=self._checkpoints,
            fence=self._fence,
        )
        """What a framework integration calls (see :mod:`spikeguard.workers.rank.framework`)."""
        self._reporter.send(
            "hello",
            0,
            world_size=config.world_size,
            pid=os.getpid(),
            host=socket.gethostname(),
            sample_every=config.sample_every,
        )
        self._sampler.start_at(0)

    # -- what the rank is (read-only: the configuration) ----------------------------------
    @property
    def rank(self) -> int:
        """This rank's global index."""
        return self.config.rank

    @property
    def world_size(self) -> int:
        """How many ranks the job has."""
        return self.config.world_size

    @property
    def generation(self) -> int:
        """The launch generation this rank belongs to."""
        return self.config.generation

    @property
    def run_id(self) -> str:
        """The run's name, echoed in every message."""
        return self.config.run_id

    @property
    def sample_every(self) -> int:
        """Probe activations every N steps."""
        return self.config.sample_every

    @property
    def ckpt_dir(self) -> str | None:
        """Where checkpoints are written (None: none can be saved)."""
        return self.config.ckpt_dir

    # -- the parts' public state ----------------------------------------------------------
    @property
    def channel(self) -> Channel | NullChannel:
        """The report channel (its ``dropped`` and ``sent`` counters)."""
        return self._reporter.channel

    @property
    def probes(self) -> Probes:
        """The forward hooks on the model (see :class:`~spikeguard.workers.probes.Probes`)."""
        return self._sampler.probes

    @property
    def plan(self) -> contract.ResumePlan | None:
        """The supervisor's plan for this launch as known now (None: a fresh start, or a
        standby not released yet)."""
        return self._launch.current

    @property
    def lr_scale(self) -> float:
        """The plan's LR scale, once :meth:`resume` installed it (the multiplier in force but for
        a re-warm-up after an optimizer reset, or a cut being given back after probation)."""
        return self._lr.value

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        self._lr.value = float(value)

    @property
    def batch_ids(self) -> collections.deque[tuple[int, Any]]:
        """The ring buffer of the last steps' ``(step, batch_ids)`` (a bounded deque)."""
        return self._requests.ring

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
        The message also carries ``step_time``, the seconds this rank computed in the step (its
        model's forward passes, plus its ``data`` phase), and ``phases``, the seconds of each
        phase the script marked (see :meth:`phase`).
        ``lr``: the script's own (unscaled) LR; the message carries the effective one, times the
        multiplier the step's optimizer step used (the plan's scale, its re-warm-up after an
        optimizer reset, an LR cut being given back after probation).
        """
        self._launch.await_release()
        self._requests.take()
        s = self._sampler.next_step if step is None else int(step)
        loss_f, gn_f = _num(loss), _num(grad_norm)
        eff_lr = None if lr is None else float(lr) * self._lr.in_force
        self._lr.feed(s)
        self._cadence.stepped(s)
        if batch_ids is not None:
            self._requests.record(s, batch_ids)
        fields: dict[str, Any] = {"loss": loss_f, "lr": eff_lr, "grad_norm": gn_f}
        if tokens is not None:
            fields["tokens"] = int(tokens)
        if total_steps is not None:
            fields["total_steps"] = int(total_steps)
        if extra is not None:
            fields["extra"] = extra
        if self._timer is not None:
            fields.update(self._timer.take())
        sample = self._sampler.take(s, loss_f)
        if sample is not None:
            layers, summary = sample
            self._reporter.send(
                "report", s, layers=layers, summary=summary, lr_scale=self._lr.value, **fields
            )
        else:
            self._reporter.send("heartbeat", s, **fields)
        self._sampler.start_at(s + 1)
        self._requests.answer_batch_ids(s)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``with sg.phase("data"): batch = next(loader)`` clocks the block as phase ``name``.

        A step's message carries the seconds of each phase in ``phases`` (summed over the step:
        a phase entered twice counts twice; a phase counts into the step whose ``step()`` comes
        after it ends). The ``data`` phase also counts into ``step_time``: loading its batch is
        the rank's own work, and a rank slow at it makes the others wait as surely as a slow
        forward; any other phase is reported only (it may hold waits on the peers, or enclose
        the forward the SDK already times). Do not enclose the forward in ``data``.

        Phases are CPU wall time: a phase of CUDA work measures its launches unless it ends with
        a synchronisation. ``name`` is a letter or ``_`` then up to 31 of ``[A-Za-z0-9_.-]``
        (ValueError otherwise, at its first use); at most 16 names a step are reported (later
        new names are not, with one warning)."""
        if self._timer is None:
            return contextlib.nullcontext()
        return self._timer.phase(name)  # reusable: the same object for the same name

    def phase_start(self, name: str) -> None:
        """Start phase ``name`` (see :meth:`phase`), for a phase that does not fit a block."""
        if self._timer is not None:
            self._timer.phase_start(name)

    def phase_stop(self, name: str) -> None:
        """End phase ``name`` (see :meth:`phase`); nothing for a phase not started."""
        if self._timer is not None:
            self._timer.phase_stop(name)

    def pause_sampling(self) -> None:
        """Stop the probes and the forward timing until :meth:`resume_sampling`: a framework's
        validation (or sanity check) runs forward passes between training steps, which must
        not count as the next step's sample, nor as its compute time."""
        self._sampler.pause()
        if self._timer is not None:
            self._timer.pause()

    def resume_sampling(self) -> None:
        """Arm the probes again for the next step, if it is a sampled one, and time forwards."""
        self._sampler.resume()
        if self._timer is not None:
            self._timer.resume()

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

        The job's ``checkpoint_every`` (``SPIKEGUARD_CKPT_EVERY``), when it sets one, overrides
        ``every`` (a warning says so once when they differ), as the other ``SPIKEGUARD_*``
        variables override ``attach()``'s arguments; a script that never calls this method
        while the job sets an interval is warned once, after that many steps.

        ``collective=True`` (for sharded saves, where every rank must save at the same step):
        the ranks agree on the supervisor's requests, so every rank gets the same answer at the
        same step even though a request reaches the ranks at different times. It costs one
        all-reduce of one integer per call on spikeguard's own gloo group (a few tens of
        microseconds on one host), and every rank must call it at every step.
        """
        self._launch.await_release()
        self._requests.answer_batch_ids(self._sampler.next_step - 1)  # takes new requests too
        if collective:
            requested = self._requests.claim_agreed(self._checkpoints.agree_max)
        else:
            requested = self._requests.claim()
        if requested:
            return True
        return self._cadence.due(self._sampler.next_step - 1 if step is None else int(step), every)

    def should_skip(self, step: int, batch_ids: Any = None) -> bool:
        """True when the supervisor asked to skip this batch (an incident's data).

        By step (``recovery.skip_by: steps``): the steps of the plan's ``skip_ranges``. By batch
        (``skip_by: batch_ids``): a batch whose ``batch_ids`` equal those a rank recorded for a
        step of the incident's window, wherever it comes up again (pass the ids you will pass
        to :meth:`step`); without ``batch_ids``, or when the supervisor's batch-ids file cannot
        be read, the window's steps are skipped instead.
        """
        self._launch.await_release()
        return self._resume.skip(step, batch_ids)

    def recent_batch_ids(self) -> list[tuple[int, Any]]:
        """The last ~200 steps' ``batch_ids`` (oldest first), for incident forensics."""
        return list(self._requests.ring)

    # -- checkpoints ---------------------------------------------------------------------
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
        self._launch.await_release()
        if not self.ckpt_dir:
            raise ValueError(
                "no checkpoint directory: pass ckpt_dir= to attach() or set SPIKEGUARD_CKPT_DIR"
            )
        if async_save and not sharded:
            raise ValueError("async_save needs sharded=True (a replicated save is synchronous)")
        return self._checkpoints.save(
            state, step=step, sharded=sharded, async_save=async_save, meta=meta
        )

    def wait_checkpoint(self) -> ckpt.CheckpointInfo | None:
        """Wait for the asynchronous sharded save in flight, if any: its checkpoint, or its
        error (:class:`~.checkpoint.CheckpointError`)."""
        return self._checkpoints.wait()

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
        return self._resume.apply(model, optimizer, scheduler)

    def close(self, timeout: float = 5.0) -> None:
        """Wait for an asynchronous save in flight, say ``done``, flush the channel and remove
        hooks; then raise that save's error, if it failed."""
        failed: BaseException | None = None
        try:
            self._checkpoints.close()
        except Exception as e:
            failed = e
        self._reporter.send("done", self._sampler.next_step)
        self._sampler.remove()
        if self._timer is not None:
            self._timer.remove()
        self._lr.remove()
        self._reporter.close(timeout)
        if failed is not None:
            raise failed


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
    step_timing: bool = True,
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
        step_timing: time the model's forward passes and the script's phases into each step's
            ``step_time`` (see :meth:`Session.phase`); False leaves both out of the messages.
    """
    config = RankConfig.from_env(
        report=report,
        sample_every=sample_every,
        ckpt_dir=ckpt_dir,
        run_id=run_id,
        batch_ids_window=batch_ids_window,
        queue_size=queue_size,
    )
    return Session(model, config, probe_patterns=probe_patterns, step_timing=step_timing)
