"""Checkpoints with grades: atomic write, checksum, sidecar metadata, safe load.

``ckpt-step{step:08d}-gen{generation:03d}-rank{rank}.pt`` (a ``torch.save`` that loads with ``weights_only=True``)
and its sidecar ``<name>.json`` (version, step, generation, rank, sha256, size, time, the caller's ``meta``) are each
written to ``.tmp-<name>-<pid>``, fsynced, published under their final name without ever replacing a file (hard
link; check + rename where links are unsupported), and the directory fsynced. The sidecar goes last: a checkpoint
exists once its sidecar does. In the common data-parallel case rank 0 writes the replicated state, the others
nothing; ``rank`` is in the name so per-rank shards can come later. Test hook: ``SPIKEGUARD_TEST_CKPT_PAUSE``
(read only in :func:`write_checkpoint`) makes the writer sleep so a test can SIGKILL it: ``SECONDS`` or
``publish:SECONDS`` once both temp files are durable; ``sidecar:SECONDS`` once the data file alone is published.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import glob
import hashlib
import json
import os
import pickle
import re
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np
import torch

CHECKPOINT_FORMAT = "spikeguard-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
ENV_TEST_PAUSE = "SPIKEGUARD_TEST_CKPT_PAUSE"
TMP_PREFIX = ".tmp-"
_NAME_RE = re.compile(r"^ckpt-step\d+-gen\d+-rank\d+\.pt$")
_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    torch.Size,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.qscheme,
    torch.Tensor,
    torch.nn.Parameter,
)
_CONTAINERS = (dict, collections.OrderedDict, collections.defaultdict, list, tuple, set)
_unsafe_globals = getattr(
    torch.serialization, "get_unsafe_globals_in_checkpoint", lambda f: []
)  # torch < 2.5: no scan
_safe_globals = getattr(torch.serialization, "get_safe_globals", list)  # torch < 2.4: none


class CheckpointError(Exception):
    """A checkpoint could not be written, found or loaded."""


class CorruptCheckpointError(CheckpointError):
    """The data file is missing, empty, truncated, altered (size/sha256 mismatch) or undecodable."""


class UnsafeCheckpointError(CheckpointError):
    """The file needs globals that ``weights_only`` refuses (e.g. a malicious pickle); nothing was run."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One published checkpoint, as its sidecar describes it."""

    path: str
    meta_path: str
    step: int
    generation: int
    rank: int
    sha256: str
    size: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)
    created: str = ""

    @property
    def grade(self) -> int | None:
        """``meta["grade"]`` (min grade over layers) as an int; None if absent or not an integer."""
        g = self.meta.get("grade")
        return int(g) if type(g) in (int, float) and float(g).is_integer() else None


class CheckpointList(list[CheckpointInfo]):
    """:func:`list_checkpoints`'s result; ``problems`` holds (path, reason) for each file skipped."""

    problems: list[tuple[str, str]]


def checkpoint_name(step: int, generation: int, rank: int = 0) -> str:
    """The data file name of a checkpoint."""
    return f"ckpt-step{step:08d}-gen{generation:03d}-rank{rank}.pt"


def _prepare(obj: Any, where: str, safe: set[type]) -> Any:
    """``obj`` with numpy values and defaultdicts converted; CheckpointError if weights_only can't load it
    (``safe``: the classes given to ``add_safe_globals``)."""
    t = type(obj)
    if t in _LEAVES or t in safe:
        return obj
    if isinstance(obj, np.generic):
        return _prepare(obj.item(), where, safe)
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        return torch.tensor(obj)
    if t not in _CONTAINERS:
        raise CheckpointError(
            f"{where}: {t.__module__}.{t.__qualname__} cannot be loaded with weights_only=True; "
            "store plain containers, scalars and tensors (or add_safe_globals the class)"
        )
    if isinstance(obj, dict):
        out = {
            _prepare(k, f"{where}[{k!r}]", safe): _prepare(v, f"{where}[{k!r}]", safe)
            for k, v in obj.items()
        }
        return (
            out
            if t is collections.defaultdict
            else obj
            if all(out[k] is obj[k] for k in obj)
            else t(out)
        )
    items = [_prepare(v, f"{where}[{i}]", safe) for i, v in enumerate(obj)]
    return obj if all(a is b for a, b in zip(items, obj)) else t(items)


