"""Carve before bind: prepare a claim as soon as it is allocated to this node, and report it.

With `--binding-conditions` every device the node publishes carries the binding condition
`<driver>/Carved` and the failure condition `<driver>/CarveFailed`; whoever allocates a device
(carve's controller or kube-scheduler) copies both into the allocation result, and
kube-scheduler then holds the pod in PreBind until the claim's `status.devices` says `Carved`
for each such device. This module closes the loop on the node:

- it sees every claim (`kubeletplugin.claimwatch`) and keeps those allocated to this node's
  pool whose results ask for the condition and have no verdict yet (`carve_target`, pure);
- it runs the ordinary prepare (`Preparer.prepare`: same checkpoint states, node finalizer
  before the first NVML change, CDI spec), so the kubelet's `NodePrepareResources` later finds
  the claim `PrepareCompleted` and only returns its CDI IDs;
- it writes the verdict into `status.devices` (`device_status_entries`, pure; written through
  `resourceclaims/status`, which also needs the node-scoped `resourceclaims/driver` verb).

A failed carve has already been torn down by the preparer (instance, spec, node finalizer)
when `CarveFailed` is written, so the placement is free when kube-scheduler clears the
allocation. When NVML itself refused (not a claim-level problem such as bad config), the GPU
also gets the device taint `<driver>/carve-failed:NoSchedule` for a cool-down, published
*before* the verdict, so that the controller's re-plan and kube-scheduler's allocator go to
another GPU instead of the one that just failed.

A claim carved here whose allocation is cleared before the pod is bound (binding timeout, or
the scheduler gave up for another reason) is never unprepared by the kubelet; the preparer's
housekeeping releases it (`Preparer.retry_pending`), run at once when the watch shows it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from driver.allocation import AllocatedDevice
from driver.apiviews import ClaimView, ObjectView
from driver.contract import Contract
from driver.naming import parse_device_name
from kubeletplugin.checkpoint import Checkpoint
from kubeletplugin.claims import ClaimFormatError, parse_claim
from kubeletplugin.claimwatch import ClaimWatch
from kubeletplugin.ports import ClaimRef, PrepareResult
from process.kube import Obj
from process.kube.errors import ApiError
from process.kube.jsonclient import KubeJson
from process.kube.rmw import (
    MERGE_PATCH,
    ObjectGoneError,
    Target,
    WriteSkippedError,
    read_modify_write,
)

log = logging.getLogger(__name__)


# Prepare failures that say the GPU (NVML) refused, not that the claim is wrong: only these
# taint the GPU, because placing the claim elsewhere on the same GPU would likely fail again.
GPU_FAILURES = frozenset({"carve-failed", "mig-enable-failed", "mig-disable-failed"})


@dataclass(frozen=True)
class CarveTarget:
    """A claim this node should carve now: its reference and its devices on this node."""

    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]


@dataclass(frozen=True)
class Verdict:
    """What the node reports for a claim's devices."""

    carved: bool
    reason: str  # a condition reason: CamelCase
    message: str


def carve_target(obj: Mapping[str, Any], *, contract: Contract, pool: str) -> CarveTarget | None:
    """The claim, if this node must carve it before bind: allocated to `pool`, some result of
    the driver asks for the `Carved` binding condition, not being deleted, and no verdict
    (`Carved` or `CarveFailed` True) reported yet for those devices. Raises ClaimFormatError
    for what the apiserver would never serve."""
    claim = parse_claim(obj)
    if claim.deleting or not claim.allocated:
        return None
    ours = tuple(
        r
        for r in claim.results_for(contract.driver)
        if r.pool == pool and contract.carved_condition in r.binding_conditions
    )
    if not ours:
        return None
    reported = _reported_devices(obj, contract)
    if all((r.pool, r.device, r.share_id) in reported for r in ours):
        return None
    return CarveTarget(ClaimRef(claim.namespace, claim.name, claim.uid), ours)


def _reported_devices(
    obj: Mapping[str, Any], contract: Contract
) -> set[tuple[str, str, str | None]]:
    """(pool, device, shareID) of the driver's device entries that carry a verdict."""
    verdicts = {contract.carved_condition, contract.carve_failed_condition}
    out: set[tuple[str, str, str | None]] = set()
    for entry in ClaimView(obj).device_statuses:
        if entry.get("driver") != contract.driver:
            continue
        for cond in entry.get("conditions") or ():
            if (
                isinstance(cond, Mapping)
                and cond.get("type") in verdicts
                and cond.get("status") == "True"
            ):
                out.add((str(entry.get("pool")), str(entry.get("device")), entry.get("shareID")))
    return out


