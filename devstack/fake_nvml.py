"""A fake NVML: the subset of `pynvml` the agent's adapter calls, with the same names, constants,
structures and error classes (taken from nvidia-ml-py itself), over GPUs a test controls.

It answers NotSupported where a real driver would (`FakeGpu.unsupported`, GPUs without NVLink
or GPM), and delivers XID events from a queue like an NVML event set.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    temperature_c: int = 55
    slowdown_c: int = 87  # the thermal margin is the distance to this
    power_mw: int = 350_000
    utilization: tuple[int, int] = (90, 40)  # gpu %, memory %
    memory: tuple[int, int] = (60 * 2**30, 80 * 2**30)  # used, total
    ecc: tuple[int, int] = (0, 0)  # corrected, uncorrected
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrected, pending, failed
    throttle: int = 0
    nvlinks: int = 18
    link_down: set[int] = field(default_factory=set)
    link_errors: dict[tuple[int, str], int] = field(default_factory=dict)  # (link, crc_flit|...) -> count
    tensor_busy: float = 0.5  # 0..1: tensor-core activity GPM reports between two samples
    gpm: bool = True
    processes: list[int] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # names of pynvml functions that answer NotSupported
    # Fallen off the bus: the handle stays, and every query of it answers NVML_ERROR_GPU_IS_LOST (as
    # NVML's API reference gives for each nvmlDeviceGet* function).
    lost: bool = False


_COUNTER_NAMES = {pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
                  pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery"}


class FakeNvml:
    """Pass an instance where the agent expects the `pynvml` module."""

    # Error classes, constants and structures are the real ones: the adapter cannot tell.
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu() for _ in range(8)]
        self.calls = 0
        self.initialized = False
        self._events: queue.Queue[tuple[int, int]] = queue.Queue()
        self._samples: dict[int, int] = {}  # sample address -> GPU index
        self._addresses = itertools.count(0x1000, 0x10)
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # Every other NVML_* / nvml* constant the adapter reads comes from the real module.
        if name.startswith(("NVML_", "nvmlClocks", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # --- test controls --------------------------------------------------------------------------

    def emit_xid(self, gpu: int, xid: int) -> None:
        self._events.put((gpu, xid))

    # --- helpers ------------------------------------------------------------------------------

    def _gpu(self, handle: Any, function: str) -> FakeGpu:
        self.calls += 1
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu: FakeGpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.unsupported:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return gpu

    # --- the pynvml subset, under pynvml's own names ------------------------------------------

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return SimpleNamespace(index=index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._gpu(handle, "nvmlDeviceGetUUID")
        return f"GPU-00000000-0000-0000-0000-{handle.index:012d}"

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetMarginTemperature(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetMarginTemperature")
        return gpu.slowdown_c - gpu.temperature_c

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").throttle

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu_pct, memory_pct = self._gpu(handle, "nvmlDeviceGetUtilizationRates").utilization
        return SimpleNamespace(gpu=gpu_pct, memory=memory_pct)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        used, total = self._gpu(handle, "nvmlDeviceGetMemoryInfo").memory
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        corrected, uncorrected = self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc
        return corrected if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else uncorrected

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkState")
        if link >= gpu.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(pynvml.NVML_FEATURE_DISABLED if link in gpu.link_down else pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkErrorCounter")
        return gpu.link_errors.get((link, _COUNTER_NAMES[counter]), 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=2**30)
                for pid in self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses").processes]

    # GPM: samples are opaque pointers; metrics compare two of them.
    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        return SimpleNamespace(isSupportedDevice=int(self._gpu(handle, "nvmlGpmQueryDeviceSupport").gpm))

    def nvmlGpmSampleAlloc(self) -> Any:
        with self._lock:
            address = next(self._addresses)
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        self._gpu(handle, "nvmlGpmSampleGet")
        address = ctypes.cast(sample, ctypes.c_void_p).value or 0
        self._samples[address] = handle.index
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._samples.pop(ctypes.cast(sample, ctypes.c_void_p).value or 0, None)

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self.calls += 1
        self._samples[ctypes.cast(request.sample1, ctypes.c_void_p).value or 0]  # both samples must exist
        gpu = self.gpus[self._samples[ctypes.cast(request.sample2, ctypes.c_void_p).value or 0]]
        for k in range(request.numMetrics):
            metric = request.metrics[k]
            if metric.metricId != pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL:
                metric.nvmlReturn = NOT_SUPPORTED
                continue
            metric.value = 100.0 * gpu.tensor_busy
            metric.nvmlReturn = pynvml.NVML_SUCCESS
        return request

    # XID events.
    def nvmlEventSetCreate(self) -> Any:
        return SimpleNamespace(registered=set())

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: Any) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        event_set.registered.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        try:
            gpu, xid = self._events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(device=self.nvmlDeviceGetHandleByIndex(gpu), eventData=xid,
                               eventType=pynvml.nvmlEventTypeXidCriticalError)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        return None
