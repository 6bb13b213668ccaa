"""Least privilege, checked with the real apiserver on an installed chart: what each service
account may do (``kubectl auth can-i``), and every narrowed permission refused to a real
service-account token (bound to a pod on a node, for the plugin): the admission policies that
confine a plugin to its own node's slices, pool and finalizer, the verbs the controller no
longer holds, and the policies that keep carve-controller the one allocator of carve's claims
and the one remover of its gate (issue 30.4, 30.5).

The install is parked (no component runs: nothing here needs a kubelet) and has a driver name
of its own, so it shares the control plane with the other installs of this session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from devcluster.cluster import LocalCluster, run_kubectl
from devcluster.pytest_plugin import (  # noqa: F401  (fixtures, used by name)
    fake_node,
    k8s_api,
    node_heartbeater,
)
from devcluster.waiting import wait_for
from driver.contract import Contract
from kubeletplugin.claims import KubernetesClaimClient
from process.kube.jsonclient import KubeJson
from tests.support.helm import NOWHERE, Helm, parked_install
from tests.support.sa_tokens import client_as, service_account_token

pytestmark = pytest.mark.cluster

CONTRACT = Contract("mig.privs.carve.dev")
NAMESPACE = "carve-privs"
PLUGIN = f"system:serviceaccount:{NAMESPACE}:carve-kubelet-plugin"
CONTROLLER = f"system:serviceaccount:{NAMESPACE}:carve-controller"
MPS_DAEMON = f"system:serviceaccount:{NAMESPACE}:carve-mps-daemon"
SOMEONE = "system:serviceaccount:default:default"

# (who, verb, resource[/subresource], name or "", expected): the table the note reports.
CAN_I: tuple[tuple[str, str, str, str, bool], ...] = (
    # The plugin: its node's slices (the admission policy narrows "its node"), the claims it
    # prepares, the status of its own driver's devices on its node, events.
    (PLUGIN, "create", "resourceslices.resource.k8s.io", "", True),
    (PLUGIN, "delete", "resourceslices.resource.k8s.io", "", True),
    (PLUGIN, "get", "resourceclaims.resource.k8s.io", "", True),
    (PLUGIN, "patch", "resourceclaims.resource.k8s.io", "", True),
    (PLUGIN, "update", "resourceclaims.resource.k8s.io", "", False),
    # only to rebuild a damaged checkpoint from the claims holding its node finalizer
    (PLUGIN, "list", "resourceclaims.resource.k8s.io", "", True),
    (PLUGIN, "watch", "resourceclaims.resource.k8s.io", "", False),
    # Claim status: the status.devices of its own driver's devices on the node the claim is
    # allocated to (which MIG device each is), nothing wider; never another driver's.
    (PLUGIN, "patch", "resourceclaims.resource.k8s.io/status", "", True),
    (
        PLUGIN,
        "associated-node:patch",
        "resourceclaims.resource.k8s.io/driver",
        CONTRACT.driver,
        True,
    ),
    (
        PLUGIN,
        "arbitrary-node:patch",
        "resourceclaims.resource.k8s.io/driver",
        CONTRACT.driver,
        False,
    ),
    (
        PLUGIN,
        "associated-node:update",
        "resourceclaims.resource.k8s.io/driver",
        CONTRACT.driver,
        False,
    ),
    (
        PLUGIN,
        "associated-node:update",
        "resourceclaims.resource.k8s.io/driver",
        "gpu.nvidia.com",
        False,
    ),
    (PLUGIN, "deletecollection", "resourceslices.resource.k8s.io", "", False),
    (PLUGIN, "update", "resourceclaims.resource.k8s.io/status", "", False),
    (PLUGIN, "update", "resourceclaims.resource.k8s.io/binding", "", False),
    (PLUGIN, "create", "events.events.k8s.io", "", True),
    (PLUGIN, "patch", "events.events.k8s.io", "", True),  # a repeat's series count
    (PLUGIN, "delete", "events.events.k8s.io", "", False),
    (PLUGIN, "get", "secrets", "", False),
    (PLUGIN, "list", "pods", "", False),
    # MPS daemon pods only in its own namespace (CAN_I_OWN_NAMESPACE), never here.
    (PLUGIN, "create", "pods", "", False),
    (PLUGIN, "delete", "pods", "", False),
    (PLUGIN, "update", "nodes", "", False),
    (PLUGIN, "update", "deviceclasses.resource.k8s.io", "", False),
    # The controller: allocation (status + binding), gates and its condition, no secrets.
    (CONTROLLER, "update", "resourceclaims.resource.k8s.io/status", "", True),
    (CONTROLLER, "update", "resourceclaims.resource.k8s.io/binding", "", True),
    (CONTROLLER, "patch", "pods", "", True),
    (CONTROLLER, "update", "pods", "", False),
    (CONTROLLER, "patch", "resourceclaims.resource.k8s.io", "", True),
    (CONTROLLER, "update", "resourceclaims.resource.k8s.io", "", False),
    (CONTROLLER, "patch", "pods/status", "", True),
    (CONTROLLER, "get", "secrets", "", False),
    (CONTROLLER, "list", "secrets", "", False),
    (CONTROLLER, "create", "pods", "", False),
    (CONTROLLER, "delete", "pods", "", False),
    # Preemption: evictions through the Eviction API only, and the budgets it must honour.
    (CONTROLLER, "create", "pods/eviction", "", True),
    (CONTROLLER, "list", "poddisruptionbudgets.policy", "", True),
    (CONTROLLER, "watch", "poddisruptionbudgets.policy", "", True),
    (CONTROLLER, "update", "poddisruptionbudgets.policy", "", False),
    (CONTROLLER, "deletecollection", "pods", "", False),
    (CONTROLLER, "create", "resourceslices.resource.k8s.io", "", False),
    (CONTROLLER, "update", "deviceclasses.resource.k8s.io", "", False),
    # DeviceTaintRules: read, as kube-scheduler reads them; taking devices out of service
    # stays the admin's.
    (CONTROLLER, "list", "devicetaintrules.resource.k8s.io", "", True),
    (CONTROLLER, "watch", "devicetaintrules.resource.k8s.io", "", True),
    (CONTROLLER, "create", "devicetaintrules.resource.k8s.io", "", False),
    (CONTROLLER, "update", "devicetaintrules.resource.k8s.io/status", "", False),
    (PLUGIN, "list", "devicetaintrules.resource.k8s.io", "", False),
    # Nobody else writes allocations.
    (SOMEONE, "update", "resourceclaims.resource.k8s.io/binding", "", False),
    (SOMEONE, "update", "resourceclaims.resource.k8s.io/status", "", False),
)

# The plugin in its own namespace: the MPS daemon pods (kubeletplugin/mpspods.py), which it
# creates, reads and deletes by name; it never lists, changes or enters them. The admission
# policy holds it to pods bound to its own node (test_a_plugin_may_run_daemon_pods_...).
CAN_I_OWN_NAMESPACE: tuple[tuple[str, str, str, str, bool], ...] = (
    (PLUGIN, "create", "pods", "", True),
    (PLUGIN, "get", "pods", "", True),
    (PLUGIN, "delete", "pods", "", True),
    (PLUGIN, "list", "pods", "", False),
    (PLUGIN, "watch", "pods", "", False),
    (PLUGIN, "update", "pods", "", False),
    (PLUGIN, "patch", "pods", "", False),
    (PLUGIN, "create", "pods/exec", "", False),
    (PLUGIN, "get", "secrets", "", False),
    # carve-controller's leader Lease, to check the contract version declared there
    # (kubeletplugin/controllerskew.py), and no other Lease; never written.
    (PLUGIN, "get", "leases.coordination.k8s.io", "carve-controller", True),
    (PLUGIN, "get", "leases.coordination.k8s.io", "another-lease", False),
    (PLUGIN, "update", "leases.coordination.k8s.io", "carve-controller", False),
    (PLUGIN, "list", "leases.coordination.k8s.io", "", False),
    # The daemons' own account: no API rights at all (issue 41.1).
    (MPS_DAEMON, "get", "pods", "", False),
    (MPS_DAEMON, "get", "secrets", "", False),
    (MPS_DAEMON, "get", "resourceclaims.resource.k8s.io", "", False),
)


def _chart_installed(
    k8s_cluster: LocalCluster, helm: Helm, release: str, namespace: str, *sets: str
) -> contextlib.AbstractContextManager[Path]:
    """The chart installed under `release`, its pods scheduled nowhere (only RBAC matters)."""
    return parked_install(helm, Path(k8s_cluster.info.kubeconfig), release, namespace, *sets)


def _can_i_mismatches(
    kubeconfig: Path,
    table: Sequence[tuple[str, str, str, str, bool]],
    namespace: str = "default",
) -> list[str]:
    """Each row of `table` asked with `kubectl auth can-i` (in `namespace`); the rows answered
    otherwise."""
    wrong = []
    for who, verb, what, name, expected in table:
        resource, _, subresource = what.partition("/")
        target = f"{resource}/{name}" if name else resource
        args = ["auth", "can-i", verb, target, "--as", who, "-n", namespace]
        if subresource:
            args.append(f"--subresource={subresource}")
            target += f" ({subresource})"
        done = run_kubectl(kubeconfig, *args, check=False)
        answer = done.stdout.strip()
        if answer not in ("yes", "no"):
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}{done.stdout}")
        if (answer == "yes") != expected:
            wrong.append(f"{who} {verb} {target}: {answer}, expected {'yes' if expected else 'no'}")
    return wrong


@pytest.fixture(scope="module")
def installed(k8s_cluster: LocalCluster, helm: Helm) -> Iterator[Path]:
    with _chart_installed(
        k8s_cluster, helm, "carve-privs", NAMESPACE, f"driverName={CONTRACT.driver}"
    ) as kubeconfig:
        yield kubeconfig


def test_each_service_account_holds_what_it_uses_and_no_more(installed: Path) -> None:
    wrong = _can_i_mismatches(installed, CAN_I)
    wrong += _can_i_mismatches(installed, CAN_I_OWN_NAMESPACE, NAMESPACE)
    assert not wrong, "\n".join(wrong)


def _slice(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"privs-{node}"},
        "spec": {
            "driver": CONTRACT.driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def _token(
    core: client.CoreV1Api,
    pod: str | None,
    account: str = "carve-kubelet-plugin",
    namespace: str = NAMESPACE,
) -> str:
    """A token of `account` (the plugin's by default), as the kubelet gets one for its pod
    (bound to the pod, so it carries the pod's node) or, with no pod, one that names no node."""
    return service_account_token(core, account, namespace, pod)


_client_as = client_as


def _as_token(kubeconfig: Path, token: str) -> client.ResourceV1Api:
    return client.ResourceV1Api(_client_as(kubeconfig, token))


def test_a_plugin_may_write_only_its_own_nodes_slices(
    installed: Path,
    fake_node: Any,  # noqa: F811
    k8s_api: Any,  # noqa: F811
) -> None:
    here, there = fake_node(), fake_node()
    core = client.CoreV1Api(k8s_api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin-stand-in", "namespace": NAMESPACE},
        "spec": {
            "serviceAccountName": "carve-kubelet-plugin",
            "nodeName": here,
            "containers": [{"name": "c", "image": "carve.local/none:0"}],
        },
    }
    core.create_namespaced_pod(NAMESPACE, pod)
    try:
        own = _as_token(installed, _token(core, "plugin-stand-in"))
        own.create_resource_slice(_slice(here))
        own.delete_resource_slice(f"privs-{here}")
        with pytest.raises(client.ApiException) as refused:
            own.create_resource_slice(_slice(there))
        assert refused.value.status == 403
        assert (
            f"carve-kubelet-plugin on node {here} may only write ResourceSlices of its own "
            f"node, not of '{there}'"
        ) in str(refused.value.body)

        # Its own node, another node's pool (and so, to the controller, that node's GPUs).
        foreign_pool = _slice(here)
        foreign_pool["spec"]["pool"]["name"] = there
        with pytest.raises(client.ApiException) as other_pool:
            own.create_resource_slice(foreign_pool)
        assert other_pool.value.status == 403
        assert (
            f"carve-kubelet-plugin on node {here} may only publish the pool of its own node, "
            f"not '{there}'"
        ) in str(other_pool.value.body)

        unbound = _as_token(installed, _token(core, None))
        with pytest.raises(client.ApiException) as no_node:
            unbound.create_resource_slice(_slice(here))
        assert no_node.value.status == 403
        assert f"no node association in the service-account token of {PLUGIN}" in str(
            no_node.value.body
        )
    finally:
        core.delete_namespaced_pod("plugin-stand-in", NAMESPACE, grace_period_seconds=0)


def _daemon_pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "carve.local/none:0"}]},
    }


