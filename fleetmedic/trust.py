"""The trust boundary: what an alert, a CLI argument or a UI form may say, and how it is cleaned.

Everything here is pure. Alerts and operator input are untrusted: a node name must be a valid
Kubernetes node name, a cluster must be one the deployment is configured for (an input only
selects among them, it never creates one, since each cluster has its own fleet guard and budget),
and any value that reaches a Temporal visibility query goes through :func:`visibility_literal`.
"""

from __future__ import annotations

import re

# Kubernetes node names are DNS-1123 subdomains: lowercase alphanumerics, '-' and '.', each dot
# separated part starting and ending alphanumeric, 253 characters at most.
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
MAX_NODE_NAME = 253
# Cluster names appear in workflow IDs and Slurm reasons: keep them to a DNS-1123 label.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_CLUSTER_NAME = 63


class UntrustedValue(ValueError):
    """A value from outside that FleetMedic refuses, with the reason an operator can act on."""


def normalise_node(raw: str) -> str:
    """The documented normalisation of a node name from an alert or the CLI: ASCII lowercase.

    Hostnames are case-insensitive and some exporters report `GPU-NODE-0`; Kubernetes stores
    `gpu-node-0`. Nothing else is changed: whitespace, dots at the ends and the like are refused,
    never trimmed into some other node's name.
    """
    return raw.lower() if raw.isascii() else raw


def node_name_error(name: str) -> str | None:
    """Why `name` is not a valid Kubernetes node name, or None when it is."""
    if not name:
        return "node name is empty"
    if len(name) > MAX_NODE_NAME:
        return f"node name is {len(name)} characters long, more than {MAX_NODE_NAME}"
    if not _DNS1123_SUBDOMAIN.fullmatch(name):
        return (f"node name {_shown(name)} is not a valid Kubernetes node name (lowercase letters, digits, '-' "
                "and '.', starting and ending with a letter or digit)")
    return None


def checked_node(raw: str) -> str:
    """The normalised node name, or UntrustedValue with the reason."""
    name = normalise_node(raw)
    error = node_name_error(name)
    if error is not None:
        raise UntrustedValue(error)
    return name


def cluster_name_error(name: str) -> str | None:
    if not name:
        return "cluster name is empty"
    if len(name) > MAX_CLUSTER_NAME or not _DNS1123_LABEL.fullmatch(name):
        return (f"cluster name {_shown(name)} is not a DNS-1123 label (lowercase letters, digits and '-', "
                f"at most {MAX_CLUSTER_NAME})")
    return None


def checked_cluster(raw: str | None, configured: tuple[str, ...] | list[str], default: str) -> str:
    """The cluster an input selects: one of `configured`, or `default` when it names none."""
    name = default if raw is None or raw == "" else raw
    if name not in configured:
        raise UntrustedValue(f"cluster {_shown(name)} is not served by this FleetMedic "
                             f"(configured: {', '.join(configured)})")
    return name


# Characters Temporal's visibility query language cannot carry inside a quoted literal without
# escapes whose handling differs between the SQL and Elasticsearch stores: refuse them outright.
_UNQUOTABLE = re.compile(r"[\"'\\`\x00-\x1f\x7f]")


def visibility_literal(value: str) -> str:
    """`value` as a double-quoted literal of a visibility query, or UntrustedValue.

    Every query FleetMedic builds from data (cluster, node, runbook names) goes through here, so
    no input can close the quote and add `OR FleetCluster != "x"` to a count the lemon rule trusts.
    """
    if _UNQUOTABLE.search(value):
        raise UntrustedValue(f"{_shown(value)} contains a quote, backslash or control character and cannot "
                             "be used in a visibility query")
    if len(value) > 1000:
        raise UntrustedValue("value is longer than a visibility query literal may be (1000 characters)")
    return f'"{value}"'


def _shown(value: str, limit: int = 80) -> str:
    """A value quoted for an error message: control characters visible, long values cut."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…'"
