"""The worker's side of the node agent: validation verdicts and GPU reset (against a stand-in)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from temporalio.exceptions import ApplicationError

from activities.agent import AgentActivities
from devstack.standins import AgentStandIn
from fleetmedic.models import GpuResetRequest, Validate
from tests.harness import run_activity as run


@pytest.fixture
def agent() -> Iterator[AgentStandIn]:
    with AgentStandIn() as server:
        yield server  # type: ignore[misc]



def test_validation_passes_and_fails_with_its_checks(agent: AgentStandIn) -> None:
    client = AgentActivities(agent.url_template, agent.token)
    ok = run(client.validate, Validate(node="n1", since=datetime.now(UTC), expected_gpus=8))
    assert ok.available and ok.passed and {c.name for c in ok.checks} >= {"gpus_present", "no_xid_since"}
    agent.passed = False
    bad = run(client.validate, Validate(node="n1", since=datetime.now(UTC)))
    assert bad.available and not bad.passed
    assert [c.value for c in bad.checks if not c.passed] == ["XID 79 on GPU 3"]


def test_no_agent_means_validation_is_skipped() -> None:
    assert not run(AgentActivities(None, None).validate, Validate(node="n1", since=datetime.now(UTC))).available
    unreachable = AgentActivities("http://127.0.0.1:9/{node}", None, timeout_s=1)
    verdict = run(unreachable.validate, Validate(node="n1", since=datetime.now(UTC)))
    assert not verdict.available and "unreachable" in verdict.detail
    assert not run(unreachable.available, "n1")


def test_reset_needs_the_token_and_honours_dry_run(agent: AgentStandIn) -> None:
    assert run(AgentActivities(agent.url_template, agent.token).reset_gpu, GpuResetRequest(node="n1", gpu=2)).changed
    assert agent.resets == [("n1", 2)]
    assert run(AgentActivities(agent.url_template, agent.token).reset_gpu,
               GpuResetRequest(node="n1", gpu=2, dry_run=True)).dry_run
    with pytest.raises(ApplicationError) as err:
        run(AgentActivities(agent.url_template, "wrong").reset_gpu, GpuResetRequest(node="n1", gpu=2))
    assert err.value.type == "Forbidden" and err.value.non_retryable
    assert agent.resets == [("n1", 2)]