def _plugin_env(apps: client.AppsV1Api) -> dict[str, str]:
    """The plugin's settings as the chart configured its DaemonSet (name -> literal value)."""
    (ds,) = apps.list_namespaced_daemon_set(NAMESPACE).items
    (container,) = ds.spec.template.spec.containers
    return {e.name: e.value for e in container.env or () if e.value is not None}


def _real_daemon_pod(env: dict[str, str], uid: str, node: str) -> dict[str, Any]:
    """The pod kubeletplugin.mpspods builds for a claim, with the chart's settings."""
    from kubeletplugin.checkpoint import MpsDaemon
    from kubeletplugin.mpspods import DaemonPods, PodSettings

    pods = DaemonPods(
        None,  # type: ignore[arg-type]  (only `manifest` is called: no API)
        PodSettings(
            namespace=NAMESPACE,
            image=env["CARVE_MPS_DAEMON_IMAGE"],
            node_name=node,
            driver_name=CONTRACT.driver,
            service_account=env["CARVE_MPS_DAEMON_SERVICE_ACCOUNT"],
        ),
    )
    top = f"/var/lib/kubelet/plugins/{CONTRACT.driver}/mps/{uid}"
    d = pods.intent(MpsDaemon(f"{top}/pipe", f"{top}/log", ("MIG-1",)), uid)
    return pods.manifest(
        Path("/usr/bin/nvidia-cuda-mps-control"),
        d,
        {"CUDA_MPS_PIPE_DIRECTORY": f"{top}/pipe", "CUDA_VISIBLE_DEVICES": "MIG-1"},
    )


