"""A tiny torchrun-style training script for integration and fault tests.

A 2-layer GPT on random-but-deterministic tokens, data parallel over gloo,
using the real SDK. Faults are injected through ``SG_FAULT`` (set by the
``fail_at`` fixture): ``"RANK:STEP:MODE[:GEN]"``, several separated by ``,``;
the fault fires only in generation GEN (default 1; ``*``: every generation),
so a recovered run does not hit it again. STEP may be ``+N``: N steps after
the step this generation started at. Modes:

``exit``         exit with code 3 before the step
``sigkill``      SIGKILL itself mid-step (after backward, before all_reduce)
``hang``         sleep forever right before the gradient all_reduce (peers hang inside it)
``collapse``     from this step on (in that generation) scale the attention
                 queries/keys up and report a loss spike: grade and entropy fall
``nan``          report a NaN loss from this step on
``stall_start``  sleep forever before init_process_group: never a first heartbeat (STEP ignored)
``ignore_term``  ignore SIGTERM from the start (STEP ignored): a kill needs SIGKILL
``zombie``       after reporting the step, SIGSTOP itself; once continued, keep trying to save a
                 checkpoint and to report every 0.2 s, appending each outcome to ``$SG_ZOMBIE_OUT``
``garbage``      before the step, write malformed/invalid lines to its own report socket
``finish``       exit 0 before the step; from that step on no rank uses collectives (uneven data)
``slow``         from this step on sleep ``--slow-sleep`` seconds per step (a straggler)
``straggle``     from this step on the model's forward is slower by half a step, inside the
                 model (its last block sleeps half the median of the rank's own steps so far):
                 the rank computes longer, and its peers wait in the all_reduce
``hostile``      before the step: write hostile lines onto its own report socket (JSON nested
                 5000 deep, 400-digit numbers in step/loss/grade/a layer signal, a ``dropped``
                 count that is a string), send an unencodable report through the SDK, plant
                 look-alike checkpoints (a 400-digit grade, deep JSON, a FIFO data file, a
                 symlink loop) and dump its environment's names to ``$SG_ENV_OUT``; then exit 3

``--env-out DIR`` writes the environment the rank started with to ``DIR/rank{RANK}.json`` (and
``DIR/gen{GEN}-rank{RANK}.json``, kept across generations). ``--print-every N`` prints
``step S loss L`` every N steps on stdout (for the driver-log tests). ``--hold-at S --hold-file
F``: in generation 1, every rank waits before step S until file F exists (a test decides when
the run goes on).
``--env-out DIR`` writes the environment the rank started with to ``DIR/rank{RANK}.json``.
``--data-shift N``: from generation 2 on, step S trains on the batch of step S - N (its
``batch_ids`` are ``[S - N, RANK]``): the data order after a rollback is not the one before.
``--optimizer adamw``: ``torch.optim.AdamW`` itself rather than :class:`QuickAdamW` (the same
arithmetic without torch's lazy ``torch._dynamo`` import; see there).
Every step reports ``tokens`` (4 x 16) and ``total_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

import spikeguard.workers as sgw
import torch
import torch.distributed as dist
from spikeguard.examples.model import GPT


def faults(rank: int, gen: int, start: int = 0) -> tuple[dict[int, str], set[str], int | None]:
    """(this rank's {step: mode}, this rank's step-less modes, the step from which all ranks go
    solo)."""
    out: dict[int, str] = {}
    flags: set[str] = set()
    solo: int | None = None
    for spec in filter(None, os.environ.get("SG_FAULT", "").split(",")):
        parts = spec.split(":")
        r, s, mode = int(parts[0]), parts[1], parts[2]
        g = parts[3] if len(parts) > 3 else "1"
        if g != "*" and int(g) != gen:
            continue
        step = start + int(s[1:]) if s.startswith("+") else int(s)
        if mode == "finish":
            solo = step if solo is None else min(solo, step)
        if r != rank:
            continue
        if mode in ("stall_start", "ignore_term"):
            flags.add(mode)
        else:
            out[step] = mode
    return out, flags, solo


def write_garbage(gen: int) -> None:
    """Bytes no valid rank sends, straight into this rank's report socket."""
    import json
    import socket

    addr = os.environ.get("SPIKEGUARD_REPORT", "")
    if not addr.startswith("unix://"):
        return
    rank = int(os.environ.get("RANK", 0))
    ok = {"v": 1, "type": "heartbeat", "run": "toy", "gen": gen, "rank": rank, "step": 1, "t": 0.0}
    lines = [
        b"this is not json",
        b"[1, 2, 3]",
        b"\xff\xfe\x00garbage",
        b'{"v": 1, "type": "heartbeat", "ste',
        json.dumps({**ok, "v": 99}).encode(),
        json.dumps({**ok, "type": "bogus"}).encode(),
        json.dumps({**ok, "step": "ten"}).encode(),
        json.dumps({**ok, "loss": "NaN"}).encode(),
        json.dumps({**ok, "rank": rank + 7}).encode(),
        json.dumps({**ok, "gen": gen - 1}).encode(),
        b"x" * ((1 << 20) + 100),
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(addr[len("unix://") :])
        s.sendall(b"\n".join(lines) + b"\n")


def hostile(sg: sgw.Session, gen: int, step: int) -> None:
    """Everything a hostile or broken rank can throw at the supervisor (see ``hostile``)."""
    import json
    import socket

    rank = int(os.environ.get("RANK", 0))
    ok = {"v": 1, "type": "report", "run": "toy", "gen": gen, "rank": rank, "step": step, "t": 0}
    huge = int("9" * 400)
    lines = [
        b"[" * 5000 + b"]" * 5000,
        json.dumps({**ok, "type": "heartbeat", "step": huge}).encode(),
        json.dumps({**ok, "type": "heartbeat", "loss": huge}).encode(),
        json.dumps({**ok, "summary": {"grade": huge}, "layers": {}}).encode(),
        json.dumps({**ok, "layers": {"blocks.0": {"max_logit": huge}}, "summary": {}}).encode(),
        json.dumps({**ok, "type": "dropped", "count": "x"}).encode(),
    ]
    addr = os.environ.get("SPIKEGUARD_REPORT", "")
    if addr.startswith("unix://"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(addr[len("unix://") :])
            s.sendall(b"\n".join(lines) + b"\n")
    # unencodable through the SDK: a tensor of 2 values, a tuple key, an object
    sg.step(step=step, loss=1.0, extra={"t": torch.ones(2), (1, 2): "k", "o": object()})
    ckpt = os.environ.get("SPIKEGUARD_CKPT_DIR")
    if ckpt:
        os.makedirs(ckpt, exist_ok=True)
        fake = {"format": "spikeguard-checkpoint", "version": 1, "rank": 0, "size": 1, "meta": {}}
        fake["sha256"] = "0" * 64
        # look-alikes just before the crash, so a rollback must pass over them
        for s, extra in ((step - 9, {"grade": huge}), (step - 8, {"grade": 1e308})):
            name = f"ckpt-step{s:08d}-gen{gen:03d}-rank0.pt"
            with open(os.path.join(ckpt, name), "wb") as f:
                f.write(b"x")
            side = dict(fake, step=s, generation=gen, file=name, meta=extra)
            with open(os.path.join(ckpt, name + ".json"), "w") as f:
                f.write(json.dumps(side))
        deep = f"ckpt-step{step - 7:08d}-gen{gen:03d}-rank0.pt"
        with open(os.path.join(ckpt, deep), "wb") as f:
            f.write(b"x")
        with open(os.path.join(ckpt, deep + ".json"), "w") as f:
            f.write("[" * 20000 + "]" * 20000)
        fifo = f"ckpt-step{step - 6:08d}-gen{gen:03d}-rank0.pt"
        os.mkfifo(os.path.join(ckpt, fifo))
        side = dict(fake, step=step - 6, generation=gen, file=fifo, meta={"grade": 7})
        with open(os.path.join(ckpt, fifo + ".json"), "w") as f:
            f.write(json.dumps(side))
        loop = f"ckpt-step{step - 5:08d}-gen{gen:03d}-rank0.pt"
        os.symlink(loop + ".json", os.path.join(ckpt, loop + ".json.tmp"))
        os.symlink(loop + ".json.tmp", os.path.join(ckpt, loop + ".json"))
        os.symlink(loop, os.path.join(ckpt, loop))
    out = os.environ.get("SG_ENV_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(sorted(os.environ)) + "\n")
            f.write(json.dumps(sorted(os.environ.values())) + "\n")


def zombie(sg: sgw.Session, model: torch.nn.Module, step: int) -> None:
    """Freeze; once continued, behave like a rank that outlived its generation and keeps
    training."""
    out = os.environ.get("SG_ZOMBIE_OUT", os.devnull)
    os.kill(os.getpid(), signal.SIGSTOP)
    for i in range(1, 10**6):
        try:
            info = sg.save_checkpoint(
                {"model": model.state_dict(), "step": step + i}, step=step + i
            )
            what = f"written {info.path}"
        except sgw.StaleGenerationError as e:
            what = f"refused {e}"
        except Exception as e:
            what = f"error {type(e).__name__}: {e}"
        with open(out, "a") as f:
            f.write(f"{os.getpid()} {what}\n")
        sg.step(step=step + i, loss=1.0, lr=0.0)
        time.sleep(0.2)


class QuickAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arithmetic, state, hooks and state dicts) minus the wrappers
    that import ``torch._dynamo`` on their first call: ~1.8 s of CPU at every rank's start on 2
    cores, and the suite starts ~150 generations. A test script's shortcut: a user's optimizer
    pays that import, so the recovery bench, which times cold starts, runs ``--optimizer adamw``."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return torch.optim.AdamW.step.__wrapped__(self, closure)  # type: ignore[attr-defined]

    state_dict = torch.optim.Optimizer.state_dict.__wrapped__  # type: ignore[attr-defined]
    load_state_dict = torch.optim.Optimizer.load_state_dict.__wrapped__  # type: ignore[attr-defined]
    zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__  # type: ignore[attr-defined]
    add_param_group = torch.optim.Optimizer.add_param_group.__wrapped__  # type: ignore[attr-defined]


class Straggle:
    """A forward hook that sleeps :attr:`seconds` (0: none) inside the model's forward."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        if self.seconds:
            time.sleep(self.seconds)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-sleep", type=float, default=1.0)
    p.add_argument("--env-out", help="write this rank's environment to DIR/rank{RANK}.json")
    p.add_argument("--print-every", type=int, default=0)
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--hold-file", default="")
    p.add_argument("--data-shift", type=int, default=0)
    p.add_argument(
        "--optimizer",
        choices=("quick", "adamw"),
        default="quick",
        help="adamw: torch.optim.AdamW itself, with its cold-start cost (the recovery bench)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    gen = int(os.environ.get("SPIKEGUARD_GENERATION", 1))
    if args.env_out:
        for name in (f"rank{rank}.json", f"gen{gen}-rank{rank}.json"):
            with open(os.path.join(args.env_out, name), "w") as f:
                json.dump(dict(os.environ), f)
    _, flags, _ = faults(rank, gen)
    if "ignore_term" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"rank {rank}: ignoring SIGTERM", flush=True)
    if "stall_start" in flags:
        print(f"rank {rank}: injected stall before init_process_group", flush=True)
        time.sleep(3600)
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(vocab=64, seq_len=16, d_model=32, n_layer=2, n_head=4)
    adamw = QuickAdamW if args.optimizer == "quick" else torch.optim.AdamW
    opt = adamw(model.parameters(), lr=args.lr)
    sg = sgw.attach(model, sample_every=args.sample_every, report="off")
    start = sg.resume(model, opt)
    plan, _, solo_from = faults(rank, gen, start)
    collapsing = nan = slow = False
    shift = args.data_shift if gen >= 2 else 0
    durations: list[float] = []  # this rank's steps, wall seconds (straggle's half a step)
    straggle = Straggle()
    model.blocks[-1].register_forward_hook(straggle)
    for step in range(start, args.steps):
        began = time.perf_counter()
        data_step = step - shift
        if sg.should_skip(step, batch_ids=[data_step, rank]):
            continue
        if args.hold_file and gen == 1 and step == args.hold_at:
            while not os.path.exists(args.hold_file):
                time.sleep(0.05)
        mode = plan.get(step)
        if mode == "exit":
            print(f"rank {rank}: injected exit at step {step}", flush=True)
            return 3
        if mode == "finish":
            print(f"rank {rank}: finishing early at step {step}", flush=True)
            sg.close()
            return 0
        if mode == "garbage":
            write_garbage(gen)
        if mode == "hostile":
            print(f"rank {rank}: hostile at step {step}", flush=True)
            hostile(sg, gen, step)
            time.sleep(1.0)  # let the channel's writer send what it queued, then crash
            return 3
        slow = slow or mode == "slow"
        if mode == "straggle" and not straggle.seconds:
            straggle.seconds = 0.5 * statistics.median(durations[-20:] or [0.02])
            print(
                f"rank {rank}: forward slower by {straggle.seconds:.4f} s from step {step}",
                flush=True,
            )
        collapsing = collapsing or mode == "collapse"
        nan = nan or mode == "nan"
        if collapsing:
            with torch.no_grad():  # blow the attention logits up: entropy and rank collapse
                for b in model.blocks:
                    b.attn.q_proj.weight.mul_(1.5)
                    b.attn.k_proj.weight.mul_(1.5)
        g = torch.Generator().manual_seed(data_step * 1000 + rank)
        x = torch.randint(0, 64, (4, 16), generator=g)
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            print(f"rank {rank}: injected hang before all_reduce at step {step}", flush=True)
            time.sleep(3600)
        if world > 1 and (solo_from is None or step < solo_from):
            # one bucket, as DDP does: a gloo all_reduce per parameter costs ~5x the step
            grads = [prm.grad for prm in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= world
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        gn = float(torch.norm(torch.stack([q.grad.norm() for q in model.parameters()])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        adam_steps = int(next(iter(opt.state.values()))["step"]) if opt.state else 0
        rep_loss = float("nan") if nan else (loss.item() * (10.0 if collapsing else 1.0))
        sg.step(
            step=step,
            loss=rep_loss,
            grad_norm=gn,
            lr=args.lr,
            batch_ids=[data_step, rank],
            extra={"adam_steps": adam_steps, "gen": gen},
            tokens=x.numel(),
            total_steps=args.steps,
        )
        if args.print_every and step % args.print_every == 0:
            print(f"step {step} loss {rep_loss:.4f}", flush=True)
        if sg.should_checkpoint(step, every=args.ckpt_every) and rank == 0:
            sg.save_checkpoint(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                step=step,
            )
        if mode == "zombie":
            zombie(sg, model, step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if slow:
            time.sleep(args.slow_sleep)
        durations.append(time.perf_counter() - began)
    sg.close()
    if world > 1 and solo_from is None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