def device_status_entries(
    current: Sequence[Mapping[str, Any]],
    devices: Sequence[AllocatedDevice],
    verdict: Verdict,
    *,
    contract: Contract,
    now: dt.datetime,
) -> list[Obj]:
    """`status.devices` with `verdict` set on `devices`; every other entry (other drivers',
    other conditions of ours) is kept as it is. Both conditions are always written, one True
    and one False, so a reader never sees a stale opposite verdict."""
    stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    wanted = {
        contract.carved_condition: verdict.carved,
        contract.carve_failed_condition: not verdict.carved,
    }
    message = verdict.message[:_MAX_MESSAGE]
    out: list[Obj] = [dict(e) for e in current]
    for d in devices:
        key = (d.driver, d.pool, d.device, d.share_id)
        entry = next(
            (
                e
                for e in out
                if (e.get("driver"), e.get("pool"), e.get("device"), e.get("shareID")) == key
            ),
            None,
        )
        if entry is None:
            entry = {"driver": d.driver, "pool": d.pool, "device": d.device}
            if d.share_id is not None:
                entry["shareID"] = d.share_id
            out.append(entry)
        conditions = [
            dict(c)
            for c in entry.get("conditions") or ()
            if isinstance(c, Mapping) and c.get("type") not in wanted
        ]
        for type_, status in wanted.items():
            conditions.append(
                {
                    "type": type_,
                    "status": "True" if status else "False",
                    "reason": verdict.reason,
                    "message": message,
                    "lastTransitionTime": stamp,
                }
            )
        entry["conditions"] = conditions
    return out


_MAX_MESSAGE = 32768  # metav1.Condition.message


class DeviceStatusWriter(Protocol):
    def report(self, target: CarveTarget, verdict: Verdict) -> None: ...


class KubernetesDeviceStatus:
    """Writes verdicts through `resourceclaims/status` as a merge patch of `status.devices`,
    guarded by the resourceVersion it was derived from (the list is replaced whole, so a stale
    copy must not drop another driver's entry)."""

    def __init__(
        self,
        api: KubeJson,
        contract: Contract,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._api = api
        self._contract = contract
        self._clock = clock

    def report(self, target: CarveTarget, verdict: Verdict) -> None:
        ref = target.ref
        path = f"/apis/resource.k8s.io/v1/namespaces/{ref.namespace}/resourceclaims/{ref.name}"
        wanted = {(d.pool, d.device, d.share_id) for d in target.devices}

        def mutate(cur: Obj) -> Obj | None:
            claim = parse_claim(cur)
            have = {(r.pool, r.device, r.share_id) for r in claim.results_for(target_driver)}
            if claim.deleting or not wanted <= have:
                raise WriteSkippedError("the claim's allocation changed meanwhile")
            current = ClaimView(cur).device_statuses
            new = device_status_entries(
                current,
                target.devices,
                verdict,
                contract=self._contract,
                now=self._clock(),
            )
            if new == current:
                return None
            return {"status": {"devices": new}}

        target_driver = self._contract.driver
        rmw_target = Target(
            namespace=ref.namespace,
            name=ref.name,
            uid=ref.uid,
            read=lambda: self._api.request("GET", path),
            write=lambda body: self._api.request(
                "PATCH", f"{path}/status", body=body, content_type=MERGE_PATCH
            ),
        )
        read_modify_write(rmw_target, mutate)


class ClaimPreparer(Protocol):
    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]: ...
    def retry_pending(self) -> None: ...
    def checkpoint(self) -> Checkpoint: ...


class CarveFailures:
    """GPUs on which NVML refused to carve recently, as device taints for the publisher."""

    def __init__(
        self, key: str, cooldown: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._key = key
        self._cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}  # gpu uuid -> taint ends

    def add(self, gpu_uuids: Sequence[str]) -> bool:
        """Taint these GPUs for the cool-down; True if any was not tainted already."""
        if self._cooldown <= 0:
            return False
        end = self._clock() + self._cooldown
        with self._lock:
            fresh = any(u not in self._until for u in gpu_uuids)
            for u in gpu_uuids:
                self._until[u] = end
        return fresh

    def expire(self) -> bool:
        """Drop taints whose cool-down is over; True if any was dropped."""
        now = self._clock()
        with self._lock:
            gone = [u for u, end in self._until.items() if end <= now]
            for u in gone:
                del self._until[u]
        return bool(gone)

    def taints(self) -> Mapping[str, tuple[Mapping[str, str], ...]]:
        with self._lock:
            return {u: ({"key": self._key, "effect": "NoSchedule"},) for u in self._until}


