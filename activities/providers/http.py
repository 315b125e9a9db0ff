"""The `http` provider: a small REST contract any fleet API can implement (docs/http-provider.md).

POST {url}/v1/requests with an `Idempotency-Key` header; the same key always names the same
request, so a retried activity never asks twice.
"""

from __future__ import annotations

import httpx

from activities.errors import fail, http_errors, raise_for_status
from fleetmedic.errors import ErrorKind
from fleetmedic.models import ProviderRequest, ProviderResult


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
        return ProviderResult(provider=self.name, action=request.action, accepted=True,
                              reference=str(data.get("id", "")), detail=str(data.get("status", "accepted")))