def test_a_plugin_may_run_daemon_pods_on_its_own_node_only(
    installed: Path,
    fake_node: Any,  # noqa: F811
    k8s_api: Any,  # noqa: F811
) -> None:
    here, there = fake_node(), fake_node()
    core = client.CoreV1Api(k8s_api)
    env = _plugin_env(client.AppsV1Api(k8s_api))
    stand_in = _daemon_pod("plugin-stand-in-pods", here)
    stand_in["spec"]["serviceAccountName"] = "carve-kubelet-plugin"
    core.create_namespaced_pod(NAMESPACE, stand_in)
    elsewhere = "carve-mps-elsewhere"
    core.create_namespaced_pod(NAMESPACE, _daemon_pod(elsewhere, there))  # by an admin
    try:
        own = client.CoreV1Api(_client_as(installed, _token(core, "plugin-stand-in-pods")))
        own.create_namespaced_pod(NAMESPACE, _real_daemon_pod(env, "u-here", here))
        own.delete_namespaced_pod("carve-mps-u-here", NAMESPACE, grace_period_seconds=0)
        for attempt in (
            lambda: own.create_namespaced_pod(NAMESPACE, _real_daemon_pod(env, "u-there", there)),
            lambda: own.delete_namespaced_pod(elsewhere, NAMESPACE),
        ):
            _refused(
                attempt,
                f"carve-kubelet-plugin on node {here} may only create and delete pods bound to "
                f"its own node, not to '{there}'",
            )
    finally:
        for name in ("plugin-stand-in-pods", elsewhere):
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)


