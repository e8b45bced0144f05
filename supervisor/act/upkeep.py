"""The controller's upkeep beside the machine's effects: retention, the warm standby, reaping.

Each carries out what a pure decision elsewhere says (``retention.decide``, the worker group's
standby bookkeeping, the reaper's pid files) and returns the events to journal; the recovery
machine never sees them.
"""

from __future__ import annotations

from typing import Any

from spikeguard.workers.checkpoint import choose, remove, retention
from spikeguard.workers.contract.logs import logger

from ..decide import events
from ..decide import recovery as rc
from ..launch import reaper
from ..launch.interface import Group
from ..settings import RunPaths

log = logger(__name__)


def _incident_id(state: rc.State) -> str | None:
    return state.incident.id if state.incident else None


def retain(
    paths: RunPaths, settings: retention.RetentionSettings | None, state: rc.State
) -> list[dict[str, Any]]:
    """Delete what the retention settings do not keep (a pure decision over the listing; the
    resume plan's checkpoint is never deleted). The ``checkpoint_deleted`` events to journal."""
    if settings is None:
        return []
    listed = choose.list_checkpoints(paths.ckpt_dir)
    plan = state.plan
    protected = {plan.checkpoint} if plan is not None and plan.checkpoint else set()
    verdicts = retention.decide(
        listed,
        listed.incomplete,
        settings,
        protected=protected,
        lineage=state.lineage,
        generation=state.generation,
    )
    deleted = []
    for verdict in verdicts:
        if verdict.keep:
            continue
        try:
            remove.remove_checkpoint(verdict.path)
        except (OSError, choose.CheckpointError) as e:
            log.warning("could not delete checkpoint %s: %s", verdict.path, e)
            continue
        deleted.append(events.checkpoint_deleted_event(verdict, _incident_id(state)))
    return deleted


def keep_standby(
    group: Group, *, paths: RunPaths, cmd: list[str], env: dict[str, str], state: rc.State
) -> dict[str, Any] | None:
    """Have the next generation's processes waiting; the ``standby`` event if anything
    changed."""
    change = group.standby(
        generation=rc.next_generation(state),
        cmd=cmd,
        env=env,
        fence_file=str(paths.fence_file),
        ckpt_dir=paths.ckpt_dir,
    )
    return None if change is None else events.standby_event(change, _incident_id(state))


def reap(
    paths: RunPaths, below_generation: int, why: str, *, remote: bool, incident: Any
) -> dict[str, Any] | None:
    """Kill rank processes of generations below ``below_generation`` left running (told apart by
    the run's checkpoint directory in their environment); the ``reaped`` event if any were
    found."""
    found = reaper.reap(str(paths.fence_file), below_generation, remote=remote)
    if not found:
        return None
    return events.reaped_event(found, why, incident.id if incident else None)
