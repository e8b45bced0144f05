"""A torchrun-style DDP rank with a straggler inside its model, for ``tests/test_step_time.py``.

A small MLP trained with ``DistributedDataParallel`` over gloo, attached to the real SDK (the
DDP wrapper is what is attached), reporting every step to ``OUT_DIR/rank{RANK}.jsonl``. From
step ``--slow-from`` on, rank ``--slow-rank``'s forward is slowed *inside the model*: a module
of it sleeps ``--slow-sleep`` seconds in its forward. The other rank then waits in the gradient
all-reduce, so both ranks step at the same pace; only their ``step_time`` differs. Each step
loads its batch inside ``sg.phase("data")``.

    python straggler_rank.py OUT_DIR [--steps 30] [--slow-from 12] [--slow-rank 1]
"""

from __future__ import annotations

import argparse
import os
import time

import spikeguard.workers as sgw
import torch
import torch.distributed as dist
from torch import nn


class Straggle(nn.Module):
    """Sleeps ``seconds`` in its forward on rank ``slow_rank`` from step ``slow_from`` on (the
    script sets :attr:`step`); the identity otherwise."""

    def __init__(self, rank: int, slow_rank: int, slow_from: int, seconds: float) -> None:
        super().__init__()
        self.slow = rank == slow_rank
        self.slow_from = slow_from
        self.seconds = seconds
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow and self.step >= self.slow_from:
            time.sleep(self.seconds)
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--slow-from", type=int, default=12)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-sleep", type=float, default=0.05)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    straggle = Straggle(rank, args.slow_rank, args.slow_from, args.slow_sleep)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), straggle, nn.Linear(256, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sg = sgw.attach(ddp, report=f"jsonl://{args.out_dir}/rank{rank}.jsonl", sample_every=1_000_000)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        with sg.phase("data"):
            x = torch.randn(64, 64, generator=gen)
            y = x.sum(dim=1, keepdim=True)
        straggle.step = step
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sg.step(step=step, loss=loss.item())
    sg.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
