"""The LR a framework logs itself is the LR its optimizer steps used, the plan's cut applied.

spikeguard applies the plan's LR scale (with its re-warm-up) as optimizer step hooks and puts the
schedule's value back after each step, so that any schedule survives it. A user reading their
usual logs must still see the cut: the Hugging Face Trainer's ``learning_rate`` (its
``log_history``, the console, every ``report_to`` integration) and what Lightning's
``LearningRateMonitor`` hands the loggers. Each test trains in this process under a plan of
``lr_scale`` 0.5 with a 4-step re-warm-up, records the LR each optimizer step really used (a step
pre hook registered after spikeguard's), and compares the framework's own log with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.usefixtures("restore_environ")

SCALE, REWARM = 0.5, 4


def _plan_env(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh start under a plan that cuts the LR (no checkpoint to load), no other
    ``SPIKEGUARD_*`` variable, one process."""
    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        monkeypatch.delenv(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"lr_scale": SCALE, "rewarm_steps": REWARM, "generation": 1}))
    monkeypatch.setenv("SPIKEGUARD_RESUME", str(plan))


def _ramp(k: int) -> float:
    """The multiplier of optimizer step ``k`` (from 0) under the plan."""
    return SCALE * min(1.0, (k + 1) / REWARM)


def test_the_trainer_logs_the_learning_rate_its_steps_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    import argparse

    from spikeguard.examples.hf_llama_diverge import build_model
    from spikeguard.workers.integrations.hf import SpikeguardCallback
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    _plan_env(tmp_path, monkeypatch)
    seq, steps, lr = 16, 6, 1e-3
    model = build_model(argparse.Namespace(seq=seq, layers=1, seed=0))
    data = [
        {"input_ids": (ids := torch.randint(0, 256, (seq,))), "labels": ids.clone()}
        for _ in range(64)
    ]
    used: list[float] = []
    schedule: list[float] = []

    class Observe(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            opt, sched = kw["optimizer"], kw["lr_scheduler"]

            def pre(o: Any, a: Any, k: Any) -> None:  # after spikeguard's hook: the applied LR
                used.append(float(o.param_groups[0]["lr"]))
                schedule.append(float(sched.get_last_lr()[0]))

            getattr(opt, "optimizer", opt).register_step_pre_hook(pre)

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=lr,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        log_level="warning",
        seed=0,
    )
    sg = SpikeguardCallback(sample_every=1000, report=f"jsonl://{tmp_path / 'reports.jsonl'}")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[sg, Observe()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()

    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert len(used) == len(logged) == steps
    for k in range(steps):  # the schedule runs on untouched; each step used its cut
        assert used[k] == pytest.approx(_ramp(k) * schedule[k], rel=1e-9)
        assert schedule[k] == pytest.approx(lr * (1 - k / steps), rel=1e-9)
    assert logged == pytest.approx(used, rel=1e-9)


def test_lightnings_lr_monitor_logs_the_learning_rate_its_steps_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also: the monitor is listed before spikeguard's callback, gradients accumulate over 2
    batches (the applied LR stays in the param groups across them) and the scheduler is a
    chainable one (``ExponentialLR`` multiplies what the param groups hold: it must never see a
    scaled value, or the cut would compound)."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import Logger
    from spikeguard.workers.integrations.lightning import SpikeguardCallback

    _plan_env(tmp_path, monkeypatch)
    steps, accumulate, lr, gamma = 6, 2, 0.1, 0.8
    used: list[float] = []
    in_training_step: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            in_training_step.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_start(self) -> None:  # after the callbacks': after spikeguard's hooks
            def pre(o: Any, a: Any, k: Any) -> None:
                used.append(float(o.param_groups[0]["lr"]))

            self.trainer.optimizers[0].register_step_pre_hook(pre)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=lr)
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=gamma)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 4, generator=g)
            return torch.utils.data.DataLoader(list(zip(x, x.sum(1, keepdim=True))), batch_size=4)

    class Recorder(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "recorder"

        @property
        def version(self) -> str:
            return "0"

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((int(step or 0), dict(metrics)))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    recorder = Recorder()
    sg = SpikeguardCallback(sample_every=1000, checkpoint_every=0, report="off")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[LearningRateMonitor(logging_interval="step"), sg],
        logger=recorder,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module())

    assert len(used) == steps
    for k in range(steps):  # the schedule never saw the cut: lr * gamma^k, then cut
        assert used[k] == pytest.approx(_ramp(k) * lr * gamma**k, rel=1e-9)
    logged = [(step, m["lr-SGD"]) for step, m in recorder.rows if "lr-SGD" in m]
    assert {step for step, _ in logged} == set(range(steps)), logged
    for step, value in logged:  # every micro-batch's log of a step: that step's LR
        assert value == pytest.approx(used[step], rel=1e-9), (step, value, used)
    assert in_training_step == pytest.approx([u for u in used for _ in range(accumulate)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr * gamma**steps)


def test_a_shown_lr_never_reaches_a_scheduler_or_a_second_scaling() -> None:
    """The applied LR put into the param groups before a step (``show``): consumed by the step
    (scaled once, the schedule's value back after it); put back by ``hide`` when the step does
    not come (the AMP grad scaler skipped it), so a chainable scheduler steps from the
    schedule's value; and a value the script's own schedule writes meanwhile is the new
    schedule, scaled by the step and kept by ``hide``."""
    from spikeguard.workers.contract import ResumePlan
    from spikeguard.workers.rank.resume import LrScale

    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    seen: list[float] = []
    scale = LrScale()
    scale.configure(ResumePlan(lr_scale=0.25), start=0)
    scale.apply(opt)
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))

    def step() -> None:
        param.grad = torch.ones(2)
        opt.step()

    scale.show(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # what a monitor reads now
    step()
    assert seen == [pytest.approx(0.025)] and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    sched.step()  # 0.05
    scale.show(opt)
    scale.hide(opt)  # the step was skipped
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    sched.step()  # from the schedule's value: 0.025, not 0.05 * 0.25 * 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    scale.show(opt)
    opt.param_groups[0]["lr"] = 0.2  # the script's own schedule, during the window
    step()
    assert seen[-1] == pytest.approx(0.05) and opt.param_groups[0]["lr"] == pytest.approx(0.2)
    scale.show(opt)
    opt.param_groups[0]["lr"] = 0.4
    scale.hide(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)
