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
        for name in ("skip_batches", "skip_batches_steps"):  # absent when unused: older plans
            if d[name] is None:
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

    @classmethod
    def from_env(cls) -> ResumePlan | None:
        """The plan named by ``SPIKEGUARD_RESUME``, or None for a fresh start."""
        path = os.environ.get(ENV_RESUME)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())
