"""Bring the running deployment to a plan: launch what was added, drain then down what was removed, keep the rest.

The deployment recorded in DuckDB is the source of truth. Every decision is written before it is carried out
(new nodes as `pending`, removed ones as `draining`), and every outcome right after, so a run that dies part-way
leaves rows the next run resumes from. A node that fails to launch rolls its whole instance back (`down`) and
marks it `failed`; the next run plans a fresh replica in its place.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Mapping

import pandas as pd

from coral_dagster.allocation.types import Plan
from coral_dagster.deploy import state, tasks
from coral_dagster.deploy.launcher import Drainer, Launcher, LaunchRequest
from coral_dagster.deploy.names import plan_tag
from coral_dagster.deploy.spec import (
    COORDINATOR_SLOT, CPU_ROLES, InstanceShape, InstanceSpec, NodeSpec, build_coordinators, build_instance,
    coordinator_region, instance_shapes,
)
from coral_dagster.errors import CoralError
from coral_dagster.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Removal:
    """A recorded instance (or a coordinator) to drain and take down."""

    instance_id: str
    clusters: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Diff:
    """What one reconcile does: nodes to launch (new or resumed), instances to remove, instances left alone.

    `addresses` are the recorded `tcp://ip:port` of clusters already up; `coordinator` and `standby` are the live
    or new coordinator pair and `endpoint` the HAProxy in front of it (None when the plan is empty); `plain_http`
    whether they serve plain HTTP (`coral launch --plain-http`) rather than HTTPS.
    """

    plan_id: str
    coordinator: NodeSpec | None
    launch: tuple[InstanceSpec, ...]
    remove: tuple[Removal, ...]
    keep: tuple[str, ...]
    addresses: Mapping[str, str] = field(default_factory=dict)
    standby: NodeSpec | None = None
    plain_http: bool = False
    endpoint: NodeSpec | None = None

    @property
    def coordinators(self) -> tuple[NodeSpec, ...]:
        """The planned coordinator pair, primary first."""
        return tuple(n for n in (self.coordinator, self.standby) if n is not None)

    @property
    def front(self) -> tuple[NodeSpec, ...]:
        """The coordinator pair and its endpoint, in launch order (the endpoint is given both addresses)."""
        return self.coordinators + ((self.endpoint,) if self.endpoint is not None else ())

    def nodes_to_launch(self) -> list[NodeSpec]:
        """Nodes not yet up, in launch order: the coordinator pair and its endpoint, then each instance in its
        launch order."""
        nodes = list(self.front)
        nodes += [n for inst in self.launch for n in inst.nodes]
        return [n for n in nodes if n.cluster_name not in self.addresses]

    @property
    def coordinator_cluster(self) -> str | None:
        """The coordinator instances are drained through: the planned primary, else a live one being removed last."""
        if self.coordinator is not None:
            return self.coordinator.cluster_name
        return next((r.clusters[0] for r in self.remove if r.instance_id == COORDINATOR_SLOT), None)

    @property
    def coordinator_clusters(self) -> tuple[str, ...]:
        """The clusters every instance's scheduler is given: the planned pair, primary first."""
        return tuple(n.cluster_name for n in self.coordinators)

    @property
    def changes(self) -> bool:
        return bool(self.nodes_to_launch() or self.remove)


def _fingerprint(slot: str) -> str:
    return slot.split("#", 1)[0]


@dataclass(frozen=True)
class _Recorded:
    """One recorded instance: its rows and whether it is active, being removed, or history."""

    instance_id: str
    rows: pd.DataFrame

    @property
    def fingerprint(self) -> str:
        return _fingerprint(str(self.rows.slot.iloc[0]))

    @property
    def replica(self) -> int:
        return int(self.rows.replica.iloc[0])

    @property
    def state(self) -> str:
        """active: every node pending or launched; settled: every node down or failed; else being removed."""
        status = self.rows.status
        if status.isin(state.ACTIVE).all():
            return "active"
        if status.isin(state.SETTLED).all():
            return "settled"
        return "removing"

    @property
    def open_clusters(self) -> tuple[str, ...]:
        return tuple(sorted(self.rows.cluster_name[~self.rows.status.isin(state.SETTLED)]))


