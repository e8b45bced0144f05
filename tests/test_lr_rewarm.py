"""The rank side of the plan's LR multiplier (``workers/rank/resume.py`` LrScale), on a real torch
optimizer: the re-warm-up after an optimizer reset (counted in optimizer steps since launch), an
LR cut given back after probation (against the training step ``Session.step`` feeds it), and the
effective LR ``Session.step(lr=)`` reports."""

from __future__ import annotations

import json

import pytest
import spikeguard.workers as sgw
import torch
from spikeguard.workers import contract
from spikeguard.workers.rank.resume import LrScale


def sgd() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    w = torch.nn.Parameter(torch.zeros(1))
    return w, torch.optim.SGD([w], lr=1.0)


def lr_seen(w: torch.nn.Parameter, opt: torch.optim.Optimizer, lr: LrScale, steps: range):
    """The LR each optimizer step applied (SGD on a gradient of 1: the step's change of ``w``);
    each training step is fed to ``lr`` after its optimizer step, as ``Session.step`` does."""
    seen = []
    for step in steps:
        before = w.item()
        w.grad = torch.ones(1)
        opt.step()
        seen.append(round(before - w.item(), 6))
        assert opt.param_groups[0]["lr"] == 1.0  # the schedule's own value is put back
        lr.feed(step)
    return seen


def test_after_an_optimizer_reset_the_lr_ramps_up_over_rewarm_steps():
    w, opt = sgd()
    lr = LrScale()
    lr.configure(contract.ResumePlan(lr_scale=0.5, reset_optimizer=True, rewarm_steps=4), 501)
    lr.apply(opt)
    assert lr_seen(w, opt, lr, range(501, 507)) == [0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert lr.optimizer_steps == 6 and lr.in_force == 0.5


def test_without_a_re_warm_up_the_scale_applies_from_the_first_step():
    w, opt = sgd()
    lr = LrScale()
    lr.configure(contract.ResumePlan(lr_scale=0.5, reset_optimizer=True), 501)
    lr.apply(opt)
    assert lr_seen(w, opt, lr, range(501, 504)) == [0.5, 0.5, 0.5]


def test_a_re_warm_up_at_scale_one_is_still_installed():
    w, opt = sgd()
    lr = LrScale()
    lr.configure(contract.ResumePlan(reset_optimizer=True, rewarm_steps=2), 0)
    assert not lr.idle
    lr.apply(opt)
    assert lr_seen(w, opt, lr, range(3)) == [0.5, 1.0, 1.0]


def test_the_cut_is_given_back_linearly_after_the_probation_ends():
    w, opt = sgd()
    lr = LrScale()
    plan = contract.ResumePlan(
        lr_scale=0.5, lr_restore_from=10, lr_restore_steps=4, lr_restore_to=1.0
    )
    lr.configure(plan, 8)
    lr.apply(opt)
    assert lr_seen(w, opt, lr, range(8, 17)) == [
        0.5, 0.5, 0.5, 0.625, 0.75, 0.875, 1.0, 1.0, 1.0,
    ]  # fmt: skip


def test_re_warm_up_and_restore_multiply():
    plan = contract.ResumePlan(
        lr_scale=0.5, rewarm_steps=2, lr_restore_from=0, lr_restore_steps=2, lr_restore_to=1.0
    )
    assert [plan.lr_multiplier(k, step=k) for k in range(4)] == [0.25, 0.75, 1.0, 1.0]


def test_session_step_reports_the_lr_each_step_used(tmp_path, monkeypatch):
    plan = contract.ResumePlan(lr_scale=0.5, reset_optimizer=True, rewarm_steps=4, generation=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    monkeypatch.setenv(contract.ENV_RESUME, str(tmp_path / "plan.json"))
    out = tmp_path / "r.jsonl"
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sg = sgw.attach(model, report=f"jsonl://{out}", sample_every=10**9)
    assert sg.resume(model, opt) == 0
    for step in range(5):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        sg.step(step=step, loss=1.0, lr=0.1)
    sg.close()
    msgs = [json.loads(x) for x in out.read_text().splitlines()]
    lrs = [m["lr"] for m in msgs if m["type"] in ("heartbeat", "report")]
    assert lrs == pytest.approx([0.0125, 0.025, 0.0375, 0.05, 0.05])
    resumed = next(m for m in msgs if m["type"] == "resumed")
    assert resumed["lr_scale"] == 0.5
