"""What the Temporal UI's *Current Details* of a run say: the step, what the run waits for and
why, and what an operator can do about it — the exact CLI command, and the signal or Update the
UI sends for it. Kept true by the runbook base whenever its step or its wait changes."""

from __future__ import annotations

from fleetmedic.models import Escalation, Operator


def current_details(workflow_id: str, step: str, *, waiting_for: str | None = None, dry_run: bool = False,
                    escalation: Escalation | None = None, awaiting_approval: str | None = None,
                    paused: Operator | None = None, outcome: str | None = None) -> str:
    """Markdown, as the UI renders it."""
    lines = [f"**{step}**" + (" (shadow mode: nothing is changed)" if dry_run else "")]
    if outcome is not None:
        lines.append(f"Ended: **{outcome}** (`fleetmedic audit {workflow_id}`)")
        return "\n\n".join(lines)
    if waiting_for:
        lines.append(f"Waiting for: {waiting_for}")
    if escalation is not None:
        lines.append(f"Escalated: {escalation.error}")
        lines.append(f"To do: `fleetmedic answer {workflow_id} retry|skip|abort --by YOU` — or signal `answer` "
                     '`{"action": "retry", "by": "you"}`')
    elif awaiting_approval:
        lines.append(f"To do: `fleetmedic approve {workflow_id} --by YOU` or `fleetmedic reject {workflow_id} "
                     f"--by YOU --reason …` — or the Update `approve` / `reject` "
                     '`{"by": "you", "reason": "…"}`')
    elif paused is not None:
        lines.append(f"Paused by {paused.by}" + (f": {paused.reason}" if paused.reason else "")
                     + ' — signal `resume` `{"by": "you"}` (or `fleetmedic resume` for a fleet-wide pause)')
    elif waiting_for and "`replaced`" in waiting_for:
        lines.append(f"To do: `fleetmedic replaced {workflow_id} [--new-node NAME] --by YOU` — or signal "
                     '`replaced` `{"by": "you", "new_node": "…"}`')
    if waiting_for or escalation is not None or awaiting_approval:
        lines.append(f"To stop it: `fleetmedic abort {workflow_id} --by YOU --reason …`")
    return "\n\n".join(lines)


def run_details(workflow_id: str, runbook: str, cluster: str, *, node: str = "", gpu: int | None = None,
                xid: int | None = None, dry_run: bool = False, started_by: str) -> str:
    """The run's *Details* in the Temporal UI, set once when it starts: what it is about, who or what
    started it, whether it changes anything, and where to read more. Markdown; `started_by` may
    carry an alert's name (untrusted), so it goes in a code span with its backticks removed."""
    facts = [f"**Runbook** {runbook}", f"**Cluster** {cluster}"]
    facts += [f"**Node** {node}"] if node else []
    facts += [f"**GPU** {gpu}"] if gpu is not None else []
    facts += [f"**XID** {xid}"] if xid is not None else []
    mode = ("**Shadow mode** (dry run): every step is recorded, nothing is changed, nobody is paged" if dry_run
            else "**Live**: it cordons, drains and replaces as the policy allows")
    return "\n\n".join([" · ".join(facts), f"**Started by** `{started_by.replace('`', '')}`", mode,
                        f"Follow it: `fleetmedic status --cluster {cluster}` · `fleetmedic audit {workflow_id}`"])


def guard_details(cluster: str) -> str:
    """The fleet guard's *Details*: what it is and the two commands an operator needs of it."""
    return "\n\n".join([
        f"Grants the disruption leases of **{cluster}**: first come, first served, within the policy's `budget` "
        "(runbooks at once, share of GPU nodes out, per topology domain).",
        f"Who holds and who waits: `fleetmedic status --cluster {cluster}`",
        f"Stop every destructive step in {cluster}: `fleetmedic pause --cluster {cluster} --reason …` "
        f"(recovery goes on; `fleetmedic resume --cluster {cluster}` lifts it)"])
