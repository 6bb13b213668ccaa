"""The cluster's MIG picture from the API alone: which slices are carved where, and for whom.

`carve status` shows, per node and GPU, the memory slices each allocated claim holds, the
claim and the pods it is reserved for, what profiles still fit, and the taints that keep its
devices from claims that do not tolerate them: the node's own (a sick GPU) and those of an
admin's DeviceTaintRules, named, judged as the controller and kube-scheduler judge them
(`driver.taintrules`). It reads only the API (ResourceSlices, ResourceClaims and, where the
user may list them, DeviceTaintRules), so it works the same on a real cluster and on simulated
nodes. Pure functions over the API's JSON.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.geometry import PlacementError, geometry_for
from driver.naming import parse_device_name
from driver.slicereader import SlicedGpu, parse_resource_slices
from driver.taintrules import TaintRule, parse_taint_rule, rules_on

_LABELS = string.ascii_uppercase + string.ascii_lowercase


@dataclass(frozen=True)
class HeldSlice:
    """One allocated device on a GPU and the claim holding it."""

    device: str
    profile: str  # profile name, or "whole GPU"
    profile_id: int | None
    start: int
    size: int
    claim: str  # namespace/name
    consumers: tuple[str, ...]  # names of the pods (or other objects) the claim is reserved for
    releasing: bool  # the claim is being deleted: the node has not confirmed destruction yet


@dataclass(frozen=True)
class GpuView:
    node: str
    minor: int
    uuid: str
    product_name: str
    memory_units: int
    held: tuple[HeldSlice, ...]
    still_fits: Mapping[str, int]  # profile name -> how many more could be carved now
    problem: str = ""  # allocations the geometry cannot express (overlap): shown, not hidden
    taints: tuple[TaintOnGpu, ...] = ()  # what keeps its devices from untolerating claims


@dataclass(frozen=True)
class TaintOnGpu:
    """One taint on some of a GPU's devices: ``source`` is ``DeviceTaintRule <name>`` or
    ``the node``; ``devices`` of the GPU's ``of`` published devices carry it."""

    taint: str
    source: str
    devices: int
    of: int


def cluster_view(
    slices: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
    driver: str,
    on_error: Callable[[ValueError], None] | None = None,
    rules: Iterable[Mapping[str, Any]] = (),
) -> list[GpuView]:
    """Join the published GPUs with the allocations that name their devices, and with the
    taints on those devices (their own, and what DeviceTaintRules ``rules`` add)."""
    slices = list(slices)
    gpus = parse_resource_slices(slices, driver, on_error=on_error)
    own = _published_taints(slices, driver)
    taint_rules = [r for r in map(parse_taint_rule, rules) if r is not None]
    by_gpu: dict[tuple[str, int], list[HeldSlice]] = {}
    index = {(g.pool, g.minor): g for g in gpus}
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        allocation = status.get("allocation") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        consumers = tuple(str(r.get("name")) for r in status.get("reservedFor") or [])
        releasing = meta.get("deletionTimestamp") is not None
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") != driver:
                continue
            try:
                parsed = parse_device_name(str(result.get("device")))
            except ValueError:
                continue
            gpu = index.get((str(result.get("pool")), parsed.minor))
            if gpu is None:
                continue
            by_gpu.setdefault((gpu.pool, gpu.minor), []).append(
                _held(
                    gpu,
                    str(result.get("device")),
                    profile_id=parsed.profile_id,
                    start=parsed.placement_start,
                    claim=key,
                    consumers=consumers,
                    releasing=releasing,
                )
            )
    return [
        _view(g, by_gpu.get((g.pool, g.minor), []), _taints_on(g, driver, own, taint_rules))
        for g in gpus
    ]