def _as_controller(pod: dict[str, Any]) -> None:
    pod["spec"]["serviceAccountName"] = "carve-controller"


def _host_root(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}})


def _token_mounted(pod: dict[str, Any]) -> None:
    pod["spec"]["automountServiceAccountToken"] = True


def _other_image(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["image"] = "evil.example/shell:1"


def _shell(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "cat /var/run/secrets/*"]


def _secret_env(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["env"].append(
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "any", "key": "token"}}}
    )


def _projected_token(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"].append(
        {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
    )


def _host_network(pod: dict[str, Any]) -> None:
    pod["spec"]["hostNetwork"] = True


def _second_container(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"].append(
        {"name": "side", "image": pod["spec"]["containers"][0]["image"]}
    )


def _misnamed(pod: dict[str, Any]) -> None:
    pod["metadata"]["name"] = "innocent"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (_as_controller, "spec.serviceAccountName: a daemon pod runs as carve-mps-daemon"),
        (_host_root, "spec.volumes: a daemon pod mounts only host paths among /dev, "),
        (_token_mounted, "spec.automountServiceAccountToken: a daemon pod mounts no token"),
        (_other_image, "spec.containers[0].image: a daemon pod runs "),
        (_shell, "spec.containers[0].command: a daemon pod runs the driver's"),
        (_secret_env, "spec.containers[0].env: a daemon pod's environment is literal values"),
        (_projected_token, "t (not a host path)"),
        (_host_network, "spec: a daemon pod shares no host namespace"),
        (_second_container, "spec.containers: a daemon pod has one container"),
        (_misnamed, "metadata.name: a daemon pod is named carve-mps-CLAIM_UID, not innocent"),
    ],
)
def test_a_plugin_may_create_only_the_daemon_pod_it_builds(
    installed: Path,
    fake_node: Any,  # noqa: F811
    k8s_api: Any,  # noqa: F811
    change: Any,
    says: str,
) -> None:
    """Issue 41.1: before, the node check was the only one, so a plugin's token could run a pod
    as carve-controller (and so hold its token), or mount the host's root, and both were
    admitted."""
    here = fake_node()
    core = client.CoreV1Api(k8s_api)
    env = _plugin_env(client.AppsV1Api(k8s_api))
    stand_in = _daemon_pod("plugin-stand-in-daemon", here)
    stand_in["spec"]["serviceAccountName"] = "carve-kubelet-plugin"
    core.create_namespaced_pod(NAMESPACE, stand_in)
    try:
        own = client.CoreV1Api(_client_as(installed, _token(core, "plugin-stand-in-daemon")))
        pod = _real_daemon_pod(env, "u-bad", here)
        change(pod)
        _refused(lambda: own.create_namespaced_pod(NAMESPACE, pod), says)
    finally:
        core.delete_namespaced_pod("plugin-stand-in-daemon", NAMESPACE, grace_period_seconds=0)


MERGE = "application/merge-patch+json"


def _claim_body(name: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {"requests": [{"name": "mig", "exactly": {"deviceClassName": driver}}]}
        },
    }


def _allocation(driver: str, node: str) -> dict[str, Any]:
    return {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "mig", "driver": driver, "pool": node, "device": "gpu-0"}
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                },
            }
        }
    }


def _refused(call: Any, *fragments: str) -> None:
    """`call()` is refused with 403 and a message holding every fragment."""
    with pytest.raises(client.ApiException) as refused:
        call()
    assert refused.value.status == 403, refused.value.body
    for fragment in fragments:
        assert fragment in str(refused.value.body), refused.value.body


