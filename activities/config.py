"""The policy snapshot a run works with: read once at its start and kept in its history."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity

from fleetmedic.activity_refs import RunConfig
from fleetmedic.models import RunContext
from fleetmedic.policy import Policy


class ConfigActivities:
    def __init__(self, policy: Policy, context: RunContext, *, force_dry_run: bool = False) -> None:
        self.policy = policy
        self.context = context
        self.force_dry_run = force_dry_run

    # Coroutines: local activities run in every run's first workflow task, right before its
    # protective step, and must not wait for a thread of the pool the runs' other steps hold.
    @activity.defn(name="config.context")
    async def get_context(self) -> RunContext:
        return self.context

    @activity.defn(name="config.policy")
    async def get_policy(self) -> Policy:
        if self.force_dry_run:
            # FLEETMEDIC_DRY_RUN on the worker: every runbook it runs is in shadow mode.
            return self.policy.model_copy(update={"shadow": self.policy.shadow.model_copy(
                update={"all_runbooks": True})})
        return self.policy

    @activity.defn(name="config.run")
    async def get_run_config(self) -> RunConfig:
        """Both, for a node run's first step (0.1.0's runs read them apart)."""
        return RunConfig(policy=await self.get_policy(), context=self.context)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.get_run_config, self.get_policy, self.get_context]
