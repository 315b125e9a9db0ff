"""fleet-guard/<cluster>: one entity workflow per cluster that grants disruption leases.

Automation that can drain one node can drain a hundred. Every destructive runbook asks this
guard for a lease first; the guard grants them explicitly, in the order asked (FIFO), while:

- fewer than `budget.max_concurrent` leases are held;
- the share of GPU nodes out of service — nodes already NotReady or cordoned (but for the nodes
  of runbooks still in line, which their protective step cordoned), plus the nodes under a
  lease — stays within `budget.max_unavailable_fraction` (at least one node);
- fewer than `budget.max_per_hour` leases were granted in the last hour;
- a topology domain (`budget.topology_label`) has fewer than `budget.max_per_domain` nodes out
  of service — under a lease, or already NotReady or cordoned — (a request blocked only by its
  domain lets the next one in line pass).

It also answers protective kills: a runbook whose XID already killed the job on its node
(catalog `job_lost`) asks to take the node DOWN and requeue before its lease; at most
`budget.max_protective_kills_per_minute` are granted a minute, none while paused, and a refused
one simply waits for its lease. Nobody waits in line for a kill.

It holds the cordon breaker (activities/breaker.py): a protective step that finds too many GPU
nodes gone out of service says so with its lease request, and the breaker trips — until a person
resets it (signal `reset_breaker`, `fleetmedic breaker reset`), no run whose protective step it held
gets a lease, and every worker holds new protective steps. The guard publishes the pause and the
breaker in its memo, which each worker reads without a workflow task.

A plain `wait_condition` on a counter would let every waiter through at once; here each grant is
a decision recorded in the guard's history and a `lease` signal to exactly one runbook. The guard
pauses the whole fleet (no new lease, and every runbook told to hold before its next destructive
step), reclaims the lease of a runbook that closed without releasing it, and continues-as-new
with its state before its history grows large. Recovery steps never ask it for anything.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.models import (
        BreakerState,
        FleetCapacity,
        GuardState,
        KillAnswer,
        Lease,
        LeaseAnswer,
        LeaseRequest,
        Operator,
    )
    from fleetmedic.policy import Policy

from workflows.runbook import bounded_retry, configuration, execute

# How long a count of the fleet's out-of-service nodes is reused. Leases are always counted
# fresh; only nodes that went NotReady or were cordoned by others in the last seconds can be missed.
CAPACITY_TTL = timedelta(seconds=5)
HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)
T = TypeVar("T")
# Since 0.2.0 the guard publishes the fleet pause and the cordon breaker in its memo (each upsert a
# command): guards started by 0.1.0 replay without (docs/upgrading.md).
PUBLISHES_FLEET = "guard-publishes-pause-and-breaker"
# Since 0.2.0 the guard's answers go out without the guard waiting for each round's to be delivered
# (a round's delivery under a storm took minutes, and no lease was granted meanwhile): guards started
# by 0.1.0 replay with the wait (docs/upgrading.md).
TELLS_WITHOUT_WAITING = "guard-tells-without-waiting"
# The batch signals a guard takes (activities/guard_batches.py), said in its memo. Only a run whose
# own code published it says it (`next_memo`), and an older worker cannot run that run's tasks: its
# replay stops at the run's patch markers (TMPRL1100, checked with 0.1.0's code against
# tests/histories/fleet-guard-takes-batches.json), fails the task, and a new worker takes it with the
# batch still in the history. So a batch never reaches code without a handler for it.
BATCH_SIGNALS = ["requests", "releases"]


# Waiters this near the front hear every move in line.
NEAR = 10


def worth_telling(told: int | None, position: int) -> bool:
    """Whether a waiter last told `told` hears of its new place. Each grant moves everyone in line
    up by one: telling all of them was a signal, a workflow task and a search-attribute write per
    waiter per grant, so 5,000 in line behind a budget of 10 cost the server millions of each.
    Near the front every move is told; further back, when the place has come a tenth closer
    (about 60 times from position 5,000), and at once when it did not move forward."""
    if told is None or told == 0 or position <= NEAR or position > told:
        return told != position
    return position <= told * 9 // 10


class DomainCount:
    """Nodes of a topology domain out of service — under a lease, or already NotReady or cordoned
    (by anyone) — for one round of grants. Nodes of runbooks waiting in line do not count against
    each other. Built once a round and kept up to date by `granted`: counted afresh for each
    request in line, a storm's grants grew with the square of the line."""

    def __init__(self, holders: list[Lease], queue: list[LeaseRequest], capacity: FleetCapacity) -> None:
        self.held: dict[str | None, set[str]] = {}
        for lease in holders:
            self.held.setdefault(lease.domain, set()).add(lease.node)
        self.down: dict[str, set[str]] = {}
        for node, domain in capacity.domains.items():
            self.down.setdefault(domain, set()).add(node)
        self.waiting = Counter(q.node for q in queue)  # a node may be in line for two runbooks

    def out(self, request: LeaseRequest) -> int:
        held = self.held.get(request.domain, set())
        down = {node for node in self.down.get(request.domain or "", set()) if not self.waiting[node]}
        return len((held | down) - {request.node})

    def granted(self, lease: Lease) -> None:
        self.held.setdefault(lease.domain, set()).add(lease.node)
        self.waiting[lease.node] -= 1


