"""Checkpoints with grades: atomic write, checksum, sidecar metadata, safe load, selection.

* :mod:`.storage`      where checkpoints live: the one interface for listing, reading,
                       publishing and removing them, a registry by URL scheme, POSIX behind it
* :mod:`.files`        POSIX: opening regular files only, never a symlink, never a blocking FIFO
* :mod:`.format`       what a checkpoint looks like on disk: names, the sidecar, the errors
* :mod:`.integrity`    a data file's bytes against its recorded size and sha256
* :mod:`.pickle_scan`  a static check of the pickle inside a data file, without torch
* :mod:`.choose`       list, verify and choose checkpoints (what the supervisor uses)
* :mod:`.commit`       a sharded checkpoint's directory and commit marker
* :mod:`.retention`    which checkpoints to keep and which to delete (pure)
* :mod:`.write`        atomic, never-overwriting writes; temp file clean-up (torch)
* :mod:`.load`         verified, weights-only loads (torch)
* :mod:`.dcp_write`    sharded saves with torch.distributed.checkpoint, and their commit (torch)
* :mod:`.dcp_load`     verified sharded loads, resharded to the current world size (torch)

Importing this package, :mod:`.storage`, :mod:`.format`, :mod:`.commit`, :mod:`.choose`,
:mod:`.remove` or :mod:`.retention` does not import torch: the supervisor lists, verifies,
chooses and deletes checkpoints on a head node without it. :func:`write_checkpoint`,
:func:`clean_temp_files`, :func:`load_checkpoint`, :class:`ShardedWriter`, :class:`PendingSave`
and :func:`load_sharded` are loaded on first use (PEP 562).
"""

from __future__ import annotations

from ..lazy import lazy_attributes
from .choose import list_checkpoints, on_lineage, select_checkpoint, verify
from .commit import is_sharded_path, read_marker, sharded_name
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

_LAZY = {
    "clean_temp_files": "write",
    "write_checkpoint": "write",
    "load_checkpoint": "load",
    "ShardedWriter": "dcp_write",
    "PendingSave": "dcp_write",
    "load_sharded": "dcp_load",
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
    "PendingSave",
    "ShardedWriter",
    "UnsafeCheckpointError",
    "checkpoint_name",
    "clean_temp_files",
    "is_sharded_path",
    "list_checkpoints",
    "load_checkpoint",
    "load_sharded",
    "on_lineage",
    "read_marker",
    "read_sidecar",
    "select_checkpoint",
    "sharded_name",
    "verify",
    "write_checkpoint",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
