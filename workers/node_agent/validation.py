"""The verdict `/v1/validate` gives a repaired node before a runbook returns it to service.

Pure: it judges readings taken by the caller. Every check carries the value it judged, so the
runbook's history says why a node failed ("nvlink_up=down: GPU 2 link 7").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from workers.node_agent.infiniband import ACTIVE, PortSample
from workers.node_agent.nvml import GpuSample, XidEvent


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    value: str


def verdict(gpus: list[GpuSample], xids: list[XidEvent], ports: list[PortSample], *, expected_gpus: int | None,
            max_temperature_c: float) -> list[Check]:
    checks = [_gpus_present(gpus, expected_gpus), _gpus_answer(gpus), _temperature(gpus, max_temperature_c),
              _no_xid(xids), _nvlink(gpus), _infiniband(ports)]
    return checks


def _gpus_present(gpus: list[GpuSample], expected: int | None) -> Check:
    if expected is None:
        return Check("gpus_present", bool(gpus), f"{len(gpus)} (no expected count given)")
    return Check("gpus_present", len(gpus) >= expected, f"{len(gpus)}/{expected}")


def _gpus_answer(gpus: list[GpuSample]) -> Check:
    """Every GPU answered NVML (or said a query is not supported on it). A GPU that fell off the bus
    keeps its handle and answers "GPU is lost": counted present, its readings merely absent, it
    would pass every other check."""
    failing = [g for g in gpus if g.errors]
    if not failing:
        return Check("gpus_answer", True, f"{len(gpus)}/{len(gpus)}")
    return Check("gpus_answer", False, "; ".join(f"GPU {g.index}: {', '.join(g.errors[:3])}" for g in failing[:4]))


def _temperature(gpus: list[GpuSample], limit: float) -> Check:
    readings = [(g.temperature_c, g.index) for g in gpus if g.temperature_c is not None]
    if not readings:
        return Check("temperature", not gpus, "no temperature reading")
    hottest, index = max(readings)
    return Check("temperature", hottest <= limit, f"{hottest:g} C max (GPU {index}; limit {limit:g} C)")


def _no_xid(xids: list[XidEvent]) -> Check:
    if not xids:
        return Check("no_xid_since", True, "none")
    seen = ", ".join(f"XID {e.xid} on GPU {e.gpu} at {datetime.fromtimestamp(e.at, UTC).isoformat()}"
                     for e in xids[-5:])
    return Check("no_xid_since", False, seen)


def _nvlink(gpus: list[GpuSample]) -> Check:
    links = [(g.index, link.link) for g in gpus for link in g.nvlinks]
    down = [(g.index, link.link) for g in gpus for link in g.nvlinks if not link.up]
    if not links:
        return Check("nvlink_up", True, "no NVLink")
    if down:
        return Check("nvlink_up", False, "down: " + ", ".join(f"GPU {g} link {lk}" for g, lk in down[:10]))
    return Check("nvlink_up", True, f"{len(links)}/{len(links)} up")


def _infiniband(ports: list[PortSample]) -> Check:
    if not ports:
        return Check("infiniband_active", True, "no InfiniBand ports")
    inactive = [p for p in ports if p.state != ACTIVE]
    if inactive:
        return Check("infiniband_active", False, "not active: " + ", ".join(
            f"{p.device}/{p.port} {p.state_name or p.state}" for p in inactive))
    return Check("infiniband_active", True, f"{len(ports)}/{len(ports)} active")
