"""Supervisor scale: N simulated ranks through the real collector, engine, machine and journal.

No training and no Ray: a simulated group stands in for the rank agents (the one fake: what
cannot run here is a thousand ranks). Everything behind it is the real supervisor: the
:class:`~spikeguard.supervisor.controller.Controller` and its loop (``run()``, polling every
tick), the collector validating every line, the built-in ``default`` policy in the engine, the
recovery machine, a real journal on disk (fsynced per event), ``reports.jsonl`` and
``status.json``.

Traffic, as a lockstep data-parallel job sends it: every simulated second each rank finishes
one step and sends a heartbeat; every 200 steps the heartbeat is a full report of 24 layers
(erank ratio, grade, attention entropies, max logit) and the LM head's log Z. Lines are encoded
by the SDK's encoder (``workers/encode.py``), as a rank sends them. The controller ticks 4 times
per simulated second (its default 250 ms poll); the second's lines arrive on its first tick.
The simulation runs as fast as the supervisor goes, so CPU per simulated second is the share of
a core the supervisor needs at the real rate.

A warm-up (not measured) sends the reports of steps 0..1000 so that the per-layer medians exist;
the measured phase runs steps 1001..1200. Injected: loss spikes in 8 fresh ranks every 10 steps
(the heartbeat path: ``loss-spike`` fires on the third spiking step), and an attention-entropy
collapse in 8 ranks at the reports of steps 1000 and 1200 (the report path:
``entropy-low`` fires at 1200, inside the report burst of every rank; with the loss flat the
default policy only warns on it). To journal many
decisions in one run, this bench's copy of the default policy says ``notify`` where the
original says ``recover``: the path from message to the first journaled event is the same
(``alert`` instead of ``incident``), and the run goes on instead of stopping the group.
Decision latency: from the moment the poll hands the tick's lines to the controller to the
moment the decision's event is fsynced in the journal.

    python3 bench/bench_scale.py [--ranks 1024 4096] [--profile FILE] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import math
import random
import re
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import percentile, table
from spikeguard.supervisor.controller import Controller
from spikeguard.supervisor.launch.interface import KillReport, LaunchedRank, RankPoll
from spikeguard.workers.contract.signals import summarize
from spikeguard.workers.encode import encode_line

LAYERS = 24
REPORT_EVERY = 200
TICKS_PER_SECOND = 4
WARM_UNTIL = 1000
"""The last step of the warm-up (a report step)."""
SPIKE_EVERY = 10
SPIKE_RANKS = 8
SPIKE_LEN = 4
NAN_OFFSET = 5
"""Non-finite losses start this many steps after each spike onset (their own fresh ranks)."""
COLLAPSE_RANKS = 8
RECOVERING_RULES = (
    "grade-drop",
    "entropy-collapse",
    "loss-climb",
    "loss-spike",
    "non-finite-loss",
)


def bench_policy() -> Any:
    """The built-in default policy with ``recover`` turned into ``notify`` for the rules that
    watch training signals (see the module docstring)."""
    import spikeguard.policies as pol

    text = (Path(pol.__file__).parent / "default.yaml").read_text()
    for name in RECOVERING_RULES:
        pattern = rf"(- name: {re.escape(name)}\n(?:(?!  - name:).*\n)*?\s+action: )recover"
        text, n = re.subn(pattern, r"\1notify", text)
        if n != 1:
            raise RuntimeError(f"rule {name} of default.yaml has no 'action: recover' to change")
    return pol.loader.load_policy_text(text, "default.yaml (bench: recover -> notify)")


class SimGroup:
    """The simulated ranks: the traffic of one simulated second per :meth:`advance`."""

    def __init__(self, ranks: int, last_step: int, seed: int = 0) -> None:
        self.ranks = ranks
        self.last_step = last_step
        self.generation = 0
        self.step = -1
        self.rng = random.Random(seed)
        self.pending: list[list[bytes]] = [[] for _ in range(ranks)]
        self.spiking: dict[int, int] = {}  # rank -> last spiking step
        self.collapsing: set[int] = set()
        self.fresh = list(range(ranks))
        self.rng.shuffle(self.fresh)
        self.injected: dict[tuple[int, int], str] = {}
        """(rank, step) where a rule should fire -> the rule."""
        self.arrived: dict[int, tuple[float, float]] = {}
        """step -> (perf_counter, process_time) when the poll handed its lines to the controller."""
        self.gen_cpu = 0.0
        """CPU seconds spent making lines (not the supervisor's work)."""
        self.lines = 0
        self.bytes = 0

    # -- the Group protocol ----------------------------------------------------------------
    def launch(self, *, generation: int, **_: Any) -> list[LaunchedRank]:
        self.generation = generation
        for r in range(self.ranks):
            self._put(r, "hello", 0, world_size=self.ranks, pid=10_000 + r, host="sim")
        return [
            LaunchedRank(rank=r, pid=10_000 + r, generation=generation, report="sim", port=0)
            for r in range(self.ranks)
        ]

    def poll(self) -> list[RankPoll]:
        out = [
            RankPoll(rank=r, generation=self.generation, lines=tuple(lines), rx_age_s=0.0)
            for r, lines in enumerate(self.pending)
        ]
        if any(self.pending):
            self.pending = [[] for _ in range(self.ranks)]
            self.arrived[self.step] = (time.perf_counter(), time.process_time())
        return out

    def kill(self, grace_s: float = 0.0) -> KillReport:
        return KillReport(duration_s=0.0)

    def request(self, payload: dict[str, Any]) -> int:
        return self.ranks

    # -- traffic ------------------------------------------------------------------------------
    def advance(self, *, reports_only: bool = False) -> None:
        """The next simulated second: every rank's heartbeat (or report) of the next step."""
        t0 = time.thread_time()
        self.step = s = self.step + (REPORT_EVERY if reports_only and self.step >= 0 else 1)
        fires_in_time = s + 2 <= self.last_step
        if (
            s > WARM_UNTIL
            and s % SPIKE_EVERY == 0
            and len(self.fresh) >= SPIKE_RANKS
            and fires_in_time
        ):
            for _ in range(SPIKE_RANKS):  # fresh ranks (a rule fires once per rank it holds on)
                r = self.fresh.pop()
                self.spiking[r] = s + SPIKE_LEN - 1
                self.injected[(r, s + 2)] = "loss-spike"  # 3 steps in a row
        nans = set()
        if (
            s > WARM_UNTIL
            and s % SPIKE_EVERY == NAN_OFFSET
            and len(self.fresh) >= SPIKE_RANKS
            and fires_in_time
        ):
            for _ in range(SPIKE_RANKS):  # fresh ranks: one NaN loss each
                r = self.fresh.pop()
                nans.add(r)
                self.injected[(r, s)] = "non-finite-loss"  # on the first message
        if s == WARM_UNTIL:
            for _ in range(COLLAPSE_RANKS):
                r = self.fresh.pop()
                self.collapsing.add(r)
                # alone (the loss flat), a collapse is the default policy's warning
                self.injected[(r, WARM_UNTIL + REPORT_EVERY)] = "entropy-low"
        for r in range(self.ranks):
            loss = 2.0 + self.rng.gauss(0.0, 0.02)
            if self.spiking.get(r, -1) >= s:
                loss *= 2.0
            if r in nans:
                loss = math.nan
            fields = {"loss": loss, "lr": 1e-3, "grad_norm": 1.0 + self.rng.random() * 0.1}
            if s % REPORT_EVERY == 0:
                layers = self._layers(r in self.collapsing and s >= WARM_UNTIL)
                self._put(r, "report", s, layers=layers, summary=summarize(layers), **fields)
            else:
                self._put(r, "heartbeat", s, **fields)
        self.gen_cpu += time.thread_time() - t0

    def _layers(self, collapsed: bool) -> dict[str, dict[str, float]]:
        rng = self.rng
        layers = {}
        for i in range(LAYERS):
            norm = 0.8 + rng.random() * 0.05
            layers[f"blocks.{i}"] = {
                "erank_ratio": 0.75 + rng.random() * 0.05,
                "grade": 7,
                "attn_entropy_mean": 3.0 + rng.random() * 0.1,
                "attn_entropy_min": 2.5 + rng.random() * 0.1,
                "attn_entropy_min_norm": norm * (0.1 if collapsed and i == 5 else 1.0),
                "max_logit": 10.0 + rng.random(),
            }
        layers["lm_head"] = {"logz_mean": 5.0 + rng.random() * 0.1, "logz_max": 7.0}
        return layers

    def _put(self, rank: int, type_: str, step: int, **fields: Any) -> None:
        msg = {
            "v": 1,
            "type": type_,
            "run": "scale",
            "gen": self.generation,
            "rank": rank,
            "step": step,
            "t": time.time(),
            **fields,
        }
        _, line = encode_line(msg)
        self.pending[rank].append(line.rstrip(b"\n"))
        self.lines += 1
        self.bytes += len(line)


class Decisions:
    """A notifier: when each decision's ``alert`` was journaled (called right after the fsync)."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[float, float], dict[str, Any]]] = []

    def handle(self, event: dict[str, Any]) -> None:
        if event.get("kind") == "alert" and not event.get("resolved"):
            self.seen.append(((time.perf_counter(), time.process_time()), event))


def run_scale(
    ranks: int, measured_steps: int, profile: str | None = None, tmp: str | None = None
) -> dict[str, Any]:
    """One run with ``ranks`` simulated ranks; returns its row of the table."""
    last = WARM_UNTIL + measured_steps
    group = SimGroup(ranks, last)
    decisions = Decisions()
    from spikeguard.policies import Engine

    run_dir = tempfile.mkdtemp(prefix=f"sg-scale-{ranks}-", dir=tmp)
    phase: dict[str, Any] = {"tick": 0}

    def on_tick(c: Controller) -> None:
        phase["tick"] += 1
        if phase["tick"] % TICKS_PER_SECOND:
            return  # the other ticks of the simulated second poll nothing new
        if group.step < WARM_UNTIL:
            group.advance(reports_only=True)
            if group.step == WARM_UNTIL:  # the measured phase starts after this report burst
                phase.update(cpu=time.process_time(), wall=time.perf_counter())
                phase["gen_cpu"], phase["lines"] = group.gen_cpu, group.lines
                if profile:
                    phase["prof"] = cProfile.Profile()
                    phase["prof"].enable()
        elif group.step < last:
            group.advance()
            if group.step % 50 == 0:
                print(f"    {ranks} ranks: step {group.step}/{last}", flush=True)
        else:
            c.stop_file.write_text("bench done")

    controller = Controller(
        run_dir=run_dir,
        run_id="scale",
        group=group,
        engine=Engine(bench_policy()),
        cmd=["sim"],
        env={},
        world_size=ranks,
        hang_timeout_s=60.0,
        first_heartbeat_timeout_s=300.0,
        sinks=[decisions],
        poll_interval_s=0.0,
        on_tick=on_tick,
        remote_reap=False,
        reap_interval_s=1e9,
    )
    appends: list[tuple[float, float]] = []  # (when, ms) of each journal append (fsynced)
    record = controller.journal.record

    def timed_record(event: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return record(event)
        finally:
            appends.append((t0, (time.perf_counter() - t0) * 1e3))

    controller.journal.record = timed_record  # type: ignore[method-assign]
    controller.run()
    cpu = time.process_time() - phase["cpu"]
    wall = time.perf_counter() - phase["wall"]
    if profile:
        phase["prof"].disable()
        phase["prof"].dump_stats(f"{profile}.{ranks}")
    controller.close()
    gen_cpu = group.gen_cpu - phase["gen_cpu"]
    lines = group.lines - phase["lines"]
    sup_cpu = cpu - gen_cpu
    wall_ms: dict[str, list[float]] = {"loss-spike": [], "non-finite-loss": []}  # heartbeats
    cpu_ms: dict[str, list[float]] = {"loss-spike": [], "non-finite-loss": []}
    burst_ms: list[float] = []  # report path (entropy-collapse inside the report burst)
    burst_cpu_ms: list[float] = []
    fired = set()
    for (at, at_cpu), ev in decisions.seen:
        key = (ev.get("rank"), ev.get("step"))
        rule = group.injected.get(key)
        if rule is None or rule != ev.get("rule"):
            continue
        fired.add(key)
        arrived, arrived_cpu = group.arrived[ev["step"]]
        on_wall, on_cpu = (
            (wall_ms[rule], cpu_ms[rule]) if rule in wall_ms else (burst_ms, burst_cpu_ms)
        )
        on_wall.append((at - arrived) * 1e3)
        on_cpu.append((at_cpu - arrived_cpu) * 1e3)
    return {
        "ranks": ranks,
        "msgs": lines,
        "msg/s needed": lines / measured_steps,
        "ingest msg/s": lines / sup_cpu,
        "spike p50 ms": percentile(wall_ms["loss-spike"], 50),
        "spike p99 ms": percentile(wall_ms["loss-spike"], 99),
        "spike p99 cpu": percentile(cpu_ms["loss-spike"], 99),
        "nan p50 ms": percentile(wall_ms["non-finite-loss"], 50),
        "nan p99 ms": percentile(wall_ms["non-finite-loss"], 99),
        "nan p99 cpu": percentile(cpu_ms["non-finite-loss"], 99),
        "burst ms": max(burst_ms) if burst_ms else math.nan,
        "burst cpu ms": max(burst_cpu_ms) if burst_cpu_ms else math.nan,
        "fired": f"{len(fired)}/{len(group.injected)}",
        "journal max ms": max((ms for t, ms in appends if t >= phase["wall"]), default=math.nan),
        "cores": sup_cpu / measured_steps,
        "cpu/wall": sup_cpu / wall,
        "rss MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "dropped": sum(controller.collector.dropped.values()),
        "other alerts": len(decisions.seen) - len(fired),
    }


COLUMNS = (
    ("ranks", "d"),
    ("msgs", "d"),
    ("msg/s needed", ".0f"),
    ("ingest msg/s", ".0f"),
    ("spike p50 ms", ".1f"),
    ("spike p99 ms", ".1f"),
    ("spike p99 cpu", ".1f"),
    ("nan p50 ms", ".1f"),
    ("nan p99 ms", ".1f"),
    ("nan p99 cpu", ".1f"),
    ("burst ms", ".1f"),
    ("burst cpu ms", ".1f"),
    ("fired", ""),
    ("journal max ms", ".1f"),
    ("cores", ".3f"),
    ("cpu/wall", ".2f"),
    ("rss MB", ".0f"),
    ("dropped", "d"),
    ("other alerts", "d"),
)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print its table; returns the rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--steps", type=int, default=200, help="measured simulated seconds (>= 200)")
    p.add_argument("--profile", default=None, help="cProfile the measured phase to FILE.<ranks>")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    p.add_argument(
        "--tmp",
        default=None,
        help="where the run directory (journal, reports.jsonl) is made; default: the system's "
        "temporary directory (/dev/shm: a journal whose fsync never waits for a disk)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.ranks, args.steps = [32], 200
    if args.steps < REPORT_EVERY:
        p.error(f"--steps must reach the next report ({REPORT_EVERY})")
    print(
        f"bench_scale: {args.ranks} simulated ranks, {LAYERS} layers, heartbeat 1/s, report "
        f"every {REPORT_EVERY} steps, {args.steps} measured seconds",
        flush=True,
    )
    rows = []
    for n in args.ranks:
        t0 = time.time()
        rows.append(run_scale(n, args.steps, args.profile, args.tmp))
        print(f"  {n} ranks done in {time.time() - t0:.0f}s", flush=True)
    print()
    print(table(rows, COLUMNS))
    print(
        "cores: supervisor CPU seconds per simulated second (the share of one core it needs at "
        "the real rate); spike p50/p99: loss spikes (heartbeat path, decided on their third "
        "step: the rank is pending), nan p50/p99: a NaN loss (decided on its first message), "
        "poll handed the lines over -> decision fsynced in the journal, in wall time (cpu: the "
        "supervisor's own CPU time); burst: the slowest entropy collapse decided inside the "
        "report burst of every rank; journal max: the slowest journal append (an fsync) of the "
        "measured phase, which the decisions after it in its tick wait for"
    )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
