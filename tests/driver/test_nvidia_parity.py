"""NVIDIA's DRA driver's selectors and attributes against carve's published slices (issue 31.2).

Users arrive with manifests written for NVIDIA's driver and port them by changing the domain.
`data/nvidia_dra_driver.yaml` holds, from one commit of NVIDIA's repository, every CEL selector
of its example manifests and the attribute set (names, types) it publishes for GPU and MIG
devices. The slices here are the kubelet plugin's own, built as the plugin builds them
(`kubeletplugin.nodehardware.open_backend` on the NVML simulator, with its fake sysfs), for a node
with every GPU model carve knows plus an A100 whose MIG mode is off (the only way an Ampere
GPU is offered whole). Selectors are judged by carve's CEL evaluation over the facts the
controller reads from those slices (`controller.model.device_facts`), in kube-scheduler's
order: the class's selectors first, the request's only on devices the class admits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.model import device_facts
from driver.catalog import CATALOG
from driver.cel import CelDevice, CelError, SelectorEvaluator, Semver
from driver.contract import DEFAULT_CONTRACT
from driver.nvml import sim
from kubeletplugin.nodehardware import NodeHardware, open_backend

DATA = yaml.safe_load((Path(__file__).parent / "data" / "nvidia_dra_driver.yaml").read_text())
MANIFESTS = Path(__file__).parents[2] / "deploy" / "manifests" / "10-deviceclasses.yaml"
NVIDIA_DOMAIN = "gpu.nvidia.com"
DRIVER = DEFAULT_CONTRACT.driver
_MISSING = re.compile(r"no such key '([^']+)'")
_KINDS = {str: "string", int: "int", bool: "bool", Semver: "version"}


def _carve_classes() -> dict[str, tuple[str, ...]]:
    """carve's shipped DeviceClasses (the plain manifests rendered from the chart)."""
    docs = [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]
    return {
        d["metadata"]["name"]: tuple(s["cel"]["expression"] for s in d["spec"]["selectors"])
        for d in docs
        if d.get("kind") == "DeviceClass"
    }


def _port(expression: str) -> str:
    """Change only the domain, as a user porting the manifest would."""
    return expression.replace(NVIDIA_DOMAIN, DRIVER)


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("node")
    gpus: list[Any] = [*CATALOG, {"model": "A100-SXM4-40GB", "mig": False}]
    config = root / "sim.yaml"
    sim.sim_write_config(config, {"state": str(root / "state.json"), "gpus": gpus})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CARVE_SIM_CONFIG", "")  # open_backend sets it; leave no trace
        hw: NodeHardware = open_backend(config)
        try:
            slices = hw.resource_slices(driver=DRIVER, node_name="n", generation=1, split=True)
        finally:
            hw.close()
            sim.configure(None)
    yield [d for s in slices for d in s["spec"].get("devices") or ()]


@pytest.fixture(scope="module")
def facts(devices: list[dict[str, Any]]) -> list[CelDevice]:
    return [device_facts(d, DRIVER) for d in devices]


def _selector_id(entry: Mapping[str, Any]) -> str:
    where = entry["source"].rsplit("/", 2)[-2:]
    return "/".join(where) + ":" + " ".join(entry["expression"].split())[:60]


def _judge(evaluator: SelectorEvaluator, expression: str, device: CelDevice) -> bool | CelError:
    """The selector's result, where a missing attribute that NVIDIA's driver does not publish
    either (its own gpu-test6 still reads `index`, removed from the driver) is not carve's
    error: such an attribute is given a placeholder and the selector judged again, so the
    rest of it must evaluate cleanly (CEL would otherwise let one error hide another)."""
    kind = device.attribute(f"{DRIVER}/type")
    published = DATA["attributes"].get(kind, {}) if isinstance(kind, str) else {}
    while isinstance(result := evaluator.matches(expression, device), CelError):
        missing = _MISSING.search(result.detail)
        if missing is None or missing[1] in published or "/" in missing[1]:
            return result
        attributes = {name: value for name, value in device.attributes}
        if f"{DRIVER}/{missing[1]}" in attributes:
            return result  # present yet reported missing: not NVIDIA's gap
        attributes[f"{DRIVER}/{missing[1]}"] = 0
        device = CelDevice.of(DRIVER, attributes, dict(device.capacity))
    return result


@pytest.mark.parametrize("entry", DATA["selectors"], ids=_selector_id)
def test_every_example_selector_evaluates_on_carves_slices(
    entry: Mapping[str, Any], facts: list[CelDevice]
) -> None:
    classes = _carve_classes()
    if "deviceClass" in entry:  # a class's own selector: judged on every device
        gate: tuple[str, ...] = ()
    else:
        role = DATA["classes"][entry["deviceClassName"]]
        gate = classes[{"gpu": DEFAULT_CONTRACT.gpu_class, "mig": DEFAULT_CONTRACT.mig_class}[role]]
    expression = _port(entry["expression"])
    evaluator = SelectorEvaluator()
    judged, failures = 0, []
    for device in facts:
        admitted = evaluator.matches_all(gate, device)
        assert not isinstance(admitted, CelError), admitted.message
        if not admitted:
            continue
        judged += 1
        result = _judge(evaluator, expression, device)
        if isinstance(result, CelError):
            failures.append(f"{device.attribute(f'{DRIVER}/productName')}: {result.message}")
    assert judged, f"no carve device is admitted by the class of {entry['source']}"
    assert not failures, "\n".join(sorted(set(failures)))


@pytest.mark.parametrize("kind", sorted(DATA["attributes"]))
def test_every_device_carries_nvidias_attribute_set_with_its_types(
    kind: str, facts: list[CelDevice]
) -> None:
    """On the simulated node every platform fact is known, so the optional ones are there too
    (where NVML or sysfs cannot say, carve leaves them out as NVIDIA does: test_resourceslice)."""
    typed = [d for d in facts if d.attribute(f"{DRIVER}/type") == kind]
    assert typed
    for device in typed:
        for name, spec in DATA["attributes"][kind].items():
            qualified = name if "/" in name else f"{DRIVER}/{name}"
            value = device.attribute(qualified)
            assert value is not None, f"{kind} device lacks {name}"
            assert _KINDS[type(value)] == spec["type"], (name, value)


def test_a_selector_on_every_nvidia_attribute_ports(facts: list[CelDevice]) -> None:
    """What a user's own selector may read: each of NVIDIA's attributes, under carve's domain
    for NVIDIA's own names and unchanged for the standard ones."""
    evaluator = SelectorEvaluator()
    for kind, attributes in DATA["attributes"].items():
        for name in attributes:
            domain, _, short = name.rpartition("/")
            ref = f'device.attributes["{domain or DRIVER}"].{short}'
            expression = f'device.attributes["{DRIVER}"].type != "{kind}" || {ref} == {ref}'
            for device in facts:
                assert evaluator.matches(expression, device) is True, (kind, name)
