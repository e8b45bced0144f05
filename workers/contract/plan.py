"""The resume plan: what the supervisor decided for a (re)launched generation.

The launcher writes it as JSON to the file named by ``SPIKEGUARD_RESUME``; the rank's
``Session.resume`` applies it. The journal records the same dictionary in ``launch`` and
``rollback`` events.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .env import ENV_RESUME


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumePlan:
    """What the supervisor decided for a (re)launch; written as JSON to ``SPIKEGUARD_RESUME``."""

    checkpoint: str | None = None
    """Path of the checkpoint to load; None starts from scratch (with the other settings)."""
    checkpoint_step: int | None = None
    """The training step the checkpoint was taken at (training resumes at the next one)."""
    sha256: str | None = None
    """Expected checksum of that checkpoint; a mismatch refuses the load."""
    lr_scale: float = 1.0
    """Multiplier on top of whatever LR schedule the script uses (compounded by the supervisor)."""
    reset_optimizer: bool = False
    """Start the optimizer from fresh state, not the checkpoint's (moments are often poisoned)."""
    skip_ranges: tuple[tuple[int, int], ...] = ()
    """Inclusive step ranges whose batches are skipped (the incident window's data)."""
    skip_batches: str | None = None
    """Path of an incident's batch-ids file (``RUN_DIR/incidents/<id>/batch_ids-<n>.json``,
    written by the supervisor from the ranks' ring buffers): a batch whose ``batch_ids`` equal
    one recorded there for a step in :attr:`skip_batches_steps` is skipped wherever it comes up
    again (``Session.should_skip(step, batch_ids=ids)``)."""
    skip_batches_steps: tuple[int, int] | None = None
    """The inclusive step window of the incident whose recorded batches are skipped; a script
    that does not pass ``batch_ids`` to ``should_skip`` skips these steps instead."""
    generation: int = 0
    """The launch generation this plan belongs to."""
    rewarm_steps: int = 0
    """After an optimizer reset: the LR multiplier ramps linearly from ``1/rewarm_steps`` of
    :attr:`lr_scale` to all of it over the generation's first ``rewarm_steps`` optimizer steps
    (fresh Adam state at the full LR makes the first steps jump); 0: the full scale at once."""
    lr_restore_from: int | None = None
    """The training step the incident's probation ends at (None: the LR cut is kept): from
    there the scale returns linearly to :attr:`lr_restore_to` over :attr:`lr_restore_steps`
    steps. Committed at launch: a probation that fails kills this generation anyway."""
    lr_restore_steps: int = 0
    """Over how many training steps the LR scale returns to :attr:`lr_restore_to`."""
    lr_restore_to: float | None = None
    """The LR scale the run had before the incident (what the cut is given back to)."""

    @property
    def start_step(self) -> int:
        """The first training step of a generation launched with this plan."""
        return 0 if self.checkpoint_step is None else self.checkpoint_step + 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (``skip_ranges`` as lists)."""
        d = dataclasses.asdict(self)
        d["skip_ranges"] = [list(r) for r in self.skip_ranges]
        if self.skip_batches_steps is not None:
            d["skip_batches_steps"] = list(self.skip_batches_steps)
        for name, unused in _ABSENT_WHEN_UNUSED.items():  # as older plans wrote them
            if d[name] == unused:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResumePlan:
        """The inverse of :meth:`to_dict`; ``ValueError`` on unknown fields."""
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"resume plan has unknown fields {sorted(unknown)}")
        kw = dict(d)
        kw["skip_ranges"] = tuple((int(a), int(b)) for a, b in kw.get("skip_ranges", ()))
        window = kw.get("skip_batches_steps")
        if window is not None:
            a, b = window
            kw["skip_batches_steps"] = (int(a), int(b))
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ResumePlan:
        return cls.from_dict(json.loads(text))

    def lr_multiplier(self, optimizer_steps: int, step: int) -> float:
        """The LR multiplier of the optimizer step after ``optimizer_steps`` steps of this
        generation, at training step ``step``: the (restoring) scale, times the re-warm-up."""
        return self.scale_at(step) * self.rewarm_factor(optimizer_steps)

    def rewarm_factor(self, optimizer_steps: int) -> float:
        """The re-warm-up's fraction of the scale for the step after ``optimizer_steps``
        optimizer steps: ``1/rewarm_steps``, ``2/rewarm_steps``, … then 1."""
        if self.rewarm_steps <= 0:
            return 1.0
        return min(1.0, (max(optimizer_steps, 0) + 1) / self.rewarm_steps)

    def scale_at(self, step: int) -> float:
        """The LR scale at training step ``step``: :attr:`lr_scale`, returning linearly to
        :attr:`lr_restore_to` over the :attr:`lr_restore_steps` steps after
        :attr:`lr_restore_from`."""
        if self.lr_restore_from is None or self.lr_restore_to is None:
            return self.lr_scale
        if self.lr_restore_steps <= 0:
            return self.lr_restore_to if step > self.lr_restore_from else self.lr_scale
        done = min(1.0, max(0, step - self.lr_restore_from) / self.lr_restore_steps)
        return self.lr_scale + (self.lr_restore_to - self.lr_scale) * done

    @classmethod
    def from_env(cls) -> ResumePlan | None:
        """The plan named by ``SPIKEGUARD_RESUME``, or None for a fresh start."""
        path = os.environ.get(ENV_RESUME)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


_ABSENT_WHEN_UNUSED: dict[str, Any] = {
    "skip_batches": None,
    "skip_batches_steps": None,
    "rewarm_steps": 0,
    "lr_restore_from": None,
    "lr_restore_steps": 0,
    "lr_restore_to": None,
}
"""Fields :meth:`ResumePlan.to_dict` leaves out at these values: added after the first plans, so
a plan that does not use them reads (and compares) as an older supervisor wrote it."""
