"""kube-scheduler's side of DeviceTaintRules (issue 31, point 1): for each rule, whether the real
v1.37 kube-scheduler allocates a device to a claim, next to what carve's controller decides from
the same rule (`controller.taintrules`, `controller.tolerations`), so carve's reading of
selectors, effects and tolerations is checked against the scheduler, not only against its
source.

Each case publishes its own pool (a fresh fake node) under its own driver name, and every rule
names that driver or that pool (or selects nothing): rules are cluster-scoped, and one
selecting every device (``deviceSelector: {}``) or a device name alone would taint the devices of
other tests on this control plane. Those two forms are covered from the tracker's source in
`tests/controller/test_taintrules.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from controller.taintrules import TaintRules
from controller.tolerations import blocking, parse_tolerations
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from tests.cluster.dra_objects import Api, claim_spec, claim_template, pod, pod_condition
from tests.cluster.dra_objects import unique_driver as _unique_driver

pytestmark = pytest.mark.cluster

KEY = "example.com/maintenance"
DEVICE = "gpu-0"  # the toy pool's whole GPU, which the claim's profile "full" selects
# (selector with {driver} and {pool} filled in, or None; effect; tolerated; carve blocks it)
CASES: list[tuple[Obj | None, str, bool, bool]] = [
    (None, "NoSchedule", False, False),
    ({"driver": "{driver}"}, "NoSchedule", False, True),
    ({"driver": "other.example.com"}, "NoSchedule", False, False),
    ({"pool": "{pool}"}, "NoSchedule", False, True),
    ({"pool": "{pool}-other"}, "NoSchedule", False, False),
    ({"pool": "{pool}", "device": DEVICE}, "NoSchedule", False, True),
    ({"pool": "{pool}", "device": "gpu-0-mig-4g-0"}, "NoSchedule", False, False),
    ({"driver": "{driver}", "pool": "{pool}", "device": DEVICE}, "None", False, False),
    ({"pool": "{pool}"}, "NoExecute", False, True),
    ({"pool": "{pool}"}, "NoSchedule", True, False),
]


@pytest.fixture
def driver(k8s_api: ApiClient) -> Iterator[str]:
    api = Api(k8s_api)
    name = _unique_driver()
    api.create_class(_class_of(name), name)
    yield name
    api.resource.delete_collection_resource_slice(field_selector=f"spec.driver={name}")
    api.resource.delete_device_class(_class_of(name))


def _class_of(driver: str) -> str:
    return f"class-{driver.split('.', maxsplit=1)[0]}"


def _rule(name: str, selector: Obj | None, effect: str, driver: str, pool: str) -> Obj:
    spec: Obj = {"taint": {"key": KEY, "value": "disk", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = {
            k: v.format(driver=driver, pool=pool) for k, v in selector.items()
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": spec,
    }


def _carve_blocks(rule: Obj, tolerations: list[Obj], driver: str, pool: str) -> bool:
    """What carve's controller decides for the device from the same rule object."""
    rules = TaintRules(driver)
    rules.observe(rule, {})
    taints = rules.taints(pool, DEVICE)
    return bool(blocking(taints, parse_tolerations(tolerations, "tolerations")))


def _scheduler_outcome(api: Api, namespace: str, name: str) -> str | None:
    got = api.read_pod(namespace, name)
    if got.get("spec", {}).get("nodeName"):
        return "allocated"
    cond = pod_condition(got, "PodScheduled")
    if cond and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
        return "refused"
    return None


@pytest.mark.parametrize(("selector", "effect", "tolerated", "blocks"), CASES)
def test_kube_scheduler_and_carve_agree_on_a_rule(  # noqa: PLR0917 - fixtures and case
    k8s_api: ApiClient,
    namespace: str,
    fake_node: Callable[..., str],
    driver: str,
    selector: Obj | None,
    effect: str,
    tolerated: bool,
    blocks: bool,
) -> None:
    api = Api(k8s_api)
    node = fake_node()  # carve names pools after nodes; so does the toy publisher
    rule = _rule(f"dtr-{namespace}"[:63], selector, effect, driver, node)
    tolerations = [{"key": KEY, "operator": "Exists"}] if tolerated else []
    assert _carve_blocks(rule, tolerations, driver, node) is blocks
    api.resource.create_device_taint_rule(rule)  # before the slices: the scheduler has it first
    try:
        api.publish_pool(driver, node)
        spec = claim_spec(_class_of(driver), driver, "full")
        spec["devices"]["requests"][0]["exactly"]["tolerations"] = tolerations
        api.resource.create_namespaced_resource_claim_template(
            namespace, claim_template("whole", spec)
        )
        api.create_pod(namespace, pod("p", template="whole"))
        outcome = wait_for(
            "kube-scheduler to allocate or refuse",
            lambda: _scheduler_outcome(api, namespace, "p"),
            timeout=60,
        )
    finally:
        try:
            api.resource.delete_device_taint_rule(rule["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 404:
                raise
    assert outcome == ("refused" if blocks else "allocated"), (rule, outcome)