def _published_taints(
    slices: Iterable[Mapping[str, Any]], driver: str
) -> dict[tuple[str, str], list[str]]:
    """(pool, device) -> the device's own taints, as ``key=value:effect``."""
    out: dict[tuple[str, str], list[str]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        pool = str((spec.get("pool") or {}).get("name"))
        for d in spec.get("devices") or ():
            for t in d.get("taints") or ():
                value = f"={t['value']}" if t.get("value") else ""
                out.setdefault((pool, str(d.get("name"))), []).append(
                    f"{t.get('key')}{value}:{t.get('effect')}"
                )
    return out


def _taints_on(
    gpu: SlicedGpu,
    driver: str,
    own: Mapping[tuple[str, str], list[str]],
    rules: Sequence[TaintRule],
) -> tuple[TaintOnGpu, ...]:
    names = [*gpu.devices.values(), *([gpu.whole_gpu_device] if gpu.whole_gpu_device else [])]
    counted: dict[tuple[str, str], int] = {}
    for name in names:
        found = [(t, "the node") for t in own.get((gpu.pool, name), ())]
        found += [
            (r.taint, f"DeviceTaintRule {r.name}") for r in rules_on(rules, driver, gpu.pool, name)
        ]
        for key in dict.fromkeys(found):
            counted[key] = counted.get(key, 0) + 1
    return tuple(
        TaintOnGpu(taint, source, n, len(names))
        for (taint, source), n in sorted(counted.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    )


def _held(
    gpu: SlicedGpu,
    device: str,
    *,
    profile_id: int | None,
    start: int | None,
    claim: str,
    consumers: tuple[str, ...],
    releasing: bool,
) -> HeldSlice:
    if profile_id is None or start is None:
        return HeldSlice(
            device, "whole GPU", None, 0, gpu.model.memory_units, claim, consumers, releasing
        )
    try:
        spec = gpu.model.profile_by_id(profile_id)
        name, size = spec.name, spec.size
    except KeyError:
        name, size = f"profile id {profile_id}", 1
    return HeldSlice(device, name, profile_id, start, size, claim, consumers, releasing)


def _view(gpu: SlicedGpu, held: Sequence[HeldSlice], taints: tuple[TaintOnGpu, ...]) -> GpuView:
    ordered = tuple(sorted(held, key=lambda h: (h.start, h.device)))
    geometry = geometry_for(gpu.model)
    problem = ""
    fits: dict[str, int] = {}
    try:
        if any(h.profile_id is None for h in ordered):
            state = None  # a whole-GPU allocation: nothing else fits
        else:
            state = geometry.state_of(
                (h.profile_id, h.start) for h in ordered if h.profile_id is not None
            )
    except PlacementError as exc:
        state = None
        problem = f"allocations do not fit together: {exc}"
    if state is not None:
        admits = geometry.admits(state)
        for p in gpu.model.profiles:
            count = admits.get(p.id, 0)
            if count:
                fits[p.name] = count
    return GpuView(
        node=gpu.node_name,
        minor=gpu.minor,
        uuid=gpu.uuid,
        product_name=gpu.product_name,
        memory_units=gpu.model.memory_units,
        held=ordered,
        still_fits=fits,
        problem=problem,
        taints=taints,
    )


def memory_map(units: int, held: Sequence[HeldSlice]) -> str:
    """One character per memory slice: '.' free, a letter per allocated device."""
    cells = ["."] * units
    for label, h in zip(_LABELS, held, strict=False):
        for unit in range(h.start, min(h.start + h.size, units)):
            cells[unit] = "#" if cells[unit] != "." else label
    return "".join(cells)


def render(views: Sequence[GpuView]) -> str:
    """The per-GPU picture `carve status` prints."""
    if not views:
        return "no GPUs published by carve's kubelet plugins (no ResourceSlices of the driver)"
    lines: list[str] = []
    node = None
    for v in views:
        if v.node != node:
            node = v.node
            lines.append(f"node {node}")
        scale = "".join(str(u % 10) for u in range(v.memory_units))
        used = sum(h.size for h in v.held)
        lines.append(
            f"  gpu-{v.minor}  {v.product_name}  {v.uuid}  ({used}/{v.memory_units} memory "
            "slices allocated)"
        )
        lines.append(f"    memory slices  {scale}")
        lines.append(f"                   {memory_map(v.memory_units, v.held)}")
        for label, h in zip(_LABELS, v.held, strict=False):
            who = ", ".join(h.consumers) if h.consumers else "no pod"
            state = "  [releasing]" if h.releasing else ""
            lines.append(
                f"      {label} = {h.profile:<11} at {h.start}:{h.size}  claim {h.claim}  "
                f"(for {who}){state}"
            )
        if v.problem:
            lines.append(f"      ! {v.problem}")
        for t in v.taints:
            on = f"all {t.of} devices" if t.devices == t.of else f"{t.devices} of {t.of} devices"
            lines.append(f"      tainted {t.taint} by {t.source}, on {on}")
        if v.still_fits:
            fits = ", ".join(f"{name} x{n}" for name, n in v.still_fits.items())
            only = " (for claims that tolerate those taints)" if _blocked(v) else ""
            lines.append(f"      still fits{only}: {fits}")
        else:
            lines.append("      still fits: nothing (full)")
    return "\n".join(lines)


def _blocked(view: GpuView) -> bool:
    """Whether a taint on the GPU keeps devices from claims that do not tolerate it."""
    return any(t.taint.endswith((":NoSchedule", ":NoExecute")) for t in view.taints)
