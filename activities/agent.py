"""The node agent, seen from the worker: validation of a repaired node, and GPU reset.

`FLEETMEDIC_AGENT_URL` is a template (`http://{node}:9400`). Without it, or when the agent does
not answer, validation reports `available: false` and the runbook records it skipped; a reset
then falls back to the policy's choice (reboot or replace).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from temporalio import activity

from activities.errors import fail, http_errors, raise_for_status
from fleetmedic.errors import ErrorKind
from fleetmedic.models import (
    ActionResult,
    GpuReading,
    GpuReadings,
    GpuResetRequest,
    Validate,
    Validation,
    ValidationCheck,
)


class AgentActivities:
    def __init__(self, url_template: str | None, token: str | None, timeout_s: float = 10.0, *,
                 force_dry_run: bool = False) -> None:
        self.template = url_template
        self.token = token
        self.timeout = timeout_s
        self.force_dry_run = force_dry_run

    def _url(self, node: str) -> str | None:
        return self.template.format(node=node).rstrip("/") if self.template else None

    def _read(self, node: str, path: str, params: dict[str, str] | None = None) -> dict[str, Any] | str:
        """The agent's JSON answer, or why there is none (not configured, unreachable: the caller
        reports itself unavailable). An HTTP error status raises, classified for the retry policy."""
        url = self._url(node)
        if url is None:
            return "no node agent configured (FLEETMEDIC_AGENT_URL)"
        try:
            response = httpx.get(f"{url}{path}", params=params, timeout=self.timeout)
        except httpx.HTTPError as exc:
            return f"node agent unreachable: {exc}"
        raise_for_status(response, f"agent {path}")
        data: dict[str, Any] = response.json()
        return data

    @activity.defn(name="agent.validate")
    def validate(self, request: Validate) -> Validation:
        params: dict[str, str] = {"since": request.since.isoformat()}
        if request.expected_gpus is not None:
            params["expected_gpus"] = str(request.expected_gpus)
        data = self._read(request.node, "/v1/validate", params)
        if isinstance(data, str):
            return Validation(available=False, detail=data)
        checks = [ValidationCheck(name=c["name"], passed=bool(c["passed"]), value=str(c.get("value", "")))
                  for c in data.get("checks", [])]
        return Validation(available=True, passed=bool(data.get("passed")), checks=checks)

    @activity.defn(name="agent.gpus")
    def gpus(self, node: str) -> GpuReadings:
        """A fresh reading of every GPU of the node (temperature, thermal margin)."""
        data = self._read(node, "/v1/gpus")
        if isinstance(data, str):
            return GpuReadings(available=False, detail=data)
        return GpuReadings(available=True, gpus=[GpuReading.model_validate(g) for g in data["gpus"]])

    @activity.defn(name="agent.available")
    def available(self, node: str) -> bool:
        url = self._url(node)
        if url is None:
            return False
        try:
            return httpx.get(f"{url}/healthz", timeout=self.timeout).status_code == 200
        except httpx.HTTPError:
            return False

    @activity.defn(name="agent.reset_gpu")
    def reset_gpu(self, request: GpuResetRequest) -> ActionResult:
        url = self._url(request.node)
        target = f"GPU {request.gpu} on {request.node}"
        if url is None:
            raise fail(ErrorKind.INVALID, "no node agent configured")
        if request.dry_run or self.force_dry_run:
            return ActionResult(system="agent", action="reset", target=target, changed=False, dry_run=True)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        with http_errors(f"node agent of {request.node} (GPU reset)"):
            response = httpx.post(f"{url}/v1/gpus/{request.gpu}/reset", headers=headers, timeout=120)
        raise_for_status(response, "GPU reset refused")
        return ActionResult(system="agent", action="reset", target=target, changed=True,
                            detail=str(response.json().get("detail", "")))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.validate, self.gpus, self.available, self.reset_gpu]
