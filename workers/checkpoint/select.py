"""Finding, checking and choosing checkpoints. Torch-free: the supervisor uses it on a head node.

* :func:`list_checkpoints` reads a directory's sidecars (cheap: no hashing);
* :func:`verify` checks one data file's size and sha256 against its sidecar, then scans its pickle
  statically (:mod:`.pickle_scan`), so that a checkpoint the rank could not load is never chosen;
* :func:`on_lineage` says whether a checkpoint lies on the path the current launch descends from;
* :func:`select_checkpoint` chooses the rollback target: the newest checkpoint that qualifies,
  with the reason each newer one was passed over.

Everything here is pure apart from reading files; nothing is written or removed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from . import pickle_scan
from .files import NotRegularFile, lstat_regular
from .format import (
    SIDECAR_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    CheckpointList,
    CorruptCheckpointError,
    is_data_name,
    is_sidecar_name,
    read_sidecar,
)
from .integrity import open_checked


def _order(info: CheckpointInfo) -> tuple[int, int, int, str]:
    """Oldest first: by step, then generation, then rank."""
    return (info.step, info.generation, info.rank, info.path)


def _read_listed(meta_path: str) -> CheckpointInfo:
    """The sidecar at ``meta_path``, checked against its data file's size (not its content).

    Both must be regular files (a symlink is not one: it is never followed).
    """
    lstat_regular(meta_path)
    info = read_sidecar(meta_path)
    try:
        size = lstat_regular(info.path).st_size
    except FileNotFoundError:
        raise CorruptCheckpointError(f"data file {info.path} is missing") from None
    except NotRegularFile as e:
        raise CorruptCheckpointError(f"data file {e}") from None
    except OSError as e:
        raise CorruptCheckpointError(f"data file {info.path}: {e}") from None
    if size != info.size:
        raise CorruptCheckpointError(
            f"size mismatch: {info.path} has {size} bytes, sidecar says {info.size}"
        )
    return info


def list_checkpoints(directory: str | os.PathLike[str]) -> CheckpointList:
    """The published checkpoints in ``directory``, sorted by (step, generation, rank).

    Cheap: reads sidecars and stats data files, never hashes, removes nothing. Never raises and
    never blocks: malformed, oversized or inconsistent sidecars, missing data files, size
    mismatches, anything that is not a regular file (a symlink is never followed; a FIFO is never
    opened for a blocking read), files that cannot be read (EACCES, ELOOP, EIO...) and data files
    without a sidecar (interrupted writes) go to the result's ``problems`` as (path, reason); so
    does a directory that cannot be listed. A directory that does not exist holds no
    checkpoints.
    """
    found = CheckpointList()
    found.problems = []
    try:
        names = set(os.listdir(directory))
    except FileNotFoundError:
        return found
    except OSError as e:  # ENOTDIR, EACCES, ELOOP, ENAMETOOLONG...
        found.problems.append((os.fspath(directory), f"cannot list the directory: {e}"))
        return found
    for name in sorted(names):
        path = os.path.join(os.fspath(directory), name)
        if is_data_name(name) and name + SIDECAR_SUFFIX not in names:
            found.problems.append((path, "data file without sidecar (interrupted write?)"))
        if not is_sidecar_name(name):
            continue
        try:
            found.append(_read_listed(path))
        except (CheckpointError, OSError) as e:
            found.problems.append((path, str(e)))
        except Exception as e:  # one odd file must never hide the others or stop a recovery
            found.problems.append((path, f"unexpected {type(e).__name__}: {e}"))
    found.sort(key=_order)
    return found


def verify(info: CheckpointInfo) -> None:
    """Check that ``info``'s data file is the one its sidecar describes, and loadable.

    Checks the recorded size and sha256 (streamed), then scans the pickle inside the file
    statically with :func:`.pickle_scan.scan_checkpoint` (nothing is run, torch is not needed), so
    that :func:`select_checkpoint` never picks a file the weights-only unpickler would refuse.
    Globals a rank allowed with ``torch.serialization.add_safe_globals`` are refused here.

    Raises :class:`CorruptCheckpointError` (missing, not a regular file, empty, truncated, altered,
    not a ``torch.save`` zip), :class:`UnsafeCheckpointError` (an opcode or a global the
    unpickler refuses), or :class:`CheckpointError` (the file cannot be read for another reason).
    """
    try:
        with open_checked(info.path, [("sidecar", info.sha256)], info.size) as f:
            pickle_scan.scan_checkpoint(f, info.path)
    except OSError as e:  # reading failed midway (EIO...): not the file's fault
        raise CheckpointError(f"{info.path}: reading failed: {e}") from e


def on_lineage(lineage: Sequence[tuple[int, int | None]], generation: int, step: int) -> bool:
    """Whether the checkpoint of ``generation`` at ``step`` lies on the current generation's path.

    ``lineage`` lists every launch, oldest first, as (generation, the step of the checkpoint it was
    launched from, or None if it was launched without one); the current generation is the last.
    Walking back from it, each generation's checkpoints count up to the earliest step any later
    launch branched from: all of the current generation's, an ancestor's only up to where its
    descendants took over (what it wrote after that was abandoned). A launch without a checkpoint
    sets no bound. A generation not in ``lineage`` is not on it; with an empty one nothing is.
    """
    limit = math.inf
    for launched, branched_at in reversed(lineage):
        if generation == launched:
            return step <= limit
        if branched_at is not None:
            limit = min(limit, branched_at)
    return False


def _skip_reason(
    info: CheckpointInfo,
    *,
    min_grade: int | None,
    step_limit: int | None,
    min_steps_back: int,
    lineage: Sequence[tuple[int, int | None]] | None,
) -> str | None:
    """Why ``info`` does not qualify before verification, or None if it might."""
    if lineage is not None and not on_lineage(lineage, info.generation, info.step):
        return f"generation {info.generation} step {info.step} is off the current lineage"
    if step_limit is not None and info.step > step_limit:
        return f"step {info.step} > {step_limit} = before_step - min_steps_back {min_steps_back}"
    if min_grade is None:
        return None  # any grade, ungraded included
    if info.grade is None:
        return "ungraded (no integer 'grade' in meta)"
    if info.grade < min_grade:
        return f"grade {info.grade} < min_grade {min_grade}"
    return None


def select_checkpoint(
    infos: list[CheckpointInfo],
    *,
    min_grade: int | None,
    before_step: int | None,
    min_steps_back: int = 0,
    lineage: Sequence[tuple[int, int | None]] | None = None,
    verify_fn: Callable[[CheckpointInfo], None] = verify,
    fallback_on_corrupt: bool = True,
) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]:
    """Choose the checkpoint to roll back to; pass it one rank's checkpoints.

    The choice is the newest (by step, then generation) checkpoint that

    * lies on ``lineage`` (see :func:`on_lineage`), if ``lineage`` is given;
    * has step <= ``before_step - min_steps_back`` (no bound if ``before_step`` is None);
    * has grade >= ``min_grade`` (ungraded checkpoints never qualify; ``min_grade`` None: any
      grade, ungraded included);
    * passes ``verify_fn``: a :class:`CheckpointError` from it falls back to older checkpoints
      (with ``fallback_on_corrupt`` False it ends the search: nothing is chosen), any other
      error propagates.

    Returns (the choice or None, [(skipped, reason)] for each newer checkpoint passed over, for the
    journal). Pure apart from ``verify_fn``. Raises ValueError if ``min_steps_back`` is negative,
    or non-zero without ``before_step``.
    """
    if min_steps_back < 0 or (before_step is None and min_steps_back):
        raise ValueError(f"min_steps_back={min_steps_back} must be >= 0, and 0 without before_step")
    step_limit = None
    if before_step is not None:
        step_limit = before_step - min_steps_back
    skipped: list[tuple[CheckpointInfo, str]] = []
    for info in sorted(infos, key=_order, reverse=True):
        reason = _skip_reason(
            info,
            min_grade=min_grade,
            step_limit=step_limit,
            min_steps_back=min_steps_back,
            lineage=lineage,
        )
        if reason is not None:
            skipped.append((info, reason))
            continue
        try:
            verify_fn(info)
        except CheckpointError as e:
            skipped.append((info, f"failed verification: {e}"))
            if not fallback_on_corrupt:
                return None, skipped
            continue
        return info, skipped
    return None, skipped
