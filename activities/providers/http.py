"""The `http` provider: a small REST contract any fleet API can implement (docs/http-provider.md).

POST {url}/v1/requests with an `Idempotency-Key` header; the same key always names the same
request, so a retried activity never asks twice. A provider that brings a new machine says so
(`"replacement": "new"`, and `"node"` once the new node's name is known); FleetMedic then reads
GET {url}/v1/requests/{id} until the answer names the node.
"""

from __future__ import annotations

import httpx

from activities.errors import fail, http_errors, raise_for_status
from fleetmedic.errors import ErrorKind
from fleetmedic.models import Follow, ProviderRequest, ProviderResult, Replacement


class HttpProvider:
    name = "http"
    supports = frozenset({"replace", "reboot", "rma", "prewarm"})

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers)

    def request(self, request: ProviderRequest) -> ProviderResult:
        if request.dry_run:
            return ProviderResult(provider=self.name, action=request.action, accepted=True, dry_run=True,
                                  reference=request.idempotency_key,
                                  detail=f"would POST /v1/requests {request.action} {request.node}")
        body = {"cluster": request.cluster, "node": request.node, "action": request.action,
                "reason": request.reason}
        with http_errors("provider"):
            response = self.client.post("/v1/requests", json=body,
                                        headers={"Idempotency-Key": request.idempotency_key})
        if response.status_code == 409:
            # The key was used for a different request: a bug or a collision, never retry it.
            raise fail(ErrorKind.INVALID, f"provider refused idempotency key {request.idempotency_key}: "
                                          f"{response.text[:200]}")
        raise_for_status(response, "provider")
        data = response.json()
        reference = str(data.get("id", ""))
        new_node = _new_node(data, request.node)
        follow = None
        if new_node is None and data.get("replacement") == "new" and reference:
            follow = Follow(provider=self.name, old_node=request.node, reference=reference)
        return ProviderResult(provider=self.name, action=request.action, accepted=True, reference=reference,
                              detail=str(data.get("status", "accepted")), new_node=new_node, follow=follow)

    def find_replacement(self, follow: Follow) -> Replacement:
        with http_errors("provider"):
            response = self.client.get(f"/v1/requests/{follow.reference}")
        raise_for_status(response, "provider")
        data = response.json()
        status = str(data.get("status", ""))
        if status == "failed":
            return Replacement(failed=True, detail=f"provider request {follow.reference} failed: "
                                                   f"{str(data.get('detail', ''))[:200]}")
        node = _new_node(data, follow.old_node)
        if node is None:
            return Replacement(detail=f"provider request {follow.reference}: {status or 'no status'}, no node yet")
        return Replacement(node=node, detail=f"provider request {follow.reference} → node {node}")


def _new_node(data: dict[str, object], old: str) -> str | None:
    node = data.get("node")
    return str(node) if isinstance(node, str) and node and node != old else None
