"""Tests for spikeguard.workers.checkpoint: real files, real child processes, real signals."""

from __future__ import annotations

import collections
import datetime
import errno
import hashlib
import io
import json
import math
import os
import pickle
import resource
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)


def _train_state(seed: int = 0) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    return model, opt


def _write(d: Path, step: int, grade: int | None = 6, gen: int = 1, **kw: Any) -> CheckpointInfo:
    state = {"w": torch.full((64,), float(step)), "step": step}
    return ckpt.write_checkpoint(
        d, state, step=step, generation=gen, meta={"grade": grade, "loss": 1.0}, **kw
    )


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def _forge(d: Path, step: int, data: bytes, grade: int = 7) -> str:
    """Write ``data`` as a checkpoint with a sidecar whose sha256 and size match it.

    This is what an attacker with write access to the directory can do.
    """
    name = ckpt.checkpoint_name(step, 1)
    (d / name).write_bytes(data)
    (d / (name + ".json")).write_text(
        json.dumps(
            {
                "format": ckpt.CHECKPOINT_FORMAT,
                "version": ckpt.CHECKPOINT_FORMAT_VERSION,
                "file": name,
                "step": step,
                "generation": 1,
                "rank": 0,
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "created": "",
                "meta": {"grade": grade},
            }
        )
    )
    return str(d / name)


def test_roundtrip_and_sidecar(tmp_path: Path) -> None:
    model, opt = _train_state()
    layers = {
        "blocks.0.attn": {"grade": 5, "erank_ratio": 0.61},
        "blocks.1.attn": {"grade": 3, "max_logit": 41.5},
    }
    meta = {
        "grade": 3,
        "loss": float("nan"),
        "lr": 1e-3,
        "layers": layers,
        "worst_layer": "blocks.1.attn",
    }
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 120,
        "epoch": 2,
        "tokens": 3.5e6,
        "name": "run-a",
        "np_loss": np.float32(2.5),
        "counts": collections.defaultdict(int, a=1),
    }
    info = ckpt.write_checkpoint(tmp_path, state, step=120, generation=2, meta=meta)

    assert _files(tmp_path) == [
        "ckpt-step00000120-gen002-rank0.pt",
        "ckpt-step00000120-gen002-rank0.pt.json",
    ]
    data = Path(info.path).read_bytes()
    assert (info.size, info.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert (info.step, info.generation, info.rank, info.grade) == (120, 2, 0, 3)
    side = json.loads(Path(info.meta_path).read_text())
    assert (
        side["format"] == ckpt.CHECKPOINT_FORMAT
        and side["version"] == ckpt.CHECKPOINT_FORMAT_VERSION
    )
    assert (side["step"], side["generation"], side["rank"]) == (120, 2, 0)
    assert (side["sha256"], side["size"], side["file"]) == (
        info.sha256,
        info.size,
        os.path.basename(info.path),
    )
    assert datetime.datetime.fromisoformat(side["created"]).tzinfo is not None
    assert math.isnan(side["meta"].pop("loss")) and side["meta"] == {
        k: v for k, v in meta.items() if k != "loss"
    }

    loaded = ckpt.load_checkpoint(info)
    assert (
        loaded["step"] == 120
        and loaded["epoch"] == 2
        and loaded["tokens"] == 3.5e6
        and loaded["name"] == "run-a"
    )
    assert (
        loaded["np_loss"] == 2.5
        and type(loaded["np_loss"]) is float
        and loaded["counts"] == {"a": 1}
    )
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["model"][k], v)
    model2, opt2 = _train_state(seed=1)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])  # the optimizer really accepts what came back
    for p, q in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(
            p["exp_avg_sq"], q["exp_avg_sq"]
        )
    assert ckpt.load_checkpoint(info.path)["step"] == 120  # by path: the sidecar is found
    assert ckpt.load_checkpoint(info.path, expected_sha256=info.sha256)["step"] == 120

    listed = ckpt.list_checkpoints(tmp_path)
    assert listed == [info] and listed.problems == [] and listed[0].meta["layers"] == layers
    ckpt.verify(listed[0])


