"""Benchmark: CPU time of one agent scrape — 8 GPUs × 18 NVLinks and 8 InfiniBand ports — against
the fake NVML and a sysfs tree (target: under 50 ms).

It measures the agent's own work (the adapter's NVML calls, the sysfs reads, building and
rendering the metrics), which is what a scrape costs the node besides the driver's time; on a
real node each NVML call adds the driver's latency on top.

`--nvml real` scrapes the GPUs of this machine through the driver's NVML (`pynvml`) and the
node's own InfiniBand sysfs instead (a lent device machine: scripts/test-gpu). Beside the
scrape's CPU and wall time it reports its floor, measured in the same scrapes: the wall time
spent inside the driver's NVML calls, which no agent can avoid, and the scrape's ratio to it.

    python bench/agent_scrape.py [--scrapes 200] [--nvml fake|real]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import generate_latest

from bench.stats import percentile
from devstack.fake_nvml import FakeGpu, FakeNvml
from devstack.fake_sysfs import write_fabric
from fleetmedic.policy import Policy
from fleetmedic.settings import Settings
from workers.node_agent.serve import build_agent


class TimedNvml:
    """`pynvml` with the wall time of its `nvml*` calls summed: the driver's share of a scrape."""

    def __init__(self, lib: Any) -> None:
        self._lib, self.calls, self.seconds = lib, 0, 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if not (name.startswith("nvml") and callable(value)):
            return value  # constants, structures and the NVMLError classes

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return value(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--nvml", choices=("fake", "real"), default="fake")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib: Any
        if args.nvml == "real":
            import pynvml

            lib = TimedNvml(pynvml)
            settings = Settings(node_name="gpu-bench")  # the node's own /sys/class/infiniband
        else:
            lib = FakeNvml([FakeGpu(nvlinks=18) for _ in range(8)])
            settings = Settings(node_name="gpu-bench", agent_expected_gpus=8,
                                infiniband_root=str(write_fabric(Path(tmp) / "ib", 8)))
        agent = build_agent(settings, Policy(), lib=lib, node_cordoned=lambda: False, watch_xids=False)
        assert agent.nvml is not None, agent.nvml_error
        generate_latest(agent.registry)  # the first scrape primes GPM's previous sample
        calls_before = lib.calls
        driver_before = lib.seconds if args.nvml == "real" else 0.0
        cpu: list[float] = []
        wall: list[float] = []
        size = 0
        for _ in range(args.scrapes):
            start, started = time.process_time(), time.perf_counter()
            body = generate_latest(agent.registry)
            cpu.append((time.process_time() - start) * 1000)
            wall.append((time.perf_counter() - started) * 1000)
            size = len(body)
        nvml_calls = (lib.calls - calls_before) / args.scrapes
        gpus, ports = agent.nvml.count, len(agent.infiniband.sample())
        models = sorted({g.name for g in agent.nvml.sample()})
        agent.nvml.stop()
    result: dict[str, Any] = {
        "benchmark": "agent_scrape", "nvml": args.nvml, "gpus": gpus, "models": models,
        "nvlinks_per_gpu": 18 if args.nvml == "fake" else None, "infiniband_ports": ports,
        "scrapes": args.scrapes, "cpu_ms_p50": round(percentile(cpu, 50), 2),
        "cpu_ms_p99": round(percentile(cpu, 99), 2),
        "cpu_ms_mean": round(sum(cpu) / len(cpu), 2), "nvml_calls_per_scrape": nvml_calls,
        "series_bytes": size, "target_ms": 50, "met": percentile(cpu, 99) < 50,
    }
    if args.nvml == "real":
        driver_ms = (lib.seconds - driver_before) * 1000 / args.scrapes
        wall_mean = sum(wall) / len(wall)
        result |= {"wall_ms_p50": round(percentile(wall, 50), 2), "wall_ms_p99": round(percentile(wall, 99), 2),
                   "wall_ms_mean": round(wall_mean, 2), "floor_driver_nvml_ms_mean": round(driver_ms, 2),
                   "wall_over_floor": round(wall_mean / driver_ms, 2) if driver_ms else None,
                   "agent_own_ms_mean": round(wall_mean - driver_ms, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
