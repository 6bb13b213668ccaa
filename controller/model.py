"""The controller's picture of the cluster: nodes, pod requests, GPUs and what occupies them.

Everything the placement engine reads lives here, typed and pre-digested:
- each GPU's published devices (from its node's ResourceSlices) and its occupancy, derived from
  the claims that hold its devices;
- GPUs indexed by (kind, occupancy, node busy), so the engine looks at distinct states, not at
  thousands of GPUs (a *kind* groups GPUs whose devices are identical apart from identity
  attributes such as ``uuid``, so selector results are shared by the whole kind);
- per node: the Node's facts and the cpu/memory/pods that pods placed there already request.

A claim holds its devices from allocation until the node confirms the instance is gone
(invariant 4): the reconciler calls :meth:`ClusterModel.hold` for every claim with
``status.allocation`` (terminating or not) and :meth:`ClusterModel.release` only when the
allocation is cleared. GPU occupancy is always recomputed from the set of holds on that GPU, so
applying updates one by one and rebuilding from scratch give identical states.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType

from controller.claims import ClaimHold, ClaimKey
from controller.nodefit import NO_RESOURCES, NodeInfo, Resources
from controller.objects import Problem
from controller.tolerations import DeviceTaint, parse_taints
from driver.catalog import GpuModel
from driver.cel import (
    AttributeValue,
    CelDevice,
    Semver,
    common_facts,
)
from driver.contract import IDENTITY_ATTRIBUTES
from driver.geometry import EMPTY_STATE, Geometry, GpuState, PlacementError, geometry_for
from driver.quantity import parse_quantity

_NO_DEVICES: Mapping[str, str] = MappingProxyType({})

WHOLE_GPU = -1
"""Profile id the model uses for a whole-GPU device (it blocks every MIG placement)."""


@dataclass(frozen=True, slots=True)  # slots: a fleet holds one per published device
class PublishedDevice:
    """One device a node publishes for a GPU: a (profile, placement) or the whole GPU."""

    name: str
    profile_id: int  # WHOLE_GPU for the whole-GPU device
    start: int
    facts: CelDevice
    taints: tuple[DeviceTaint, ...] = ()  # e.g. the node's health taint on a sick GPU
    # What the allocation must carry so that kube-scheduler binds only after the node carved
    # (empty unless the node's plugin runs with --binding-conditions).
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuInventory:
    """A physical GPU as its node publishes it (built from ResourceSlices)."""

    node: str
    pool: str
    uuid: str
    model: GpuModel
    devices: tuple[PublishedDevice, ...]


@dataclass(frozen=True)
class Occupancy:
    """What occupies a GPU: the MIG state, or ``blocked`` (whole GPU allocated, or holds that
    contradict each other, which the model never lets the engine build on)."""

    state: GpuState
    blocked: bool = False

    @property
    def in_use(self) -> bool:
        return self.blocked or bool(self.state.instances)


FREE = Occupancy(EMPTY_STATE)


BucketKey = tuple[int, Occupancy, bool]  # (kind, occupancy, node busy)


@dataclass
class GpuRecord:
    """The model's mutable record of one GPU; the engine reads it, only the model writes it."""

    inventory: GpuInventory
    geometry: Geometry
    kind: int
    position: int  # index among its node's GPUs (ordered by uuid)
    by_placement: Mapping[tuple[int, int], PublishedDevice]
    occupancy: Occupancy = FREE
    holders: dict[tuple[int, int], set[ClaimKey]] = field(default_factory=dict)

    @property
    def uuid(self) -> str:
        return self.inventory.uuid

    @property
    def node(self) -> str:
        return self.inventory.node


@functools.lru_cache(maxsize=4096)
def _placement_key(profile_id: int, start: int) -> tuple[int, int]:
    """One (profile, start) tuple for every GPU that publishes that placement (~1.5 KB a GPU)."""
    return (profile_id, start)


def _named_device(record: GpuRecord, name: str) -> PublishedDevice:
    """The device ``name`` of a GPU the device index points at (so it is there)."""
    return next(d for d in record.inventory.devices if d.name == name)


def _used_units(record: GpuRecord) -> int:
    occupancy = record.occupancy
    if occupancy.blocked:
        return record.inventory.model.memory_units
    return occupancy.state.occupied.bit_count()


