"""The incident chart's series are chosen, not declared: they must still be ones the observation
carries and (but for step and loss) declared signals."""

from spikeguard.supervisor.decide.observation import CHART_KEYS
from spikeguard.supervisor.sinks.charts import PANELS
from spikeguard.workers.contract.signals import SIGNALS


def test_the_chart_panels_read_series_the_observation_carries():
    carried = {k + ("s" if k == "step" else "") for k in CHART_KEYS}
    assert {key for key, _, _ in PANELS} <= carried


def test_every_chart_series_but_step_and_loss_is_a_declared_signal():
    assert set(CHART_KEYS) - {"step", "loss"} <= set(SIGNALS)
