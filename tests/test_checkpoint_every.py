"""The job's ``checkpoint_every`` is honoured: by the SDK's ``should_checkpoint``, by the
Hugging Face Trainer (it becomes its ``save_steps``) and by the Lightning callback; it overrides
the script's own interval (as every ``SPIKEGUARD_*`` setting overrides its argument), with a
warning when they differ, and a script that never asks is told so.

The supervisor exports the job's ``checkpoint_every`` as ``SPIKEGUARD_CKPT_EVERY`` to every rank
(``supervisor/runner.py``); these tests set that variable as the launcher does and train in this
process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.usefixtures("restore_environ")


class _Lines(logging.Handler):
    """The ``spikeguard`` logger's records (it does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_of_spikeguard() -> Iterator[list[str]]:
    handler = _Lines()
    root = logging.getLogger("spikeguard")
    root.addHandler(handler)
    try:
        yield handler.lines
    finally:
        root.removeHandler(handler)


def _env(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)


def test_the_sdk_checkpoints_at_the_jobs_interval_over_the_scripts(
    monkeypatch: pytest.MonkeyPatch, warnings_of_spikeguard: list[str]
) -> None:
    from spikeguard.workers import attach

    _env(monkeypatch)
    sg = attach(torch.nn.Linear(2, 2), report="off")
    assert [s for s in range(12) if sg.should_checkpoint(s, every=5)] == [5, 10]
    sg.close()

    _env(monkeypatch, SPIKEGUARD_CKPT_EVERY="3")
    sg = attach(torch.nn.Linear(2, 2), report="off")
    assert [s for s in range(12) if sg.should_checkpoint(s, every=5)] == [3, 6, 9]
    assert [s for s in range(12) if sg.should_checkpoint(s)] == [3, 6, 9]  # no every: the job's
    sg.close()
    told = [w for w in warnings_of_spikeguard if "checkpoint_every=3" in w]
    assert len(told) == 1 and "overrides the script's interval of 5" in told[0], told


def test_a_script_that_never_asks_is_told_once(
    monkeypatch: pytest.MonkeyPatch, warnings_of_spikeguard: list[str]
) -> None:
    from spikeguard.workers import attach

    _env(monkeypatch, SPIKEGUARD_CKPT_EVERY="4")
    sg = attach(torch.nn.Linear(2, 2), report="off")
    for s in range(3):
        sg.step(step=s, loss=1.0)
    assert not [w for w in warnings_of_spikeguard if "never calls" in w]
    for s in range(3, 12):
        sg.step(step=s, loss=1.0)
    sg.close()
    told = [w for w in warnings_of_spikeguard if "never calls should_checkpoint" in w]
    assert len(told) == 1 and "checkpoint_every=4" in told[0], warnings_of_spikeguard


def test_the_trainer_saves_at_the_jobs_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings_of_spikeguard: list[str]
) -> None:
    """The script says ``save_steps=100``; the job says every 2 steps: the Trainer writes (and
    spikeguard commits) ``checkpoint-2`` and ``checkpoint-4``."""
    pytest.importorskip("transformers")
    import argparse

    from spikeguard.examples.hf_llama_diverge import build_model
    from spikeguard.workers import checkpoint as ckpt
    from spikeguard.workers.integrations.hf import SpikeguardCallback
    from transformers import PrinterCallback, Trainer, TrainingArguments

    out = tmp_path / "ck"
    _env(monkeypatch, SPIKEGUARD_CKPT_EVERY="2", SPIKEGUARD_CKPT_DIR=str(out))
    seq = 16
    model = build_model(argparse.Namespace(seq=seq, layers=1, seed=0))
    data = [
        {"input_ids": (ids := torch.randint(0, 256, (seq,))), "labels": ids.clone()}
        for _ in range(32)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "elsewhere"),
        max_steps=5,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=100,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        log_level="warning",
    )
    sg = SpikeguardCallback(sample_every=1000, report="off")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[sg])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    listed = ckpt.list_checkpoints(out)
    # 2 and 4 by the job's interval; 5, the last step, by the Trainer's own end-of-training save
    assert [(i.kind, i.step) for i in listed] == [("hf-trainer", s) for s in (2, 4, 5)], listed
    told = [w for w in warnings_of_spikeguard if "checkpoint_every=2" in w]
    assert len(told) == 1 and "save_steps=100" in told[0], warnings_of_spikeguard


def test_lightning_saves_at_the_jobs_interval_over_its_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings_of_spikeguard: list[str]
) -> None:
    pytest.importorskip("lightning")
    from spikeguard.examples.lightning_diverge import GPTModule, parse_args, trainer_for
    from spikeguard.workers import checkpoint as ckpt
    from spikeguard.workers.integrations.lightning import SpikeguardCallback

    _env(monkeypatch, SPIKEGUARD_CKPT_EVERY="3")
    args = parse_args(["--steps", "8", "--d-model", "32", "--heads", "2", "--seq", "16"])
    module = GPTModule(args)
    sg: Any = SpikeguardCallback(
        sample_every=1000, checkpoint_every=5, ckpt_dir=str(tmp_path / "ck"), report="off"
    )
    trainer_for(args, sg).fit(module, ckpt_path=sg.ckpt_path(module))
    assert [i.step for i in ckpt.list_checkpoints(tmp_path / "ck")] == [3, 6]
    told = [w for w in warnings_of_spikeguard if "checkpoint_every=3" in w]
    assert len(told) == 1 and "interval of 5" in told[0], warnings_of_spikeguard