def _recorded_instances(records: pd.DataFrame) -> list[_Recorded]:
    rows = records[~records.role.isin(CPU_ROLES)]
    return [_Recorded(str(iid), g) for iid, g in rows.groupby("instance_id", sort=True)]


def plan_diff(plan: Plan, plan_id: str, records: pd.DataFrame, prices: pd.DataFrame, engine: str = "coral",
              plain_http: bool = False) -> Diff:
    """Compare the plan with the recorded deployment; pure (reads nothing, writes nothing).

    Instances match across plans by fingerprint (template, layer split, node order, region, spot): of the
    recorded active replicas of a fingerprint the lowest-numbered `count` stay, the rest go; missing replicas
    are launched under the smallest free replica numbers with names from this plan. `engine` is the one the plan
    was made for (`app.plans.plan_engine`): under `vllm` its prefill and decode instances are vLLM PD instances.
    A fresh coordinator pair serves HTTPS unless `plain_http`.
    """
    shapes = instance_shapes(plan, prices, engine)
    recorded = _recorded_instances(records)
    ours = records.plan_id == plan_id
    next_index = int(records.loc[ours, "instance_index"].max()) + 1 if ours.any() else 0

    launch: list[InstanceSpec] = []
    keep: list[str] = []
    removals: list[Removal] = [Removal(r.instance_id, r.open_clusters, "removal left unfinished by an earlier run")
                               for r in recorded if r.state == "removing"]
    wanted = {s.fingerprint for s in shapes}
    for r in recorded:
        if r.state == "active" and r.fingerprint not in wanted:
            removals.append(Removal(r.instance_id, r.open_clusters, "not in the plan"))
    for shape in shapes:
        fp = shape.fingerprint
        staying: list[tuple[_Recorded, InstanceSpec | None]] = []
        for r in sorted((r for r in recorded if r.state == "active" and r.fingerprint == fp),
                        key=lambda r: r.replica):
            if (r.rows.status == "launched").all():
                staying.append((r, None))
                continue
            spec = build_instance(shape, r.replica, str(r.rows.plan_id.iloc[0]), int(r.rows.instance_index.iloc[0]))
            if sorted(n.cluster_name for n in spec.nodes) == sorted(r.rows.cluster_name):
                staying.append((r, spec))
            else:
                removals.append(Removal(r.instance_id, r.open_clusters, "recorded nodes differ from the plan's"))
        for r, rebuilt in staying[:shape.count]:
            if rebuilt is None:
                keep.append(r.instance_id)
            else:
                launch.append(rebuilt)
        for r, _ in staying[shape.count:]:
            removals.append(Removal(r.instance_id, r.open_clusters, "more replicas than the plan wants"))
        used = {r.replica for r in recorded if r.fingerprint == fp and r.state != "settled"}
        replica = 0
        for _ in range(shape.count - min(shape.count, len(staying))):
            while replica in used:
                replica += 1
            used.add(replica)
            launch.append(build_instance(shape, replica, plan_id, next_index))
            next_index += 1

    pair = _coordinator_diff(shapes, plan_id, records, removals, plan, plain_http)
    up = records[(records.status == "launched") & records.address.notna()]
    removals.sort(key=lambda r: (r.instance_id == COORDINATOR_SLOT, r.instance_id))
    launch.sort(key=lambda i: (i.plan_id != plan_id, i.plan_id, i.index))
    primary, standby, endpoint = pair if pair else (None, None, None)
    return Diff(plan_id, primary, tuple(launch), tuple(removals), tuple(sorted(keep)),
                dict(zip(up.cluster_name, up.address)), standby,
                plain_http if primary is None else primary.phase != tasks.HTTPS_SCHEME, endpoint)