class PreCarver:
    """Consumes claim events (`on_claim`, any thread) and carves on a small worker pool."""

    def __init__(
        self,
        *,
        preparer: ClaimPreparer,
        status: DeviceStatusWriter,
        contract: Contract,
        pool: str,
        gpu_uuids: Mapping[int, str],
        failures: CarveFailures,
        on_taints_changed: Callable[[], None] = lambda: None,
        workers: int = 4,
    ) -> None:
        self._preparer = preparer
        self._status = status
        self._contract = contract
        self._pool = pool
        self._gpu_uuids = dict(gpu_uuids)
        self.failures = failures
        self._on_taints_changed = on_taints_changed
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._release_due = threading.Event()
        self._pool_exec = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="precarve")

    def close(self) -> None:
        self._pool_exec.shutdown(wait=True)

    # -- events ---------------------------------------------------------------------------

    def on_claim(self, event: str, obj: Mapping[str, Any]) -> None:
        uid = ObjectView(obj).uid
        if event == "DELETED":
            self._maybe_release(uid)
            return
        try:
            target = carve_target(obj, contract=self._contract, pool=self._pool)
        except ClaimFormatError as e:
            view = ObjectView(obj)
            log.warning(
                "ignoring a claim carve cannot read",
                extra={"claim": f"{view.namespace}/{view.name}", "error": str(e)},
            )
            return
        if target is None:
            if not self._allocated_here(obj) or _deleted_unused(obj):
                self._maybe_release(uid)
            return
        with self._lock:
            if target.ref.uid in self._inflight:
                return
            self._inflight.add(target.ref.uid)
        self._pool_exec.submit(self._carve, target)

    def _allocated_here(self, obj: Mapping[str, Any]) -> bool:
        try:
            claim = parse_claim(obj)
        except ClaimFormatError:
            return True  # unreadable: never a reason to tear anything down
        return claim.allocated and any(
            r.pool == self._pool for r in claim.results_for(self._contract.driver)
        )

    def _maybe_release(self, uid: str) -> None:
        """A checkpointed claim that is gone or no longer allocated here: let the preparer's
        housekeeping decide (it reads the claim again and tears down only on a definite
        answer), now rather than at the next 30-second pass."""
        if uid and uid in self._preparer.checkpoint().claims:
            with self._lock:
                if uid in self._inflight:
                    return
            self._pool_exec.submit(self._release)

    def _release(self) -> None:
        try:
            self._preparer.retry_pending()
        except Exception as e:
            log.warning("releasing a claim not allocated here failed", extra={"error": str(e)})

    # -- the work -------------------------------------------------------------------------

    def _carve(self, target: CarveTarget) -> None:
        ctx = {"claim": f"{target.ref.namespace}/{target.ref.name}", "claimUID": target.ref.uid}
        try:
            result = self._preparer.prepare([target.ref])[target.ref.uid]
            if not result.error:
                verdict = Verdict(True, "Carved", self._carved_message(result))
                log.info("carved before bind", extra=ctx)
            else:
                if result.reason in ("claim-deleted", "not-allocated", "wrong-uid"):
                    log.info("claim changed before it was carved", extra=ctx)
                    return
                verdict = Verdict(False, _reason(result.reason), result.error)
                if result.reason in GPU_FAILURES:
                    self._taint(target)
                log.warning("carve before bind failed", extra={**ctx, "error": result.error})
            self._status.report(target, verdict)
        except (WriteSkippedError, ObjectGoneError) as e:
            log.info("claim changed before its verdict was written", extra={**ctx, "why": str(e)})
        except ApiError as e:
            log.warning("writing the device status failed", extra={**ctx, "error": str(e)})
        except Exception:
            log.exception("carve before bind failed unexpectedly", extra=ctx)
        finally:
            with self._lock:
                self._inflight.discard(target.ref.uid)

    def _carved_message(self, result: PrepareResult) -> str:
        names = ", ".join(d.device_name for d in result.devices)
        return f"MIG instance(s) carved for {names}; the pod may bind"

    def _taint(self, target: CarveTarget) -> None:
        uuids = []
        for d in target.devices:
            try:
                minor = parse_device_name(d.device).minor
            except ValueError:
                continue
            if minor in self._gpu_uuids:
                uuids.append(self._gpu_uuids[minor])
        if self.failures.add(uuids):
            # Before the verdict: the re-plan that follows must already see the taint.
            self._on_taints_changed()

    def expire_taints(self) -> None:
        if self.failures.expire():
            self._on_taints_changed()


def _deleted_unused(obj: Mapping[str, Any]) -> bool:
    """Being deleted with no pod reserved for it: carved for a pod that went before its
    binding, which the kubelet will never unprepare."""
    try:
        claim = parse_claim(obj)
    except ClaimFormatError:
        return False
    return claim.deleting and not claim.reserved_for


def _reason(prepare_reason: str) -> str:
    """A condition reason (CamelCase) from a prepare failure's short cause."""
    words = [w for w in prepare_reason.replace("_", "-").split("-") if w]
    return "".join(w[:1].upper() + w[1:] for w in words) or "CarveFailed"


class PreCarve:
    """The claim watch feeding the carver; what the node agent starts and stops."""

    def __init__(self, watch: ClaimWatch, carver: PreCarver) -> None:
        self.watch = watch
        self.carver = carver

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()
        self.carver.close()


def build_precarve(
    api: KubeJson,
    preparer: ClaimPreparer,
    *,
    driver: str,
    node: str,
    gpu_uuids: Mapping[int, str],
    cooldown: float,
    publish_now: Callable[[], None],
) -> PreCarve:
    contract = Contract(driver)
    carver = PreCarver(
        preparer=preparer,
        status=KubernetesDeviceStatus(api, contract),
        contract=contract,
        pool=node,
        gpu_uuids=gpu_uuids,
        failures=CarveFailures(contract.carve_failed_taint_key, cooldown),
        on_taints_changed=publish_now,
    )
    return PreCarve(ClaimWatch(api, carver.on_claim), carver)
