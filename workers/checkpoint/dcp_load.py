"""Loading a sharded checkpoint into an FSDP2 (or any) model: verify first, then let DCP read
only what was verified, with nothing that runs code. Needs torch.

``torch.distributed.checkpoint`` trusts its files: it reads ``.metadata`` with a plain
``pickle.load`` (a crafted one runs code) and non-tensor values (optimizer hyper-parameters, a
step) with ``torch.load(weights_only=False)``. :func:`load_sharded` therefore, before
``dcp.load`` touches the directory:

1. reads the commit marker and checks its sha256 against the one the supervisor's plan carries,
   and that the directory holds nothing the marker does not list
   (:func:`.commit.refuse_unlisted`);
2. on every rank, reads ``.metadata`` once, checks its size and sha256 against the marker, scans
   it statically (:func:`.pickle_scan.scan_dcp_metadata`) and unpickles those same bytes with an
   unpickler that resolves only :data:`~.pickle_scan.DCP_METADATA_GLOBALS`; every file that
   metadata refers to must be one the marker lists;
3. checks the size and sha256 of every data file against the marker, the files shared out among
   the ranks (each file is read once by one rank), and agrees on the outcome (one gather);

then calls ``dcp.load`` with a reader that returns the verified metadata instead of unpickling
the file again, and a planner that loads non-tensor values with ``weights_only=True``. A refusal
raises :class:`CorruptCheckpointError` or :class:`UnsafeCheckpointError` on every rank, naming
the file; nothing of the checkpoint was unpickled by then.

The checkpoint may have been written by a different number of ranks: DCP reshards on load.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from . import commit, pickle_scan
from .dcp_storage import reader_for
from .dcp_write import ShardedWriter, describe_error, failures, quiet_single_process
from .format import (
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from .integrity import open_checked


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata is made of; refuses persistent ids."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in pickle_scan.DCP_METADATA_GLOBALS:
            raise UnsafeCheckpointError(f".metadata names {full}, which is not DCP metadata")
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(".metadata holds a persistent id")


class _VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader (through the object store's storage for its URL), except that its
    metadata is the one verified beforehand."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        reader_for(self, path)  # an object store's URL: read through its storage
        self._verified = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The verified metadata (never the file again, never a rank-local one)."""
        storage_meta = getattr(self._verified, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return self._verified


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Unpickle one non-tensor value with the weights-only unpickler."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()
            raise UnsafeCheckpointError(
                f"the value of {fqn} was refused by the weights-only unpickler (it needs code "
                f"execution to load; nothing was run): {first[0] if first else e}"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _read_metadata(info: CheckpointInfo) -> Metadata:
    """``.metadata``, checked against the marker, scanned, then unpickled from the same bytes."""
    entry = next(f for f in info.files if f[0] == commit.DCP_METADATA_NAME)
    path = os.path.join(info.path, commit.DCP_METADATA_NAME)
    try:
        with open_checked(path, [("commit marker", entry[1])], entry[2]) as f:
            data = f.read(pickle_scan.MAX_PICKLE_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: reading failed: {e}") from e
    pickle_scan.scan_dcp_metadata(data, path)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{path} cannot be decoded: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    listed = {name for name, _, _ in info.files}
    for item in metadata.storage_data.values():
        name = getattr(item, "relative_path", None)
        if not isinstance(name, str) or name not in listed:
            raise CorruptCheckpointError(
                f"{path} refers to {name!r}, which the commit marker does not list"
            )
    return metadata


def _verify_share(info: CheckpointInfo, rank: int, world_size: int) -> None:
    """Check this rank's share of the data files (every ``world_size``-th, from ``rank``)."""
    data_files = [f for f in info.files if f[0] != commit.DCP_METADATA_NAME]
    for name, sha256, size in data_files[rank::world_size]:
        path = os.path.join(info.path, name)
        try:
            with open_checked(path, [("commit marker", sha256)], size):
                pass
        except OSError as e:
            raise CheckpointError(f"{path}: reading failed: {e}") from e


def verify_for_load(
    path: str, expected_sha256: str | None, writer: ShardedWriter
) -> tuple[CheckpointInfo, Metadata]:
    """Steps 1 to 3 of the module docstring, on every rank; returns the marker and the verified
    metadata or raises the same refusal on every rank (a collective call)."""
    problem: BaseException | None = None
    info: CheckpointInfo | None = None
    metadata: Metadata | None = None
    try:
        info = commit.read_marker(path)
        if expected_sha256 is not None and info.sha256 != expected_sha256.lower():
            raise CorruptCheckpointError(
                f"commit marker {info.meta_path}: sha256 {info.sha256}, the plan expects "
                f"{expected_sha256}"
            )
        commit.refuse_unlisted(info)
        metadata = _read_metadata(info)
        _verify_share(info, writer.rank, writer.world_size)
    except CheckpointError as e:
        problem = e
    verdicts = writer.all_gather(
        None if problem is None else (type(problem).__name__, str(problem)), writer._groups()[0]
    )
    if problem is not None:
        raise problem
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            kind = UnsafeCheckpointError if verdict[0] == "UnsafeCheckpointError" else None
            raise (kind or CorruptCheckpointError)(f"rank {rank} refused {path}: {verdict[1]}")
    assert info is not None and metadata is not None
    return info, metadata


def _load_error(path: str, e: BaseException) -> CheckpointError:
    """What ``dcp.load`` raised, as a checkpoint error: a refusal by the weights-only planner on
    any rank (DCP gathers them into a ``CheckpointException``) stays an unsafe-checkpoint one."""
    for rank, failure in failures(e):
        if isinstance(failure, UnsafeCheckpointError):
            return UnsafeCheckpointError(f"{path}: rank {rank}: {failure}")
    return CheckpointError(f"loading {path} failed: {describe_error(e)}")


def _saved_keys(metadata: Metadata) -> set[str]:
    """The top-level keys of the saved state dict (``model``, ``optimizer``...)."""
    return {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}


def load_sharded(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    reset_optimizer: bool = False,
    expected_sha256: str | None = None,
    writer: ShardedWriter | None = None,
) -> CheckpointInfo:
    """Verify the sharded checkpoint at ``path``, then load it into ``model`` (and ``optimizer``,
    unless ``reset_optimizer``; and ``scheduler``, if it was saved). Every rank calls it.

    The checkpoint's state dict must have the keys ``model`` (and ``optimizer``, ``scheduler``),
    as :meth:`~spikeguard.workers.session.Session.save_checkpoint` documents. Returns the
    checkpoint's :class:`CheckpointInfo` (its ``step``). Raises :class:`CorruptCheckpointError`,
    :class:`UnsafeCheckpointError` or :class:`CheckpointError` on every rank.
    """
    writer = writer or ShardedWriter()
    info, metadata = verify_for_load(os.fspath(path), expected_sha256, writer)
    saved = _saved_keys(metadata)
    if "model" not in saved:
        raise CorruptCheckpointError(f"{path} holds no 'model' (it has {sorted(saved)})")
    with_optimizer = optimizer is not None and not reset_optimizer and "optimizer" in saved
    state: dict[str, Any] = {}
    if with_optimizer:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)  # type: ignore[arg-type]
    else:
        state["model"] = get_model_state_dict(model)
    if scheduler is not None and "scheduler" in saved:
        state["scheduler"] = scheduler.state_dict()
    control = writer._groups()[0]
    try:
        with quiet_single_process(writer.distributed):
            dcp.load(
                state,
                storage_reader=_VerifiedReader(info.path, metadata),
                planner=_WeightsOnlyPlanner(),
                process_group=control,
                no_dist=not writer.distributed,
            )
    except CheckpointError:
        raise
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _load_error(os.fspath(path), e) from e
    if with_optimizer:
        set_state_dict(
            model,
            optimizer,  # type: ignore[arg-type]
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
    else:
        set_model_state_dict(model, state["model"])
    if "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    return info