def _coordinator_diff(shapes: tuple[InstanceShape, ...], plan_id: str, records: pd.DataFrame,
                      removals: list[Removal], plan: Plan,
                      plain_http: bool) -> tuple[NodeSpec, NodeSpec, NodeSpec] | None:
    """Keep a live coordinator pair and its endpoint while any instance is planned (starting whichever is not live,
    with the scheme the live ones serve), start all three when none is live, remove them otherwise."""
    rows = records[records.role.isin(CPU_ROLES)]
    for r in rows[rows.status == "draining"].itertuples():
        removals.append(Removal(COORDINATOR_SLOT, (r.cluster_name,), "removal left unfinished by an earlier run"))
    live = rows[rows.status.isin(state.ACTIVE)]
    if not shapes:
        for r in live.itertuples():
            removals.append(Removal(COORDINATOR_SLOT, (r.cluster_name,), "the plan has no instances"))
        return None
    if len(live):
        first = live.iloc[0]
        return build_coordinators(str(first.plan_id), str(first.region), shapes, plan,
                                  plain_http=first.phase != tasks.HTTPS_SCHEME)
    return build_coordinators(plan_id, coordinator_region(shapes), shapes, plan, plain_http=plain_http)


@dataclass(frozen=True)
class ReconcileReport:
    """What a reconcile run did, by cluster and instance."""

    run_id: str
    plan_id: str
    status: str
    launched: tuple[str, ...]
    failed: tuple[str, ...]
    drained: tuple[str, ...]
    downed: tuple[str, ...]
    kept: tuple[str, ...]
    messages: tuple[str, ...]

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


class _Run:
    """One reconcile run's bookkeeping: every state change is its own committed transaction."""

    def __init__(self, store: Store, run_id: str, addresses: Mapping[str, str]) -> None:
        self.store, self.run_id = store, run_id
        self.addresses = dict(addresses)
        self.launched: list[str] = []
        self.failed: list[str] = []
        self.drained: list[str] = []
        self.downed: list[str] = []
        self.messages: list[str] = []

    def set(self, cluster: str, status: state.NodeStatus, action: str, message: str = "",
            address: str | None = None) -> None:
        with self.store.transaction() as con:
            state.set_status(con, cluster, status, self.run_id, action, message, address)

    def note(self, message: str) -> None:
        log.warning("%s", message)
        self.messages.append(message)

    def finish(self, status: str, kept: int) -> None:
        with self.store.transaction() as con:
            state.finish_run(con, self.run_id, status, launched=len(self.launched), failed=len(self.failed),
                             drained=len(self.drained), downed=len(self.downed), kept=kept,
                             message="; ".join(self.messages))


def reconcile(plan: Plan, plan_id: str, store: Store, launcher: Launcher, drainer: Drainer,
              prices: pd.DataFrame | None = None, drain_timeout_s: float = 600.0,
              engine: str = "coral", plain_http: bool = False) -> ReconcileReport:
    """Make the running deployment match `plan`; running it again with the same plan changes nothing.

    Order: the coordinator pair and its endpoint (whichever is not live: primary, the standby wired to it, the
    endpoint wired to both), then every new or unfinished instance (each scheduler wired to both coordinators),
    then removals, so capacity rises before it falls. Raises `CoralError` only when one of the three cannot start.
    A fresh pair and endpoint serve HTTPS unless `plain_http`.
    """
    if prices is None:
        from coral_dagster.catalog.prices import load_node_prices
        prices = load_node_prices()
    records = state.read_nodes(store)
    diff = plan_diff(plan, plan_id, records, prices, engine, plain_http)
    run = _Run(store, f"{state.now_utc():%Y%m%dT%H%M%S%f}-{plan_tag(plan_id)}", diff.addresses)
    settled = set(records.cluster_name[records.status.isin(state.SETTLED)])
    known = set(records.cluster_name)
    with store.transaction() as con:
        state.ensure_tables(con)
        state.start_run(con, run.run_id, plan_id)
        state.record_nodes(con, [n for n in diff.nodes_to_launch()
                                 if n.cluster_name not in known or n.cluster_name in settled], "pending", run.run_id)
        for removal in diff.remove:
            for cluster in removal.clusters:
                state.set_status(con, cluster, "draining", run.run_id, "plan", removal.reason)

    coordinator = diff.coordinator_cluster
    live = coordinator in run.addresses
    for node in diff.front:
        if node.cluster_name not in run.addresses:
            _launch_coordinator(node, launcher, run, len(diff.keep))
    for inst in diff.launch:
        _launch_instance(inst, diff.coordinator_clusters, launcher, run)
    if diff.coordinator is not None and live and coordinator is not None:
        _set_admission(diff.coordinator, run.addresses[coordinator], drainer, run)
    for removal in diff.remove:
        _remove(removal, run.addresses.get(coordinator or ""), launcher, drainer, drain_timeout_s, run)
    status = "failed" if run.failed else "done"
    run.finish(status, len(diff.keep))
    return ReconcileReport(run.run_id, plan_id, status, tuple(run.launched), tuple(run.failed), tuple(run.drained),
                           tuple(run.downed), diff.keep, tuple(run.messages))


