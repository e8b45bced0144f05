"""The diverging GPT of ``gpt_diverge.py``, trained with FSDP2 and sharded checkpoints.

The same byte-level GPT, data and learning-rate recipe as ``examples/gpt_diverge.py`` (every one
of its arguments: ``--steps``, ``--warmup``, ``--lr-peak``, ``--stable``...), so it diverges the
same way, but each rank holds a shard of every parameter and of the AdamW moments:
``fully_shard`` (FSDP2) per block and at the root, on a CPU ``DeviceMesh`` over gloo. FSDP's
reduce-scatter averages the gradients, as ``gpt_diverge``'s all-reduce does.

Checkpoints are sharded: every rank asks ``sg.should_checkpoint(step, every=N,
collective=True)`` (so a supervisor's request is answered by every rank at the same step) and
saves its own shard with ``sg.save_checkpoint({"model": msd, "optimizer": osd}, step=...,
sharded=True)`` (``--async-save``: ``torch.distributed.checkpoint.async_save``, the write and
commit in the background). ``sg.resume(model, optimizer)`` loads the supervisor's chosen
checkpoint into the sharded model, whatever world size wrote it.

Run it under the supervisor with 2 ranks (``spikeguard submit`` a job whose entrypoint is this
file), or alone: ``torchrun --nproc-per-node 2 examples/fsdp_diverge.py --ckpt-dir ck/``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from spikeguard.examples.data import Batches, load_corpus
from spikeguard.examples.gpt_diverge import (
    NullSession,
    build_parser,
    first_spike,
    lr_at,
    parse_args,
)
from spikeguard.examples.model import GPT
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def sharded_model(args: argparse.Namespace, world: int) -> torch.nn.Module:
    """The example's GPT (same seed, same initial weights), sharded over every rank."""
    torch.manual_seed(args.seed)
    model = GPT(seq_len=args.seq, qk_norm=args.qk_norm)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    return model


def grad_norm(model: torch.nn.Module) -> float:
    """The 2-norm of the whole (averaged) gradient, over every rank's shard."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def train(args: argparse.Namespace) -> dict:
    """The training loop (every rank); returns rank 0's history of global losses."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # alone: a one-rank process group
    os.environ.setdefault("MASTER_PORT", "29512")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = sharded_model(args, world)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=lr_at(0, args),
        betas=(0.9, args.beta2),
        weight_decay=args.weight_decay,
    )
    batches = Batches(load_corpus(args.data_bytes), args.seq, args.batch, world, args.seed)
    if args.no_sdk:
        sg = NullSession()
    else:
        import spikeguard.workers as sgw

        sg = sgw.attach(
            model, report=args.report, sample_every=args.sample_every, ckpt_dir=args.ckpt_dir
        )
    start = sg.resume(model, optimizer)
    ckpt_every = args.ckpt_every if getattr(sg, "ckpt_dir", None) else 0
    history: list[tuple[int, float]] = []
    bad_streak, t0 = 0, time.time()
    if rank == 0:
        print(
            f"fsdp_diverge: world={world} (FSDP2, gloo) steps={start}..{args.steps} "
            f"lr {args.lr_start:g}->{args.lr_peak:g} (warmup {args.warmup}) "
            f"lr_scale={sg.lr_scale:g} sharded checkpoints every {ckpt_every or '-'}"
            f"{' (async)' if args.async_save else ''}",
            flush=True,
        )
    for step in range(start, args.steps):
        if sg.should_skip(step):
            continue
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y, ids = batches.get(step, rank)
        _, loss = model(x, y)
        loss.backward()
        gn = grad_norm(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        global_loss = float(total) / world
        sg.step(step=step, loss=float(loss.detach()), grad_norm=gn, lr=lr, batch_ids=ids)
        if sg.should_checkpoint(step, every=ckpt_every, collective=True):
            msd, osd = get_state_dict(model, optimizer)
            sg.save_checkpoint(
                {"model": msd, "optimizer": osd},
                step=step,
                sharded=True,
                async_save=args.async_save,
            )
        if rank == 0:
            history.append((step, global_loss))
            if args.log_every and step % args.log_every == 0:
                print(
                    f"step {step:5d} loss {global_loss:.4f} lr {lr * sg.lr_scale:.3e} "
                    f"gnorm {gn:.3g} ({time.time() - t0:.1f}s)",
                    flush=True,
                )
        bad_streak = 0 if math.isfinite(global_loss) else bad_streak + 1
        if args.nan_patience and bad_streak >= args.nan_patience:
            if rank == 0:
                print(f"note: loss non-finite for {bad_streak} steps; stopping", flush=True)
            break
    sg.close()
    if rank == 0 and history:
        tail = [loss for _, loss in history[-50:]]
        spike = first_spike([loss for _, loss in history], [s for s, _ in history])
        print(
            f"finished: last step {history[-1][0]}, final loss (mean of last {len(tail)}) "
            f"{sum(tail) / len(tail):.4f}, first spike {spike if spike is not None else 'none'}, "
            f"{time.time() - t0:.1f}s",
            flush=True,
        )
    dist.barrier()  # nobody tears down (rank 0 hosts the store) while a peer is still talking
    dist.destroy_process_group()
    return {"history": history}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="save with torch.distributed.checkpoint.async_save (write and commit in the "
        "background)",
    )
    train(parse_args(argv, parser))
    return 0


if __name__ == "__main__":
    sys.exit(main())
