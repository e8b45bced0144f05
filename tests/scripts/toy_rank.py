"""A tiny torchrun-style training script for integration and fault tests.

A 2-layer GPT on random-but-deterministic tokens, data parallel over gloo,
using the real SDK. Faults are injected through ``SG_FAULT`` (set by the
``fail_at`` fixture): ``"RANK:STEP:MODE[:GEN]"``, several separated by ``,``;
the fault fires only in generation GEN (default 1), so a recovered run does not
hit it again. Modes:

``exit``      exit with code 3 before the step
``sigkill``   SIGKILL itself mid-step (after backward, before all_reduce)
``hang``      sleep forever right before the gradient all_reduce (peers hang inside it)
``collapse``  from this step on (in that generation) scale the attention
              queries/keys up and report a loss spike: grade and entropy fall
``nan``       report a NaN loss from this step on
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import spikeguard.workers as sgw
from spikeguard.examples.model import GPT


def faults(rank: int, gen: int) -> dict[int, str]:
    out = {}
    for spec in filter(None, os.environ.get("SG_FAULT", "").split(",")):
        parts = spec.split(":")
        r, s, mode = int(parts[0]), int(parts[1]), parts[2]
        g = int(parts[3]) if len(parts) > 3 else 1
        if r == rank and g == gen:
            out[s] = mode
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    gen = int(os.environ.get("SPIKEGUARD_GENERATION", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(vocab=64, seq_len=16, d_model=32, n_layer=2, n_head=4)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sg = sgw.attach(model, sample_every=args.sample_every, report="off")
    start = sg.resume(model, opt)
    plan = faults(rank, gen)
    collapsing = nan = False
    for step in range(start, args.steps):
        if sg.should_skip(step):
            continue
        mode = plan.get(step)
        if mode == "exit":
            print(f"rank {rank}: injected exit at step {step}", flush=True)
            return 3
        collapsing = collapsing or mode == "collapse"
        nan = nan or mode == "nan"
        if collapsing:
            with torch.no_grad():  # blow the attention logits up: entropy and rank collapse
                for b in model.blocks:
                    b.attn.q_proj.weight.mul_(1.5)
                    b.attn.k_proj.weight.mul_(1.5)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randint(0, 64, (4, 16), generator=g)
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            print(f"rank {rank}: injected hang before all_reduce at step {step}", flush=True)
            time.sleep(3600)
        if world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        gn = float(torch.norm(torch.stack([q.grad.norm() for q in model.parameters()])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        adam_steps = int(next(iter(opt.state.values()))["step"]) if opt.state else 0
        rep_loss = float("nan") if nan else (loss.item() * (10.0 if collapsing else 1.0))
        sg.step(step=step, loss=rep_loss, grad_norm=gn, lr=args.lr, batch_ids=[step, rank],
                extra={"adam_steps": adam_steps, "gen": gen})
        if rank == 0 and args.ckpt_every and step > 0 and step % args.ckpt_every == 0:
            sg.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                               step=step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    sg.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