def _launch_node(node: NodeSpec, coordinators: tuple[str, ...], launcher: Launcher, run: _Run) -> None:
    """Launch one node wired to the addresses known so far; record it launched with its own address."""
    wired = tasks.wired_envs(node, coordinators, run.addresses)
    request = LaunchRequest(node.cluster_name, tasks.task_config(node, wired), tasks.secret_names(node.role))
    result = launcher.launch(request)
    address = tasks.node_address(result.head_ip)
    run.addresses[node.cluster_name] = address
    run.set(node.cluster_name, "launched", "launch", address=address)
    run.launched.append(node.cluster_name)


def _launch_coordinator(node: NodeSpec, launcher: Launcher, run: _Run, kept: int) -> None:
    """Start a coordinator of the pair or their endpoint; without all three no instance is wired to survive losing
    one, nor reached at one URL, so a failure ends the run (instances stay pending)."""
    try:
        _launch_node(node, (), launcher, run)
    except Exception as exc:
        run.set(node.cluster_name, "failed", "launch-failed", str(exc))
        run.failed.append(node.cluster_name)
        run.note(f"the coordinator {node.cluster_name} did not start: {exc}")
        try:
            launcher.down(node.cluster_name)
        except Exception as down_exc:
            # Same name next run: relaunching it reuses whatever half-started cluster is left.
            run.note(f"could not take the half-started {node.cluster_name} down ({down_exc})")
        run.finish("failed", kept)
        raise CoralError(f"the coordinator {node.cluster_name} did not start: {exc}",
                         "fix the cause and run `coral launch` again; planned instances stay pending and resume.")


def _set_admission(node: NodeSpec, address: str, drainer: Drainer, run: _Run) -> None:
    """Hand the live coordinator the plan's admission limits (a fresh one got them as `CORAL_ADMIT`), after the
    new instances are up and before any is removed; a failure is noted and fails the run, so the next one retries."""
    text = dict(node.envs).get("CORAL_ADMIT", "")
    try:
        if drainer.admit(address, text):
            run.note(f"the live coordinator {node.cluster_name} now admits {text or 'every request'}")
    except CoralError as exc:
        run.note(f"the live coordinator {node.cluster_name} kept its old admission limits: {exc}")
        run.failed.append(node.cluster_name)


def _launch_instance(inst: InstanceSpec, coordinators: tuple[str, ...], launcher: Launcher, run: _Run) -> None:
    for node in inst.nodes:
        if node.cluster_name in run.addresses:
            continue
        try:
            _launch_node(node, coordinators, launcher, run)
        except Exception as exc:
            run.set(node.cluster_name, "failed", "launch-failed", str(exc))
            _roll_back(inst, node.cluster_name, launcher, run, str(exc))
            return