def _json_default(o: Any) -> Any:
    if (isinstance(o, torch.Tensor) and o.numel() == 1) or isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"{type(o).__qualname__} is not JSON serialisable")


class _HashingWriter:
    """Write-only wrapper of a buffered file: hashes and counts the bytes written, keeps the OSError if any."""

    def __init__(self, f: BinaryIO) -> None:
        self._f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None  # torch's C++ writer turns it into an opaque RuntimeError

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        try:
            self._f.write(mv)  # a BufferedWriter writes everything or raises
        except OSError as e:
            self.error = e
            raise
        self.sha.update(mv)
        self.size += len(mv)
        return len(mv)

    def flush(self) -> None:
        self._f.flush()


def _write_durable(
    path: str, write: Callable[[_HashingWriter], object], created: list[str]
) -> _HashingWriter:
    """Create ``path`` (never an existing one), fill it with ``write``, fsync it; return the hashing writer."""
    try:
        f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb")
    except FileExistsError:
        raise CheckpointError(
            f"temp file {path} exists: the same checkpoint is being written concurrently, "
            "or a crashed writer left it (see clean_temp_files)"
        ) from None
    with f:
        created.append(path)
        w = _HashingWriter(f)
        try:
            write(w)
        except Exception:
            if w.error is None:
                raise
            raise w.error from None  # the real cause (ENOSPC, EFBIG...), not torch's rewording of it
        f.flush()
        os.fsync(f.fileno())
    return w


