"""Accelerator health from NVML, read by the rank agent for its rank's GPUs.

Two halves. :func:`signals_of` is pure: the readings of a rank's GPUs (:class:`GpuReading`)
become its signals (``gpu_ecc_errors``, ``gpu_xid``, ``gpu_throttle`` and its flags, ``gpu_lost``;
those policies read: :data:`spikeguard.supervisor.decide.health.GPU_SIGNALS`).
:class:`NvmlReader` takes the readings with ``pynvml`` (the ``nvidia-ml-py`` package, the
optional extra ``spikeguard[gpu]``), and :class:`HealthMonitor` reads every
:data:`HEALTH_EVERY_S` seconds on a thread of its own (an NVML call on a failing GPU can block),
keeping the latest signals for the agent's polls.

Without NVML (the package is not installed, or ``nvmlInit`` fails: a CPU machine, no driver)
there are no readings and no signals: nothing is reported, nothing is judged. No Ray here.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

HEALTH_EVERY_S = 5.0
"""How often a rank agent reads its GPUs' health from NVML."""
NVML_MODULE = "pynvml"
"""The module the reader imports (``nvidia-ml-py`` installs it)."""

THROTTLE_THERMAL = 0x20 | 0x40
"""NVML's clock-event reasons for thermal slowdown (software 0x20, hardware 0x40)."""
THROTTLE_POWER = 0x04 | 0x80
"""NVML's clock-event reasons for power capping (software power cap 0x04, hardware power brake
0x80)."""
THROTTLE_HW_SLOWDOWN = 0x08
"""NVML's hardware slowdown (thermal or power, the hardware does not say which)."""
THROTTLE_BITS = THROTTLE_THERMAL | THROTTLE_POWER | THROTTLE_HW_SLOWDOWN
"""The reasons ``gpu_throttle`` reports; the others (idle, application clocks, sync boost) are
no trouble."""

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuReading:
    """What NVML said of one GPU at one read."""

    gpu: str
    """The device id the rank was given (an index, or a ``GPU-…`` UUID)."""
    lost: bool = False
    """NVML answers that the GPU is lost (fallen off the bus), or cannot find it any more."""
    ecc_uncorrected: int | None = None
    """Uncorrectable ECC errors since the driver loaded (volatile); None: not supported."""
    throttle: int | None = None
    """The current clock-event (throttle) reasons, NVML's bitmask; None: not supported."""
    xids: tuple[int, ...] = ()
    """Critical XID errors NVML reported since the last read."""


def signals_of(readings: Sequence[GpuReading]) -> dict[str, Any] | None:
    """A rank's accelerator signals from its GPUs' readings (None: no readings, no signals).

    ``gpu_ecc_errors``: uncorrectable ECC errors, summed over its GPUs; ``gpu_xid``: the
    latest critical XID code since the previous read (0: none); ``gpu_throttle``: the thermal
    and power reasons of :data:`THROTTLE_BITS` any of its GPUs is throttled for (a bitmask, 0:
    none), also as ``gpu_throttle_thermal`` and ``gpu_throttle_power``; ``gpu_lost``: one of
    its GPUs fell off the bus."""
    if not readings:
        return None
    throttle = 0
    for r in readings:
        throttle |= (r.throttle or 0) & THROTTLE_BITS
    xids = [x for r in readings for x in r.xids]
    return {
        "gpu_ecc_errors": sum(r.ecc_uncorrected or 0 for r in readings),
        "gpu_xid": xids[-1] if xids else 0,
        "gpu_throttle": throttle,
        "gpu_throttle_thermal": bool(throttle & (THROTTLE_THERMAL | THROTTLE_HW_SLOWDOWN)),
        "gpu_throttle_power": bool(throttle & THROTTLE_POWER),
        "gpu_lost": any(r.lost for r in readings),
        "gpus": [r.gpu for r in readings],
    }