def test_never_overwrites(tmp_path: Path) -> None:
    first = _write(tmp_path, 10)
    before = Path(first.path).read_bytes(), Path(first.meta_path).read_bytes()
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        ckpt.write_checkpoint(
            tmp_path, {"w": torch.zeros(3)}, step=10, generation=1, meta={"grade": 0}
        )
    assert (Path(first.path).read_bytes(), Path(first.meta_path).read_bytes()) == before
    Path(first.path).unlink()  # a sidecar alone still blocks the name
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        _write(tmp_path, 10)
    assert _files(tmp_path) == [os.path.basename(first.meta_path)]
    assert _write(tmp_path, 10, gen=2).generation == 2  # the next generation gets its own name
    racer = tmp_path / ckpt.checkpoint_name(
        30, 1
    )  # another writer wins the race after the up-front check
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        _write(tmp_path, 30, fence=lambda: racer.write_bytes(b"theirs"))
    assert racer.read_bytes() == b"theirs"
    assert not any(n.startswith((".tmp-", racer.name + ".")) for n in _files(tmp_path))


@pytest.mark.parametrize(
    "bad",
    [
        {"obj": object()},
        {"fn": lambda: 1},
        {"nested": [1, {"x": Path("/x")}]},
        {"arr": np.array([object()])},
        {(1, frozenset()): 1},
        {"sub": torch.Tensor._make_subclass(type("MyT", (torch.Tensor,), {}), torch.zeros(2))},
    ],
)
def test_refuses_state_weights_only_cannot_load_before_writing(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    with pytest.raises(CheckpointError, match="state"):
        ckpt.write_checkpoint(tmp_path, {"ok": torch.ones(2), **bad}, step=1, generation=1, meta={})
    assert _files(tmp_path) == []


def test_refuses_bad_meta_cycles_and_unsafe_tensor_attributes(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="JSON"):
        ckpt.write_checkpoint(
            tmp_path, {"w": torch.ones(2)}, step=1, generation=1, meta={"x": object()}
        )
    cyc: list[Any] = []
    cyc.append(cyc)
    with pytest.raises(CheckpointError, match="cycle"):
        ckpt.write_checkpoint(tmp_path, {"c": cyc}, step=1, generation=1, meta={})
    t = torch.ones(2)
    t.origin = Path("/data")  # type: ignore[attr-defined]  # pickled with the tensor; the walker can't see it
    with pytest.raises(UnsafeCheckpointError, match="PosixPath"):
        ckpt.write_checkpoint(tmp_path, {"t": t}, step=1, generation=1, meta={})
    assert _files(tmp_path) == []


def test_refuses_what_the_listing_would_refuse_before_writing(tmp_path: Path) -> None:
    """A checkpoint the supervisor could never list is never written: the sidecar's size and
    nesting caps and the 2^53 bound on its integers are checked first."""
    deep: Any = 1
    for _ in range(80):
        deep = [deep]
    for meta, why in (
        ({"pad": "x" * (2 << 20)}, "larger than"),
        ({"deep": deep}, "nested more than"),
    ):
        with pytest.raises(CheckpointError, match=why):
            ckpt.write_checkpoint(tmp_path, {"w": torch.ones(2)}, step=1, generation=1, meta=meta)
    with pytest.raises(CheckpointError, match="2\\^53"):
        ckpt.write_checkpoint(tmp_path, {"w": torch.ones(2)}, step=2**60, generation=1, meta={})
    assert _files(tmp_path) == []
    info = ckpt.write_checkpoint(  # at the limits: written, and listed
        tmp_path, {"w": torch.ones(2)}, step=2**53, generation=1, meta={"grade": np.float32(6)}
    )
    assert ckpt.list_checkpoints(tmp_path) == [info] and info.grade == 6


def test_fence_refusal_publishes_nothing(tmp_path: Path) -> None:
    calls: list[int] = []

    class Stale(RuntimeError):
        pass

    def fence() -> None:
        calls.append(1)
        raise Stale("generation 3 < 4")

    old = _write(tmp_path, 1)
    with pytest.raises(Stale, match="generation 3"):  # the fence's own exception, unchanged
        _write(tmp_path, 2, fence=fence)
    assert calls == [1] and _files(tmp_path) == sorted(
        [os.path.basename(old.path), os.path.basename(old.meta_path)]
    )
    assert _write(tmp_path, 2, fence=lambda: calls.append(2)).step == 2 and calls == [1, 2]


def test_failure_after_data_publish_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _write(tmp_path, 1)
    real, n = os.fsync, [0]

    def flaky(fd: int) -> None:
        n[0] += 1
        if n[0] == 4:  # data file, sidecar, directory after the data, directory after the sidecar
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    with pytest.raises(CheckpointError, match="Input/output error"):
        _write(tmp_path, 2)
    assert n[0] == 4
    assert _files(tmp_path) == sorted([os.path.basename(old.path), os.path.basename(old.meta_path)])


# The child writes a first checkpoint, then a second one of ``numel`` floats. With a stage
# ("publish" or "sidecar") it first wraps the writer's publish step to sleep right before it
# publishes the data file ("publish": both temp files are durable, nothing is published) or the
# sidecar ("sidecar": the data file alone is published), so that the test can SIGKILL it there.
_CHILD = textwrap.dedent("""
    import sys, time, torch
    from spikeguard.workers import checkpoint as ckpt
    from spikeguard.workers.checkpoint import write
    d, numel, stage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ckpt.write_checkpoint(d, {"w": torch.ones(1000)}, step=1, generation=1, meta={"grade": 6})
    publish = write._publish

    def paused_publish(tmp, final, created):
        if final.endswith(ckpt.SIDECAR_SUFFIX):
            publishing = "sidecar"
        else:
            publishing = "publish"
        if publishing == stage:
            time.sleep(120)
        publish(tmp, final, created)

    write._publish = paused_publish
    state = {"w": torch.ones(numel)}
    try:
        ckpt.write_checkpoint(d, state, step=2, generation=1, meta={"grade": 6})
    except ckpt.CheckpointError as e:
        print(f"CheckpointError|{getattr(e.__cause__, 'errno', None)}|{e}")
""")


def _child(d: Path, numel: int, stage: str = "", **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(d), str(numel), stage],
        text=True,
        **kw,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _assert_first_intact(d: Path) -> None:
    listed = ckpt.list_checkpoints(d)
    assert [i.step for i in listed] == [1]
    ckpt.verify(listed[0])
    assert torch.equal(ckpt.load_checkpoint(listed[0])["w"], torch.ones(1000))


@pytest.mark.parametrize("stage", ["publish", "sidecar"])
def test_sigkill_mid_write_leaves_previous_intact(tmp_path: Path, stage: str) -> None:
    proc = _child(tmp_path, 2_000_000, stage)
    big = ckpt.checkpoint_name(2, 1)
    # "publish": both temp files durable, nothing published; "sidecar": data published, sidecar not.
    ready = (
        (lambda: any(n.startswith(f".tmp-{big}.json-") for n in os.listdir(tmp_path)))
        if stage == "publish"
        else (
            lambda: (tmp_path / big).exists() and not (tmp_path / f".tmp-{big}-{proc.pid}").exists()
        )
    )
    deadline = time.monotonic() + 90
    try:
        while not ready():
            assert proc.poll() is None, f"writer exited early: {proc.communicate()}"
            assert time.monotonic() < deadline, "writer never reached the pause"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    _assert_first_intact(tmp_path)
    listed = ckpt.list_checkpoints(tmp_path)
    temps = [n for n in _files(tmp_path) if n.startswith(".tmp-")]
    assert all(n.endswith(f"-{proc.pid}") for n in temps)
    if stage == "publish":
        assert len(temps) == 2 and listed.problems == []
        assert not (tmp_path / big).exists()
        assert (
            os.path.getsize(tmp_path / f".tmp-{big}-{proc.pid}") > 8_000_000
        )  # the big one was written in full
    else:
        assert temps == [f".tmp-{big}.json-{proc.pid}"]
        assert listed.problems == [
            (str(tmp_path / big), "data file without sidecar (interrupted write?)")
        ]
    assert ckpt.clean_temp_files(tmp_path, older_than_s=3600) == []  # too fresh
    assert ckpt.clean_temp_files(tmp_path) == [str(tmp_path / n) for n in temps]
    assert not any(n.startswith(".tmp-") for n in _files(tmp_path))
    _assert_first_intact(tmp_path)


def test_disk_full_rlimit_fsize(tmp_path: Path) -> None:
    limit = 1 << 20

    def preexec() -> None:
        signal.signal(
            signal.SIGXFSZ, signal.SIG_IGN
        )  # else the kernel kills the writer; now write() gets EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _child(tmp_path, 1_000_000, preexec_fn=preexec)  # 4 MB of floats > 1 MiB limit
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    kind, errno_, msg = out.strip().split("|", 2)
    assert (kind, errno_) == ("CheckpointError", str(errno.EFBIG)), (
        out
    )  # EFBIG surfaced, not torch's rewording
    assert "File too large" in msg and "ckpt-step00000002" in msg
    assert not any(n.startswith(".tmp-") for n in _files(tmp_path))
    assert ckpt.list_checkpoints(tmp_path).problems == []
    _assert_first_intact(tmp_path)


def test_corrupt_files_refused_and_selection_falls_back(tmp_path: Path) -> None:
    infos = [_write(tmp_path, s) for s in (10, 20, 30, 40)]
    good, flipped, empty, truncated = infos
    data = bytearray(Path(flipped.path).read_bytes())
    data[data.find(torch.full((64,), 20.0).numpy().tobytes()) + 101] ^= (
        0x01  # in the tensor: torch can't tell
    )
    Path(flipped.path).write_bytes(data)
    assert not torch.equal(
        torch.load(flipped.path, weights_only=True)["w"], torch.full((64,), 20.0)
    )
    Path(empty.path).write_bytes(b"")
    with open(truncated.path, "r+b") as f:
        f.truncate(truncated.size // 2)

    for info, why in (
        (flipped, "sha256 mismatch"),
        (empty, "is empty"),
        (truncated, "size mismatch"),
    ):
        for check, arg in (
            (ckpt.load_checkpoint, info),
            (ckpt.load_checkpoint, info.path),
            (ckpt.verify, info),
        ):
            with pytest.raises(CorruptCheckpointError, match=why) as e:
                check(arg)
            assert info.path in str(e.value)
    with pytest.raises(CorruptCheckpointError, match=r"sha256 mismatch.*expected_sha256"):
        ckpt.load_checkpoint(good.path, expected_sha256="0" * 64)
    os.unlink(good.meta_path)
    with pytest.raises(CheckpointError, match="no sidecar and no expected_sha256"):
        ckpt.load_checkpoint(good.path)
    assert ckpt.load_checkpoint(good.path, expected_sha256=good.sha256)["step"] == 10
    _forge(tmp_path, 10, Path(good.path).read_bytes(), grade=6)  # restore the sidecar

    chosen, skipped = ckpt.select_checkpoint(infos, min_grade=5, before_step=None)
    assert chosen == good
    assert [(s.step, r.split(":")[0]) for s, r in skipped] == [
        (40, "failed verification"),
        (30, "failed verification"),
        (20, "failed verification"),
    ]
    assert (
        "size mismatch" in skipped[0][1]
        and "is empty" in skipped[1][1]
        and "sha256 mismatch" in skipped[2][1]
    )

    listed = ckpt.list_checkpoints(tmp_path)  # cheap: catches size changes, not the flipped byte
    assert [i.step for i in listed] == [10, 20]
    assert sorted(p for p, _ in listed.problems) == [empty.meta_path, truncated.meta_path]
    assert all("size mismatch" in r for _, r in listed.problems)
    chosen = ckpt.select_checkpoint(listed, min_grade=5, before_step=None)[0]
    assert chosen is not None and chosen.path == good.path


def test_list_reports_malformed_sidecars(tmp_path: Path) -> None:
    ok, missing, mangled = _write(tmp_path, 1), _write(tmp_path, 2), _write(tmp_path, 3)
    os.unlink(missing.path)
    Path(mangled.meta_path).write_text('{"format": "spikeguard-checkpoint", "step": ')
    (tmp_path / "notes.json").write_text("{}")  # not ours: ignored
    listed = ckpt.list_checkpoints(tmp_path)
    assert listed == [ok]
    assert dict(listed.problems) == {
        missing.meta_path: f"data file {missing.path} is missing",
        mangled.meta_path: dict(listed.problems)[mangled.meta_path],
    }
    assert "malformed JSON" in dict(listed.problems)[mangled.meta_path]
    assert ckpt.list_checkpoints(tmp_path / "nope") == []


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.mark.parametrize("fmt", ["torch-zip", "raw-pickle"])
def test_malicious_pickle_never_runs(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "PWNED"
    healthy = _write(tmp_path, 1)
    buf = io.BytesIO()
    if fmt == "torch-zip":
        torch.save({"model": {"w": torch.ones(2)}, "x": _Evil(marker)}, buf)
    else:
        pickle.dump({"x": _Evil(marker)}, buf, protocol=2)
    path = _forge(tmp_path, 2, buf.getvalue())
    monkeypatch.setenv(
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1"
    )  # must not weaken an explicit weights_only=True

    listed = ckpt.list_checkpoints(tmp_path)
    assert [i.step for i in listed] == [
        1,
        2,
    ]  # the sidecar is consistent: only content checks can tell
    with pytest.raises(UnsafeCheckpointError, match="weights-only") as e:
        ckpt.load_checkpoint(path)
    assert path in str(e.value) and ("system" in str(e.value) or fmt == "raw-pickle")
    with pytest.raises(CheckpointError):
        ckpt.verify(listed[1])
    chosen, skipped = ckpt.select_checkpoint(listed, min_grade=5, before_step=None)
    assert chosen == healthy and skipped[0][0].step == 2 and "verification" in skipped[0][1]
    assert not marker.exists()

    # The payload is live: an unsafe load does run it (so the checks above were not vacuous).
    if fmt == "torch-zip":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(buf.getvalue())
    assert marker.exists()


def _info(step: int, grade: int | float | None, gen: int = 1) -> CheckpointInfo:
    return CheckpointInfo(
        path=f"/ck/{ckpt.checkpoint_name(step, gen)}",
        meta_path="",
        step=step,
        generation=gen,
        rank=0,
        sha256="0" * 64,
        size=1,
        meta={} if grade is None else {"grade": grade},
    )


def _select(
    infos: list[CheckpointInfo], bad: tuple[int, ...] = (), **kw: Any
) -> tuple[Any, list[Any], list[int]]:
    verified: list[int] = []

    def verify_fn(info: CheckpointInfo) -> None:
        verified.append(info.step)
        if info.step in bad:
            raise CorruptCheckpointError(f"{info.path}: sha256 mismatch")

    chosen, skipped = ckpt.select_checkpoint(infos, verify_fn=verify_fn, **kw)
    return (chosen and chosen.step), [(s.step, r) for s, r in skipped], verified


def test_select_grade_threshold() -> None:
    infos = [_info(40, None), _info(10, 7), _info(30, 6.0), _info(20, 3), _info(50, float("nan"))]
    assert _select(infos, min_grade=5, before_step=None) == (
        30,
        [
            (50, "ungraded (no integer 'grade' in meta)"),
            (40, "ungraded (no integer 'grade' in meta)"),
        ],
        [30],
    )
    chosen, skipped, verified = _select(infos, min_grade=7, before_step=None)
    assert (chosen, [s for s, _ in skipped], verified) == (10, [50, 40, 30, 20], [10])
    assert skipped[2][1] == "grade 6 < min_grade 7"


def test_select_before_step_and_min_steps_back() -> None:
    infos = [_info(s, 6) for s in (10, 20, 30, 40)]
    assert _select(infos, min_grade=0, before_step=30)[0] == 30  # inclusive bound
    chosen, skipped, _ = _select(infos, min_grade=0, before_step=35, min_steps_back=10)
    assert chosen == 20 and skipped == [
        (s, f"step {s} > 25 = before_step - min_steps_back 10") for s in (40, 30)
    ]
    assert _select(infos, min_grade=0, before_step=5) == (
        None,
        [(s, f"step {s} > 5 = before_step - min_steps_back 0") for s in (40, 30, 20, 10)],
        [],
    )
    with pytest.raises(ValueError):
        _select(infos, min_grade=0, before_step=None, min_steps_back=5)
    with pytest.raises(ValueError):
        _select(infos, min_grade=0, before_step=10, min_steps_back=-1)


def test_select_prefers_newer_generation_and_falls_back_on_failed_verify() -> None:
    infos = [_info(20, 6, gen=1), _info(20, 6, gen=2), _info(10, 6)]
    sel = ckpt.select_checkpoint(infos, min_grade=5, before_step=None, verify_fn=lambda i: None)[0]
    assert sel is not None and sel.generation == 2
    chosen, skipped, verified = _select(infos, bad=(20,), min_grade=5, before_step=None)
    assert (chosen, verified) == (10, [20, 20, 10])
    assert [s for s, _ in skipped] == [20, 20] and all(
        "failed verification: " in r for _, r in skipped
    )


def test_select_none_healthy_and_unexpected_errors() -> None:
    infos = [_info(10, 6), _info(20, 2), _info(30, 6)]
    chosen, skipped, verified = _select(infos, bad=(10, 30), min_grade=5, before_step=None)
    assert chosen is None and verified == [30, 10]
    assert [(s, r.split(":")[0]) for s, r in skipped] == [
        (30, "failed verification"),
        (20, "grade 2 < min_grade 5"),
        (10, "failed verification"),
    ]
    assert ckpt.select_checkpoint([], min_grade=0, before_step=None) == (None, [])

    def broken(info: CheckpointInfo) -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):  # a bug in verify_fn is not "this checkpoint is bad"
        ckpt.select_checkpoint(infos, min_grade=5, before_step=None, verify_fn=broken)
