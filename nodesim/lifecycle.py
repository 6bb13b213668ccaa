"""What a kubelet decides about one pod, as pure functions over the pod's JSON (test tooling).

The node agent (`nodesim.node_agent`) does the I/O; everything here is a function of API objects
and clock values, so the rules a simulated node follows can be read and tested in one place:

- which ResourceClaims a pod uses and whether they are ready for it (allocated, reserved for it),
- how long a pod's containers "run" (an annotation, or a `sleep N` command),
- the pod status a kubelet would post when containers start, finish, or cannot be created,
- how a CDI device ID is resolved to the device's container edits in the specs on disk.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.apiobject import Obj
from kubeletplugin.ports import ClaimRef

# How long the containers of a pod run before exiting 0; absent = until the pod is deleted.
RUN_SECONDS_ANNOTATION = "nodesim.carve.dev/run-seconds"
# Exit code the containers end with (non-zero makes the pod Failed); default 0.
EXIT_CODE_ANNOTATION = "nodesim.carve.dev/exit-code"

_SLEEP = re.compile(r"^\s*(?:exec\s+)?sleep\s+(\d+(?:\.\d+)?)s?\s*$")


class ClaimsNotReadyError(Exception):
    """The pod's claims cannot be prepared yet (not created, allocated, or reserved); retry."""


class PodSpecError(ValueError):
    """The pod cannot be started as written (bad annotation, claim for an unknown driver)."""


@dataclass(frozen=True)
class PodClaim:
    """One claim of a pod: the pod-level entry name and the claim to prepare."""

    entry: str
    ref: ClaimRef
    drivers: tuple[str, ...]


@dataclass(frozen=True)
class ContainerEdits:
    """What the container runtime would apply for a pod's CDI devices (env, device nodes)."""

    cdi_ids: tuple[str, ...]
    env: tuple[str, ...]
    device_nodes: tuple[str, ...]
    spec_files: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "cdiDeviceIDs": list(self.cdi_ids),
            "env": list(self.env),
            "deviceNodes": list(self.device_nodes),
            "specFiles": list(self.spec_files),
        }


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def pod_uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def is_deleting(pod: Mapping[str, Any]) -> bool:
    return (pod.get("metadata") or {}).get("deletionTimestamp") is not None


def run_seconds(pod: Mapping[str, Any]) -> float | None:
    """How long the pod's containers run; None = they run until the pod is deleted.

    The annotation wins; otherwise a pod whose every container runs `sleep N` (directly or via
    `sh -c`) runs for the longest N. Anything else is treated as a long-running server.
    """
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(RUN_SECONDS_ANNOTATION)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            raise PodSpecError(
                f"annotation {RUN_SECONDS_ANNOTATION}={raw!r} is not a number of seconds"
            ) from None
        if value < 0:
            raise PodSpecError(f"annotation {RUN_SECONDS_ANNOTATION} must not be negative")
        return value
    containers = (pod.get("spec") or {}).get("containers") or []
    durations = [_sleep_seconds(c) for c in containers]
    if not durations or any(d is None for d in durations):
        return None
    return max(d for d in durations if d is not None)


def _sleep_seconds(container: Mapping[str, Any]) -> float | None:
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    if len(argv) == 2 and argv[0] in ("sleep", "/bin/sleep"):
        m = _SLEEP.match(" ".join(argv))
    elif len(argv) == 3 and argv[0] in ("sh", "/bin/sh", "bash", "/bin/bash") and argv[1] == "-c":
        m = _SLEEP.match(argv[2])
    else:
        return None
    return float(m.group(1)) if m else None


def exit_code(pod: Mapping[str, Any]) -> int:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(EXIT_CODE_ANNOTATION, "0")
    try:
        return int(raw)
    except ValueError:
        raise PodSpecError(f"annotation {EXIT_CODE_ANNOTATION}={raw!r} is not an integer") from None


EXTENDED_RESOURCES_ENTRY = "<extended-resources>"
"""The entry name a pod's extended-resource claim is listed under (it has none in the spec)."""