class NvmlReader:
    """Reads the health of a set of GPUs with an NVML binding (``nvml``: the ``pynvml`` module,
    already initialised); :meth:`open` makes one, or None without NVML."""

    def __init__(self, nvml: Any, gpus: Sequence[str]) -> None:
        self.nvml = nvml
        self.gpus = tuple(gpus)
        self._events: Any = None
        """NVML's event set the GPUs' critical XID errors arrive on (None: unsupported)."""
        self._handles: dict[str, Any] = {}
        self._uuids: dict[str, str] = {}
        """GPU UUID -> the rank's device id (an XID event names its GPU by handle)."""

    @classmethod
    def open(cls, gpus: Sequence[str], module: Any = None) -> NvmlReader | None:
        """A reader for ``gpus``, or None: no GPUs, no NVML binding installed, or NVML does not
        start (no driver). ``module``: the binding (None: import :data:`NVML_MODULE`; a test
        passes a fake)."""
        if not gpus:
            return None
        nvml = module
        if nvml is None:
            try:
                nvml = importlib.import_module(NVML_MODULE)
            except ImportError:
                return None
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError (no driver, no library), or a broken binding
            log.info("NVML unavailable (%s): no accelerator health is reported", e)
            return None
        reader = cls(nvml, gpus)
        reader._watch_xids()
        return reader

    def _handle(self, gpu: str) -> Any:
        if gpu not in self._handles:
            n = self.nvml
            if gpu.startswith(("GPU-", "MIG-")):
                self._handles[gpu] = n.nvmlDeviceGetHandleByUUID(gpu)
            else:
                self._handles[gpu] = n.nvmlDeviceGetHandleByIndex(int(gpu))
        return self._handles[gpu]

    def _watch_xids(self) -> None:
        """Register for the GPUs' critical XID errors (best effort: unsupported on some)."""
        n = self.nvml
        try:
            self._events = n.nvmlEventSetCreate()
            for gpu in self.gpus:
                handle = self._handle(gpu)
                self._uuids[_text(n.nvmlDeviceGetUUID(handle))] = gpu
                n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, self._events)
        except Exception as e:
            log.info("NVML XID events unavailable (%s)", e)
            self._events = None

    def _lost(self, e: BaseException) -> bool:
        """An NVML error that means the GPU is gone (lost, or no longer found)."""
        n = self.nvml
        value = getattr(e, "value", None)
        gone = {getattr(n, "NVML_ERROR_GPU_IS_LOST", 15), getattr(n, "NVML_ERROR_NOT_FOUND", 6)}
        return value in gone

    def _read_one(self, gpu: str, xids: tuple[int, ...]) -> GpuReading:
        n = self.nvml
        try:
            handle = self._handle(gpu)
        except n.NVMLError as e:
            return GpuReading(gpu=gpu, lost=self._lost(e), xids=xids)
        values: dict[str, Any] = {}
        reads = {
            "ecc_uncorrected": lambda: int(
                n.nvmlDeviceGetTotalEccErrors(
                    handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                )
            ),
            "throttle": lambda: _throttle_reasons(n, handle),
        }
        for name, read in reads.items():
            try:
                values[name] = read()
            except n.NVMLError as e:
                if self._lost(e):
                    return GpuReading(gpu=gpu, lost=True, xids=xids)
                values[name] = None  # not supported on this GPU
        return GpuReading(gpu=gpu, xids=xids, **values)

    def _drain_xids(self) -> dict[str, tuple[int, ...]]:
        """The critical XID errors that arrived since the last read, by GPU (never waits)."""
        out: dict[str, list[int]] = {}
        if self._events is None:
            return {}
        n = self.nvml
        for _ in range(64):  # bounded: a storm of events must not hold the read
            try:
                data = n.nvmlEventSetWait(self._events, 0)
            except n.NVMLError:
                break  # a timeout: none left
            try:
                gpu = self._uuids.get(_text(n.nvmlDeviceGetUUID(data.device)), self.gpus[0])
            except n.NVMLError:
                gpu = self.gpus[0]  # its GPU is gone: the error is the rank's all the same
            out.setdefault(gpu, []).append(int(data.eventData))
        return {g: tuple(x) for g, x in out.items()}

    def read(self) -> list[GpuReading]:
        """One reading per GPU."""
        xids = self._drain_xids()
        return [self._read_one(g, xids.get(g, ())) for g in self.gpus]

    def close(self) -> None:
        """Let go of NVML (best effort)."""
        try:
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
            self.nvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: Any) -> str:
    """A string NVML returned (bytes from older bindings)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _throttle_reasons(nvml: Any, handle: Any) -> int:
    """The GPU's current clock-event (throttle) reasons: NVML's newer call where the binding and
    the driver have it, else the older name of the same call."""
    newer = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if newer is not None:
        try:
            return int(newer(handle))
        except nvml.NVMLError as e:
            if getattr(e, "value", None) != getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                raise
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


class HealthMonitor:
    """Reads a rank's GPUs every ``every_s`` seconds on a daemon thread; :meth:`latest` is what
    the agent's poll carries (None until the first read, and always without NVML)."""

    def __init__(self, reader: NvmlReader, every_s: float = HEALTH_EVERY_S) -> None:
        self.reader, self.every_s = reader, every_s
        self._latest: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, gpus: Sequence[str], module: Any = None, every_s: float = HEALTH_EVERY_S
    ) -> HealthMonitor | None:
        """Watch ``gpus`` (the rank's, as Ray assigned them); None without GPUs or NVML."""
        reader = NvmlReader.open(gpus, module)
        if reader is None:
            return None
        monitor = cls(reader, every_s)
        monitor.read_now()
        monitor._thread = threading.Thread(target=monitor._loop, daemon=True, name="sg-nvml")
        monitor._thread.start()
        return monitor

    def read_now(self) -> dict[str, Any] | None:
        """Read once and keep it; the signals read."""
        try:
            signals = signals_of(self.reader.read())
        except Exception as e:  # a reader that fails must never take the agent with it
            log.warning("reading NVML failed: %s", e)
            return self.latest()
        with self._lock:
            if signals is not None and self._latest is not None:
                # an XID seen since the last poll stays until a poll takes it (:meth:`take`)
                signals["gpu_xid"] = signals["gpu_xid"] or self._latest.get("gpu_xid", 0)
            self._latest = signals
        return signals

    def latest(self) -> dict[str, Any] | None:
        """The latest signals (a copy)."""
        with self._lock:
            return None if self._latest is None else dict(self._latest)

    def take(self) -> dict[str, Any] | None:
        """The latest signals for a poll; an XID in them is reported once."""
        with self._lock:
            if self._latest is None:
                return None
            out = dict(self._latest)
            self._latest["gpu_xid"] = 0
            return out

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read_now()

    def stop(self) -> None:
        """Stop reading and let go of NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 1)
        self.reader.close()
