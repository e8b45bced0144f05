"""The signals seam: a signal is declared once (``contract.signals.SignalSpec``) and every reader
derives from the declarations: the policy language, ``policy explain``, the engine, the rank's
summary, the metrics exporter, the post-mortem. A throw-away signal, declared for one test only,
flows through all of them; a reader that kept its own list of names would miss it."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from spikeguard.policies import Engine, PolicyError, load_policy_text
from spikeguard.policies.explain import explain
from spikeguard.policies.testing import heartbeat, hello, report
from spikeguard.supervisor.observe import report as html_report
from spikeguard.supervisor.observe import rundata
from spikeguard.supervisor.observe.metrics import PREFIX, MetricsFold, RankSnapshot, Snapshot
from spikeguard.workers.contract import signals as contract
from spikeguard.workers.contract.signals import MetricFamily, SignalSpec, declared

SPIKE = SignalSpec(
    name="test_spikiness",
    probe="residual",
    display="the test spikiness",
    metric=MetricFamily(name="test_spikiness_ratio", help="a throw-away signal of the seam's test"),
    aggregate="max",
)
"""A per-layer signal no reader has heard of: the highest over layers is the worst."""

POLICY = """
version: 1
name: seam
warm_in: 0 steps
rules:
  - name: spiky
    when: test_spikiness > 0.5
    action: notify
  - name: spiky-layer
    when: test_spikiness > 2 * median(3)
    layers: "*"
    action: notify
