"""The pods part of the API, and a kubelet that runs them, for the plugin's MPS daemon pods.

It stands in for the apiserver and the node's kubelet where the unit harness has neither (the
real ones run the same pods in tests/realnode/test_in_cluster.py): a pod created is run at
once as a local process, its container's command with its environment; its status says
whether that process runs; a deletion stops it (SIGTERM, SIGKILL after the grace period) and
the pod is gone once the process is, as the kubelet confirms a deletion only after the
container stopped. Every other request (events) is recorded and answered with its body.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from process.kube.errors import api_error

_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$")


@dataclass
class _Pod:
    obj: dict[str, Any]
    process: subprocess.Popen[bytes] | None  # None: its image cannot be pulled
    kill_at: float | None = None  # deleted: SIGKILL then


@dataclass
class FakeKubelet:
    """`unreachable` makes every request raise; images in `cannot_pull` never start;
    `confirm_deletions` False leaves deleted pods in place (a kubelet that does not answer);
    `on_delete` is called with the pod's name when a deletion is asked for."""

    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    unreachable: Exception | None = None
    cannot_pull: set[str] = field(default_factory=set)
    confirm_deletions: bool = True
    on_delete: Callable[[str], None] = lambda name: None
    _pods: dict[tuple[str, str], _Pod] = field(default_factory=dict)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if self.unreachable is not None:
            raise self.unreachable
        self.requests.append((method, path, body))
        m = _POD.match(path)
        if m is None:
            return dict(body) if isinstance(body, Mapping) else {}
        namespace, name = m.groups()
        if method == "POST" and name is None:
            return self._create(namespace, body)
        key = (namespace, name or "")
        pod = self._current(key)
        if pod is None:
            raise api_error(404, f'pods "{name}" not found')
        if method == "GET":
            return self._status(pod)
        if method == "DELETE":
            self.on_delete(key[1])
            grace = (body or {}).get("gracePeriodSeconds", 30)
            pod.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            if pod.process is not None and pod.process.poll() is None:
                pod.process.send_signal(signal.SIGTERM)
            pod.kill_at = time.monotonic() + grace
            return pod.obj
        raise AssertionError(f"unexpected {method} {path}")

    def _create(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if self._current((namespace, name)) is not None:
            raise api_error(409, f'pods "{name}" already exists')
        (container,) = body["spec"]["containers"]
        process = None
        if container["image"] not in self.cannot_pull:
            env = {e["name"]: e["value"] for e in container.get("env", ())}
            process = subprocess.Popen(
                container["command"],
                env={"PATH": os.environ["PATH"], **env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        obj = {**body, "metadata": {**body["metadata"], "uid": f"pod-{len(self.requests)}"}}
        self._pods[(namespace, name)] = _Pod(obj, process)
        return obj

    def _current(self, key: tuple[str, str]) -> _Pod | None:
        """The pod, or None once a deletion has been carried out."""
        pod = self._pods.get(key)
        if pod is None or pod.kill_at is None or not self.confirm_deletions:
            return pod
        if pod.process is not None and pod.process.poll() is None:
            if time.monotonic() < pod.kill_at:
                return pod
            pod.process.kill()
            pod.process.wait()
        del self._pods[key]
        return None

    def _status(self, pod: _Pod) -> dict[str, Any]:
        if pod.process is None:
            phase, state = "Pending", {"waiting": {"reason": "ErrImagePull", "message": "no"}}
        elif (code := pod.process.poll()) is None:
            phase, state = "Running", {"running": {}}
        else:
            phase = "Succeeded" if code == 0 else "Failed"
            state = {"terminated": {"exitCode": code, "reason": "Completed" if not code else ""}}
        (container,) = pod.obj["spec"]["containers"]
        status = {
            "phase": phase,
            "containerStatuses": [{"name": container["name"], "state": state}],
        }
        return {**pod.obj, "status": status}

    # -- for the tests ----------------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        pod = self._current((namespace, name))
        return None if pod is None else self._status(pod)

    def process(self, namespace: str, name: str) -> subprocess.Popen[bytes] | None:
        pod = self._current((namespace, name))
        return None if pod is None else pod.process

    def calls(self, method: str) -> list[str]:
        """The pod paths asked with `method`, in order."""
        return [p for m, p, _ in self.requests if m == method and _POD.match(p)]

    def close(self) -> None:
        for pod in self._pods.values():
            if pod.process is not None and pod.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.process.pid, signal.SIGKILL)
                pod.process.wait()
        self._pods.clear()