def _publish(tmp: str, final: str, created: list[str]) -> None:
    """Give ``tmp`` the name ``final`` without ever replacing an existing ``final``; fsync the directory."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise CheckpointError(f"refusing to overwrite existing {final}") from None
    except OSError:  # no hard links on this filesystem: check, then rename
        if os.path.lexists(final):
            raise CheckpointError(f"refusing to overwrite existing {final}") from None
        os.rename(tmp, final)
    created.append(final)
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _test_pause(stage: str) -> None:
    where, _, secs = os.environ.get(ENV_TEST_PAUSE, "").rpartition(":")
    time.sleep(float(secs) if secs and (where or "publish") == stage else 0)


def write_checkpoint(
    directory: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    step: int,
    generation: int,
    rank: int = 0,
    meta: dict[str, Any],
    fence: Callable[[], None] | None = None,
) -> CheckpointInfo:
    """Write ``state`` as a new checkpoint in ``directory``; return its description. ``state`` holds tensors,
    dicts/lists/tuples/sets, scalars, strings, dtypes, devices, ``add_safe_globals`` classes (numpy values become
    scalars/tensors, defaultdicts dicts); else :class:`CheckpointError` before writing. ``meta`` must be JSON-able
    (NaN allowed); ``meta["grade"]`` is the grade. ``fence`` is called once, right before anything is published; if
    it raises, nothing is and its exception propagates as is. Any other failure raises :class:`CheckpointError`
    after removing all this call created; other checkpoints are never touched."""
    if not all(type(v) is int and v >= 0 for v in (step, generation, rank)):
        raise CheckpointError(
            f"step, generation, rank must be non-negative ints: {step!r}, {generation!r}, {rank!r}"
        )
    if not isinstance(state, dict) or not isinstance(meta, dict):
        raise CheckpointError(
            f"state and meta must be dicts, not {type(state).__name__}, {type(meta).__name__}"
        )
    path = os.path.join(os.fspath(directory), name := checkpoint_name(step, generation, rank))
    if os.path.lexists(path) or os.path.lexists(path + ".json"):
        raise CheckpointError(f"refusing to overwrite existing checkpoint {path}")
    safe = (g[0] if isinstance(g, tuple) else g for g in _safe_globals())
    try:
        state = _prepare(state, "state", {g for g in safe if isinstance(g, type)})
        meta = json.loads(json.dumps(meta, default=_json_default, allow_nan=True))
    except RecursionError:
        raise CheckpointError(
            f"state or meta for {name} contains a reference cycle (or is nested too deep)"
        ) from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta for {name} is not JSON-serialisable: {e}") from e
    tmp = os.path.join(os.fspath(directory), f"{TMP_PREFIX}{name}-{os.getpid()}")
    meta_tmp = os.path.join(os.fspath(directory), f"{TMP_PREFIX}{name}.json-{os.getpid()}")
    created: list[str] = []  # everything this call created, removed on failure
    fenced = False  # True while ``fence`` runs: its exception is re-raised unchanged
    try:
        hw = _write_durable(tmp, lambda w: torch.save(state, w), created)
        unsafe = _unsafe_globals(tmp)
        if unsafe:
            raise UnsafeCheckpointError(
                f"{name} would need globals weights_only refuses: {sorted(unsafe)}"
            )
        info = CheckpointInfo(
            path=path,
            meta_path=path + ".json",
            step=step,
            generation=generation,
            rank=rank,
            sha256=hw.sha.hexdigest(),
            size=hw.size,
            meta=meta,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        )
        sidecar = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_FORMAT_VERSION,
            "file": name,
            **{k: v for k, v in dataclasses.asdict(info).items() if k not in ("path", "meta_path")},
        }
        text = json.dumps(sidecar, indent=1, sort_keys=True) + "\n"
        _write_durable(meta_tmp, lambda w: w.write(text.encode()), created)
        _test_pause("publish")
        if fence is not None:
            fenced = True
            fence()
            fenced = False
        _publish(tmp, path, created)
        _test_pause("sidecar")
        _publish(meta_tmp, info.meta_path, created)
        return info
    except BaseException as e:
        for p in reversed(created):  # sidecar first: a half-removed checkpoint is never listed
            with contextlib.suppress(OSError):  # best effort; the original error matters more
                os.unlink(p)
        if isinstance(e, CheckpointError) or not isinstance(e, Exception) or fenced:
            raise
        raise CheckpointError(f"writing checkpoint {path} failed: {type(e).__name__}: {e}") from e


def clean_temp_files(directory: str | os.PathLike[str], older_than_s: float = 0) -> list[str]:
    """Remove ``.tmp-*`` files not modified for ``older_than_s`` seconds; return their sorted paths. Use a generous
    ``older_than_s`` while another process may write there (a writer that loses its temp file fails cleanly)."""
    removed: list[str] = []
    for p in sorted(glob.glob(os.path.join(glob.escape(os.fspath(directory)), TMP_PREFIX + "*"))):
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime >= older_than_s:
                os.unlink(p)
                removed.append(p)
    return removed


def _parse_sidecar(meta_path: str) -> CheckpointInfo:
    """Read and validate one sidecar; CorruptCheckpointError naming what is wrong."""
    try:
        with open(meta_path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"sidecar {meta_path}: unreadable or malformed JSON: {e}"
        ) from e
    d = d if isinstance(d, dict) else {}
    ints = all(type(d.get(k)) is int and d[k] >= 0 for k in ("step", "generation", "rank", "size"))
    name = checkpoint_name(d["step"], d["generation"], d["rank"]) if ints else "?"
    problem = next(
        (
            why
            for bad, why in (
                (d.get("format") != CHECKPOINT_FORMAT, f"not a {CHECKPOINT_FORMAT} sidecar"),
                (
                    d.get("version") != CHECKPOINT_FORMAT_VERSION,
                    f"unsupported format version {d.get('version')!r}",
                ),
                (not ints, "step, generation, rank or size is not a non-negative int"),
                (
                    not re.fullmatch(r"[0-9a-f]{64}", str(d.get("sha256"))),
                    "field 'sha256' is not a sha256 hex digest",
                ),
                (not isinstance(d.get("meta"), dict), "field 'meta' is not an object"),
                (
                    d.get("file") != name or os.path.basename(meta_path) != name + ".json",
                    f"names {d.get('file')!r} but its fields describe {name}",
                ),
            )
            if bad
        ),
        None,
    )
    if problem:
        raise CorruptCheckpointError(f"sidecar {meta_path}: {problem}")
    return CheckpointInfo(
        path=meta_path[: -len(".json")],
        meta_path=meta_path,
        step=d["step"],
        generation=d["generation"],
        rank=d["rank"],
        sha256=d["sha256"],
        size=d["size"],
        meta=d["meta"],
        created=str(d.get("created", "")),
    )


def list_checkpoints(directory: str | os.PathLike[str]) -> CheckpointList:
    """The published checkpoints in ``directory``, sorted by (step, generation, rank). Cheap: reads sidecars and
    stats data files, never hashes, removes nothing. Malformed or inconsistent sidecars, missing data files, size
    mismatches and data files without sidecar (interrupted writes) go to the result's ``problems``."""
    out = CheckpointList()
    out.problems = []
    try:
        names = set(os.listdir(directory))
    except FileNotFoundError:
        return out
    for n in sorted(names):
        p = os.path.join(os.fspath(directory), n)
        if _NAME_RE.match(n) and n + ".json" not in names:
            out.problems.append((p, "data file without sidecar (interrupted write?)"))
        if not (n.endswith(".json") and _NAME_RE.match(n[: -len(".json")])):
            continue
        try:
            info = _parse_sidecar(p)
            if (size := os.stat(info.path).st_size) != info.size:
                raise CorruptCheckpointError(
                    f"size mismatch: {info.path} has {size} bytes, sidecar says {info.size}"
                )
            out.append(info)
        except CorruptCheckpointError as e:
            out.problems.append((p, str(e)))
        except FileNotFoundError:
            out.problems.append((p, f"data file {info.path} is missing"))
    out.sort(key=lambda i: (i.step, i.generation, i.rank, i.path))
    return out