@workflow.defn(name="fleet-guard")
class FleetGuard:
    @workflow.init
    def __init__(self, state: GuardState) -> None:
        self.state = state
        self.dirty = True
        # The place each runbook was last told, in the state: kept across continue-as-new.
        self.told = state.told
        self.policy: Policy | None = None
        self.out_fraction = 0.0
        self.capacity: FleetCapacity | None = None
        self.capacity_at = workflow.now()
        self.reclaimed_at = workflow.now()
        # Who holds a lease and who is in line, by workflow ID: a storm sends thousands of requests,
        # and a scan of both lists for each made the guard's work grow with their square.
        self.holding = {h.workflow_id for h in state.holders}
        self.in_line = {q.workflow_id for q in state.queue}
        # The answers on their way, by run (TELLS_WITHOUT_WAITING): a run hears one answer at a time.
        self.sending: dict[str, asyncio.Task[None]] = {}
        self.backlog = False  # answers due that found no room among those on their way

    # --- what runbooks and operators send -----------------------------------------------------

    @workflow.signal(description="Internal (runbooks): ask for a disruption lease, answered by signal `lease`")
    def request(self, request: LeaseRequest) -> None:
        if request.trip is not None and self.state.breaker is None:
            # A protective step found too many GPU nodes gone out: the breaker trips (and stays).
            self.state.breaker = BreakerState(**request.trip.model_dump(), tripped_at=workflow.now(),
                                              by=request.workflow_id)
            self.told.clear()  # everyone held hears why
            workflow.logger.warning("cordon breaker tripped by %s: %s", request.workflow_id, request.trip.reason)
        if request.breaker_held and self.state.breaker is not None and request.workflow_id not in self.in_line:
            self.state.breaker = self.state.breaker.model_copy(update={"held": self.state.breaker.held + 1})
        if request.workflow_id in self.holding:
            self.told.pop(request.workflow_id, None)  # a retried request: answer "granted" again
        elif request.workflow_id not in self.in_line:
            self.state.queue.append(request.model_copy(update={"requested_at": workflow.now()}))
            self.in_line.add(request.workflow_id)
        self.dirty = True

    @workflow.signal(description="Internal (workers): lease requests of many runbooks in one signal")
    def requests(self, requests: list[LeaseRequest]) -> None:
        for request in requests:
            self.request(request)

    @workflow.signal(description="Internal (workers): leases of many runbooks given back (or lines left) in one signal")
    def releases(self, workflow_ids: list[str]) -> None:
        gone = set(workflow_ids)
        if gone & self.holding:  # one pass over each list for the whole batch, not one per run
            self.state.holders = [h for h in self.state.holders if h.workflow_id not in gone]
            self.holding -= gone
        if gone & self.in_line:
            self.state.queue = [q for q in self.state.queue if q.workflow_id not in gone]
            self.in_line -= gone
        for workflow_id in gone:
            self.told.pop(workflow_id, None)
        self.dirty = True

    @workflow.signal(description="Internal (runbooks): ask to kill the jobs an XID already killed, before the lease")
    def kill(self, request: LeaseRequest) -> None:
        """A protective kill asked (DOWN + requeue of a job its XID already killed, before the lease)."""
        if not any(k.workflow_id == request.workflow_id for k in self.state.kill_requests):
            self.state.kill_requests.append(request)
        self.dirty = True

    @workflow.signal(description="Internal (runbooks): give a lease back, or leave the line")
    def release(self, workflow_id: str) -> None:
        self.releases([workflow_id])

    @workflow.signal(description='Pause the fleet: no new lease, every runbook holds before its next destructive '
                                  'step (recovery goes on): {"by": "alice", "reason": "..."} — `fleetmedic pause`')
    def pause(self, operator: Operator) -> None:
        self.state.paused = operator
        self.told.clear()  # everyone hears about the pause
        self.dirty = True

    @workflow.signal(description='Lift the fleet pause: {"by": "alice"} — `fleetmedic resume`')
    def resume(self, operator: Operator) -> None:
        self.state.paused = None
        self.told.clear()
        self.dirty = True

    @workflow.signal(description='Reset the tripped cordon breaker, after looking at why it tripped: {"by": "alice", '
                                  '"reason": "..."} — `fleetmedic breaker reset`')
    def reset_breaker(self, operator: Operator) -> None:
        if self.state.breaker is not None:
            workflow.logger.info("cordon breaker reset by %s", operator.by)
        self.state.breaker = None
        # Nodes that went out before now were looked at: the breaker counts from here.
        self.state.breaker_reset_at, self.state.breaker_reset_by = workflow.now(), operator
        self.told.clear()
        self.dirty = True

    @workflow.query(name="state", description="Leases held, the line, the fleet pause, the cordon breaker, kills")
    def state_query(self) -> GuardState:
        return self.state

    # --- the loop -------------------------------------------------------------------------------

    @workflow.run
    async def run(self, state: GuardState) -> None:
        # Decided before the policy's local activity (docs/upgrading.md: never right after one).
        self.publishes = workflow.patched(PUBLISHES_FLEET)
        self.tells_without_waiting = workflow.patched(TELLS_WITHOUT_WAITING)
        self.published: dict[str, Any] | None = None
        self.policy = await configuration(refs.CONFIG_POLICY)
        limit = self.policy.budget.guard_history_events
        while True:
            woke = await self._wake()
            reclaim_due = workflow.now() - self.reclaimed_at >= self.policy.budget.guard_reclaim_interval
            if not woke and self.state.holders and reclaim_due:
                await self.reclaim()
                self.reclaimed_at = workflow.now()
            await self.grant()
            await self.tell()
            if self.publishes:
                self.publish()
            if self.state.kill_requests:
                await self.answer_kills()
            self.record_metrics()
            if workflow.info().is_continue_as_new_suggested() or workflow.info().get_current_history_length() > limit:
                # The answers on their way first: a run told nothing would wait for a `told` never kept.
                await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self.sending)
                # Everything the guard knows is in its state, what it told each runbook too.
                workflow.continue_as_new(self.state, memo=self.next_memo())

    async def _wake(self) -> bool:
        """Until a signal changes something, or the next look: the reclaim interval, or — while runbooks
        wait in line and the fleet is not paused — the next count of the fleet (nodes that others
        return to service free the budget without telling the guard)."""
        if self.dirty and self.tells_without_waiting:
            # Woken already: on at once, without yielding to the answers on their way. Each is a
            # task that makes its signal command when the run yields, so yielding here put those
            # commands before this round's timer when a signal had come before this look, and after
            # it when not. Temporal's core sometimes hands a local activity's result (the policy
            # read) to the workflow a task later live than on replay (docs/upgrading.md), so a
            # signal came before this look on replay and after it live: the same history with its
            # commands in another order, TMPRL1100, and a guard that no worker could run (CI, and
            # tests/histories/fleet-guard-policy-read-a-task-late.json).
            self.dirty = False
            return True
        try:
            assert self.policy is not None
            timeout, why = self.policy.budget.guard_reclaim_interval, "reclaim leases of closed runbooks"
            if self.state.queue and self.state.paused is None and timeout > CAPACITY_TTL:
                timeout, why = CAPACITY_TTL, "count the fleet again for the runbooks in line"
            await workflow.wait_condition(lambda: self.dirty, timeout=timeout, timeout_summary=why)
        except TimeoutError:
            return False
        self.dirty = False
        return True

    async def grant(self) -> None:
        assert self.policy is not None
        budget = self.policy.budget
        now = workflow.now()
        self.state.granted_recently = [t for t in self.state.granted_recently if now - t < HOUR]
        if self.state.paused is not None or not self.state.queue:
            return
        if len(self.state.holders) >= budget.max_concurrent or len(self.state.granted_recently) >= budget.max_per_hour:
            return
        capacity = await self._capacity()
        # At least one node may be out at a time, or a small cluster could never heal itself;
        # an unknown fleet (no count) allows none.
        allowed_out = max(1, int(budget.max_unavailable_fraction * capacity.gpu_nodes)) if capacity.gpu_nodes else 0
        # Runbooks in line cordoned their nodes already (the protective step, before the lease):
        # those cordons must not count against the leases they wait for, or a storm of alerts would
        # fill the budget with itself and no lease would ever be granted.
        waiting = {q.node for q in self.state.queue}
        # The nodes out of service: (unavailable - waiting) | held. A grant moves its node from
        # `waiting` to `held`, which adds exactly that node, so `out` grows by it and is never
        # rebuilt (rebuilding it for each request in line made a storm's grants quadratic).
        out = (set(capacity.unavailable) - waiting) | {h.node for h in self.state.holders}
        domains = DomainCount(self.state.holders, self.state.queue, capacity)
        index = 0
        while index < len(self.state.queue) and len(self.state.holders) < budget.max_concurrent \
                and len(self.state.granted_recently) < budget.max_per_hour:
            request = self.state.queue[index]
            if request.node not in out and len(out) + 1 > allowed_out:
                break  # the next disruption would take too much of the fleet out
            if request.breaker_held and self.state.breaker is not None:
                index += 1  # held by the tripped breaker: nothing of it is out yet, the next may pass
                continue
            if request.domain and domains.out(request) >= budget.max_per_domain:
                index += 1  # its domain is full: the next in line may pass
                continue
            self.state.queue.pop(index)
            self.in_line.discard(request.workflow_id)
            lease = Lease(workflow_id=request.workflow_id, node=request.node, domain=request.domain, granted_at=now)
            self.state.holders.append(lease)
            self.holding.add(request.workflow_id)
            domains.granted(lease)
            self.state.granted_recently.append(now)
            self.state.grants += 1
            self.state.max_held = max(self.state.max_held, len(self.state.holders))
            self.told.pop(request.workflow_id, None)
            waiting.discard(request.node)
            out.add(request.node)
            self.out_fraction = len(out) / capacity.gpu_nodes

    async def answer_kills(self) -> None:
        """Grant protective kills in the order asked, up to the budget's per-minute limit; refuse the
        rest (they wait for their lease). Answers go out together, as `tell` does."""
        assert self.policy is not None
        now = workflow.now()
        limit = self.policy.budget.max_protective_kills_per_minute
        self.state.killed_recently = [t for t in self.state.killed_recently if now - t < MINUTE]
        answers: list[tuple[str, KillAnswer]] = []
        asked, rest = self.batch(self.state.kill_requests)
        for request in asked:
            if self.state.paused is not None:
                answer = KillAnswer(granted=False, reason=f"fleet paused by {self.state.paused.by}")
            elif self.state.breaker is not None:
                answer = KillAnswer(granted=False, reason="the cordon breaker is tripped")
            elif len(self.state.killed_recently) >= limit:
                answer = KillAnswer(granted=False, reason=f"{len(self.state.killed_recently)} protective kill(s) in "
                                                          f"the last minute (budget.max_protective_kills_per_minute "
                                                          f"{limit})")
            else:
                self.state.killed_recently.append(now)
                answer = KillAnswer(granted=True)
            answers.append((request.workflow_id, answer))
        self.state.kill_requests = rest
        await asyncio.gather(*(self._answer_kill(workflow_id, answer) for workflow_id, answer in answers))

    async def _answer_kill(self, workflow_id: str, answer: KillAnswer) -> None:
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("protective_kill", answer)
        except FailureError:
            workflow.logger.info("runbook %s is gone: its protective kill is moot", workflow_id)

    def record_metrics(self) -> None:
        """Budget use on the worker's /metrics (the dashboard's budget panel). Gauges: each
        worker that runs the guard reports the latest state; replays record nothing."""
        assert self.policy is not None
        meter = workflow.metric_meter().with_additional_attributes({"cluster": self.state.cluster})
        meter.create_gauge("fleetmedic_guard_leases_held", "disruption leases held").set(len(self.state.holders))
        meter.create_gauge("fleetmedic_guard_leases_max", "budget.max_concurrent").set(
            self.policy.budget.max_concurrent)
        meter.create_gauge("fleetmedic_guard_waiting", "runbooks waiting for a lease").set(len(self.state.queue))
        meter.create_gauge("fleetmedic_guard_paused", "1 while the fleet is paused").set(
            int(self.state.paused is not None))
        breaker = self.state.breaker
        meter.create_gauge("fleetmedic_cordon_breaker_tripped", "1 while the cordon breaker is tripped").set(
            int(breaker is not None))
        meter.create_gauge("fleetmedic_cordon_breaker_held", "protective steps held since the breaker tripped").set(
            breaker.held if breaker is not None else 0)
        meter.create_gauge_float("fleetmedic_guard_out_fraction", "share of GPU nodes out of service").set(
            self.out_fraction)

    async def _capacity(self) -> FleetCapacity:
        assert self.policy is not None
        if self.capacity is not None and workflow.now() - self.capacity_at < CAPACITY_TTL:
            return self.capacity
        try:
            capacity = await execute(
                refs.FLEET_CAPACITY, (self.policy.labels.gpu_node_selector, self.policy.budget.topology_label),
                start_to_close_timeout=self.policy.retries.call_timeout, retry_policy=bounded_retry(self.policy),
                summary="count GPU nodes out of service")
            self.capacity, self.capacity_at = capacity, workflow.now()
            self.state.capacity_unknown = None
            return capacity
        except ActivityError as err:
            # Without a count the share cannot be checked: fail closed, hold every new lease until
            # it can, and say so where operators look (the guard's state, `fleetmedic status`).
            cause = str(err.cause or err)
            if self.state.capacity_unknown is None:
                self.state.capacity_unknown = f"cannot count GPU nodes since {workflow.now().isoformat()}: {cause}"
            workflow.logger.warning("cannot count GPU nodes (%s); no lease is granted until it can", cause)
            return FleetCapacity(gpu_nodes=0)

    async def tell(self) -> None:
        """Tell each runbook what changed for it: granted, its new place in line, or the pause.
        The signals go out together (one workflow task), not one round trip after another; grants
        first, then places in line from the front, a batch a task (`batch`). Since 0.2.0 the guard
        goes on without waiting for them to be delivered (`_send`)."""
        due: list[tuple[str, int]] = [(lease.workflow_id, 0) for lease in self.state.holders
                                      if self.told.get(lease.workflow_id) != 0]
        for position, request in enumerate(self.state.queue, start=1):
            told = self.told.get(request.workflow_id)
            if told != position and worth_telling(told, position):
                due.append((request.workflow_id, position))
        breaker = self.state.breaker
        held = {q.workflow_id for q in self.state.queue if q.breaker_held} if breaker else set()
        if self.tells_without_waiting:
            self._send(due, held)
            return
        due, _ = self.batch(due)
        delivered = await asyncio.gather(*(self._signal(workflow_id, self.answer(position, workflow_id in held))
                                           for workflow_id, position in due))
        for (workflow_id, position), ok in zip(due, delivered, strict=True):
            if ok:
                self.told[workflow_id] = position

    def answer(self, position: int, breaker_held: bool) -> LeaseAnswer:
        """What the guard tells a run at `position` (0: granted); `breaker_held`: the run's protective
        step was held by the tripped breaker."""
        paused, breaker = self.state.paused, self.state.breaker
        if position == 0:
            return LeaseAnswer(granted=True, paused=paused, out_fraction=self.out_fraction)
        reason = f"paused by {paused.by}" if paused else "budget in use"
        if breaker is not None and breaker_held:
            reason = (f"held by the cordon breaker, tripped {breaker.tripped_at:%H:%M:%S} ({breaker.out} of "
                      f"{breaker.gpu_nodes} GPU nodes out, bound {breaker.bound}): a person resets it with "
                      "`fleetmedic breaker reset`")
        return LeaseAnswer(granted=False, position=position, paused=paused, reason=reason)

    def _send(self, due: list[tuple[str, int]], held: set[str]) -> None:
        """The answers due, without waiting for them: each is delivered while the guard grants more.
        Under a storm a round's deliveries took minutes (each waits for the guard's lock on the
        server behind thousands of requests), and the guard waiting for them granted nothing meanwhile
        (bench/guard_throughput.py --storm). At most `budget.guard_signals_per_task` are on their way
        at once — commands a task, and the server's limit on a workflow's pending signals (2,000) —
        and a run hears one answer at a time; those left wait for room (`_sent`)."""
        assert self.policy is not None
        room = self.policy.budget.guard_signals_per_task - len(self.sending)
        due = [(workflow_id, position) for workflow_id, position in due if workflow_id not in self.sending]
        self.backlog = len(due) > room
        for workflow_id, position in due[:max(room, 0)]:
            answer = self.answer(position, workflow_id in held)
            self.sending[workflow_id] = asyncio.create_task(self._sent(workflow_id, position, answer))

    async def _sent(self, workflow_id: str, position: int, answer: LeaseAnswer) -> None:
        try:
            if await self._signal(workflow_id, answer) and (
                    workflow_id in self.holding or workflow_id in self.in_line):
                self.told[workflow_id] = position  # not for a run that left meanwhile: `told` is kept
        finally:
            del self.sending[workflow_id]
        if self.backlog or (position != 0 and workflow_id in self.holding):
            self.dirty = True  # room for the answers left, or this run was granted while told its place

    def publish(self) -> None:
        """The pause and the breaker in the guard's memo, when they changed: every worker reads them
        there before a protective step (activities/breaker.py), without a workflow task."""
        reset = self.state.breaker_reset_at
        fleet = {"paused": self.state.paused.model_dump(mode="json") if self.state.paused else None,
                 "breaker": self.state.breaker.model_dump(mode="json", exclude={"held"}) if self.state.breaker
                 else None, "breaker_reset_at": reset.isoformat() if reset else None,
                 "signals": BATCH_SIGNALS}
        if fleet != self.published:
            workflow.upsert_memo({"fleet": fleet})
            self.published = fleet

    def next_memo(self) -> dict[str, Any] | None:
        """The memo the next run starts with: this one's pause and breaker, but not the batch signals.
        The server starts a continued run with no memo unless it is given one, and every worker would
        read "not paused, no breaker" until the new run's first round published again. The batch
        signals stay out: during a roll an older worker may run the next run's first task, that run
        never publishes, and an inherited "signals" would have new workers send it batches it has no
        handler for. None (no memo) for runs that never publish."""
        if not self.publishes or self.published is None:
            return None
        return {"fleet": {key: value for key, value in self.published.items() if key != "signals"}}

    def batch(self, signals: list[T]) -> tuple[list[T], list[T]]:
        """The signals this workflow task sends, and those left for the next round (which comes at
        once: the guard is marked dirty). The cost of a workflow task stays bounded, its replay too."""
        assert self.policy is not None
        size = self.policy.budget.guard_signals_per_task
        if len(signals) <= size:
            return signals, []
        self.dirty = True
        return signals[:size], signals[size:]

    async def _signal(self, workflow_id: str, answer: LeaseAnswer) -> bool:
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("lease", answer)
            return True
        except FailureError:
            # The runbook is gone: its lease (or its place in line) goes back to the fleet.
            workflow.logger.info("runbook %s is gone: reclaiming its lease", workflow_id)
            self.release(workflow_id)
            return False

    async def reclaim(self) -> None:
        """A lease held by a closed workflow is reclaimed (a crash between grant and release)."""
        try:
            running = await execute(
                refs.RUNNING, [h.workflow_id for h in self.state.holders],
                start_to_close_timeout=timedelta(seconds=30), retry_policy=bounded_retry(self.policy),
                summary="which lease holders still run")
        except ActivityError:
            # Unknown: keep every lease (fail closed) and look again at the next reclaim interval.
            workflow.logger.warning("cannot tell which lease holders still run; leases kept")
            return
        for lease in list(self.state.holders):
            if lease.workflow_id not in running:
                workflow.logger.info("reclaiming the lease of closed runbook %s", lease.workflow_id)
                self.release(lease.workflow_id)
