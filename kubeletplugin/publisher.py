"""Keeps this node's ResourceSlices equal to what its GPUs offer.

The desired slices come from `driver.resourceslice` (pure); this module converges the apiserver
to them: create what is missing, replace what differs, delete what is no longer wanted. Every
change of content bumps the pool generation, and all slices of the pool carry the same
generation, because consumers use only the highest generation they see.

Two plugins that run with one node name (two machines given the same ``--node-name``) would
overwrite each other's slices forever, each with its own GPUs. Every slice names the process
that wrote it (annotation ``<driver>/publisher``, host name and a per-process id); a publisher
that finds a slice it wrote rewritten by another process stops writing, reports the conflict
on /readyz and in a Node event, and resumes only once no slice of another process is left (the
kubelet deletes a plugin's slices 30 s after it disappears). A restarted plugin is a new
process that has written nothing yet, so it takes its predecessor's slices over.

The kubelet deletes a node's slices when it starts and 30 s after a plugin disappears, so the
publisher resyncs periodically and on demand (`trigger()`, e.g. after registration), with
exponential backoff while the apiserver is unreachable. On uninstall (`--cleanup`, or SIGTERM
when configured) it deletes the node's slices for this driver.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import re
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from driver import contract
from driver.apiviews import ObjectView, SliceView
from kubeletplugin.metrics import PluginMetrics
from process.kube.errors import ApiError, NotFoundError
from process.kube.jsonclient import KubeJson
from process.kube.rmw import (
    ObjectGoneError,
    ObjectReplacedError,
    RetryPolicy,
    Target,
    read_modify_write,
)

log = logging.getLogger(__name__)

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
SPLIT_COUNTERS_SINCE = (1, 35)
# Conflicts on a slice are retried in place a few times; an outage is the retry loop's business.
_CONFLICTS = RetryPolicy(attempts=4)

SliceBuilder = Callable[[int, bool], list[dict[str, Any]]]
"""(pool generation, split counters) -> desired ResourceSlice manifests, each already named
(`driver.resourceslice.build_resource_slices` names them deterministically)."""


def parse_server_version(version: Mapping[str, Any]) -> tuple[int, int]:
    """(major, minor) from the apiserver's /version (minor may read "35+")."""
    major = re.match(r"\d+", str(version.get("major", "")))
    minor = re.match(r"\d+", str(version.get("minor", "")))
    if major and minor:
        return int(major.group()), int(minor.group())
    git = re.match(r"v(\d+)\.(\d+)", str(version.get("gitVersion", "")))
    if git:
        return int(git.group(1)), int(git.group(2))
    raise ValueError(f"cannot read a Kubernetes version from {dict(version)!r}")


def uses_split_counters(version: tuple[int, int]) -> bool:
    """From 1.35 counter sets must live in their own slice of the pool."""
    return version >= SPLIT_COUNTERS_SINCE


@dataclass(frozen=True)
class PublisherSettings:
    driver_name: str
    node_name: str
    resync_seconds: float = 30.0
    max_backoff_seconds: float = 60.0