def _roll_back(inst: InstanceSpec, failed_node: str, launcher: Launcher, run: _Run, cause: str) -> None:
    """Down every node of the instance that may be up (the failed one too: it may be half up); mark all failed."""
    run.failed.append(inst.instance_id)
    run.note(f"instance {inst.instance_id} ({inst.shape.template.template_id} in {inst.shape.region}) rolled "
             f"back: {failed_node} failed to launch: {cause}")
    for node in inst.nodes:
        name = node.cluster_name
        if name != failed_node and name not in run.addresses:
            run.set(name, "failed", "rollback", f"not launched: {failed_node} failed")
            continue
        try:
            launcher.down(name)
        except Exception as exc:
            # Up as far as we know: leave it draining so the next run takes it down.
            run.set(name, "draining", "rollback-down-failed", str(exc))
            run.note(f"rollback could not take {name} down ({exc}); the next run retries")
            continue
        run.addresses.pop(name, None)
        run.set(name, "failed", "rollback", f"rolled back: {failed_node} failed to launch")
        run.downed.append(name)


def _remove(removal: Removal, coordinator: str | None, launcher: Launcher, drainer: Drainer, timeout_s: float,
            run: _Run) -> None:
    """Drain (stop new requests, finish in-flight) through the coordinator, then down every cluster."""
    if removal.instance_id != COORDINATOR_SLOT and coordinator:
        try:
            finished = drainer.drain(coordinator, removal.instance_id, timeout_s)
        except Exception as exc:
            finished = False
            run.note(f"drain of {removal.instance_id} failed ({exc}); taking it down anyway")
        if not finished:
            run.note(f"instance {removal.instance_id} still had requests in flight after {timeout_s:g} s")
        run.drained.append(removal.instance_id)
    for name in removal.clusters:
        try:
            launcher.down(name)
        except Exception as exc:
            run.set(name, "draining", "down-failed", str(exc))
            run.note(f"could not take {name} down ({exc}); the next run retries")
            continue
        run.addresses.pop(name, None)
        run.set(name, "down", "down", removal.reason)
        run.downed.append(name)


def teardown_removals(records: pd.DataFrame) -> tuple[Removal, ...]:
    """Every recorded cluster that is not down yet, by instance, the coordinator pair and endpoint last (the
    others drain through them)."""
    removals = [Removal(r.instance_id, r.open_clusters, "coral down") for r in _recorded_instances(records)
                if r.open_clusters]
    coord = records[records.role.isin(CPU_ROLES) & ~records.status.isin(state.SETTLED)]
    if not coord.empty:
        removals.append(Removal(COORDINATOR_SLOT, tuple(sorted(coord.cluster_name)), "coral down"))
    return tuple(removals)


def teardown(store: Store, launcher: Launcher, drainer: Drainer, drain_timeout_s: float = 600.0) -> ReconcileReport:
    """Drain and take down everything `coral launch` started, as recorded; a second run finds nothing left."""
    records = state.read_nodes(store)
    removals = teardown_removals(records)
    up = records[(records.status == "launched") & records.address.notna()]
    run = _Run(store, f"{state.now_utc():%Y%m%dT%H%M%S%f}-down", dict(zip(up.cluster_name, up.address)))
    coordinator = next((r.clusters[0] for r in removals if r.instance_id == COORDINATOR_SLOT), None)
    with store.transaction() as con:
        state.ensure_tables(con)
        state.start_run(con, run.run_id, "down")
        for removal in removals:
            for cluster in removal.clusters:
                state.set_status(con, cluster, "draining", run.run_id, "down", removal.reason)
    for removal in removals:
        _remove(removal, run.addresses.get(coordinator or ""), launcher, drainer, drain_timeout_s, run)
    status = "failed" if any(r.clusters for r in teardown_removals(state.read_nodes(store))) else "done"
    run.finish(status, 0)
    return ReconcileReport(run.run_id, "down", status, (), (), tuple(run.drained), tuple(run.downed), (),
                           tuple(run.messages))
