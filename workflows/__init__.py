"""Runbooks as Temporal workflows: what happens, in order. Deterministic, no I/O."""

from workflows.fleet_guard import FleetGuard
from workflows.hot_gpu_pull import HotGpuPull
from workflows.kueue_quota_sync import KueueQuotaSync
from workflows.migrate_back import MigrateBack
from workflows.nvlink_fault_replace import NvlinkFaultReplace
from workflows.traffic_flip import TrafficFlip
from workflows.xid_recovery import XidRecovery

WORKFLOWS: list[type] = [XidRecovery, HotGpuPull, NvlinkFaultReplace, TrafficFlip, MigrateBack, KueueQuotaSync,
                              FleetGuard]
