"""Lightning's checkpoint files as spikeguard checkpoints: a ``CheckpointIO`` plugin.

Needs torch and ``lightning`` (the extra ``spikeguard[lightning]``). The
:class:`~.lightning.SpikeguardCallback` installs it on the trainer's strategy; nothing else needs
to know about it.

Why a ``CheckpointIO`` and not only a callback: Lightning hands the finished checkpoint dict (the
one ``Trainer.save_checkpoint`` dumps: weights, optimizer and LR-scheduler states, loop progress,
callback states) to its ``CheckpointIO`` on global rank 0, and asks the same object for it back
when ``trainer.fit(ckpt_path=...)`` resumes, on every rank. A callback sees the dict
(``on_save_checkpoint``) but not the file, and nothing at load time; only the IO sits on both
ends. So the file is published by spikeguard's own write path (temp file, fsync, link, sidecar
last, fence checked before anything is published) and verified by its own load path (size and
sha256 against the sidecar and the resume plan, then ``torch.load(weights_only=True)`` of the
bytes that were hashed), whatever Lightning would otherwise do.

Which files are spikeguard's: those in the session's checkpoint directory named like a
spikeguard checkpoint (``ckpt-step00000120-gen001-rank0.pt``, what the callback asks Lightning to
save), and the file the resume plan names. Anything else (a ``ModelCheckpoint`` of the user's own,
``last.ckpt``) goes to the wrapped IO unchanged and is no rollback candidate.

The checkpoint directory may be an object store (``SPIKEGUARD_CKPT_DIR=s3://bucket/prefix``):
spikeguard's write and load paths go through its :class:`~..checkpoint.storage.Storage`, so a
checkpoint is published to the store (data file, then sidecar, each write-once) and loaded back
from it (verified, then unpickled from the same open object), with no local copy: a URL is
compared as it is, never made a local path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from .. import checkpoint as ckpt
from ..checkpoint.format import parse_data_name
from ..checkpoint.remove import remove_checkpoint
from ..checkpoint.storage import scheme_of
from ..session import Session

LIGHTNING_STATE_KEY = "state_dict"
"""The key every Lightning checkpoint has (the module's weights); a file without it was written by
a script of its own, not by ``Trainer.save_checkpoint``."""


def _full(path: str | Path) -> str:
    """``path`` made absolute, to compare it with another; a URL (``s3://bucket/key``) as it is
    but for a trailing slash (``abspath`` would make it a local path)."""
    path = os.fspath(path)
    return path.rstrip("/") if scheme_of(path) else os.path.abspath(path)


class SpikeguardCheckpointIO(CheckpointIO):
    """Writes and reads spikeguard's checkpoints for Lightning; delegates every other path.

    ``session`` is the rank's :class:`~spikeguard.workers.session.Session` (its checkpoint
    directory, generation, fence and plan); ``inner`` the IO the strategy had before (Lightning's
    ``TorchCheckpointIO`` unless the user configured another).
    """

    def __init__(self, session: Session, inner: CheckpointIO) -> None:
        self.session = session
        self.inner = inner
        self.loaded: str | None = None
        """The absolute path of the spikeguard checkpoint this IO loaded last, verified."""

    def _plan_path(self) -> str | None:
        plan = self.session.plan
        if plan is None or not plan.checkpoint:
            return None
        return _full(plan.checkpoint)

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` is a spikeguard checkpoint: named like one in the session's checkpoint
        directory, or the one the resume plan names."""
        full = _full(path)
        if full == self._plan_path():
            return True
        directory = self.session.ckpt_dir
        if directory is None or os.path.dirname(full) != _full(directory):
            return False
        return parse_data_name(os.path.basename(full)) is not None

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | Path,
        storage_options: Any | None = None,
    ) -> None:
        """Publish ``checkpoint`` (Lightning's dict) as a graded spikeguard checkpoint at ``path``.

        Called by Lightning on global rank 0 only. The step, generation and rank come from the
        name; the generation and rank must be this session's. The write is
        :meth:`Session.save_checkpoint`'s: refused when this generation was fenced
        (:class:`~spikeguard.workers.session.StaleGenerationError`), or when the dict holds
        something ``torch.load(weights_only=True)`` cannot load back
        (:class:`~spikeguard.workers.checkpoint.CheckpointError`: keep hyper-parameters plain).
        """
        if not self.owns(path):
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError("spikeguard checkpoints take no storage_options")
        full = _full(path)
        parsed = parse_data_name(os.path.basename(full))
        if parsed is None or os.path.dirname(full) != _full(self.session.ckpt_dir or ""):
            raise ckpt.CheckpointError(f"{full} is the plan's checkpoint: never written again")
        step, generation, rank = parsed
        if (generation, rank) != (self.session.generation, self.session.rank):
            raise ckpt.CheckpointError(
                f"{full} names generation {generation} rank {rank}; this rank is generation "
                f"{self.session.generation} rank {self.session.rank}"
            )
        self.session.save_checkpoint(checkpoint, step=step)

    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a spikeguard checkpoint for Lightning, verified first; any other path is the
        wrapped IO's.

        The size and sha256 are checked against the sidecar, and against the resume plan's when
        ``path`` is the plan's checkpoint; the same bytes are then loaded with
        ``torch.load(weights_only=True)`` (whatever ``weights_only`` Lightning passes).
        Raises :class:`~spikeguard.workers.checkpoint.CorruptCheckpointError` (altered,
        truncated, no sidecar, not a Lightning checkpoint),
        :class:`~spikeguard.workers.checkpoint.UnsafeCheckpointError` (refused by the
        weights-only unpickler) or :class:`~spikeguard.workers.checkpoint.CheckpointError`.
        """
        if not self.owns(path):
            return self.inner.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        full = _full(path)
        if ckpt.is_sharded_path(full):
            raise ckpt.CheckpointError(
                f"{full} is a sharded checkpoint; the Lightning integration resumes from the "
                "single files it writes"
            )
        plan = self.session.plan
        expected = plan.sha256 if plan is not None and full == self._plan_path() else None
        state = ckpt.load_checkpoint(
            full,
            expected_sha256=expected,
            map_location="cpu" if map_location is None else map_location,
        )
        if LIGHTNING_STATE_KEY not in state:
            raise ckpt.CorruptCheckpointError(
                f"{full} is not a Lightning checkpoint (no {LIGHTNING_STATE_KEY!r}): it was not "
                "written by Trainer.save_checkpoint"
            )
        self.loaded = full
        return state

    def loaded_plan_checkpoint(self) -> bool:
        """Whether the checkpoint the resume plan names is the one this IO loaded."""
        return self.loaded is not None and self.loaded == self._plan_path()

    def remove_checkpoint(self, path: str | Path) -> None:
        """Remove a spikeguard checkpoint sidecar first (never half listed); delegate others."""
        if not self.owns(path):
            self.inner.remove_checkpoint(path)
            return
        remove_checkpoint(_full(path))

    def teardown(self) -> None:
        """The wrapped IO's clean-up."""
        self.inner.teardown()
