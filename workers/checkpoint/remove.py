"""Deleting one checkpoint, so that it is never half there. Torch-free.

The file that makes a checkpoint exist goes first (a replicated checkpoint's sidecar, a sharded
one's commit marker), and the directory entry is made durable: from then on no listing offers it,
whatever happens to the rest. Then its data goes. Nothing is followed through a symlink; only a
name shaped like a checkpoint is touched. Every removal goes through the checkpoint's
:class:`~.storage.Storage`.
"""

from __future__ import annotations

import os

from . import commit
from .format import SIDECAR_SUFFIX, CheckpointError, parse_data_name
from .storage import Storage, storage_for


def remove_checkpoint(path: str, *, storage: Storage | None = None) -> None:
    """Delete the checkpoint at ``path``: a replicated data file (and its sidecar, first), or a
    sharded checkpoint's or a Trainer's committed directory (its commit marker first). A missing
    one is no error. ``storage``: where it is (default: :func:`~.storage.storage_for` ``path``).

    Raises :class:`CheckpointError` if ``path`` is not named like a checkpoint, or a sharded
    one is not a directory (a symlink is never followed); ``OSError`` if a removal fails.
    """
    name = os.path.basename(path)
    directory = os.path.dirname(path)
    storage = storage or storage_for(path)
    if commit.is_committed_dir_name(name):
        try:
            st = storage.stat(path)
        except FileNotFoundError:
            return
        if st.kind != "dir":
            raise CheckpointError(f"{path} is {st.what}, not a checkpoint directory")
        storage.remove_file(os.path.join(path, commit.COMMIT_NAME))
        storage.sync(path)
        storage.remove_tree(path)
        storage.sync(directory)
        return
    if parse_data_name(name) is None:
        raise CheckpointError(f"{path} is not named like a checkpoint; not removed")
    storage.remove_file(path + SIDECAR_SUFFIX)
    storage.sync(directory)
    storage.remove_file(path)
    storage.sync(directory)
