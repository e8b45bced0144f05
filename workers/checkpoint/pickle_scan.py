"""A static check of the pickles in a checkpoint, without torch. Never runs them.

Two kinds of pickle are checked: the one inside a ``torch.save`` zip (:func:`scan_checkpoint`,
below), and the ``.metadata`` of a ``torch.distributed.checkpoint`` directory
(:func:`scan_dcp_metadata`: DCP reads it with a plain ``pickle.load``, so the allowlist there is
the exact set of classes torch 2.13's writer uses, :data:`DCP_METADATA_GLOBALS`, and the rank
unpickles it with an unpickler that resolves nothing else; see :mod:`.dcp_load`).

The real guard is on the rank: :func:`~.load.load_checkpoint` unpickles with
``torch.load(weights_only=True)``, whose unpickler implements a fixed set of opcodes and calls only
allowlisted globals. The supervisor, which must not import torch, still has to avoid choosing a
checkpoint that guard would refuse (or a malicious one), so :func:`~.choose.verify` runs this scan.
It reads the pickle's opcodes with :func:`pickletools.genops`, which decodes the byte stream and
nothing more: it imports no module, looks up no global and calls nothing.

Two rules; a pickle that breaks one is refused with :class:`UnsafeCheckpointError` naming the
culprit:

* every opcode is one the weights-only unpickler implements (:data:`ALLOWED_OPCODES`, the opcodes
  ``torch/_weights_only_unpickler.py`` handles; its ``Unpickler.load`` raises on any other).
  ``torch.save`` writes protocol 2, so everything it writes passes; refused are, for example,
  ``STACK_GLOBAL`` (a global whose name is computed on the stack), ``INST`` and ``OBJ`` (build
  any class), ``EXT1/2/4`` (the copyreg extension registry), ``PERSID`` (text persistent ids),
  and ``FRAME``, ``MEMOIZE``, ``SHORT_BINUNICODE``, ``BINBYTES``... (protocols 3 to 5);
* every ``GLOBAL`` names a ``"module.name"`` in :data:`ALLOWED_GLOBALS`, a fixed list of names
  torch's weights-only unpickler allows by default. The list leaves out the few it allows that
  ``torch.save`` never writes for a state dict (legacy tensor classes such as
  ``torch.FloatTensor``, and CUDA storage classes: a CUDA tensor's storage is pickled under its
  CPU class name with a location). Names the caller allowed with ``add_safe_globals`` are refused
  here: the supervisor has no such list.

A ``GLOBAL``'s name is read exactly as torch reads it: the two lines after the opcode, UTF-8,
joined by a dot. Protocol 2 writes builtins under their Python 2 module name, so ``__builtin__``
is read as ``builtins``, as torch does. Torch renames a few other Python 2 names as well; this
scan does not, which can only make it refuse more, never less.

The pickle is the zip entry ``<dir>/data.pkl``: there must be exactly one, in the directory of the
zip's first entry (where torch's reader looks for it), and no ``<dir>/constants.pkl`` (a
TorchScript archive, which ``torch.load(weights_only=True)`` refuses). A file that is not such a
zip, or a pickle ``pickletools`` cannot decode, is a :class:`CorruptCheckpointError`.

The scan is a necessary condition, not a sufficient one: it cannot see what the stack holds when
``REDUCE``, ``BUILD`` or ``BINPERSID`` run, which the weights-only unpickler also checks. It reads
the whole pickle into memory, as ``torch.load`` does, up to :data:`MAX_PICKLE_BYTES`.
"""

from __future__ import annotations

import pickletools
import zipfile
import zlib
from typing import BinaryIO

from .format import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

# The opcodes torch's weights-only Unpickler.load implements, by their pickletools names.
ALLOWED_OPCODES: frozenset[str] = frozenset(
    {
        # framing: the protocol header and the end
        "PROTO",
        "STOP",
        # globals and the three ways to apply them
        "GLOBAL",
        "REDUCE",
        "NEWOBJ",
        "BUILD",
        # the tensor storages, by persistent id
        "BINPERSID",
        # scalars and strings
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "BINFLOAT",
        "BINUNICODE",
        "SHORT_BINSTRING",
        # containers
        "MARK",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_LIST",
        "APPEND",
        "APPENDS",
        "EMPTY_DICT",
        "SETITEM",
        "SETITEMS",
        "EMPTY_SET",
        # the memo
        "BINPUT",
        "LONG_BINPUT",
        "BINGET",
        "LONG_BINGET",
    }
)

