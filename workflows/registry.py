"""Every workflow the worker runs.

Kept out of `workflows/__init__.py` on purpose: the sandbox re-imports a workflow's modules for
every run, and a package `__init__` that imports every runbook would make each run import all of
them.
"""

from workflows.fleet_guard import FleetGuard
from workflows.hot_gpu_pull import HotGpuPull
from workflows.job_failures import JobFailures
from workflows.kueue_quota_sync import KueueQuotaSync
from workflows.migrate_back import MigrateBack
from workflows.nvlink_fault_replace import NvlinkFaultReplace
from workflows.suspect_node import SuspectNode
from workflows.traffic_flip import TrafficFlip
from workflows.xid_recovery import XidRecovery

WORKFLOWS: list[type] = [XidRecovery, HotGpuPull, NvlinkFaultReplace, TrafficFlip, MigrateBack, KueueQuotaSync,
                         FleetGuard, SuspectNode, JobFailures]