class SlicePublisher:
    def __init__(
        self,
        settings: PublisherSettings,
        api: KubeJson,
        build: SliceBuilder,
        metrics: PluginMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._api = api
        self._build = build
        self._metrics = metrics or PluginMetrics()
        self._wake = threading.Event()
        self._sync_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._split: bool | None = None
        self.last_error: str = ""
        self.synced_once = threading.Event()
        self.identity = f"{socket.gethostname()}/{uuid.uuid4().hex[:12]}"
        self.conflict: str = ""  # why this publisher stopped writing; "" while it writes
        self._written: dict[str, str] = {}  # slice name -> resourceVersion of our last write
        self.on_conflict: Callable[[str], None] = lambda _message: None

    # -- API helpers --------------------------------------------------------------------------

    def _selector(self) -> str:
        return f"spec.nodeName={self._settings.node_name},spec.driver={self._settings.driver_name}"

    def existing(self) -> list[dict[str, Any]]:
        """This driver's slices on this node, as the apiserver has them."""
        listing = self._api.request("GET", SLICES_PATH, query=[("fieldSelector", self._selector())])
        items: list[dict[str, Any]] = listing.get("items") or []
        return items

    def split_counters(self) -> bool:
        if self._split is None:
            version = parse_server_version(self._api.request("GET", "/version"))
            self._split = uses_split_counters(version)
            log.info(
                "apiserver version detected",
                extra={"version": f"{version[0]}.{version[1]}", "splitCounters": self._split},
            )
        return self._split

    def _node_owner(self) -> list[dict[str, Any]]:
        """Owner reference to the Node, so slices go away with the node object."""
        try:
            node = self._api.request("GET", f"/api/v1/nodes/{self._settings.node_name}")
        except ApiError:
            return []
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self._settings.node_name,
                "uid": ObjectView(node).uid,
                "controller": True,
            }
        ]

    # -- convergence --------------------------------------------------------------------------

    def _hash_key(self) -> str:
        return f"{self._settings.driver_name}/content-hash"

    def _publisher_key(self) -> str:
        return f"{self._settings.driver_name}/publisher"

    def _contract_key(self) -> str:
        return contract.Contract(self._settings.driver_name).contract_version_key

    def _foreign(self, current: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
        """Slices another process wrote: name -> that process, for a conflict only those we
        wrote before (a slice left by a predecessor, or unannotated, is taken over)."""
        out = {}
        for name, obj in current.items():
            writer = ObjectView(obj).annotations.get(self._publisher_key())
            if writer and writer != self.identity:
                out[name] = str(writer)
        return out

    def _check_conflict(self, current: Mapping[str, Mapping[str, Any]]) -> bool:
        """True while another live process publishes for this node (see the module docstring)."""
        foreign = self._foreign(current)
        taken = {
            n: w
            for n, w in foreign.items()
            if n in self._written and ObjectView(current[n]).resource_version != self._written[n]
        }
        if taken and not self.conflict:
            writers = ", ".join(sorted(set(taken.values())))
            self.conflict = (
                f"another carve kubelet plugin ({writers}) rewrote this node's ResourceSlices "
                f"({', '.join(sorted(taken))}) that this one ({self.identity}) published: two "
                f"machines run with the node name {self._settings.node_name!r}; give each its own "
                "(--node-name); this plugin stops publishing until the other's slices are gone"
            )
            log.error("ResourceSlice conflict", extra={"error": self.conflict})
            self.on_conflict(self.conflict)
        if self.conflict and not foreign:
            log.info("no other publisher's ResourceSlices left; publishing again")
            self.conflict = ""
            self._written.clear()
        return bool(self.conflict)

    def _desired(
        self, generation: int, split: bool, owner: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for obj in self._build(generation, split):
            meta = dict(obj["metadata"])
            if owner:
                meta.setdefault("ownerReferences", owner)
            # The apiserver defaults fields, so the stored spec never compares equal to ours;
            # a hash of our own rendering (generation excluded) says whether content changed.
            meta["annotations"] = {
                **(meta.get("annotations") or {}),
                self._hash_key(): _content_hash(obj.get("spec") or {}),
                self._publisher_key(): self.identity,
            }
            # The contract this plugin speaks, read by the controller before it reads anything
            # else of the slice (docs/architecture.md, Version skew).
            meta["labels"] = {
                **(meta.get("labels") or {}),
                self._contract_key(): str(contract.CONTRACT_VERSION),
            }
            out.append({**obj, "metadata": meta})
        return out

    def sync(self) -> bool:
        """Converge once; True if anything was written. Safe from any thread: the loop and a
        caller that must see its change published before it goes on (precarve's taint)."""
        with self._sync_lock:
            return self._sync()

    def _sync(self) -> bool:
        split = self.split_counters()
        current = {ObjectView(s).name: s for s in self.existing()}
        if self._check_conflict(current):
            return False
        pool_generations = {SliceView(s).pool_generation for s in current.values()}
        generation = max(pool_generations, default=0)
        # Built once, already at the next generation: names and content hashes do not depend on
        # the generation, so the same objects answer "unchanged?" and are what gets written.
        wanted = {
            ObjectView(d).name: d for d in self._desired(generation + 1, split, self._node_owner())
        }
        unchanged = (
            set(current) == set(wanted)
            and len(pool_generations) == 1
            and not self._foreign(current)
            and all(
                ObjectView(current[n]).annotations.get(self._hash_key())
                == ObjectView(wanted[n]).annotations.get(self._hash_key())
                and ObjectView(current[n]).labels.get(self._contract_key())
                == ObjectView(wanted[n]).labels.get(self._contract_key())
                for n in wanted
            )
        )
        if unchanged:
            return False
        for name, d in wanted.items():
            if name in current:
                written = self._replace(current[name], d)
            else:
                written = self._api.request("POST", SLICES_PATH, body=d)
            self._written[name] = ObjectView(written).resource_version
        for name in set(current) - set(wanted):
            self._delete(name)
            self._written.pop(name, None)
        log.info(
            "ResourceSlices published",
            extra={"slices": len(wanted), "generation": generation + 1, "split": split},
        )
        return True

    def _replace(self, listed: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
        """PUT `desired` over a listed slice through `process.kube.rmw`: guarded by the listed
        resourceVersion, re-read and written again on a conflict (the slice is wholly ours, so
        the fresh copy only lends its resourceVersion). A slice the kubelet wiped meanwhile is
        created instead; any other failure ends this sync and the retry loop below starts over
        from a fresh listing, because the pool generation is decided over all slices at once."""
        view = ObjectView(listed)
        path = f"{SLICES_PATH}/{view.name}"
        target = Target(
            namespace="",
            name=view.name,
            uid=view.uid,
            read=lambda: self._api.request("GET", path),
            write=lambda body: self._api.request("PUT", path, body=body),
        )
        try:
            return read_modify_write(
                target, lambda _: copy.deepcopy(desired), current=listed, policy=_CONFLICTS
            )
        except ObjectReplacedError:
            raise
        except ObjectGoneError:
            return self._api.request("POST", SLICES_PATH, body=desired)

    def _delete(self, name: str) -> None:
        with contextlib.suppress(NotFoundError):  # already gone: what we wanted
            self._api.request("DELETE", f"{SLICES_PATH}/{name}")

    def cleanup(self) -> int:
        """Delete every slice of this driver on this node (uninstall); returns how many."""
        names = [ObjectView(s).name for s in self.existing()]
        for name in names:
            self._delete(name)
        log.info("ResourceSlices removed", extra={"slices": len(names)})
        return len(names)

    # -- background loop ----------------------------------------------------------------------

    def _sync_with_backoff(self) -> None:
        retrying = Retrying(
            retry=retry_if_exception_type(Exception),
            wait=wait_exponential_jitter(initial=0.5, max=self._settings.max_backoff_seconds),
            stop=stop_after_attempt(1_000_000),
            sleep=self._sleep_unless_stopped,
            reraise=True,
            before_sleep=self._log_retry,
        )
        for attempt in retrying:
            if self._stop.is_set():
                return
            with attempt:
                self.sync()
                self._metrics.slice_publish.labels(result="ok").inc()
                self.last_error = ""
                self.synced_once.set()

    def _sleep_unless_stopped(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise _StoppedError

    def _log_retry(self, state: Any) -> None:
        err = state.outcome.exception() if state.outcome else None
        self.last_error = str(err)
        self._metrics.slice_publish.labels(result="error").inc()
        log.warning("ResourceSlice sync failed; retrying", extra={"error": str(err)})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync_with_backoff()
            except _StoppedError:
                return
            except Exception:  # never let the loop die
                log.exception("ResourceSlice sync loop error")
            self._wake.wait(self._settings.resync_seconds)
            self._wake.clear()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="slice-publisher", daemon=True)
        self._thread.start()

    def trigger(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class _StoppedError(Exception):
    pass


def _content_hash(spec: Mapping[str, Any]) -> str:
    without_generation = {
        **spec,
        "pool": {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"},
    }
    text = json.dumps(without_generation, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
