"""The Temporal UI as an operator sees it, in Debian's Chromium (headless): an escalated run started
from the CLI shows what it is about, why it waits and the command that answers it; once answered,
the workflow list's saved query on `FleetOutcome` tells the aborted run apart from a repaired one."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from urllib.parse import quote

from temporalio.client import WorkflowHandle

from fleetmedic.ids import guard_workflow_id, node_workflow_id
from fleetmedic.models import RunbookStatus
from tests.browser import headless_chromium
from tests.conftest import require
from tests.harness import settings_for, worker_for
from tests.runbook_stack import Stack, status_when


def chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    require(binary is not None, "Debian's chromium (scripts/install-system-deps)")
    assert binary is not None
    return binary


async def test_an_escalated_run_shows_its_summary_why_it_waits_and_what_to_do(stack: Stack, temporal_ui: str,
                                                                               tmp_path: Path) -> None:
    browser = chromium()
    stack.provider.fail_next(503, times=100)  # the replacement cannot be asked for: the run escalates
    settings = settings_for(stack.task_queue, stack.kube, slurm=stack.slurm, slack=stack.slack,
                            provider=stack.provider)
    workflow_id = node_workflow_id("xid-recovery", stack.cluster, "gpu-node-0")
    # Screenshots land where CI keeps artifacts when it says so, else beside the test's files.
    shots = Path(os.environ.get("FLEETMEDIC_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    async with worker_for(stack.client, settings, stack.policy()):
        started = await asyncio.to_thread(stack.cli, "run", "xid-recovery", "--node", "gpu-node-0", "--xid", "79",
                                          "--gpu", "3", "--by", "alice")
        assert started.returncode == 0, started.stderr
        handle: WorkflowHandle[object, RunbookStatus] = stack.client.get_workflow_handle(
            workflow_id, result_type=RunbookStatus)
        try:
            status = await status_when(handle, lambda s: s.escalation is not None)
            assert status.escalation is not None
            page_url = (f"{temporal_ui}/namespaces/default/workflows/{quote(workflow_id, safe='')}/"
                        f"{(await handle.describe()).run_id}/user-metadata")
            async with headless_chromium(browser, tmp_path / "chromium") as page:
                await page.goto(page_url)
                text = await page.wait_for_text(
                    # the summary and details, set when the run started
                    f"xid-recovery gpu-node-0 in {stack.cluster} (XID 79, GPU 3) — started by alice",
                    "Started by alice (fleetmedic run)", "Live",
                    # why it waits: the escalation and the error behind it
                    "Waiting for: an operator's answer", f"Escalated: {status.escalation.error}",
                    # what to do, as a command to paste
                    f"fleetmedic answer {workflow_id} retry|skip|abort --by YOU",
                    f"fleetmedic abort {workflow_id} --by YOU")
                await page.screenshot(shots / "escalated-run.png")
                assert "Unavailable" in text or "503" in text, text
                # The fleet guard that granted its lease says what it is and how to pause it.
                guard = await stack.client.get_workflow_handle(guard_workflow_id(stack.cluster)).describe()
                assert await guard.static_summary() == f"fleet-guard {stack.cluster} — disruption leases"
                assert f"fleetmedic pause --cluster {stack.cluster}" in (await guard.static_details() or "")

                answered = await asyncio.to_thread(stack.cli, "answer", workflow_id, "abort", "--by", "alice",
                                                   "--reason", "hardware team on it")
                assert answered.returncode == 0, answered.stderr
                report = await asyncio.wait_for(handle.result(), 60)
                assert report.outcome == "aborted"

                # The list an operator keeps open: the saved query of the README finds the run by outcome.
                query = f'WorkflowId="{workflow_id}" AND FleetOutcome="aborted"'
                await page.goto(f"{temporal_ui}/namespaces/default/workflows?query={quote(query)}")
                await page.wait_for_text(workflow_id)
                await page.goto(f"{temporal_ui}/namespaces/default/workflows/{quote(workflow_id, safe='')}/"
                                f"{(await handle.describe()).run_id}/user-metadata")
                await page.wait_for_text("Ended: aborted")
                await page.screenshot(shots / "aborted-run.png")
        except BaseException:
            await handle.terminate("test failed")
            raise
    for name in ("escalated-run.png", "aborted-run.png"):
        assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
