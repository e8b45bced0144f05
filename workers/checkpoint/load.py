"""Loading a checkpoint on a rank: verify its bytes first, then unpickle them safely. Needs torch.

:func:`load_checkpoint` hashes the data file against its sidecar and/or a checksum the caller was
given (the supervisor's resume plan carries one), then unpickles the same open file with
``torch.load(weights_only=True)``: the weights-only unpickler is the real guard against a
malicious pickle, whatever :func:`~.choose.verify` predicted. The files are read through their
:class:`~.storage.Storage`.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch

from .format import (
    SIDECAR_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    read_sidecar,
)
from .integrity import open_checked
from .storage import storage_for

# torch's refusal message ends by advising weights_only=False; only its first line says why.
_REFUSAL_RE = re.compile(r"WeightsUnpickler error: ([^\n]*)")


def _sidecar_for(path: str, expected_sha256: str | None) -> CheckpointInfo | None:
    """The sidecar next to ``path``, if there is one.

    A corrupt sidecar raises :class:`CorruptCheckpointError`, unless ``expected_sha256`` is given:
    then it is ignored and the caller's checksum decides.
    """
    if not storage_for(path).exists(path + SIDECAR_SUFFIX):
        return None
    try:
        return read_sidecar(path + SIDECAR_SUFFIX)
    except CorruptCheckpointError:
        if expected_sha256 is None:
            raise
        return None


def load_checkpoint(
    path_or_info: str | os.PathLike[str] | CheckpointInfo,
    *,
    expected_sha256: str | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """Verify a checkpoint's size and sha256, then ``torch.load(weights_only=True)`` it.

    The checksum comes from the sidecar (the :class:`CheckpointInfo` given, or ``<path>.json``)
    and/or ``expected_sha256``: the file must match each; with neither, the load is refused.
    Hashing and loading read the same open file.

    Raises :class:`CorruptCheckpointError` (missing, empty, truncated, altered, undecodable, not a
    state dict), :class:`UnsafeCheckpointError` (refused by the weights-only unpickler; nothing
    was run), or :class:`CheckpointError` (no checksum, or the file cannot be read).
    """
    if isinstance(path_or_info, CheckpointInfo):
        info: CheckpointInfo | None = path_or_info
        path = path_or_info.path
    else:
        path = os.fspath(path_or_info)
        info = _sidecar_for(path, expected_sha256)
    sha256s: list[tuple[str, str]] = []
    size = None
    if info is not None:
        sha256s.append(("sidecar", info.sha256))
        size = info.size
    if expected_sha256 is not None:
        sha256s.append(("expected_sha256", expected_sha256))
    if not sha256s:
        raise CheckpointError(
            f"refusing to load {path}: no sidecar and no expected_sha256 to verify it against"
        )
    with open_checked(path, sha256s, size) as f:
        try:
            state = torch.load(f, weights_only=True, map_location=map_location, mmap=False)
        except pickle.UnpicklingError as e:
            why = _REFUSAL_RE.search(str(e))
            reason = why[1] if why else e
            raise UnsafeCheckpointError(
                f"{path} was refused by the weights-only unpickler (it needs code "
                f"execution to load; nothing was run): {reason}"
            ) from e
        except Exception as e:
            raise CorruptCheckpointError(
                f"{path} cannot be deserialised: {type(e).__name__}: {e}"
            ) from e
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(state).__qualname__}, not a state dict")
    return state
