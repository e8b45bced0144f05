"""A small byte-level GPT that diverges on purpose: the spikeguard demo script.

An ordinary torchrun-style data-parallel script (reads ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; gloo on CPU)
wired to the rank-side SDK (``spikeguard.workers``)::

    torchrun --nproc-per-node 2 examples/gpt_diverge.py --report jsonl:///tmp/run.jsonl \
        --ckpt-dir /tmp/ckpt

Model: 3 layers, d=64, 4 heads, SDPA, on the stdlib's ``*.py`` bytes
(:mod:`.data`, :mod:`.model`); batch 16 x 64 per rank. Recipe: AdamW
(betas 0.9/0.95, no weight decay), no gradient clipping, no QK-norm; the LR
warms up geometrically from ``--lr-start`` 1e-3 to ``--lr-peak`` 0.15 over
``--warmup`` 800 steps, then decays by a cosine to ``--final-frac`` 10 % of
the peak at ``--steps`` 1600. The peak is past this model's stability edge:
attention logits grow without bound (entropy collapse) and the loss climbs
~0.5-0.9 nats from step ~800 (3 of 3 seeds, ``bench/example_seeds.py``).

``--stable``: the same schedule scaled x0.1 (a control that trains to a lower
loss). ``--qk-norm``: RMSNorm on each head's q and k (the known fix; also
stable). After a rollback to a checkpoint before the spike with a fresh
optimizer, an LR scale of 0.25 finishes cleanly; 0.5 finishes with a low loss
but the attention logits grow again (a second incident for an entropy-based
policy). The schedule only decays after the peak, so a scaled rerun never
sees a higher LR than the one it was rolled back from.

Non-finite losses do not crash the script: it keeps training (the SDK reports
the NaNs), and after ``--nan-patience`` consecutive non-finite steps it stops
early, prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from spikeguard.examples.data import DEFAULT_MAX_BYTES, Batches, load_corpus
from spikeguard.examples.model import GPT

STABLE_FACTOR = 0.1


def build_parser() -> argparse.ArgumentParser:
    """The example's arguments (``fsdp_diverge.py`` adds its own to them)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=1600, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--lr-start", type=float, default=1e-3, help="LR at step 0")
    p.add_argument(
        "--lr-peak",
        type=float,
        default=None,
        help="LR at the end of the warm-up (default 0.15; x0.1 with --stable)",
    )
    p.add_argument("--warmup", type=int, default=800, help="geometric warm-up steps")
    p.add_argument(
        "--final-frac",
        type=float,
        default=0.1,
        help="LR at --steps as a fraction of the peak (cosine decay)",
    )
    p.add_argument(
        "--stable",
        action="store_true",
        help=f"control run: the same schedule scaled x{STABLE_FACTOR}",
    )
    p.add_argument("--qk-norm", action="store_true", help="RMSNorm on q and k per head (the fix)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2")
    p.add_argument(
        "--sample-every",
        type=int,
        default=200,
        help="SDK probe interval (SPIKEGUARD_SAMPLE_EVERY overrides)",
    )
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval (0: never)")
    p.add_argument(
        "--ckpt-dir", default=None, help="checkpoint directory (SPIKEGUARD_CKPT_DIR overrides)"
    )
    p.add_argument(
        "--report",
        default="off",
        help='"off" or "jsonl:///path/file.jsonl" (SPIKEGUARD_REPORT overrides)',
    )
    p.add_argument("--no-sdk", action="store_true", help="run without spikeguard.workers")
    p.add_argument("--log-every", type=int, default=100, help="rank-0 progress interval")
    p.add_argument(
        "--logit-every",
        type=int,
        default=0,
        help="record the max attention logit on rank 0 every N steps (0: never)",
    )
    p.add_argument("--metrics", default=None, help="rank 0 writes one JSON line per step here")
    p.add_argument(
        "--nan-patience",
        type=int,
        default=20,
        help="stop after this many consecutive non-finite losses",
    )
    p.add_argument("--data-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda uses nccl)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    return p


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """The parsed arguments (``parser``: :func:`build_parser`'s, possibly extended)."""
    args = (parser or build_parser()).parse_args(argv)
    if args.lr_peak is None:
        args.lr_peak = 0.15
    if args.stable:
        args.lr_peak *= STABLE_FACTOR
        args.lr_start *= STABLE_FACTOR
    return args


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Geometric warm-up lr_start -> lr_peak over ``warmup`` steps, then cosine to final_frac."""
    if args.warmup > 0 and step < args.warmup:
        return args.lr_start * (args.lr_peak / args.lr_start) ** (step / args.warmup)
    span = max(1, args.steps - args.warmup)
    frac = min(1.0, (step - args.warmup) / span)
    floor = args.final_frac * args.lr_peak
    return floor + 0.5 * (args.lr_peak - floor) * (1.0 + math.cos(math.pi * frac))


def first_spike(
    losses: list[float], steps: list[int] | None = None, window: int = 20, jump: float = 0.3
) -> int | None:
    """Step of the first loss spike: a non-finite loss, or a ``window``-step mean
    that exceeds the best earlier ``window``-step mean by more than ``jump`` nats."""
    steps = steps if steps is not None else list(range(len(losses)))
    best = math.inf
    run = 0.0
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return steps[i]
        run += loss
        if i >= window:
            run -= losses[i - window]
        if i + 1 >= window:
            mean = run / window
            if mean > best + jump:
                # report where the excursion began: the first step above best + jump/2
                for j in range(i - window + 1, i + 1):
                    if losses[j] > best + jump / 2:
                        return steps[j]
                return steps[i]
            best = min(best, mean)
    return None


class NullSession:
    """What the loop calls when run with ``--no-sdk`` (no reports, no checkpoints)."""

    lr_scale = 1.0
    ckpt_dir = None

    def resume(self, model, optimizer) -> int:
        return 0

    def should_skip(self, step: int, batch_ids: object = None) -> bool:
        return False

    def should_checkpoint(
        self, step: int, every: int | None = None, collective: bool = False
    ) -> bool:
        return False

    def step(self, **kw) -> None:
        pass

    def save_checkpoint(self, state, step: int, **kw) -> None:
        pass

    def close(self) -> None:
        pass


def _attach(args, model):
    if args.no_sdk:
        return NullSession()
    try:
        import spikeguard.workers as sgw

        attach = sgw.attach
    except (ImportError, AttributeError) as e:
        raise SystemExit(
            f"spikeguard.workers.attach is not available ({e}); run with --no-sdk"
        ) from e
    return attach(model, report=args.report, sample_every=args.sample_every, ckpt_dir=args.ckpt_dir)


def train(args: argparse.Namespace, on_step=None) -> dict:
    """The training loop. ``on_step(record)`` is called on rank 0 after each step.

    Returns (on every rank) a summary: steps run, last step, whether it stopped
    on NaNs, and rank 0's history of global losses.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
        )

    torch.manual_seed(args.seed)
    model = GPT(seq_len=args.seq, qk_norm=args.qk_norm).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if world > 1:
        for p in params:  # identical seeds give identical weights; make sure anyway
            dist.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(
        params, lr=lr_at(0, args), betas=(0.9, args.beta2), weight_decay=args.weight_decay
    )
    batches = Batches(load_corpus(args.data_bytes), args.seq, args.batch, world, args.seed)

    sg = _attach(args, model)
    start = sg.resume(model, optimizer)
    lr_scale = float(
        getattr(sg, "lr_scale", 1.0)
    )  # the supervisor's scale, applied inside optimizer.step
    # checkpoints need a directory (--ckpt-dir or SPIKEGUARD_CKPT_DIR); without one, none are
    # written
    ckpt_every = args.ckpt_every if getattr(sg, "ckpt_dir", None) else 0
    metrics = open(args.metrics, "a", encoding="utf-8") if (args.metrics and rank == 0) else None
    history: list[tuple[int, float]] = []
    bad_streak = 0
    stopped_on_nan = False
    last = start - 1
    t0 = time.time()
    if rank == 0:
        print(
            f"gpt_diverge: world={world} batch={args.batch}x{args.seq}/rank "
            f"steps={start}..{args.steps} "
            f"lr {args.lr_start:g}->{args.lr_peak:g} (warmup {args.warmup}) qk_norm={args.qk_norm} "
            f"sdk={'off' if args.no_sdk else 'on'} lr_scale={lr_scale:g} "
            f"checkpoints={'every ' + str(ckpt_every) if ckpt_every else 'off'}",
            flush=True,
        )
    try:
        for step in range(start, args.steps):
            if sg.should_skip(step, batch_ids=batches.ids(step, rank)):
                continue
            lr = lr_at(step, args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y, ids = batches.get(step, rank)
            x, y = x.to(device), y.to(device)
            record = args.logit_every > 0 and rank == 0 and step % args.logit_every == 0
            if record:
                model.set_record_logits(True)
            _, loss = model(x, y)
            max_logit = model.max_attn_logit() if record else None
            if record:
                model.set_record_logits(False)
            loss.backward()
            grads = [p.grad.reshape(-1) for p in params]
            flat = torch.cat(grads + [loss.detach().reshape(1)])
            if world > 1:  # one collective: gradients plus the loss, averaged
                dist.all_reduce(flat)
                flat /= world
            gn = float(flat[:-1].norm())
            global_loss = float(flat[-1])
            if world > 1:
                offset = 0
                for p, g in zip(params, grads):
                    p.grad.copy_(flat[offset : offset + g.numel()].view_as(p.grad))
                    offset += g.numel()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            local_loss = float(loss.detach())
            sg.step(
                step=step,
                loss=local_loss,
                grad_norm=gn,
                lr=lr,
                batch_ids=ids,
                tokens=x.numel(),
                total_steps=args.steps,
            )
            last = step
            if sg.should_checkpoint(step, every=ckpt_every) and rank == 0:
                sg.save_checkpoint(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step,
                    },
                    step=step,
                )
            if rank == 0:
                history.append((step, global_loss))
                rec = {
                    "step": step,
                    "loss": global_loss,
                    "grad_norm": gn,
                    "lr": lr * lr_scale,
                    "max_logit": max_logit,
                    "t": time.time() - t0,
                }
                if metrics:
                    metrics.write(json.dumps(rec) + "\n")
                if on_step:
                    on_step(rec)
                if args.log_every and step % args.log_every == 0:
                    ml = f" max_logit {max_logit:.1f}" if max_logit is not None else ""
                    print(
                        f"step {step:5d} loss {global_loss:.4f} lr {lr * lr_scale:.3e} "
                        f"gnorm {gn:.3g}{ml} "
                        f"({time.time() - t0:.1f}s)",
                        flush=True,
                    )
            # every rank sees the same averaged loss, so every rank stops at the same step
            bad_streak = 0 if math.isfinite(global_loss) else bad_streak + 1
            if args.nan_patience and bad_streak >= args.nan_patience:
                stopped_on_nan = True
                if rank == 0:
                    print(
                        f"note: loss non-finite for {bad_streak} steps (since step "
                        f"{step - bad_streak + 1}); stopping early at step {step}",
                        flush=True,
                    )
                break
    finally:
        if metrics:
            metrics.close()
    sg.close()
    wall = time.time() - t0
    if rank == 0 and history:
        losses = [loss for _, loss in history]
        tail = losses[-50:]
        spike = first_spike(losses, [s for s, _ in history])
        print(
            f"finished: last step {last}, final loss (mean of last {len(tail)}) "
            f"{sum(tail) / len(tail):.4f}, min {min(losses):.4f}, first spike "
            f"{spike if spike is not None else 'none'}, {wall:.1f}s",
            flush=True,
        )
    if world > 1 and dist.is_initialized():
        dist.barrier()  # nobody tears down (rank 0 hosts the store) while a peer is still talking
        dist.destroy_process_group()
    return {"last_step": last, "stopped_on_nan": stopped_on_nan, "history": history, "wall": wall}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