def _claims_of(holders: Mapping[tuple[int, int], set[ClaimKey]]) -> tuple[str, ...]:
    return tuple(sorted({str(c) for claims in holders.values() for c in claims}))


def _kind_signature(inv: GpuInventory) -> tuple[object, ...]:
    def strip(device: PublishedDevice) -> tuple[object, ...]:
        attrs = tuple(
            (k, v)
            for k, v in device.facts.attributes
            if k.rpartition("/")[2] not in IDENTITY_ATTRIBUTES
        )
        return (device.profile_id, device.start, attrs, device.facts.capacity, device.taints)

    return (inv.model.key, tuple(sorted(strip(d) for d in inv.devices)))


class ClusterModel:
    """Mutable cluster state with incremental updates; see the module docstring."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        self._pods: dict[str, tuple[str, Resources]] = {}
        self._node_usage: dict[str, Resources] = {}
        self.gpus: dict[str, GpuRecord] = {}
        self._node_gpus: dict[str, list[str]] = {}
        # pool -> device name -> GPU uuid; nested, so no (pool, name) key per device, and the
        # uuid alone (the record's own string), so no (uuid, device) pair per device either:
        # the device is found among its GPU's ~20 when a claim resolves (see _named_device).
        self._device_index: dict[str, dict[str, str]] = {}
        self._holds: dict[ClaimKey, ClaimHold] = {}
        self._claims_on_gpu: dict[str, set[ClaimKey]] = {}
        self._gpus_of_claim: dict[ClaimKey, set[str]] = {}
        self._states: dict[tuple[Geometry, frozenset[tuple[int, int]]], GpuState | str] = {}
        self._units_total: dict[str, int] = {}
        self._units_used: dict[str, int] = {}
        self._unresolved: dict[ClaimKey, tuple[str, ...]] = {}
        self._kinds: dict[tuple[object, ...], int] = {}
        self.buckets: dict[BucketKey, list[tuple[str, str]]] = {}
        """(kind, occupancy, node busy) -> sorted [(node, uuid)] of the GPUs in that state."""
        self._bucket_of: dict[str, BucketKey] = {}
        self._busy_nodes: set[str] = set()
        self.problems: dict[str, Problem] = {}
        # What each node publishes, GPUs shadowed by another node's included, and the GPU
        # UUIDs several nodes publish: (uuid, a node ignored) -> the node it counts on.
        self._published: dict[str, list[GpuInventory]] = {}
        self.duplicate_gpus: dict[tuple[str, str], str] = {}
        self.version = 0
        """Bumped on every change that can alter a placement decision."""

    # ------------------------------------------------------------------------------------------
    # Nodes and pods

    def set_node(self, node: NodeInfo) -> None:
        self.nodes[node.name] = node
        self.version += 1

    def remove_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        self.version += 1

    def set_pod(self, key: str, node: str, requests: Resources) -> None:
        """A pod bound (or about to be bound) to ``node`` whose requests count against it."""
        self.remove_pod(key)
        self._pods[key] = (node, requests)
        self._node_usage[node] = self._node_usage.get(node, NO_RESOURCES) + requests
        self.version += 1

    def remove_pod(self, key: str) -> None:
        old = self._pods.pop(key, None)
        if old is not None:
            node, requests = old
            self._node_usage[node] = self._node_usage[node] - requests
            if self._node_usage[node] == NO_RESOURCES:
                del self._node_usage[node]
            self.version += 1

    def pod_usage(self, key: str) -> tuple[str, Resources] | None:
        """The node and requests a pod counts with, if it counts anywhere."""
        return self._pods.get(key)

    def node_usage(self, node: str) -> Resources:
        return self._node_usage.get(node, NO_RESOURCES)

    def node_busy(self, node: str) -> bool:
        return node in self._busy_nodes

    # ------------------------------------------------------------------------------------------
    # GPUs

    def set_node_gpus(self, node: str, gpus: Iterable[GpuInventory]) -> None:
        """Replace what ``node`` publishes (its ResourceSlices changed).

        A GPU UUID is one physical GPU, so it counts on one node only: the node that published
        it first keeps it, and another node's publication of it is ignored (`duplicate_gpus`,
        which the controller reports) until the first lets it go. A node that publishes
        another's UUIDs, by mistake or by malice, so cannot remove that node's GPUs."""
        published = list(gpus)
        for g in published:
            if g.node != node:
                raise ValueError(f"GPU {g.uuid} belongs to node {g.node}, not {node}")
        released = set(self._node_gpus.get(node, ()))
        self._published[node] = published
        if not published:
            del self._published[node]
        self._place_node_gpus(node, published)
        released -= set(self._node_gpus.get(node, ()))
        # A GPU this node gave up that other nodes also publish counts on one of them now.
        for claimant in sorted({c for (u, c) in self.duplicate_gpus if u in released}):
            self._place_node_gpus(claimant, self._published.get(claimant, []))

    def _place_node_gpus(self, node: str, published: list[GpuInventory]) -> None:
        for uuid in list(self._node_gpus.get(node, ())):
            self._drop_gpu(uuid)
        for shadowed in [k for k in self.duplicate_gpus if k[1] == node]:
            del self.duplicate_gpus[shadowed]
        ordered = []
        for g in sorted(published, key=lambda g: g.uuid):
            holder = self.gpus.get(g.uuid)
            if holder is not None:
                self.duplicate_gpus[(g.uuid, node)] = holder.node
                continue
            ordered.append(g)
        self._node_gpus[node] = [g.uuid for g in ordered]
        if not ordered:
            del self._node_gpus[node]
        for position, inv in enumerate(ordered):
            kind = self._kinds.setdefault(_kind_signature(inv), len(self._kinds))
            record = GpuRecord(
                inventory=inv,
                geometry=geometry_for(inv.model),
                kind=kind,
                position=position,
                by_placement={_placement_key(d.profile_id, d.start): d for d in inv.devices},
            )
            self.gpus[inv.uuid] = record
            key = inv.model.key
            self._units_total[key] = self._units_total.get(key, 0) + inv.model.memory_units
            in_pool = self._device_index.setdefault(inv.pool, {})
            for d in inv.devices:
                in_pool[d.name] = inv.uuid
        for claim in list(self._unresolved):
            self._attach(self._holds[claim])
        for uuid in self._node_gpus.get(node, ()):
            self._recompute(uuid)
        self._refresh_busy(node)
        self.version += 1

    def _drop_gpu(self, uuid: str) -> None:
        self._unbucket(uuid)
        record = self.gpus.pop(uuid)
        key = record.inventory.model.key
        self._units_total[key] -= record.inventory.model.memory_units
        self._units_used[key] = self._units_used.get(key, 0) - _used_units(record)
        in_pool = self._device_index.get(record.inventory.pool, {})
        for d in record.inventory.devices:
            in_pool.pop(d.name, None)
        if not in_pool:
            self._device_index.pop(record.inventory.pool, None)
        for claim in self._claims_on_gpu.pop(uuid, set()):
            self._gpus_of_claim.get(claim, set()).discard(uuid)
            self._unresolved[claim] = ()  # re-resolved against the new publication
        self.problems.pop(f"gpu {uuid}", None)
        node_list = self._node_gpus.get(record.node)
        if node_list and uuid in node_list:
            node_list.remove(uuid)

    def gpus_on(self, node: str) -> list[GpuRecord]:
        return [self.gpus[u] for u in self._node_gpus.get(node, ())]

    def gpu_nodes(self) -> Iterator[str]:
        return iter(self._node_gpus)

    def device(self, pool: str, name: str) -> tuple[GpuRecord, PublishedDevice] | None:
        uuid = self._device_index.get(pool, _NO_DEVICES).get(name)
        if uuid is None:
            return None
        record = self.gpus[uuid]
        return record, _named_device(record, name)

    # ------------------------------------------------------------------------------------------
    # Claims

    def hold(self, hold: ClaimHold) -> None:
        """The claim holds these devices (``status.allocation`` set, terminating or not)."""
        self.release(hold.claim)
        self._holds[hold.claim] = hold
        self._attach(hold)
        self.version += 1

    def release(self, claim: ClaimKey) -> None:
        """The claim's allocation was cleared: its placements are free again."""
        old = self._holds.pop(claim, None)
        if old is None:
            return
        self._unresolved.pop(claim, None)
        for uuid in sorted(self._gpus_of_claim.pop(claim, ())):
            self._claims_on_gpu[uuid].discard(claim)
            self._recompute(uuid)
            self._refresh_busy(self.gpus[uuid].node)
        self.version += 1

    def hold_of(self, claim: ClaimKey) -> ClaimHold | None:
        return self._holds.get(claim)

    def holds(self) -> Iterator[ClaimHold]:
        return iter(self._holds.values())

    def _attach(self, hold: ClaimHold) -> None:
        missing = []
        touched = set()
        for d in hold.devices:
            uuid = self._device_index.get(d.pool, _NO_DEVICES).get(d.device)
            if uuid is None:
                missing.append(f"{d.pool}/{d.device}")
                continue
            self._claims_on_gpu.setdefault(uuid, set()).add(hold.claim)
            self._gpus_of_claim.setdefault(hold.claim, set()).add(uuid)
            touched.add(uuid)
        if missing:
            # Slices not seen yet (or withdrawn): keep the hold and attach when they appear.
            self._unresolved[hold.claim] = tuple(missing)
        else:
            self._unresolved.pop(hold.claim, None)
        for uuid in touched:
            self._recompute(uuid)
            self._refresh_busy(self.gpus[uuid].node)

    def unresolved(self) -> Mapping[ClaimKey, tuple[str, ...]]:
        """Claims holding devices that no known ResourceSlice publishes."""
        return self._unresolved

    def _recompute(self, uuid: str) -> None:
        record = self.gpus[uuid]
        holders: dict[tuple[int, int], set[ClaimKey]] = {}
        for claim in sorted(self._claims_on_gpu.get(uuid, ())):
            for d in self._holds[claim].devices:
                if self._device_index.get(d.pool, _NO_DEVICES).get(d.device) == uuid:
                    device = _named_device(record, d.device)
                    holders.setdefault((device.profile_id, device.start), set()).add(claim)
        record.holders = holders
        subject = f"gpu {uuid}"
        self.problems.pop(subject, None)
        shared = {k: v for k, v in holders.items() if len(v) > 1}
        whole = (WHOLE_GPU, 0) in holders
        occupancy = FREE
        if shared:
            (pid, start), claims = sorted(shared.items())[0]
            self.problems[subject] = Problem(
                subject,
                f"device {record.by_placement[(pid, start)].name} on node {record.node} is "
                f"allocated to several claims: {', '.join(sorted(map(str, claims)))}",
                tuple(sorted(map(str, claims))),
            )
            occupancy = Occupancy(EMPTY_STATE, blocked=True)
        elif whole:
            if len(holders) > 1:
                self.problems[subject] = Problem(
                    subject,
                    f"GPU {uuid} on node {record.node} is allocated whole and as MIG slices",
                    _claims_of(holders),
                )
            occupancy = Occupancy(EMPTY_STATE, blocked=True)
        elif holders:
            state = self._state_of(record, frozenset(holders))
            if isinstance(state, str):
                self.problems[subject] = Problem(
                    subject,
                    f"allocations on GPU {uuid} (node {record.node}) conflict: {state}",
                    _claims_of(holders),
                )
                occupancy = Occupancy(EMPTY_STATE, blocked=True)
            else:
                occupancy = Occupancy(state)
        before = _used_units(record)
        record.occupancy = occupancy
        key = record.inventory.model.key
        self._units_used[key] = self._units_used.get(key, 0) + _used_units(record) - before
        self._rebucket(uuid)

    def _state_of(self, record: GpuRecord, instances: frozenset[tuple[int, int]]) -> GpuState | str:
        """The geometry state holding ``instances``, or why they cannot coexist; memoized
        because the same sets recur on many GPUs."""
        key = (record.geometry, instances)
        hit = self._states.get(key)
        if hit is None:
            try:
                hit = record.geometry.state_of(instances)
            except PlacementError as exc:
                hit = str(exc)
            if len(self._states) > 100_000:
                self._states.clear()
            self._states[key] = hit
        return hit

    # ------------------------------------------------------------------------------------------
    # Index by (kind, occupancy, node busy)

    def _refresh_busy(self, node: str) -> None:
        busy = any(self.gpus[u].occupancy.in_use for u in self._node_gpus.get(node, ()))
        if busy != (node in self._busy_nodes):
            if busy:
                self._busy_nodes.add(node)
            else:
                self._busy_nodes.discard(node)
            for uuid in self._node_gpus.get(node, ()):
                self._rebucket(uuid)

    def _unbucket(self, uuid: str) -> None:
        key = self._bucket_of.pop(uuid, None)
        if key is None:
            return
        members = self.buckets[key]
        entry = (self.gpus[uuid].node, uuid)
        i = bisect.bisect_left(members, entry)
        del members[i]
        if not members:
            del self.buckets[key]

    def _rebucket(self, uuid: str) -> None:
        record = self.gpus[uuid]
        key = (record.kind, record.occupancy, record.node in self._busy_nodes)
        if self._bucket_of.get(uuid) == key:
            return
        self._unbucket(uuid)
        bisect.insort(self.buckets.setdefault(key, []), (record.node, uuid))
        self._bucket_of[uuid] = key

    def utilization(self, model_key: str) -> float:
        """Fraction of the memory units of all GPUs of ``model_key`` that are occupied."""
        total = self._units_total.get(model_key, 0)
        return self._units_used.get(model_key, 0) / total if total else 0.0

    # ------------------------------------------------------------------------------------------
    # Comparison

    def snapshot(self) -> tuple[object, ...]:
        """Everything decisions depend on, as a comparable value (used to prove that
        incremental updates and a rebuild agree)."""
        return (
            tuple(sorted(self.nodes.items())),
            tuple(sorted(self._node_usage.items())),
            tuple(sorted((u, r.node, r.occupancy) for u, r in self.gpus.items())),
            tuple(sorted(self._busy_nodes)),
            tuple(sorted(self.problems)),
            tuple(sorted(self._unresolved)),
            tuple(sorted((k, v) for k, v in self._units_used.items() if v)),
            tuple(sorted((k, v) for k, v in self._units_total.items() if v)),
        )


