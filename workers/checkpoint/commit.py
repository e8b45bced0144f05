"""A sharded checkpoint on disk: a ``torch.distributed.checkpoint`` directory and its commit
marker. Torch-free: the supervisor lists and verifies them with this.

One directory per saved step, beside the replicated checkpoints::

    checkpoints/ckpt-step00000550-gen002.dcp/
        __0_0.distcp              rank 0's shard (DCP's FileSystemWriter names them)
        __1_0.distcp              rank 1's shard
        .metadata                 DCP's global metadata: a pickle (see pickle_scan)
        spikeguard-commit.json    the commit marker, written last

Every rank writes its own shard; rank 0 writes ``.metadata`` (DCP does both). Then each rank
hashes its own files and the hashes are gathered on rank 0, which writes the commit marker: a
JSON object with ``format`` (:data:`SHARDED_FORMAT`), ``version``, ``directory`` (the
directory's name), ``step``, ``generation``, ``world_size``, ``created``, ``files`` (``{name:
{"sha256": ..., "size": ...}}`` for every file DCP wrote, ``.metadata`` included) and ``meta``
(``grade``: the worst rank's; ``ranks``: each rank's grade and loss; the worst rank's
``summary``...). It goes to a temp file, is fsynced, renamed to :data:`COMMIT_NAME` and the
directory is fsynced: a checkpoint exists once its marker does, and a directory without one is an
interrupted (or still running) save that is never selected.

A committed directory holds what its marker lists and nothing else
(:func:`refuse_unlisted`, part of every verification): an added file, symlink or subdirectory
would be read by the framework without ever being checked (a Trainer loads a
``pytorch_model_fsdp_0/`` it finds, follows a symlink out of the directory), so its checkpoint is
refused, naming what it holds. The only entries allowed beside the listed files are the ones
spikeguard itself puts there (:func:`expected_unlisted`): the marker, and the temp file the
marker is published through. Nothing else writes into a committed directory: DCP and the
Trainer have finished their save before the commit, a Trainer directory saved again is retracted
(its marker removed) first, and a removal takes the marker first, then the whole directory.

The checkpoint's checksum (:attr:`~.format.CheckpointInfo.sha256`, what a resume plan carries)
is the sha256 of the marker's bytes: the marker pins every other file.

The same marker also commits a training framework's own checkpoint directory: a Hugging Face
``Trainer``'s ``checkpoint-N`` (:data:`TRAINER_LAYOUT`). Its marker adds ``"layout":
"hf-trainer"``, names the directory ``checkpoint-{step}`` (the generation is in the marker, not
in the name), lists every file the Trainer wrote (no ``.metadata`` is required) and gives the
checkpoint the kind ``"hf-trainer"``. A DCP marker has no ``layout`` field.

Object storage (``s3://…``) fits the same layout: one prefix per checkpoint, the marker a single
object written last (a PUT is atomic there, so no rename is needed), and listing reads the
markers under the checkpoint prefix. Markers are read through :mod:`.storage`, so such a store
is one more :class:`~.storage.Storage`; see the README's "Checkpoints" section for what is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from .format import (
    MAX_FIELD_INT,
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    decode_json,
    header_problem,
)
from .storage import TMP_PREFIX, Entry, Kind, Storage, storage_for

SHARDED_FORMAT = "spikeguard-sharded-checkpoint"
SHARDED_FORMAT_VERSION = 1
SHARDED_SUFFIX = ".dcp"
COMMIT_NAME = "spikeguard-commit.json"
DCP_METADATA_NAME = ".metadata"

MAX_MARKER_BYTES = 16 << 20
"""A marker larger than this is refused unread (one for 4096 ranks is about 1 MiB)."""
MAX_MARKER_DEPTH = 64
"""A marker nesting lists and objects deeper than this is refused (a real one nests 5 deep)."""
MAX_FILES = 1 << 20
"""The most files a marker may list."""

TRAINER_LAYOUT = "hf-trainer"
"""The ``layout`` (and checkpoint kind) of a Hugging Face Trainer's ``checkpoint-N`` directory."""
TRAINER_PREFIX = "checkpoint-"
"""transformers' ``PREFIX_CHECKPOINT_DIR`` and its dash."""

_TRAINER_NAME_RE = re.compile(r"^checkpoint-(\d{1,15})$")
_DIR_NAME_RE = re.compile(r"^ckpt-step(\d+)-gen(\d+)\.dcp$")
_FILE_NAME_RE = re.compile(r"^(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]{0,250})$")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_INT_FIELDS = ("step", "generation", "world_size")
_MARKER_TEMP_RE = re.compile(re.escape(f"{TMP_PREFIX}{COMMIT_NAME}-") + r"\d{1,10}")
"""The marker's temp name, :func:`~.storage.temp_name` of it (``-<pid>``)."""
MAX_NAMED_UNLISTED = 5
"""How many unlisted entries a refusal names (then how many more there are)."""


def sharded_name(step: int, generation: int) -> str:
    """The directory name of the sharded checkpoint of ``step`` written by ``generation``."""
    return f"ckpt-step{step:08d}-gen{generation:03d}{SHARDED_SUFFIX}"


