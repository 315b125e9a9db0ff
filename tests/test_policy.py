"""The policy file: defaults, validation that names the bad field, and the CLI refusing to start."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from fleetmedic import policy as policy_module
from fleetmedic.policy import Policy, PolicyError, default_policy_text, load_policy, parse_policy, shared
from fleetmedic.xid import XidAction


def test_default_policy_file_matches_the_models() -> None:
    policy = load_policy(None)
    assert policy == Policy()  # the shipped YAML says exactly what the code defaults to
    assert policy.grace.checkpoint == timedelta(seconds=120)
    assert policy.thermal.threshold_c == 78
    assert policy.xid.catalog[79].action is XidAction.REPLACE
    assert policy.labels.opt_out_pair == ("fleetmedic.io/remediation", "disabled")


@pytest.mark.parametrize(("document", "field", "reason"), [
    ("grace: {checkpoint: 10x}", "grace.checkpoint", "is not a duration"),
    ("budget: {max_concurrent: 0}", "budget.max_concurrent", "greater than or equal to 1"),
    ("budget: {max_unavailable_fraction: 1.5}", "budget.max_unavailable_fraction", "less than or equal to 1"),
    ("provider: {kind: aws}", "provider.kind", "'manual', 'cluster-api', 'karpenter' or 'http'"),
    ("xid: {catalog: {79: explode}}", "xid.catalog.79.action", "'replace'"),
    ("xid: {catalog: {abc: notify}}", "xid.catalog", "XID 'abc' is not a number"),
    ("labels: {opt_out: disabled}", "labels.opt_out", "must be written key=value"),
    ("storage: {layout: /etc/*}", "storage.layout", "relative glob"),
    ("thermal: {mode: hot}", "thermal.mode", "'absolute' or 'margin'"),
    ("traffic: {overflow_taint: 'fleetmedic.io/overflow=closed:NoExecute'}", "traffic.overflow_taint",
     "never NoExecute"),
    ("nvlink: {degraded_taint: 'x=y:NoExecute'}", "nvlink.degraded_taint", "NoSchedule"),
    ("traffic: {inference_selector: 'a=b,c=d'}", "traffic.inference_selector", "must be written key=value"),
    ("kueue: {queues: {training: {mode: half}}}", "kueue.queues.training.mode", "'all', 'share' or 'reserve'"),
    ("grace: {checkpoint: 1h, eviction_deadline: 10m}", "(document)", "grace.checkpoint must not be longer"),
    ("unknown_section: 1", "unknown_section", "unknown key (valid: approvals, budget, burn_in, crash, drain,"),
    ("budget: {max_concurent: 3}", "budget.max_concurent", "unknown key; did you mean 'max_concurrent'?"),
    ("grace: {checkpoint: 30m1h}", "grace.checkpoint", "largest first"),
    ("retries: {wait_heartbeat: 1s}", "retries.wait_heartbeat", "between 10s and 1h"),
    ("[1, 2]", "(document)", "must be a mapping"),
    ("grace: {checkpoint: [", "(document)", "not valid YAML"),
])
def test_bad_policy_names_the_field_and_the_reason(document: str, field: str, reason: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(document, "site.yaml")
    assert caught.value.field == field
    assert reason in caught.value.reason
    assert str(caught.value).startswith(f"invalid policy site.yaml: {field}: ")


def test_catalog_overrides_keep_the_other_defaults() -> None:
    policy = parse_policy("xid: {catalog: {63: reset_gpu, 61: {action: notify, description: ours}}}")
    assert policy.xid.catalog[63].action is XidAction.RESET_GPU
    assert policy.xid.catalog[61].description == "ours"
    assert policy.xid.catalog[79].action is XidAction.REPLACE  # untouched


def test_a_catalog_entry_keeps_what_it_does_not_say() -> None:
    """An entry that changes one field of a built-in XID keeps the others: turning `job_lost` off
    for 79 leaves it a replace; changing 48's action leaves it `job_lost`."""
    policy = parse_policy("xid: {catalog: {79: {job_lost: false}, 48: replace}}", "test")
    assert policy.xid.catalog[79].action is XidAction.REPLACE and not policy.xid.catalog[79].job_lost
    assert policy.xid.catalog[48].action is XidAction.REPLACE and policy.xid.catalog[48].job_lost
    assert policy.xid.catalog[48].description == "Double-bit ECC error"
    with pytest.raises(PolicyError, match="xid.catalog.555.action"):
        parse_policy("xid: {catalog: {555: {job_lost: true}}}", "test")


def test_durations_accept_units_and_seconds() -> None:
    policy = parse_policy("grace: {checkpoint: 90, eviction_deadline: 30m, node_ready_deadline: 2h}\n"
                          "lemon: {window: 7d}\napprovals: {timeout: 1h30m}\nbudget: {lease_timeout: 2d12h}")
    assert policy.grace.checkpoint == timedelta(seconds=90)
    assert policy.grace.node_ready_deadline == timedelta(hours=2)
    assert policy.lemon.window == timedelta(days=7)
    # Compound, as Go, Prometheus and kubectl write them; and back the same way.
    assert policy.approvals.timeout == timedelta(hours=1, minutes=30)
    assert policy.budget.lease_timeout == timedelta(days=2, hours=12)
    assert policy.model_dump(mode="json")["approvals"]["timeout"] == "1h30m"


def test_policy_round_trips_through_json_for_workflows() -> None:
    # Workflows receive the policy through Temporal's pydantic converter (JSON, field names).
    policy = parse_policy("shadow: {global: true, runbooks: {hot-gpu-pull: true}}")
    again = Policy.model_validate_json(policy.model_dump_json())
    assert again == policy and again.shadow.enabled_for("xid-recovery")


def test_missing_policy_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "nope.yaml")


def test_worker_refuses_to_start_with_a_bad_policy(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("grace:\n  checkpoint: soon\n")
    done = subprocess.run([sys.executable, "-m", "workers.cli", "worker"], capture_output=True, text=True,
                          env={"FLEETMEDIC_POLICY": str(bad), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 2
    assert f"invalid policy {bad}: grace.checkpoint: " in done.stderr


def test_policy_check_command(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(default_policy_text())
    ok = subprocess.run([sys.executable, "-m", "workers.cli", "policy", "check", str(good)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "valid" in ok.stdout


def test_runs_share_one_object_per_policy() -> None:
    # Each run loads the policy through its own activity result: equal ones become one object, so
    # 5,000 runs in flight hold one policy, not 5,000 copies; a changed file is a policy of its own.
    # Start from no shared policies: tests before this one (workers in this process) leave some,
    # and a full cache is dropped on the next new policy.
    policy_module._SHARED = {}
    first, again = load_policy(None), load_policy(None)
    assert first is not again
    assert shared(first) is shared(again) is shared(first)
    changed = parse_policy("lemon:\n  count: 9\n")
    assert shared(changed) is not shared(first)
    assert shared(changed).lemon.count == 9
    # Policy files come and go: the ones kept stay few.
    for n in range(2, 12):
        shared(parse_policy(f"lemon:\n  count: {n}\n"))
    assert len(policy_module._SHARED) <= 4
    assert shared(load_policy(None)) == first
