"""What a sharded checkpoint costs the training step: no save vs synchronous vs asynchronous.

Starts ``--world`` real processes (gloo on CPU), each an FSDP2 rank of an MLP (``--depth``
layers of ``--width``), and runs the same job three times in the same processes, one after the
other: without checkpoints, saving a sharded checkpoint through the SDK every ``--every`` steps
synchronously (``sg.save_checkpoint(..., sharded=True)``), and the same asynchronously
(``async_save=True``). It prints, side by side, the mean step time of each (the wait for the last
asynchronous save included), its ratio to the run without saves, and how long a step waited
for each save on average (for the asynchronous save: the staging copy and the wait for the
previous one).

    python3 bench/bench_sharded_ckpt.py                      # ~100 MiB of weights, 2 ranks
    python3 bench/bench_sharded_ckpt.py --width 64 --steps 6 # a smoke run (what the tests run)

On a machine with few cores the background write competes with training for the CPU, so the
asynchronous ratio here is an upper bound of what a GPU job (whose step runs on the GPU) pays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--width", type=int, default=1792, help="MLP width")
    p.add_argument("--depth", type=int, default=4, help="MLP layers")
    p.add_argument("--batch", type=int, default=64, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=40, help="steps per mode")
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(args: argparse.Namespace):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _run_mode(mode: str, args: argparse.Namespace, model, optimizer, sg, rank: int) -> dict:
    """One mode: ``args.steps`` steps; returns rank 0's timings."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    waits: list[float] = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sg.step(step=step, loss=float(loss))
        if mode != "no save" and step % args.every == args.every - 1:
            t = time.perf_counter()
            msd, osd = get_state_dict(model, optimizer)
            sg.save_checkpoint(
                {"model": msd, "optimizer": osd},
                step=step,
                sharded=True,
                async_save=mode == "async save",
                mode=mode,
            )
            waits.append(time.perf_counter() - t)
    sg.wait_checkpoint()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {"mode": mode, "step_s": elapsed / args.steps, "waits": waits}


def rank_main(args: argparse.Namespace) -> None:
    """One rank: the three modes in turn; rank 0 prints its timings as JSON."""
    import torch
    import torch.distributed as dist
    from spikeguard.workers import attach
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in _model(args).parameters())
    results = []
    for i, mode in enumerate(("no save", "sync save", "async save")):
        directory = os.path.join(args.dir, f"mode{i}")
        os.environ["SPIKEGUARD_GENERATION"] = str(i)  # a fresh name per mode
        sg = attach(model, report="off", ckpt_dir=directory, sample_every=10**9)
        results.append(_run_mode(mode, args, model, optimizer, sg, rank))
        sg.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"params": params, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def table(args: argparse.Namespace, data: dict) -> str:
    """The timings, side by side."""
    params = data["params"]
    weights_mib = params * 4 / 2**20
    lines = [
        f"sharded checkpoint cost: {args.world} ranks (FSDP2, gloo, CPU), {params / 1e6:.1f}M "
        f"parameters ({weights_mib:.0f} MiB of weights + {2 * weights_mib:.0f} MiB of AdamW "
        f"moments per checkpoint), a save every {args.every} steps, {args.steps} steps per mode",
        f"{'mode':<12}{'step time':>12}{'x no save':>12}{'wait per save':>16}",
    ]
    base = data["results"][0]["step_s"]
    for r in data["results"]:
        waits = r["waits"]
        wait = f"{1000 * sum(waits) / len(waits):.0f} ms" if waits else "-"
        lines.append(
            f"{r['mode']:<12}{1000 * r['step_s']:>9.1f} ms{r['step_s'] / base:>12.2f}{wait:>16}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rank_main:
        rank_main(args)
        return 0
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-sharded-")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    cmd = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])]
    cmd += ["--rank-main", "--dir", args.dir]
    procs = []
    for rank in range(args.world):
        rank_env = {
            **env,
            "RANK": str(rank),
            "WORLD_SIZE": str(args.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    outputs = [p.communicate() for p in procs]
    if own_dir:
        shutil.rmtree(args.dir, ignore_errors=True)
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            sys.stderr.write(err.decode(errors="replace")[-3000:])
            return 1
    data = json.loads(outputs[0][0].decode().strip().splitlines()[-1])
    print(table(args, data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
