"""A rank's checkpoints: the two save paths, the report of a committed checkpoint, and the small
collectives every rank takes part in.

* **Replicated**: one rank writes the whole state (:func:`~..checkpoint.write_checkpoint`),
  graded with its latest sample, and reports it at once.
* **DCP-sharded**: every rank writes its shard through one
  :class:`~..checkpoint.ShardedWriter` (its own gloo groups, created at the first collective, and
  the asynchronous save in flight); rank 0 reports the checkpoint once it is committed.

Either way the checkpoint message answers the supervisor's checkpoint requests claimed so far
(:class:`.reports.Requests`), and a fenced generation writes nothing (:class:`.reports.Fence`).
"""

from __future__ import annotations

from typing import Any

from .. import checkpoint as ckpt
from ..checkpoint.storage import storage_for
from .reports import Fence, Reporter, Requests
from .resume import LrScale
from .sampling import Sampler


class Checkpoints:
    """Saves this rank's checkpoints into ``ckpt_dir`` (graded with ``sampler``'s latest
    sample, with ``lr``'s scale recorded) and tells the supervisor of them."""

    def __init__(
        self,
        *,
        ckpt_dir: str | None,
        generation: int,
        rank: int,
        run_id: str,
        reporter: Reporter,
        requests: Requests,
        sampler: Sampler,
        fence: Fence,
        lr: LrScale,
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self._generation = generation
        self._rank = rank
        self._run_id = run_id
        self._reporter = reporter
        self._requests = requests
        self._sampler = sampler
        self._fence = fence
        self._lr = lr
        self._writer: ckpt.ShardedWriter | None = None

    def writer(self) -> ckpt.ShardedWriter:
        """The rank's sharded writer (and its gloo groups), created on first use."""
        if self._writer is None:
            self._writer = ckpt.ShardedWriter()
        return self._writer

    def run_meta(self) -> dict[str, Any]:
        """The run's fields of a checkpoint's metadata (LR scale, run id)."""
        return {"lr_scale": self._lr.value, "run": self._run_id}

    def save(
        self, state: dict[str, Any], *, step: int, sharded: bool, async_save: bool, meta: Any
    ) -> ckpt.CheckpointInfo | ckpt.PendingSave:
        """Save ``state`` (see :meth:`~spikeguard.workers.session.Session.save_checkpoint`,
        which checks the arguments)."""
        if sharded:
            return self._save_sharded(state, step=step, async_save=async_save, meta=meta)
        return self._save_replicated(state, step=step, meta=meta)

    def _save_replicated(
        self, state: dict[str, Any], *, step: int, meta: dict[str, Any]
    ) -> ckpt.CheckpointInfo:
        """One file with this rank's grade and latest layers; reported once written."""
        assert self.ckpt_dir is not None
        self._fence.check()
        storage_for(self.ckpt_dir).make_dirs(self.ckpt_dir)  # a prefix on an object store: nothing
        full_meta = {
            **self._sampler.grade_meta(),
            "layers": self._sampler.layers(),
            **self.run_meta(),
            **meta,
        }
        info = ckpt.write_checkpoint(
            self.ckpt_dir,
            state,
            step=step,
            generation=self._generation,
            rank=self._rank,
            meta=full_meta,
            fence=self._fence.check,
        )
        self._requests.take()  # a save after a request answers it, whatever prompted the save
        self._reporter.send(
            "checkpoint",
            step,
            path=info.path,
            sha256=info.sha256,
            grade=full_meta["grade"],
            loss=self._sampler.last_loss,
            requests=self._requests.answered(),
        )
        return info

    def _save_sharded(
        self, state: dict[str, Any], *, step: int, async_save: bool, meta: dict[str, Any]
    ) -> ckpt.CheckpointInfo | ckpt.PendingSave:
        """Every rank's part of a sharded save; rank 0 reports it once it is committed."""
        assert self.ckpt_dir is not None
        answered = self._requests.answered()

        def report(info: ckpt.CheckpointInfo) -> None:
            self._send(info, answered)

        return self.writer().save(
            self.ckpt_dir,
            state,
            step=step,
            generation=self._generation,
            rank_meta=self._sampler.grade_meta(),
            meta={**self.run_meta(), **meta},
            fence=self._fence.check,
            async_save=async_save,
            on_commit=report,
        )

    def report(self, info: ckpt.CheckpointInfo) -> None:
        """Tell the supervisor about ``info``, committed outside :meth:`save` (a framework's
        own checkpoint); it answers the requests taken so far."""
        self._requests.take()
        self._send(info, self._requests.answered())

    def _send(self, info: ckpt.CheckpointInfo, answered: list[int]) -> None:
        """The ``checkpoint`` message of a committed directory (sharded or a framework's)."""
        self._reporter.send(
            "checkpoint",
            info.step,
            path=info.path,
            sha256=info.sha256,
            grade=info.grade,
            loss=info.meta.get("loss"),
            requests=answered,
            kind=info.kind,
            world_size=info.world_size,
        )

    def wait(self) -> ckpt.CheckpointInfo | None:
        """Wait for the asynchronous sharded save in flight, if any: its checkpoint, or its
        error."""
        if self._writer is None:
            return None
        return self._writer.wait()

    def agree_max(self, value: int) -> int:
        """The largest ``value`` any rank passes (a collective on spikeguard's own gloo
        group: every rank calls it at the same point)."""
        return self.writer().agree_max(value)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, by rank (a collective on spikeguard's own gloo group)."""
        return self.writer().all_gather(obj)

    def close(self) -> None:
        """Wait for the save in flight (its error propagates) and stop the writer's thread."""
        if self._writer is not None:
            self._writer.close()
