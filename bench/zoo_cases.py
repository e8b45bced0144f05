"""The divergence zoo's cases: a model, a failure kind, and a stable control for each.

A case is a model from :mod:`zoo_models` and a recipe: the LR schedule, the output layer's own LR
multiplier, and what the data do at which step. Its ``diverge`` variant fails in the case's way;
its ``control`` variant is the same model on the same data without the cause (a lower LR, or no
burst, or no head-LR jump), so the control's final loss is what a rescue should reach.

Failure kinds (``Case.failure``):

``overshoot``  a geometric LR warm-up to a peak past the model's stability edge, then a cosine
               decay (the example's recipe): attention logits grow until the loss climbs.
``constant``   a constant LR too high for the model from a short linear warm-up on: it trains,
               then diverges somewhere (where depends on the seed).
``shift``      a late spike after a data shift: the data switch at ``shift_at`` from Python
               source to English prose (``pydoc_data/topics.py``), at an LR that was stable on
               the first data but is not on the second; the control (a lower LR) sees the shift
               too, so its loss rises at the shift without diverging.
``burst``      a burst of repeated content: ``burst_len`` steps from ``burst_at`` where every row
               of the batch is the same sequence (one batch id) — what the seed article traced
               its spike to; the control trains on the ordinary data at the same LR.
``logits``     an output-logit blow-up with no precursor: the output layer's LR jumps by
               ``head_jump`` for ``head_len`` steps at ``head_at`` (a schedule bug: a warm
               restart of the head's group), nothing before it moves.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One zoo case: a model, a failure kind and their numbers (see the module docstring)."""

    name: str
    """How the bench and the job files name the case."""
    model: str
    """A key of :data:`zoo_models.MODELS`."""
    failure: str
    """overshoot, constant, shift, burst or logits."""
    steps: int = 800
    """Total optimizer steps."""
    lr: float = 0.01
    """The diverging variant's peak (overshoot) or constant LR."""
    lr_start: float = 1e-3
    """overshoot: the LR at step 0 of the geometric warm-up."""
    warmup: int = 500
    """overshoot: geometric warm-up steps; otherwise linear warm-up steps."""
    control_lr: float | None = None
    """The control's LR (None: ``lr`` x 0.1 for overshoot/constant/shift, ``lr`` otherwise)."""
    final_frac: float = 0.1
    """overshoot: the cosine decays to this fraction of the peak at ``steps``."""
    shift_at: int = 500
    burst_at: int = 500
    burst_len: int = 8
    head_at: int = 500
    head_len: int = 10
    head_jump: float = 30.0
    fsdp: bool = False
    """Train with FSDP2 (``fully_shard`` per block and at the root) and sharded checkpoints."""
    weight_decay: float = 0.0

    def lr_at(self, step: int, variant: str) -> float:
        """The base LR of ``step`` (the output layer's is this times :meth:`head_factor`)."""
        peak = self.lr if variant == "diverge" else self.control_peak
        if self.failure == "overshoot":
            start = self.lr_start * peak / self.lr
            if step < self.warmup:
                return start * (peak / start) ** (step / self.warmup)
            frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
            floor = self.final_frac * peak
            return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * frac))
        if step < self.warmup:
            return peak * (step + 1) / self.warmup
        return peak

    @property
    def control_peak(self) -> float:
        if self.control_lr is not None:
            return self.control_lr
        return self.lr * (0.1 if self.failure in ("overshoot", "constant", "shift") else 1.0)

    def head_factor(self, step: int, variant: str) -> float:
        """The output layer's LR multiplier at ``step``."""
        jumped = variant == "diverge" and self.failure == "logits"
        return self.head_jump if jumped and 0 <= step - self.head_at < self.head_len else 1.0

    def burst(self, step: int, variant: str) -> bool:
        """Whether ``step``'s batch is the burst of repeated content."""
        return (
            variant == "diverge"
            and self.failure == "burst"
            and self.burst_at <= step < self.burst_at + self.burst_len
        )

    def shifted(self, step: int) -> bool:
        """Whether ``step`` trains on the second data (both variants shift)."""
        return self.failure == "shift" and step >= self.shift_at


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(name="gpt-overshoot", model="gpt", failure="overshoot", lr=0.15),
        Case(name="gpt-qk-overshoot", model="gpt-qk", failure="overshoot", lr=0.6),
        Case(name="qwen3-overshoot", model="qwen3", failure="overshoot", lr=0.6),
        Case(name="neox-overshoot", model="neox", failure="overshoot", lr=0.4),
        Case(name="gemma-overshoot", model="gemma", failure="overshoot", lr=0.4),
        Case(name="fsdp-overshoot", model="gpt", failure="overshoot", lr=0.15, fsdp=True),
        Case(name="unnamed-overshoot", model="unnamed", failure="overshoot", lr=0.3),
        Case(name="qwen3-logits", model="qwen3", failure="logits", lr=0.005, head_jump=60),
        Case(name="gpt-burst", model="gpt", failure="burst", lr=0.03, burst_len=30),
        Case(name="gpt-constant", model="gpt", failure="constant", lr=0.12, warmup=200),
        Case(name="gpt-shift", model="gpt", failure="shift", lr=0.08, warmup=200, shift_at=400),
    )
}
"""Every case, by name."""

DIVERGING = (
    "gpt-overshoot",
    "gpt-qk-overshoot",
    "qwen3-overshoot",
    "neox-overshoot",
    "gemma-overshoot",
    "fsdp-overshoot",
    "unnamed-overshoot",
    "qwen3-logits",
    "gpt-burst",
)
"""The cases whose ``diverge`` variant diverges on every seed measured; the others' two variants
are both controls (see bench/README.md: a constant LR too high for these models and a data shift
made their loss plateau or fall, never spike, at every LR tried)."""