_BUILTIN_GLOBALS = (
    "_codecs.encode",  # bytes, in protocol 2
    "builtins.bytearray",
    "builtins.complex",
    "builtins.set",
    "collections.Counter",
    "collections.OrderedDict",
)

_TORCH_TYPES = (
    "torch.Size",
    "torch.Tensor",
    "torch.device",
    "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout",  # the layout of a sparse tensor
    "torch.storage.TypedStorage",
    "torch.storage.UntypedStorage",
)

_REBUILD_FUNCTIONS = (
    "torch._tensor._rebuild_from_type_v2",  # tensor subclasses, tensors with attributes
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_wrapper_subclass",
)

# The storage class a tensor's data is pickled under, one per dtype family.
_STORAGE_CLASSES = (
    "torch.BFloat16Storage",
    "torch.BoolStorage",
    "torch.ByteStorage",
    "torch.CharStorage",
    "torch.ComplexDoubleStorage",
    "torch.ComplexFloatStorage",
    "torch.DoubleStorage",
    "torch.FloatStorage",
    "torch.HalfStorage",
    "torch.IntStorage",
    "torch.LongStorage",
    "torch.QInt32Storage",
    "torch.QInt8Storage",
    "torch.QUInt2x4Storage",
    "torch.QUInt4x2Storage",
    "torch.QUInt8Storage",
    "torch.ShortStorage",
)

_DTYPES = (
    "torch.bfloat16",
    "torch.bits16",
    "torch.bits1x8",
    "torch.bits2x4",
    "torch.bits4x2",
    "torch.bits8",
    "torch.bool",
    "torch.complex128",
    "torch.complex32",
    "torch.complex64",
    "torch.float16",
    "torch.float32",
    "torch.float4_e2m1fn_x2",
    "torch.float64",
    "torch.float8_e4m3fn",
    "torch.float8_e4m3fnuz",
    "torch.float8_e5m2",
    "torch.float8_e5m2fnuz",
    "torch.float8_e8m0fnu",
    "torch.int1",
    "torch.int2",
    "torch.int3",
    "torch.int4",
    "torch.int5",
    "torch.int6",
    "torch.int7",
    "torch.int8",
    "torch.int16",
    "torch.int32",
    "torch.int64",
    "torch.qint32",
    "torch.qint8",
    "torch.quint2x4",
    "torch.quint4x2",
    "torch.quint8",
    "torch.uint1",
    "torch.uint2",
    "torch.uint3",
    "torch.uint4",
    "torch.uint5",
    "torch.uint6",
    "torch.uint7",
    "torch.uint8",
    "torch.uint16",
    "torch.uint32",
    "torch.uint64",
)

_QSCHEMES = (
    "torch.per_channel_affine",
    "torch.per_channel_affine_float_qparams",
    "torch.per_channel_symmetric",
    "torch.per_tensor_affine",
    "torch.per_tensor_symmetric",
)

# The globals a checkpoint's pickle may name, as "module.name".
ALLOWED_GLOBALS: frozenset[str] = frozenset(
    _BUILTIN_GLOBALS + _TORCH_TYPES + _REBUILD_FUNCTIONS + _STORAGE_CLASSES + _DTYPES + _QSCHEMES
)

# -- torch.distributed.checkpoint's .metadata ------------------------------------------------

DCP_METADATA_OPCODES: frozenset[str] = (ALLOWED_OPCODES - {"BINPERSID", "SHORT_BINSTRING"}) | {
    "FRAME",  # protocol 4's framing
    "STACK_GLOBAL",  # only with literal operands, see _scan
    "MEMOIZE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "SHORT_BINBYTES",
    "BINBYTES",
    "ADDITEMS",
    "FROZENSET",
}
"""The opcodes a DCP ``.metadata`` may use: what ``pickle.dump`` (protocol 4) writes for plain
data and objects (the weights-only set, less persistent ids and Python 2 strings, plus protocol
4's framing, memo and string opcodes). Refused, for example: ``INST``/``OBJ`` (build a class
named inline), ``NEWOBJ_EX``, ``EXT1/2/4``, ``PERSID``/``BINPERSID``, out-of-band buffers, stack
juggling (``POP``, ``DUP``) and the text opcodes of protocol 0."""

_DCP_METADATA_CLASSES = (
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
)

