"""The `manual` provider: a person replaces the node and tells the runbook (`replaced` signal, or
`fleetmedic replaced <workflow-id> [--new-node NAME] --by WHO`)."""

from __future__ import annotations

from activities.providers.base import ask_a_human, nothing_to_follow
from fleetmedic.models import Follow, ProviderRequest, ProviderResult, Replacement


class ManualProvider:
    name = "manual"
    supports: frozenset[str] = frozenset()

    def request(self, request: ProviderRequest) -> ProviderResult:
        return ask_a_human(self.name, request, f"{request.action} {request.node} by hand, then signal "
                                               f"`replaced` to the workflow: {request.reason}")

    def find_replacement(self, follow: Follow) -> Replacement:
        return nothing_to_follow(follow)