"""


def test_a_declared_signal_flows_through_the_policy_the_engine_and_the_metrics():
    with declared(SPIKE):
        assert "test_spikiness" in contract.SIGNALS and "test_spikiness" in contract.LAYER_SIGNALS
        assert contract.AGGREGATE["test_spikiness"] == "max"

        # the policy language accepts it, and explain words it from its declaration
        policy = load_policy_text(POLICY)
        assert [r.when.cadence() for r in policy.rules] == [{"report"}, {"report"}]
        assert all(r.uses_layer_signals for r in policy.rules)
        text = explain(policy)
        assert "the test spikiness (highest over the rank's layers) is above 0.5" in text

        # the rank's summary aggregates it as declared, and the engine evaluates it per report
        msg = report(
            0, 10, {"blocks.0": {"test_spikiness": 0.2}, "blocks.1": {"test_spikiness": 0.9}}
        )
        assert msg["summary"]["test_spikiness"] == 0.9
        engine = Engine(policy)
        assert engine.observe(hello(0)) == []
        for step in (1, 2, 3):  # per-layer history: three samples of each layer, then the spike
            quiet = {"blocks.0": {"test_spikiness": 0.2}, "blocks.1": {"test_spikiness": 0.1}}
            assert engine.observe(report(0, step, quiet)) == []
            assert engine.observe(heartbeat(0, step + 1)) == []
        fired = engine.observe(msg)
        assert sorted((d.rule, d.layer) for d in fired) == [
            ("spiky", "blocks.1"),
            ("spiky-layer", "blocks.1"),
        ]
        assert "the test spikiness of any layer rises above 2× its median" in text

        # the metrics fold exports it under its declared family, per rank and per layer
        fold = MetricsFold(run="seam")
        rank = RankSnapshot(rank=0, step=10, summary=msg["summary"], layers=msg["layers"])
        fold.tick(
            Snapshot(phase="running", generation=0, lr_scale=1.0, launched_at=0.0, ranks=(rank,))
        )
        families = {f.name: f for f in fold.families(now=1.0)}
        per_rank = families[PREFIX + "rank_test_spikiness_ratio"]
        assert per_rank.kind == "gauge"
        assert per_rank.help == "a throw-away signal of the seam's test (highest over layers)"
        assert per_rank.samples == ((("seam", "0"), 0.9),)
        per_layer = families[PREFIX + "layer_test_spikiness_ratio"]
        assert per_layer.help == "a throw-away signal of the seam's test, per layer"
        assert dict(per_layer.samples) == {
            ("seam", "0", "blocks.0"): 0.2,
            ("seam", "0", "blocks.1"): 0.9,
        }

    # undone after the block: the name is unknown again everywhere
    assert "test_spikiness" not in contract.SIGNALS
    with pytest.raises(PolicyError, match="unknown signal 'test_spikiness'"):
        load_policy_text(POLICY)
    fold = MetricsFold(run="seam")
    assert not [f for f in fold.families(now=1.0) if "test_spikiness" in f.name]


def test_the_post_mortem_keeps_a_declared_signal_per_step_the_worst_over_ranks():
    low = dataclasses.replace(
        SPIKE, name="test_floor", metric=MetricFamily(name="test_floor", help="x"), aggregate="min"
    )
    with declared(SPIKE, low):
        into: dict[str, float] = {}
        for v in (0.3, 0.8, 0.5):
            rundata._keep_worst(into, "test_spikiness", v)
            rundata._keep_worst(into, "test_floor", v)
        assert into == {"test_spikiness": 0.8, "test_floor": 0.3}
        gens: dict[int, rundata.Generation] = {}
        rundata._fold(report(0, 3, test_spikiness=0.7, test_floor=0.1), gens, {})
        assert gens[0].signals[3]["test_spikiness"] == 0.7
        assert gens[0].signals[3]["test_floor"] == 0.1


def test_declaring_checks_the_declaration_and_a_failed_block_undoes_it():
    with pytest.raises(ValueError, match="already declared"):
        contract.declare(dataclasses.replace(SPIKE, name="grade"))
    with pytest.raises(ValueError, match="metric 'grade' is 'grade'"):
        contract.declare(dataclasses.replace(SPIKE, metric=MetricFamily(name="grade", help="x")))
    with pytest.raises(ValueError, match="say where trouble lies"):
        dataclasses.replace(SPIKE, aggregate="mean")
    with pytest.raises(ValueError, match="is the worst high"):
        dataclasses.replace(SPIKE, worst="low")
    with pytest.raises(ValueError, match="unknown probe kind"):
        dataclasses.replace(SPIKE, probe="mlp")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError), declared(SPIKE):
        raise RuntimeError
    assert "test_spikiness" not in contract.SIGNALS
    with pytest.raises(ValueError, match="already declared"), declared(SPIKE, SPIKE):
        pass
    assert "test_spikiness" not in contract.SIGNALS


def test_aggregations_over_layers():
    mean = dataclasses.replace(SPIKE, aggregate="mean", worst="high")
    last = dataclasses.replace(
        SPIKE,
        name="test_last",
        metric=MetricFamily(name="test_last", help="x"),
        aggregate="last",
        worst="low",
    )
    with declared(mean, last):
        assert contract.aggregate("test_spikiness", [1.0, 2.0, 6.0]) == 3.0
        assert contract.aggregate("test_last", [1.0, 2.0, 6.0]) == 6.0
        assert math.isnan(contract.aggregate("test_last", [math.nan, 2.0]))
        assert contract.worse("test_spikiness", 1.0, 2.0) == 2.0
        assert contract.worse("test_last", 1.0, 2.0) == 1.0
        layers = {"a": {"test_spikiness": 1.0, "test_last": 4.0}, "b": {"test_spikiness": 3.0}}
        summary = contract.summarize(layers)
        assert summary["test_spikiness"] == 2.0 and summary["test_last"] == 4.0
    assert contract.aggregate("max_logit", [1.0, 5.0]) == 5.0
    assert contract.aggregate("grade", [3, 1]) == 1


def test_the_views_are_the_declarations_in_order():
    names = tuple(s.name for s in contract.specs())
    assert names == contract.SIGNALS
    assert tuple(s.name for s in contract.specs(per_layer=True)) == contract.LAYER_SIGNALS
    assert tuple(s.name for s in contract.specs(per_layer=False)) == contract.STEP_SIGNALS
    assert contract.LAYER_SIGNALS + contract.STEP_SIGNALS + contract.AGENT_SIGNALS == (
        contract.SIGNALS
    )
    assert {contract.spec_of(n).probe for n in contract.AGENT_SIGNALS} == {"agent"}
    assert dict(contract.AGGREGATE) == {s.name: s.aggregate for s in contract.specs(per_layer=True)}
    assert "loss" not in contract.AGGREGATE and 3 not in contract.SIGNALS
    with pytest.raises(KeyError, match="undeclared signal 'nope'"):
        contract.spec_of("nope")


# -- the places that cannot derive, checked against the declarations ------------------------------


def test_every_per_step_signal_is_a_field_the_metrics_snapshot_keeps():
    # a per-step signal's value comes from the collector's view of the rank (a field per signal)
    fields = {f.name for f in dataclasses.fields(RankSnapshot)}
    assert set(contract.STEP_SIGNALS) <= fields


def test_the_report_heatmaps_are_declared_signals_the_run_data_keeps_per_layer():
    assert tuple(html_report.HEATMAPS) == rundata.HEATMAP_SIGNALS
    assert set(rundata.HEATMAP_SIGNALS) <= set(contract.LAYER_SIGNALS)


def test_every_probe_kind_writes_exactly_its_declared_signals():
    torch = pytest.importorskip("torch")
    from spikeguard.workers import probes as P
    from test_probes import TinyGPT

    kinds = set(typing.get_args(contract.ProbeKind)) - {"step", "agent"}
    assert kinds == set(P.PROBE_KINDS)
    assert {s.probe for s in contract.specs(per_layer=True)} == kinds

    torch.manual_seed(0)
    model = TinyGPT()
    probes = P.Probes(model, strict=True)
    with probes.sampling(1):
        model(torch.randint(0, 50, (2, 16)))
    results = probes.collect()
    names = {
        "residual": probes.residual_names,
        "attention": probes.attention_names,
        "lm_head": probes.lm_head_names,
    }
    assert set(names) == kinds
    for kind, modules in names.items():
        assert modules, kind
        for module in modules:
            assert set(results[module]) == set(P.declared_signals(kind)), (kind, module)
