"""`fleetmedic`: the command line of DESIGN.md.

A command whose issue is still open says so and exits 2; it never pretends to work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.breaker import MEMO_KEY, VIEW_EVERY, GuardView
from activities.start import RUNBOOK_TASK_TIMEOUT, start_or_attach
from fleetmedic.details import run_details
from fleetmedic.ids import (
    NODE_RUNBOOKS,
    cluster_workflow_id,
    guard_queue,
    guard_workflow_id,
    node_workflow_id,
    run_summary,
    start_attributes,
)
from fleetmedic.models import (
    Approval,
    EscalationAnswer,
    GuardState,
    NodeRunbookInput,
    Operator,
    Replaced,
    RunbookStatus,
)
from fleetmedic.policy import PolicyError, load_policy
from fleetmedic.quota import QuotaSyncInput
from fleetmedic.settings import Settings, SettingsError
from fleetmedic.traffic import TrafficInput
from fleetmedic.trust import UntrustedValue, checked_node, cluster_name_error, visibility_literal
from workers import event_loop
from workers.temporal_client import SearchAttributesMissing, TemporalUnreachable

# `run --wait` exits 3 with these: the run ended without doing what it was started for.
UNSUCCESSFUL = frozenset({"aborted", "rejected", "quarantined", "stopped", "invalid-input", "unknown-node"})
# How long `pause` and `resume` wait for the guard to record the change in its memo, which every
# worker reads (activities/breaker.py): until then, a run's first protective step can miss it.
APPLIED_WITHIN_S = 30.0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetmedic")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetmedic", description="GPU fleet remediation runbooks on Temporal.")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--version", action="version", version=f"fleetmedic {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dev = sub.add_parser("dev", help="the embedded local stack: Temporal dev server + UI, worker, emulated fleet")
    dev.add_argument("--state-dir", type=Path, default=Path(".fleetmedic/dev"),
                     help="Temporal history and dev files, kept across restarts (default: .fleetmedic/dev)")
    dev.add_argument("--port", type=int, default=7233, help="Temporal frontend port (default 7233)")
    dev.add_argument("--ui-port", type=int, default=8233, help="Temporal UI port (default 8233)")
    dev.add_argument("--nodes", type=int, default=8, help="emulated GPU nodes (default 8)")
    dev.add_argument("--no-slurm", action="store_true", help="do not start a local Slurm cluster")
    dev.add_argument("--webhook-port", type=int, default=8080, help="alert webhook port (default 8080)")
    dev.add_argument("--agent-port", type=int, default=9400, help="the fake-NVML node agents' port (default 9400)")
    dev.add_argument("--policy", type=Path, help="a site policy to run the dev fleet under (approvals, shadow mode, "
                                                 "budgets); the provider and storage stay the dev ones")

    sub.add_parser("worker", help="run the Temporal worker (runbooks and activities)")
    webhook = sub.add_parser("webhook", help="run the Alertmanager webhook receiver")
    webhook.add_argument("--host", default=None,
                         help="listen address (default: 0.0.0.0 in a container, else 127.0.0.1)")
    webhook.add_argument("--port", type=int, default=8080)
    webhook.add_argument("--insecure-no-auth", action="store_true",
                         help="accept alerts without a bearer token (only on a trusted network)")
    agent = sub.add_parser("agent", help="run the GPU node agent (DaemonSet): metrics, validation, GPU reset")
    agent.add_argument("--host", default="0.0.0.0")
    agent.add_argument("--port", type=int, default=9400)

    run = sub.add_parser("run", help="start a runbook by hand")
    run.add_argument("runbook", choices=sorted(NODE_RUNBOOKS + ("traffic-flip", "migrate-back", "kueue-quota-sync")))
    run.add_argument("--node", help="the node (node runbooks)")
    run.add_argument("--gpu", type=int)
    run.add_argument("--xid", type=int)
    run.add_argument("--temperature", type=float, help="hot-gpu-pull: the reading that started it (°C)")
    run.add_argument("--cluster", help="default: FLEETMEDIC_CLUSTER")
    run.add_argument("--dry-run", action="store_true", help="shadow mode: record what would be done")
    run.add_argument("--wait", action="store_true", help="wait for the outcome")
    run.add_argument("--by", default="cli", help="who asks (recorded in the history)")

    guard_commands = []
    for name, text in (("pause", "stop new disruption leases and hold every runbook before its next destructive "
                                 "step (recovery steps go on)"), ("resume", "lift the fleet-wide pause")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--reason", default="")
        command.add_argument("--by", default=os.environ.get("USER", "cli"), help="who (recorded everywhere)")
        command.add_argument("--cluster", help="default: FLEETMEDIC_CLUSTER")
        command.add_argument("--within", type=float, default=APPLIED_WITHIN_S, metavar="SECONDS",
                             help="how long to wait for the guard to record it (exit 1 if it has not)")
        guard_commands.append(command)
    breaker = sub.add_parser("breaker", help="the cordon breaker: `breaker reset --by NAME` once you have looked at "
                                             "why it tripped (it never resets by itself)")
    breaker.add_argument("action", choices=["reset"])
    breaker.add_argument("--by", default=os.environ.get("USER", ""), help="who resets it (required)")
    breaker.add_argument("--reason", default="")
    breaker.add_argument("--cluster", help="default: FLEETMEDIC_CLUSTER")
    answers = []
    for name, text in (("approve", "approve the step a runbook waits on"),
                       ("reject", "reject the step a runbook waits on (needs --reason); the run ends")):
        command = sub.add_parser(name, help=text)
        command.add_argument("workflow_id")
        command.add_argument("--by", default=os.environ.get("USER", ""), help="who approves (required)")
        command.add_argument("--reason", default="")
        answers.append(command)
    answer = sub.add_parser("answer", help="answer a runbook's escalation: retry the step, skip it, or abort the run")
    answer.add_argument("workflow_id")
    answer.add_argument("action", choices=("retry", "skip", "abort"))
    abort = sub.add_parser("abort", help="abort a runbook (it leaves what it changed in place, and says so)")
    abort.add_argument("workflow_id")
    replaced = sub.add_parser("replaced", help="tell a runbook that a person replaced or repaired its node")
    replaced.add_argument("workflow_id")
    replaced.add_argument("--new-node", help="the replacement's node name, when it came back under another one")
    for command in (answer, abort, replaced):
        command.add_argument("--by", default=os.environ.get("USER", ""), help="who (required; recorded everywhere)")
        command.add_argument("--reason", default="")
        answers.append(command)
    status = sub.add_parser("status", help="open runbooks: node, step, what each waits for")
    status.add_argument("--cluster", help="default: FLEETMEDIC_CLUSTER")
    status.add_argument("-o", "--output", choices=("table", "json"), default="table")
    jobs = sub.add_parser("jobs", help="training jobs: failures, restarts, lost time, ETTR; suspects on trial")
    jobs.add_argument("--cluster", help="default: FLEETMEDIC_CLUSTER")
    jobs.add_argument("-o", "--output", choices=("table", "json"), default="table")
    audit = sub.add_parser("audit", help="the timeline of one run, from its Temporal history")
    audit.add_argument("workflow_id")
    audit.add_argument("--format", choices=("md", "json"), default="md")

    policy = sub.add_parser("policy", help="validate a policy file, or print the default one")
    policy.add_argument("action", choices=("check", "default"))
    policy.add_argument("file", nargs="?")

    for command in (run, audit, sub.choices["status"], jobs, sub.choices["worker"], webhook, breaker, *guard_commands,
                    *answers):
        command.add_argument("--address", help="Temporal address (default: TEMPORAL_ADDRESS or localhost:7233)")
        command.add_argument("--namespace", help="Temporal namespace (default: TEMPORAL_NAMESPACE or default)")
    return p


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.command == "run" and args.runbook in NODE_RUNBOOKS and not args.node:
        cli.error(f"run {args.runbook}: --node is required")
    if args.command == "run" and args.runbook not in NODE_RUNBOOKS and (args.node or args.gpu is not None
                                                                          or args.xid is not None):
        cli.error(f"run {args.runbook}: a cluster runbook takes no --node, --gpu or --xid (it acts on --cluster)")
    if args.command == "run" and args.runbook == "xid-recovery" and args.xid is None:
        cli.error("run xid-recovery: --xid is required (the XID decides what the runbook does)")
    if args.command == "run" and args.runbook in NODE_RUNBOOKS:
        try:  # the same rule the webhook applies to alert labels (fleetmedic/trust.py)
            args.node = checked_node(args.node)
        except UntrustedValue as exc:
            cli.error(f"run {args.runbook}: --node: {exc}")
    if args.command in ("approve", "reject", "answer", "abort", "replaced") and not args.by.strip():
        cli.error(f"{args.command}: --by is required (who decides; it is recorded in the run's history)")
    if args.command == "reject" and not args.reason.strip():
        cli.error("reject: --reason is required (the run ends; say why)")
    if getattr(args, "new_node", None):
        try:
            args.new_node = checked_node(args.new_node)
        except UntrustedValue as exc:
            cli.error(f"replaced: --new-node: {exc}")
    if getattr(args, "cluster", None) and (error := cluster_name_error(args.cluster)):
        cli.error(f"--cluster: {error}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings.from_env()
        if args.command == "policy":
            return policy_command(args)
        if args.command == "dev":
            DevOptions, run_dev = load_dev_stack()
            asyncio.run(run_dev(DevOptions(state_dir=args.state_dir, port=args.port, ui_port=args.ui_port,
                                           nodes=args.nodes, slurm=not args.no_slurm,
                                           webhook_port=args.webhook_port, agent_port=args.agent_port,
                                           policy=args.policy)))
            return 0
        if args.command == "worker":
            from workers.worker import run_worker

            policy = load_policy(settings.policy_path)  # a bad policy stops the process here
            _apply_address(args)
            event_loop.run(run_worker(settings, policy, own_process=True), settings.event_loop)
            return 0
        if args.command == "webhook":
            from workers.webhook import default_listen_host, serve

            policy = load_policy(settings.policy_path)
            _apply_address(args)
            event_loop.run(serve(settings, policy, host=args.host or default_listen_host(), port=args.port,
                                 insecure_no_auth=args.insecure_no_auth), settings.event_loop)
            return 0
        if args.command == "agent":
            from workers.node_agent.serve import serve as serve_agent

            policy = load_policy(settings.policy_path)
            try:
                event_loop.run(serve_agent(settings, policy, host=args.host, port=args.port), settings.event_loop)
            except ValueError as exc:
                print(f"fleetmedic agent: {exc}", file=sys.stderr)
                return 2
            return 0
        _apply_address(args)
        return asyncio.run(client_command(args, settings))
    except (PolicyError, SettingsError) as exc:
        print(f"fleetmedic: {exc}", file=sys.stderr)
        return 2
    except RPCError as exc:
        print(f"fleetmedic: Temporal: {exc.message}", file=sys.stderr)
        return 1
    except (TemporalUnreachable, SearchAttributesMissing) as exc:
        print(f"fleetmedic {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _apply_address(args: argparse.Namespace) -> None:
    if getattr(args, "address", None):
        os.environ["TEMPORAL_ADDRESS"] = args.address
    if getattr(args, "namespace", None):
        os.environ["TEMPORAL_NAMESPACE"] = args.namespace


def policy_command(args: argparse.Namespace) -> int:
    from fleetmedic.policy import default_policy_text

    if args.action == "default":
        print(default_policy_text(), end="")
        return 0
    policy = load_policy(args.file)
    print(f"{args.file or 'the default policy'}: valid (provider {policy.provider.kind}, "
          f"{len(policy.xid.catalog)} XIDs in the catalog)")
    return 0


async def client_command(args: argparse.Namespace, settings: Settings) -> int:
    from workers.temporal_client import connect

    if args.command == "breaker" and not args.by.strip():
        print("fleetmedic breaker reset: --by is required (who looked at why it tripped)", file=sys.stderr)
        return 2
    client = await connect()
    if args.command == "run":
        return await run_command(client, args, settings)
    if args.command == "status":
        return await status_command(client, args.cluster or settings.cluster, args.output)
    if args.command == "jobs":
        from workers.jobs_cli import jobs_command

        return await jobs_command(client, args.cluster or settings.cluster, args.output)
    if args.command in ("pause", "resume"):
        return await guard_command(client, args, settings)
    if args.command == "breaker":
        return await breaker_command(client, args, settings)
    if args.command in ("approve", "reject"):
        handle = client.get_workflow_handle(args.workflow_id)
        try:
            answer = await handle.execute_update(args.command, Approval(by=args.by, reason=args.reason),
                                                 result_type=str)
        except WorkflowUpdateFailedError as exc:
            print(f"fleetmedic {args.command}: refused: {exc.cause}", file=sys.stderr)
            return 2
        print(answer)
        return 0
    if args.command in ("answer", "abort", "replaced"):
        return await signal_command(client, args)
    if args.command == "audit":
        from workers.audit import audit_command

        return await audit_command(client, args.workflow_id, args.format)
    raise AssertionError(args.command)


async def run_command(client: Client, args: argparse.Namespace, settings: Settings) -> int:
    """Start a runbook by hand; a second start for the same ID attaches to the running one."""
    cluster = args.cluster or settings.cluster
    node = args.node if args.runbook in NODE_RUNBOOKS else ""
    runbook_input: BaseModel
    if node:
        runbook_input = NodeRunbookInput(cluster=cluster, node=node, gpu=args.gpu, xid=args.xid,
                                         temperature_c=args.temperature, dry_run=args.dry_run, requested_by=args.by)
    elif args.runbook == "kueue-quota-sync":
        runbook_input = QuotaSyncInput(cluster=cluster, dry_run=args.dry_run, requested_by=args.by)
    else:
        runbook_input = TrafficInput(cluster=cluster, dry_run=args.dry_run, requested_by=args.by)
    workflow_id = node_workflow_id(args.runbook, cluster, node) if node else cluster_workflow_id(args.runbook, cluster)
    handle = await start_or_attach(
        client, args.runbook, runbook_input, result_type=RunbookStatus, workflow_id=workflow_id,
        task_queue=settings.task_queue, task_timeout=RUNBOOK_TASK_TIMEOUT,
        search_attributes=start_attributes(args.runbook, cluster, node, args.xid if node else None, args.dry_run),
        summary=run_summary(args.runbook, cluster, node, args.xid if node else None, args.gpu if node else None,
                            f"started by {args.by}" + (" (shadow)" if args.dry_run else "")),
        details=run_details(workflow_id, args.runbook, cluster, node=node, gpu=args.gpu if node else None,
                            xid=args.xid if node else None, dry_run=args.dry_run,
                            started_by=f"{args.by} (fleetmedic run)"))
    print(f"{workflow_id} (run {handle.result_run_id}): started{' in shadow mode' if args.dry_run else ''}")
    if args.wait:
        report = await handle.result()
        if args.runbook == "kueue-quota-sync":  # the diff, one line per queue and flavor
            for decision in report.decisions:
                if decision.step == "compare":
                    print(f"  {decision.result}")
        traffic = args.runbook in ("traffic-flip", "migrate-back")
        why = report.decisions[-1].result if traffic and report.decisions else ""
        print(f"outcome: {report.outcome}" + (f": {why}" if why else ""))
        if report.outcome in UNSUCCESSFUL:
            return 3
    return 0


async def signal_command(client: Client, args: argparse.Namespace) -> int:
    """`answer`, `abort`, `replaced`: the runbook's signals, as the UI sends them."""
    handle = client.get_workflow_handle(args.workflow_id)
    arg: BaseModel
    if args.command == "answer":
        arg = EscalationAnswer(action=args.action, by=args.by, reason=args.reason)
        status = await handle.query("status", result_type=RunbookStatus, rpc_timeout=timedelta(seconds=5))
        if status.escalation is None:
            print(f"fleetmedic answer: {args.workflow_id} is not waiting for an answer (step: {status.step})",
                  file=sys.stderr)
            return 2
    elif args.command == "abort":
        arg = Operator(by=args.by, reason=args.reason)
    else:
        arg = Replaced(by=args.by, new_node=args.new_node, reason=args.reason)
    await handle.signal(args.command, arg)
    print(f"{args.workflow_id}: {args.command} sent by {args.by}")
    return 0


