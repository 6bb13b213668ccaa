"""MPS control daemons in pods of their own: one per claim, on the plugin's node.

Why pods: a daemon the plugin forks lives in the plugin's container, and goes with it: the
kernel kills a PID namespace with its init, and with ``hostPID`` containerd kills the
container's cgroup when its main process ends. A pod's daemon is the kubelet's to run, so
deleting, crashing or upgrading the plugin's pod leaves it and its clients alone, and the next
plugin finds it by its name (docs/kubeletplugin.md, "Where the daemons run").

The pod, ``carve-mps-<claim UID>`` in the plugin's namespace (``--mps-daemon-namespace``), is
bound to this node by ``spec.nodeName`` (no scheduler, no gate) and runs carve's own image
(``--mps-daemon-image``, already on the node) with ``<binary> -f`` as its only process. It
mounts the claim's MPS directory, the driver root, the dev root and /dev at their host paths,
so the binary and the pipe and log directories are where the plugin sees them, and it is
privileged for the same reason the plugin is: the daemon opens the GPU's device nodes.
``restartPolicy: Never``: a daemon that ends is started again by the plugin, which sends it the
claim's settings and says so (an Event on the claim); a kubelet restart would bring it back
without them.

It runs as ``--mps-daemon-service-account`` (the chart's ``carve-mps-daemon``, which holds no
API rights) with no token mounted: a daemon needs no API.

The plugin's service account may create, read and delete pods in its own namespace only, and
a ValidatingAdmissionPolicy of the chart admits only this pod, field by field: on its own node,
this image and command, that service account, no token, no env from secrets, only the host
paths above, no host namespaces (deploy/helm/carve/templates/22-rbac-plugin-mps.yaml). A stolen
plugin token cannot turn a daemon pod into a way off its node.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from driver.apiviews import PodView
from kubeletplugin.checkpoint import MpsDaemon
from kubeletplugin.mps import MpsError
from process.kube.errors import NotFoundError
from process.kube.jsonclient import KubeJson

POD_PREFIX = "carve-mps-"
CONTAINER = "mps-control-daemon"
APP = "carve-mps-daemon"  # app.kubernetes.io/name of every daemon pod
# Waiting reasons after which the container will not start without someone changing something.
_CANNOT_START = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


@dataclass(frozen=True)
class PodSettings:
    namespace: str
    image: str
    node_name: str
    driver_name: str
    pull_policy: str = "IfNotPresent"
    service_account: str = ""  # "": the namespace's default
    driver_root: Path = Path("/")
    dev_root: Path = Path("/")
    start_timeout: float = 120.0  # pulling the image may be part of it
    priority_class: str = "system-node-critical"


def _container_state(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for c in PodView(pod).container_statuses:
        if c.get("name") == CONTAINER:
            state: Mapping[str, Any] = c.get("state") or {}
            return state
    return {}


class DaemonPods:
    """Daemons as pods of their own (see the module); the records name their pod."""

    poll_seconds = 0.25

    def __init__(self, api: KubeJson, settings: PodSettings, *, gone_timeout: float = 60.0):
        self._api = api
        self._settings = settings
        self._gone_timeout = gone_timeout
        self.start_timeout: float | None = settings.start_timeout

    def intent(self, d: MpsDaemon, claim_uid: str) -> MpsDaemon:
        return replace(d, pid=None, pod=f"{self._settings.namespace}/{POD_PREFIX}{claim_uid}")

    def _where(self, d: MpsDaemon) -> tuple[str, str]:
        assert d.pod is not None, "a pod daemon's record names its pod"
        namespace, _, name = d.pod.partition("/")
        return namespace, name

    def manifest(self, binary: Path, d: MpsDaemon, env: Mapping[str, str]) -> dict[str, Any]:
        """The daemon's pod (see the module for why each part is there)."""
        namespace, name = self._where(d)
        claim_dir = str(Path(d.pipe_dir).parent)
        mounts = {claim_dir: False, "/dev": False}
        if self._settings.driver_root != Path("/"):
            mounts[str(self._settings.driver_root)] = True
        if self._settings.dev_root not in (Path("/"), self._settings.driver_root):
            mounts[str(self._settings.dev_root)] = False
        volumes = [(f"host-{i}", path, ro) for i, (path, ro) in enumerate(mounts.items())]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {
                    "app.kubernetes.io/name": APP,
                    "app.kubernetes.io/component": "mps-control-daemon",
                    "app.kubernetes.io/managed-by": "carve-kubelet-plugin",
                    f"{self._settings.driver_name}/claim-uid": name.removeprefix(POD_PREFIX),
                },
                "annotations": {f"{self._settings.driver_name}/node": self._settings.node_name},
            },
            "spec": {
                "nodeName": self._settings.node_name,
                "restartPolicy": "Never",
                "priorityClassName": self._settings.priority_class,
                "tolerations": [{"operator": "Exists"}],
                **(
                    {"serviceAccountName": self._settings.service_account}
                    if self._settings.service_account
                    else {}
                ),
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": CONTAINER,
                        "image": self._settings.image,
                        "imagePullPolicy": self._settings.pull_policy,
                        "command": [str(binary), "-f"],
                        "env": [{"name": k, "value": v} for k, v in env.items() if k != "PATH"],
                        # The image runs as a user of its own; the daemon makes its FIFOs
                        # in directories the plugin (root) made.
                        "securityContext": {"privileged": True, "runAsUser": 0},
                        # What it said before it failed reaches the prepare's error, though
                        # the pod is deleted with the claim's rollback.
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                        "volumeMounts": [
                            {"name": v, "mountPath": path, "readOnly": ro}
                            for v, path, ro in volumes
                        ],
                    }
                ],
                "volumes": [
                    {"name": v, "hostPath": {"path": path, "type": "Directory"}}
                    for v, path, _ in volumes
                ],
            },
        }

    def launch(self, binary: Path, d: MpsDaemon, env: Mapping[str, str]) -> MpsDaemon:
        namespace, _ = self._where(d)
        try:
            self._api.request(
                "POST", f"/api/v1/namespaces/{namespace}/pods", body=self.manifest(binary, d, env)
            )
        except Exception as e:
            raise MpsError(f"creating pod {d.pod}: {e}") from e
        return d

    def _get(self, d: MpsDaemon) -> Mapping[str, Any] | None:
        namespace, name = self._where(d)
        try:
            return self._api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except NotFoundError:
            return None
        except Exception as e:
            raise MpsError(f"reading pod {d.pod}: {e}") from e

    def running(self, d: MpsDaemon) -> bool:
        pod = self._get(d)
        if pod is None or PodView(pod).deleting:
            return False
        return "running" in _container_state(pod)

    def failed(self, d: MpsDaemon) -> str | None:
        try:
            pod = self._get(d)
        except MpsError:
            return None  # the API may answer again before the deadline
        if pod is None:
            return f"pod {d.pod} is gone"
        view = PodView(pod)
        if view.deleting:
            return f"pod {d.pod} is being deleted"
        state = _container_state(pod)
        phase = view.phase
        if view.terminal or "terminated" in state:
            ended = state.get("terminated") or {}
            said = " ".join(str(ended.get("message", "")).split())[-500:]
            return (
                f"pod {d.pod} ended: exit code {ended.get('exitCode', '?')} "
                f"({ended.get('reason', phase)})" + (f": {said}" if said else "")
            )
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in _CANNOT_START:
            return (
                f"pod {d.pod} cannot start its container: {waiting['reason']}: "
                f"{waiting.get('message', '')}".strip()
            )
        return None

    def terminate(self, d: MpsDaemon, grace: float) -> None:
        namespace, name = self._where(d)
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        try:
            self._api.request(
                "DELETE",
                path,
                body={
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": int(grace),
                },
            )
        except NotFoundError:
            pass  # already gone
        except Exception as e:
            raise MpsError(f"deleting pod {d.pod}: {e}") from e
        # Gone from the API only once the kubelet has stopped its container: before that the
        # daemon may still hold the slices.
        limit = grace + self._gone_timeout
        deadline = time.monotonic() + limit
        while self._get(d) is not None:
            if time.monotonic() > deadline:
                raise MpsError(
                    f"pod {d.pod} was deleted but is still there after {limit:.0f}s: the "
                    f"kubelet of node {self._settings.node_name} has not confirmed that its "
                    "container stopped"
                )
            time.sleep(self.poll_seconds)
