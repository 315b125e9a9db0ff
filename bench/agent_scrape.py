"""Benchmark: CPU time of one agent scrape — 8 GPUs × 18 NVLinks and 8 InfiniBand ports — against
the fake NVML and a sysfs tree (target: under 50 ms).

It measures the agent's own work (the adapter's NVML calls, the sysfs reads, building and
rendering the metrics), which is what a scrape costs the node besides the driver's time; on a
real node each NVML call adds the driver's latency on top.

    python bench/agent_scrape.py [--scrapes 200]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import generate_latest

from bench.stats import percentile
from devstack.fake_nvml import FakeGpu, FakeNvml
from devstack.fake_sysfs import write_fabric
from fleetmedic.policy import Policy
from fleetmedic.settings import Settings
from workers.node_agent.serve import build_agent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = FakeNvml([FakeGpu(nvlinks=18) for _ in range(8)])
        settings = Settings(node_name="gpu-bench", agent_expected_gpus=8,
                            infiniband_root=str(write_fabric(Path(tmp) / "ib", 8)))
        agent = build_agent(settings, Policy(), lib=lib, node_cordoned=lambda: False, watch_xids=False)
        generate_latest(agent.registry)  # the first scrape primes GPM's previous sample
        calls_before = lib.calls
        cpu: list[float] = []
        size = 0
        for _ in range(args.scrapes):
            start = time.process_time()
            body = generate_latest(agent.registry)
            cpu.append((time.process_time() - start) * 1000)
            size = len(body)
        nvml_calls = (lib.calls - calls_before) / args.scrapes
        assert agent.nvml is not None
        agent.nvml.stop()
    print(json.dumps({
        "benchmark": "agent_scrape", "gpus": 8, "nvlinks_per_gpu": 18, "infiniband_ports": 8,
        "scrapes": args.scrapes, "cpu_ms_p50": round(percentile(cpu, 50), 2),
        "cpu_ms_p99": round(percentile(cpu, 99), 2),
        "cpu_ms_mean": round(sum(cpu) / len(cpu), 2), "nvml_calls_per_scrape": nvml_calls,
        "series_bytes": size, "target_ms": 50, "met": percentile(cpu, 99) < 50,
    }))


if __name__ == "__main__":
    main()