def withheld_devices_note(
    gpus: Iterable[GpuRecord], *, whole: bool = True, mig: bool = True
) -> str:
    """Why some of ``gpus`` publish no whole-GPU device (``whole``) or no MIG device (``mig``)
    now ("" if none does), to follow a "nothing matches" message for a request that could use
    that kind: a whole GPU must not be in MIG mode, and carve changes MIG mode only where that
    needs no GPU reset (Hopper and later)."""
    in_mig_mode: set[str] = set()
    out_of_mig_mode: set[str] = set()
    held_whole: set[str] = set()
    for g in gpus:
        model = g.inventory.model
        kinds = {d.profile_id == WHOLE_GPU for d in g.inventory.devices}
        if True not in kinds:
            in_mig_mode.add(model.key)
        if False not in kinds:
            (out_of_mig_mode if model.architecture.mig_toggle_needs_reset else held_whole).add(
                model.key
            )
    if not whole:
        in_mig_mode.clear()
    if not mig:
        out_of_mig_mode.clear()
        held_whole.clear()
    notes = []
    if in_mig_mode:
        notes.append(
            f"{', '.join(sorted(in_mig_mode))} GPUs in MIG mode offer no whole GPU: on Ampere "
            "only a GPU reset turns MIG mode off, which carve never does (run `nvidia-smi -i "
            "<GPU> -mig 0` on the node and reset the GPU)"
        )
    if out_of_mig_mode:
        notes.append(
            f"{', '.join(sorted(out_of_mig_mode))} GPUs out of MIG mode offer no MIG slice: on "
            "Ampere only a GPU reset turns MIG mode on (run `nvidia-smi -i <GPU> -mig 1` on the "
            "node and reset the GPU)"
        )
    if held_whole:
        notes.append(
            f"{', '.join(sorted(held_whole))} GPUs allocated whole offer no MIG slice until "
            "their claims are released"
        )
    return "; ".join(notes)


