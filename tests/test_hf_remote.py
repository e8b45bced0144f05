"""The Hugging Face Trainer with a remote checkpoint directory (``SPIKEGUARD_CKPT_DIR=s3://...``):
the real ``transformers.Trainer`` trains a tiny Llama in this process with spikeguard's callback
(no Ray, no supervisor: reports go to a JSONL file), against moto's real S3 server
(tests/s3server.py). The Trainer writes into a local staging directory; its ``checkpoint-N``
directories land on the store as committed checkpoints that the supervisor's own listing lists
and verifies; a resume from one pulls it back verified and restores the same parameters; a
copy kept on the node is reused, and a damaged store is refused. Two real gloo ranks on one node
share the staging directory: both ranks' files are in the published checkpoint, and both pull it
back (one at a time) on a resume.

This file is also the rank program of that test: ``python tests/test_hf_remote.py OUT STEPS``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import plan_file
from s3server import Bucket, s3, s3_server

pytest.importorskip("transformers")

import torch
from spikeguard.workers import contract
from spikeguard.workers.checkpoint import choose, commit, mirror
from spikeguard.workers.checkpoint.format import CheckpointError, CorruptCheckpointError

__all__ = ["s3", "s3_server"]  # the fixtures, used by name
pytestmark = pytest.mark.usefixtures("restore_environ", "no_leftover_attention_capture")
HERE = Path(__file__).resolve()

RUN = "run/checkpoints"


@pytest.fixture
def no_leftover_attention_capture():
    """Undo the HF attention capture a Trainer left installed: a test whose Trainer raises on
    purpose (a refused resume) never closes its session, and the capture is process-wide (the
    attention tests that run next in this process check that it is gone)."""
    from spikeguard.workers.integrations import hf_attention

    before = hf_attention._installs
    yield
    while hf_attention._installs > before:
        hf_attention.uninstall()


SEQ = 16


def checksum(model: torch.nn.Module) -> str:
    """The sha256 of every parameter and buffer's bytes, by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _environment(monkeypatch: pytest.MonkeyPatch, tmp: Path, s3: Bucket, **env: str) -> None:
    """A rank's environment as the launcher would set it, the checkpoint directory on S3."""
    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(contract.ENV_CKPT_DIR, s3.url(RUN))
    monkeypatch.setenv("SPIKEGUARD_STAGE_DIR", str(tmp / "stage"))
    monkeypatch.setenv(contract.ENV_RUN_ID, "hf-remote")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _trainer(
    tmp: Path, *, steps: int, seed: int, report: str = "reports.jsonl", **callback: Any
) -> tuple[Any, Any, Any]:
    """A Trainer of a tiny Llama (random weights of ``seed``) saving every 2 steps, with
    spikeguard's callback (reporting to ``tmp/report``) and a watcher of the parameters;
    (trainer, callback, watcher). DDP over gloo under a torchrun environment of 2 ranks."""
    from spikeguard.examples.hf_llama_diverge import build_model
    from spikeguard.workers.integrations.hf import SpikeguardCallback
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class Watch(TrainerCallback):
        """The parameters' checksum at each save and where training begins."""

        def __init__(self) -> None:
            self.saved: dict[int, str] = {}
            self.began: tuple[int, str] | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.began = (state.global_step, checksum(kw["model"]))

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.saved[state.global_step] = checksum(kw["model"])

    torch.set_num_threads(1)
    model = build_model(argparse.Namespace(seq=SEQ, layers=1, seed=seed))
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": (ids := torch.randint(0, 256, (SEQ,), generator=g)), "labels": ids.clone()}
        for _ in range(64)
    ]
    args = TrainingArguments(
        output_dir=str(tmp / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_level="warning",
        seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    sg = SpikeguardCallback(sample_every=1000, report=f"jsonl://{tmp / report}", **callback)
    watch = Watch()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[sg, watch])
    trainer.remove_callback(PrinterCallback)
    return trainer, sg, watch


def _messages(tmp: Path, kind: str) -> list[dict[str, Any]]:
    from conftest import read_jsonl

    return [m for m in read_jsonl(tmp / "reports.jsonl") if m["type"] == kind]


def _staged(stage: str) -> list[str]:
    return sorted(p.name for p in Path(stage).iterdir() if p.name.startswith("checkpoint-"))


def test_trainer_checkpoints_go_to_s3_and_a_resume_pulls_one_back(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _environment(monkeypatch, tmp_path, s3, **{contract.ENV_GENERATION: "1"})
    trainer, sg, watch = _trainer(tmp_path, steps=4, seed=0)
    # the Trainer writes into staging under SPIKEGUARD_STAGE_DIR, never into a directory "s3:"
    assert sg.remote == s3.url(RUN) and trainer.args.output_dir == sg.stage
    assert sg.stage.startswith(str(tmp_path / "stage")) and sg.stage.endswith("gen001")
    trainer.train(resume_from_checkpoint=sg.resume_from_checkpoint())
    assert not (tmp_path / "s3:").exists()

    # on the store: committed Trainer checkpoints, listed and verified as the supervisor does
    listed = choose.list_checkpoints(s3.url(RUN))
    assert not listed.problems, listed.problems
    assert [(i.step, i.generation, i.kind) for i in listed] == [
        (2, 1, commit.TRAINER_LAYOUT),
        (4, 1, commit.TRAINER_LAYOUT),
    ]
    for info in listed:
        assert info.path == s3.url(f"{RUN}/checkpoint-{info.step}")
        choose.verify(info)
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {
            name for name, _, _ in info.files
        }
    # the supervisor was told the remote paths; the staged copies are gone once published
    sent = _messages(tmp_path, "checkpoint")
    assert [(m["path"], m["sha256"]) for m in sent] == [(i.path, i.sha256) for i in listed]
    assert _staged(sg.stage) == []

    # a rollback to checkpoint-2: generation 2 (other initial weights) pulls it from the store
    first = listed[0]
    monkeypatch.setenv(contract.ENV_GENERATION, "2")
    monkeypatch.setenv(contract.ENV_RESUME, plan_file(tmp_path, first, 2))
    trainer, sg2, resumed = _trainer(tmp_path, steps=4, seed=1)
    local = sg2.resume_from_checkpoint()
    assert local == os.path.join(sg2.stage, "checkpoint-2") and sg2.stage.endswith("gen002")
    assert commit.read_marker(local).sha256 == first.sha256  # the store's, byte for byte
    assert not Path(sg.stage).exists()  # generation 1's staging: removed once 2 runs
    trainer.train(resume_from_checkpoint=local)
    assert resumed.began == (2, watch.saved[2])  # the same parameters as when it was saved
    [m] = _messages(tmp_path, "resumed")
    assert m["checkpoint"] == first.path and m["from_step"] == 3  # the remote path, as planned

    # generation 2 saved step 4 again: its checkpoint replaced generation 1's on the store
    listed = choose.list_checkpoints(s3.url(RUN))
    assert [(i.step, i.generation) for i in listed] == [(2, 1), (4, 2)]
    for info in listed:
        choose.verify(info)
    assert _staged(sg2.stage) == []  # the pulled copy went with the first save


def test_a_kept_copy_is_reused_and_a_damaged_store_refused(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _environment(monkeypatch, tmp_path, s3, **{contract.ENV_GENERATION: "1"})
    trainer, sg, watch = _trainer(tmp_path, steps=2, seed=0, keep_staged=1)
    trainer.train()
    [info] = choose.list_checkpoints(s3.url(RUN))
    assert _staged(sg.stage) == ["checkpoint-2"]  # kept on the node
    # the store's copy damaged since: the kept copy (verified) is what a resume uses
    key = f"{RUN}/checkpoint-2/model.safetensors"
    s3.put(key, b"\x00" * len(s3.get(key)))
    monkeypatch.setenv(contract.ENV_GENERATION, "2")
    monkeypatch.setenv(contract.ENV_RESUME, plan_file(tmp_path, info, 2))
    trainer, sg2, resumed = _trainer(tmp_path, steps=2, seed=1, keep_staged=1)
    local = sg2.resume_from_checkpoint()
    assert local == os.path.join(sg2.stage, "checkpoint-2") and not Path(sg.stage).exists()
    trainer.train(resume_from_checkpoint=local)
    assert resumed.began == (2, watch.saved[2])
    # with no copy on the node, the damaged store is refused before the Trainer sees anything
    mirror.prune_staging(sg2.stage, busy=None, keep=0)
    monkeypatch.setenv(contract.ENV_GENERATION, "3")
    monkeypatch.setenv(contract.ENV_RESUME, plan_file(tmp_path, info, 3))
    _, sg3, _ = _trainer(tmp_path, steps=2, seed=1)
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch"):
        sg3.resume_from_checkpoint()
    assert _staged(sg3.stage) == []
    # and a plan whose checksum is not the store's marker's
    plan = json.loads(Path(plan_file(tmp_path, info, 3)).read_text())
    plan["sha256"] = "0" * 64
    Path(tmp_path / "plan-bad.json").write_text(json.dumps(plan))
    monkeypatch.setenv(contract.ENV_RESUME, str(tmp_path / "plan-bad.json"))
    _, sg4, _ = _trainer(tmp_path, steps=2, seed=1)
    with pytest.raises(CheckpointError, match="not the checkpoint the plan names"):
        sg4.resume_from_checkpoint()


def _rank_main(out: Path, steps: int) -> int:
    """One rank of the two-rank test: train (resuming from what the plan names), then write
    what its watcher saw to ``out/genG-rankR.json``."""
    rank, generation = int(os.environ["RANK"]), int(os.environ[contract.ENV_GENERATION])
    trainer, sg, watch = _trainer(out, steps=steps, seed=generation, report=f"rank{rank}.jsonl")
    local = sg.resume_from_checkpoint()
    trainer.train(resume_from_checkpoint=local)
    seen = {"began": watch.began, "saved": watch.saved, "local": local, "stage": sg.stage}
    (out / f"gen{generation}-rank{rank}.json").write_text(json.dumps(seen))
    return 0


def test_two_ranks_on_a_node_share_the_staging_and_both_pull(s3: Bucket, tmp_path: Path) -> None:
    from conftest import run_ranks

    env = {
        contract.ENV_CKPT_DIR: s3.url(RUN),
        "SPIKEGUARD_STAGE_DIR": str(tmp_path / "stage"),
        contract.ENV_RUN_ID: "hf-ddp",
    }
    for r in run_ranks(HERE, [str(tmp_path), "4"], 2, 900, SPIKEGUARD_GENERATION="1", **env):
        assert r.returncode == 0, r.stdout[-3000:]
    listed = choose.list_checkpoints(s3.url(RUN))
    assert [(i.step, i.generation, i.world_size) for i in listed] == [(2, 1, 2), (4, 1, 2)]
    for info in listed:
        choose.verify(info)
        names = {name for name, _, _ in info.files}
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= names
    gen1 = [json.loads((tmp_path / f"gen1-rank{r}.json").read_text()) for r in (0, 1)]
    assert gen1[0]["stage"] == gen1[1]["stage"] and _staged(gen1[0]["stage"]) == []

    plan = plan_file(tmp_path, listed[0], 2)
    env.update(SPIKEGUARD_GENERATION="2", SPIKEGUARD_RESUME=plan)
    for r in run_ranks(HERE, [str(tmp_path), "4"], 2, 900, **env):
        assert r.returncode == 0, r.stdout[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"gen2-rank{rank}.json").read_text())
        assert seen["local"] == os.path.join(seen["stage"], "checkpoint-2")
        assert seen["began"] == [2, gen1[0]["saved"]["2"]], rank
    listed = choose.list_checkpoints(s3.url(RUN))
    assert [(i.step, i.generation) for i in listed] == [(2, 1), (4, 2)]
    for info in listed:
        choose.verify(info)


if __name__ == "__main__":
    out, n = sys.argv[1:3]
    sys.exit(_rank_main(Path(out), int(n)))