# torch 2.13's DCP refuses to plan the sub-byte integers, the bit types and the quantized types.
_NOT_IN_DCP = frozenset(
    [f"torch.{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)]
    + [d for d in _DTYPES if d.startswith(("torch.bits", "torch.qint", "torch.quint"))]
)
_DCP_DTYPES = tuple(d for d in _DTYPES if d not in _NOT_IN_DCP)

DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    _DCP_METADATA_CLASSES
    + _DCP_DTYPES
    + (
        "pathlib.PosixPath",  # StorageMeta.checkpoint_id: the directory it was written to
        "torch.Size",
        "torch.serialization._get_layout",  # TensorProperties.layout, by name
    )
)
"""The globals a DCP ``.metadata`` written by torch 2.13's ``FileSystemWriter`` names, found by
writing real checkpoints (an FSDP2 model and optimizer, plain, empty, channels-last and 0-d
tensors, every dtype, non-tensor values) and scanning them (``tests/test_checkpoint_sharded``
checks the list is exactly that). Each one builds plain data: constructing it runs no code of
the file's choosing."""

# Module names as protocol 2 writes them -> as torch's unpickler reads them.
_PY2_MODULES = {"__builtin__": "builtins"}

MAX_PICKLE_BYTES = 1 << 30
PICKLE_NAME = "data.pkl"
TORCHSCRIPT_MARKER = "constants.pkl"


def _global_name(data: bytes, pos: int, where: str) -> str:
    """The ``"module.name"`` of the ``GLOBAL`` opcode at ``data[pos]``, read as torch reads it."""
    module_start = pos + 1
    module_end = data.index(b"\n", module_start)
    name_end = data.index(b"\n", module_end + 1)
    try:
        module = data[module_start:module_end].decode("utf-8")
        name = data[module_end + 1 : name_end].decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: GLOBAL at byte {pos} is not UTF-8: {e}") from None
    module = _PY2_MODULES.get(module, module)
    return f"{module}.{name}"


_STRING_PUSHES = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_MEMO_PUTS = frozenset({"MEMOIZE", "BINPUT", "LONG_BINPUT"})
_MEMO_GETS = frozenset({"BINGET", "LONG_BINGET"})
_NO_STACK_EFFECT = frozenset({"PROTO", "FRAME"})


def _scan(
    data: bytes, where: str, opcodes: frozenset[str], allowed: frozenset[str], reader: str
) -> frozenset[str]:
    """Check ``data`` against an opcode and a global allowlist; return the globals it names.

    ``STACK_GLOBAL`` (protocol 4) takes its module and name from the stack; it is accepted only
    when both are string literals, pushed by the two stack-changing opcodes right before it
    (a string opcode, or a memo get of a slot that was filled with such a literal). Any other
    way to compute the name is refused: this scan only names what it can read.
    """
    names: set[str] = set()
    memo: dict[int, str | None] = {}
    recent: list[str | None] = [None, None]  # what the last two stack pushes were, if literals
    try:
        for opcode, arg, pos in pickletools.genops(data):
            name = opcode.name
            if name not in opcodes:
                raise UnsafeCheckpointError(
                    f"{where}: pickle opcode {name} at byte {pos} is not one the {reader} "
                    "unpickler supports"
                )
            if name in _NO_STACK_EFFECT:
                continue
            if name in _MEMO_PUTS:
                index = len(memo) if name == "MEMOIZE" else int(arg)  # type: ignore[arg-type]
                memo[index] = recent[-1]
                continue
            pushed: str | None = None
            if name == "GLOBAL":
                names.add(_global_name(data, pos or 0, where))
            elif name == "STACK_GLOBAL":
                module, attribute = recent
                if module is None or attribute is None:
                    raise UnsafeCheckpointError(
                        f"{where}: STACK_GLOBAL at byte {pos} takes its module and name from "
                        "something other than string literals"
                    )
                names.add(f"{_PY2_MODULES.get(module, module)}.{attribute}")
            elif name in _STRING_PUSHES:
                pushed = str(arg)
            elif name in _MEMO_GETS:
                pushed = memo.get(int(arg))  # type: ignore[arg-type]
            recent = [recent[-1], pushed]
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: undecodable pickle: {e}") from e
    refused = sorted(names - allowed)
    if refused:
        raise UnsafeCheckpointError(f"{where} needs globals {reader} refuses: {refused}")
    return frozenset(names)