# ---------------------------------------------------------------------------------------------
# From ResourceSlices


def inventories_from_slices(
    slices: Iterable[Mapping[str, object]],
    driver: str,
    *,
    on_error: Callable[[ValueError], None] | None = None,
    rule_taints: Callable[[str, str], tuple[DeviceTaint, ...]] | None = None,
) -> list[GpuInventory]:
    """The GPUs ``driver``'s ResourceSlices publish, with every device's attributes and
    capacity exactly as published (so selectors see what kube-scheduler sees), and its taints
    followed by those ``rule_taints(pool, device)`` adds (the DeviceTaintRules,
    `controller.taintrules`), as kube-scheduler's slice tracker adds them.

    Structure (which GPU, which placement a device is) comes from
    :func:`driver.slicereader.parse_resource_slices`; malformed slices are reported through
    ``on_error`` and skipped, as there.
    """
    from driver.slicereader import parse_resource_slices

    slices = list(slices)
    raw: dict[tuple[str, str], Mapping[str, object]] = {}
    for obj in slices:
        spec = obj.get("spec")
        if not isinstance(spec, Mapping) or spec.get("driver") != driver:
            continue
        pool = spec.get("pool")
        pool_name = pool.get("name") if isinstance(pool, Mapping) else None
        for device in spec.get("devices") or ():
            if isinstance(device, Mapping) and isinstance(pool_name, str):
                raw[(pool_name, str(device.get("name")))] = device
    out = []
    for gpu in parse_resource_slices(slices, driver, on_error=on_error):
        named = [((pid, start), name) for (pid, start), name in gpu.devices.items()]
        if gpu.whole_gpu_device is not None:
            named.append(((WHOLE_GPU, 0), gpu.whole_gpu_device))
        found = []
        for (pid, start), name in sorted(named):
            device = raw.get((gpu.pool, name))
            if device is None:  # parse_resource_slices saw it, so this cannot happen
                continue
            found.append((name, pid, start, device, device_facts(device, driver)))
        shared = _gpu_level_facts([(pid, facts) for _, pid, _, _, facts in found])
        devices = tuple(
            PublishedDevice(
                name,
                pid,
                start,
                facts.sharing(shared),
                parse_taints(device.get("taints"))
                + (rule_taints(gpu.pool, name) if rule_taints else ()),
                _condition_names(device.get("bindingConditions")),
                _condition_names(device.get("bindingFailureConditions")),
            )
            for name, pid, start, device, facts in found
        )
        out.append(GpuInventory(gpu.node_name, gpu.pool, gpu.uuid, gpu.model, devices))
    return out