def parse_sharded_name(name: str) -> tuple[int, int] | None:
    """(step, generation) of a sharded checkpoint's directory name, or None if it is not one."""
    match = _DIR_NAME_RE.match(name)
    if match is None:
        return None
    return int(match[1]), int(match[2])


def parse_trainer_name(name: str) -> int | None:
    """The step of a Trainer checkpoint directory's name (``checkpoint-N``), or None."""
    match = _TRAINER_NAME_RE.match(name)
    return None if match is None else int(match[1])


def is_committed_dir_name(name: str) -> bool:
    """Whether ``name`` is a directory a commit marker may commit (sharded or Trainer)."""
    return parse_sharded_name(name) is not None or parse_trainer_name(name) is not None


def is_sharded_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a sharded checkpoint (by its last component; nothing is read)."""
    return parse_sharded_name(os.path.basename(os.path.normpath(os.fspath(path)))) is not None


def valid_file_name(name: str) -> bool:
    """Whether a marker may list ``name``: a plain name in the directory (no path, not the
    marker itself)."""
    return _FILE_NAME_RE.match(name) is not None and name != COMMIT_NAME


def expected_unlisted(name: str, kind: Kind) -> bool:
    """Whether a committed directory may hold the entry ``name`` (of kind ``kind``) although
    its marker does not list it: the marker itself, or the regular file it is published
    through (``.tmp-spikeguard-commit.json-<pid>``: there for a moment during the publication,
    and left behind for good when the publisher died between the link and the unlink). The
    whole list: nothing else is written into a committed directory (see the module
    docstring)."""
    if name == COMMIT_NAME:
        return True
    return kind == "file" and _MARKER_TEMP_RE.fullmatch(name) is not None


_EMPTY_DCP_BUCKET_RE = re.compile(r"__\d{1,6}_\d{1,6}\.distcp")


def _legacy_empty_bucket(entry: Entry, info: CheckpointInfo) -> bool:
    """An empty ``__R_K.distcp`` in a DCP directory: DCP creates one for a rank with nothing to
    write and never reads it (only files its ``.metadata`` names are read). Saves since
    ``ShardedWriter._drop_empty_buckets`` leave none, but directories committed before it hold
    them; refusing those would throw every older sharded checkpoint away at the upgrade."""
    return (
        info.kind != TRAINER_LAYOUT
        and entry.kind == "file"
        and entry.size == 0
        and _EMPTY_DCP_BUCKET_RE.fullmatch(entry.name) is not None
    )


def _entry_words(entry: Entry) -> str:
    """An entry as a refusal names it: ``name/`` for a directory, the kind for a non-file."""
    if entry.kind == "dir":
        return f"{entry.name}/"
    if entry.kind == "file":
        return entry.name
    return f"{entry.name} ({entry.what})"


def refuse_unlisted(info: CheckpointInfo, *, storage: Storage | None = None) -> None:
    """Refuse the committed directory ``info.path`` if it holds an entry its marker does not
    list (a file, a symlink, a subdirectory, anything) other than :func:`expected_unlisted`.

    Raises :class:`CorruptCheckpointError` naming the entries (``checkpoint-200 holds
    pytorch_model_fsdp_0/ which its commit marker does not list``), or
    :class:`CheckpointError` when the directory cannot be listed. ``storage``: where it is
    (default: :func:`~.storage.storage_for` it). A listed name that is not a regular file is
    left to the file checks, which refuse it.
    """
    storage = storage or storage_for(info.path)
    listed = {name for name, _, _ in info.files}
    try:
        entries = storage.listdir(info.path)
    except OSError as e:
        raise CheckpointError(f"{info.path}: cannot list the directory: {e}") from e
    extra = sorted(
        (
            e
            for e in entries
            if e.name not in listed
            and not expected_unlisted(e.name, e.kind)
            and not _legacy_empty_bucket(e, info)
        ),
        key=lambda e: e.name,
    )
    if not extra:
        return
    words = [_entry_words(e) for e in extra[:MAX_NAMED_UNLISTED]]
    if len(extra) > MAX_NAMED_UNLISTED:
        words.append(f"{len(extra) - MAX_NAMED_UNLISTED} more")
    named = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
    raise CorruptCheckpointError(
        f"{info.path} holds {named} which its commit marker does not list (added after the "
        "commit: never verified, so the checkpoint is refused)"
    )


def marker_text(
    *,
    directory_name: str,
    step: int,
    generation: int,
    world_size: int,
    files: dict[str, tuple[str, int]],
    meta: dict[str, Any],
    created: str,
    layout: str | None = None,
) -> str:
    """The commit marker's content (sorted keys). ``files``: {name: (sha256, size)}.
    ``layout``: None for a DCP directory, :data:`TRAINER_LAYOUT` for a Trainer's."""
    fields: dict[str, Any] = {
        "format": SHARDED_FORMAT,
        "version": SHARDED_FORMAT_VERSION,
        "directory": directory_name,
        "step": step,
        "generation": generation,
        "world_size": world_size,
        "created": created,
        "files": {name: {"sha256": sha, "size": size} for name, (sha, size) in files.items()},
        "meta": meta,
    }
    if layout is not None:
        fields["layout"] = layout
    return json.dumps(fields, indent=1, sort_keys=True, allow_nan=True) + "\n"