@contextlib.contextmanager
def _plugin_on(kubeconfig: Path, core: client.CoreV1Api, node: str) -> Iterator[client.ApiClient]:
    """The plugin's identity on `node`: a token bound to a stand-in pod there."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin-stand-in-claims", "namespace": NAMESPACE},
        "spec": {
            "serviceAccountName": "carve-kubelet-plugin",
            "nodeName": node,
            "containers": [{"name": "c", "image": "carve.local/none:0"}],
        },
    }
    core.create_namespaced_pod(NAMESPACE, pod)
    try:
        yield _client_as(kubeconfig, _token(core, "plugin-stand-in-claims"))
    finally:
        core.delete_namespaced_pod("plugin-stand-in-claims", NAMESPACE, grace_period_seconds=0)


def _drop_claims(admin: client.ResourceV1Api, *names: str) -> None:
    for name in names:
        with contextlib.suppress(client.ApiException):
            admin.patch_namespaced_resource_claim(
                name, NAMESPACE, {"metadata": {"finalizers": None}}, _content_type=MERGE
            )
            admin.delete_namespaced_resource_claim(name, NAMESPACE)


def test_a_plugin_may_add_and_remove_only_its_own_finalizer_on_its_nodes_claims(
    installed: Path,
    fake_node: Any,  # noqa: F811
    k8s_api: Any,  # noqa: F811
) -> None:
    here, there = fake_node(), fake_node()
    core, admin = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    controller = _as_token(installed, _token(core, None, "carve-controller"))
    own, theirs = CONTRACT.node_finalizer(here), CONTRACT.node_finalizer(there)
    kept = CONTRACT.allocation_finalizer  # put there at creation by 32-claim-finalizer.yaml
    try:
        for name, node in (("on-here", here), ("on-there", there)):
            admin.create_namespaced_resource_claim(NAMESPACE, _claim_body(name, CONTRACT.driver))
            controller.patch_namespaced_resource_claim_status(
                name, NAMESPACE, _allocation(CONTRACT.driver, node), _content_type=MERGE
            )
        admin.patch_namespaced_resource_claim(
            "on-there", NAMESPACE, {"metadata": {"finalizers": [kept, theirs]}}, _content_type=MERGE
        )
        with _plugin_on(installed, core, here) as api:
            plugin = client.ResourceV1Api(api)

            def finalizers(name: str, wanted: list[str]) -> Any:
                return lambda: plugin.patch_namespaced_resource_claim(
                    name,
                    NAMESPACE,
                    {"metadata": {"finalizers": [kept, *wanted]}},
                    _content_type=MERGE,
                )

            finalizers("on-here", [own])()  # carving on its node: allowed
            _refused(
                finalizers("on-there", [theirs, own]),
                f"carve-kubelet-plugin on node {here} may add its node finalizer only to a "
                "ResourceClaim allocated to that node",
            )
            _refused(
                finalizers("on-there", []),
                f"carve-kubelet-plugin on node {here} may only add or remove its own node "
                f"finalizer on a ResourceClaim, not {theirs}",
            )
            _refused(
                lambda: plugin.patch_namespaced_resource_claim(
                    "on-here", NAMESPACE, {"metadata": {"labels": {"x": "y"}}}, _content_type=MERGE
                ),
                "may change nothing of a ResourceClaim but its own node finalizer",
            )
            finalizers("on-here", [])()  # its instance destroyed: allowed

            # The plugin's own client writes the same (process.kube.finalizers: a strategic
            # merge adds, a tested JSON patch removes), and the policy admits both.
            node = KubernetesClaimClient(KubeJson(api))
            uid = admin.read_namespaced_resource_claim("on-here", NAMESPACE).metadata.uid
            node.add_finalizer(NAMESPACE, "on-here", uid, own)
            read = admin.read_namespaced_resource_claim("on-here", NAMESPACE).metadata
            assert read.finalizers == [own, kept], "a strategic merge puts new entries first"
            node.remove_finalizer(NAMESPACE, "on-here", uid, own)
            read = admin.read_namespaced_resource_claim("on-here", NAMESPACE).metadata
            assert read.finalizers == [kept]
    finally:
        _drop_claims(admin, "on-here", "on-there")


def test_the_controller_may_not_update_pods_or_claims_whole(
    installed: Path,
    k8s_api: Any,  # noqa: F811
) -> None:
    core, admin = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    api = _client_as(installed, _token(core, None, "carve-controller"))
    admin.create_namespaced_resource_claim(NAMESPACE, _claim_body("whole", CONTRACT.driver))
    core.create_namespaced_pod(NAMESPACE, _gated_pod("whole"))
    try:
        pod = core.read_namespaced_pod("whole", NAMESPACE)
        _refused(
            lambda: client.CoreV1Api(api).replace_namespaced_pod("whole", NAMESPACE, pod),
            'cannot update resource \\"pods\\"',
        )
        claim = admin.read_namespaced_resource_claim("whole", NAMESPACE)
        _refused(
            lambda: client.ResourceV1Api(api).replace_namespaced_resource_claim(
                "whole", NAMESPACE, claim
            ),
            'cannot update resource \\"resourceclaims\\"',
        )
    finally:
        core.delete_namespaced_pod("whole", NAMESPACE, grace_period_seconds=0)
        _drop_claims(admin, "whole")


STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@pytest.mark.parametrize(
    ("patch", "content_type", "says"),
    [
        (
            {"spec": {"containers": [{"name": "c", "image": "evil.example/miner:1"}]}},
            STRATEGIC,
            "spec.containers: carve-controller never changes a pod's containers",
        ),
        (
            {"metadata": {"labels": {"app": "hijacked"}}},
            MERGE,
            "metadata.labels, metadata.finalizers, metadata.ownerReferences",
        ),
        (
            {"metadata": {"annotations": {"example.com/owner": "someone"}}},
            MERGE,
            f"metadata.annotations: carve-controller changes only annotations under "
            f"{CONTRACT.driver}/",
        ),
        (
            [{"op": "add", "path": "/spec/tolerations/-", "value": {"operator": "Exists"}}],
            JSON_PATCH,
            "spec.tolerations, spec.activeDeadlineSeconds",
        ),
        (
            {"spec": {"activeDeadlineSeconds": 1}},
            MERGE,
            "spec.tolerations, spec.activeDeadlineSeconds",
        ),
    ],
)
def test_the_controller_may_change_only_what_it_writes_in_a_pod(
    installed: Path,
    k8s_api: Any,  # noqa: F811
    patch: Any,
    content_type: str,
    says: str,
) -> None:
    """Issue 41.2: before, the controller's token changed a workload's image in any namespace.
    Each patch is one the apiserver's own pod validation allows (a 422 would prove nothing)."""
    core = client.CoreV1Api(k8s_api)
    as_controller = client.CoreV1Api(_client_as(installed, _token(core, None, "carve-controller")))
    core.create_namespaced_pod("default", _gated_pod("workload"))
    try:
        _refused(
            lambda: as_controller.patch_namespaced_pod(
                "workload", "default", patch, _content_type=content_type
            ),
            says,
        )
    finally:
        core.delete_namespaced_pod("workload", "default", grace_period_seconds=0)


