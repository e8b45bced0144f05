"""Lightning with a remote checkpoint directory (``SPIKEGUARD_CKPT_DIR=s3://...``): the real
``lightning.Trainer`` trains the example's tiny GPT in this process with spikeguard's callback
(no Ray, no supervisor), against moto's real S3 server (tests/s3server.py). Lightning hands its
checkpoint dict to spikeguard's CheckpointIO, which writes it straight to the store (a
replicated checkpoint: data file, then sidecar); the supervisor's own listing lists and verifies
it there; ``trainer.fit(ckpt_path=<the plan's URL>)`` loads it back from the store, verified, and
restores the same parameters; a damaged object is refused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import plan_file
from s3server import Bucket, s3, s3_server

pytest.importorskip("lightning")

import torch
from spikeguard.workers import checkpoint as ckpt
from spikeguard.workers import contract
from spikeguard.workers.checkpoint import choose

__all__ = ["s3", "s3_server"]  # the fixtures, used by name
pytestmark = pytest.mark.usefixtures("restore_environ")

RUN = "run/checkpoints"
TINY = ["--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "4"]


def checksum(state: dict[str, torch.Tensor]) -> str:
    """The sha256 of every tensor's bytes in ``state``, by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _environment(monkeypatch: pytest.MonkeyPatch, s3: Bucket, **env: str) -> None:
    """A single rank's environment, the checkpoint directory on S3."""
    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "SIZE" in name else "0")
    monkeypatch.setenv(contract.ENV_CKPT_DIR, s3.url(RUN))
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _fit(tmp: Path, steps: int, seed: int) -> dict[str, Any]:
    """The example's module (initial weights of ``seed``) fitted for ``steps`` steps with the
    callback (a checkpoint every 5 steps), resuming from what the plan names; what a watcher saw:
    the parameters' checksum at each save and at the start of training, and the step there."""
    import lightning.pytorch as pl
    from spikeguard.examples.lightning_diverge import GPTModule, parse_args, trainer_for
    from spikeguard.workers.integrations.lightning import SpikeguardCallback

    seen: dict[str, Any] = {"saved": {}}

    class Watch(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["began"] = (trainer.global_step, checksum(pl_module.state_dict()))

        def on_save_checkpoint(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
        ) -> None:
            seen["saved"][trainer.global_step - 1] = checksum(pl_module.state_dict())

    torch.manual_seed(seed)
    args = parse_args(["--steps", str(steps), *TINY])
    module = GPTModule(args)
    callback = SpikeguardCallback(
        sample_every=5, checkpoint_every=5, report=f"jsonl://{tmp / 'reports.jsonl'}"
    )
    trainer = trainer_for(args, callback)
    trainer.callbacks.append(Watch())
    trainer.fit(module, ckpt_path=callback.ckpt_path(module))
    return seen


def test_lightning_checkpoints_go_to_s3_and_a_resume_loads_one_back(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import read_jsonl

    monkeypatch.chdir(tmp_path)
    _environment(monkeypatch, s3, **{contract.ENV_GENERATION: "0"})
    first = _fit(tmp_path, steps=7, seed=0)
    listed = choose.list_checkpoints(s3.url(RUN))
    assert not listed.problems, listed.problems
    [info] = listed
    name = ckpt.checkpoint_name(5, 0)
    assert (info.path, info.step, info.kind) == (s3.url(f"{RUN}/{name}"), 5, "replicated")
    assert s3.objects() == [f"{RUN}/{name}", f"{RUN}/{name}.json"]  # nothing else, no temp
    choose.verify(info)  # what the supervisor checks before choosing it
    state = ckpt.load_checkpoint(info.path, expected_sha256=info.sha256)
    assert state["global_step"] == 6 and checksum(state["state_dict"]) == first["saved"][5]
    [sent] = [m for m in read_jsonl(tmp_path / "reports.jsonl") if m["type"] == "checkpoint"]
    assert (sent["path"], sent["sha256"]) == (info.path, info.sha256)
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir())  # no local "s3:" copy

    # a rollback to it: generation 1 (other initial weights) resumes from the plan's URL
    monkeypatch.setenv(contract.ENV_GENERATION, "1")
    monkeypatch.setenv(contract.ENV_RESUME, plan_file(tmp_path, info, 1))
    resumed = _fit(tmp_path, steps=9, seed=1)
    assert resumed["began"] == (6, first["saved"][5])  # the same parameters, the next step
    [m] = [m for m in read_jsonl(tmp_path / "reports.jsonl") if m["type"] == "resumed"]
    assert m["checkpoint"] == info.path and m["from_step"] == 6

    # a damaged object on the store: refused before anything is unpickled, nothing trained
    key = f"{RUN}/{name}"
    good = s3.get(key)
    s3.put(key, good[:-64] + bytes(64))
    monkeypatch.setenv(contract.ENV_GENERATION, "2")
    monkeypatch.setenv(contract.ENV_RESUME, plan_file(tmp_path, info, 2))
    with pytest.raises(ckpt.CorruptCheckpointError, match="sha256 mismatch"):
        _fit(tmp_path, steps=9, seed=1)
