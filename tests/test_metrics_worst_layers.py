"""``/metrics`` exports, per per-layer signal, its worst ``max_layers`` layers under their own
name and folds the rest into ``layer="(other)"``: a real layer that falls after the first names
filled the cap gets its own series; memory stays at ``max_layers`` names per signal."""

from __future__ import annotations

import inspect
import math
from typing import Any

from spikeguard.supervisor import job
from spikeguard.supervisor.observe.metrics import (
    OTHER_LAYERS,
    PREFIX,
    MetricsFold,
    RankSnapshot,
    Snapshot,
)


def tick(fold: MetricsFold, *ranks: dict[str, dict[str, Any]], now: float = 1.0) -> None:
    snaps = tuple(RankSnapshot(rank=i, step=10, layers=layers) for i, layers in enumerate(ranks))
    fold.tick(Snapshot(phase="running", generation=1, lr_scale=1.0, launched_at=0.0, ranks=snaps))


def series(fold: MetricsFold, metric: str) -> dict[tuple[str, str], float]:
    """(rank, layer) -> value of ``spikeguard_layer_<metric>``."""
    (fam,) = [f for f in fold.families(now=2.0) if f.name == PREFIX + "layer_" + metric]
    return {(labels[1], labels[2]): v for labels, v in fam.samples}


def folded(fold: MetricsFold) -> float:
    (fam,) = [f for f in fold.families(now=2.0) if f.name == PREFIX + "layers_folded"]
    return fam.samples[0][1]


def test_a_layer_that_falls_after_the_cap_filled_gets_its_own_series():
    fold = MetricsFold(run="r", max_layers=4)
    healthy = {f"noise.{i}": {"grade": 7} for i in range(10)}  # reported first, filling the cap
    tick(fold, healthy)
    assert {layer for _, layer in series(fold, "grade")} == {*list(healthy)[:4], OTHER_LAYERS}
    tick(fold, {**healthy, "blocks.9.attn": {"grade": 1}})
    grades = series(fold, "grade")
    assert grades[("0", "blocks.9.attn")] == 1  # the worst layer, not the first reported
    assert grades[("0", OTHER_LAYERS)] == 7
    assert len(grades) == 4 + 1 and folded(fold) == 11 - 4


def test_the_worst_is_judged_over_ranks_per_signal_by_its_declaration():
    fold = MetricsFold(run="r", max_layers=1)
    rank0 = {"a": {"grade": 6, "max_logit": 50.0}, "b": {"grade": 5, "max_logit": 1.0}}
    rank1 = {"a": {"grade": 2, "max_logit": 2.0}, "b": {"grade": 6, "max_logit": 3.0}}
    tick(fold, rank0, rank1)
    # grade: lower is worse (a reads 2 on rank 1); max_logit: higher is worse (a reads 50)
    assert {layer for _, layer in series(fold, "grade")} == {"a", OTHER_LAYERS}
    assert series(fold, "grade")[("1", OTHER_LAYERS)] == 6  # b on rank 1
    assert {layer for _, layer in series(fold, "max_attn_logit")} == {"a", OTHER_LAYERS}
    tick(fold, {"a": {"grade": 6}, "b": {"grade": float("nan")}})  # NaN is the worst of all
    grades = series(fold, "grade")
    assert math.isnan(grades[("0", "b")]) and grades[("0", OTHER_LAYERS)] == 6


def test_an_exported_series_stays_until_something_strictly_worse_comes():
    fold = MetricsFold(run="r", max_layers=2)
    tick(fold, {"a": {"grade": 3}, "b": {"grade": 4}})
    tick(fold, {"a": {"grade": 3}, "b": {"grade": 4}, "c": {"grade": 4}})  # a tie: b stays
    assert {layer for _, layer in series(fold, "grade")} == {"a", "b", OTHER_LAYERS}
    tick(fold, {"a": {"grade": 3}, "c": {"grade": 5}})  # b no longer reported: the least bad
    assert {layer for _, layer in series(fold, "grade")} == {"a", "c"}
    tick(fold, {"a": {"grade": 3}, "c": {"grade": 5}, "d": {"grade": 0}})
    assert {layer for _, layer in series(fold, "grade")} == {"a", "d", OTHER_LAYERS}


def test_memory_stays_at_max_layers_names_per_signal_whatever_the_names():
    fold = MetricsFold(run="r", max_layers=8)
    for t in range(30):  # every tick, 500 new names on each of 2 ranks
        layers = {
            f"t{t}.{i}": {"grade": (i * 7 + t) % 8, "attn_entropy_min": float(i % 5)}
            for i in range(500)
        }
        tick(fold, layers, {f"r1.{k}": v for k, v in layers.items()}, now=float(t))
    assert fold._layers and all(len(names) <= 8 for names in fold._layers.values())
    for metric in ("grade", "attn_entropy_min_nats"):
        exported = series(fold, metric)
        assert len(exported) <= 2 * (8 + 1)  # ranks x (max_layers + (other))


def test_max_layers_0_exports_no_per_layer_series():
    fold = MetricsFold(run="r", max_layers=0)
    tick(fold, {"a": {"grade": 1}, "b": {"grade": 2}})
    assert series(fold, "grade") == {} and folded(fold) == 2
    rank = [f for f in fold.families(now=2.0) if f.name == PREFIX + "rank_grade"]
    assert rank and rank[0].samples == ()  # the rank_ family reads the summary (none here)


def test_the_job_spec_documents_the_label_the_exporter_uses():
    doc = job.MetricsSettings.model_fields["max_layers"].description or ""
    assert f'layer="{OTHER_LAYERS}"' in doc and "_other" not in inspect.getsource(job)
    assert "worst" in doc