async def guard_command(client: Client, args: argparse.Namespace, settings: Settings) -> int:
    """Signal-with-start the cluster's fleet guard (it exists from the first pause on), and return
    once the guard has recorded the change: a change started right after `fleetmedic pause` is held."""
    cluster = args.cluster or settings.cluster
    operator = Operator(by=args.by, reason=args.reason)
    await start_or_attach(client, "fleet-guard", GuardState(cluster=cluster), workflow_id=guard_workflow_id(cluster),
                          task_queue=guard_queue(settings.task_queue), signal=args.command, signal_args=[operator])
    pausing = args.command == "pause"
    verb = "paused" if pausing else "resumed"
    if not await guard_recorded(client, cluster, operator if pausing else None, args.within):
        print(f"fleet-guard/{cluster}: {args.command} sent, but not recorded by the guard after "
              f"{args.within:g} s: no worker runs it (task queue {guard_queue(settings.task_queue)}); "
              "it applies when one does", file=sys.stderr)
        return 1
    print(f"fleet-guard/{cluster}: {verb} by {operator.by}" + (f": {operator.reason}" if operator.reason else "")
          + f" (recorded; every worker reads it within {VIEW_EVERY:g} s)")
    return 0


async def guard_recorded(client: Client, cluster: str, paused: Operator | None, within_s: float) -> bool:
    """Whether the guard shows `paused` (None: not paused) within `within_s`."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        known, now = await guard_pause(client, cluster)
        if known and (now is None if paused is None else
                      now is not None and (now.by, now.reason) == (paused.by, paused.reason)):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.2)


async def guard_pause(client: Client, cluster: str) -> tuple[bool, Operator | None]:
    """(read, the pause) as the guard's memo publishes it to the workers; (False, None) when it could
    not be read (the next try, or the deadline, says so)."""
    try:
        memo = await (await client.get_workflow_handle(guard_workflow_id(cluster)).describe(
            rpc_timeout=timedelta(seconds=3))).memo()
    except RPCError:
        return False, None
    if MEMO_KEY in memo:
        return True, GuardView.from_memo(memo).paused
    # A guard started by 0.1.0 publishes nothing until it continues as new: ask the guard itself.
    state = await guard_state(client, cluster)
    return (True, state.paused) if state is not None else (False, None)


async def breaker_command(client: Client, args: argparse.Namespace, settings: Settings) -> int:
    """`breaker reset`: signal the cluster's fleet guard (signal `reset_breaker`, also sendable from the UI)."""
    cluster = args.cluster or settings.cluster
    state = await guard_state(client, cluster)
    if state is None or state.breaker is None:
        print(f"fleet-guard/{cluster}: the cordon breaker is not tripped; nothing to reset")
        return 0
    await client.get_workflow_handle(guard_workflow_id(cluster)).signal(
        "reset_breaker", Operator(by=args.by.strip(), reason=args.reason))
    print(f"fleet-guard/{cluster}: cordon breaker reset by {args.by.strip()} (it had held {state.breaker.held} "
          f"run(s); they now wait for their lease under the budget)")
    return 0


