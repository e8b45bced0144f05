"""Checkpoints with grades: atomic write, checksum, sidecar metadata, safe load, selection.

* :mod:`.format`       what a checkpoint looks like on disk: names, the sidecar, the errors
* :mod:`.files`        opening regular files only: never a symlink, never a blocking FIFO
* :mod:`.integrity`    a data file's bytes against its recorded size and sha256
* :mod:`.pickle_scan`  a static check of the pickle inside a data file, without torch
* :mod:`.select`       list, verify and choose checkpoints (what the supervisor uses)
* :mod:`.write`        atomic, never-overwriting writes; temp file clean-up (torch)
* :mod:`.load`         verified, weights-only loads (torch)

Importing this package, :mod:`.format` or :mod:`.select` does not import torch: the supervisor
lists, verifies and chooses checkpoints on a head node without it. :func:`write_checkpoint`,
:func:`clean_temp_files` and :func:`load_checkpoint` are loaded on first use (PEP 562).
"""

from __future__ import annotations

from ..lazy import lazy_attributes
from .format import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    SIDECAR_SUFFIX,
    TMP_PREFIX,
    CheckpointError,
    CheckpointInfo,
    CheckpointList,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    checkpoint_name,
    read_sidecar,
)
from .select import list_checkpoints, on_lineage, select_checkpoint, verify

_LAZY = {
    "clean_temp_files": "write",
    "write_checkpoint": "write",
    "load_checkpoint": "load",
}

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_FORMAT_VERSION",
    "SIDECAR_SUFFIX",
    "TMP_PREFIX",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointList",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "checkpoint_name",
    "clean_temp_files",
    "list_checkpoints",
    "load_checkpoint",
    "on_lineage",
    "read_sidecar",
    "select_checkpoint",
    "verify",
    "write_checkpoint",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
