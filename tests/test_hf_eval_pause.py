"""The Hugging Face Trainer's evaluation is not a training step: not a probe sample, not compute
time.

A tiny Llama trains for a few steps under ``transformers.Trainer`` with spikeguard's callback,
evaluating every 3 steps or at every epoch's end (3 steps), and once before the first step
(``eval_on_start``). Its eval forwards
are made slow (a pre-hook inside the model that sleeps whenever it is in eval mode), so the
forward timing would put the whole evaluation into the next step's ``step_time`` if it ran; the
probes, armed for every step (``sample_every=1``), would take the evaluation's activations as
that step's sample. Neither may happen: every reported step_time stays far below one eval
forward's sleep, and every step is sampled once, from its own training forward."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("restore_environ")]

EVAL_SLEEP = 1.0
"""Seconds each eval forward sleeps (the eval set is 2 batches)."""


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_the_trainers_evaluation_is_neither_sampled_nor_timed(
    tmp_path: Path, strategy: str
) -> None:
    """``steps``: every 3 steps (decided in the step's end); ``epoch``: at each epoch's end (3
    steps an epoch; decided after the step's end, in the epoch's)."""
    import torch
    from spikeguard.examples.hf_llama_diverge import build_model
    from spikeguard.workers.integrations.hf import SpikeguardCallback
    from transformers import PrinterCallback, Trainer, TrainingArguments

    torch.set_num_threads(1)
    seq = 16
    model = build_model(argparse.Namespace(seq=seq, layers=1, seed=0))
    evals: list[int] = []

    def slow_eval(module: torch.nn.Module, args: object) -> None:
        if not module.training:
            evals.append(1)
            time.sleep(EVAL_SLEEP)

    model.model.layers[0].register_forward_pre_hook(slow_eval)  # inside the timed forward

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 256, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=7,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        eval_strategy=strategy,
        eval_steps=3,
        eval_on_start=True,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_level="warning",
        seed=0,
    )
    out = tmp_path / "rank0.jsonl"
    sg = SpikeguardCallback(sample_every=1, report=f"jsonl://{out}")
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(6), eval_dataset=Tokens(4), callbacks=[sg]
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()

    assert len(evals) >= 3 * 2, evals  # on start, after steps 3 and 6: 2 batches each
    assert sum("eval_loss" in h for h in trainer.state.log_history) >= 3
    msgs = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [m for m in msgs if m["type"] in ("heartbeat", "report")]
    assert sorted(m["step"] for m in steps) == list(range(1, 8)), steps
    for m in steps:  # the evaluation before steps 1, 4 and 7 is in none of them
        assert m["step_time"] < EVAL_SLEEP, (m["step"], m["step_time"])
    sampled = [m for m in steps if m["type"] == "report"]
    assert [m["step"] for m in sampled] == list(range(1, 8))  # each step's own sample, once
