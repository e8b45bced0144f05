"""``spikeguard checkpoints RUN_DIR``: every checkpoint of a run, in one table. Pure: the command
gathers the listing, the verification outcomes and the journal's events; this turns them into
rows (:func:`rows`) and text (:func:`render`), with no I/O.

A row is a checkpoint on disk (``verified``, ``corrupt``, ``incomplete``, or ``listed`` when
not verified), or one retention deleted (``deleted``, from the journal's ``checkpoint_deleted``
events, with the reason). The ``retention`` column says why a checkpoint on disk is there when
the journal knows: the generations launched from it, and whether the current generation was.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from spikeguard.workers.checkpoint import commit
from spikeguard.workers.checkpoint.format import SIDECAR_SUFFIX, CheckpointInfo, Incomplete

from ..decide.events import Kind

_NAME_RE = re.compile(r"^ckpt-step(\d+)-gen(\d+)(?:-rank\d+\.pt|\.dcp)$")


@dataclasses.dataclass(frozen=True)
class Row:
    """One checkpoint of the table."""

    step: int | None
    generation: int | None
    kind: str
    """``replicated`` or ``sharded``."""
    ranks: int | None
    """How many ranks wrote it."""
    grade: int | None
    loss: float | None
    bytes: int | None
    status: str
    """``verified``, ``corrupt``, ``incomplete``, ``listed`` (not verified) or ``deleted``."""
    retention: str
    """``kept`` (and why the journal says it matters) or ``deleted: <reason>``."""
    path: str
    detail: str = ""
    """Why it is corrupt or incomplete."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return dataclasses.asdict(self)


def _parse_name(path: str) -> tuple[int | None, int | None, str]:
    """(step, generation, kind) from a checkpoint's file or directory name."""
    name = os.path.basename(path)
    if name.endswith(SIDECAR_SUFFIX):
        name = name[: -len(SIDECAR_SUFFIX)]
    match = _NAME_RE.match(name)
    trainer_step = commit.parse_trainer_name(name)
    if trainer_step is not None:
        return trainer_step, None, commit.TRAINER_LAYOUT
    if match is None:
        return None, None, "?"
    kind = "sharded" if name.endswith(".dcp") else "replicated"
    return int(match[1]), int(match[2]), kind


def _launched_from(events: Sequence[Mapping[str, Any]]) -> tuple[dict[str, list[int]], str | None]:
    """({checkpoint path: generations launched from it}, the current generation's checkpoint)."""
    launched: dict[str, list[int]] = {}
    current: str | None = None
    for ev in events:
        if ev.get("kind") != Kind.LAUNCH.value:
            continue
        plan = ev.get("plan")
        path = plan.get("checkpoint") if isinstance(plan, dict) else None
        current = path if isinstance(path, str) else None
        if current is not None and isinstance(ev.get("generation"), int):
            launched.setdefault(current, []).append(ev["generation"])
    return launched, current


def _kept(path: str, launched: dict[str, list[int]], current: str | None) -> str:
    gens = launched.get(path)
    if not gens:
        return "kept"
    which = ", ".join(str(g) for g in gens)
    plural = "s" if len(gens) > 1 else ""
    if path == current:
        return f"kept: rollback target (generation{plural} {which} resumed from it)"
    return f"kept: generation{plural} {which} resumed from it"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def rows(
    checkpoints: Sequence[CheckpointInfo],
    problems: Sequence[tuple[str, str]],
    incomplete: Sequence[Incomplete],
    verified: Mapping[str, str | None] | None,
    events: Sequence[Mapping[str, Any]],
) -> list[Row]:
    """The table's rows, oldest first.

    ``checkpoints``, ``problems`` and ``incomplete`` are a listing's; ``verified`` maps a listed
    checkpoint's path to None (it verified) or why it failed (None: nothing was verified);
    ``events`` are the run's journal.
    """
    launched, current = _launched_from(events)
    out: list[Row] = []
    for info in checkpoints:
        status, detail = "listed", ""
        if verified is not None:
            failure = verified.get(info.path)
            status, detail = ("corrupt", failure) if failure else ("verified", "")
        out.append(
            Row(
                info.step,
                info.generation,
                info.kind,
                info.world_size,
                info.grade,
                _number(info.meta.get("loss")),
                info.size,
                status,
                _kept(info.path, launched, current),
                info.path,
                detail,
            )
        )
    unfinished = {item.path: item for item in incomplete}
    for path, why in problems:
        step, generation, kind = _parse_name(path)
        item = unfinished.get(path)
        if item is not None:
            out.append(
                Row(
                    step,
                    generation,
                    kind,
                    None,
                    None,
                    None,
                    item.size,
                    "incomplete",
                    "kept",
                    path,
                    why,
                )
            )
        elif step is not None:
            out.append(
                Row(step, generation, kind, None, None, None, None, "corrupt", "kept", path, why)
            )
    on_disk = {row.path for row in out}
    for ev in events:
        if ev.get("kind") != Kind.CHECKPOINT_DELETED.value or ev.get("path") in on_disk:
            continue
        path = str(ev.get("path"))
        step, generation, kind = _parse_name(path)
        grade, ranks = ev.get("grade"), ev.get("ranks")
        out.append(
            Row(
                step,
                generation,
                str(ev.get("checkpoint_kind") or kind),
                ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else None,
                grade if isinstance(grade, int) and not isinstance(grade, bool) else None,
                _number(ev.get("loss")),
                ev.get("bytes") if isinstance(ev.get("bytes"), int) else None,
                "deleted",
                f"deleted: {ev.get('reason')}",
                path,
            )
        )
    return sorted(out, key=lambda r: (r.step if r.step is not None else -1, r.generation or 0))


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


_COLUMNS = ("step", "gen", "kind", "ranks", "grade", "loss", "size", "status", "retention")


def render(table: Sequence[Row]) -> str:
    """The rows as aligned text, and a summary line."""
    lines = [
        (
            _cell(r.step),
            _cell(r.generation),
            r.kind,
            _cell(r.ranks),
            _cell(r.grade, "S{}"),
            _cell(r.loss, "{:.4f}"),
            _size(r.bytes),
            r.status + (f" ({r.detail})" if r.status == "corrupt" and r.detail else ""),
            r.retention,
        )
        for r in table
    ]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(_COLUMNS)]
    right = {0, 1, 3, 5, 6}

    def fmt(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    out = [fmt(_COLUMNS)] + [fmt(line) for line in lines]
    present = [r for r in table if r.status != "deleted"]
    deleted = [r for r in table if r.status == "deleted"]
    kept_bytes = sum(r.bytes or 0 for r in present)
    freed = sum(r.bytes or 0 for r in deleted)
    out.append(
        f"{len(present)} on disk ({_size(kept_bytes)}), {len(deleted)} deleted by retention "
        f"({_size(freed)} freed)"
    )
    return "\n".join(out)
