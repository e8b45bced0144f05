"""The Lightning integration (spikeguard.workers.integrations.lightning): Lightning's own checkpoint
files graded, checksummed and verified through its CheckpointIO, and a real 2-rank DDP run of
examples/lightning_diverge.py under the supervisor on local Ray, recovered from an injected
collapse by rolling back into one of those files."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TEST_TIMEOUTS, events, read_jsonl, reports
from spikeguard.policies.schema import RecoverySettings
from spikeguard.workers import checkpoint as ckpt

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_rank.py"
POLICY = ROOT / "examples" / "lightning_diverge.policy.yaml"
TINY = ["--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "4"]

REWARM = RecoverySettings().rewarm_steps
"""The re-warm-up after an optimizer reset (the policies here leave the default)."""


def _fit(tmp: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> list[dict[str, Any]]:
    """The example's module trained in this process for ``steps`` steps by a Trainer with the
    callback (checkpoints and samples every 5 steps); returns its reports."""
    from spikeguard.examples.lightning_diverge import GPTModule, parse_args, trainer_for
    from spikeguard.workers.integrations.lightning import SpikeguardCallback

    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "SIZE" in name else "0")
    args = parse_args(["--steps", str(steps), *TINY])
    module = GPTModule(args)
    report = tmp / "reports.jsonl"
    callback = SpikeguardCallback(
        sample_every=5, checkpoint_every=5, ckpt_dir=str(tmp / "ck"), report=f"jsonl://{report}"
    )
    trainer_for(args, callback).fit(module, ckpt_path=callback.ckpt_path(module))
    return read_jsonl(report)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lightning")
    with pytest.MonkeyPatch.context() as mp:
        msgs = _fit(tmp, mp, steps=12)
    return {"tmp": tmp, "ck": tmp / "ck", "msgs": msgs}


def _session(ck: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    from spikeguard.workers import attach

    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return attach(torch.nn.Linear(2, 2), report="off", ckpt_dir=str(ck))


def _io(session: Any) -> Any:
    from lightning.fabric.plugins import TorchCheckpointIO
    from spikeguard.workers.integrations.lightning_io import SpikeguardCheckpointIO

    return SpikeguardCheckpointIO(session, TorchCheckpointIO())


def test_lightning_writes_graded_checksummed_checkpoints_the_supervisor_can_choose(
    trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = ckpt.list_checkpoints(trained["ck"])
    assert not listed.problems, listed.problems
    assert [(c.step, c.generation, c.rank) for c in listed] == [(5, 0, 0), (10, 0, 0)]
    sent = {m["step"]: m for m in trained["msgs"] if m["type"] == "checkpoint"}
    for info in listed:
        assert info.grade is not None and info.grade >= 4  # the sample of the step before
        assert sent[info.step]["sha256"] == info.sha256 and sent[info.step]["grade"] == info.grade
        ckpt.verify(info)  # what the supervisor checks before choosing it: passes
    # it is Lightning's own checkpoint: what Trainer.save_checkpoint dumps, loaded back by the IO
    # (verified, weights_only) for Lightning
    state = _io(_session(trained["ck"], monkeypatch)).load_checkpoint(listed[-1].path)
    assert state["global_step"] == 11 and "pytorch-lightning_version" in state
    assert state["optimizer_states"][0]["state"] and state["lr_schedulers"]
    assert {"model.blocks.0.attn.q_proj.weight", "model.lm_head.weight"} <= set(state["state_dict"])
    # reports every step, with the loss, grad norm and LR, and the probes' layers when sampled
    beats = [m for m in trained["msgs"] if m["type"] in ("heartbeat", "report")]
    assert [m["step"] for m in beats] == list(range(12))
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["lr"] > 0 for m in beats)
    sampled = [m for m in beats if m["type"] == "report"]
    assert [m["step"] for m in sampled] == [0, 5, 10]
    assert {"model.blocks.0", "model.blocks.0.attn", "model.lm_head"} <= set(sampled[0]["layers"])


def test_a_corrupt_unchecked_or_unsafe_lightning_checkpoint_is_refused(
    trained: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(trained["ck"], ck)
    first, last = ckpt.list_checkpoints(ck)
    # a plan whose checksum is not the file's: refused before anything is unpickled
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"checkpoint": last.path, "sha256": "0" * 64, "generation": 1}))
    io = _io(_session(ck, monkeypatch, SPIKEGUARD_RESUME=str(plan)))
    with pytest.raises(ckpt.CorruptCheckpointError, match="expected_sha256"):
        io.load_checkpoint(last.path)
    assert not io.loaded_plan_checkpoint()
    # one flipped byte: refused on the rank, skipped by the supervisor's verification
    raw = bytearray(Path(first.path).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    Path(first.path).write_bytes(bytes(raw))
    io = _io(_session(ck, monkeypatch))
    with pytest.raises(ckpt.CorruptCheckpointError, match="sha256 mismatch"):
        io.load_checkpoint(first.path)
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.verify(first)
    # no sidecar: nothing to verify it against
    os.unlink(last.meta_path)
    with pytest.raises(ckpt.CheckpointError, match="no sidecar"):
        io.load_checkpoint(last.path)
    # a pickle that would run code, under a valid sidecar: the weights-only load refuses it
    evil = ck / ckpt.checkpoint_name(20, 0)
    torch.save({"state_dict": {}, "payload": _Payload()}, evil)
    _sidecar_for(evil, step=20)
    with pytest.raises(ckpt.UnsafeCheckpointError):
        io.load_checkpoint(str(evil))
    assert not _Payload.ran


def test_a_fenced_generation_cannot_publish_and_other_paths_stay_lightnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spikeguard.workers.session import StaleGenerationError

    ck = tmp_path / "ck"
    fence = tmp_path / "FENCE"
    fence.write_text("2")
    session = _session(ck, monkeypatch, SPIKEGUARD_GENERATION="1", SPIKEGUARD_FENCE_FILE=str(fence))
    io = _io(session)
    state = {"state_dict": {"w": torch.ones(2)}, "global_step": 4}
    with pytest.raises(StaleGenerationError):
        io.save_checkpoint(state, str(ck / ckpt.checkpoint_name(3, 1)))
    assert not ck.exists() or not os.listdir(ck)
    with pytest.raises(ckpt.CheckpointError, match="generation 0"):  # not this rank's name
        io.save_checkpoint(state, str(ck / ckpt.checkpoint_name(3, 0)))
    # a path of the user's own (a ModelCheckpoint's): Lightning's IO, no sidecar, no candidate
    own = tmp_path / "mine" / "epoch=0-step=4.ckpt"
    io.save_checkpoint(state, str(own))
    assert own.is_file() and not Path(str(own) + ".json").exists()
    assert io.load_checkpoint(str(own), weights_only=True)["global_step"] == 4


class _Payload:
    """Unpickling it would run code (and say so in ``ran``)."""

    ran = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Payload._run, ())

    @staticmethod
    def _run() -> None:
        _Payload.ran = True


def _sidecar_for(path: Path, *, step: int) -> None:
    """A valid sidecar for the file at ``path`` (its real size and sha256)."""
    import hashlib

    from spikeguard.workers.checkpoint.format import CheckpointInfo, sidecar_text

    data = path.read_bytes()
    info = CheckpointInfo(
        path=str(path),
        meta_path=str(path) + ".json",
        step=step,
        generation=0,
        rank=0,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        meta={"grade": 7},
    )
    Path(info.meta_path).write_text(sidecar_text(info))


@pytest.mark.slow
def test_a_collapse_under_lightning_rolls_back_into_its_own_checkpoint(
    ray_local: Any, tmp_path: Path
) -> None:
    """2 gloo ranks of the Lightning example under the supervisor: reports flow, Lightning's
    checkpoints carry grades, an injected collapse leads to kill -> rollback into a Lightning
    checkpoint -> both ranks resumed by ``trainer.fit(ckpt_path=...)`` at the cut LR, with fresh
    optimizer state, from the checkpoint's global step."""
    from spikeguard.examples.gpt_diverge import lr_at
    from spikeguard.examples.lightning_diverge import parse_args
    from spikeguard.supervisor.job import JobSpec
    from spikeguard.supervisor.runner import run_job

    steps, collapse_at = 60, 35
    argv = ["--steps", str(steps), "--sample-every", "5", "--ckpt-every", "10", *TINY]
    argv += ["--log-every", "0"]
    observed = tmp_path / "observed"
    job = JobSpec(
        name="lightning",
        entrypoint=str(SCRIPT),
        args=argv,
        workers=2,
        policy=str(POLICY),
        run_dir=str(tmp_path / "run"),
        env={"SG_COLLAPSE_AT": str(collapse_at), "SG_OBSERVE_DIR": str(observed)},
        timeouts={"heartbeat_s": 60.0, "first_heartbeat_s": 120.0, **TEST_TIMEOUTS},
        metrics={"port": 0},
    )
    assert run_job(job, live=False) == 0
    run = Path(job.run_dir)
    evs = [e for e in events(run) if e["kind"] not in ("probation_progress", "checkpoint_deleted")]
    kinds = [e["kind"] for e in evs]
    story = ["incident", "kill", "rollback", "lr_cut", "optimizer_reset", "launch"]
    it = iter(kinds)
    assert all(k in it for k in [*story, "probation_start", "probation_passed", "completed"]), kinds
    incident = next(e for e in evs if e["kind"] == "incident")
    assert collapse_at <= incident["step"] < collapse_at + 10, incident

    # the rollback chose a Lightning checkpoint, graded, before the collapse
    rollback = next(e for e in evs if e["kind"] == "rollback")
    target = rollback["checkpoint_path"]
    assert Path(target).parent == run / "checkpoints" and rollback["grade"] >= 4
    back = rollback["checkpoint_step"]  # the newest at least min_steps_back (10) before it
    assert back == (incident["step"] - 10) // 10 * 10 and back < collapse_at
    state = ckpt.load_checkpoint(target)  # verified, weights_only
    assert state["global_step"] == back + 1 and "pytorch-lightning_version" in state

    msgs = reports(run)
    gen1 = [m for m in msgs if m["gen"] == 1]
    for rank in (0, 1):  # reports flowed from both ranks, every step, sampled every 5
        mine = [m for m in gen1 if m["rank"] == rank and m["type"] in ("heartbeat", "report")]
        assert [m["step"] for m in mine][:collapse_at] == list(range(collapse_at))
        assert [m["step"] for m in mine if m["type"] == "report"][:3] == [0, 5, 10]
    graded = [m for m in gen1 if m["type"] == "checkpoint"]
    assert [m["step"] for m in graded][:3] == [10, 20, 30]
    assert all(m["rank"] == 0 and m["grade"] >= 4 for m in graded[:3])

    # the resumed ranks' own account: Lightning restored the checkpoint's global_step, the
    # optimizer state it restored was dropped, the first step ran at half the schedule's LR with
    # AdamW's counter back at 1; and Lightning ran under torchrun's environment as spikeguard set it
    args = parse_args(argv)
    for rank in (0, 1):
        seen = json.loads((observed / f"gen2-rank{rank}.json").read_text())
        assert seen["cluster_environment"] == "TorchElasticEnvironment" and seen["world_size"] == 2
        assert seen["global_step_at_start"] == back + 1
        assert seen["optimizer_state_entries_at_start"] == 0
        assert seen["scheduled_lr"] == pytest.approx(lr_at(back + 1, args), rel=1e-9)
        # the first step after the optimizer reset re-warms: 1/REWARM of the cut LR
        assert seen["lr_in_step"] == [pytest.approx(0.5 * lr_at(back + 1, args) / REWARM, rel=1e-9)]
        assert seen["adam_step_after_first_step"] == 1
        before = json.loads((observed / f"gen1-rank{rank}.json").read_text())
        assert before["lr_in_step"] == [pytest.approx(lr_at(0, args), rel=1e-9)]
    gen2 = [m for m in msgs if m["gen"] == 2]
    resumed = [m for m in gen2 if m["type"] == "resumed"]
    assert sorted(m["rank"] for m in resumed) == [0, 1]
    assert all(m["from_step"] == back + 1 and m["checkpoint"] == target for m in resumed)
    assert all(m["lr_scale"] == pytest.approx(0.5) and m["optimizer_reset"] for m in resumed)
    beats = [m for m in gen2 if m["type"] in ("heartbeat", "report") and m["rank"] == 0]
    assert [m["step"] for m in beats] == list(range(back + 1, steps))
    # the reported LR is the one each step used: the re-warm-up ramp, then the cut schedule
    ramp = [min(1.0, (m["step"] - back) / REWARM) for m in beats]
    assert all(
        m["lr"] == pytest.approx(0.5 * lr_at(m["step"], args) * r, rel=1e-6)
        for m, r in zip(beats, ramp)
    )
