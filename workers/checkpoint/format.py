"""What a checkpoint looks like on disk. Torch-free.

A replicated checkpoint (one rank's ``torch.save``) is two files in one directory (a sharded one,
a ``torch.distributed.checkpoint`` directory with a commit marker, is described in
:mod:`.commit`; both are a :class:`CheckpointInfo`):

* the data file ``ckpt-step{step:08d}-gen{generation:03d}-rank{rank}.pt``, a ``torch.save`` zip
  that loads with ``weights_only=True``;
* its sidecar ``<data file>.json``, a JSON object with the fields ``format``
  (:data:`CHECKPOINT_FORMAT`), ``version`` (:data:`CHECKPOINT_FORMAT_VERSION`), ``file`` (the data
  file's name), ``step``, ``generation``, ``rank``, ``sha256`` and ``size`` (of the data file),
  ``created`` (ISO 8601, UTC) and ``meta`` (the writer's JSON metadata; ``meta["grade"]`` is the
  checkpoint's grade).

A checkpoint exists once its sidecar does: the writer publishes the sidecar last. While a writer
works, its files are named ``.tmp-<final name>-<pid>`` (:data:`TMP_PREFIX`).

This module holds the names, the sidecar's fields and their validation, :class:`CheckpointInfo`
(one checkpoint as its sidecar describes it), :class:`CheckpointList` and the error classes. It
reads sidecars but never data files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from ..contract.messages import too_deep
from .storage import TMP_PREFIX as TMP_PREFIX
from .storage import Storage, storage_for

CHECKPOINT_FORMAT = "spikeguard-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
SIDECAR_SUFFIX = ".json"

_DATA_NAME_RE = re.compile(r"^ckpt-step(\d+)-gen(\d+)-rank(\d+)\.pt$")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_INT_FIELDS = ("step", "generation", "rank", "size")

MAX_SIDECAR_BYTES = 1 << 20
"""A sidecar larger than this is refused unread (a real one is a few KiB)."""
MAX_SIDECAR_DEPTH = 64
"""A sidecar nesting lists and objects deeper than this is refused (a real one nests 4 deep)."""
MAX_FIELD_INT = 2**53
"""The largest step, generation, rank or size a sidecar may record."""


class CheckpointError(Exception):
    """A checkpoint could not be written, found or loaded."""


class CorruptCheckpointError(CheckpointError):
    """The data file is missing, empty, truncated, altered (size or sha256 mismatch), or cannot
    be decoded; or the sidecar is."""


class UnsafeCheckpointError(CheckpointError):
    """The data file needs something the weights-only unpickler refuses (e.g. a malicious pickle's
    globals); nothing was run."""


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
    kind: str = "replicated"
    """``"replicated"``: one ``torch.save`` file and its sidecar (``path`` the file, ``meta_path``
    the sidecar). ``"sharded"``: a ``torch.distributed.checkpoint`` directory (``path`` the
    directory, ``meta_path`` its commit marker, ``sha256`` the marker's own checksum, ``size``
    the bytes of every file it lists, ``rank`` 0); see :mod:`.commit`."""
    world_size: int = 1
    """How many ranks wrote it (1 for a replicated checkpoint)."""
    files: tuple[tuple[str, str, int], ...] = dataclasses.field(
        default=(), hash=False, compare=False
    )
    """A sharded checkpoint's files, as its commit marker lists them: (name, sha256, size)."""

    @property
    def grade(self) -> int | None:
        """``meta["grade"]`` (the minimum grade over layers) as an int 0..7.

        None if absent or not a grade: a bool, a string, NaN, 6.5, 8, 1e308 and a 400-digit
        integer are not. An integral float 0.0..7.0 is (``write_checkpoint`` keeps a grade
        given as a numpy float as a float).
        """
        g = self.meta.get("grade")
        if isinstance(g, bool):
            return None
        if isinstance(g, int) and 0 <= g <= 7:
            return g
        if isinstance(g, float) and g.is_integer() and 0 <= g <= 7:
            return int(g)
        return None


@dataclasses.dataclass(frozen=True)
class Incomplete:
    """A save that never finished (or has not finished yet): a sharded checkpoint directory
    without a commit marker, or a replicated data file without its sidecar."""

    path: str
    step: int
    generation: int
    kind: str
    """``"sharded"`` or ``"replicated"``."""
    size: int = 0
    """Bytes on disk (what removing it frees)."""


class CheckpointList(list[CheckpointInfo]):
    """:func:`~.choose.list_checkpoints`'s result.

    ``problems`` holds (path, reason) for each file that was skipped; ``incomplete`` the saves
    among them that never finished (each also in ``problems``).
    """

    problems: list[tuple[str, str]]
    incomplete: list[Incomplete]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.problems = []
        self.incomplete = []


def checkpoint_name(step: int, generation: int, rank: int = 0) -> str:
    """The data file name of a checkpoint."""
    return f"ckpt-step{step:08d}-gen{generation:03d}-rank{rank}.pt"


