"""What a checkpoint looks like on disk. Torch-free.

A checkpoint is two files in one directory:

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

CHECKPOINT_FORMAT = "spikeguard-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
SIDECAR_SUFFIX = ".json"
TMP_PREFIX = ".tmp-"

_DATA_NAME_RE = re.compile(r"^ckpt-step\d+-gen\d+-rank\d+\.pt$")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_INT_FIELDS = ("step", "generation", "rank", "size")


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

    @property
    def grade(self) -> int | None:
        """``meta["grade"]`` (the minimum grade over layers) as an int.

        None if absent or not an integer (a bool, a string, NaN and 6.5 are not).
        """
        g = self.meta.get("grade")
        if not isinstance(g, (int, float)) or isinstance(g, bool):
            return None
        if not float(g).is_integer():
            return None
        return int(g)


class CheckpointList(list[CheckpointInfo]):
    """:func:`~.select.list_checkpoints`'s result.

    ``problems`` holds (path, reason) for each file that was skipped.
    """

    problems: list[tuple[str, str]]


def checkpoint_name(step: int, generation: int, rank: int = 0) -> str:
    """The data file name of a checkpoint."""
    return f"ckpt-step{step:08d}-gen{generation:03d}-rank{rank}.pt"


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
        if key not in ("path", "meta_path"):
            fields[key] = value
    return json.dumps(fields, indent=1, sort_keys=True) + "\n"


def _sidecar_problem(fields: dict[str, Any], meta_path: str) -> str | None:
    """What is wrong with a sidecar's decoded ``fields``, or None if nothing is."""
    if fields.get("format") != CHECKPOINT_FORMAT:
        return f"not a {CHECKPOINT_FORMAT} sidecar"
    if fields.get("version") != CHECKPOINT_FORMAT_VERSION:
        return f"unsupported format version {fields.get('version')!r}"
    for key in _INT_FIELDS:
        value = fields.get(key)
        if type(value) is not int or value < 0:
            return "step, generation, rank or size is not a non-negative int"
    if not _SHA256_RE.fullmatch(str(fields.get("sha256"))):
        return "field 'sha256' is not a sha256 hex digest"
    if not isinstance(fields.get("meta"), dict):
        return "field 'meta' is not an object"
    name = checkpoint_name(fields["step"], fields["generation"], fields["rank"])
    if fields.get("file") != name or os.path.basename(meta_path) != name + SIDECAR_SUFFIX:
        return f"names {fields.get('file')!r} but its fields describe {name}"
    return None


def read_sidecar(meta_path: str) -> CheckpointInfo:
    """Read and validate the sidecar at ``meta_path``; its data file is not looked at.

    Raises :class:`CorruptCheckpointError` naming what is wrong: unreadable, malformed JSON, another
    format or version, a bad field, or fields that describe another file name.
    """
    try:
        with open(meta_path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"sidecar {meta_path}: unreadable or malformed JSON: {e}"
        ) from e
    if not isinstance(fields, dict):
        fields = {}
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
