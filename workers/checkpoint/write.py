"""Writing checkpoints atomically, and cleaning up after writers that died. Needs torch.

:func:`write_checkpoint` writes the data file (a ``torch.save``) and then the sidecar (see
:mod:`.format`), each to a temp file ``.tmp-<final name>-<pid>`` that it fsyncs, then publishes
them under their final names without ever replacing a file (a hard link; a check and a rename
where the filesystem has no hard links), fsyncing the directory after each. The sidecar goes last:
a checkpoint exists once its sidecar does, so a writer killed at any point leaves either a whole
checkpoint or one that :func:`~.choose.list_checkpoints` reports as a problem, plus temp files
that :func:`clean_temp_files` removes. Other checkpoints are never touched. Every file operation
goes through the directory's :class:`~.storage.Storage`, the pickle scan of the temp file (by
torch) too: it reads the file the storage opens, so the directory may be an object store.

In the common data-parallel case rank 0 writes the replicated state and the others nothing;
``rank`` is in the name so that per-rank shards can come later.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import torch

from ..contract.messages import too_deep
from .format import (
    MAX_FIELD_INT,
    MAX_SIDECAR_BYTES,
    MAX_SIDECAR_DEPTH,
    SIDECAR_SUFFIX,
    TMP_PREFIX,
    CheckpointError,
    CheckpointInfo,
    UnsafeCheckpointError,
    checkpoint_name,
    sidecar_text,
)
from .storage import Storage, remove_quietly, storage_for, temp_name

# Values the weights-only unpickler loads as they are.
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
# Containers it loads; their items are checked one by one.
_CONTAINERS = (dict, collections.OrderedDict, collections.defaultdict, list, tuple, set)


def _unsafe_globals(path: str, storage: Storage) -> list[str]:
    """The globals in the ``torch.save`` file at ``path`` (in ``storage``) that ``weights_only``
    would refuse.

    Asks torch, so classes given to ``add_safe_globals`` count as safe; it reads the zip's
    directory and its pickle, not the tensors. Torch before 2.5 has no such scan: then nothing is
    reported.
    """
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None:
        return []
    with storage.open_read(path) as f:
        return scan(f)


def _safe_classes() -> set[type]:
    """The classes given to ``torch.serialization.add_safe_globals`` (none before torch 2.4)."""
    get_safe_globals = getattr(torch.serialization, "get_safe_globals", None)
    if get_safe_globals is None:
        return set()
    classes = set()
    for entry in get_safe_globals():
        if isinstance(entry, tuple):  # (class, "module.name")
            entry = entry[0]
        if isinstance(entry, type):
            classes.add(entry)
    return classes


def _prepare(obj: Any, where: str, safe: set[type]) -> Any:
    """``obj`` made loadable by the weights-only unpickler, or :class:`CheckpointError`.

    Numpy scalars become Python scalars, numeric numpy arrays tensors, defaultdicts dicts; leaves,
    containers of loadable values and the classes in ``safe`` pass. Anything else raises, naming
    ``where`` it is. Returns ``obj`` itself when nothing inside it changed.
    """
    kind = type(obj)
    if kind in _LEAVES or kind in safe:
        return obj
    if isinstance(obj, np.generic):
        return _prepare(obj.item(), where, safe)
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        return torch.tensor(obj)
    if kind not in _CONTAINERS:
        raise CheckpointError(
            f"{where}: {kind.__module__}.{kind.__qualname__} cannot be loaded with "
            "weights_only=True; store plain containers, scalars and tensors "
            "(or add_safe_globals the class)"
        )
    if isinstance(obj, dict):
        prepared = {}
        for key, value in obj.items():
            inner = f"{where}[{key!r}]"
            prepared[_prepare(key, inner, safe)] = _prepare(value, inner, safe)
        if kind is collections.defaultdict:
            return prepared
        if all(prepared[key] is obj[key] for key in obj):
            return obj
        return kind(prepared)
    items = [_prepare(value, f"{where}[{i}]", safe) for i, value in enumerate(obj)]
    if all(new is old for new, old in zip(items, obj)):
        return obj
    return kind(items)


def _json_default(value: Any) -> Any:
    """``json.dumps``'s fallback for ``meta``: one-element tensors and numpy scalars."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__qualname__} is not JSON serialisable")


