"""A small FSDP2 job (gloo, CPU) that saves sharded checkpoints through the SDK.

Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (WORLD_SIZE 1: no
torch.distributed at all, a plain model). A two-layer MLP sharded with ``fully_shard`` trains
``--steps`` steps of AdamW on data that is a function of the step, and saves a sharded
checkpoint at each step of ``--save-at`` (``--async``: with ``async_save``). Under a resume plan
(``SPIKEGUARD_RESUME``) it first resumes. Each rank appends its report to ``--report`` (a JSONL
channel per rank) and rank 0 writes, to ``--out``:

* ``saved-step{N}.pt``: the full model and optimizer state at save step N (gathered);
* ``resumed.pt``: the full state right after ``resume``, with the step it returned;
* ``result.json``: the step resume returned, the paths and checksums saves returned.

``--kill-rank R --kill-at N``: rank R SIGKILLs itself in the middle of the save of step N,
right after DCP wrote its shard and before fsyncing it (the peers then fail in a collective).
``--request R:N:ID`` (repeatable): the supervisor's checkpoint request ``ID`` reaches rank R
right before its step N (put where the channel's reader thread puts what the supervisor sends),
so that the ranks see one request at different steps.
``--fence-at N``: in the middle of the save of step N (after every rank passed the pre-flight),
rank 0 writes generation 99 into the fence file (``SPIKEGUARD_FENCE_FILE``), as the supervisor
does when it replaces a generation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import spikeguard.workers as sgw
import torch
import torch.distributed as dist
from spikeguard.workers.checkpoint import sharded_name


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", default="")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report", default="off")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--fence-at", type=int, default=-1)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--low-rank", type=int, default=-1, help="this rank trains on rank-one inputs")
    p.add_argument("--request", action="append", default=[], help="RANK:STEP:ID")
    return p.parse_args(argv)


def model_for(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 8)
    )


def batch(step: int, rank: int, low_rank: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's data at ``step``; rank-one inputs (a collapsed representation: a low grade)
    when ``low_rank``."""
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    x = torch.randn(32, 16, generator=g)
    if low_rank:
        x = torch.outer(torch.randn(32, generator=g), torch.randn(16, generator=g))
    return x, torch.sin(x[:, :8])


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state on rank 0 (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optimizer": osd.get("state", {})}


def mid_save(directory: str, action) -> None:
    """Run ``action()`` once DCP has written a shard into ``directory`` (before its fsync; on
    an object store, once the first bytes of the shard's upload were written)."""
    if "://" in directory:
        _mid_upload(directory, action)
        return
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(directory) and target.endswith(".distcp"):
            action()
        real_fsync(fd)

    os.fsync = fsync


def _mid_upload(directory: str, action) -> None:
    """``mid_save`` on an object store: ``action()`` after the first write into a shard's upload."""
    from spikeguard.workers.checkpoint import dcp_storage

    real = dcp_storage.StoreFileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as f:
            url = os.fspath(path)
            if url.startswith(directory) and url.endswith(".distcp"):
                real_write = f.write

                def write(b):
                    n = real_write(b)
                    action()
                    return n

                f.write = write
            yield f

    dcp_storage.StoreFileSystem.create_stream = create_stream


class Requests:
    """The supervisor's checkpoint requests as this rank receives them: ``arrive(step)`` hands
    the session (through its channel's ``poll_requests``, as the reader thread would) those
    that reach this rank right before ``step``."""

    def __init__(self, sg, rank: int, specs: list[str]) -> None:
        self.due: dict[int, list[dict]] = {}
        for spec in specs:
            r, step, rid = (int(x) for x in spec.split(":"))
            if r == rank:
                request = {"type": "checkpoint", "id": rid, "reason": "test"}
                self.due.setdefault(step, []).append(request)
        self.arrived: list[dict] = []
        sg.channel.poll_requests = self.poll

    def arrive(self, step: int) -> None:
        self.arrived += self.due.pop(step, [])

    def poll(self) -> list[dict]:
        out, self.arrived = self.arrived, []
        return out


def main() -> int:
    args = parse()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    model = model_for(args.width)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    report = args.report if args.report == "off" else f"{args.report}.rank{rank}.jsonl"
    sg = sgw.attach(
        model,
        report=report,
        ckpt_dir=args.ckpt_dir,
        sample_every=4,
        probe_patterns={"residual": ["0", "1"], "attention": [], "lm_head": []},
    )
    out = Path(args.out)
    start = sg.resume(model, optimizer)
    result: dict = {"start": start, "saved": {}}
    if sg.plan is not None:
        resumed = full_state(model, optimizer)
        if rank == 0:
            torch.save({"step": start, **resumed}, out / "resumed.pt")
    save_at = {int(s) for s in args.save_at.split(",") if s}
    requests = Requests(sg, rank, args.request)
    for step in range(start, args.steps):
        requests.arrive(step)
        x, y = batch(step, rank, rank == args.low_rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sg.step(step=step, loss=loss.item())
        if not sg.should_checkpoint(step, collective=True) and step not in save_at:
            continue
        directory = os.path.join(args.ckpt_dir, sharded_name(step, 0))
        if step == args.kill_at and rank == args.kill_rank:
            mid_save(directory, lambda: os.kill(os.getpid(), signal.SIGKILL))
        if step == args.fence_at and rank == 0:
            fence = Path(os.environ["SPIKEGUARD_FENCE_FILE"])
            mid_save(directory, lambda fence=fence: fence.write_text("99"))
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        snapshot = full_state(model, optimizer)
        if rank == 0:
            torch.save(snapshot, out / f"saved-step{step}.pt")
        try:
            saved = sg.save_checkpoint(
                {"model": msd, "optimizer": osd},
                step=step,
                sharded=True,
                async_save=args.async_save,
            )
        except Exception as e:  # the test reads what each rank was told
            result["saved"][str(step)] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if args.async_save:
            result["saved"][str(step)] = {"pending": saved.path}
        else:
            result["saved"][str(step)] = {"path": saved.path, "sha256": saved.sha256}
    last = sg.wait_checkpoint()
    if last is not None:
        result["last_async"] = {"path": last.path, "sha256": last.sha256, "grade": last.grade}
    sg.close()
    (out / f"result-rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
