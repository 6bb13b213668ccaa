"""Per-test view of the end-to-end environment: its own namespace, its own simulated nodes
(selected by a label every pod of the test carries as nodeSelector, so tests sharing the
control plane and the controller never land on each other's GPUs), builders and waits."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.slicereader import parse_resource_slices
from nodesim.invariants import allocated_devices, at_rest, leaks, overlaps
from nodesim.lifecycle import claim_names
from nodesim.simnode import DRIVER, SimNode, SimNodeSpec
from nodesim.stack import CarveStack, gates_pod
from process.kube.jsonclient import KubeJson

GROUP_LABEL = "e2e.carve.dev/group"
NATIVE_CLASS = "e2e-native-mig"
GATED_NAMESPACES = {"e2e.carve.dev/gated": "on"}


def cel(expression: str) -> Obj:
    return {"cel": {"expression": expression}}


def profile_is(prefix: str) -> Obj:
    return cel(f'device.attributes["{DRIVER}"].profile.startsWith("{prefix}")')


def request(
    name: str, selectors: Sequence[Obj] = (), *, device_class: str = "mig.carve.dev", count=1
) -> Obj:
    exactly: Obj = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = list(selectors)
    if count != 1:
        exactly["count"] = count
    return {"name": name, "exactly": exactly}


def first_available(name: str, options: Sequence[tuple[str, Sequence[Obj]]]) -> Obj:
    return {
        "name": name,
        "firstAvailable": [
            {"name": sub, "deviceClassName": "mig.carve.dev", "selectors": list(sels)}
            for sub, sels in options
        ],
    }


def _devices(requests: Sequence[Obj], constraints: Sequence[Obj], config: Sequence[Obj]) -> Obj:
    devices: Obj = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = list(constraints)
    if config:
        devices["config"] = list(config)
    return devices


class E2E:
    def __init__(
        self,
        stack: CarveStack,
        test_name: str,
        namespace_labels: Mapping[str, str] = GATED_NAMESPACES,
    ) -> None:
        slug = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:28].strip("-")
        self.stack = stack
        self.group = f"{slug}-{uuid.uuid4().hex[:5]}"
        self.namespace = f"e2e-{self.group}"
        self.core = client.CoreV1Api(stack.api)
        self.resource = client.ResourceV1Api(stack.api)
        self.apps = client.AppsV1Api(stack.api)
        self.nodes: dict[str, SimNode] = {}
        self.core.create_namespace(
            {"metadata": {"name": self.namespace, "labels": dict(namespace_labels)}}
        )
        wait_for(
            "the namespace's default ServiceAccount",
            lambda: self._exists(
                lambda: self.core.read_namespaced_service_account("default", self.namespace)
            ),
            timeout=60.0,
        )

    @staticmethod
    def _exists(call: Callable[[], Any]) -> bool:
        try:
            call()
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    # -- nodes ---------------------------------------------------------------------------------

    def node(self, suffix: str, *gpus: str, **fields: Any) -> SimNode:
        labels = {GROUP_LABEL: self.group, **fields.pop("labels", {})}
        spec = SimNodeSpec(name=f"{self.group}-{suffix}"[:63], gpus=gpus, labels=labels, **fields)
        node = self.stack.add_node(spec)
        self.nodes[node.name] = node
        self.wait_slices_published(node.name)
        return node

    def wait_slices_published(self, node: str, timeout: float = 30.0) -> None:
        """Until the node's pool is complete: the plugin writes a pool's slices one request at
        a time, and a pool read half-way (some GPUs' devices, not yet the others') is one
        that `parse_resource_slices`, like every consumer, refuses."""

        def published() -> bool:
            resp = self.resource.list_resource_slice(
                field_selector=f"spec.nodeName={node}", _preload_content=False
            )
            items = json.loads(resp.data)["items"]
            try:
                return bool(parse_resource_slices(items, self.stack.contract.driver))
            except ValueError:
                return False

        wait_for(f"ResourceSlices of {node}", published, timeout)

    # -- objects -------------------------------------------------------------------------------

    def template(
        self,
        name: str,
        requests: Sequence[Obj],
        constraints: Sequence[Obj] = (),
        gated=True,
        config: Sequence[Obj] = (),
    ) -> None:
        devices = _devices(requests, constraints, config)
        self._create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {"spec": {"devices": devices}},
            },
        )
        if gated:
            self.wait_gate_sees({"resourceClaimTemplateName": name})

    def claim(
        self,
        name: str,
        requests: Sequence[Obj],
        constraints: Sequence[Obj] = (),
        config: Sequence[Obj] = (),
    ) -> None:
        devices = _devices(requests, constraints, config)
        self._create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": devices},
            },
        )
        self.wait_gate_sees({"resourceClaimName": name})

    def _create(self, body: Obj) -> None:
        """Create a claim or template. With opaque config, through kubectl as compact JSON, as
        users' tools send it: the Python client's JSON has whitespace, and kube-apiserver then
        refuses every later metadata change to the claim (carve's finalizer included;
        docs/controller.md)."""
        devices = body["spec"].get("devices") or body["spec"]["spec"]["devices"]
        if not devices.get("config"):
            if body["kind"] == "ResourceClaim":
                self.resource.create_namespaced_resource_claim(self.namespace, body)
            else:
                self.resource.create_namespaced_resource_claim_template(self.namespace, body)
            return
        compact = json.dumps(body, separators=(",", ":"))
        self.stack.kubectl("create", "-n", self.namespace, "-f", "-", input=compact)

    def wait_gate_sees(self, ref: Obj) -> None:
        """The admission policy reads claims and templates from the apiserver's cache; a pod
        created before the cache has the object would not be gated. Dry-run until it is."""
        api = KubeJson(self.stack.api)
        wait_for(
            f"the admission gate to see {ref}",
            lambda: gates_pod(api, self.namespace, ref, self.stack.contract.scheduling_gate),
            timeout=20,
        )

    def pod_manifest(
        self,
        name: str,
        claims: Mapping[str, Obj],
        *,
        run_seconds: float | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Obj:
        resources: Obj = {"claims": [{"name": entry} for entry in claims]}
        requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
        if requests:
            resources["requests"] = requests
        annotations = {}
        if run_seconds is not None:
            annotations["nodesim.carve.dev/run-seconds"] = str(run_seconds)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations, "labels": dict(labels or {})},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 5,
                "nodeSelector": {GROUP_LABEL: self.group},
                "resourceClaims": [{"name": entry, **ref} for entry, ref in claims.items()],
                "containers": [
                    {"name": "main", "image": "registry.example/cuda:12", "resources": resources}
                ],
            },
        }

    def pod(self, name: str, claims: Mapping[str, Obj], **kwargs: Any) -> None:
        self.core.create_namespaced_pod(self.namespace, self.pod_manifest(name, claims, **kwargs))

    def raw_pod(self, name: str) -> Obj | None:
        try:
            resp = self.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        out: Obj = json.loads(resp.data)
        return out

    def wait_phase(self, name: str, *phases: str, timeout: float = 60.0) -> Obj:
        def probe() -> Obj | None:
            pod = self.raw_pod(name)
            if pod is None:
                return None
            phase = pod.get("status", {}).get("phase")
            if phase in phases:
                return pod
            if phase == "Failed" and "Failed" not in phases:
                raise AssertionError(
                    f"pod {name} failed: {pod['status'].get('message')}\n{self.describe(name)}"
                )
            return None

        try:
            return wait_for(f"pod {name} to be {'/'.join(phases)}", probe, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnostics(name)}") from None

    def wait_gone(self, name: str, timeout: float = 60.0) -> None:
        wait_for(f"pod {name} to be deleted", lambda: self.raw_pod(name) is None, timeout)

    def delete_pod(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.namespace)

    def claims(self) -> list[Obj]:
        resp = self.resource.list_namespaced_resource_claim(self.namespace, _preload_content=False)
        items: list[Obj] = json.loads(resp.data)["items"]
        return items

    def claim_of(self, pod_name: str, entry: str) -> Obj:
        pod = self.raw_pod(pod_name)
        assert pod is not None, f"pod {pod_name} is gone"
        name = dict(claim_names(pod)).get(entry)
        assert name, f"pod {pod_name} has no ResourceClaim for entry {entry!r} yet"
        resp = self.resource.read_namespaced_resource_claim(
            name, self.namespace, _preload_content=False
        )
        out: Obj = json.loads(resp.data)
        return out

    def container_env(self, pod_name: str) -> tuple[str, ...]:
        """The environment the pod's containers got from their CDI devices, on whichever of
        this test's nodes started it."""
        for node in self.nodes.values():
            record = node.agent.record_of(self.namespace, pod_name)
            if record is not None and record.edits is not None:
                return tuple(record.edits.env)
        return ()

    @staticmethod
    def results(claim: Obj) -> list[Obj]:
        alloc = claim.get("status", {}).get("allocation") or {}
        out: list[Obj] = alloc.get("devices", {}).get("results", [])
        return out

    def published_device(self, node: str, device: str) -> Obj:
        """The device as the node's ResourceSlices publish it (attributes, capacity)."""
        resp = self.resource.list_resource_slice(
            field_selector=f"spec.nodeName={node}", _preload_content=False
        )
        for s in json.loads(resp.data)["items"]:
            for d in s["spec"].get("devices") or []:
                if d["name"] == device:
                    out: Obj = d
                    return out
        raise AssertionError(f"device {device} not published by {node}")

    def events(self, kind: str, name: str) -> list[Obj]:
        resp = self.core.list_namespaced_event(
            self.namespace,
            field_selector=f"involvedObject.kind={kind},involvedObject.name={name}",
            _preload_content=False,
        )
        core_events: list[Obj] = json.loads(resp.data)["items"]
        events_api = client.EventsV1Api(self.stack.api)
        resp2 = events_api.list_namespaced_event(
            self.namespace,
            field_selector=f"regarding.kind={kind},regarding.name={name}",
            _preload_content=False,
        )
        new_events: list[Obj] = json.loads(resp2.data)["items"]
        return [
            *({"reason": e.get("reason"), "message": e.get("message")} for e in core_events),
            *({"reason": e.get("reason"), "message": e.get("note")} for e in new_events),
        ]

    def node_events(self, node: str, reason: str) -> list[Obj]:
        """The plugin's events on Node `node` with `reason` (events.k8s.io, in the namespace
        node events go to)."""
        from kubeletplugin.nodeevents import NODE_EVENT_NAMESPACE

        resp = client.EventsV1Api(self.stack.api).list_namespaced_event(
            NODE_EVENT_NAMESPACE,
            field_selector=f"regarding.kind=Node,regarding.name={node}",
            _preload_content=False,
        )
        items: list[Obj] = json.loads(resp.data)["items"]
        return [e for e in items if e.get("reason") == reason]

    def describe(self, name: str, kind: str = "pod") -> str:
        done = self.stack.kubectl("describe", kind, name, "-n", self.namespace, check=False)
        return done.stdout or done.stderr

    def diagnostics(self, pod_name: str | None = None) -> str:
        parts = []
        if pod_name:
            parts.append(self.describe(pod_name))
        parts.append("controller log:\n" + self.stack.controller_log_tail(25))
        for node in self.nodes.values():
            parts.append(f"plugin log {node.name}:\n{node.plugin_log_tail(15)}")
        return "\n".join(parts)

    # -- invariants ----------------------------------------------------------------------------

    def hardware(self, nodes: Iterable[SimNode] | None = None) -> Obj:
        return {n.name: n.hardware_view() for n in (nodes or self.nodes.values())}

    def all_claims(self) -> list[Obj]:
        resp = self.resource.list_resource_claim_for_all_namespaces(_preload_content=False)
        items: list[Obj] = json.loads(resp.data)["items"]
        return items

    def check_invariants(self, *, lost: Iterable[SimNode] = ()) -> list[str]:
        """No overlap and no leaked instance, from the hardware and every claim.

        Instances on ``lost`` nodes (down, given up by the controller) are not counted as
        leaks: nothing can destroy them while the node is off, and its plugin does so when it
        comes back. Overlaps are checked on every node."""
        before = allocated_devices(self.all_claims(), self.stack.contract.driver)
        hardware = self.hardware()
        after = allocated_devices(self.all_claims(), self.stack.contract.driver)
        down = {n.name for n in lost}
        alive = {name: hw for name, hw in hardware.items() if name not in down}
        return overlaps(after, hardware) + leaks(alive, before, after)

    def check_at_rest(self) -> list[str]:
        return at_rest(
            self.hardware(), allocated_devices(self.all_claims(), self.stack.contract.driver)
        )

    def instance_count(self) -> int:
        """Instances held for claims (warm ones belong to the node and go with it)."""
        return sum(len(hw.claimed) for hw in self.hardware().values())

    # -- teardown ------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Delete every pod gracefully (the agents unprepare), then the claims; stop the nodes.
        Returns problems found on the way (instances left behind)."""
        problems: list[str] = []
        for dep in self.apps.list_namespaced_deployment(self.namespace).items:
            self.apps.delete_namespaced_deployment(dep.metadata.name, self.namespace)
        self.core.delete_collection_namespaced_pod(self.namespace)
        try:
            wait_for(
                "pods of the test to be gone",
                lambda: not self.core.list_namespaced_pod(self.namespace).items,
                timeout=60,
            )
            self.resource.delete_collection_namespaced_resource_claim(self.namespace)
            wait_for("claims of the test to be gone", lambda: not self.claims(), timeout=60)
            wait_for("instances to be destroyed", lambda: self.instance_count() == 0, timeout=30)
        except AssertionError as exc:
            problems.append(f"{exc}\n{self.diagnostics()}")
            self.core.delete_collection_namespaced_pod(self.namespace, grace_period_seconds=0)
        for name in list(self.nodes):
            self.stack.remove_node(name)
            del self.nodes[name]
        self.core.delete_namespace(self.namespace)
        return problems


def environment_for(
    stack: CarveStack,
    request: Any,
    namespace_labels: Mapping[str, str] = GATED_NAMESPACES,
    *,
    env: E2E | None = None,
) -> Iterator[E2E]:
    """A fixture body: one E2E (or the given ``env``) for the requesting test, torn down after
    it; problems found by the teardown fail the test only if nothing else did (the first failure
    is the real one)."""
    import pytest

    if env is None:
        env = E2E(stack, request.node.name, namespace_labels)
    failed_before = request.session.testsfailed
    try:
        yield env
    finally:
        problems = env.teardown()
    if problems and request.session.testsfailed == failed_before:
        pytest.fail("teardown found problems:\n" + "\n".join(problems))


def destroy_as_the_admin(sim_config: Path, minor: int | None = None) -> None:
    """`nvidia-smi mig -dci`, then `-dgi`, on GPU `minor` (every GPU when None) of a simulated
    node: what a ForeignMigInstance event tells the admin to run."""
    from driver.nvml import sim
    from driver.nvml.backend import NvmlBackend

    sim.configure(sim_config)
    try:
        with NvmlBackend(sim, proc_root=sim.sim_proc_root()) as b:
            for gpu in b.gpus():
                if minor is None or gpu.minor == minor:
                    for inst in b.instances(gpu.uuid):
                        b.destroy(gpu.uuid, inst.gi_id)
    finally:
        sim.configure(None)
