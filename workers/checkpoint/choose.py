"""Finding, checking and choosing checkpoints. Torch-free: the supervisor uses it on a head node.

* :func:`list_checkpoints` reads a directory's sidecars and the commit markers of its sharded
  checkpoints (cheap: no hashing);
* :func:`verify` checks one data file's size and sha256 against its sidecar, then scans its pickle
  statically (:mod:`.pickle_scan`), so that a checkpoint the rank could not load is never chosen;
  for a sharded checkpoint it checks the marker's checksum, that the directory holds nothing the
  marker does not list, every file it lists, and scans the DCP ``.metadata``;
* :func:`on_lineage` says whether a checkpoint lies on the path the current launch descends from;
* :func:`select_checkpoint` chooses the rollback target: the newest checkpoint that qualifies,
  with the reason each newer one was passed over; :func:`select_rollback` also judges "healthy"
  against the run's own baseline (:func:`run_baseline`) where the absolute grade is out of
  reach.

Everything here is pure apart from reading files, through the directory's
:class:`~.storage.Storage` (:func:`~.storage.storage_for` it, unless one is given); nothing is
written or removed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypedDict

from . import commit, pickle_scan
from .format import (
    SIDECAR_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    CheckpointList,
    CorruptCheckpointError,
    Incomplete,
    is_sidecar_name,
    parse_data_name,
    read_sidecar,
)
from .integrity import open_checked
from .storage import NotRegularFile, Storage, stat_file, storage_for

if TYPE_CHECKING:  # Python 3.10 has no typing.Unpack; the annotations are never evaluated
    from typing_extensions import Unpack


def _order(info: CheckpointInfo) -> tuple[int, int, int, str]:
    """Oldest first: by step, then generation, then rank."""
    return (info.step, info.generation, info.rank, info.path)


def _read_listed(meta_path: str, storage: Storage) -> CheckpointInfo:
    """The sidecar at ``meta_path``, checked against its data file's size (not its content).

    Both must be regular files (a symlink is not one: it is never followed).
    """
    stat_file(storage, meta_path)
    info = read_sidecar(meta_path, storage=storage)
    try:
        size = stat_file(storage, info.path).size
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


def _size_on_disk(path: str, storage: Storage) -> int:
    """Bytes of the regular files directly in ``path`` (0 if it cannot be listed)."""
    try:
        return sum(entry.size for entry in storage.listdir(path) if entry.kind == "file")
    except OSError:
        return 0


def _read_sharded(directory: str, storage: Storage) -> CheckpointInfo | None:
    """The commit marker of ``directory``, checked against the sizes of the files it lists.

    None when the directory has no marker (an incomplete save).
    """
    st = storage.stat(directory)
    if st.kind != "dir":
        raise CorruptCheckpointError(f"{directory} is {st.what}, not a directory (never followed)")
    try:
        raw = commit.read_marker_bytes(directory, storage=storage)
    except FileNotFoundError:
        return None
    info = commit.parse_marker(directory, raw)
    for name, _sha, size in info.files:
        path = os.path.join(directory, name)
        try:
            actual = stat_file(storage, path).size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{path}, listed in its commit marker, is missing"
            ) from None
        except OSError as e:  # NotRegularFile, EACCES...
            raise CorruptCheckpointError(f"{path}: {e}") from None
        if actual != size:
            raise CorruptCheckpointError(
                f"size mismatch: {path} has {actual} bytes, its commit marker says {size}"
            )
    return info


def _list_one(
    found: CheckpointList, path: str, name: str, names: set[str], storage: Storage
) -> None:
    """Add the checkpoint (or the problem) ``name`` in the listed directory is, if any."""
    if commit.parse_trainer_name(name) is not None:
        info = _read_sharded(path, storage)
        if info is not None:
            found.append(info)
        else:  # the Trainer's save in progress, or one spikeguard never committed: not ours
            found.problems.append((path, "no commit marker (not committed by spikeguard)"))
        return
    sharded = commit.parse_sharded_name(name)
    if sharded is not None:
        info = _read_sharded(path, storage)
        if info is not None:
            found.append(info)
        else:
            found.problems.append(
                (path, "incomplete: no commit marker (interrupted or unfinished)")
            )
            size = _size_on_disk(path, storage)
            found.incomplete.append(Incomplete(path, sharded[0], sharded[1], "sharded", size))
        return
    replicated = parse_data_name(name)
    if replicated is not None and name + SIDECAR_SUFFIX not in names:
        found.problems.append((path, "data file without sidecar (interrupted write?)"))
        try:
            size = stat_file(storage, path).size
        except OSError:
            size = 0
        found.incomplete.append(Incomplete(path, replicated[0], replicated[1], "replicated", size))
    if is_sidecar_name(name):
        found.append(_read_listed(path, storage))


def list_checkpoints(
    directory: str | os.PathLike[str], *, storage: Storage | None = None
) -> CheckpointList:
    """The published checkpoints in ``directory``, sorted by (step, generation, rank).

    Replicated checkpoints are found by their sidecars, sharded ones by their directories'
    commit markers. Cheap: reads sidecars and markers and stats the files they describe, never
    hashes, removes nothing. Never raises and never blocks: malformed, oversized or inconsistent
    sidecars and markers, missing files, size mismatches, anything that is not a regular file (a
    symlink is never followed; a FIFO is never opened for a blocking read), files that cannot be
    read (EACCES, ELOOP, EIO...), data files without a sidecar and sharded directories without a
    commit marker (interrupted or unfinished saves, also in ``incomplete``) go to the result's
    ``problems`` as (path, reason); so does a directory that cannot be listed, or one of a URL
    scheme no storage is registered for. A directory that does not exist holds no checkpoints.
    ``storage``: where ``directory`` is (default: :func:`~.storage.storage_for` it).
    """
    found = CheckpointList()
    directory = os.fspath(directory)
    try:
        storage = storage or storage_for(directory)
        names = {entry.name for entry in storage.listdir(directory)}
    except FileNotFoundError:
        return found
    except (OSError, ValueError) as e:  # ENOTDIR, EACCES, ELOOP...; an unknown URL scheme
        found.problems.append((directory, f"cannot list the directory: {e}"))
        return found
    for name in sorted(names):
        path = os.path.join(directory, name)
        try:
            _list_one(found, path, name, names, storage)
        except (CheckpointError, OSError) as e:
            found.problems.append((path, str(e)))
        except Exception as e:  # one odd file must never hide the others or stop a recovery
            found.problems.append((path, f"unexpected {type(e).__name__}: {e}"))
    found.sort(key=_order)
    return found


def verify_sharded(info: CheckpointInfo, *, storage: Storage | None = None) -> CheckpointInfo:
    """Check a sharded checkpoint: its marker, every file it lists, and DCP's ``.metadata``.

    The marker is read again and must still have ``info.sha256`` (what a resume plan carries);
    the directory must hold nothing the marker does not list (:func:`.commit.refuse_unlisted`);
    each file it lists must have its recorded size and sha256 (streamed); ``.metadata`` must
    pass :func:`.pickle_scan.scan_dcp_metadata`. Returns the marker as read now. Raises
    :class:`CorruptCheckpointError`, :class:`UnsafeCheckpointError` or :class:`CheckpointError`
    as :func:`verify` does.
    """
    storage = storage or storage_for(info.path)
    marker = commit.read_marker(info.path, storage=storage)
    if marker.sha256 != info.sha256:
        raise CorruptCheckpointError(
            f"commit marker {marker.meta_path}: sha256 {marker.sha256}, expected {info.sha256} "
            "(rewritten since it was listed?)"
        )
    commit.refuse_unlisted(marker, storage=storage)
    for name, sha256, size in marker.files:
        path = os.path.join(info.path, name)
        try:
            with open_checked(path, [("commit marker", sha256)], size, storage=storage) as f:
                if name == commit.DCP_METADATA_NAME:
                    pickle_scan.scan_dcp_metadata(f.read(pickle_scan.MAX_PICKLE_BYTES + 1), path)
        except OSError as e:  # reading failed midway (EIO...): not the file's fault
            raise CheckpointError(f"{path}: reading failed: {e}") from e
    return marker


def verify(info: CheckpointInfo, *, storage: Storage | None = None) -> None:
    """Check that ``info``'s data file is the one its sidecar describes, and loadable (a sharded
    checkpoint: :func:`verify_sharded`).

    Checks the recorded size and sha256 (streamed), then scans the pickle inside the file
    statically with :func:`.pickle_scan.scan_checkpoint` (nothing is run, torch is not needed), so
    that :func:`select_checkpoint` never picks a file the weights-only unpickler would refuse.
    Globals a rank allowed with ``torch.serialization.add_safe_globals`` are refused here.

    Raises :class:`CorruptCheckpointError` (missing, not a regular file, empty, truncated, altered,
    not a ``torch.save`` zip), :class:`UnsafeCheckpointError` (an opcode or a global the
    unpickler refuses), or :class:`CheckpointError` (the file cannot be read for another reason).
    ``storage``: where the checkpoint is (default: :func:`~.storage.storage_for` its path).
    """
    if info.kind != "replicated":  # a committed directory: sharded, or a Trainer's
        verify_sharded(info, storage=storage)
        return
    checked = open_checked(info.path, [("sidecar", info.sha256)], info.size, storage=storage)
    try:
        with checked as f:
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
    bar_name: str = "",
) -> str | None:
    """Why ``info`` does not qualify before verification, or None if it might (``bar_name``:
    what the grade bar is, after its value)."""
    if lineage is not None and not on_lineage(lineage, info.generation, info.step):
        return f"generation {info.generation} step {info.step} is off the current lineage"
    if step_limit is not None and info.step > step_limit:
        return f"step {info.step} > {step_limit} = before_step - min_steps_back {min_steps_back}"
    if min_grade is None:
        return None  # any grade, ungraded included
    if info.grade is None:
        return "ungraded (no integer 'grade' in meta)"
    if info.grade < min_grade:
        return f"grade {info.grade} < min_grade {min_grade}{bar_name}"
    return None


@dataclasses.dataclass(frozen=True)
class _Search:
    """One pass over the checkpoints, newest first: the choice, what was passed over, and
    whether a failed verification ended it (``fallback_on_corrupt`` False)."""

    chosen: CheckpointInfo | None
    skipped: list[tuple[CheckpointInfo, str]]
    stopped: bool = False


def _search(
    infos: list[CheckpointInfo],
    *,
    min_grade: int | None,
    before_step: int | None,
    min_steps_back: int,
    lineage: Sequence[tuple[int, int | None]] | None,
    verify_fn: Callable[[CheckpointInfo], None],
    fallback_on_corrupt: bool,
    bar_name: str = "",
) -> _Search:
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
            bar_name=bar_name,
        )
        if reason is not None:
            skipped.append((info, reason))
            continue
        try:
            verify_fn(info)
        except CheckpointError as e:
            skipped.append((info, f"failed verification: {e}"))
            if not fallback_on_corrupt:
                return _Search(None, skipped, stopped=True)
            continue
        return _Search(info, skipped)
    return _Search(None, skipped)


class SearchRules(TypedDict, total=False):
    """The rest of what a checkpoint must satisfy (see :func:`select_rollback`)."""

    min_steps_back: int
    lineage: Sequence[tuple[int, int | None]] | None
    verify_fn: Callable[[CheckpointInfo], None]
    fallback_on_corrupt: bool


def select_checkpoint(
    infos: list[CheckpointInfo],
    *,
    min_grade: int | None,
    before_step: int | None,
    **rules: Unpack[SearchRules],
) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]:
    """Choose the checkpoint to roll back to; pass it one rank's checkpoints.

    The choice is the newest (by step, then generation) checkpoint that

    * lies on ``lineage`` (see :func:`on_lineage`), if ``lineage`` is given;
    * has step <= ``before_step - min_steps_back`` (no bound if ``before_step`` is None);
    * has grade >= ``min_grade`` (ungraded checkpoints never qualify; ``min_grade`` None: any
      grade, ungraded included);
    * passes ``verify_fn`` (default :func:`verify`): a :class:`CheckpointError` from it falls
      back to older checkpoints (with ``fallback_on_corrupt`` False it ends the search: nothing
      is chosen), any other error propagates.

    Returns (the choice or None, [(skipped, reason)] for each newer checkpoint passed over, for the
    journal). Pure apart from ``verify_fn``. Raises ValueError if ``min_steps_back`` is negative,
    or non-zero without ``before_step``. :func:`select_rollback` can also judge the grade
    against the run's own baseline.
    """
    found = select_rollback(infos, min_grade=min_grade, before_step=before_step, **rules)
    return found.chosen, found.skipped


def run_baseline(
    infos: Sequence[CheckpointInfo],
    *,
    before_step: int | None,
    lineage: Sequence[tuple[int, int | None]] | None,
) -> tuple[int, int] | None:
    """The run's own healthy grade: (the median grade of its graded checkpoints on ``lineage``
    before ``before_step``, how many it is the median of), or None when none is graded.

    One grade per saved step (a checkpoint each rank wrote counts once); ungraded checkpoints do
    not count. The lower median: a bar the run met at least half the time it saved."""
    grades: dict[tuple[int, int], int] = {}
    for info in infos:
        if info.grade is None or (before_step is not None and info.step >= before_step):
            continue
        if lineage is not None and not on_lineage(lineage, info.generation, info.step):
            continue
        grades.setdefault((info.generation, info.step), info.grade)
    if not grades:
        return None
    return statistics.median_low(grades.values()), len(grades)


GradeRule = Literal["absolute", "run baseline", "ungraded"]


@dataclasses.dataclass(frozen=True)
class Rollback:
    """The rollback target :func:`select_rollback` chose, and by which rule."""

    chosen: CheckpointInfo | None
    skipped: list[tuple[CheckpointInfo, str]]
    """(checkpoint, why) of each newer one passed over (under the rule that decided)."""
    grade_rule: GradeRule | None
    """``"absolute"``: graded at least ``min_grade``; ``"run baseline"``: nothing was, and the
    bar became the run's own healthy baseline; ``"ungraded"``: no checkpoint of the run carries
    a grade at all (its probes found no blocks), so the grade cannot judge and any qualifies;
    None: any grade (``min_grade`` None)."""
    grade_bar: int | None
    """The grade the choice had to meet."""
    baseline_of: int | None = None
    """How many graded checkpoints the baseline is the median of (None: not computed)."""
    stopped: bool = False
    """A failed verification ended the search (``fallback_on_corrupt`` False)."""


def select_rollback(
    infos: list[CheckpointInfo],
    *,
    min_grade: int | None,
    before_step: int | None,
    min_steps_back: int = 0,
    lineage: Sequence[tuple[int, int | None]] | None = None,
    verify_fn: Callable[[CheckpointInfo], None] = verify,
    fallback_on_corrupt: bool = True,
    grade_baseline: Literal["run", "absolute"] = "absolute",
) -> Rollback:
    """:func:`select_checkpoint`, and with ``grade_baseline`` "run", when nothing meets
    ``min_grade``, again with the bar lowered to the run's own healthy baseline
    (:func:`run_baseline` before ``before_step``, capped at ``min_grade``): a healthy small model
    grades S2-S3, and an absolute S4 would make its first incident escalate; with no graded
    checkpoint at all (a model whose blocks no probe found), with any grade. Each checkpoint is
    verified at most once. Says which rule chose, with the bar."""
    search = functools.partial(
        _search,
        infos,
        before_step=before_step,
        min_steps_back=min_steps_back,
        lineage=lineage,
        verify_fn=_verified_once(verify_fn),
        fallback_on_corrupt=fallback_on_corrupt,
    )
    first = search(min_grade=min_grade)
    rule: GradeRule | None = None if min_grade is None else "absolute"
    absolute = Rollback(first.chosen, first.skipped, rule, min_grade, stopped=first.stopped)
    if first.chosen is not None or first.stopped or min_grade is None or grade_baseline != "run":
        return absolute
    baseline = run_baseline(infos, before_step=before_step, lineage=lineage)
    if baseline is None:  # nothing graded: a model whose blocks no probe found
        found = search(min_grade=None)
        return Rollback(found.chosen, found.skipped, "ungraded", None, 0, found.stopped)
    if baseline[0] >= min_grade:
        return dataclasses.replace(absolute, baseline_of=baseline[1] if baseline else None)
    bar, n = baseline
    found = search(min_grade=bar, bar_name=" (the run's baseline)")
    return Rollback(found.chosen, found.skipped, "run baseline", bar, n, found.stopped)


def _verified_once(verify_fn: Callable[[CheckpointInfo], None]) -> Callable[[CheckpointInfo], None]:
    """``verify_fn``, remembering each checkpoint's outcome (a second look costs nothing)."""
    seen: dict[str, CheckpointError | None] = {}

    def verify_once(info: CheckpointInfo) -> None:
        if info.path not in seen:
            try:
                verify_fn(info)
                seen[info.path] = None
            except CheckpointError as e:
                seen[info.path] = e
        failed = seen[info.path]
        if failed is not None:
            raise failed

    return verify_once