class _HashingWriter:
    """A write-only wrapper of a buffered file that hashes and counts the bytes written.

    It keeps the OSError of a failed write in ``error``: torch's C++ writer turns it into an opaque
    RuntimeError, and the caller re-raises the real cause (ENOSPC, EFBIG...).
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        """Write all of ``data`` (a BufferedWriter writes everything or raises)."""
        view = memoryview(data).cast("B")
        try:
            self._f.write(view)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """Flush the underlying file's buffer."""
        self._f.flush()


def refusal(e: FileExistsError, final: str | None = None) -> CheckpointError:
    """The error of a write-once publication (of ``final``) that found ``e.filename`` there:
    ``final`` itself, or this process's temp file for it."""
    if final is not None and e.filename == final:
        return CheckpointError(f"refusing to overwrite existing {final}")
    return CheckpointError(
        f"temp file {e.filename} exists: the same checkpoint is being written concurrently, "
        "or a crashed writer left it (see clean_temp_files)"
    )


def _write_durable(
    path: str, write: Callable[[_HashingWriter], object], created: list[str]
) -> _HashingWriter:
    """Create ``path`` (never an existing one), fill it with ``write`` and make it durable.

    Appends ``path`` to ``created`` once it exists; returns the hashing writer.
    """
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(storage_for(path).create(path))
        except FileExistsError as e:
            raise refusal(e) from None
        created.append(path)
        writer = _HashingWriter(f)
        try:
            write(writer)
        except Exception:
            if writer.error is None:
                raise
            raise writer.error from None  # the real cause, not torch's rewording of it
    return writer


def _publish(tmp: str, final: str, created: list[str]) -> None:
    """Give the file ``tmp`` the name ``final``, never replacing an existing ``final``, durably
    (:meth:`.storage.Storage.publish`). Appends ``final`` to ``created``."""
    try:
        storage_for(final).publish(tmp, final)
    except FileExistsError as e:
        raise refusal(e, final) from None
    created.append(final)


def _check_arguments(state: Any, meta: Any, step: Any, generation: Any, rank: Any) -> None:
    """Raise :class:`CheckpointError` unless step, generation and rank are non-negative ints
    up to 2^53 (what a sidecar may record) and state and meta are dicts."""
    for number in (step, generation, rank):
        if type(number) is not int or not 0 <= number <= MAX_FIELD_INT:
            raise CheckpointError(
                "step, generation, rank must be non-negative ints up to 2^53: "
                f"{step!r}, {generation!r}, {rank!r}"
            )
    if not isinstance(state, dict) or not isinstance(meta, dict):
        raise CheckpointError(
            f"state and meta must be dicts, not {type(state).__name__}, {type(meta).__name__}"
        )


