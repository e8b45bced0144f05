"""Accelerator health from NVML, with a fake NVML (a GPU cannot run here): readings become
signals (pure), the reader takes them through the few ``pynvml`` calls it uses, the monitor keeps
the latest for the agent's polls, and without NVML nothing is reported."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from spikeguard.supervisor.launch import nvml
from spikeguard.supervisor.launch.agent import RankAgent
from spikeguard.supervisor.launch.nvml import GpuReading, HealthMonitor, NvmlReader, signals_of


class NVMLError(Exception):
    """pynvml's error: ``value`` is NVML's return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeGpu:
    """One device's state, as the fake NVML reports it."""

    def __init__(self, index: int) -> None:
        self.uuid = f"GPU-{index:04d}"
        self.ecc: int | None = 0
        self.throttle = 0
        self.lost = False


def fake_nvml(count: int = 2, init_error: int | None = None) -> Any:
    """A module implementing the pynvml calls the reader makes, over ``count`` fake GPUs
    (``init_error``: nvmlInit fails with that code, as on a machine without a driver)."""
    m = types.ModuleType("fake_pynvml")
    gpus = [FakeGpu(i) for i in range(count)]
    events: list[Any] = []
    m.gpus, m.events, m.NVMLError = gpus, events, NVMLError
    m.NVML_ERROR_GPU_IS_LOST, m.NVML_ERROR_NOT_FOUND, m.NVML_ERROR_TIMEOUT = 15, 6, 10
    m.NVML_ERROR_NOT_SUPPORTED = 3
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC = 1, 0
    m.nvmlEventTypeXidCriticalError = 8

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)

    def live(h: FakeGpu) -> FakeGpu:
        if h.lost:
            raise NVMLError(15)
        return h

    def ecc(h: FakeGpu, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)  # uncorrectable, since the driver loaded
        if live(h).ecc is None:
            raise NVMLError(3)
        return int(h.ecc or 0)

    def wait(es: Any, timeout_ms: int) -> Any:
        if not events:
            raise NVMLError(10)
        return events.pop(0)

    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetHandleByUUID = lambda u: next(g for g in gpus if g.uuid == u)
    m.nvmlDeviceGetUUID = lambda h: live(h).uuid.encode()
    m.nvmlDeviceGetTotalEccErrors = ecc
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: live(h).throttle
    m.nvmlEventSetCreate = lambda: "events"
    m.nvmlEventSetFree = lambda es: None
    m.nvmlDeviceRegisterEvents = lambda h, kind, es: None
    m.nvmlEventSetWait = wait
    return m


def xid(m: Any, gpu: int, code: int) -> None:
    """The fake GPU ``gpu`` reports critical XID ``code``."""
    m.events.append(types.SimpleNamespace(device=m.gpus[gpu], eventData=code))


# ---- readings -> signals (pure) ------------------------------------------------------------------
def test_readings_become_a_ranks_signals() -> None:
    healthy = [GpuReading(gpu="0", ecc_uncorrected=0, throttle=0x1)]  # 0x1: idle, no trouble
    assert signals_of(healthy) == {
        "gpu_ecc_errors": 0,
        "gpu_xid": 0,
        "gpu_throttle": 0,
        "gpu_throttle_thermal": False,
        "gpu_throttle_power": False,
        "gpu_lost": False,
        "gpus": ["0"],
    }
    sick = signals_of(
        [
            GpuReading(gpu="0", ecc_uncorrected=2, throttle=0x40, xids=(48,)),
            GpuReading(gpu="1", ecc_uncorrected=None, throttle=0x04, xids=(79,), lost=True),
        ]
    )
    assert sick is not None
    assert sick["gpu_ecc_errors"] == 2 and sick["gpu_xid"] == 79 and sick["gpu_lost"]
    assert sick["gpu_throttle"] == 0x44
    assert sick["gpu_throttle_thermal"] and sick["gpu_throttle_power"]
    assert signals_of([]) is None


# ---- the reader, with a fake NVML ----------------------------------------------------------------
def test_the_reader_reads_ecc_throttling_and_xids_of_its_ranks_gpus() -> None:
    m = fake_nvml(count=3)
    reader = NvmlReader.open(("1", "GPU-0002"), module=m)
    assert reader is not None
    m.gpus[1].ecc, m.gpus[2].throttle = 1, 0x20
    xid(m, 2, 63)
    xid(m, 2, 94)
    first = signals_of(reader.read())
    assert first is not None
    assert (first["gpu_ecc_errors"], first["gpu_xid"], first["gpu_throttle"]) == (1, 94, 0x20)
    assert first["gpus"] == ["1", "GPU-0002"] and not first["gpu_lost"]
    m.gpus[0].ecc = 5  # not one of the rank's GPUs
    again = signals_of(reader.read())
    assert again is not None and again["gpu_xid"] == 0 and again["gpu_ecc_errors"] == 1
    reader.close()


def test_a_gpu_off_the_bus_reads_as_lost_and_an_unsupported_counter_as_none() -> None:
    m = fake_nvml()
    reader = NvmlReader.open(("0", "1"), module=m)
    assert reader is not None
    m.gpus[0].ecc = None  # a GPU without ECC
    m.gpus[1].lost = True
    a, b = reader.read()
    assert a == GpuReading(gpu="0", ecc_uncorrected=None, throttle=0)
    assert b.lost


def test_without_nvml_nothing_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NvmlReader.open(("0",), module=fake_nvml(init_error=9)) is None  # no driver
    assert NvmlReader.open((), module=fake_nvml()) is None  # a CPU rank
    monkeypatch.setitem(sys.modules, nvml.NVML_MODULE, None)  # the package is not installed
    assert NvmlReader.open(("0",)) is None
    assert HealthMonitor.start(("0",)) is None


def test_the_reader_imports_pynvml_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    m = fake_nvml(count=1)
    monkeypatch.setitem(sys.modules, nvml.NVML_MODULE, m)
    reader = NvmlReader.open(("0",))
    assert reader is not None and reader.nvml is m


# ---- the monitor and the agent's poll ------------------------------------------------------------
def test_an_xid_is_reported_by_one_poll_and_a_failure_by_every_poll() -> None:
    m = fake_nvml(count=1)
    monitor = HealthMonitor.start(("0",), module=m, every_s=3600)  # reads here, not on its clock
    assert monitor is not None
    try:
        xid(m, 0, 79)
        monitor.read_now()
        monitor.read_now()  # an XID not yet taken by a poll is kept
        assert (monitor.take() or {})["gpu_xid"] == 79
        assert (monitor.take() or {})["gpu_xid"] == 0
        m.gpus[0].lost = True
        monitor.read_now()
        assert (monitor.take() or {})["gpu_lost"] and (monitor.take() or {})["gpu_lost"]
    finally:
        monitor.stop()


def test_the_agents_poll_carries_its_ranks_gpu_signals() -> None:
    m = fake_nvml(count=2)
    agent = RankAgent(0)
    assert agent.poll().health is None  # nothing watched: no GPUs, nothing reported
    agent.watch_gpus(("1",), nvml=m)
    m.gpus[1].ecc = 3
    assert agent._health is not None
    agent._health.read_now()
    poll = agent.poll()
    assert poll.health is not None and poll.health["gpu_ecc_errors"] == 3
    agent._health.stop()


def test_an_agent_without_nvml_reports_no_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, nvml.NVML_MODULE, None)
    agent = RankAgent(0)
    agent.watch_gpus(("0",))
    assert agent._health is None and agent.poll().health is None
