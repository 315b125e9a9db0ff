"""The XID catalog: what each NVIDIA XID means for the node, as data the policy can override.

Defaults follow NVIDIA's published "immediate action" column (XID catalog, r555+), with one
deliberate choice: XID 79 (GPU fell off the bus) replaces the node instead of rebooting it,
because in practice a card that dropped off the bus once does it again within days.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import BaseModel, Field

from fleetmedic.durations import Duration


class XidAction(StrEnum):
    REPLACE = "replace"  # take the node out and have the provider replace it
    RESET_GPU = "reset_gpu"  # drain, reset the GPU (or reboot), validate, return
    NVLINK = "nvlink"  # hand over to the nvlink-fault-replace runbook
    FOLLOW_LINKED = "follow_linked"  # the XID names another XID / an NVML recovery action
    NOTIFY = "notify"  # tell humans, touch nothing
    DIAGNOSE = "diagnose"  # a notify-class XID that bursts: escalate for diagnosis
    IGNORE = "ignore"


DESTRUCTIVE_ACTIONS = frozenset({XidAction.REPLACE, XidAction.RESET_GPU})


class XidRule(BaseModel):
    action: XidAction
    description: str = ""
    # The XID itself already killed what ran on the GPU (the CUDA context is gone): taking the
    # node DOWN and requeueing its job costs nothing more, so it may join the protective step
    # before the lease (within budget.max_protective_kills_per_minute).
    job_lost: bool = False


class BurstRule(BaseModel):
    """`count` occurrences on one GPU within `window` change the action."""

    count: int = Field(ge=2)
    window: Duration


def default_catalog() -> dict[int, XidRule]:
    rule = XidRule
    catalog: dict[int, XidRule] = {
        79: rule(action=XidAction.REPLACE, description="GPU has fallen off the bus", job_lost=True),
        74: rule(action=XidAction.NVLINK, description="NVLink error"),
        45: rule(action=XidAction.FOLLOW_LINKED, description="Preemptive cleanup, due to previous errors"),
        154: rule(action=XidAction.FOLLOW_LINKED, description="GPU recovery action changed (see NVML)"),
        13: rule(action=XidAction.NOTIFY, description="Graphics engine exception (usually the application)"),
        31: rule(action=XidAction.NOTIFY, description="GPU memory page fault (usually the application)"),
        43: rule(action=XidAction.NOTIFY, description="GPU stopped processing (usually the application)"),
        94: rule(action=XidAction.NOTIFY, description="Contained ECC error: the application was stopped"),
        92: rule(action=XidAction.IGNORE, description="High single-bit ECC error rate"),
        # Disputed between vendors. NVIDIA lists a reset for 61; some operators only watch it.
        # 63 records a pending row remap that the next reset applies anyway: notify by default.
        61: rule(action=XidAction.RESET_GPU, description="Internal micro-controller breakpoint/warning"),
        63: rule(action=XidAction.NOTIFY, description="ECC page retirement or row remapping recorded"),
    }
    for xid, text in {
        48: "Double-bit ECC error",
        62: "Internal micro-controller halt",
        64: "ECC page retirement or row remapper recording failure",
        95: "Uncontained ECC error",
        119: "GSP RPC timeout",
        120: "GSP error",
        140: "Unrecovered ECC error",
        143: "GPU initialization failure",
    }.items():
        # A double-bit or uncontained ECC error ends every process on the GPU.
        catalog[xid] = rule(action=XidAction.RESET_GPU, description=text, job_lost=xid in (48, 95))
    return catalog


class XidClassification(BaseModel):
    xid: int
    action: XidAction
    reason: str
    destructive: bool
    job_lost: bool = False


def classify_xid(
    xid: int,
    catalog: dict[int, XidRule],
    *,
    unknown_action: XidAction,
    application_burst: BurstRule,
    reset_repeat: BurstRule,
    recent: Iterable[datetime] = (),
    now: datetime,
    linked_xid: int | None = None,
) -> XidClassification:
    """Decide what to do about one XID on one GPU.

    `recent` holds when the same XID class was seen on the same GPU before (this one excluded);
    bursts turn notify-class XIDs into a diagnosis and repeated reset-class XIDs into a replace.
    """
    rule = catalog.get(xid)
    job_lost = rule.job_lost if rule is not None else False
    if rule is None:
        action, reason = unknown_action, f"XID {xid} is not in the catalog: default action '{unknown_action}'"
    else:
        action, reason = rule.action, f"XID {xid} ({rule.description or 'no description'}): {rule.action}"

    if action is XidAction.FOLLOW_LINKED:
        if linked_xid is not None and linked_xid != xid:
            linked = classify_xid(
                linked_xid, catalog, unknown_action=unknown_action, application_burst=application_burst,
                reset_repeat=reset_repeat, recent=recent, now=now,
            )
            return linked.model_copy(update={
                "xid": xid, "reason": f"XID {xid} follows XID {linked_xid}: {linked.reason}"})
        action, reason = XidAction.NOTIFY, f"XID {xid} asks to follow a linked action, none given: notify"

    seen = sum(1 for at in recent if now - at <= _window(action, application_burst, reset_repeat))
    if action is XidAction.NOTIFY and seen + 1 >= application_burst.count:
        action = XidAction.DIAGNOSE
        reason += (f"; {seen + 1} on this GPU within {application_burst.window}: burst, escalate to"
                   " diagnosis")
    elif action is XidAction.RESET_GPU and seen + 1 >= reset_repeat.count:
        action = XidAction.REPLACE
        reason += f"; repeated {seen + 1} times on this GPU within {reset_repeat.window}: replace instead"
    return XidClassification(xid=xid, action=action, reason=reason, destructive=action in DESTRUCTIVE_ACTIONS,
                             job_lost=job_lost)


def _window(action: XidAction, application_burst: BurstRule, reset_repeat: BurstRule) -> timedelta:
    return reset_repeat.window if action is XidAction.RESET_GPU else application_burst.window


def default_burst() -> BurstRule:
    return BurstRule(count=5, window=timedelta(hours=24))


def default_reset_repeat() -> BurstRule:
    return BurstRule(count=2, window=timedelta(hours=24))