def _files_problem(files: Any, dcp: bool) -> str | None:
    """What is wrong with a marker's ``files`` object, or None."""
    if not isinstance(files, dict) or not files:
        return "field 'files' is not a non-empty object"
    if len(files) > MAX_FILES:
        return f"lists more than {MAX_FILES} files"
    if dcp and DCP_METADATA_NAME not in files:
        return f"does not list {DCP_METADATA_NAME}"
    for name, entry in files.items():
        if not valid_file_name(name):
            return f"lists {name!r}, which is not a plain file name in the checkpoint directory"
        if not isinstance(entry, dict):
            return f"file {name!r}: not an object"
        size = entry.get("size")
        if type(size) is not int or not 0 <= size <= MAX_FIELD_INT:
            return f"file {name!r}: size is not an int in 0..2^53"
        if not _SHA256_RE.fullmatch(str(entry.get("sha256"))):
            return f"file {name!r}: sha256 is not a sha256 hex digest"
    return None


def _marker_problem(fields: dict[str, Any], directory: str) -> str | None:
    """What is wrong with a marker's decoded ``fields``, or None if nothing is."""
    problem = header_problem(
        fields, SHARDED_FORMAT, SHARDED_FORMAT_VERSION, _INT_FIELDS, "commit marker"
    )
    if problem is not None:
        return problem
    if fields["world_size"] < 1:
        return "world_size is 0"
    if not isinstance(fields.get("meta"), dict):
        return "field 'meta' is not an object"
    layout = fields.get("layout")
    if layout not in (None, TRAINER_LAYOUT):
        return f"unknown layout {layout!r}"
    if layout is None:
        name = sharded_name(fields["step"], fields["generation"])
    else:
        name = f"{TRAINER_PREFIX}{fields['step']}"
    if fields.get("directory") != name or os.path.basename(directory) != name:
        return f"names {fields.get('directory')!r} but its fields describe {name}"
    return _files_problem(fields.get("files"), dcp=layout is None)


def read_marker_bytes(directory: str, *, storage: Storage | None = None) -> bytes:
    """The raw bytes of ``directory``'s commit marker (a regular file, never followed through a
    symlink, never blocking), read from ``storage`` (default: :func:`~.storage.storage_for`
    ``directory``). Raises ``FileNotFoundError`` when there is none (an incomplete save),
    :class:`CorruptCheckpointError` when it cannot be read or is too large."""
    path = os.path.join(directory, COMMIT_NAME)
    storage = storage or storage_for(directory)
    try:
        raw = storage.read_bytes(path, MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(f"commit marker {path}: unreadable: {e}") from e
    if len(raw) > MAX_MARKER_BYTES:
        raise CorruptCheckpointError(
            f"commit marker {path}: larger than {MAX_MARKER_BYTES} bytes, not read"
        )
    return raw


def parse_marker(directory: str, raw: bytes) -> CheckpointInfo:
    """The checkpoint the commit marker bytes ``raw`` of ``directory`` describe.

    Raises :class:`CorruptCheckpointError` naming what is wrong: malformed JSON, nested deeper
    than :data:`MAX_MARKER_DEPTH`, another format or version, a bad field, a file name that is
    not a plain name, no ``.metadata``, or fields that describe another directory name.
    """
    path = os.path.join(directory, COMMIT_NAME)
    fields = decode_json(raw, f"commit marker {path}", MAX_MARKER_DEPTH)
    problem = _marker_problem(fields, directory)
    if problem is not None:
        raise CorruptCheckpointError(f"commit marker {path}: {problem}")
    files = tuple(
        (name, entry["sha256"], entry["size"]) for name, entry in sorted(fields["files"].items())
    )
    return CheckpointInfo(
        path=directory,
        meta_path=path,
        step=fields["step"],
        generation=fields["generation"],
        rank=0,
        sha256=hashlib.sha256(raw).hexdigest(),
        size=sum(size for _, _, size in files),
        meta=fields["meta"],
        created=str(fields.get("created", "")),
        kind="sharded" if fields.get("layout") is None else TRAINER_LAYOUT,
        world_size=fields["world_size"],
        files=files,
    )


def read_marker(
    directory: str | os.PathLike[str], *, storage: Storage | None = None
) -> CheckpointInfo:
    """Read and validate ``directory``'s commit marker (in ``storage``, by default
    :func:`~.storage.storage_for` it); the other files are not looked at.

    Raises :class:`CorruptCheckpointError` (see :func:`parse_marker`; a missing marker too).
    """
    directory = os.fspath(directory)
    try:
        raw = read_marker_bytes(directory, storage=storage)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(
            f"{directory} has no commit marker (an interrupted or unfinished save): {e}"
        ) from None
    return parse_marker(directory, raw)