def test_the_controller_still_pins_ungates_and_annotates_its_pods(
    installed: Path,
    k8s_api: Any,  # noqa: F811
) -> None:
    core = client.CoreV1Api(k8s_api)
    as_controller = client.CoreV1Api(_client_as(installed, _token(core, None, "carve-controller")))
    core.create_namespaced_pod("default", _gated_pod("placed"))
    try:
        mine = {"metadata": {"annotations": {f"{CONTRACT.driver}/note": "x"}}}
        as_controller.patch_namespaced_pod("placed", "default", mine, _content_type=MERGE)
        pinned = {
            "spec": {
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchFields": [
                        {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}},
                "schedulingGates": [],
            }
        }  # fmt: skip
        as_controller.patch_namespaced_pod("placed", "default", pinned, _content_type=MERGE)
        pod = core.read_namespaced_pod("placed", "default")
        assert not pod.spec.scheduling_gates and pod.spec.affinity.node_affinity is not None
    finally:
        core.delete_namespaced_pod("placed", "default", grace_period_seconds=0)


SAFE = "cluster-autoscaler.kubernetes.io/safe-to-evict"
SAFE_KEY = SAFE.replace("/", "~1")


@pytest.mark.parametrize(
    ("start", "ungate_first", "ops"),
    [
        ({}, False, [{"op": "add", "path": "/metadata/annotations", "value": {SAFE: "true"}}]),
        (
            {SAFE: "true"},
            False,
            [{"op": "replace", "path": f"/metadata/annotations/{SAFE_KEY}", "value": "false"}],
        ),
        (
            {SAFE: "false"},
            False,
            [{"op": "remove", "path": f"/metadata/annotations/{SAFE_KEY}"}],
        ),
        ({}, True, [{"op": "add", "path": "/metadata/annotations", "value": {SAFE: "false"}}]),
    ],
    ids=["sets-true", "changes-users-value", "removes-users-value", "on-an-ungated-pod"],
)
def test_the_controller_adds_only_safe_to_evict_false_where_none_is(
    installed: Path,
    k8s_api: Any,  # noqa: F811
    start: dict[str, str],
    ungate_first: bool,
    ops: list[dict[str, Any]],
) -> None:
    """Issue 44.5: carve marks a pod it ungates not safe to evict; the policy admits that one
    value, where the user set none, on a pod that had carve's gate, and nothing else of CA's."""
    core = client.CoreV1Api(k8s_api)
    as_controller = client.CoreV1Api(_client_as(installed, _token(core, None, "carve-controller")))
    body = _gated_pod("evictable")
    if start:
        body["metadata"]["annotations"] = dict(start)
    core.create_namespaced_pod("default", body)
    try:
        if ungate_first:
            as_controller.patch_namespaced_pod(
                "evictable", "default", {"spec": {"schedulingGates": []}}, _content_type=MERGE
            )
        _refused(
            lambda: as_controller.patch_namespaced_pod(
                "evictable", "default", ops, _content_type=JSON_PATCH
            ),
            "metadata.annotations: carve-controller changes only annotations under "
            f"{CONTRACT.driver}/, and adds {SAFE}",
        )
    finally:
        core.delete_namespaced_pod("evictable", "default", grace_period_seconds=0)


def test_the_controllers_own_writer_sets_the_hint_and_ungates_with_safe_to_evict(
    installed: Path,
    k8s_api: Any,  # noqa: F811
) -> None:
    """What `KubeClaimWriter` sends with the controller's token is admitted: the hint through
    pods/status, its reset, and the gate's removal with safe-to-evict "false" in one patch."""
    from controller.autoscaling import SCHEDULING_GATED, shows_hint
    from controller.status import KubeClaimWriter

    core = client.CoreV1Api(k8s_api)
    api = _client_as(installed, _token(core, None, "carve-controller"))
    writer = KubeClaimWriter(KubeJson(api), contract=CONTRACT)
    body = _gated_pod("hinted")
    body["metadata"]["annotations"] = {"example.com/keep": "x"}
    core.create_namespaced_pod("default", body)
    try:
        pod = KubeJson(api).request("GET", "/api/v1/namespaces/default/pods/hinted")
        hinted = writer.set_unschedulable(pod, "carve cannot place this pod: no room")
        assert shows_hint(hinted)
        out = writer.remove_gate(hinted, protect=True)
        assert not out["spec"].get("schedulingGates")
        assert out["metadata"]["annotations"] == {"example.com/keep": "x", SAFE: "false"}
        [cond] = [c for c in out["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert cond["reason"] == SCHEDULING_GATED
    finally:
        core.delete_namespaced_pod("hinted", "default", grace_period_seconds=0)


def _gated_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulingGates": [{"name": CONTRACT.scheduling_gate}],
            "nodeSelector": NOWHERE,
            "containers": [{"name": "c", "image": "carve.local/none:0"}],
        },
    }


