"""Leader election on a coordination.k8s.io/v1 Lease, so only one controller replica allocates.

The algorithm is the one client-go uses, written for this controller:
- a candidate trusts only its own monotonic clock: a lease held by someone else is considered
  expired when *we* have not seen its record change for `lease_duration`, whatever timestamps the
  record carries (so clock skew between replicas cannot make two leaders);
- every write is a PUT with the lease's resourceVersion, so two candidates racing for an expired
  lease cannot both win;
- the leader renews every `retry_period` and gives up (fences itself) when it could not renew for
  `renew_deadline`, which is shorter than `lease_duration`: it stops writing before anyone else may
  take over;
- every lease request times out after `renew_deadline` (client-go bounds each renewal by it),
  so a half-open connection cannot keep the election thread from noticing that it lost;
- a renewal counts from the moment its round began, before any request was sent, never from
  when the answer came: others measure the lease from when they saw it change, which is after
  the write was sent, so a late answer cannot stretch our term past theirs;
- a leader whose decision loop has stopped making progress (`alive`, the loop's heartbeat)
  stops renewing and says so: a wedged loop must not keep the lease, which would stop every
  placement in the cluster while the process looks alive.

`is_leader()` is the fence that the reconciler and the claim writer check before each write.

A graceful hand-over follows client-go's ReleaseOnCancel rule: the lease may be released only
once nothing it guards can still happen. `close_fence()` stops every new write at once while
the lease is still renewed; the caller drains the writes in flight; then `stop(release=True)`
hands the lease back, or `stop(release=False)` (writes still in flight) lets it expire, so a
successor never decides while an old write can still land.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from driver import contract
from process.kube import Obj
from process.kube.errors import status_of
from process.kube.events import micro_time
from process.kube.jsonclient import JsonRequests

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    name: str = "carve-controller"
    namespace: str = "carve-system"
    identity: str = "carve-controller"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    # Whose contract version the lease declares (`Contract.contract_version_key`), for the
    # plugins to check theirs against (docs/architecture.md, Version skew).
    driver_name: str = contract.DEFAULT_DRIVER_NAME

    def __post_init__(self) -> None:
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs retry period < renew deadline < lease duration, got "
                f"{self.retry_period_s} / {self.renew_deadline_s} / {self.lease_duration_s}"
            )


def may_take(
    spec: Obj, identity: str, observed_at: float, now: float, lease_duration_s: float
) -> bool:
    """Whether `identity` may write itself into a lease whose spec is `spec`.

    `observed_at` is our monotonic time when the record last changed (not the record's own
    renewTime, which another replica's clock wrote).
    """
    holder = spec.get("holderIdentity") or ""
    if not holder or holder == identity:
        return True
    duration = float(spec.get("leaseDurationSeconds") or lease_duration_s)
    return now - observed_at >= duration


class LeaderElector:
    def __init__(
        self,
        api: JsonRequests,
        config: LeaseConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        alive: Callable[[], str] = lambda: "",
    ) -> None:
        """`alive`: "" while the work the lease guards makes progress, else why not."""
        self._api = api
        self._alive = alive
        self._cfg = config
        self._path = (
            f"/apis/coordination.k8s.io/v1/namespaces/{config.namespace}/leases/{config.name}"
        )
        self._clock = clock
        self._wall = wall_clock
        self._observed_spec: Obj | None = None
        self._observed_at = 0.0
        self._last_renew: float | None = None
        self._stop = threading.Event()
        self._fenced = False
        self._timeout = config.renew_deadline_s
        # Held by each election round, so `stop` never releases under a round that could
        # then write the lease back.
        self._round = threading.Lock()

    # -- fence -----------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        return not self._fenced and self._holds()

    def _holds(self) -> bool:
        """Renewed within the renew deadline (fenced or not)."""
        last = self._last_renew
        return last is not None and self._clock() - last < self._cfg.renew_deadline_s

    def close_fence(self) -> None:
        """Stop every write from now on; the lease is still renewed until `stop`."""
        self._fenced = True

    # -- one attempt -----------------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One round of the election; True when we hold the lease after it."""
        with self._round:
            if self._stop.is_set():
                return False
            return self._one_round()

    def _one_round(self) -> bool:
        cfg = self._cfg
        started = self._clock()  # a renewal counts from here (see the module)
        now_wall = micro_time(self._wall())
        try:
            lease = self._api.request("GET", self._path, timeout=self._timeout)
        except Exception as exc:
            if status_of(exc) != 404:
                _log.warning("reading lease %s/%s failed: %s", cfg.namespace, cfg.name, exc)
                return False
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": cfg.name,
                    "namespace": cfg.namespace,
                    "annotations": self._declaration(),
                },
                "spec": self._spec_for({}, now_wall),
            }
            try:
                self._api.request(
                    "POST", self._path.rsplit("/", 1)[0], body=body, timeout=self._timeout
                )
            except Exception as create_exc:
                _log.info("creating lease failed (%s); another candidate won", create_exc)
                return False
            self._won(started)
            return True
        spec = lease.get("spec") or {}
        if spec != self._observed_spec:
            self._observed_spec = spec
            self._observed_at = self._clock()
        if not may_take(spec, cfg.identity, self._observed_at, self._clock(), cfg.lease_duration_s):
            self._last_renew = None
            return False
        lease["spec"] = self._spec_for(spec, now_wall)
        meta = lease.setdefault("metadata", {})
        meta["annotations"] = {**(meta.get("annotations") or {}), **self._declaration()}
        try:
            fresh = self._api.request("PUT", self._path, body=lease, timeout=self._timeout)
        except Exception as exc:
            _log.info("writing lease failed (%s)", exc)
            return False
        self._observed_spec = fresh.get("spec") or {}
        self._observed_at = self._clock()
        self._won(started)
        return True

    def _declaration(self) -> dict[str, str]:
        """The annotation that declares the contract version this controller speaks, written
        with every acquire and renewal (no request of its own); read now, so a test can bump
        `driver.contract.CONTRACT_VERSION`."""
        key = contract.Contract(self._cfg.driver_name).contract_version_key
        return {key: str(contract.CONTRACT_VERSION)}

    def _spec_for(self, current: Obj, now_wall: str) -> Obj:
        cfg = self._cfg
        ours = current.get("holderIdentity") == cfg.identity
        transitions = int(current.get("leaseTransitions") or 0)
        return {
            "holderIdentity": cfg.identity,
            "leaseDurationSeconds": int(cfg.lease_duration_s),
            "acquireTime": current.get("acquireTime") if ours else now_wall,
            "renewTime": now_wall,
            "leaseTransitions": transitions if ours or not current else transitions + 1,
        }

    def _won(self, started: float) -> None:
        if self._last_renew is None:
            _log.info("became leader as %s", self._cfg.identity)
        self._last_renew = started

    # -- loop ------------------------------------------------------------------------------------

    def run(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        """Campaign until elected, call `on_started`, renew; call `on_stopped` once lost."""
        while not self._stop.is_set():
            if self.try_acquire_or_renew():
                break
            self._stop.wait(self._cfg.retry_period_s)
        if self._stop.is_set():
            return
        on_started()
        while not self._stop.wait(self._cfg.retry_period_s):
            stalled = self._alive()
            if stalled:
                # Not released: writes of this term may still be in flight; it expires.
                _log.error("giving up the lease: %s", stalled)
                self._fenced = True
                self._last_renew = None
                on_stopped()
                return
            self.try_acquire_or_renew()
            if not self._holds() and not self._stop.is_set():
                _log.error("lost the lease (could not renew within the renew deadline)")
                on_stopped()
                return

    def stop(self, release: bool = True) -> None:
        """Stop campaigning and renewing; with `release`, hand the lease back so a successor
        need not wait for it to expire. Release only once no write of this term can land
        (`close_fence`, then drain, then this)."""
        self._fenced = True
        self._stop.set()
        with self._round:  # a round in progress ends first; none starts after
            if release and self._holds():
                self._release()
            self._last_renew = None

    def _release(self) -> None:
        cfg = self._cfg
        try:
            lease = self._api.request("GET", self._path, timeout=self._timeout)
            if (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            self._api.request("PUT", self._path, body=lease, timeout=self._timeout)
        except Exception as exc:
            _log.warning("releasing the lease failed: %s", exc)