@contextlib.contextmanager
def _open_checked(
    path: str, sha256s: list[tuple[str, str]], size: int | None
) -> Iterator[BinaryIO]:
    """Open ``path``, hash it in 1 MiB chunks and yield it rewound (so what the caller reads is what was hashed);
    CorruptCheckpointError if it is missing, empty, or differs from ``size`` or any of ``sha256s``."""
    try:
        f = open(path, "rb")
    except (
        OSError
    ) as e:  # a missing file is a corrupt checkpoint; EACCES, EIO... are not the file's fault
        raise (CorruptCheckpointError if isinstance(e, FileNotFoundError) else CheckpointError)(
            f"{path}: {e}"
        ) from e
    with f:
        h, n = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
        if n == 0:
            raise CorruptCheckpointError(f"{path} is empty")
        if size is not None and n != size:
            raise CorruptCheckpointError(
                f"{path}: size mismatch: {n} bytes, expected {size} (truncated?)"
            )
        for source, want in sha256s:
            if h.hexdigest() != want.lower():
                raise CorruptCheckpointError(
                    f"{path}: sha256 mismatch: file {h.hexdigest()}, {source} {want}"
                )
        f.seek(0)
        yield f


def verify(info: CheckpointInfo) -> None:
    """Check ``info``'s data file against its recorded size and sha256 (streamed), then scan its pickle statically
    (nothing runs) for globals ``weights_only`` refuses, so :func:`select_checkpoint` never picks a file that cannot
    be loaded. Raises :class:`CorruptCheckpointError`, or :class:`UnsafeCheckpointError` for the latter."""
    with _open_checked(info.path, [("sidecar", info.sha256)], info.size) as f:
        try:
            unsafe = _unsafe_globals(f)
        except Exception as e:
            raise CorruptCheckpointError(
                f"{info.path} is not a readable torch checkpoint: {e}"
            ) from e
    if unsafe:
        raise UnsafeCheckpointError(
            f"{info.path} needs globals weights_only refuses: {sorted(unsafe)}"
        )


