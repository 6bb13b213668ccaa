"""The shipped gate policy and the controller agree on which DeviceClasses are carve's.

The policy (CEL in deploy/manifests/30-admission-gate.yaml) and `CarveClasses` encode the same
rule twice because a MutatingAdmissionPolicy cannot call Python; this test keeps them in step.
Its behaviour on a real apiserver is tested in tests/controller/cluster/test_admission_policy.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.objects import CarveClasses
from driver.contract import DEFAULT_CONTRACT

SCHEDULING_GATE = DEFAULT_CONTRACT.scheduling_gate

POLICY = Path(__file__).resolve().parents[2] / "deploy" / "manifests" / "30-admission-gate.yaml"


CLASSES = POLICY.parent / "10-deviceclasses.yaml"


def _policies() -> list[dict[str, Any]]:
    """The claim policies (their parameters are the claims or templates)."""
    return [d for d in _all_policies() if "paramKind" in d["spec"]]


def _all_policies() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(POLICY.read_text()) if d]
    return [d for d in docs if d["kind"] == "MutatingAdmissionPolicy"]


def test_the_extended_resource_policy_names_exactly_the_shipped_classes_names() -> None:
    """The policy gates pods by resource name; the names are the classes' extendedResourceName
    (rendered from the same chart values), and the implicit names follow the class rule."""
    (policy,) = [d for d in _all_policies() if "paramKind" not in d["spec"]]
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    classes = [d for d in yaml.safe_load_all(CLASSES.read_text()) if d]
    shipped = {
        c["spec"]["extendedResourceName"] for c in classes if "extendedResourceName" in c["spec"]
    }
    listed = set(yaml.safe_load(variables["names"]))
    assert listed == shipped
    assert "nvidia.com/mig-3g.40gb" in listed
    rule = CarveClasses()
    for name in sorted(rule.names):
        assert f'"{name}"' in variables["carveName"]
    assert f'endsWith("{rule.suffix}")' in variables["carveName"]
    assert '"deviceclass.resource.kubernetes.io/"' in variables["carveName"]
    mutation = policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    assert f'name: "{SCHEDULING_GATE}"' in mutation


@pytest.mark.parametrize("policy", _policies(), ids=lambda p: p["metadata"]["name"])
def test_policy_uses_the_controller_class_rule_and_gate(policy: dict[str, Any]) -> None:
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    rule = CarveClasses()
    for name in sorted(rule.names):
        assert f'"{name}"' in variables["usesCarve"]
    assert f'endsWith("{rule.suffix}")' in variables["usesCarve"]
    mutation = policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    assert f'name: "{SCHEDULING_GATE}"' in mutation
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]


def test_both_claim_sources_are_covered() -> None:
    kinds = {p["spec"]["paramKind"]["kind"] for p in _policies()}
    assert kinds == {"ResourceClaimTemplate", "ResourceClaim"}
