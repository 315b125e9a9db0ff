"""Connecting to Temporal the way the `temporal` CLI does, and the search attributes we need."""

from __future__ import annotations

import logging
from typing import Any

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeIndexedValueType
from temporalio.envconfig import ClientConfig
from temporalio.runtime import Runtime

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


async def ensure_search_attributes(client: Client) -> list[str]:
    """Register FleetMedic's search attributes when missing. Returns those added.

    Works on the dev server and self-hosted clusters; on Temporal Cloud register them with
    tcld (docs/production.md), and this logs what is missing.
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
    except Exception as exc:
        log.error("search attributes %s are missing and could not be registered: %s", sorted(missing), exc)
        raise
    log.info("registered search attributes %s", sorted(missing))
    return sorted(missing)


def _indexed(kind: SearchAttributeIndexedValueType) -> IndexedValueType.ValueType:
    return IndexedValueType.ValueType(int(kind))
