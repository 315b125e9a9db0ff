"""Kueue quota sync, the pure part: from what the cluster looks like to the quota each
ClusterQueue should have, with every guard and the reason for each number.

Healthy capacity behind a ResourceFlavor: the GPUs of nodes that match the flavor's node labels
and are Ready, schedulable and not held by a FleetMedic run (degraded inference-only nodes count
only when policy says). A queue's target is all of it, a share, or all but a reserve (policy).
Guards: never above the healthy capacity; never below what admitted workloads use (unless an
approval allows the cut); at most `max_change_fraction` of the current quota moved up in one run
(cuts down to the healthy capacity are never bounded: a quota above the GPUs that exist breaks
gang scheduling, which is the whole point).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleetmedic.models import NodeInfo


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class Flavor(_Model):
    name: str
    node_labels: dict[str, str] = Field(default_factory=dict)


class QuotaSlot(_Model):
    """One `nominalQuota` of a ClusterQueue: resourceGroups[group].flavors[flavor_index].resources[resource_index]."""

    flavor: str
    group: int
    flavor_index: int
    resource_index: int
    nominal: int


class Queue(_Model):
    name: str
    resource_version: str = ""
    slots: list[QuotaSlot] = Field(default_factory=list)  # only the GPU resource's slots
    used: dict[str, int] = Field(default_factory=dict)  # flavor -> GPUs admitted workloads hold


class KueueSnapshot(_Model):
    installed: bool = True
    flavors: list[Flavor] = Field(default_factory=list)
    queues: list[Queue] = Field(default_factory=list)
    nodes: list[NodeInfo] = Field(default_factory=list)


class QuotaSyncInput(_Model):
    """What starts kueue-quota-sync (the Schedule, a node runbook, or `fleetmedic run`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: str = Field(min_length=1)
    dry_run: bool = False
    requested_by: str = "schedule"


class QuotaUpdate(_Model):
    """Set these slots of one ClusterQueue to their `nominal`."""

    queue: str
    slots: list[QuotaSlot]
    dry_run: bool = False


class QuotaChange(_Model):
    queue: str
    flavor: str
    current: int
    healthy: int  # GPUs behind the flavor
    target: int  # what policy wants, before the guards
    new: int  # what the run sets (== current: nothing to do)
    used: int
    reason: str
    needs_approval: bool = False  # the target cuts below admitted use: only with an approval

    @property
    def drift(self) -> int:
        return self.current - self.healthy


class QueueShare(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["all", "share", "reserve"] = "all"
    share: float = Field(1.0, gt=0, le=1)  # mode share: this fraction of the healthy GPUs
    reserve: int = Field(0, ge=0)  # mode reserve: all but this many GPUs


def healthy_gpus(flavor: Flavor, nodes: list[NodeInfo], *, gpu_node_selector: str, hold_annotations: tuple[str, ...],
                 degraded_taint_key: str, count_degraded: bool) -> tuple[int, list[str]]:
    """GPUs behind the flavor, and the nodes left out with why (for the run's record)."""
    gpu_key, _, gpu_value = gpu_node_selector.partition("=")
    total, left_out = 0, []
    for node in nodes:
        if node.labels.get(gpu_key) != gpu_value:
            continue
        if any(node.labels.get(k) != v for k, v in flavor.node_labels.items()):
            continue
        why = ("not Ready" if not node.ready else "cordoned" if node.unschedulable else
               "held by a FleetMedic run" if any(a in node.annotations for a in hold_annotations) else
               "degraded (inference only)" if not count_degraded and any(t.key == degraded_taint_key
                                                                          for t in node.taints) else None)
        if why:
            left_out.append(f"{node.name} ({why})")
        else:
            total += node.gpu_allocatable
    return total, left_out


def target_for(share: QueueShare, healthy: int) -> int:
    if share.mode == "share":
        return math.floor(healthy * share.share)
    if share.mode == "reserve":
        return max(0, healthy - share.reserve)
    return healthy


def plan(queue: Queue, slot: QuotaSlot, healthy: int, share: QueueShare, max_change_fraction: float) -> QuotaChange:
    current, used = slot.nominal, queue.used.get(slot.flavor, 0)
    target = min(target_for(share, healthy), healthy)
    new, reasons = target, [f"{healthy} healthy GPU(s) behind {slot.flavor}, policy {share.mode}: target {target}"]
    needs_approval = False
    if new > current:
        step = max(1, math.ceil(current * max_change_fraction))
        if new - current > step:
            new = current + step
            reasons.append(f"raised by at most {step} per run (kueue.max_change_fraction)")
    if new < used:
        needs_approval = True
        new = max(min(used, current), new)
        reasons.append(f"admitted workloads use {used}: no cut below that without approval")
    return QuotaChange(queue=queue.name, flavor=slot.flavor, current=current, healthy=healthy, target=target,
                       new=new, used=used, reason="; ".join(reasons), needs_approval=needs_approval)
