"""MPS settings checked at placement, before anything is carved.

The node refuses bad MPS settings too (``kubeletplugin.prepare``), but by then the pod is bound
and the claim allocated: the refusal costs a pod stuck on that node. Here the same rules run on
the claim, its DeviceClasses and the pod, so the user reads the reason in the pod's and the
claim's events while nothing is allocated.

Two sources of MPS settings meet in a container:

* the opaque ``mpsConfig`` of the claim and of its classes (class entries first, claim entries
  last wins, as the node resolves the copy in the allocation). It sets the MPS control daemon's
  defaults, the ceiling for every client of the claim;
* a container's own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` / ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``driver.mpsclient``): per-client limits that CUDA applies when lower than the daemon's.

The rules:

1. Requests of one claim with different MPS settings are refused: one daemon serves a claim,
   whether on its MIG slices or on its whole GPUs (NVIDIA's driver shares whole GPUs so too).
2. A pinned-memory limit cannot be more than the device's memory (the slice's, or the GPU's
   for a whole GPU). For a claim being placed, the largest limit that applies to a request
   (the daemon default or a client's) becomes a memory floor: only devices with at least that
   much memory are candidates, so a ``firstAvailable`` or a selector naming several profiles
   gets one that can hold it. For a claim that is already allocated (a shared claim, a second
   pod), a client limit above its device's memory is refused.
3. A container that sets a client variable must use, through ``resources.claims``, a carve
   request with MPS sharing: otherwise no daemon serves it and CUDA ignores the variable, which
   the user would not notice. Containers that use no carve claim are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from controller.claims import ClaimSpec, DeviceClass, DeviceRequest
from driver.allocation import parse_allocation
from driver.apiviews import ClaimView, PodView
from driver.cel import qualify
from driver.config import (
    ConfigError,
    MpsConfig,
    OpaqueConfigEntry,
    SharingStrategy,
    resolve_config,
)
from driver.mpsclient import VARIABLES, ClientLimitError, ClientLimits, parse_client_env

_MIB = 2**20


class MpsSettingError(ValueError):
    """MPS settings carve cannot honour as written; the message says what to change."""


@dataclass(frozen=True)
class ClaimMps:
    """A carve claim of the pod, as the MPS rules see it.

    ``mps`` maps result names (``req`` or ``req/sub``) to their MPS config, for those with MPS
    sharing. ``memory`` is only known for an allocated claim: its results' slice memory.
    """

    name: str
    mps: Mapping[str, MpsConfig]
    memory: Mapping[str, int] | None = None

    def mps_results(self, request: str | None) -> list[str]:
        """The MPS results a container reaches through ``resources.claims[].request``."""
        return [
            r for r in self.mps if request is None or r == request or r.partition("/")[0] == request
        ]


@dataclass(frozen=True)
class ContainerMps:
    """One container that sets client variables, and the claim requests it uses."""

    container: str
    limits: ClientLimits
    uses: tuple[tuple[str, str | None], ...]  # (claim object name, request or None: all)


# ---------------------------------------------------------------------------------------------
# The claim side


def spec_mps(
    spec: ClaimSpec, classes: Mapping[str, DeviceClass], driver: str
) -> dict[str, MpsConfig]:
    """The MPS config of each alternative of an unallocated claim that has MPS sharing."""
    claim_entries = [
        OpaqueConfigEntry("FromClaim", c.requests, c.opaque.driver, c.opaque.parameters)
        for c in spec.config
    ]
    out: dict[str, MpsConfig] = {}
    for request in spec.requests:
        for alt in request.alternatives:
            cls = classes.get(alt.spec.device_class)
            entries = [
                OpaqueConfigEntry(
                    "FromClass", (alt.result_name,), c.opaque.driver, c.opaque.parameters
                )
                for c in (cls.config if cls is not None else ())
            ]
            try:
                cfg = resolve_config([*entries, *claim_entries], driver, alt.result_name)
            except ConfigError as exc:  # validated when parsed; kept for a class edited since
                raise MpsSettingError(f"request {alt.result_name!r}: {exc}") from exc
            if cfg.sharing.strategy is SharingStrategy.MPS:
                out[alt.result_name] = cfg.sharing.mps or MpsConfig()
    return out


def allocated_mps(claim: Mapping[str, Any], driver: str) -> dict[str, MpsConfig]:
    """The MPS config of each result of an allocated claim, from the config its allocation
    carries (what the node will apply, whatever the class says now)."""
    allocation = parse_allocation(ClaimView(claim).status.get("allocation"))
    out: dict[str, MpsConfig] = {}
    for result in allocation.results_for(driver):
        try:
            cfg = resolve_config(allocation.config, driver, result.request)
        except ConfigError:
            continue  # the node refuses it with the field's name; nothing to add here
        if cfg.sharing.strategy is SharingStrategy.MPS:
            out[result.request] = cfg.sharing.mps or MpsConfig()
    return out


def check_one_daemon(spec: ClaimSpec, mps: Mapping[str, MpsConfig]) -> None:
    """One daemon serves a claim, so its requests cannot ask for different MPS settings.

    Refused here only when certain: every MPS request has one setting whatever alternative it
    gets. Otherwise (alternatives that differ) the node refuses it if the chosen ones differ.
    """
    per_request = {}
    for request in spec.requests:
        settings = {mps[a.result_name] for a in request.alternatives if a.result_name in mps}
        if len(settings) == 1:
            per_request[request.name] = next(iter(settings))
    if len(set(per_request.values())) > 1:
        raise MpsSettingError(
            f"requests {', '.join(map(repr, sorted(per_request)))} ask for different MPS "
            "settings, but one MPS control daemon serves a claim; give them one mpsConfig (or "
            "use separate claims)"
        )


# ---------------------------------------------------------------------------------------------
# The pod side


def pod_clients(
    pod: Mapping[str, Any], claim_names: Mapping[str, str | None]
) -> list[ContainerMps]:
    """Containers (init containers included) whose literal env sets a client variable.

    ``claim_names`` maps the pod's ``spec.resourceClaims[].name`` to the claim object's name
    (None while a template's claim does not exist yet). A variable from ``valueFrom`` cannot be
    read here and is left to CUDA.
    """
    spec = PodView(pod).spec
    out = []
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            env = {
                str(e.get("name")): str(e.get("value", ""))
                for e in c.get("env") or []
                if isinstance(e, Mapping) and e.get("name") in VARIABLES and "valueFrom" not in e
            }
            if not env:
                continue
            where = f"spec.{field}[{i}] ({c.get('name', '')})"
            try:
                limits = parse_client_env(env)
            except ClientLimitError as exc:
                raise MpsSettingError(f"{where}.env: {exc}") from exc
            uses = tuple(
                (name, ref.get("request") or None)
                for ref in (c.get("resources") or {}).get("claims") or []
                if (name := claim_names.get(str(ref.get("name")))) is not None
            )
            out.append(ContainerMps(where, limits, uses))
    return out


def check_clients(
    clients: Sequence[ContainerMps], claims: Mapping[str, ClaimMps]
) -> dict[tuple[str, str], int]:
    """Rules 2 and 3 for the pod's containers. Returns the memory floors that client limits put
    on results of claims not yet allocated: (claim name, result name) -> bytes."""
    floors: dict[tuple[str, str], int] = {}
    for client in clients:
        carve = [(claims[n], req) for n, req in client.uses if n in claims]
        if not carve:
            continue
        reached = [(c, r) for c, req in carve for r in c.mps_results(req)]
        if not reached:
            names = ", ".join(sorted({c.name for c, _ in carve}))
            raise MpsSettingError(
                f"{client.container} sets {_set_vars(client.limits)} but no carve claim it uses "
                f"({names}) has MPS sharing, so no MPS daemon serves it and CUDA would ignore "
                "the setting; give the claim (or its DeviceClass) sharing strategy MPS, or "
                "remove the variable"
            )
        pinned = client.limits.largest_pinned_bytes
        if pinned is None:
            continue
        for claim, result in reached:
            if claim.memory is None:
                key = (claim.name, result)
                floors[key] = max(floors.get(key, 0), pinned)
            elif (have := claim.memory.get(result)) is not None and pinned > have:
                raise MpsSettingError(
                    f"{client.container}: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT {pinned // _MIB}Mi is "
                    f"more than the {have // _MIB}Mi of memory of the device that ResourceClaim "
                    f"{claim.name} (request {result}) holds; lower the limit"
                )
    return floors


def _set_vars(limits: ClientLimits) -> str:
    names = []
    if limits.thread_percentage is not None:
        names.append("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if limits.pinned_bytes is not None:
        names.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    return " and ".join(names)


# ---------------------------------------------------------------------------------------------
# Memory floors on the requests being placed


def claim_floors(mps: Mapping[str, MpsConfig]) -> dict[str, int]:
    """The daemon's default pinned limit of each MPS result, as a memory floor."""
    return {
        result: cfg.default_pinned_device_memory_limit_bytes
        for result, cfg in mps.items()
        if cfg.default_pinned_device_memory_limit_bytes is not None
    }


def with_floors(spec: ClaimSpec, floors: Mapping[str, int], driver: str) -> ClaimSpec:
    """The claim with each floored alternative asking for at least that much memory capacity
    (the larger of its own memory request and the floor)."""
    if not floors:
        return spec
    memory = qualify(driver, "memory")
    requests: list[DeviceRequest] = []
    for request in spec.requests:
        alternatives = []
        for alt in request.alternatives:
            floor = floors.get(alt.result_name)
            if floor is None:
                alternatives.append(alt)
                continue
            capacity = dict(alt.spec.capacity)
            capacity[memory] = max(capacity.get(memory, Decimal(0)), Decimal(floor))
            floored = replace(alt.spec, capacity=tuple(sorted(capacity.items())))
            alternatives.append(replace(alt, spec=floored))
        requests.append(replace(request, alternatives=tuple(alternatives)))
    return replace(spec, requests=tuple(requests))


def floor_refusal(claim: str, result: str, floor: int, largest: Decimal) -> str:
    """Why a floored request found no device, when the floor is more than its largest slice."""
    return (
        f"ResourceClaim {claim}, request {result}: an MPS pinned device memory limit of "
        f"{floor // _MIB}Mi applies to it (mpsConfig.defaultPinnedDeviceMemoryLimit or a "
        f"container's CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), but the largest device it matches has "
        f"{int(largest) // _MIB}Mi; lower the limit or ask for a device with more memory (a "
        "larger profile, or a whole GPU of a larger model)"
    )