async def guard_state(client: Client, cluster: str) -> GuardState | None:
    try:
        state: GuardState = await client.get_workflow_handle(guard_workflow_id(cluster)).query(
            "state", result_type=GuardState, rpc_timeout=timedelta(seconds=3))
        return state
    except RPCError:
        return None


async def guard_lines(client: Client, cluster: str) -> list[str]:
    state = await guard_state(client, cluster)
    if state is None:
        return [f"fleet-guard/{cluster}: not running (no runbook has asked for a lease yet)"]
    pause = f"PAUSED by {state.paused.by}: {state.paused.reason}" if state.paused else "not paused"
    lines = [f"fleet-guard/{cluster}: {pause}; {len(state.holders)} lease(s) held, {len(state.queue)} waiting, "
             f"{state.grants} granted so far"]
    if state.capacity_unknown:
        lines.append(f"  NO NEW LEASES: {state.capacity_unknown}")
    if state.breaker is not None:
        b = state.breaker
        lines.append(f"  CORDON BREAKER TRIPPED at {b.tripped_at:%Y-%m-%d %H:%M:%S} by {b.by}: {b.out} of "
                     f"{b.gpu_nodes} GPU nodes went out (bound {b.bound}); {b.held} run(s) held, nothing cordoned "
                     f"ahead of the lease. {b.reason}. Reset: fleetmedic breaker reset --by NAME")
    lines += [f"  lease    {h.workflow_id} (node {h.node}, since {h.granted_at:%H:%M:%S})" for h in state.holders]
    lines += [f"  waiting  {i}. {q.workflow_id}" for i, q in enumerate(state.queue, start=1)]
    return lines


