"""One run of a divergence-zoo case: a torchrun-style script adopting spikeguard as the README says.

    python3 bench/zoo_train.py --case qwen3-overshoot --variant diverge --seed 0 \
        --report jsonl:///tmp/r.jsonl                        # alone, world size 1
    spikeguard submit JOB.yaml                               # 2 ranks under the supervisor

Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (gloo). The global
batch is ``--global-batch`` sequences split over the ranks, drawn from ``(seed, step)`` only, so a
world-size-1 run sees the batches a 2-rank job does. The SDK's lines, as in the README:
``attach(model)`` (after ``fully_shard`` for FSDP2), ``resume(model, optimizer)``,
``should_skip(step, batch_ids=...)``, ``step(loss=..., grad_norm=..., lr=<unscaled>)``,
``should_checkpoint`` / ``save_checkpoint``. Rank 0 appends one JSON line per step (step, the
ranks' mean loss, generation) to ``--metrics``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from zoo_cases import CASES, Case
from zoo_models import build, head_params, loss_of

SHIFT_FILE = ("pydoc_data", "topics.py")
"""The second data of the ``shift`` case: the Python docs' prose (stdlib, always present)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--case", required=True, help=f"one of {', '.join(CASES)}, or MODEL/FAILURE (tuning)"
    )
    p.add_argument("--variant", choices=("diverge", "control"), default="diverge")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override the case's steps")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one of the case's numbers (for tuning a case), e.g. --set lr=0.1",
    )
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--report", default="off")
    p.add_argument("--no-sdk", action="store_true")
    p.add_argument("--metrics", default=None, help="rank 0 appends one JSON line per step here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--nan-patience", type=int, default=30)
    return p.parse_args(argv)


class Data:
    """The case's batches: the example's byte corpus, its second data after a shift, and the
    burst of one repeated sequence."""

    def __init__(self, case, seq: int, batch: int, world: int, seed: int):
        from spikeguard.examples.data import Batches, load_corpus, stdlib_dir

        self.case, self.batch, self.seq = case, batch, seq
        self.main = Batches(load_corpus(), seq, batch, world, seed)
        self.second = None
        if case.failure == "shift":
            with open(os.path.join(stdlib_dir(), *SHIFT_FILE), "rb") as f:
                text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).clone()
            self.second = Batches(text, seq, batch, world, seed + 1000)

    def get(self, step: int, rank: int, variant: str):
        """(x, y, batch ids) of this rank at ``step``."""
        if self.case.burst(step, variant):
            ids = [7_777_777] * self.batch  # one sequence, every row: the repeated content
            x, y, _ = self.main.get(self.case.burst_at, 0)
            return x[:1].repeat(self.batch, 1), y[:1].repeat(self.batch, 1), ids
        src = self.second if self.case.shifted(step) else self.main
        x, y, ids = src.get(step, rank)
        if src is self.second:
            ids = [i + 10_000_000 for i in ids]
        return x, y, ids


def _attach(args, model):
    if args.no_sdk:
        from spikeguard.examples.gpt_diverge import NullSession

        return NullSession()
    import spikeguard.workers as sgw

    return sgw.attach(
        model, report=args.report, sample_every=args.sample_every, ckpt_dir=args.ckpt_dir
    )


def case_of(args: argparse.Namespace):
    """The case, with ``--set`` overrides (numbers only)."""
    if args.case in CASES:
        case = CASES[args.case]
    else:
        model, _, failure = args.case.partition("/")
        case = Case(name=args.case.replace("/", "-"), model=model, failure=failure)
    changes = {}
    for item in args.set:
        field, _, value = item.partition("=")
        kind = type(getattr(case, field))
        changes[field] = kind(float(value)) if kind in (int, float) else kind(value)
    return dataclasses.replace(case, **changes)


def train(args: argparse.Namespace) -> dict:
    case = case_of(args)
    steps = args.steps or case.steps
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads)
    if case.fsdp or world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 2000))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build(case.model, args.seq, args.seed)
    if case.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.inner.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    head, rest = head_params(model)
    groups = [{"params": rest, "head": False}, {"params": head, "head": True}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=case.lr_at(0, args.variant),
        betas=(0.9, 0.95),
        weight_decay=case.weight_decay,
    )
    data = Data(case, args.seq, args.global_batch // world, world, args.seed)
    sg = _attach(args, model)
    start = sg.resume(model, optimizer)
    ckpt_every = args.ckpt_every if getattr(sg, "ckpt_dir", None) else 0
    generation = int(os.environ.get("SPIKEGUARD_GENERATION", "0") or 0)
    metrics = open(args.metrics, "a", encoding="utf-8") if (args.metrics and rank == 0) else None
    params = [p for p in model.parameters() if p.requires_grad]
    bad, t0, last, losses = 0, time.time(), start - 1, []
    for step in range(start, steps):
        x, y, ids = data.get(step, rank, args.variant)
        if sg.should_skip(step, batch_ids=ids):
            continue
        lr = case.lr_at(step, args.variant)
        for g in optimizer.param_groups:
            g["lr"] = lr * (case.head_factor(step, args.variant) if g["head"] else 1.0)
        loss = loss_of(model(x), y)
        loss.backward()
        if case.fsdp:
            from torch.distributed.tensor import DTensor

            gn_t = torch.nn.utils.clip_grad_norm_(params, math.inf)
            gn = float(gn_t.full_tensor() if isinstance(gn_t, DTensor) else gn_t)
        else:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if world > 1:
                dist.all_reduce(flat)
                flat /= world
                off = 0
                for p in params:
                    p.grad.copy_(flat[off : off + p.numel()].view_as(p.grad))
                    off += p.numel()
            gn = float(flat.norm())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        local = float(loss.detach())
        total = torch.tensor([local])
        if world > 1:
            dist.all_reduce(total)
        mean_loss = float(total) / world
        sg.step(step=step, loss=local, grad_norm=gn, lr=lr, batch_ids=ids, total_steps=steps)
        last = step
        if sg.should_checkpoint(step, every=ckpt_every, collective=case.fsdp):
            if case.fsdp:
                from torch.distributed.checkpoint.state_dict import get_state_dict

                msd, osd = get_state_dict(model, optimizer)
                sg.save_checkpoint({"model": msd, "optimizer": osd}, step=step, sharded=True)
            elif rank == 0:
                sg.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step=step
                )
        losses.append(mean_loss)
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": mean_loss, "gen": generation}) + "\n")
            metrics.flush()
        if rank == 0 and args.log_every and step % args.log_every == 0:
            print(
                f"{args.case} step {step} loss {mean_loss:.4f} lr {lr:.2e} gn {gn:.3g}", flush=True
            )
        bad = 0 if math.isfinite(mean_loss) else bad + 1
        if args.nan_patience and bad >= args.nan_patience:
            break
    sg.close()
    if metrics:
        metrics.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"last_step": last, "losses": losses, "wall": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