def _gpu_level_facts(
    devices: list[tuple[int, CelDevice]],
) -> tuple[tuple[str, AttributeValue], ...]:
    """The attributes a GPU's MIG placements all publish alike (product, driver, PCI address,
    parent UUID, ...), held once per GPU instead of once per device (~20 of them a GPU).

    The whole-GPU device is left out of the comparison: it names the GPU by ``uuid``, not
    ``parentUUID``, so counting it would leave the per-GPU UUID in every placement's own facts
    and no placement's own facts could be one tuple for the fleet. It keeps all of its own.
    """
    placements = [facts for pid, facts in devices if pid != WHOLE_GPU]
    return common_facts(placements) if len(placements) > 1 else ()


def _condition_names(value: object) -> tuple[str, ...]:
    """A device's binding (failure) conditions; the apiserver validated them, so anything but a
    list of strings means no conditions."""
    if not isinstance(value, list):
        return ()
    return tuple(v for v in value if isinstance(v, str))


@functools.lru_cache(maxsize=4096)
def _quantity(text: str) -> Decimal:
    # GPUs of one model publish the same few quantities thousands of times, and the planner
    # re-reads every device of a node whenever one of its slices changes.
    return parse_quantity(text)


@functools.lru_cache(maxsize=1024)
def _semver(text: str) -> Semver:
    return Semver.parse(text)


def device_facts(device: Mapping[str, object], driver: str) -> CelDevice:
    """A ResourceSlice device (API JSON) as the facts CEL selectors read."""
    attributes: dict[str, AttributeValue] = {}
    raw_attrs = device.get("attributes")
    for name, value in raw_attrs.items() if isinstance(raw_attrs, Mapping) else ():
        if not isinstance(value, Mapping):
            continue
        if "version" in value:
            try:
                attributes[name] = _semver(str(value["version"]))
            except ValueError:
                continue  # the apiserver validates versions; never trust, never crash
        elif "bool" in value:
            attributes[name] = bool(value["bool"])
        elif "int" in value:
            attributes[name] = int(value["int"])
        elif "string" in value:
            attributes[name] = str(value["string"])
    capacity: dict[str, Decimal] = {}
    raw_caps = device.get("capacity")
    for name, value in raw_caps.items() if isinstance(raw_caps, Mapping) else ():
        if isinstance(value, Mapping) and "value" in value:
            try:
                capacity[name] = _quantity(str(value["value"]))
            except ValueError:
                continue
    return CelDevice.of(driver, attributes, capacity)
