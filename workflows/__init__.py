"""Runbooks as Temporal workflows: what happens, in order. Deterministic, no I/O."""

from workflows.fleet_guard import FleetGuard
from workflows.xid_recovery import XidRecovery

WORKFLOWS: list[type] = [XidRecovery, FleetGuard]
