"""What a sharded checkpoint costs the training step: no save vs synchronous vs asynchronous, on
a local directory and on S3.

Starts ``--world`` real processes (gloo on CPU), each an FSDP2 rank of an MLP (``--depth``
layers of ``--width``), and runs the same job five times in the same processes, one after the
other: without checkpoints; saving a sharded checkpoint through the SDK every ``--every`` steps
into a local directory synchronously (``sg.save_checkpoint(..., sharded=True)``) and
asynchronously (``async_save=True``); and the same two into an ``s3://`` prefix of a local
S3-compatible server that the bench starts itself (moto in server mode, tests/s3server.py, the
environment of the ranks pointing at it), each rank writing its shard straight to the store. It
prints, side by side, the mean step time of each mode (the wait for the last asynchronous save
included), its ratio to the run without saves, how long a step waited for each save on average
(for the asynchronous save: the staging copy and the wait for the previous one), how long a save
took from the call to its commit marker (in the background, for the asynchronous save), the
checkpoint's size and that size over that time. Each mode makes its store's client before its
clock starts (importing s3fs and botocore is a cost of the process, once, not of a save).

    python3 bench/bench_sharded_ckpt.py            # ~150 MiB per checkpoint, 2 ranks
    python3 bench/bench_sharded_ckpt.py --smoke    # tiny sizes (tests/test_bench_sharded.py)

On a machine with few cores the background write competes with training for the CPU, so the
asynchronous ratio here is an upper bound of what a GPU job (whose step runs on the GPU) pays.
The S3 rows measure spikeguard's own path to an object store (the upload through s3fs and
botocore, hashing as it writes, the commit marker's PUT) against a server on the loopback: no
network latency, no real S3 throughput, and the server shares the machine's CPUs with the ranks.
Without moto's server or s3fs (the ``test`` extra) the S3 rows are left out, saying why.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench-sharded"
"""The bucket the bench creates on its S3 server."""
MODES = (
    ("no save", None, False),
    ("sync posix", "posix", False),
    ("async posix", "posix", True),
    ("sync s3", "s3", False),
    ("async s3", "s3", True),
)
"""(name, where the checkpoints go — None: no saves —, asynchronous) of every mode, in order."""
SMOKE = {"width": 32, "depth": 1, "batch": 4, "steps": 4, "every": 2}
"""The sizes of ``--smoke``."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--width", type=int, default=1792, help="MLP width")
    p.add_argument("--depth", type=int, default=4, help="MLP layers")
    p.add_argument("--batch", type=int, default=64, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=40, help="steps per mode")
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the tests")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--s3-url", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


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


def _committed_at(info: Any) -> float:
    """When the checkpoint ``info`` was committed (its marker's ``created``), as ``time.time()``."""
    return dt.datetime.fromisoformat(info.created).timestamp()


