"""Faults during the recovery itself, on real Ray + gloo: a kill that hangs, a relaunch that
cannot bind its port, and checkpoints on disk that are corrupt or malicious when the rollback
needs them."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
from conftest import When, alive, events, kinds, launch_of, reports, toy_job

pytestmark = pytest.mark.slow
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"
CKPT40 = "ckpt-step00000040-gen001-rank0.pt"


def run(job) -> int:
    from spikeguard.supervisor.runner import run_job

    return run_job(job, live=False)


def test_a_rank_ignoring_sigterm_is_sigkilled_after_the_grace_period(ray_local, tmp_path, fail_at):
    fail_at(0, 0, "ignore_term")
    fail_at(0, 30, "hang")  # alive and deaf when the kill comes
    fail_at(1, 30, "exit")
    job = toy_job(tmp_path, policy=POLICY, faults=fail_at, steps=50, timeouts={"kill_grace_s": 1.5})
    assert run(job) == 0
    evs = events(Path(job.run_dir))
    kill = next(e for e in evs if e["kind"] == "kill")
    assert kill["forced"] == [0] and "ignored SIGTERM and were SIGKILLed" in kill["reason"]
    assert 1.5 <= kill["duration_s"] < 12  # the grace period, then SIGKILL at once
    assert not any(alive(p) for p in launch_of(evs, 1)["pids"])
    assert kinds(Path(job.run_dir))[-1] == "completed"


def test_a_port_in_use_at_launch_is_retried_with_a_fresh_port_outside_the_budget(
    ray_local, tmp_path, monkeypatch
):
    from spikeguard.supervisor.launch.group import WorkerGroup

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    real, picks = WorkerGroup._pick_port, []

    def pick(self: WorkerGroup) -> int:  # the first launch gets a port someone else holds
        picks.append(taken if not picks else real(self))
        return picks[-1]

    monkeypatch.setattr(WorkerGroup, "_pick_port", pick)
    job = toy_job(tmp_path, policy=POLICY, steps=40)
    try:
        assert run(job) == 0
    finally:
        squatter.close()
    evs = events(Path(job.run_dir))
    assert [e["kind"] for e in evs] == [
        "launch",
        "launch_failed",
        "launch",
        "completed",
    ]  # no incident
    first, failed, retry = evs[:3]
    assert first["port"] == taken and failed["rank"] == 0 and failed["exit_code"] == 1
    assert "EADDRINUSE" in failed["log_tail"] and failed["failures"] == 1
    assert (
        retry["generation"] == 2
        and retry["cause"] == "launch_retry"
        and retry["port"] not in (taken, None)
    )
    assert retry["backoff_s"] == pytest.approx(0.2)
    assert not any(
        alive(p) for p in first["pids"]
    )  # rank 1, blocked connecting to the squatter, was killed


def corrupt_when_published(run_dir: Path, change) -> When:
    target = run_dir / "checkpoints" / CKPT40
    return When(
        run_dir, lambda evs: Path(str(target) + ".json").exists(), lambda evs: change(target)
    )


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_rollback_lands_on_an_older_one(
    ray_local, tmp_path, fail_at
):
    fail_at(1, 55, "exit")
    job = toy_job(
        tmp_path, policy=POLICY, faults=fail_at, steps=60, extra_args=["--step-sleep", "0.05"]
    )
    run_dir = Path(job.run_dir)

    def flip(target: Path) -> None:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))

    w = corrupt_when_published(run_dir, flip)
    assert run(job) == 0
    assert w.ok()
    rb = next(e for e in events(run_dir) if e["kind"] == "rollback")
    assert rb["checkpoint_step"] == 20
    why = {Path(s["path"]).name: s["reason"] for s in rb["skipped"]}
    assert "sha256 mismatch" in why[CKPT40]
    resumed = [m for m in reports(run_dir) if m["type"] == "resumed" and m["gen"] == 2]
    assert {m["from_step"] for m in resumed} == {21}
    assert kinds(run_dir)[-1] == "completed"


class Evil:
    """Runs a shell command when unpickled: ``touch`` of a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_with_a_matching_sidecar_is_never_executed_and_is_skipped(
    ray_local, tmp_path, fail_at
):
    import torch

    fail_at(1, 55, "exit")
    job = toy_job(
        tmp_path, policy=POLICY, faults=fail_at, steps=60, extra_args=["--step-sleep", "0.05"]
    )
    run_dir = Path(job.run_dir)
    marker = tmp_path / "pwned"

    def poison(target: Path) -> None:  # a valid torch file and a sidecar whose checksum matches it
        tmp = target.with_name(".evil.pt")
        torch.save({"model": Evil(marker), "step": 40}, tmp)
        data = tmp.read_bytes()
        sidecar = Path(str(target) + ".json")
        meta = json.loads(sidecar.read_text())
        meta.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        os.replace(tmp, target)
        sidecar.with_name(".evil.json").write_text(json.dumps(meta))
        os.replace(sidecar.with_name(".evil.json"), sidecar)

    w = corrupt_when_published(run_dir, poison)
    assert run(job) == 0
    assert w.ok()
    rb = next(e for e in events(run_dir) if e["kind"] == "rollback")
    assert rb["checkpoint_step"] == 20
    why = {Path(s["path"]).name: s["reason"] for s in rb["skipped"]}
    assert "weights_only refuses" in why[CKPT40] and "system" in why[CKPT40]
    assert not marker.exists()  # scanned, never unpickled
    assert kinds(run_dir)[-1] == "completed"
