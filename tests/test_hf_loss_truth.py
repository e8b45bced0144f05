"""The loss spikeguard reports under the Hugging Face Trainer is the loss the Trainer logs.

Two real gloo ranks (no supervisor: each rank reports to its own JSONL file) train a tiny
random-weight Llama with ``transformers.Trainer`` at ``logging_steps=1``; the labels mask a
different number of tokens in every sample, so the ranks see different token counts. At every
step the mean over the ranks of what spikeguard reported must be the ``loss`` in the Trainer's
``log_history`` (what the Trainer prints and hands to every ``report_to`` integration), with
``average_tokens_across_devices`` on (transformers' default: the model's loss is each rank's
share of the all-rank token sum, and the Trainer multiplies it by the rank count) and off, with
and without gradient accumulation (the model's loss is then divided over the accumulated
micro-batches' tokens). The first step's loss is ~ln(256): the weights are random.

This file is also the rank program: ``python tests/test_hf_loss_truth.py OUT AVG GA STEPS``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

HERE = Path(__file__).resolve()
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("restore_environ")]


CASES = {
    "avg-tokens": (True, 1),
    "per-rank-tokens": (False, 1),
    "avg-tokens-accumulating": (True, 2),
    "per-rank-accumulating": (False, 2),
}
"""(average_tokens_across_devices, gradient_accumulation_steps) per case: one launch of the two
ranks trains them one after the other (the imports and the gloo start-up are most of the time)."""


def _rank_main(out: Path, steps: int) -> int:
    """One rank: every case in turn, in its own ``out/CASE`` directory."""
    for name, (avg_tokens, accumulation) in CASES.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        _train(out / name, avg_tokens, accumulation, steps)
    return 0


def _train(out: Path, avg_tokens: bool, accumulation: int, steps: int) -> None:
    """The tiny Llama, masked labels, the Trainer with spikeguard's callback."""
    import argparse

    import torch
    from spikeguard.examples.hf_llama_diverge import build_model
    from spikeguard.workers.integrations.hf import SpikeguardCallback
    from transformers import PrinterCallback, Trainer, TrainingArguments

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seq = 16
    model = build_model(argparse.Namespace(seq=seq, layers=1, seed=0))

    class Masked(torch.utils.data.Dataset):  # type: ignore[type-arg]
        """Random bytes; sample ``i`` masks its first ``i % 11`` labels (-100)."""

        def __len__(self) -> int:
            return 256

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 256, (seq,), generator=g)
            labels = ids.clone()
            labels[: i % 11] = -100
            return {"input_ids": ids, "labels": labels}

    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=accumulation,
        average_tokens_across_devices=avg_tokens,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_level="warning",
        seed=0,
    )
    sg = SpikeguardCallback(sample_every=1000, report=f"jsonl://{out}/rank{rank}.jsonl")
    trainer = Trainer(model=model, args=args, train_dataset=Masked(), callbacks=[sg])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    if trainer.is_world_process_zero():
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two gloo ranks that trained every case (one launch)."""
    from conftest import run_ranks

    out = tmp_path_factory.mktemp("hf_loss")
    results = run_ranks(HERE, [str(out), str(STEPS)], world=2, timeout=1200)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    return out


STEPS = 3


@pytest.mark.parametrize("case", list(CASES))
def test_the_reported_loss_is_the_loss_the_trainer_logs(trained: Path, case: str) -> None:
    from conftest import read_jsonl

    steps, tmp_path = STEPS, trained / case
    logged = {
        e["step"]: e["loss"]
        for e in json.loads((tmp_path / "log_history.json").read_text())
        if "loss" in e and "train_runtime" not in e
    }
    assert sorted(logged) == list(range(1, steps + 1)), logged
    assert logged[1] == pytest.approx(math.log(256), abs=0.3)  # random weights: ~ln(vocab)
    reported: dict[int, dict[int, float]] = {}
    for rank in (0, 1):
        for m in read_jsonl(tmp_path / f"rank{rank}.jsonl"):
            if m["type"] in ("heartbeat", "report"):
                reported.setdefault(m["step"], {})[rank] = m["loss"]
    assert sorted(reported) == list(range(1, steps + 1)), reported
    for step, loss in logged.items():
        by_rank = reported[step]
        assert set(by_rank) == {0, 1}, (step, by_rank)
        mean = (by_rank[0] + by_rank[1]) / 2
        assert mean == pytest.approx(loss, rel=1e-5), (step, by_rank, loss)
        assert all(math.isfinite(v) and v > 0 for v in by_rank.values()), (step, by_rank)


if __name__ == "__main__":
    out, n = sys.argv[1:3]
    sys.exit(_rank_main(Path(out), int(n)))


def test_a_second_trainer_given_the_same_callback_reports_its_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook re-creates its Trainer with the callback it already made: the Trainer that
    trains is wrapped too (its loss reported, as the Trainer logs it)."""
    import argparse

    import torch
    from conftest import read_jsonl
    from spikeguard.examples.hf_llama_diverge import build_model
    from spikeguard.workers.integrations.hf import SpikeguardCallback
    from transformers import PrinterCallback, Trainer, TrainingArguments

    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    seq = 16
    model = build_model(argparse.Namespace(seq=seq, layers=1, seed=0))
    data = [
        {"input_ids": (ids := torch.randint(0, 256, (seq,))), "labels": ids.clone()}
        for _ in range(32)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        log_level="warning",
    )
    sg = SpikeguardCallback(sample_every=1000, report=f"jsonl://{tmp_path / 'reports.jsonl'}")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[sg])  # made, never trained
    second = Trainer(model=model, args=args, train_dataset=data, callbacks=[sg])
    second.remove_callback(PrinterCallback)
    second.train()
    losses = {
        m["step"]: m["loss"]
        for m in read_jsonl(tmp_path / "reports.jsonl")
        if m["type"] in ("heartbeat", "report")
    }
    logged = {e["step"]: e["loss"] for e in second.state.log_history if "loss" in e}
    assert sorted(losses) == [1, 2, 3] and all(v is not None for v in losses.values()), losses
    assert losses[3] == pytest.approx(logged[3], rel=1e-5)