def _run_mode(mode: str, async_save: bool | None, args, model, optimizer, sg, rank: int) -> dict:
    """One mode (``async_save`` None: no saves): ``args.steps`` steps; returns rank 0's timings:
    the mean step time, each save's wait in the step, and each save's time from the call to its
    commit and its size."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    waits: list[float] = []
    calls: list[tuple[float, Any]] = []  # (time.time() at the call, its checkpoint or pending save)
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
        if async_save is not None and step % args.every == args.every - 1:
            t, called = time.perf_counter(), time.time()
            msd, osd = get_state_dict(model, optimizer)
            out = sg.save_checkpoint(
                {"model": msd, "optimizer": osd},
                step=step,
                sharded=True,
                async_save=async_save,
                mode=mode,
            )
            waits.append(time.perf_counter() - t)
            calls.append((called, out))
    sg.wait_checkpoint()
    dist.barrier()
    elapsed = time.perf_counter() - start
    saves = []
    for called, out in calls if rank == 0 else []:  # rank 0 wrote the markers
        info = out.result() if async_save else out
        saves.append({"save_s": _committed_at(info) - called, "bytes": info.size})
    return {"mode": mode, "step_s": elapsed / args.steps, "waits": waits, "saves": saves}


def rank_main(args: argparse.Namespace) -> None:
    """One rank: the modes in turn (the S3 ones when ``--s3-url`` is given); rank 0 prints its
    timings as JSON."""
    import torch
    import torch.distributed as dist
    from spikeguard.workers import attach
    from spikeguard.workers.checkpoint.storage import storage_for
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
    places = {"posix": args.dir, "s3": args.s3_url}
    results = []
    for i, (mode, where, async_save) in enumerate(MODES):
        if where is not None and not places[where]:
            continue
        directory = f"{places[where or 'posix']}/mode{i}"
        # the store's client made before the clock starts (s3fs and botocore imported, a
        # session set up): a one-time cost of the process, not of a save
        storage_for(directory).exists(directory)
        os.environ["SPIKEGUARD_GENERATION"] = str(i)  # a fresh name per mode
        sg = attach(model, report="off", ckpt_dir=directory, sample_every=10**9)
        saving = None if where is None else async_save
        results.append(_run_mode(mode, saving, args, model, optimizer, sg, rank))
        sg.close()
        dist.barrier()
        if rank == 0:
            storage_for(directory).remove_tree(directory, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"params": params, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def _mean(values: list[float]) -> float | None:
    """The mean of ``values``; None when there are none."""
    return sum(values) / len(values) if values else None


def _size(mib: float) -> str:
    """A size given in MiB, in KiB below 1 MiB (the smoke run's)."""
    return f"{mib:.1f} MiB" if mib >= 1 else f"{mib * 1024:.1f} KiB"


def table(args: argparse.Namespace, data: dict) -> str:
    """The timings, side by side."""
    params = data["params"]
    weights_mib = params * 4 / 2**20
    lines = [
        f"sharded checkpoint cost: {args.world} ranks (FSDP2, gloo, CPU), {params / 1e6:.1f}M "
        f"parameters ({weights_mib:.0f} MiB of weights + {2 * weights_mib:.0f} MiB of AdamW "
        f"moments per checkpoint), a save every {args.every} steps, {args.steps} steps per mode",
        f"{'mode':<12}{'step time':>12}{'x no save':>12}{'wait per save':>16}"
        f"{'save time':>12}{'size':>12}{'MiB/s':>9}",
    ]
    base = data["results"][0]["step_s"]
    for r in data["results"]:
        wait = _mean(r["waits"])
        save = _mean([s["save_s"] for s in r["saves"]])
        size = _mean([s["bytes"] / 2**20 for s in r["saves"]])
        cells = [
            f"{1000 * r['step_s']:>9.1f} ms",
            f"{r['step_s'] / base:>12.2f}",
            f"{1000 * wait:>13.0f} ms" if wait is not None else f"{'-':>16}",
            f"{1000 * save:>9.0f} ms" if save is not None else f"{'-':>12}",
            f"{_size(size):>12}" if size is not None else f"{'-':>12}",
            f"{size / save:>9.1f}" if size is not None and save else f"{'-':>9}",
        ]
        lines.append(f"{r['mode']:<12}" + "".join(cells))
    return "\n".join(lines)


def _start_s3() -> tuple[Any, str | None]:
    """The bench's S3 server (tests/s3server.py's) with its bucket, or None and why not."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import s3server
    except ImportError as e:  # pytest, which it needs for its fixtures
        return None, f"tests/s3server.py cannot be imported: {e}"
    reason = s3server.missing()
    if reason is not None:
        return None, reason
    server = s3server.S3Server()
    server.client().create_bucket(Bucket=BUCKET)
    return server, None


def _objects_left(server: Any) -> int:
    """How many objects the ranks left in the bucket (each mode removes its checkpoints)."""
    return server.client().list_objects_v2(Bucket=BUCKET).get("KeyCount", 0)


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
    server, why_not = _start_s3()
    if server is not None:
        from s3server import store_environment

        env = store_environment(env, server.endpoint)
        cmd += ["--s3-url", f"s3://{BUCKET}/checkpoints"]
    try:
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
        left = _objects_left(server) if server is not None else 0
    finally:
        if server is not None:
            server.stop()
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            sys.stderr.write(err.decode(errors="replace")[-3000:])
            return 1
    data = json.loads(outputs[0][0].decode().strip().splitlines()[-1])
    print(table(args, data))
    if server is None:
        print(f"s3 rows left out: {why_not}")
    else:
        print(
            f"s3 rows: a local moto server on 127.0.0.1 (no network latency, no real S3 "
            f"throughput; it shares the CPUs with the ranks); {left} objects left after the run"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
