"""The `manual` provider: a person replaces the node and tells the runbook (`replaced` signal)."""

from __future__ import annotations

from activities.providers.base import ask_a_human
from fleetmedic.models import ProviderRequest, ProviderResult


class ManualProvider:
    name = "manual"
    supports: frozenset[str] = frozenset()

    def request(self, request: ProviderRequest) -> ProviderResult:
        return ask_a_human(self.name, request, f"{request.action} {request.node} by hand, then signal "
                                               f"`replaced` to the workflow: {request.reason}")