def test_only_the_controller_removes_the_gate_and_allocates_carves_claims(
    installed: Path,
    k8s_api: Any,  # noqa: F811
) -> None:
    """Anyone else, an admin included (admission applies to system:masters too), is refused:
    removing carve's gate, allocating a claim of carve's classes (kube-scheduler's way; the
    end-to-end race is in tests/e2e/test_two_allocators.py), handing a claim to the scheduler,
    and marking one as kube-scheduler's extended-resource claim."""
    core, admin = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    api = _client_as(installed, _token(core, None, "carve-controller"))
    controller_core, controller = client.CoreV1Api(api), client.ResourceV1Api(api)
    core.create_namespaced_pod(NAMESPACE, _gated_pod("gated"))
    admin.create_namespaced_resource_claim(NAMESPACE, _claim_body("carves", CONTRACT.driver))
    ungate = {"spec": {"schedulingGates": []}}
    marker = {"metadata": {"annotations": {f"{CONTRACT.driver}/allocator": "kube-scheduler"}}}
    extended = {
        "metadata": {"annotations": {"resource.kubernetes.io/extended-resource-claim": "true"}}
    }
    try:
        _refused(
            lambda: core.patch_namespaced_pod("gated", NAMESPACE, ungate, _content_type=MERGE),
            f"only carve-controller removes the scheduling gate {CONTRACT.scheduling_gate}",
        )
        _refused(
            lambda: admin.patch_namespaced_resource_claim_status(
                "carves", NAMESPACE, _allocation(CONTRACT.driver, "n"), _content_type=MERGE
            ),
            f"ResourceClaim {NAMESPACE}/carves uses carve's DeviceClasses: only "
            "carve-controller allocates it",
        )
        _refused(
            lambda: admin.patch_namespaced_resource_claim(
                "carves", NAMESPACE, marker, _content_type=MERGE
            ),
            f"only carve-controller sets the annotation {CONTRACT.driver}/allocator",
        )
        _refused(
            lambda: admin.patch_namespaced_resource_claim(
                "carves", NAMESPACE, extended, _content_type=MERGE
            ),
            "only kube-scheduler marks a claim of carve's DeviceClasses",
        )
        controller_core.patch_namespaced_pod("gated", NAMESPACE, ungate, _content_type=MERGE)
        assert not core.read_namespaced_pod("gated", NAMESPACE).spec.scheduling_gates
        controller.patch_namespaced_resource_claim("carves", NAMESPACE, marker, _content_type=MERGE)
        controller.patch_namespaced_resource_claim_status(
            "carves", NAMESPACE, _allocation(CONTRACT.driver, "n"), _content_type=MERGE
        )
    finally:
        core.delete_namespaced_pod("gated", NAMESPACE, grace_period_seconds=0)
        _drop_claims(admin, "carves")


def _controller_pod(name: str) -> dict[str, Any]:
    pod = _gated_pod(name)
    pod["metadata"]["namespace"] = NAMESPACE
    pod["spec"]["serviceAccountName"] = "carve-controller"
    return pod


def _set_lease_holder(coordination: client.CoordinationV1Api, holder: str) -> None:
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "carve-controller", "namespace": NAMESPACE},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15},
    }
    try:
        coordination.create_namespaced_lease(NAMESPACE, lease)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        coordination.patch_namespaced_lease(
            "carve-controller", NAMESPACE, {"spec": {"holderIdentity": holder}}
        )


def test_only_the_lease_holder_writes_allocations(installed: Path, k8s_api: Any) -> None:  # noqa: F811
    """Issue 41.4: a leader SIGKILLed with an allocation write in flight could have it land
    after the standby decided (two claims, one device). The apiserver now admits an
    allocation only from the pod that holds the Lease (dry runs: admission runs on them too,
    and nothing is written while the fence's view of the Lease catches up)."""
    core, admin = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    coordination = client.CoordinationV1Api(k8s_api)
    for name in ("ctl-a", "ctl-b"):
        core.create_namespaced_pod(NAMESPACE, _controller_pod(name))
    admin.create_namespaced_resource_claim(NAMESPACE, _claim_body("fenced", CONTRACT.driver))
    as_pod = {
        name: client.ResourceV1Api(_client_as(installed, _token(core, name, "carve-controller")))
        for name in ("ctl-a", "ctl-b")
    }
    unbound = client.ResourceV1Api(_client_as(installed, _token(core, None, "carve-controller")))

    def allocate(api: client.ResourceV1Api) -> int:
        try:
            api.patch_namespaced_resource_claim_status(
                "fenced", NAMESPACE, _allocation(CONTRACT.driver, "n"),
                _content_type=MERGE, dry_run="All",
            )  # fmt: skip
        except client.ApiException as exc:
            assert exc.status == 403, exc.body
            assert "does not hold the leader lease" in str(exc.body), exc.body
            return 403
        return 200

    try:
        _set_lease_holder(coordination, "ctl-a")
        wait_for("the fence to refuse ctl-b", lambda: allocate(as_pod["ctl-b"]) == 403)
        assert allocate(as_pod["ctl-a"]) == 200
        assert allocate(unbound) == 403  # a token that names no pod holds no lease
        _set_lease_holder(coordination, "ctl-b")  # the standby took over
        wait_for("the fence to refuse the old leader", lambda: allocate(as_pod["ctl-a"]) == 403)
        assert allocate(as_pod["ctl-b"]) == 200
        _set_lease_holder(coordination, "")  # released: whoever wins next may write
        wait_for("a released lease to fence nobody", lambda: allocate(as_pod["ctl-a"]) == 200)
    finally:
        coordination.delete_namespaced_lease("carve-controller", NAMESPACE)
        for name in ("ctl-a", "ctl-b"):
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
        _drop_claims(admin, "fenced")


# -- with plugin.bindingConditions (carve before bind) ------------------------------------------