def scan_pickle(data: bytes, where: str = "pickle") -> frozenset[str]:
    """Check one pickle statically; return the globals it names (``"module.name"``).

    ``where`` names the pickle in error messages. Raises :class:`UnsafeCheckpointError` at the
    first opcode outside :data:`ALLOWED_OPCODES`, or after the whole stream if any global is
    outside :data:`ALLOWED_GLOBALS` (naming all of them); :class:`CorruptCheckpointError` if
    ``pickletools`` cannot decode it. Nothing in ``data`` is imported, looked up or called.
    """
    return _scan(data, where, ALLOWED_OPCODES, ALLOWED_GLOBALS, "weights_only")


def scan_dcp_metadata(data: bytes, where: str = ".metadata") -> frozenset[str]:
    """Check a ``torch.distributed.checkpoint`` ``.metadata`` file's bytes statically.

    DCP writes it with ``pickle.dump`` and reads it back with ``pickle.load``, which runs
    whatever a crafted file names. This accepts only :data:`DCP_METADATA_OPCODES` and
    :data:`DCP_METADATA_GLOBALS`; returns the globals named. Raises
    :class:`UnsafeCheckpointError` (an opcode or a global outside them, a ``STACK_GLOBAL`` whose
    name is computed, larger than :data:`MAX_PICKLE_BYTES`) or :class:`CorruptCheckpointError`
    (undecodable). Nothing in ``data`` is imported, looked up or called.
    """
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafeCheckpointError(
            f"{where} is larger than the {MAX_PICKLE_BYTES} bytes this scan reads"
        )
    return _scan(data, where, DCP_METADATA_OPCODES, DCP_METADATA_GLOBALS, "DCP metadata")


def _pickle_entry(archive: zipfile.ZipFile, where: str) -> zipfile.ZipInfo:
    """The zip entry ``<dir>/data.pkl`` that ``torch.load`` would unpickle."""
    entries = archive.infolist()
    if not entries:
        raise CorruptCheckpointError(f"{where} is not a readable torch checkpoint: empty zip")
    directory = entries[0].filename.split("/", 1)[0]
    pickles = []
    for entry in entries:
        parts = entry.filename.split("/")
        if len(parts) == 2 and parts[1] == TORCHSCRIPT_MARKER:
            raise CorruptCheckpointError(
                f"{where} is not a readable torch checkpoint: a TorchScript archive"
            )
        if len(parts) == 2 and parts[1] == PICKLE_NAME:
            pickles.append(entry)
    if len(pickles) != 1:
        raise CorruptCheckpointError(
            f"{where} is not a readable torch checkpoint: {len(pickles)} */{PICKLE_NAME} entries"
        )
    if pickles[0].filename != f"{directory}/{PICKLE_NAME}":
        raise CorruptCheckpointError(
            f"{where} is not a readable torch checkpoint: {pickles[0].filename} is not in "
            f"the directory of the first entry, {directory}/"
        )
    return pickles[0]


def scan_checkpoint(file: BinaryIO, where: str) -> frozenset[str]:
    """Check the pickle inside the ``torch.save`` zip ``file`` (an open, seekable binary file).

    ``where`` (usually the path) names the file in error messages. Returns the globals the pickle
    names. Raises :class:`CorruptCheckpointError` if ``file`` is not a ``torch.save`` zip or its
    pickle cannot be decoded, :class:`UnsafeCheckpointError` as :func:`scan_pickle` does, or if the
    pickle is larger than :data:`MAX_PICKLE_BYTES`.
    """
    try:
        with zipfile.ZipFile(file) as archive:
            entry = _pickle_entry(archive, where)
            if entry.file_size > MAX_PICKLE_BYTES:
                raise UnsafeCheckpointError(
                    f"{where}: {entry.filename} is {entry.file_size} bytes, "
                    f"more than the {MAX_PICKLE_BYTES} this scan reads"
                )
            with archive.open(entry) as member:
                data = member.read(MAX_PICKLE_BYTES + 1)
    except OSError as e:  # EIO...: not the file's fault
        raise CheckpointError(f"{where}: {e}") from e
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, ValueError) as e:
        raise CorruptCheckpointError(f"{where} is not a readable torch checkpoint: {e}") from e
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafeCheckpointError(
            f"{where}: {entry.filename} holds more than the {MAX_PICKLE_BYTES} bytes "
            "this scan reads"
        )
    return scan_pickle(data, f"{where}:{entry.filename}")