def parse_data_name(name: str) -> tuple[int, int, int] | None:
    """(step, generation, rank) of a data file name, or None if ``name`` is not one."""
    match = _DATA_NAME_RE.match(name)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3])


def is_data_name(name: str) -> bool:
    """Whether ``name`` (a base name) is shaped like a checkpoint's data file name."""
    return _DATA_NAME_RE.match(name) is not None


def is_sidecar_name(name: str) -> bool:
    """Whether ``name`` (a base name) is shaped like a checkpoint's sidecar name."""
    if not name.endswith(SIDECAR_SUFFIX):
        return False
    return is_data_name(name[: -len(SIDECAR_SUFFIX)])


def sidecar_text(info: CheckpointInfo) -> str:
    """The sidecar file's content for ``info`` (sorted keys, one field a line)."""
    fields: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_FORMAT_VERSION,
        "file": os.path.basename(info.path),
    }
    for key, value in dataclasses.asdict(info).items():
        if key not in ("path", "meta_path", "kind", "world_size", "files"):
            fields[key] = value
    return json.dumps(fields, indent=1, sort_keys=True) + "\n"


def header_problem(
    fields: dict[str, Any], fmt: str, version: int, int_fields: tuple[str, ...], what: str
) -> str | None:
    """What is wrong with the format, version and integer fields of a decoded sidecar or commit
    marker (``what`` names it), or None."""
    if fields.get("format") != fmt:
        return f"not a {fmt} {what}"
    if fields.get("version") != version:
        return f"unsupported format version {fields.get('version')!r}"
    for key in int_fields:
        value = fields.get(key)
        if type(value) is not int or not 0 <= value <= MAX_FIELD_INT:
            names = ", ".join(int_fields[:-1]) + f" or {int_fields[-1]}"
            return f"{names} is not an int in 0..2^53"
    return None


def _sidecar_problem(fields: dict[str, Any], meta_path: str) -> str | None:
    """What is wrong with a sidecar's decoded ``fields``, or None if nothing is."""
    problem = header_problem(
        fields, CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, _INT_FIELDS, "sidecar"
    )
    if problem is not None:
        return problem
    if not _SHA256_RE.fullmatch(str(fields.get("sha256"))):
        return "field 'sha256' is not a sha256 hex digest"
    if not isinstance(fields.get("meta"), dict):
        return "field 'meta' is not an object"
    name = checkpoint_name(fields["step"], fields["generation"], fields["rank"])
    if fields.get("file") != name or os.path.basename(meta_path) != name + SIDECAR_SUFFIX:
        return f"names {fields.get('file')!r} but its fields describe {name}"
    return None


def decode_json(raw: bytes, what: str, max_depth: int) -> dict[str, Any]:
    """``raw`` (UTF-8 JSON) as a dict (anything else: ``{}``, which the caller's checks refuse).

    ``what`` names it in errors. Raises :class:`CorruptCheckpointError` for malformed JSON or
    JSON nested deeper than ``max_depth``.
    """
    try:
        fields = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{what}: unreadable or malformed JSON: {type(e).__name__}: {e}"
        ) from None
    if too_deep(fields, max_depth):
        raise CorruptCheckpointError(f"{what}: nested more than {max_depth} levels")
    return fields if isinstance(fields, dict) else {}


def read_sidecar(meta_path: str, *, storage: Storage | None = None) -> CheckpointInfo:
    """Read and validate the sidecar at ``meta_path`` (in ``storage``, by default
    :func:`~.storage.storage_for` it); its data file is not looked at.

    Raises :class:`CorruptCheckpointError` naming what is wrong: unreadable (missing, a symlink, a
    FIFO or anything but a regular file, EACCES...: see :meth:`.storage.Storage.read_bytes`; never
    blocks), larger than :data:`MAX_SIDECAR_BYTES`, malformed JSON, nested deeper than
    :data:`MAX_SIDECAR_DEPTH`, another format or version, a bad field, or fields that describe
    another file name.
    """
    storage = storage or storage_for(meta_path)
    try:
        raw = storage.read_bytes(meta_path, MAX_SIDECAR_BYTES + 1)
    except OSError as e:
        raise CorruptCheckpointError(f"sidecar {meta_path}: unreadable: {e}") from e
    if len(raw) > MAX_SIDECAR_BYTES:
        raise CorruptCheckpointError(
            f"sidecar {meta_path}: larger than {MAX_SIDECAR_BYTES} bytes, not read"
        )
    fields = decode_json(raw, f"sidecar {meta_path}", MAX_SIDECAR_DEPTH)
    problem = _sidecar_problem(fields, meta_path)
    if problem is not None:
        raise CorruptCheckpointError(f"sidecar {meta_path}: {problem}")
    return CheckpointInfo(
        path=meta_path[: -len(SIDECAR_SUFFIX)],
        meta_path=meta_path,
        step=fields["step"],
        generation=fields["generation"],
        rank=fields["rank"],
        sha256=fields["sha256"],
        size=fields["size"],
        meta=fields["meta"],
        created=str(fields.get("created", "")),
    )
