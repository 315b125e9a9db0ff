"""The node-provider plugin interface: whoever can give us a healthy node back.

A provider replaces a node (and, where it can, reboots it or opens an RMA). Every request
carries an idempotency key (the workflow ID and the action), so a retried activity asks once.
A provider that needs a person answers `needs_human`; the runbook then waits for a
`replaced` signal from an operator.
"""

from __future__ import annotations

from typing import Protocol

from fleetmedic.models import ProviderRequest, ProviderResult


class NodeProvider(Protocol):
    name: str
    # Which of replace / reboot / rma this provider does itself (the rest go to a human).
    supports: frozenset[str]

    def request(self, request: ProviderRequest) -> ProviderResult: ...


def ask_a_human(provider: str, request: ProviderRequest, why: str) -> ProviderResult:
    return ProviderResult(provider=provider, action=request.action, accepted=True, needs_human=True,
                          reference=request.idempotency_key, detail=why)
