"""Tests for spikeguard.workers.checkpoint.pickle_scan, the torch-free static pickle check.

Torch is the reference: what the scan accepts must be what torch's weights-only unpickler accepts
by default, on real checkpoints; what it refuses must never run.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import pickletools
import random
import shlex
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._weights_only_unpickler as weights_only
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import pickle_scan
from spikeguard.workers.checkpoint.format import (
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

# -- helpers -----------------------------------------------------------------------------------


def _saveable_dtypes() -> list[torch.dtype]:
    """Every dtype a CPU tensor can have and ``torch.save`` can write."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental, quantized types deprecated
        for dtype in sorted(dtypes, key=str):
            try:
                torch.save(torch.zeros(3, dtype=dtype), io.BytesIO())
            except (RuntimeError, NotImplementedError, KeyError):
                continue  # sub-byte ints (no storage type), quantized (need quantize_per_*)
            found.append(dtype)
    return found


def _all_dtypes() -> dict[str, torch.Tensor]:
    return {str(d): torch.zeros(3, dtype=d) for d in _saveable_dtypes()}


def _quantized() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "per_tensor": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
            "per_channel": torch.quantize_per_channel(
                torch.ones(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.qint8
            ),
            "qint32": torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint32),
        }


def _odd_tensors() -> dict[str, Any]:
    """Tensors that take other rebuild paths than a plain dense tensor."""
    with_attr = torch.ones(2)
    with_attr.note = 3  # type: ignore[attr-defined]  # pickled through _rebuild_from_type_v2
    param_with_attr = torch.nn.Parameter(torch.ones(2))
    param_with_attr.note = "x"  # type: ignore[attr-defined]
    base = torch.arange(10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors are beta/prototype
        csr = torch.eye(3).to_sparse_csr()
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    return {
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 3, dtype=torch.int64),
        "scalar": torch.tensor(1.5),
        "view": base[2:5],
        "shared": (base, base[::2]),
        "transposed": torch.ones(2, 3).t(),
        "sparse_coo": torch.ones(3).to_sparse(),
        "sparse_csr": csr,
        "meta": torch.empty(3, device="meta"),
        "nested": nested,
        "with_attr": with_attr,
        "param": torch.nn.Parameter(torch.ones(2)),
        "frozen_param": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "param_with_attr": param_with_attr,
        "quantized": _quantized(),
    }


def _structures() -> dict[str, Any]:
    return {
        "nested": {"a": [1, (2.5, {"b": {3, 4}}), [[], ()]], "c": {"d": {"e": None}}},
        "ordered": collections.OrderedDict([("z", torch.ones(1)), ("a", 2)]),
        "bytes": b"\x00\xffabc",
        "bytearray": bytearray(b"xyz"),
        "complex": 1 + 2j,
        "big_ints": [2**100, -(2**70), 70_000, -5, 0],
        "floats": [1.5, float("inf"), float("nan"), -0.0],
        "strings": ["", "é" * 300, "日本"],
        "bools": (True, False),
        "sizes": [torch.Size([]), torch.Size([2, 3])],
        "devices": [torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")],
        "dtypes": [torch.float32, torch.bfloat16, torch.int8, torch.bool],
        "sets": {1, "a", (2, 3)},
        "tuple_keys": {(1, 2): "t", 3: "i", None: "n"},
    }


def _train_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()}


def _pickle_of(path: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return archive.read(name)


def _torch_zip(payload: bytes) -> bytes:
    """A real ``torch.save`` zip whose ``data.pkl`` is replaced by ``payload``."""
    saved = io.BytesIO()
    torch.save({"w": torch.ones(2)}, saved)
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(saved.getvalue())) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst,
    ):
        for entry in src.infolist():
            data = src.read(entry)
            if entry.filename.endswith("/data.pkl"):
                data = payload
            dst.writestr(entry.filename, data)
    return out.getvalue()


