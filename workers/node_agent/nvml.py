"""The one thin adapter over NVML (`pynvml` from nvidia-ml-py).

Everything the agent knows about a GPU passes through `Nvml`. A query the driver or the GPU does
not support leaves that value None (its metric absent) and is logged once per GPU and query;
it never crashes a scrape. XID events arrive on an NVML event set read by a background thread.
Tests hand in `devstack.fake_nvml.FakeNvml` instead of the `pynvml` module.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("fleetmedic.agent.nvml")

# NVLink error counters exported, as NVML names them -> the `type` label of the metric.
NVLINK_COUNTERS = {"NVML_NVLINK_ERROR_DL_CRC_FLIT": "crc_flit", "NVML_NVLINK_ERROR_DL_CRC_DATA": "crc_data",
                   "NVML_NVLINK_ERROR_DL_REPLAY": "replay", "NVML_NVLINK_ERROR_DL_RECOVERY": "recovery"}
# Clock throttle (event) reasons worth a label; the rest are summed into `other`.
THROTTLE_REASONS = {
    "nvmlClocksThrottleReasonGpuIdle": "gpu_idle",
    "nvmlClocksThrottleReasonApplicationsClocksSetting": "applications_clocks",
    "nvmlClocksThrottleReasonSwPowerCap": "sw_power_cap",
    "nvmlClocksThrottleReasonHwSlowdown": "hw_slowdown",
    "nvmlClocksThrottleReasonSyncBoost": "sync_boost",
    "nvmlClocksThrottleReasonSwThermalSlowdown": "sw_thermal_slowdown",
    "nvmlClocksThrottleReasonHwThermalSlowdown": "hw_thermal_slowdown",
    "nvmlClocksThrottleReasonHwPowerBrakeSlowdown": "hw_power_brake_slowdown",
}
XID_HISTORY = 256  # XID events kept for /v1/validate


@dataclass
class NvlinkSample:
    link: int
    up: bool
    errors: dict[str, int] = field(default_factory=dict)  # type label -> counter


@dataclass
class GpuSample:
    index: int
    uuid: str = ""
    name: str = ""
    temperature_c: float | None = None
    thermal_margin_c: float | None = None
    throttle_reasons: dict[str, bool] | None = None
    power_w: float | None = None
    utilization_gpu: float | None = None  # 0..1
    utilization_memory: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    ecc_corrected: int | None = None  # aggregate (lifetime) counts
    ecc_uncorrected: int | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    tensor_active: float | None = None  # 0..1, GPM (Hopper and newer)
    nvlinks: list[NvlinkSample] = field(default_factory=list)
    # What the GPU failed to answer in this sample, other than "not supported" ("temperature: GPU is
    # lost"): a GPU that fell off the bus still has a handle, and only its errors tell it apart.
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class XidEvent:
    gpu: int
    xid: int
    at: float  # unix time


def nvidia_smi_reset(gpu: int) -> None:
    """NVML's public API has no reset; nvidia-smi does it (it refuses while processes use the GPU)."""
    done = subprocess.run(["nvidia-smi", "--gpu-reset", "-i", str(gpu)], capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nvidia-smi --gpu-reset -i {gpu}: {(done.stdout + done.stderr).strip()[:300]}")


class Nvml:
    def __init__(self, lib: Any, resetter: Callable[[int], None] = nvidia_smi_reset) -> None:
        self.lib = lib
        self.resetter = resetter
        self.handles: list[Any] = []
        self._unsupported: set[tuple[int, str]] = set()
        self._gpm_samples: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._sampling = threading.local()  # the GpuSample being read on this thread, for `_try`'s errors
        self.xid_counts: Counter[tuple[int, int]] = Counter()
        self.xid_events: deque[XidEvent] = deque(maxlen=XID_HISTORY)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._counters = {label: getattr(lib, name) for name, label in NVLINK_COUNTERS.items() if hasattr(lib, name)}
        self._throttle = {label: getattr(lib, name) for name, label in THROTTLE_REASONS.items() if hasattr(lib, name)}

    # --- life cycle ---------------------------------------------------------------------------

    def start(self, watch_xids: bool = True) -> None:
        self.lib.nvmlInit()
        self.handles = [self.lib.nvmlDeviceGetHandleByIndex(i) for i in range(self.lib.nvmlDeviceGetCount())]
        if watch_xids:
            self._watcher = threading.Thread(target=self._watch_xids, name="nvml-xid-events", daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5)
        for sample in self._gpm_samples.values():
            self._quiet(-1, "gpm free", functools.partial(self.lib.nvmlGpmSampleFree, sample))
        self.lib.nvmlShutdown()

    @property
    def count(self) -> int:
        return len(self.handles)

    # --- one read of every GPU ----------------------------------------------------------------

    def sample(self) -> list[GpuSample]:
        return [self._sample(i, h) for i, h in enumerate(self.handles)]

    def temperatures(self) -> list[GpuSample]:
        """Only what hot-gpu-pull needs, cheaply."""
        return [GpuSample(index=i, temperature_c=self._temperature(i, h),
                          thermal_margin_c=self._try(i, "thermal margin", self.lib.nvmlDeviceGetMarginTemperature, h))
                for i, h in enumerate(self.handles)]

    def _sample(self, i: int, handle: Any) -> GpuSample:
        gpu = GpuSample(index=i)
        self._sampling.gpu = gpu
        try:
            self._read(i, handle, gpu)
        finally:
            self._sampling.gpu = None
        return gpu

    def _read(self, i: int, handle: Any, gpu: GpuSample) -> None:
        lib = self.lib
        gpu.uuid = _text(self._try(i, "uuid", lib.nvmlDeviceGetUUID, handle) or "")
        gpu.name = _text(self._try(i, "name", lib.nvmlDeviceGetName, handle) or "")
        gpu.temperature_c = self._temperature(i, handle)
        gpu.thermal_margin_c = self._try(i, "thermal margin", lib.nvmlDeviceGetMarginTemperature, handle)
        reasons = self._try(i, "clock throttle reasons", lib.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        if reasons is not None:
            gpu.throttle_reasons = {label: bool(reasons & bit) for label, bit in self._throttle.items()}
            gpu.throttle_reasons["other"] = bool(reasons & ~sum(self._throttle.values()))
        power_mw = self._try(i, "power", lib.nvmlDeviceGetPowerUsage, handle)
        gpu.power_w = power_mw / 1000 if power_mw is not None else None
        utilization = self._try(i, "utilization", lib.nvmlDeviceGetUtilizationRates, handle)
        if utilization is not None:
            gpu.utilization_gpu, gpu.utilization_memory = utilization.gpu / 100, utilization.memory / 100
        memory = self._try(i, "memory", lib.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            gpu.memory_used_bytes, gpu.memory_total_bytes = int(memory.used), int(memory.total)
        gpu.ecc_corrected = self._try(i, "ecc corrected", lib.nvmlDeviceGetTotalEccErrors, handle,
                                      lib.NVML_MEMORY_ERROR_TYPE_CORRECTED, lib.NVML_AGGREGATE_ECC)
        gpu.ecc_uncorrected = self._try(i, "ecc uncorrected", lib.nvmlDeviceGetTotalEccErrors, handle,
                                        lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_AGGREGATE_ECC)
        remapped = self._try(i, "remapped rows", lib.nvmlDeviceGetRemappedRows, handle)
        if remapped is not None:
            corrected, uncorrected, pending, failed = remapped
            gpu.remapped_rows_corrected, gpu.remapped_rows_uncorrected = corrected, uncorrected
            gpu.remap_pending, gpu.remap_failed = bool(pending), bool(failed)
        gpu.tensor_active = self._tensor_active(i, handle)
        gpu.nvlinks = self._nvlinks(i, handle)

    def _temperature(self, i: int, handle: Any) -> float | None:
        value = self._try(i, "temperature", self.lib.nvmlDeviceGetTemperature, handle, self.lib.NVML_TEMPERATURE_GPU)
        return float(value) if value is not None else None

    def _nvlinks(self, i: int, handle: Any) -> list[NvlinkSample]:
        if (i, "nvlink") in self._unsupported:
            return []
        links = []
        for link in range(self.lib.NVML_NVLINK_MAX_LINKS):
            try:
                state = self.lib.nvmlDeviceGetNvLinkState(handle, link)
            except self.lib.NVMLError as exc:
                # Links past the GPU's own count answer NotSupported/InvalidArgument: its links end
                # here. So does link 0 of a GPU without NVLink (an H100 passed through to a VM alone
                # answers NotSupported for all 18). Any other error is the GPU's, not its links'.
                if link == 0 and exc.value not in (self.lib.NVML_ERROR_NOT_SUPPORTED,
                                                   self.lib.NVML_ERROR_INVALID_ARGUMENT):
                    self._failed(i, "nvlink state", exc)
                    return []
                break
            sample = NvlinkSample(link=link, up=bool(state))
            for label, counter in self._counters.items():
                value = self._try(i, f"nvlink {label}", self.lib.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
                if value is not None:
                    sample.errors[label] = int(value)
            links.append(sample)
        if not links:
            self._note(i, "nvlink", "no NVLink on this GPU")
        return links

    def _tensor_active(self, i: int, handle: Any) -> float | None:
        """Tensor-core activity between this scrape and the previous one, from GPM. The first
        scrape after start has no previous sample and reports nothing."""
        lib = self.lib
        if (i, "gpm") in self._unsupported:
            return None
        support = self._try(i, "gpm", lib.nvmlGpmQueryDeviceSupport, handle)
        if support is None or not support.isSupportedDevice:
            self._note(i, "gpm", "no GPU performance metrics (tensor activity needs Hopper or newer)")
            return None
        sample = self._try(i, "gpm", lib.nvmlGpmSampleAlloc)
        if sample is None or self._try(i, "gpm", lib.nvmlGpmSampleGet, handle, sample) is None:
            return None
        with self._lock:
            previous, self._gpm_samples[i] = self._gpm_samples.get(i), sample
        if previous is None:
            return None
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1, request.sample2 = previous, sample
        request.metrics[0].metricId = lib.NVML_GPM_METRIC_ANY_TENSOR_UTIL
        result = self._try(i, "gpm", lib.nvmlGpmMetricsGet, request)
        self._quiet(i, "gpm free", lambda: lib.nvmlGpmSampleFree(previous))
        if result is None or result.metrics[0].nvmlReturn != 0:
            return None
        return float(result.metrics[0].value) / 100

    # --- processes and reset --------------------------------------------------------------------

    def processes(self, gpu: int) -> list[int]:
        """PIDs of compute processes on the GPU (the reset refuses while any run)."""
        return [int(p.pid) for p in self.lib.nvmlDeviceGetComputeRunningProcesses(self.handles[gpu])]

    def reset(self, gpu: int) -> None:
        self.resetter(gpu)

    # --- XID events -----------------------------------------------------------------------------

    def _watch_xids(self) -> None:
        lib = self.lib
        try:
            events = lib.nvmlEventSetCreate()
            for i, handle in enumerate(self.handles):
                self._quiet(i, "xid events", functools.partial(
                    lib.nvmlDeviceRegisterEvents, handle, lib.nvmlEventTypeXidCriticalError, events))
        except lib.NVMLError as exc:
            log.warning("XID events unavailable: %s; XIDs will not be counted", exc)
            return
        while not self._stop.is_set():
            try:
                data = lib.nvmlEventSetWait_v2(events, 1000)
            except lib.NVMLError_Timeout:
                continue
            except lib.NVMLError as exc:
                log.warning("XID event wait failed: %s", exc)
                time.sleep(1)
                continue
            if data.eventType != lib.nvmlEventTypeXidCriticalError:
                continue
            gpu = next((i for i, h in enumerate(self.handles) if _same_handle(h, data.device)), -1)
            self.record_xid(gpu, int(data.eventData))
        self._quiet(-1, "xid events", lambda: lib.nvmlEventSetFree(events))

    def record_xid(self, gpu: int, xid: int, at: float | None = None) -> None:
        with self._lock:
            self.xid_counts[(gpu, xid)] += 1
            self.xid_events.append(XidEvent(gpu=gpu, xid=xid, at=at if at is not None else time.time()))

    def known_xids(self, xids: list[int]) -> None:
        """Export these XIDs at 0 on every GPU from the start: the rules' `increase()` only sees a
        counter go up from a sample it already had, so a series born at 1 would never alert."""
        with self._lock:
            for gpu in range(self.count):
                for xid in xids:
                    self.xid_counts.setdefault((gpu, xid), 0)

    def xid_totals(self) -> dict[tuple[int, int], int]:
        with self._lock:
            return dict(self.xid_counts)

    def xids_since(self, since: float) -> list[XidEvent]:
        with self._lock:
            return [e for e in self.xid_events if e.at >= since]

    # --- NotSupported handling ------------------------------------------------------------------

    def _try(self, gpu: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        if (gpu, what) in self._unsupported:
            return None
        try:
            return fn(*args)
        except self.lib.NVMLError_NotSupported:
            self._note(gpu, what, "not supported by this GPU or driver")
        except self.lib.NVMLError as exc:
            self._failed(gpu, what, exc)
        return None

    def _failed(self, gpu: int, what: str, exc: Exception) -> None:
        """An error other than NotSupported (the GPU lost, busy): kept on the sample being read, so
        validation sees it; logged once, but asked again next scrape (it may be transient)."""
        sample: GpuSample | None = getattr(self._sampling, "gpu", None)
        if sample is not None:
            sample.errors.append(f"{what}: {exc}")
        key = (gpu, f"{what} error")
        if key not in self._unsupported:
            self._unsupported.add(key)
            log.warning("GPU %s: %s failed: %s", gpu, what, exc)

    def _quiet(self, gpu: int, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except self.lib.NVMLError as exc:
            log.debug("GPU %s: %s: %s", gpu, what, exc)

    def _note(self, gpu: int, what: str, why: str) -> None:
        if (gpu, what) not in self._unsupported:
            self._unsupported.add((gpu, what))
            log.info("GPU %s: %s: %s; its metric stays absent", gpu, what, why)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _same_handle(a: Any, b: Any) -> bool:
    # Real handles are ctypes pointers (compare addresses); the fake's are plain objects.
    try:
        return bool(ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return a is b or a == b