BC = Contract("mig.privsbc.carve.dev")
BC_NAMESPACE = "carve-privs-bc"
BC_PLUGIN = f"system:serviceaccount:{BC_NAMESPACE}:carve-kubelet-plugin"

# Only what carving before bind adds: watching claims, and the status.devices of its own
# driver's devices on the node the claim is allocated to (associated-node), nothing wider.
CAN_I_BC: tuple[tuple[str, str, str, str, bool], ...] = (
    (BC_PLUGIN, "list", "resourceclaims.resource.k8s.io", "", True),
    (BC_PLUGIN, "watch", "resourceclaims.resource.k8s.io", "", True),
    (BC_PLUGIN, "update", "resourceclaims.resource.k8s.io", "", False),
    (BC_PLUGIN, "patch", "resourceclaims.resource.k8s.io/status", "", True),
    (BC_PLUGIN, "update", "resourceclaims.resource.k8s.io/status", "", False),
    (BC_PLUGIN, "patch", "resourceclaims.resource.k8s.io/binding", "", False),
    (BC_PLUGIN, "associated-node:patch", "resourceclaims.resource.k8s.io/driver", BC.driver, True),
    (BC_PLUGIN, "arbitrary-node:patch", "resourceclaims.resource.k8s.io/driver", BC.driver, False),
    (
        BC_PLUGIN,
        "associated-node:patch",
        "resourceclaims.resource.k8s.io/driver",
        "gpu.nvidia.com",
        False,
    ),
    (BC_PLUGIN, "get", "secrets", "", False),
)


@pytest.fixture(scope="module")
def installed_bc(k8s_cluster: LocalCluster, helm: Helm) -> Iterator[Path]:
    with _chart_installed(
        k8s_cluster,
        helm,
        "carve-privs-bc",
        BC_NAMESPACE,
        f"driverName={BC.driver}",
        "plugin.bindingConditions=true",
    ) as kubeconfig:
        yield kubeconfig


def test_binding_conditions_add_only_the_node_scoped_device_status(installed_bc: Path) -> None:
    wrong = _can_i_mismatches(installed_bc, CAN_I_BC)
    assert not wrong, "\n".join(wrong)


def _allocated_claim(resource: Any, controller: Any, name: str, node: str) -> None:
    """A claim of the BC install's class, allocated by its controller (only it may: the
    install's carve-sole-allocator policy refuses an admin too)."""
    resource.create_namespaced_resource_claim(
        BC_NAMESPACE,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "mig", "exactly": {"deviceClassName": BC.driver}}]
                }
            },
        },
    )
    controller.patch_namespaced_resource_claim_status(
        name,
        BC_NAMESPACE,
        {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "mig", "driver": BC.driver, "pool": node, "device": "gpu-0"}
                        ]
                    },
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": [node]}
                                ]
                            }
                        ]
                    },
                }
            }
        },
    )


def _carved(node: str) -> dict[str, Any]:
    return {
        "status": {
            "devices": [
                {
                    "driver": BC.driver,
                    "pool": node,
                    "device": "gpu-0",
                    "conditions": [
                        {
                            "type": BC.carved_condition,
                            "status": "True",
                            "reason": "Carved",
                            "message": "test",
                            "lastTransitionTime": "2026-12-01T00:00:00Z",
                        }
                    ],
                }
            ]
        }
    }


def test_a_plugin_may_report_carves_only_for_claims_on_its_own_node(
    installed_bc: Path,
    fake_node: Any,  # noqa: F811
    k8s_api: Any,  # noqa: F811
) -> None:
    here, there = fake_node(), fake_node()
    core = client.CoreV1Api(k8s_api)
    admin = client.ResourceV1Api(k8s_api)
    core.create_namespaced_pod(
        BC_NAMESPACE,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "plugin-stand-in"},
            "spec": {
                "serviceAccountName": "carve-kubelet-plugin",
                "nodeName": here,
                "containers": [{"name": "c", "image": "carve.local/none:0"}],
            },
        },
    )
    try:
        controller = _as_token(installed_bc, _token(core, None, "carve-controller", BC_NAMESPACE))
        _allocated_claim(admin, controller, "on-here", here)
        _allocated_claim(admin, controller, "on-there", there)
        token = client.CoreV1Api(k8s_api).create_namespaced_service_account_token(
            "carve-kubelet-plugin",
            BC_NAMESPACE,
            {
                "spec": {
                    "audiences": [],
                    "expirationSeconds": 600,
                    "boundObjectRef": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": "plugin-stand-in",
                    },
                }
            },
        )
        own = _as_token(installed_bc, str(token.status.token))
        own.patch_namespaced_resource_claim_status("on-here", BC_NAMESPACE, _carved(here))
        with pytest.raises(client.ApiException) as refused:
            own.patch_namespaced_resource_claim_status("on-there", BC_NAMESPACE, _carved(there))
        # The apiserver reports the per-driver check as a Forbidden field error (422 Invalid).
        assert refused.value.status == 422, refused.value.body
        body = str(refused.value.body)
        assert 'changing status.devices requires resource=\\"resourceclaims/driver\\"' in body, body
        assert "arbitrary-node:patch" in body, body
    finally:
        core.delete_namespaced_pod("plugin-stand-in", BC_NAMESPACE, grace_period_seconds=0)
        for name in ("on-here", "on-there"):
            with contextlib.suppress(client.ApiException):
                admin.delete_namespaced_resource_claim(name, BC_NAMESPACE)