def claim_names(pod: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """(pod entry name, ResourceClaim name or None while kube-controller-manager has not made it).

    A template's claim name is only known from `status.resourceClaimStatuses`; a null name there
    means the entry needs no claim (kube-controller-manager decided so), and it is skipped.
    """
    spec_entries = (pod.get("spec") or {}).get("resourceClaims") or []
    statuses = {
        s.get("name"): s for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    out: list[tuple[str, str | None]] = []
    for entry in spec_entries:
        name = str(entry.get("name", ""))
        if entry.get("resourceClaimName"):
            out.append((name, str(entry["resourceClaimName"])))
        elif name in statuses:
            claim = statuses[name].get("resourceClaimName")
            if claim:
                out.append((name, str(claim)))
        else:
            out.append((name, None))
    # Like the kubelet (pkg/kubelet/cm/dra, DRAExtendedResource): the claim kube-scheduler made
    # for the pod's extended resources is prepared with the pod's own claims.
    extended = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get(
        "resourceClaimName"
    )
    if extended:
        out.append((EXTENDED_RESOURCES_ENTRY, str(extended)))
    return out


def pod_claims(pod: Mapping[str, Any], claims: Mapping[str, Mapping[str, Any]]) -> list[PodClaim]:
    """The claims to prepare for `pod`, checked as the kubelet checks them.

    `claims` maps claim name -> ResourceClaim JSON (in the pod's namespace). Raises
    ClaimsNotReadyError when a claim is missing, unallocated, or not reserved for this pod (the
    kubelet refuses to start a pod for which the claim is not reserved).
    """
    uid = pod_uid(pod)
    out: list[PodClaim] = []
    for entry, name in claim_names(pod):
        if name is None:
            raise ClaimsNotReadyError(f"claim for entry {entry!r} has not been created yet")
        claim = claims.get(name)
        if claim is None:
            raise ClaimsNotReadyError(f"ResourceClaim {name} not found")
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        allocation = status.get("allocation")
        if not allocation:
            raise ClaimsNotReadyError(f"ResourceClaim {name} is not allocated")
        reserved = {str(r.get("uid")) for r in status.get("reservedFor") or []}
        if uid not in reserved:
            raise ClaimsNotReadyError(f"ResourceClaim {name} is not reserved for this pod")
        results = (allocation.get("devices") or {}).get("results") or []
        drivers = tuple(sorted({str(r.get("driver")) for r in results}))
        out.append(
            PodClaim(
                entry=entry,
                ref=ClaimRef(str(meta.get("namespace")), name, str(meta.get("uid"))),
                drivers=drivers,
            )
        )
    return out


# -- pod status ----------------------------------------------------------------------------------


def _stamp(at: dt.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def fake_pod_ip(uid: str) -> str:
    """A stable, unique-enough pod IP in 10.244.0.0/16 derived from the pod's UID."""
    digest = hashlib.sha256(uid.encode()).digest()
    return f"10.244.{digest[0]}.{max(1, digest[1])}"


def _conditions(at: str, *, ready: bool, reason: str = "") -> list[Obj]:
    def cond(kind: str, status: bool) -> Obj:
        c: Obj = {"type": kind, "status": "True" if status else "False", "lastTransitionTime": at}
        if not status and reason:
            c["reason"] = reason
        return c

    return [
        cond("PodReadyToStartContainers", True),
        cond("Initialized", True),
        cond("ContainersReady", ready),
        cond("Ready", ready),
    ]


def _container_statuses(
    pod: Mapping[str, Any], state: Obj, *, running: bool, created: bool = True
) -> list[Obj]:
    """One status per container, all in `state`; a container never created has no ID."""
    uid = pod_uid(pod)
    statuses: list[Obj] = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        status: Obj = {"name": c.get("name"), "image": c.get("image", ""), "imageID": ""}
        if created:
            status["containerID"] = f"nodesim://{uid}-{c.get('name')}"
        status.update(ready=running, started=running, restartCount=0, state=state)
        statuses.append(status)
    return statuses


def running_status(pod: Mapping[str, Any], started: dt.datetime) -> Obj:
    """The status a kubelet posts once every container of `pod` runs."""
    at = _stamp(started)
    uid = pod_uid(pod)
    ip = fake_pod_ip(uid)
    return {
        "status": {
            "phase": "Running",
            "conditions": _conditions(at, ready=True),
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": at,
            "containerStatuses": _container_statuses(
                pod, {"running": {"startedAt": at}}, running=True
            ),
        }
    }


def finished_status(
    pod: Mapping[str, Any], started: dt.datetime, finished: dt.datetime, code: int
) -> Obj:
    """Every container exited with `code`; restartPolicy is not modelled (pods end)."""
    phase = "Succeeded" if code == 0 else "Failed"
    reason = "Completed" if code == 0 else "Error"
    return {
        "status": {
            "phase": phase,
            "conditions": _conditions(_stamp(finished), ready=False, reason="PodCompleted"),
            "containerStatuses": _container_statuses(
                pod,
                {
                    "terminated": {
                        "exitCode": code,
                        "reason": reason,
                        "startedAt": _stamp(started),
                        "finishedAt": _stamp(finished),
                    }
                },
                running=False,
            ),
        }
    }


def failed_to_start_status(pod: Mapping[str, Any], at: dt.datetime, message: str) -> Obj:
    """The pod could not start (prepare failed for good): Failed, with the plugin's message."""
    stamp = _stamp(at)
    return {
        "status": {
            "phase": "Failed",
            "reason": "FailedPrepareDynamicResources",
            "message": message,
            "conditions": _conditions(stamp, ready=False, reason="FailedPrepareDynamicResources"),
            "containerStatuses": _container_statuses(
                pod,
                {"waiting": {"reason": "FailedPrepareDynamicResources", "message": message}},
                running=False,
                created=False,
            ),
        }
    }


# -- CDI -----------------------------------------------------------------------------------------


class CdiResolutionError(Exception):
    """A CDI device ID the plugin returned has no spec on disk: the runtime would refuse it."""


def parse_cdi_id(cdi_id: str) -> tuple[str, str]:
    """`vendor/class=name` -> (kind, name)."""
    kind, sep, name = cdi_id.partition("=")
    if not sep or "/" not in kind or not name:
        raise CdiResolutionError(f"{cdi_id!r} is not a fully qualified CDI device ID")
    return kind, name


def load_cdi_specs(roots: Iterable[Path]) -> list[tuple[Path, Obj]]:
    """Every readable spec under the CDI roots (unreadable files are skipped as CDI does)."""
    specs: list[tuple[Path, Obj]] = []
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if path.suffix not in (".json", ".yaml") or path.name.startswith("."):
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                specs.append((path, data))
    return specs


def resolve_cdi(cdi_ids: Sequence[str], specs: Sequence[tuple[Path, Obj]]) -> ContainerEdits:
    """Merge the container edits of `cdi_ids` as the runtime would (spec-wide edits included)."""
    env: list[str] = []
    nodes: list[str] = []
    files: list[str] = []
    for cdi_id in cdi_ids:
        kind, name = parse_cdi_id(cdi_id)
        found = None
        for path, spec in specs:
            if spec.get("kind") != kind:
                continue
            for device in spec.get("devices") or []:
                if device.get("name") == name:
                    found = (path, spec, device)
                    break
            if found:
                break
        if found is None:
            raise CdiResolutionError(f"CDI device {cdi_id} is not defined by any spec on disk")
        path, spec, device = found
        for edits in (spec.get("containerEdits") or {}, device.get("containerEdits") or {}):
            env.extend(str(e) for e in edits.get("env") or [])
            nodes.extend(str(n.get("path")) for n in edits.get("deviceNodes") or [])
        if str(path) not in files:
            files.append(str(path))
    return ContainerEdits(
        cdi_ids=tuple(cdi_ids),
        env=tuple(dict.fromkeys(env)),
        device_nodes=tuple(dict.fromkeys(nodes)),
        spec_files=tuple(files),
    )
