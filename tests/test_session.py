"""The rank-side API: channel back-pressure, resume plans, LR scale, skips, fencing."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import spikeguard.workers as sgw
import torch
from spikeguard.examples.model import GPT
from spikeguard.workers import contract
from spikeguard.workers.channel import SocketChannel, open_channel


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=32, seq_len=8, d_model=16, n_layer=2, n_head=2)


def train_step(model, opt, sg, step, lr=1e-2):
    for g in opt.param_groups:
        g["lr"] = lr
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sg.step(step=step, loss=loss.item(), lr=lr, batch_ids=[step])
    return loss


def test_full_bounded_queue_never_blocks_step(tmp_path, monkeypatch):
    """An agent that accepts the connection but never reads: step() must not block; drops are
    counted."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "s.sock")
    srv.bind(path)
    srv.listen(1)
    conns = []
    threading.Thread(target=lambda: conns.append(srv.accept()), daemon=True).start()
    monkeypatch.setenv(contract.ENV_REPORT, f"unix://{path}")
    sg = sgw.attach(tiny(), sample_every=10**9, queue_size=8)
    assert isinstance(sg.channel, SocketChannel)
    worst = 0.0
    for s in range(300):
        t0 = time.perf_counter()
        sg.step(step=s, loss=1.0, extra={"pad": "x" * 100_000})  # fills the socket buffer fast
        worst = max(worst, time.perf_counter() - t0)
    assert (
        sg.channel.dropped > 0
    )  # back-pressure was real: the socket filled and the queue overflowed
    assert worst < 0.5  # generous: a blocking send would hang here for good
    srv.close()


def test_step_reports_heartbeats_and_samples_only_on_sampled_steps(tmp_path):
    out = tmp_path / "r.jsonl"
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    sg = sgw.attach(model, report=f"jsonl://{out}", sample_every=3)
    for s in range(7):
        train_step(model, opt, sg, s)
    sg.close()
    msgs = [json.loads(x) for x in out.read_text().splitlines()]
    types = [(m["type"], m["step"]) for m in msgs]
    assert types[0][0] == "hello" and types[-1][0] == "done"
    assert [s for t, s in types if t == "report"] == [0, 3, 6]
    assert [s for t, s in types if t == "heartbeat"] == [1, 2, 4, 5]
    rep = next(m for m in msgs if m["type"] == "report")
    assert rep["summary"]["grade"] == min(
        v["grade"] for v in rep["layers"].values() if "grade" in v
    )
    assert sg.recent_batch_ids()[-1] == (6, [6])


def test_batch_ids_ring_buffer_keeps_the_last_window():
    sg = sgw.attach(tiny(), batch_ids_window=5)
    for s in range(12):
        sg.step(step=s, loss=1.0, batch_ids=[s])
    assert [s for s, _ in sg.recent_batch_ids()] == [7, 8, 9, 10, 11]
    sg.close()


def _saved(tmp_path, monkeypatch):
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    sg = sgw.attach(model, ckpt_dir=str(tmp_path / "ck"), sample_every=1)
    for s in range(5):
        train_step(model, opt, sg, s)
    info = sg.save_checkpoint(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 4}, step=4
    )
    sg.close()
    return model, info


def _with_plan(tmp_path, monkeypatch, **plan_kw):
    plan = contract.ResumePlan(**plan_kw)
    p = tmp_path / "plan.json"
    p.write_text(plan.to_json())
    monkeypatch.setenv(contract.ENV_RESUME, str(p))


def test_checkpoint_metadata_carries_grades_and_resume_restores_weights(tmp_path, monkeypatch):
    model, info = _saved(tmp_path, monkeypatch)
    assert info.grade is not None and 0 <= info.grade <= 7
    assert info.meta["signals_step"] == 4 and info.meta["layers"]
    _with_plan(
        tmp_path,
        monkeypatch,
        checkpoint=info.path,
        sha256=info.sha256,
        checkpoint_step=4,
        reset_optimizer=False,
    )
    fresh = tiny()
    with torch.no_grad():
        for p_ in fresh.parameters():
            p_.add_(1.0)
    opt = torch.optim.AdamW(fresh.parameters())
    sg = sgw.attach(fresh)
    assert sg.resume(fresh, opt) == 5
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert opt.state  # optimizer moments were loaded
    sg.close()


def test_reset_optimizer_and_lr_scale_survive_a_scheduler(tmp_path, monkeypatch):
    _, info = _saved(tmp_path, monkeypatch)
    _with_plan(
        tmp_path,
        monkeypatch,
        checkpoint=info.path,
        sha256=info.sha256,
        checkpoint_step=4,
        reset_optimizer=True,
        lr_scale=0.25,
    )
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    sg = sgw.attach(model)
    sg.resume(model, opt, sched)
    assert not opt.state  # fresh optimizer
    for _ in range(3):
        w0 = model.lm_head.weight.detach().clone()
        x = torch.randint(0, 32, (2, 8))
        model(x, x)[1].backward()
        g = model.lm_head.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        # SGD: w1 = w0 - lr_eff * g; the effective LR is the scheduler's x 0.25
        lr_eff = ((w0 - model.lm_head.weight.detach()) / g)[g.abs() > 1e-6].mean().item()
        assert lr_eff == pytest.approx(sched.get_last_lr()[0] * 0.25, rel=1e-3)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(
        sched.get_last_lr()[0]
    )  # the schedule is untouched
    sg.close()


def test_corrupt_checkpoint_in_plan_is_refused(tmp_path, monkeypatch):
    from spikeguard.workers.checkpoint import CorruptCheckpointError

    _, info = _saved(tmp_path, monkeypatch)
    data = bytearray(open(info.path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(info.path, "wb").write(bytes(data))
    _with_plan(tmp_path, monkeypatch, checkpoint=info.path, sha256=info.sha256, checkpoint_step=4)
    model = tiny()
    sg = sgw.attach(model)
    with pytest.raises(CorruptCheckpointError):
        sg.resume(model, torch.optim.AdamW(model.parameters()))
    sg.close()


def test_skip_ranges(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    _with_plan(tmp_path, monkeypatch, skip_ranges=((3, 5),))
    sg = sgw.attach(tiny(), report=f"jsonl://{out}")
    assert [s for s in range(8) if sg.should_skip(s)] == [3, 4, 5]
    sg.close()
    assert [json.loads(x)["step"] for x in out.read_text().splitlines() if '"skipped"' in x] == [
        3,
        4,
        5,
    ]


def test_stale_generation_cannot_write_checkpoints(tmp_path, monkeypatch):
    fence = tmp_path / "FENCE"
    fence.write_text("3")
    monkeypatch.setenv(contract.ENV_FENCE_FILE, str(fence))
    monkeypatch.setenv(contract.ENV_GENERATION, "2")
    model = tiny()
    sg = sgw.attach(model, ckpt_dir=str(tmp_path / "ck"))
    with pytest.raises(sgw.StaleGenerationError):
        sg.save_checkpoint({"model": model.state_dict()}, step=1)
    assert not list(tmp_path.glob("ck/*.pt"))
    sg.close()


def test_unknown_destination_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown report destination"):
        open_channel("kafka://x")