async def status_command(client: Client, cluster: str, output: str = "table") -> int:
    """The cluster's guard and its open runbooks: step, what each waits for and why."""
    query = f'FleetCluster = {visibility_literal(cluster)} AND ExecutionStatus = "Running"'
    runs: list[dict[str, Any]] = []
    async for execution in client.list_workflows(query):
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        try:
            status = await handle.query("status", result_type=RunbookStatus, rpc_timeout=timedelta(seconds=3))
            runs.append({"workflow_id": execution.id, "runbook": status.runbook, "node": status.node,
                         "step": status.step, "waiting_for": status.waiting_for or "",
                         "paused": status.paused.by if status.paused else "",
                         "escalation": status.escalation.error if status.escalation else "",
                         "awaiting_approval": status.awaiting_approval or "", "dry_run": status.dry_run})
        except RPCError:
            runs.append({"workflow_id": execution.id, "step": "?", "waiting_for": "(no worker answered the query)"})
    if output == "json":
        guard = await guard_state(client, cluster)
        print(json.dumps({"cluster": cluster, "guard": guard.model_dump(mode="json") if guard else None,
                          "runs": runs}, indent=2))
        return 0
    for line in await guard_lines(client, cluster):
        print(line)
    if not runs:
        print(f"no runbook is running in cluster {cluster}")
        return 0
    width = max(len("WORKFLOW"), *(len(r["workflow_id"]) for r in runs))
    print(f"{'WORKFLOW':<{width}}  {'STEP':<24} {'PAUSED':<7} WAITING FOR")
    for run in runs:
        waiting = run.get("escalation") and f"an answer: {run['escalation']}" or run.get("awaiting_approval") and \
            f"approval of {run['awaiting_approval']}" or run["waiting_for"]
        print(f"{run['workflow_id']:<{width}}  {run['step']:<24} {run.get('paused', ''):<7} {waiting}")
    return 0


def load_dev_stack() -> tuple[Any, Any]:
    """The dev stack (`devstack/`, emulators and stand-ins) is not in the wheel: it runs from a source
    checkout, whose root the editable install does not put on the path by itself."""
    root = Path(__file__).resolve().parent.parent
    if (root / "devstack" / "dev.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from devstack.dev import DevOptions, run_dev
    except ModuleNotFoundError as exc:
        raise SystemExit(f"fleetmedic dev: the dev stack is not installed ({exc.name} is missing): it runs from a "
                         "source checkout — `scripts/dev`, or `pip install -e '.[dev]'` there") from None
    return DevOptions, run_dev


def entry() -> None:
    """The console script. Ends with os._exit: the Temporal client's Rust threads can abort the
    interpreter's finalization of a short-lived process (temporalio/sdk-python#300), which would
    turn a successful command into a SIGABRT. A closed pipe (`fleetmedic audit … | head`) ends it
    quietly, as it ends any Unix command."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # 128 + SIGPIPE, what a shell reports for a command whose reader went away
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()

