"""The agent's Prometheus metrics, read at scrape time. Names are a contract: the shipped rules
(`deploy/prometheus/fleetmedic-rules.yaml`) and the dashboards read them; `METRICS` documents
each, and a test checks every name the rules use is here. Every series carries `node`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.node_agent.infiniband import Infiniband
from workers.node_agent.nvml import Nvml

# name (without _total for counters) -> (type, help)
METRICS: dict[str, tuple[str, str]] = {
    "fleetmedic_gpu_count": ("gauge", "GPUs NVML sees on the node"),
    "fleetmedic_gpu_expected": ("gauge", "GPUs the node should have (FLEETMEDIC_AGENT_EXPECTED_GPUS)"),
    "fleetmedic_gpu_info": ("gauge", "1 per GPU, with its uuid and model name"),
    "fleetmedic_gpu_temperature_celsius": ("gauge", "GPU core temperature"),
    "fleetmedic_gpu_thermal_margin_celsius": ("gauge", "degrees left before the driver slows the GPU down"),
    "fleetmedic_gpu_clock_throttled": ("gauge", "1 while the clocks are held down for this reason"),
    "fleetmedic_gpu_power_watts": ("gauge", "board power draw"),
    "fleetmedic_gpu_utilization_ratio": ("gauge", "share of time a kernel ran (NVML; it lies about real work)"),
    "fleetmedic_gpu_memory_utilization_ratio": ("gauge", "share of time memory was read or written"),
    "fleetmedic_gpu_tensor_active_ratio": ("gauge", "tensor-core activity (GPM, Hopper and newer): the real work"),
    "fleetmedic_gpu_memory_used_bytes": ("gauge", "framebuffer memory in use"),
    "fleetmedic_gpu_memory_total_bytes": ("gauge", "framebuffer memory"),
    "fleetmedic_gpu_ecc_errors": ("counter", "ECC errors since the driver loaded, by type (aggregate)"),
    "fleetmedic_gpu_remapped_rows": ("counter", "memory rows remapped, by cause"),
    "fleetmedic_gpu_row_remap_pending": ("gauge", "1: a row remap waits for a GPU reset"),
    "fleetmedic_gpu_row_remap_failed": ("gauge", "1: a row remap failed (replace the GPU)"),
    "fleetmedic_gpu_xid_errors": ("counter", "XID events since the agent started, by GPU and XID"),
    "fleetmedic_nvlink_link_up": ("gauge", "1 while the NVLink is up"),
    "fleetmedic_nvlink_errors": ("counter", "NVLink errors by type (crc_flit, crc_data, replay, recovery)"),
    "fleetmedic_infiniband_port_state": ("gauge", "port state number (4 = ACTIVE)"),
    "fleetmedic_infiniband_symbol_errors": ("counter", "symbol errors on the link"),
    "fleetmedic_infiniband_receive_errors": ("counter", "received packets with errors"),
    "fleetmedic_infiniband_link_downed": ("counter", "times the link went down"),
    "fleetmedic_infiniband_transmit_wait": ("counter", "ticks a packet waited to be sent (congestion)"),
    "fleetmedic_infiniband_link_error_recovery": ("counter", "link error recoveries"),
    "fleetmedic_infiniband_transmit_discards": ("counter", "outbound packets discarded"),
    "fleetmedic_infiniband_local_link_integrity_errors": ("counter", "local link integrity errors"),
    "fleetmedic_infiniband_excessive_buffer_overrun_errors": ("counter", "excessive buffer overruns"),
    "fleetmedic_infiniband_receive_remote_physical_errors": ("counter", "packets received marked bad upstream"),
    "fleetmedic_infiniband_data_bytes": ("counter", "bytes sent or received, by direction"),
    "fleetmedic_infiniband_hw_counter": ("counter", "the driver's hw_counters, by name"),
}


class AgentCollector(Collector):
    def __init__(self, node: str, nvml: Nvml | None, infiniband: Infiniband, expected_gpus: int | None) -> None:
        self.node, self.nvml, self.infiniband, self.expected = node, nvml, infiniband, expected_gpus

    def _family(self, name: str, labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
        kind, text = METRICS[name]
        if kind == "counter":
            return CounterMetricFamily(name, text, labels=["node", *labels])
        return GaugeMetricFamily(name, text, labels=["node", *labels])

    def collect(self) -> Iterator[Metric]:
        node = self.node
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(name: str, labels: dict[str, str], value: float | None) -> None:
            if value is None:
                return  # not supported here: the series stays absent rather than a fake 0
            if name not in families:
                families[name] = self._family(name, list(labels))
            families[name].add_metric([node, *labels.values()], float(value))

        if self.nvml is not None:
            add("fleetmedic_gpu_count", {}, self.nvml.count)
            for gpu in self.nvml.sample():
                g = {"gpu": str(gpu.index)}
                add("fleetmedic_gpu_info", {**g, "uuid": gpu.uuid, "model": gpu.name}, 1)
                add("fleetmedic_gpu_temperature_celsius", g, gpu.temperature_c)
                add("fleetmedic_gpu_thermal_margin_celsius", g, gpu.thermal_margin_c)
                for reason, on in (gpu.throttle_reasons or {}).items():
                    add("fleetmedic_gpu_clock_throttled", {**g, "reason": reason}, on)
                add("fleetmedic_gpu_power_watts", g, gpu.power_w)
                add("fleetmedic_gpu_utilization_ratio", g, gpu.utilization_gpu)
                add("fleetmedic_gpu_memory_utilization_ratio", g, gpu.utilization_memory)
                add("fleetmedic_gpu_tensor_active_ratio", g, gpu.tensor_active)
                add("fleetmedic_gpu_memory_used_bytes", g, gpu.memory_used_bytes)
                add("fleetmedic_gpu_memory_total_bytes", g, gpu.memory_total_bytes)
                add("fleetmedic_gpu_ecc_errors", {**g, "type": "corrected"}, gpu.ecc_corrected)
                add("fleetmedic_gpu_ecc_errors", {**g, "type": "uncorrected"}, gpu.ecc_uncorrected)
                add("fleetmedic_gpu_remapped_rows", {**g, "cause": "correctable"}, gpu.remapped_rows_corrected)
                add("fleetmedic_gpu_remapped_rows", {**g, "cause": "uncorrectable"}, gpu.remapped_rows_uncorrected)
                add("fleetmedic_gpu_row_remap_pending", g, gpu.remap_pending)
                add("fleetmedic_gpu_row_remap_failed", g, gpu.remap_failed)
                for link in gpu.nvlinks:
                    lk = {**g, "link": str(link.link)}
                    add("fleetmedic_nvlink_link_up", lk, link.up)
                    for kind, count in link.errors.items():
                        add("fleetmedic_nvlink_errors", {**lk, "type": kind}, count)
            for (gpu_index, xid), count in sorted(self.nvml.xid_totals().items()):
                add("fleetmedic_gpu_xid_errors", {"gpu": str(gpu_index), "xid": str(xid)}, count)
        add("fleetmedic_gpu_expected", {}, self.expected)

        for port in self.infiniband.sample():
            p = {"device": port.device, "port": port.port}
            add("fleetmedic_infiniband_port_state", p, port.state)
            for name, value in port.counters.items():
                add(f"fleetmedic_infiniband_{name}", p, value)
            for direction, value in port.data_bytes.items():
                add("fleetmedic_infiniband_data_bytes", {**p, "direction": direction}, value)
            for counter, value in port.hw_counters.items():
                add("fleetmedic_infiniband_hw_counter", {**p, "counter": counter}, value)
        yield from families.values()
