"""The kubelet rules the simulated nodes follow (pure functions over pod and claim JSON)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from nodesim.lifecycle import (
    EXTENDED_RESOURCES_ENTRY,
    CdiResolutionError,
    ClaimsNotReadyError,
    PodSpecError,
    claim_names,
    exit_code,
    failed_to_start_status,
    finished_status,
    load_cdi_specs,
    pod_claims,
    resolve_cdi,
    run_seconds,
    running_status,
)


def pod(**spec: Any) -> dict[str, Any]:
    annotations = spec.pop("annotations", {})
    status = spec.pop("status", {})
    return {
        "metadata": {"namespace": "ns", "name": "p", "uid": "pod-uid", "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "img"}], **spec},
        "status": status,
    }


def claim(
    name: str, *, allocated: bool = True, reserved: tuple[str, ...] = ("pod-uid",)
) -> dict[str, Any]:
    status: dict[str, Any] = {"reservedFor": [{"resource": "pods", "uid": u} for u in reserved]}
    if allocated:
        status["allocation"] = {
            "devices": {"results": [{"driver": "mig.carve.dev", "pool": "n", "device": "gpu-0"}]}
        }
    return {"metadata": {"namespace": "ns", "name": name, "uid": f"uid-{name}"}, "status": status}


@pytest.mark.parametrize(
    ("containers", "annotations", "expected"),
    [
        ([{"name": "a", "command": ["sleep", "5"]}], {}, 5.0),
        ([{"name": "a", "command": ["sh", "-c", "sleep 2.5"]}], {}, 2.5),
        ([{"name": "a", "command": ["sleep"], "args": ["3"]}], {}, 3.0),
        (
            [{"name": "a", "command": ["sleep", "1"]}, {"name": "b", "command": ["sleep", "4"]}],
            {},
            4.0,
        ),
        ([{"name": "a", "command": ["sleep", "1"]}, {"name": "b", "command": ["serve"]}], {}, None),
        ([{"name": "a", "command": ["nvidia-smi", "-L"]}], {}, None),
        ([{"name": "a"}], {}, None),
        ([{"name": "a", "command": ["serve"]}], {"nodesim.carve.dev/run-seconds": "7"}, 7.0),
    ],
)
def test_run_seconds(
    containers: list[Any], annotations: dict[str, str], expected: float | None
) -> None:
    assert run_seconds(pod(containers=containers, annotations=annotations)) == expected


def test_bad_annotations_are_named() -> None:
    with pytest.raises(PodSpecError, match="run-seconds"):
        run_seconds(pod(annotations={"nodesim.carve.dev/run-seconds": "soon"}))
    with pytest.raises(PodSpecError, match="exit-code"):
        exit_code(pod(annotations={"nodesim.carve.dev/exit-code": "x"}))


def test_claim_names_from_spec_and_status() -> None:
    p = pod(
        resourceClaims=[
            {"name": "direct", "resourceClaimName": "shared"},
            {"name": "tmpl", "resourceClaimTemplateName": "t"},
            {"name": "later", "resourceClaimTemplateName": "t"},
            {"name": "none", "resourceClaimTemplateName": "t"},
        ],
        status={
            "resourceClaimStatuses": [
                {"name": "tmpl", "resourceClaimName": "p-tmpl-abcde"},
                {"name": "none"},
            ]
        },
    )
    assert claim_names(p) == [("direct", "shared"), ("tmpl", "p-tmpl-abcde"), ("later", None)]


def test_the_extended_resource_claim_is_prepared_like_the_pods_own() -> None:
    """As the kubelet does: the claim kube-scheduler made for the pod's resources.limits."""
    p = pod(
        resourceClaims=[{"name": "direct", "resourceClaimName": "shared"}],
        status={
            "extendedResourceClaimStatus": {
                "resourceClaimName": "p-extended-resources-x7k2q",
                "requestMappings": [],
            }
        },
    )
    assert claim_names(p) == [
        ("direct", "shared"),
        (EXTENDED_RESOURCES_ENTRY, "p-extended-resources-x7k2q"),
    ]


def test_pod_claims_requires_allocated_and_reserved_claims() -> None:
    p = pod(resourceClaims=[{"name": "c", "resourceClaimName": "c1"}])
    [pc] = pod_claims(p, {"c1": claim("c1")})
    assert (pc.entry, pc.ref.name, pc.ref.uid, pc.drivers) == (
        "c",
        "c1",
        "uid-c1",
        ("mig.carve.dev",),
    )
    with pytest.raises(ClaimsNotReadyError, match="not found"):
        pod_claims(p, {})
    with pytest.raises(ClaimsNotReadyError, match="not allocated"):
        pod_claims(p, {"c1": claim("c1", allocated=False)})
    with pytest.raises(ClaimsNotReadyError, match="not reserved"):
        pod_claims(p, {"c1": claim("c1", reserved=("other",))})


def test_statuses_follow_the_kubelet_shape() -> None:
    p = pod()
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    running = running_status(p, t0)["status"]
    assert running["phase"] == "Running"
    assert (
        running["containerStatuses"][0]["state"]["running"]["startedAt"] == "2026-01-01T00:00:00Z"
    )
    assert {c["type"]: c["status"] for c in running["conditions"]}["Ready"] == "True"
    done = finished_status(p, t0, t0 + dt.timedelta(seconds=3), 0)["status"]
    assert done["phase"] == "Succeeded"
    assert done["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    assert finished_status(p, t0, t0, 2)["status"]["phase"] == "Failed"
    failed = failed_to_start_status(p, t0, "placement taken")["status"]
    assert (failed["phase"], failed["message"]) == ("Failed", "placement taken")


def test_cdi_ids_resolve_to_specs_on_disk(tmp_path: Path) -> None:
    spec = {
        "cdiVersion": "0.6.0",
        "kind": "mig.carve.dev/claim",
        "containerEdits": {"env": ["COMMON=1"]},
        "devices": [
            {
                "name": "u1-gpu-0-mig-1g5gb-19-0",
                "containerEdits": {
                    "env": ["NVIDIA_VISIBLE_DEVICES=MIG-x"],
                    "deviceNodes": [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidiactl"}],
                },
            }
        ],
    }
    (tmp_path / "mig.carve.dev-claim_u1.json").write_text(json.dumps(spec))
    (tmp_path / "broken.json").write_text("{")
    specs = load_cdi_specs([tmp_path, tmp_path / "missing"])
    edits = resolve_cdi(["mig.carve.dev/claim=u1-gpu-0-mig-1g5gb-19-0"], specs)
    assert edits.env == ("COMMON=1", "NVIDIA_VISIBLE_DEVICES=MIG-x")
    assert edits.device_nodes == ("/dev/nvidia0", "/dev/nvidiactl")
    with pytest.raises(CdiResolutionError, match="not defined"):
        resolve_cdi(["mig.carve.dev/claim=u2-gpu-0"], specs)
    with pytest.raises(CdiResolutionError, match="fully qualified"):
        resolve_cdi(["gpu-0"], specs)
