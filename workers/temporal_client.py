"""Connecting to Temporal the way the `temporal` CLI does, and the search attributes we need."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeIndexedValueType
from temporalio.envconfig import ClientConfig
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode

from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES

log = logging.getLogger(__name__)
DEFAULT_ADDRESS = "localhost:7233"


def connect_config() -> dict[str, Any]:
    """TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS*, TEMPORAL_PROFILE and the
    Temporal config file, read by the SDK's own environment configuration."""
    config: dict[str, Any] = dict(ClientConfig.load_client_connect_config())
    config.setdefault("target_host", DEFAULT_ADDRESS)
    config.setdefault("namespace", "default")
    return config


class TemporalUnavailable(Exception):
    """The webhook's answer to a batch Temporal did not take: 503, and the sender retries."""

    @classmethod
    def from_rpc(cls, exc: Exception) -> TemporalUnavailable:
        status = getattr(exc, "status", None)
        return cls(f"{status.name if status else 'error'}: {str(getattr(exc, 'message', exc))[:200]}")


class WebhookBusy(Exception):
    """The webhook's own call slots stayed taken (a burst ahead of this batch): 503, and the
    sender retries. Not Temporal's answer, and not reported as one."""


class TemporalUnreachable(Exception):
    """Temporal did not answer: one line for the operator, never a transport traceback."""


async def connect(runtime: Runtime | None = None, **overrides: Any) -> Client:
    """The client, or TemporalUnreachable saying where it looked and what to check."""
    config = {**connect_config(), **overrides}
    try:
        return await Client.connect(**config, data_converter=data_converter, runtime=runtime)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TemporalUnreachable(f"cannot reach Temporal at {config['target_host']} (TEMPORAL_ADDRESS or "
                                  f"--address): is it running? ({first})") from None


class SearchAttributesMissing(Exception):
    """The namespace lacks FleetMedic's search attributes and this identity may not add them: one
    line naming them and the commands that do (docs/production.md §1)."""


def missing_search_attribute(exc: RPCError) -> str | None:
    """What to tell an operator when Temporal refused a start or a query because the namespace has
    no such search attribute (or its frontend has not seen it yet); None for any other refusal."""
    if exc.status != RPCStatusCode.INVALID_ARGUMENT or "search attribute" not in exc.message.lower():
        return None
    return (f"the Temporal namespace lacks FleetMedic's search attributes ({exc.message[:160]}): the worker "
            "registers them at start, or see docs/production.md §1; retry")


async def ensure_search_attributes(client: Client, usable_within: timedelta = timedelta(seconds=60)) -> list[str]:
    """Register FleetMedic's search attributes when missing, and return once the frontend takes
    them. Returns those added.

    A self-hosted server (SQL or Elasticsearch visibility) maps new attributes at once but its
    frontends learn of them at their next namespace-cache refresh (every 2 s by default,
    `system.namespaceCacheRefreshInterval`): until then a start naming one is refused, so this
    waits for a query that names them all. Where this identity may not add them (Temporal Cloud,
    an authorizer without admin rights) it raises SearchAttributesMissing with the commands that do.
    """
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace))
    known = set(existing.custom_attributes) | set(existing.system_attributes)
    missing = {key.name: _indexed(key.indexed_value_type) for key in SEARCH_ATTRIBUTES if key.name not in known}
    if not missing:
        return []
    try:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing))
    except RPCError as exc:
        if exc.status in (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.UNIMPLEMENTED):
            raise SearchAttributesMissing(
                f"Temporal namespace {client.namespace} lacks search attributes {', '.join(sorted(missing))} and "
                f"this identity may not add them ({exc.status.name}: {exc.message[:120]}); an admin adds them "
                f"once: {register_commands(client.namespace, sorted(missing))}") from None
        raise
    await _until_usable(client, sorted(missing), usable_within)
    log.info("registered search attributes %s", sorted(missing))
    return sorted(missing)


def register_commands(namespace: str, names: list[str]) -> str:
    kinds = {key.name: key.indexed_value_type.name.title().replace("_", "") for key in SEARCH_ATTRIBUTES}
    return "; ".join(f"temporal operator search-attribute create --namespace {namespace} --name {name} "
                     f"--type {kinds[name]}" for name in names)


async def _until_usable(client: Client, names: list[str], within: timedelta) -> None:
    query = " AND ".join(f"{name} IS NULL" for name in names)
    deadline = time.monotonic() + within.total_seconds()
    while True:
        try:
            await client.count_workflows(query)
            return
        except RPCError as exc:
            if missing_search_attribute(exc) is None or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def _indexed(kind: SearchAttributeIndexedValueType) -> IndexedValueType.ValueType:
    return IndexedValueType.ValueType(int(kind))
