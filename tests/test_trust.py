"""The trust boundary (fleetmedic/trust.py, fleetmedic/routing.py): what alert labels and CLI input
may choose, pure and fast. The same strings are thrown at the running webhook in test_webhook.py."""

from __future__ import annotations

import pytest

from fleetmedic.models import Alert
from fleetmedic.policy import PolicyError, RoutingPolicy, parse_policy
from fleetmedic.routing import Refused, Routed, alert_facts, route
from fleetmedic.trust import UntrustedValue, checked_cluster, checked_node, node_name_error, visibility_literal
from workers.webhook import available_runbooks

# Strings an attacker or a broken relabelling rule puts into labels.
INJECTIONS = [
    'default" OR FleetCluster != "zz',
    "default' OR FleetCluster != 'zz",
    'x" OR "1"="1',
    "gpu-node-0\\",
    "gpu-node-0\n",
    "gpu\x00node",
    "a`b",
]
BAD_NODES = ["../../etc/passwd", "gpu-node-0\n", " gpu-node-0", "*", "gpu_node", "-gpu", "gpu-", "a" * 254,
             "gpu\x00node", "", "gpü-node", "node..a", 'x" OR "1"="1', "gpu-node-0/x"]


@pytest.mark.parametrize("value", INJECTIONS)
def test_visibility_literal_refuses_what_it_cannot_quote(value: str) -> None:
    with pytest.raises(UntrustedValue):
        visibility_literal(value)


def test_visibility_literal_quotes_plain_values() -> None:
    assert visibility_literal("gpu-node-0") == '"gpu-node-0"'
    assert visibility_literal("gpu node.a_b:c/d") == '"gpu node.a_b:c/d"'


@pytest.mark.parametrize("name", BAD_NODES)
def test_invalid_node_names_are_refused(name: str) -> None:
    assert node_name_error(name) is not None
    with pytest.raises(UntrustedValue):
        checked_node(name)


def test_node_names_are_normalised_to_lowercase_only() -> None:
    assert checked_node("GPU-NODE-0") == "gpu-node-0"
    assert checked_node("gpu-node-0.rack-3.example") == "gpu-node-0.rack-3.example"
    assert checked_node("a" * 253) == "a" * 253


def test_a_label_selects_among_configured_clusters_only() -> None:
    assert checked_cluster(None, ("prod", "lab"), "prod") == "prod"
    assert checked_cluster("lab", ("prod", "lab"), "prod") == "lab"
    for name in ("c0", "PROD", 'prod" OR 1', ""):
        if name == "":
            assert checked_cluster(name, ("prod",), "prod") == "prod"  # empty label: the default
            continue
        with pytest.raises(UntrustedValue, match="not served"):
            checked_cluster(name, ("prod", "lab"), "prod")


def test_policy_clusters_must_be_dns_labels() -> None:
    with pytest.raises(PolicyError, match="routing.clusters"):
        parse_policy('routing: {clusters: ["prod", "Bad Name"]}')
    assert parse_policy('routing: {clusters: ["prod", "lab"]}').routing.served_clusters == ("prod", "lab")
    assert parse_policy("").routing.served_clusters == ("default",)


def _alert(**labels: str) -> Alert:
    return Alert(status="firing", labels={"alertname": "FleetMedicGpuXid", "xid": "79", "gpu": "3", **labels})


def test_routing_refuses_what_labels_may_not_choose() -> None:
    policy, available = RoutingPolicy(clusters=["prod"], default_cluster="prod"), available_runbooks()

    def code(**labels: str) -> str:
        decision = route(_alert(**labels), policy, available)
        assert isinstance(decision, Refused), decision
        return decision.code

    assert code(node="gpu-1", cluster="c0") == "unknown_cluster"
    assert code(node="../../etc/passwd") == "invalid_node"
    assert code(node="gpu-1", cluster='prod" OR FleetCluster != "zz') == "unknown_cluster"
    assert code(node="gpu-1", gpu="x") == "invalid_label"
    assert code(node="gpu-1", xid="-5") == "invalid_label"
    assert code(cluster="prod") == "no_node_label"
    routed = route(_alert(node="GPU-NODE-0"), policy, available)
    assert isinstance(routed, Routed) and routed.workflow_id == "xid-recovery/prod/gpu-node-0"
    assert routed.input.node == "gpu-node-0"


def test_alert_facts_read_the_gpu_index_not_the_mig_instance() -> None:
    # dcgm-exporter: `gpu` is the index, GPU_I_ID the MIG instance; the XID value sits in an annotation.
    alert = Alert(status="firing", labels={"alertname": "FleetMedicGpuXid", "Hostname": "gpu-2", "gpu": "5",
                                           "GPU_I_ID": "1"}, annotations={"xid": "48"})
    facts = alert_facts(alert, RoutingPolicy())
    assert (facts.node, facts.gpu, facts.xid) == ("gpu-2", 5, 48)
    no_index = Alert(status="firing", labels={"alertname": "FleetMedicGpuXid", "Hostname": "gpu-2", "GPU_I_ID": "1"})
    assert alert_facts(no_index, RoutingPolicy()).gpu is None


def test_the_refused_alerts_rule_leaves_out_exactly_the_benign_reasons() -> None:
    import re
    from pathlib import Path

    import yaml

    from fleetmedic.routing import BENIGN_REASONS

    rules = yaml.safe_load((Path(__file__).parent.parent / "deploy/prometheus/fleetmedic-rules.yaml").read_text())
    [expr] = [r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == "FleetMedicAlertsRefused"]
    left_out = re.search(r'reason!~"([^"]+)"', expr)
    assert left_out is not None and set(left_out.group(1).split("|")) == BENIGN_REASONS
