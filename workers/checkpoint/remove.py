"""Deleting one checkpoint, so that it is never half there. Torch-free.

The file that makes a checkpoint exist goes first (a replicated checkpoint's sidecar, a sharded
one's commit marker), and the directory entry is fsynced: from then on no listing offers it,
whatever happens to the rest. Then its data goes. Nothing is followed through a symlink; only a
name shaped like a checkpoint is touched.
"""

from __future__ import annotations

import os
import shutil
import stat

from . import commit
from .files import fsync_directory, kind
from .format import SIDECAR_SUFFIX, CheckpointError, parse_data_name


def _unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_checkpoint(path: str) -> None:
    """Delete the checkpoint at ``path``: a replicated data file (and its sidecar, first), or a
    sharded checkpoint's or a Trainer's committed directory (its commit marker first). A missing
    one is no error.

    Raises :class:`CheckpointError` if ``path`` is not named like a checkpoint, or a sharded
    one is not a directory (a symlink is never followed); ``OSError`` if a removal fails.
    """
    name = os.path.basename(path)
    directory = os.path.dirname(path)
    if commit.is_committed_dir_name(name):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path} is {kind(st.st_mode)}, not a checkpoint directory")
        _unlink_if_present(os.path.join(path, commit.COMMIT_NAME))
        fsync_directory(path)
        shutil.rmtree(path)
        fsync_directory(directory)
        return
    if parse_data_name(name) is None:
        raise CheckpointError(f"{path} is not named like a checkpoint; not removed")
    _unlink_if_present(path + SIDECAR_SUFFIX)
    fsync_directory(directory)
    _unlink_if_present(path)
    fsync_directory(directory)
