"""The scale benchmark's pods: their claim templates and manifests, and a watch-fed tracker of
when each was created, placed (carve's gate gone) and bound (kube-scheduler set its node)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from driver.contract import DEFAULT_CONTRACT

PROFILES = ("1g", "1g", "2g", "3g")
_ATTRS = f'device.attributes["{DEFAULT_CONTRACT.driver}"]'
_GATE = DEFAULT_CONTRACT.scheduling_gate
CARVE_TEMPLATES = "slice-"
NATIVE_TEMPLATES = "native-"


# -- pods --------------------------------------------------------------------------------------


def claim_template(
    profile: str, device_class: str = DEFAULT_CONTRACT.mig_class, prefix: str = CARVE_TEMPLATES
) -> dict[str, Any]:
    """A template for one slice of `profile`, of carve's class (or another: the native arm's)."""
    selector = {"cel": {"expression": f'{_ATTRS}.profile.startsWith("{profile}.")'}}
    request = {"deviceClassName": device_class, "selectors": [selector]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{prefix}{profile}"},
        "spec": {"spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}}},
    }


def pod_manifest(name: str, profile: str, prefix: str = CARVE_TEMPLATES) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": f"{prefix}{profile}"}],
            "containers": [
                {
                    "name": "work",
                    "image": "registry.invalid/bench:never-pulled",
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "128Mi"},
                        "claims": [{"name": "mig"}],
                    },
                }
            ],
        },
    }


@dataclass
class _PodTimes:
    created: float = math.nan
    placed: float = math.nan
    bound: float = math.nan
    node: str = ""


@dataclass
class PodTracker:
    """Watch-fed times at which each bench pod was created, placed (gate gone) and bound."""

    pods: dict[str, _PodTimes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def created(self, name: str, when: float) -> None:
        with self.lock:
            self.pods.setdefault(name, _PodTimes()).created = when

    def on_pod(self, _kind: Any, type_: Any, obj: dict[str, Any]) -> None:
        now = time.monotonic()
        if str(type_) == "DELETED":
            return
        name = obj["metadata"]["name"]
        spec = obj.get("spec") or {}
        gates = {g.get("name") for g in spec.get("schedulingGates") or []}
        with self.lock:
            times = self.pods.setdefault(name, _PodTimes())
            if _GATE not in gates and math.isnan(times.placed):
                times.placed = now
            if spec.get("nodeName") and math.isnan(times.bound):
                times.bound = now
                times.node = str(spec["nodeName"])

    def snapshot(self) -> dict[str, _PodTimes]:
        with self.lock:
            return {
                k: _PodTimes(v.created, v.placed, v.bound, v.node) for k, v in self.pods.items()
            }