def load_checkpoint(
    path_or_info: str | os.PathLike[str] | CheckpointInfo,
    *,
    expected_sha256: str | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """Verify a checkpoint's size and sha256, then ``torch.load(weights_only=True)`` it. The checksum comes from
    the sidecar (the info given, or ``<path>.json``) and/or ``expected_sha256``: the file must match each; with none
    the load is refused. Hashing and loading read the same open file. Raises :class:`CorruptCheckpointError`
    (missing, empty, truncated, altered, undecodable) or :class:`UnsafeCheckpointError`."""
    info = path_or_info if isinstance(path_or_info, CheckpointInfo) else None
    path = info.path if info is not None else os.fspath(path_or_info)  # type: ignore[arg-type]
    if info is None and os.path.lexists(path + ".json"):
        try:
            info = _parse_sidecar(path + ".json")
        except CorruptCheckpointError:
            if expected_sha256 is None:
                raise
    sha256s = [("sidecar", info.sha256)] if info is not None else []
    sha256s += [("expected_sha256", expected_sha256)] if expected_sha256 is not None else []
    if not sha256s:
        raise CheckpointError(
            f"refusing to load {path}: no sidecar and no expected_sha256 to verify it against"
        )
    with _open_checked(path, sha256s, info.size if info is not None else None) as f:
        try:
            state = torch.load(f, weights_only=True, map_location=map_location, mmap=False)
        except (
            pickle.UnpicklingError
        ) as e:  # torch's message advises weights_only=False: keep only the why
            why = re.search(r"WeightsUnpickler error: ([^\n]*)", str(e))
            raise UnsafeCheckpointError(
                f"{path} was refused by the weights-only unpickler (it needs code "
                f"execution to load; nothing was run): {why[1] if why else e}"
            ) from e
        except Exception as e:
            raise CorruptCheckpointError(
                f"{path} cannot be deserialised: {type(e).__name__}: {e}"
            ) from e
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(state).__qualname__}, not a state dict")
    return state


def select_checkpoint(
    infos: list[CheckpointInfo],
    *,
    min_grade: int,
    before_step: int | None,
    min_steps_back: int = 0,
    verify_fn: Callable[[CheckpointInfo], None] = verify,
) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]:
    """The newest (step, then generation) checkpoint with grade >= ``min_grade`` (ungraded never qualify), step <=
    ``before_step - min_steps_back`` (no bound if ``before_step`` is None) and passing ``verify_fn`` (a
    :class:`CheckpointError` from it falls back to older ones; other errors propagate); plus ``[(skipped, reason)]``
    for each newer one passed over, for the journal. Pure apart from ``verify_fn``. Pass it one rank's checkpoints.
    """
    if min_steps_back < 0 or (before_step is None and min_steps_back):
        raise ValueError(f"min_steps_back={min_steps_back} must be >= 0, and 0 without before_step")
    limit = None if before_step is None else before_step - min_steps_back
    skipped: list[tuple[CheckpointInfo, str]] = []
    for info in sorted(infos, key=lambda i: (i.step, i.generation, i.rank, i.path), reverse=True):
        if limit is not None and info.step > limit:
            skipped.append(
                (
                    info,
                    f"step {info.step} > {limit} = before_step - min_steps_back {min_steps_back}",
                )
            )
        elif info.grade is None or info.grade < min_grade:
            skipped.append(
                (
                    info,
                    f"grade {info.grade} < min_grade {min_grade}"
                    if info.grade is not None
                    else "ungraded (no integer 'grade' in meta)",
                )
            )
        else:
            try:
                verify_fn(info)
            except CheckpointError as e:
                skipped.append((info, f"failed verification: {e}"))
                continue
            return info, skipped
    return None, skipped
