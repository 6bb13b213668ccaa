"""The chart rendered by the real helm, without a cluster: lint, the schema's messages, the
names that follow the driver name, the settings each component parses, and the plain
manifests that must be exactly what the chart renders (one source of truth)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

import controller.main as controller_main
import kubeletplugin.main as plugin_main
from controller.placement import DEFAULT_POLICY, Policy
from driver.catalog import CATALOG
from driver.contract import DEFAULT_MIG_RESOURCE_PREFIX, Contract
from nodesim.stack import INSTALL_MANIFESTS, MANIFESTS, render_manifest
from tests.support.helm import CHART, REPO, Helm, by_kind, one

RENAMED = Contract("mig.example.com")
CLUSTER_SCOPED = {
    "Namespace",
    "DeviceClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def test_plain_manifests_are_what_the_chart_renders(helm: Helm) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "hack" / "render_manifests.py"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "CARVE_HELM": str(helm.binary)},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "sets",
    [
        (),
        (f"driverName={RENAMED.driver}",),
        (
            "plugin.simulate.enabled=true",
            "plugin.driverRoot=/run/nvidia/driver",
            "deviceClasses.profiles={1g.10gb,3g.40gb}",
            "metrics.serviceMonitor.enabled=true",
            "controller.replicas=1",
        ),
    ],
    ids=["defaults", "renamed", "everything-on"],
)
def test_lint_is_clean(helm: Helm, sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm.run(*args).stdout
    assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "driverName=Mig_Carve",
            'driverName "Mig_Carve" is not a DNS subdomain of at most 63 characters',
        ),
        ("driverName=" + "a" * 64, "at '/driverName': maxLength: got 64, want 63"),
        (
            "plugin.foreignInstances=destroy",
            "at '/plugin/foreignInstances': value must be one of 'adopt', 'leave', 'refuse-gpu'",
        ),
        ("controller.replicas=-1", "at '/controller/replicas': minimum: got -1, want 0"),
        ("contoller.replicas=2", "additional properties 'contoller' not allowed"),
        ("plugin.driverRoot=run/nvidia/driver", "at '/plugin/driverRoot': 'run/nvidia/driver'"),
        ("plugin.resyncPeriod=soon", "at '/plugin/resyncPeriod': 'soon' does not match"),
        (
            "plugin.health.fatalTaintEffect=Evict",
            "at '/plugin/health/fatalTaintEffect': value must be one of 'NoExecute'",
        ),
        ("plugin.health.fatalXids=79;48", "at '/plugin/health/fatalXids': '79;48' does not match"),
        ("logging.level=verbose", "at '/logging/level': value must be one of 'debug'"),
        ("metrics.port=70000", "at '/metrics/port': maximum: got 70,000, want 65,535"),
        (
            "controller.leaderElection.enabled=false",
            "controller.replicas=2 needs leader election",
        ),
        (
            "plugin.simulate.config.uuid_seed=x",
            "plugin.simulate.config must not set state or uuid_seed",
        ),
    ],
)
def test_bad_values_are_refused_with_a_readable_message(
    helm: Helm, value: str, message: str
) -> None:
    done = helm.run("template", "carve", str(CHART), "--set", value, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_the_renamed_chart_renders_what_the_test_tooling_installs(helm: Helm) -> None:
    """nodesim's render_manifest renames the plain files for another driver name; the chart's
    driverName value must give the same objects, so the e2e suites test what ships. A renamed
    install in the tooling is a second install beside the default one, so it names its own
    extended resources, as deploy/README.md tells operators to."""
    chart = helm.template(
        f"driverName={RENAMED.driver}",
        "namespace.create=true",
        f"deviceClasses.extendedResources.migPrefix={RENAMED.driver}/mig-",
        f"deviceClasses.extendedResources.wholeGpu={RENAMED.driver}/gpu",
    )
    for name in INSTALL_MANIFESTS:
        tooling = render_manifest((MANIFESTS / name).read_text(), RENAMED)
        wanted = [d for d in yaml.safe_load_all(tooling) if d]
        keys = {(d["kind"], d["metadata"]["name"]) for d in wanted}
        got = [d for d in chart if (d["kind"], d["metadata"]["name"]) in keys]
        assert sorted(map(_canonical, got)) == sorted(map(_canonical, wanted)), name


def test_every_name_follows_the_driver_name(helm: Helm) -> None:
    docs = helm.template(
        f"driverName={RENAMED.driver}",
        "namespace.create=true",
        "deviceClasses.profiles={1g.10gb}",
        "metrics.serviceMonitor.enabled=true",
        "plugin.simulate.enabled=true",
    )
    assert "carve.dev" not in json.dumps(docs)
    classes = {d["metadata"]["name"] for d in by_kind(docs, "DeviceClass")}
    assert classes == {RENAMED.mig_class, RENAMED.gpu_class, "mig-1g-10gb.mig.example.com"}
    for doc in docs:
        if doc["kind"] in CLUSTER_SCOPED - {"Namespace", "DeviceClass"}:
            assert "-mig-example-com" in doc["metadata"]["name"], doc["metadata"]
    gate = json.dumps(by_kind(docs, "MutatingAdmissionPolicy"))
    assert RENAMED.scheduling_gate in gate and RENAMED.profile_class_suffix in gate
    plugin_role = one(docs, "ClusterRole", "carve-kubelet-plugin-mig-example-com")
    assert {"resourceclaims", "resourceslices"} <= {
        res for rule in plugin_role["rules"] for res in rule["resources"]
    }
    for binding in by_kind(docs, "MutatingAdmissionPolicyBinding"):
        assert binding["spec"]["policyName"] == binding["metadata"]["name"]


def _catalogue_profiles() -> list[str]:
    """Every plain MIG profile (no +me/-me/+gfx variant) of the GPU catalogue."""
    names = {p.name for m in CATALOG.values() for p in m.profiles}
    return sorted(n for n in names if re.fullmatch(r"[0-9]+g\.[0-9]+gb", n))


def test_the_default_profile_classes_are_the_catalogues_profiles() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert sorted(values["deviceClasses"]["profiles"]) == _catalogue_profiles(), (
        "deviceClasses.profiles in deploy/helm/carve/values.yaml must list every plain profile "
        "of driver/catalog"
    )


def test_profile_classes_and_the_whole_gpu_class_name_the_device_plugins_resources(
    helm: Helm,
) -> None:
    """By default `nvidia.com/mig-<profile>` maps to that profile's class and `nvidia.com/gpu`
    to the whole-GPU class (as NVIDIA's chart maps it to gpu.nvidia.com), and the gate catches
    both; wholeGpu="" gives the name up, for a cluster where NVIDIA's DRA driver serves it."""
    default = Contract()
    rendered = helm.template()
    docs = {d["metadata"]["name"]: d for d in by_kind(rendered, "DeviceClass")}
    for profile in _catalogue_profiles():
        cls = docs[default.profile_class(profile)]
        assert cls["spec"]["extendedResourceName"] == f"{DEFAULT_MIG_RESOURCE_PREFIX}{profile}"
        assert f'.profile == "{profile}"' in cls["spec"]["selectors"][0]["cel"]["expression"]
    assert docs[default.gpu_class]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert '.type == "gpu"' in docs[default.gpu_class]["spec"]["selectors"][0]["cel"]["expression"]
    assert "extendedResourceName" not in docs[default.mig_class]["spec"]
    gate = one(rendered, "MutatingAdmissionPolicy", "carve-placement-gate-extended-resources")
    names = next(v for v in gate["spec"]["variables"] if v["name"] == "names")
    assert "nvidia.com/gpu" in yaml.safe_load(names["expression"])
    given_up = helm.template("deviceClasses.extendedResources.wholeGpu=")
    classes = {d["metadata"]["name"]: d for d in by_kind(given_up, "DeviceClass")}
    assert "extendedResourceName" not in classes[default.gpu_class]["spec"]
    gate = one(given_up, "MutatingAdmissionPolicy", "carve-placement-gate-extended-resources")
    names = next(v for v in gate["spec"]["variables"] if v["name"] == "names")
    assert "nvidia.com/gpu" not in yaml.safe_load(names["expression"])
    off = helm.template("deviceClasses.extendedResources.enabled=false")
    assert all("extendedResourceName" not in d["spec"] for d in by_kind(off, "DeviceClass"))
    names = {d["metadata"]["name"] for d in by_kind(off, "MutatingAdmissionPolicy")}
    assert "carve-placement-gate-extended-resources" not in names


def test_the_default_names_are_the_contracts(helm: Helm) -> None:
    default = Contract()
    docs = helm.template()
    classes = {d["metadata"]["name"] for d in by_kind(docs, "DeviceClass")}
    profiles = {default.profile_class(p) for p in _catalogue_profiles()}
    assert classes == set(default.default_classes) | profiles
    assert default.scheduling_gate in json.dumps(by_kind(docs, "MutatingAdmissionPolicy"))
    assert not by_kind(docs, "Namespace")  # helm install --create-namespace makes it
    assert not by_kind(docs, "ServiceMonitor")
    for policy in ("carve-kubelet-plugin-own-node-slices", "carve-kubelet-plugin-own-node-pods"):
        text = json.dumps(one(docs, "ValidatingAdmissionPolicy", policy))
        assert "system:serviceaccount:carve-system:carve-kubelet-plugin" in text
    policy = one(docs, "ValidatingAdmissionPolicy", "carve-kubelet-plugin-own-node-finalizer")
    assert f"{default.driver}/" in json.dumps(policy)  # the node finalizer's domain
    for name in (
        "carve-sole-allocator",
        "carve-claim-markers",
        "carve-placement-gate-owner",
        "carve-controller-pod-writes",
        "carve-leader-fence",
    ):
        policy = one(docs, "ValidatingAdmissionPolicy", name)
        assert "system:serviceaccount:carve-system:carve-controller" in json.dumps(policy)
    off = helm.template("admissionGate.soleAllocator=false")
    names = {d["metadata"]["name"] for d in by_kind(off, "ValidatingAdmissionPolicy")}
    assert names == {
        "carve-kubelet-plugin-own-node-slices",
        "carve-kubelet-plugin-own-node-pods",
        "carve-kubelet-plugin-own-node-finalizer",
        "carve-controller-pod-writes",  # not the gate's: the controller's RBAC is there anyway
        "carve-leader-fence",  # with leader election (two replicas by default)
    }


def _env_of(docs: list[dict[str, Any]], workload: str, **field_refs: str) -> dict[str, str]:
    """The environment the workload's main container starts with (ConfigMaps resolved)."""
    pod = one(docs, workload)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = field_refs[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _container(docs: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    [container] = one(docs, workload)["spec"]["template"]["spec"]["containers"]
    return container


def test_the_components_accept_the_settings_the_chart_gives_them(helm: Helm) -> None:
    docs = helm.template(
        "controller.nativeFallbackAfter=10m",
        "controller.packingPolicy=least-waste",
        "logging.format=text",
        "logging.level=debug",
        "metrics.port=9090",
        "plugin.kubeletDir=/data/kubelet/",
        "plugin.cdiDir=/etc/cdi",
        "plugin.foreignInstances=refuse-gpu",
        "plugin.driverRoot=/run/nvidia/driver",
        "plugin.simulate.enabled=true",
        "plugin.health.fatalXids=79",
        "plugin.health.degradedTaintEffect=None",
        "plugin.health.pollPeriod=2s",
    )
    pod_fields = {"metadata.name": "carve-controller-abc", "metadata.namespace": "carve-system"}
    c_env = _env_of(docs, "Deployment", **pod_fields)
    c_opts = controller_main.parse_options(_container(docs, "Deployment").get("args", []), c_env)
    assert c_opts.driver_name == "mig.carve.dev"
    assert c_opts.device_classes == Contract().default_classes
    assert c_opts.native_fallback_after == 600.0
    assert c_opts.packing_policy is Policy.LEAST_WASTE
    assert c_opts.lease is not None and c_opts.lease.namespace == "carve-system"
    assert c_opts.lease.identity == "carve-controller-abc"
    assert (c_opts.http_address, c_opts.log_format, c_opts.log_level) == (":9090", "text", "DEBUG")

    p_env = _env_of(
        docs, "DaemonSet", **{"spec.nodeName": "gpu-1", "metadata.namespace": "carve-system"}
    )
    p_args = _container(docs, "DaemonSet")["args"]
    p_opts = plugin_main.parse_options(p_args, p_env)
    assert p_opts.node_name == "gpu-1"
    assert p_opts.registry_dir == Path("/data/kubelet/plugins_registry")
    assert p_opts.plugins_dir == Path("/data/kubelet/plugins")
    assert p_opts.checkpoint_dir == Path("/data/kubelet/plugins/mig.carve.dev")
    assert p_opts.cdi_root == Path("/etc/cdi")
    assert p_opts.driver_root == Path("/run/nvidia/driver")
    assert p_opts.foreign_instances == "refuse-gpu"
    assert p_opts.simulate == Path("/run/carve-simulator/config.yaml")
    assert not p_opts.cleanup_on_exit
    assert p_opts.health.fatal_xids == {79} and p_opts.health_poll_period == 2.0
    assert p_opts.health.degraded_effect.value == "None"
    assert p_opts.health.fatal_effect.value == "NoExecute"  # the chart's default
    # MPS daemons in pods of their own: carve's image, pulled as the plugin's, in its namespace.
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert p_opts.mps_daemon_image == f"ghcr.io/carve-dev/carve:{chart['appVersion']}"
    assert p_opts.mps_daemon_image == _container(docs, "DaemonSet")["image"]
    assert p_opts.mps_daemon_namespace == "carve-system"
    assert p_opts.mps_daemon_pull_policy == "IfNotPresent"


def test_defaults_parse_too(helm: Helm) -> None:
    docs = helm.template()
    c_env = _env_of(docs, "Deployment", **{"metadata.name": "c", "metadata.namespace": "n"})
    c_opts = controller_main.parse_options([], c_env)
    assert c_opts.lease is not None
    assert c_opts.packing_policy is DEFAULT_POLICY  # the chart ships the controller's default
    p_env = _env_of(docs, "DaemonSet", **{"spec.nodeName": "n", "metadata.namespace": "ns"})
    p_opts = plugin_main.parse_options([], p_env)
    assert p_opts.simulate is None and p_opts.driver_root == Path("/")


def test_the_plugin_is_probed_as_its_start_up_allows(helm: Helm) -> None:
    """Issue 45, item 5: a startupProbe on /healthz holds the liveness probe back until the
    process serves at all, with room for far more than the measured start-up (under 2 s to
    /healthz, docs/kubeletplugin.md); /readyz gets the time its apiserver check may take."""
    from kubeletplugin.startup import READYZ_API_TIMEOUT

    container = one(helm.template(), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["httpGet"] == liveness["httpGet"] == {"path": "/healthz", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz"
    assert readiness["timeoutSeconds"] > 2 * READYZ_API_TIMEOUT  # one try and its one retry


def _mounts(docs: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Volume name -> (mount path in the plugin container, the mount), for hostPath volumes."""
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    return {name: (path, mounts[name]) for name, path in host.items()}


def test_host_paths_are_mounted_where_the_host_has_them(helm: Helm) -> None:
    default = _mounts(helm.template())
    assert set(default) == {"plugins-registry", "plugins", "cdi", "dev"}
    docs = helm.template(
        "plugin.kubeletDir=/data/kubelet",
        "plugin.cdiDir=/etc/cdi",
        "plugin.driverRoot=/run/nvidia/driver",
        "plugin.devRoot=/run/nvidia/driver",
    )
    mounts = _mounts(docs)
    assert set(mounts) == {"plugins-registry", "plugins", "cdi", "dev", "driver-root"}
    for host_path, mount in mounts.values():
        assert mount["mountPath"] == host_path
    assert mounts["plugins"][0] == "/data/kubelet/plugins"
    assert mounts["plugins"][1]["mountPropagation"] == "Bidirectional"
    assert mounts["driver-root"][1]["readOnly"] is True
    assert mounts["driver-root"][1]["mountPropagation"] == "HostToContainer"


def test_simulation_mode_keeps_the_state_on_the_host(helm: Helm) -> None:
    docs = helm.template("plugin.simulate.enabled=true", "plugin.simulate.stateDir=/srv/sim")
    config = yaml.safe_load(one(docs, "ConfigMap", "carve-simulator")["data"]["config.yaml"])
    assert config["state"] == "/srv/sim/state.json"
    assert config["gpus"] == ["A100-SXM4-40GB"]
    assert _mounts(docs)["simulator-state"][0] == "/srv/sim"
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    assert "uuid_seed" in init["command"][-1] and "$NODE_NAME" in init["command"][-1]
    default = {d["metadata"]["name"] for d in by_kind(helm.template(), "ConfigMap")}
    assert default == {"carve-controller", "carve-kubelet-plugin"}


@pytest.mark.parametrize(
    ("sets", "leader", "strategy"),
    [
        ((), "true", None),
        (("controller.replicas=1",), "false", "Recreate"),
        (("controller.replicas=0",), "false", "Recreate"),
        (("controller.replicas=1", "controller.leaderElection.enabled=true"), "true", None),
        (("controller.replicas=3",), "true", None),
    ],
)
def test_leader_election_follows_the_replicas(
    helm: Helm, sets: tuple[str, ...], leader: str, strategy: str | None
) -> None:
    docs = helm.template(*sets)
    assert one(docs, "ConfigMap", "carve-controller")["data"]["CARVE_LEADER_ELECT"] == leader
    deployment = one(docs, "Deployment")
    assert deployment["spec"].get("strategy", {}).get("type") == strategy


def _checksums(docs: list[dict[str, Any]]) -> Mapping[str, str]:
    return {
        kind: one(docs, kind)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        for kind in ("Deployment", "DaemonSet")
    }


@pytest.mark.parametrize(
    ("value", "rolls"),
    [
        ("logging.level=debug", {"Deployment", "DaemonSet"}),
        ("controller.nativeFallbackAfter=5m", {"Deployment"}),
        ("plugin.foreignInstances=adopt", {"DaemonSet"}),
        ("plugin.simulate.config.options.latency=zero", set()),  # simulation mode is off
        ("image.tag=0.2.0", set()),  # the image is in the pod template itself
    ],
)
def test_a_settings_change_changes_the_pod_templates_checksum(
    helm: Helm, value: str, rolls: set[str]
) -> None:
    before, after = _checksums(helm.template()), _checksums(helm.template(value))
    assert {kind for kind in before if before[kind] != after[kind]} == rolls


def test_a_simulator_config_change_rolls_the_plugins(helm: Helm) -> None:
    on = "plugin.simulate.enabled=true"
    before = _checksums(helm.template(on))
    after = _checksums(helm.template(on, "plugin.simulate.config.options.latency=zero"))
    assert before["DaemonSet"] != after["DaemonSet"]
    assert before["Deployment"] == after["Deployment"]


def test_optional_parts(helm: Helm) -> None:
    docs = helm.template(
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.release=prometheus",
        "admissionGate.namespaceSelector.matchLabels.carve=on",
    )
    monitors = by_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"carve-controller", "carve-kubelet-plugin"}
    assert all(m["metadata"]["labels"]["release"] == "prometheus" for m in monitors)
    for binding in by_kind(docs, "MutatingAdmissionPolicyBinding"):
        selector = binding["spec"]["matchResources"]["namespaceSelector"]
        assert selector == {"matchLabels": {"carve": "on"}}
    off = helm.template("admissionGate.enabled=false", "deviceClasses.enabled=false")
    assert not by_kind(off, "MutatingAdmissionPolicy") and not by_kind(off, "DeviceClass")


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True)


def test_the_leader_fence_comes_with_leader_election_only(helm: Helm) -> None:
    """One replica has no Lease to check a write against (issue 41.4)."""
    names = {
        d["metadata"]["name"]
        for d in by_kind(helm.template("controller.replicas=1"), "ValidatingAdmissionPolicy")
    }
    assert "carve-leader-fence" not in names
    binding = one(helm.template(), "ValidatingAdmissionPolicyBinding", "carve-leader-fence")
    assert binding["spec"]["paramRef"] == {
        "name": "carve-controller",
        "namespace": "carve-system",
        "parameterNotFoundAction": "Allow",
    }