def _check_sidecar_limits(
    path: str, meta: dict[str, Any], step: int, generation: int, rank: int
) -> None:
    """Raise :class:`CheckpointError` if the sidecar would be one that
    :func:`~.choose.list_checkpoints` refuses: nested too deep, or too large (measured on a
    draft whose checksum and size are as long as they can be)."""
    name = os.path.basename(path)
    if too_deep(meta, MAX_SIDECAR_DEPTH - 1):  # meta is one level below the sidecar's top
        raise CheckpointError(f"meta for {name} is nested more than {MAX_SIDECAR_DEPTH - 1} levels")
    draft = CheckpointInfo(
        path=path,
        meta_path=path + SIDECAR_SUFFIX,
        step=step,
        generation=generation,
        rank=rank,
        sha256="0" * 64,
        size=MAX_FIELD_INT,
        meta=meta,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
    )
    n_bytes = len(sidecar_text(draft).encode())
    if n_bytes > MAX_SIDECAR_BYTES:
        raise CheckpointError(
            f"the sidecar of {name} would be {n_bytes} bytes, larger than the "
            f"{MAX_SIDECAR_BYTES} a listing reads: keep meta small"
        )


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
    """Write ``state`` as a new checkpoint in ``directory``; return its description.

    ``state`` holds tensors, dicts, lists, tuples, sets, scalars, strings, dtypes, devices and
    ``add_safe_globals`` classes (numpy values become scalars or tensors, defaultdicts dicts);
    anything else raises :class:`CheckpointError` before writing. ``meta`` must be JSON-able (NaN
    allowed); ``meta["grade"]`` is the checkpoint's grade.

    ``fence`` is called once, right before anything is published; if it raises, nothing is, and
    its exception propagates as it is. Any other failure raises :class:`CheckpointError` after
    removing all this call created; other checkpoints are never touched, an existing name never
    replaced.
    """
    _check_arguments(state, meta, step, generation, rank)
    directory = os.fspath(directory)
    storage = storage_for(directory)
    name = checkpoint_name(step, generation, rank)
    path = os.path.join(directory, name)
    try:
        taken = storage.exists(path) or storage.exists(path + SIDECAR_SUFFIX)
    except OSError as e:  # a store that cannot be reached: not "absent"
        raise CheckpointError(f"writing checkpoint {path} failed: {e}") from e
    if taken:
        raise CheckpointError(f"refusing to overwrite existing checkpoint {path}")
    try:
        state = _prepare(state, "state", _safe_classes())
        meta = json.loads(json.dumps(meta, default=_json_default, allow_nan=True))
    except RecursionError:
        raise CheckpointError(
            f"state or meta for {name} contains a reference cycle (or is nested too deep)"
        ) from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta for {name} is not JSON-serialisable: {e}") from e
    _check_sidecar_limits(path, meta, step, generation, rank)
    tmp = temp_name(path)
    meta_tmp = temp_name(path + SIDECAR_SUFFIX)
    created: list[str] = []  # everything this call created, removed on failure
    fenced = False  # True while ``fence`` runs: its exception is re-raised unchanged
    try:
        hashed = _write_durable(tmp, lambda w: torch.save(state, w), created)
        unsafe = _unsafe_globals(tmp, storage)
        if unsafe:
            raise UnsafeCheckpointError(
                f"{name} would need globals weights_only refuses: {sorted(unsafe)}"
            )
        info = CheckpointInfo(
            path=path,
            meta_path=path + SIDECAR_SUFFIX,
            step=step,
            generation=generation,
            rank=rank,
            sha256=hashed.sha.hexdigest(),
            size=hashed.size,
            meta=meta,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        )
        text = sidecar_text(info)
        _write_durable(meta_tmp, lambda w: w.write(text.encode()), created)
        if fence is not None:
            fenced = True
            fence()
            fenced = False
        _publish(tmp, path, created)
        _publish(meta_tmp, info.meta_path, created)
        return info
    except BaseException as e:
        for created_path in reversed(created):  # sidecar first: never a half-removed listing
            remove_quietly(storage, created_path)  # best effort; the original error matters more
        if isinstance(e, CheckpointError) or not isinstance(e, Exception) or fenced:
            raise
        raise CheckpointError(f"writing checkpoint {path} failed: {type(e).__name__}: {e}") from e


def clean_temp_files(directory: str | os.PathLike[str], older_than_s: float = 0) -> list[str]:
    """Remove the ``.tmp-*`` files in ``directory`` not modified for ``older_than_s`` seconds.

    Returns their sorted paths. Use a generous ``older_than_s`` while another process may write
    there (a writer that loses its temp file fails cleanly).
    """
    directory = os.fspath(directory)
    storage = storage_for(directory)
    try:
        entries = storage.listdir(directory)
    except OSError:
        return []
    removed: list[str] = []
    for entry in sorted(entries, key=lambda e: e.name):
        path = os.path.join(directory, entry.name)
        if not entry.name.startswith(TMP_PREFIX) or entry.kind != "file":
            continue
        if time.time() - entry.mtime >= older_than_s and storage.remove_file(path):
            removed.append(path)
    return removed
