"""Which checkpoints to keep and which to delete: a pure decision over a listing. Torch-free, no
I/O: the supervisor's controller carries the deletions out (and journals each one).

:func:`decide` gives every listed checkpoint, and every save that never finished, a
:class:`Verdict`. Complete checkpoints (replicated and sharded alike) are kept when any of these
holds, checked in this order:

* it is **protected**: the checkpoint the current generation was launched from, or the one a
  pending relaunch will load (the controller passes the resume plan's checkpoint): an open
  incident or a probation may roll back to it;
* ``keep_every``: its step is a multiple of ``keep_every`` (a sparse archive, whatever its grade
  or lineage);
* it lies off the current lineage (a rollback abandoned it: no rollback can choose it again):
  deleted;
* ``keep_last``: it is one of the ``keep_last`` newest on the lineage;
* ``keep_healthy``: it is graded at least ``min_grade`` and is one of the ``keep_healthy``
  newest such on the lineage; or, when ``min_steps_back`` > 0, it lies within
  ``min_steps_back`` steps of the newest checkpoint (each of those becomes the rollback target
  of a numerical incident once the run has moved on), or is one of the ``keep_healthy`` newest
  at or before that window. So whatever step the next incident fires at, the checkpoint a
  numerical rollback would choose (newest, graded at least ``min_grade``, at least
  ``min_steps_back`` before the incident, on the lineage) is still there, and so is the one a
  crash or hang rollback would (the newest, through ``keep_last``);
* otherwise it is deleted.

A save that never finished (a sharded directory without a commit marker, a replicated data file
without its sidecar) is deleted only when no save can still be running into it: its generation
was replaced (every rank of it was killed before the next launch, and a fenced rank can never
commit), or a later save of the same generation completed (a rank saves one checkpoint at a
time). Otherwise it is kept: a save may still be running.

Disk use is therefore bounded by ``keep_last + 2 × keep_healthy`` checkpoints, plus those within
``min_steps_back`` steps of the newest one (``min_steps_back`` / the checkpoint interval), plus
the protected one, plus one every ``keep_every`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from .choose import on_lineage
from .format import CheckpointInfo, Incomplete


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionSettings:
    """How many checkpoints to keep (see the module docstring)."""

    keep_last: int = 3
    """The newest checkpoints on the lineage to keep, whatever their grade (at least 1)."""
    keep_every: int | None = None
    """Keep every checkpoint whose step is a multiple of this (None: none kept for that)."""
    keep_healthy: int = 2
    """The newest checkpoints graded at least ``min_grade`` to keep (and, with
    ``min_steps_back``, every such checkpoint within ``min_steps_back`` steps of the newest one
    and as many again before them)."""
    min_grade: int = 4
    """What counts as healthy for ``keep_healthy`` (the policy's ``recovery.min_grade``)."""
    min_steps_back: int = 0
    """The policy's largest ``min_steps_back``: how far back a numerical rollback must go."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_healthy < 0 or self.min_steps_back < 0:
            raise ValueError("keep_healthy and min_steps_back must be >= 0")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {self.keep_every}")
        if not 0 <= self.min_grade <= 7:
            raise ValueError(f"min_grade must be a grade 0..7, got {self.min_grade}")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What to do with one checkpoint (or unfinished save), and why."""

    path: str
    step: int
    generation: int
    kind: str
    """``"replicated"`` or ``"sharded"``."""
    keep: bool
    reason: str
    size: int
    """Bytes (what deleting it frees)."""
    complete: bool = True
    """False for a save that never finished."""
    grade: int | None = None
    loss: float | None = None
    """The loss recorded with the checkpoint (the journal keeps it for the table)."""
    ranks: int | None = None
    """How many ranks wrote it."""


def _order(info: CheckpointInfo) -> tuple[int, int, str]:
    return (info.step, info.generation, info.path)


def _healthy_kept(on: list[CheckpointInfo], settings: RetentionSettings) -> dict[str, str]:
    """{path: reason} of the checkpoints ``keep_healthy`` keeps (``on``: newest first)."""
    n, grade, back = settings.keep_healthy, settings.min_grade, settings.min_steps_back
    healthy = [i for i in on if i.grade is not None and i.grade >= grade]
    kept = {i.path: f"keep_healthy {n}: graded S{i.grade} >= S{grade}" for i in healthy[:n]}
    if back > 0 and on and n > 0:
        bound = on[0].step - back
        for i in healthy:
            if i.step > bound:
                kept.setdefault(
                    i.path,
                    f"keep_healthy: graded S{i.grade} >= S{grade}, within min_steps_back "
                    f"{back} of step {on[0].step} (a rollback target once the run moves on)",
                )
        for i in [i for i in healthy if i.step <= bound][:n]:
            kept.setdefault(
                i.path,
                f"keep_healthy {n}: graded S{i.grade} >= S{grade}, at least "
                f"min_steps_back {back} before step {on[0].step}",
            )
    return kept


def _complete(
    infos: Sequence[CheckpointInfo],
    settings: RetentionSettings,
    protected: Collection[str],
    lineage: Sequence[tuple[int, int | None]] | None,
) -> list[Verdict]:
    """The verdicts of the complete checkpoints."""
    newest_first = sorted(infos, key=_order, reverse=True)
    on = [i for i in newest_first if not lineage or on_lineage(lineage, i.generation, i.step)]
    last = {i.path for i in on[: settings.keep_last]}
    healthy = _healthy_kept(on, settings)
    on_paths = {i.path for i in on}
    verdicts = []
    for info in newest_first:
        if info.path in protected:
            keep, why = True, "rollback target of the current or the next generation"
        elif settings.keep_every and info.step % settings.keep_every == 0:
            keep, why = True, f"keep_every {settings.keep_every}"
        elif info.path not in on_paths:
            keep, why = False, "off the current lineage: a rollback abandoned it"
        elif info.path in last:
            keep, why = True, f"keep_last {settings.keep_last}"
        elif info.path in healthy:
            keep, why = True, healthy[info.path]
        else:
            keep, why = (
                False,
                (
                    f"beyond keep_last {settings.keep_last} and keep_healthy "
                    f"{settings.keep_healthy} (S>={settings.min_grade})"
                ),
            )
        verdicts.append(
            Verdict(
                info.path,
                info.step,
                info.generation,
                info.kind,
                keep,
                why,
                info.size,
                grade=info.grade,
                loss=_loss(info),
                ranks=info.world_size,
            )
        )
    return verdicts


def _loss(info: CheckpointInfo) -> float | None:
    value = info.meta.get("loss")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _unfinished(
    incomplete: Sequence[Incomplete], infos: Sequence[CheckpointInfo], generation: int
) -> list[Verdict]:
    """The verdicts of the saves that never finished."""
    newest_done: dict[int, int] = {}
    for info in infos:
        newest_done[info.generation] = max(newest_done.get(info.generation, -1), info.step)
    verdicts = []
    for item in sorted(incomplete, key=lambda i: (i.step, i.generation, i.path), reverse=True):
        done = newest_done.get(item.generation, -1)
        if item.generation < generation:
            keep, why = False, f"unfinished save of generation {item.generation}, since replaced"
        elif done > item.step:
            keep, why = (
                False,
                f"unfinished save: a later save of generation {item.generation} (step {done}) "
                "completed",
            )
        else:
            keep, why = True, "unfinished: a save may still be running"
        verdicts.append(
            Verdict(
                item.path,
                item.step,
                item.generation,
                item.kind,
                keep,
                why,
                item.size,
                complete=False,
            )
        )
    return verdicts


def decide(
    checkpoints: Sequence[CheckpointInfo],
    incomplete: Sequence[Incomplete],
    settings: RetentionSettings,
    *,
    protected: Collection[str],
    lineage: Sequence[tuple[int, int | None]] | None,
    generation: int,
) -> list[Verdict]:
    """A verdict for every checkpoint of a listing (see the module docstring).

    ``protected``: paths never deleted (the resume plan's checkpoint). ``lineage``: the
    launches so far (see :func:`~.choose.on_lineage`; None or empty: every checkpoint counts as
    on it). ``generation``: the generation running now. Complete checkpoints first, newest
    first, then the unfinished saves.
    """
    return [
        *_complete(checkpoints, settings, protected, lineage),
        *_unfinished(incomplete, checkpoints, generation),
    ]
