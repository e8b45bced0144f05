"""Reporting never blocks: the latency of ``Session.step()`` with a live and a stalled reader.

The rank side is the real SDK (``spikeguard.workers.attach`` on the example's GPT, reporting
over a Unix socket as under the supervisor). The supervisor side is the real agent reader
(the rank agent's report socket, ``spikeguard.supervisor.launch.agent._Process``) in its own
process, drained by a poll every 250 ms as the controller does. Two variants, alternated round
by round in one run:

* ``attached``  the reader reads and is polled;
* ``stalled``   the reader process is SIGSTOPped for the whole phase: nothing reads, the socket
  buffer and then the SDK's bounded queue fill up, and messages are dropped and counted.
  After the phase the reader is resumed (SIGCONT) and the bench waits until the ``dropped``
  note with the SDK's count reaches it.

Each step runs the model's forward pass on sampled steps (so reports carry real per-layer
signals) and sleeps ``--pace-ms`` otherwise: a training loop far faster than a real one, the
worst case for the channel. Only the ``step()`` call is timed. Target: p99 < 1 ms in both.

    python3 bench/bench_step_latency.py [--steps 4000] [--rounds 3] [--sample-every 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import types
from typing import Any

from common import interleaved, percentile, table

VARIANTS = ("attached", "stalled")
POLL_S = 0.25
"""The controller's default poll interval."""


def reader_main(path: str, conn: Any, rank_pid: int) -> None:
    """The supervisor side: the real agent report socket at ``path``, polled every 250 ms.

    Answers ``"stats"`` on ``conn`` with the lines received so far and the largest ``dropped``
    count the rank reported.
    """
    import json

    from spikeguard.supervisor.launch.agent import _Process

    # the agent's handling of one rank process: its report socket, reader threads and buffer
    # (RankAgent.start would also spawn the process; here the rank is this bench's main process)
    agent = _Process(rank=0, generation=0, sock=path)
    # the agent accepts reports only from the process it started (SO_PEERCRED: that pid, or its
    # session): here that process is the bench's main one
    agent.proc = types.SimpleNamespace(pid=rank_pid)
    agent.started.set()
    agent.serve()
    lines = 0
    dropped = 0
    conn.send("ready")
    while True:
        if conn.poll(POLL_S):
            if conn.recv() == "stop":
                return
            conn.send({"lines": lines, "dropped": dropped})
        for line in agent.drain()[0]:
            lines += 1
            if b'"dropped"' in line:
                msg = json.loads(line)
                if msg.get("type") == "dropped":
                    dropped = max(dropped, int(msg.get("count") or 0))


def run_phase(variant: str, args: argparse.Namespace, model: Any, x: Any) -> dict[str, Any]:
    """One phase: a fresh reader process and a fresh session, ``args.steps`` timed steps."""
    import spikeguard.workers as sgw
    from spikeguard.workers import contract

    ctx = mp.get_context("spawn")
    sockdir = tempfile.mkdtemp(prefix="sg-lat-")
    path = os.path.join(sockdir, "rank0.sock")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reader_main, args=(path, child, os.getpid()), daemon=True)
    proc.start()
    if not parent.poll(60) or parent.recv() != "ready":
        raise RuntimeError("the reader process did not start")
    os.environ[contract.ENV_REPORT] = f"unix://{path}"
    sg = sgw.attach(model, sample_every=args.sample_every, queue_size=args.queue_size)
    os.environ.pop(contract.ENV_REPORT)
    time.sleep(0.2)  # the channel connects
    stopped = variant == "stalled"
    if stopped:
        os.kill(proc.pid, signal.SIGSTOP)
    times: list[float] = []
    pace = args.pace_ms / 1e3
    try:
        for step in range(args.steps):
            if step % args.sample_every == 0:
                model(x)  # the armed probes compute this step's signals
            elif pace:
                time.sleep(pace)
            t0 = time.perf_counter()
            sg.step(step=step, loss=2.0, grad_norm=1.0, lr=1e-3)
            times.append(time.perf_counter() - t0)
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
    dropped = sg.channel.dropped
    sg.close(timeout=args.drain_s)  # "done" carries the dropped count once the writer catches up
    sent = sg.channel.sent
    deadline = time.monotonic() + args.drain_s
    while True:
        parent.send("stats")
        stats = parent.recv()
        if stats["lines"] >= sent and stats["dropped"] >= dropped:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    parent.send("stop")
    proc.join(5)
    if proc.is_alive():
        proc.kill()
    return {
        "variant": variant,
        "times": times,
        "dropped": dropped,
        "dropped_seen": stats["dropped"],
        "sent": sent,
        "received": stats["lines"],
    }


def summarize(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: p50/p99/max of step() over all its phases, and the drop counts."""
    rows = []
    for variant in VARIANTS:
        mine = [p for p in phases if p["variant"] == variant]
        if not mine:
            continue
        times = [t * 1e3 for p in mine for t in p["times"]]
        rows.append(
            {
                "variant": variant,
                "steps": len(times),
                "p50 ms": percentile(times, 50),
                "p99 ms": percentile(times, 99),
                "max ms": max(times),
                "dropped": sum(p["dropped"] for p in mine),
                "reported": sum(p["dropped_seen"] for p in mine),
                "sent": sum(p["sent"] for p in mine),
                "received": sum(p["received"] for p in mine),
            }
        )
    return rows


COLUMNS = (
    ("variant", ""),
    ("steps", "d"),
    ("p50 ms", ".3f"),
    ("p99 ms", ".3f"),
    ("max ms", ".2f"),
    ("dropped", "d"),
    ("reported", "d"),
    ("sent", "d"),
    ("received", "d"),
)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print its table; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4000, help="timed steps per phase")
    p.add_argument("--rounds", type=int, default=3, help="phases per variant, alternated")
    p.add_argument("--sample-every", type=int, default=10, help="the SDK's probe interval")
    p.add_argument("--pace-ms", type=float, default=0.5, help="sleep between unsampled steps")
    p.add_argument("--queue-size", type=int, default=1024, help="the SDK's queue bound")
    p.add_argument("--drain-s", type=float, default=20.0, help="wait for the dropped note")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds = 300, 1

    import torch
    from spikeguard.examples.model import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(seq_len=64)
    x = torch.randint(0, 256, (16, 64))
    print(
        f"bench_step_latency: {args.rounds} round(s) x {VARIANTS}, {args.steps} steps each, "
        f"sample every {args.sample_every}, pace {args.pace_ms} ms, queue {args.queue_size}",
        flush=True,
    )
    phases = []
    for r, variant in interleaved(VARIANTS, args.rounds):
        t0 = time.time()
        phase = run_phase(variant, args, model, x)
        phases.append(phase)
        print(
            f"  round {r + 1} {variant:<8}: p99 {percentile(phase['times'], 99) * 1e3:.3f} ms, "
            f"dropped {phase['dropped']} (reader told {phase['dropped_seen']}), "
            f"{time.time() - t0:.1f}s",
            flush=True,
        )
    rows = summarize(phases)
    print()
    print(table(rows, COLUMNS))
    worst = max(r["p99 ms"] for r in rows)
    print(f"target p99 < 1 ms in both: {'met' if worst < 1.0 else 'MISSED'} (worst {worst:.3f})")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