def _forge(d: Path, step: int, data: bytes) -> CheckpointInfo:
    """``data`` as a checkpoint whose sidecar matches it (what an attacker can do)."""
    name = ckpt.checkpoint_name(step, 1)
    (d / name).write_bytes(data)
    sidecar = {
        "format": ckpt.CHECKPOINT_FORMAT,
        "version": ckpt.CHECKPOINT_FORMAT_VERSION,
        "file": name,
        "step": step,
        "generation": 1,
        "rank": 0,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "created": "",
        "meta": {"grade": 7},
    }
    (d / (name + ".json")).write_text(json.dumps(sidecar))
    return ckpt.read_sidecar(str(d / (name + ".json")))


def _scan_file(path: str) -> frozenset[str]:
    with open(path, "rb") as f:
        return pickle_scan.scan_checkpoint(f, path)


# -- (a) real checkpoints: accepted, and torch agrees -------------------------------------------


def test_saveable_dtypes_cover_the_usual_ones() -> None:
    names = {str(d) for d in _saveable_dtypes()}
    expected = {"torch.float32", "torch.bfloat16", "torch.float8_e4m3fn", "torch.complex32"}
    expected |= {"torch.uint16", "torch.bool", "torch.int8", "torch.float64", "torch.bits8"}
    assert expected <= names


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(_all_dtypes, id="dtypes"),
        pytest.param(_odd_tensors, id="tensors"),
        pytest.param(_structures, id="structures"),
        pytest.param(_train_state, id="train-state"),
    ],
)
def test_real_checkpoints_pass_and_torch_agrees(tmp_path: Path, state: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = ckpt.write_checkpoint(tmp_path, state(), step=1, generation=1, meta={"grade": 6})
    names = _scan_file(info.path)
    torch_names = weights_only.get_globals_in_pkl(io.BytesIO(_pickle_of(info.path)))
    assert names == torch_names  # the same globals, read the same way
    assert names <= pickle_scan.ALLOWED_GLOBALS
    assert torch.serialization.get_unsafe_globals_in_checkpoint(info.path) == []
    ops = {op.name for op, _, _ in pickletools.genops(_pickle_of(info.path))}
    assert ops <= pickle_scan.ALLOWED_OPCODES
    ckpt.verify(info)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert set(ckpt.load_checkpoint(info)) == set(state())  # and the real guard loads it


def test_dtypes_checkpoint_names_every_dtype(tmp_path: Path) -> None:
    dtypes = _saveable_dtypes()
    state = {"dtypes": dtypes, **{str(d): torch.zeros(2, dtype=d) for d in dtypes}}
    info = ckpt.write_checkpoint(tmp_path, state, step=1, generation=1, meta={})
    names = _scan_file(info.path)
    assert {str(d) for d in dtypes} <= names  # each dtype is a GLOBAL the allowlist holds


# -- (b) the allowlists are torch's -------------------------------------------------------------


def test_allowed_globals_are_in_torch_default_allowlist() -> None:
    torch_allowed = set(weights_only._get_allowed_globals())
    not_in_torch = sorted(pickle_scan.ALLOWED_GLOBALS - torch_allowed)
    assert not_in_torch == []


def test_allowed_opcodes_are_those_torch_implements() -> None:
    implemented = set()
    for op in pickletools.opcodes:
        if getattr(weights_only, op.name, None) == op.code.encode("latin-1"):
            implemented.add(op.name)
    assert implemented == pickle_scan.ALLOWED_OPCODES


def _global_pickle(module: str, name: str) -> bytes:
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n."


def test_global_names_are_read_as_torch_reads_them() -> None:
    """Wherever the scan accepts a GLOBAL, torch reads the same allowed name; torch's Python 2
    renames that the scan does not apply only make it refuse."""
    from torch._utils import IMPORT_MAPPING, NAME_MAPPING

    pairs = set(NAME_MAPPING)
    for full in pickle_scan.ALLOWED_GLOBALS:
        module, _, name = full.rpartition(".")
        pairs.add((module, name))
        pairs |= {(py2, name) for py2 in IMPORT_MAPPING}
        head, _, tail = module.partition(".")
        if tail:
            pairs.add((head, f"{tail}.{name}"))  # the split point does not matter to either
    torch_allowed = set(weights_only._get_allowed_globals())
    accepted = 0
    for module, name in sorted(pairs):
        data = _global_pickle(module, name)
        line = io.BytesIO(module.encode() + b"\n" + name.encode() + b"\n")
        torch_name = ".".join(weights_only._read_global_instruction(line.readline))
        try:
            (scanned,) = pickle_scan.scan_pickle(data)
        except UnsafeCheckpointError as e:
            read_module = "builtins" if module == "__builtin__" else module
            assert f"'{read_module}.{name}'" in str(e)
            continue
        accepted += 1
        assert scanned == torch_name and torch_name in torch_allowed, (module, name)
    assert accepted >= len(pickle_scan.ALLOWED_GLOBALS)
    assert pickle_scan.scan_pickle(_global_pickle("__builtin__", "set")) == {"builtins.set"}


# -- (c) malicious pickles are refused and never run --------------------------------------------


class _System:
    """Runs ``touch marker`` through os.system when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


class _Eval:
    """Creates ``marker`` through builtins.eval when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


def _unicode(text: str) -> bytes:
    """A BINUNICODE opcode pushing ``text`` (one the weights-only unpickler supports)."""
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (a pickle that creates ``marker`` when loaded, what its refusal must name).

    The hand-made ones use only supported opcodes up to the one under test.
    """
    cmd = _unicode(f"touch {shlex.quote(str(marker))}")
    system = {"x": _System(marker)}
    return {
        "global-os-system": (pickle.dumps(system, protocol=2), r"\['posix.system'\]"),
        "stack-global": (
            b"\x80\x02" + _unicode("os") + _unicode("system") + b"\x93" + cmd + b"\x85R.",
            "opcode STACK_GLOBAL at byte 20",
        ),
        "reduce-eval": (pickle.dumps([_Eval(marker)], protocol=2), r"\['builtins.eval'\]"),
        "inst": (b"(" + cmd + b"ios\nsystem\n.", "opcode INST"),
        "obj": (b"(cos\nsystem\n" + cmd + b"o.", "opcode OBJ"),
        "protocol-4": (pickle.dumps(system, protocol=4), "opcode FRAME at byte 2"),
        "protocol-5": (pickle.dumps(system, protocol=5), "opcode FRAME at byte 2"),
    }


@pytest.mark.parametrize(
    "kind",
    ["global-os-system", "stack-global", "reduce-eval", "inst", "obj", "protocol-4", "protocol-5"],
)
def test_malicious_pickles_refused_without_running(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "PWNED"
    payload, named = _payloads(marker)[kind]
    healthy = ckpt.write_checkpoint(
        tmp_path, {"w": torch.ones(2)}, step=1, generation=1, meta={"grade": 7}
    )
    forged = _forge(tmp_path, 2, _torch_zip(payload))

    with pytest.raises(UnsafeCheckpointError, match=named):
        pickle_scan.scan_pickle(payload)
    with pytest.raises(UnsafeCheckpointError, match=named) as e:
        ckpt.verify(forged)
    assert forged.path in str(e.value)
    listed = ckpt.list_checkpoints(tmp_path)
    chosen, skipped = ckpt.select_checkpoint(listed, min_grade=5, before_step=None)
    assert chosen == healthy and skipped[0][0] == forged and "weights" in skipped[0][1]
    with pytest.raises(pickle.UnpicklingError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # protocol 4/5 warning
        torch.load(forged.path, weights_only=True)  # torch refuses it too
    assert not marker.exists()

    pickle.loads(payload)  # the payload is live: the refusals above were not vacuous
    assert marker.exists()


def test_protocol_3_to_5_pickles_refused() -> None:
    first_refused = {3: r"SHORT_BINBYTES at byte \d+", 4: "FRAME at byte 2", 5: "FRAME at byte 2"}
    for protocol, refused in first_refused.items():
        data = pickle.dumps({"w": [1, 2.5, "x", b"y"]}, protocol=protocol)
        with pytest.raises(UnsafeCheckpointError, match=f"opcode {refused}"):
            pickle_scan.scan_pickle(data)
    with pytest.raises(UnsafeCheckpointError, match="opcode EXT1 at byte 2"):
        pickle_scan.scan_pickle(b"\x80\x02\x82\x01.")  # the copyreg extension registry


def test_global_outside_allowlist_is_named(tmp_path: Path) -> None:
    saved = tmp_path / "saved.pt"
    torch.save({"p": Path("/x"), "c": collections.Counter(a=1), "f": frozenset()}, saved)
    unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(saved)))
    assert unsafe == ["builtins.frozenset", "pathlib.PosixPath"]
    with pytest.raises(UnsafeCheckpointError) as e:
        _scan_file(str(saved))
    assert str(e.value).endswith(f"needs globals weights_only refuses: {unsafe}")


class _Point:
    def __init__(self, x: int = 0) -> None:
        self.x = x


def test_add_safe_globals_classes_are_refused_by_verify(tmp_path: Path) -> None:
    """The supervisor has no add_safe_globals list: such a checkpoint is never chosen."""
    with torch.serialization.safe_globals([_Point]):
        info = ckpt.write_checkpoint(tmp_path, {"p": _Point(3)}, step=1, generation=1, meta={})
        assert ckpt.load_checkpoint(info)["p"].x == 3
        with pytest.raises(UnsafeCheckpointError, match=f"{__name__}._Point"):
            ckpt.verify(info)


# -- not a torch.save zip, or an undecodable pickle ---------------------------------------------


def _zipped(entries: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return out.getvalue()


_BAD_ARCHIVES = {
    "raw pickle": pickle.dumps({"a": 1}, protocol=2),
    "empty zip": _zipped({}),
    "no data.pkl": _zipped({"archive/version": b"3\n"}),
    "two data.pkl": _zipped({"a/data.pkl": b"N.", "b/data.pkl": b"N."}),
    "not in the first directory": _zipped({"a/version": b"3\n", "b/data.pkl": b"N."}),
    "torchscript": _zipped({"a/data.pkl": b"N.", "a/constants.pkl": b"N."}),
    "truncated pickle": _zipped({"a/data.pkl": pickle.dumps({"a": 1}, protocol=2)[:-3]}),
    "no STOP": _zipped({"a/data.pkl": b"\x80\x02N"}),
    "unknown opcode": _zipped({"a/data.pkl": b"\x80\x02\xff."}),
    "non-ASCII global": _zipped({"a/data.pkl": b"\x80\x02ctorch\nS\xc3\xa9ze\n."}),
}


@pytest.mark.parametrize("case", sorted(_BAD_ARCHIVES))
def test_bad_archives_are_corrupt(case: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"^x\.pt"):
        pickle_scan.scan_checkpoint(io.BytesIO(_BAD_ARCHIVES[case]), "x.pt")


def test_good_archive_scans() -> None:
    good = _torch_zip(pickle.dumps({"a": 1}, protocol=2))
    assert pickle_scan.scan_checkpoint(io.BytesIO(good), "good") == frozenset()


def test_oversized_pickle_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _torch_zip(pickle.dumps(list(range(100)), protocol=2))
    monkeypatch.setattr(pickle_scan, "MAX_PICKLE_BYTES", 64)
    with pytest.raises(UnsafeCheckpointError, match="more than the 64"):
        pickle_scan.scan_checkpoint(io.BytesIO(data), "big.pt")


@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
def test_mutated_pickles_only_raise_checkpoint_errors() -> None:
    """Whatever the bytes, the scan answers or raises CheckpointError: select can fall back."""
    saved = io.BytesIO()
    torch.save({"w": torch.ones(2), "s": {1}, "b": b"x", "n": [None, 2**80]}, saved)
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as archive:
        data = archive.read("archive/data.pkl")
    variants = [data[:cut] for cut in range(len(data))]
    rng = random.Random(0)
    for _ in range(500):
        mutated = bytearray(data)
        mutated[rng.randrange(len(data))] = rng.randrange(256)
        variants.append(bytes(mutated))
    outcomes = collections.Counter()
    for variant in variants:
        try:
            pickle_scan.scan_pickle(variant)
            outcomes["accepted"] += 1
        except CheckpointError as e:
            outcomes[type(e).__name__] += 1
    assert outcomes["CorruptCheckpointError"] and outcomes["UnsafeCheckpointError"]
