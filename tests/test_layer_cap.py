"""Layer names are capped per rank, and memory stays bounded (issue #24, item 1).

Before, every new layer name a rank reported became a policy series per signal and a rule
instance, carried into later generations by the rewind snapshots and never freed, and a live
view entry and a report column: six ~1 MB reports with 20,000 new names each grew the
supervisor by ~77 MiB a report. Now :class:`LayerGate` admits the first
``MAX_LAYERS_PER_RANK`` distinct names of each rank, in the collector (before a message is
recorded or evaluated) and again in the policy engine (a replay of any ``reports.jsonl``).
Real collector, real policy engine with the default policy, real tick reader and report file.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spikeguard.policies import Engine, load_policy
from spikeguard.policies.testing import checkpoint
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.intake.tick import ReportLog, TickReader
from spikeguard.supervisor.launch.interface import RankPoll
from spikeguard.workers.contract.messages import MAX_LAYERS_PER_RANK, MAX_LINE_BYTES, LayerGate

CAP = MAX_LAYERS_PER_RANK
NEW = 20_000
"""New layer names in each hostile report (the issue's reproduction)."""
REPORTS = 6
MiB = 1 << 20


def hostile(k: int, *, gen: int, step: int) -> dict[str, Any]:
    """Report ``k``: the model's one real layer ``blocks.0`` first, then NEW names never seen."""
    layers = {"blocks.0": {"grade": 6, "attn_entropy_min_norm": 0.9}}
    layers |= {f"{k}.{i}": {"grade": 5, "attn_entropy_min_norm": 0.9} for i in range(NEW)}
    return {
        "v": 1,
        "type": "report",
        "run": "r",
        "gen": gen,
        "rank": 0,
        "step": step,
        "t": 0.0,
        "at": float(step),
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "layers": layers,
        "summary": {"grade": 5, "attn_entropy_min_norm": 0.9, "worst_layer": f"{k}.0"},
    }


def stream() -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(generation, step, message), each made when asked for: REPORTS hostile reports past the
    default warm-in, each followed by a checkpoint (the engine's rewind snapshots), the last half
    in a relaunched generation that resumed after the second checkpoint (the series are rewound
    and carried over)."""
    for k in range(REPORTS):
        gen, step = (1, 400 + 10 * k) if k < REPORTS // 2 else (2, 390 + 10 * k)
        yield gen, step, hostile(k, gen=gen, step=step)
        yield gen, step, checkpoint(0, step, gen=gen, at=float(step))


def layer_names_kept(engine: Engine) -> set[Any]:
    """Every layer name the engine keeps state for: its series, their rewind snapshots and the
    copy a relaunch rewinds from, and its rule instances (its private tables, read here only)."""
    names = {key[1] for key in engine._series}
    for snap in engine._snapshots.values():
        names |= {key[1] for key in snap}
    names |= {key[1] for key in engine._rewind_from or {}}
    for per_layer in engine._instances.values():
        names |= set(per_layer)
    return names - {None}


def traced_mib() -> float:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] / MiB


@pytest.fixture
def tracing():
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def test_the_gate_admits_the_first_names_of_each_rank_and_counts_the_rest():
    gate = LayerGate(3)
    first = {"a": {}, "b": {}}
    assert gate.admit(0, first) is first  # nothing stripped: the same dict, no copy
    assert gate.admit(0, {"c": {}, "d": {}, "a": {"grade": 1}}) == {"c": {}, "a": {"grade": 1}}
    assert gate.admit(0, {"d": {}, "e": {}}) == {}  # the rank's three names are taken
    again = {"b": {}, "c": {}, "a": {}}
    assert gate.admit(0, again) is again  # admitted names stay admitted
    assert gate.admit(1, {"x": {}, "y": {}}) == {"x": {}, "y": {}}  # per rank
    assert gate.dropped == {0: 3} and gate.admitted(0) == 3 and gate.admitted(1) == 2


def test_memory_stays_bounded_when_every_report_names_20000_new_layers(tmp_path: Path, tracing):
    """The issue's reproduction through intake: collector, tick reader, reports.jsonl and the
    policy engine, as the controller wires them (no Ray: the polls are handed in)."""
    col = Collector(world_size=1, hang_timeout_s=600, first_heartbeat_timeout_s=600)
    engine = Engine(load_policy("default"))
    notes: list[dict[str, Any]] = []
    decisions = []
    reports = ReportLog(tmp_path / "reports.jsonl")
    reader = TickReader(
        collector=col,
        screen=engine,
        reports=reports,
        evaluate=lambda msg: decisions.extend(engine.observe(msg)),
        note=notes.append,
    )
    after: list[float] = []
    gen_now = None
    for gen, step, msg in stream():
        if gen != gen_now:
            col.new_generation(gen, float(step), start_step=step)
            gen_now = gen
        line = json.dumps(msg, separators=(",", ":")).encode()
        assert len(line) <= MAX_LINE_BYTES  # a line the supervisor reads: ~1 MB
        reader.read([RankPoll(rank=0, generation=gen, lines=(line,))], float(step))
        del line, msg
        after.append(traced_mib())
    reports.close()
    growth = after[-1] - after[3]  # from the second report's checkpoint to the last one
    assert growth < 16, f"{growth:.1f} MiB kept over {REPORTS - 2} reports"

    assert len(layer_names_kept(engine)) <= CAP
    assert col.layer_gate.admitted(0) == CAP and len(col.ranks[0].layers) <= CAP
    assert col.layer_gate.dropped[0] == REPORTS * NEW - (CAP - 1)  # every name past the cap
    assert col.dropped["too_many_layers"] == REPORTS  # each report, counted once
    [note] = notes  # journaled once for the rank
    assert note["kind"] == "alert" and note["code"] == "layers_capped"
    assert note["ranks"] == [0] and note["limit"] == CAP and note["step"] == 400
    recorded = [json.loads(x) for x in (tmp_path / "reports.jsonl").read_text().splitlines()]
    kept = [m for m in recorded if m["type"] == "report"]
    assert len(kept) == REPORTS and all(len(m["layers"]) <= CAP for m in kept)
    assert len({name for m in kept for name in m["layers"]}) == CAP
    assert all("blocks.0" in m["layers"] and m["loss"] == 2.0 for m in kept)  # the model's own
    assert engine.layers_dropped == 0  # the engine only ever saw admitted names
    assert not decisions  # healthy values: nothing fires


def test_the_policy_engine_is_bounded_on_its_own(tracing):
    """``policy replay`` of a hostile reports.jsonl: no collector in front of the engine."""
    engine = Engine(load_policy("default"))
    after: list[float] = []
    for _, _, msg in stream():
        engine.observe(msg)
        del msg
        after.append(traced_mib())
    growth = after[-1] - after[3]
    assert growth < 16, f"{growth:.1f} MiB kept over {REPORTS - 2} reports"
    assert len(layer_names_kept(engine)) <= CAP
    assert engine.layers_dropped == REPORTS * NEW - (CAP - 1)
