"""The committed stubs are fresh, and the contracts match the kubelet's wire names and numbers."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kubeletplugin._generated import (
    dra_health_v1_pb2,
    dra_health_v1alpha1_pb2,
    dra_v1_pb2,
    dra_v1beta1_pb2,
    pluginregistration_v1_pb2,
)

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "kubeletplugin" / "_generated"


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gen_protos", REPO / "hack" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    gen = _gen_protos()
    gen.generate(tmp_path)
    problems = gen.diff_trees(tmp_path, COMMITTED)
    assert not problems, "stubs are stale; run `python hack/gen_protos.py`:\n" + "\n".join(
        problems[:40]
    )


def test_a_changed_proto_is_reported_as_stale(tmp_path: Path) -> None:
    gen = _gen_protos()
    protos = tmp_path / "proto"
    shutil.copytree(REPO / "proto", protos)
    edited = protos / "dra_v1.proto"
    edited.write_text(
        edited.read_text().replace("string error = 1;", "string error = 1;\n  string extra = 2;")
    )
    out = tmp_path / "out"
    gen.generate(out, proto_dir=protos)
    problems = gen.diff_trees(out, COMMITTED)
    assert any("dra_v1_pb2" in line for line in problems)


def test_a_hand_edited_stub_is_reported_as_stale(tmp_path: Path) -> None:
    gen = _gen_protos()
    fresh = tmp_path / "fresh"
    gen.generate(fresh)
    edited = tmp_path / "edited"
    shutil.copytree(COMMITTED, edited)
    target = edited / "pluginregistration_v1_pb2_grpc.py"
    target.write_text(target.read_text() + "\n# hand edit\n")
    (edited / "leftover_pb2.py").write_text("")
    problems = gen.diff_trees(fresh, edited)
    assert any("hand edit" in line for line in problems)
    assert any("leftover_pb2.py" in line for line in problems)


@pytest.mark.parametrize(
    ("module", "service", "methods"),
    [
        (
            dra_v1_pb2,
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
            {"NodePrepareResources": False, "NodeUnprepareResources": False},
        ),
        (
            dra_v1beta1_pb2,
            "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
            {"NodePrepareResources": False, "NodeUnprepareResources": False},
        ),
        (dra_health_v1alpha1_pb2, "v1alpha1.DRAResourceHealth", {"NodeWatchResources": True}),
        (dra_health_v1_pb2, "v1.DRAResourceHealth", {"NodeWatchResources": True}),
        (
            pluginregistration_v1_pb2,
            "pluginregistration.Registration",
            {"GetInfo": False, "NotifyRegistrationStatus": False},
        ),
    ],
)
def test_full_method_names_match_the_kubelet(
    module: ModuleType, service: str, methods: dict[str, bool]
) -> None:
    services = {s.full_name: s for s in module.DESCRIPTOR.services_by_name.values()}
    assert list(services) == [service]
    found = {m.name: m.server_streaming for m in services[service].methods}
    assert found == methods
    assert not any(m.client_streaming for m in services[service].methods)


_DRA_FIELDS = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
}
_DEVICE_V1BETA1 = {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
_HEALTH_FIELDS = {
    "NodeWatchResourcesRequest": {},
    "NodeWatchResourcesResponse": {"devices": 1},
    "DeviceIdentifier": {"pool_name": 1, "device_name": 2},
    "DeviceHealth": {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    },
}
_REGISTRATION_FIELDS = {
    "InfoRequest": {},
    "PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "RegistrationStatus": {"plugin_registered": 1, "error": 2},
    "RegistrationStatusResponse": {},
}


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (dra_v1_pb2, {**_DRA_FIELDS, "Device": {**_DEVICE_V1BETA1, "share_id": 5}}),
        (dra_v1beta1_pb2, {**_DRA_FIELDS, "Device": _DEVICE_V1BETA1}),
        (dra_health_v1alpha1_pb2, _HEALTH_FIELDS),
        (dra_health_v1_pb2, _HEALTH_FIELDS),
        (pluginregistration_v1_pb2, _REGISTRATION_FIELDS),
    ],
)
def test_messages_and_field_numbers_match_the_contract(
    module: ModuleType, expected: dict[str, dict[str, int]]
) -> None:
    messages = module.DESCRIPTOR.message_types_by_name
    assert set(messages) == set(expected)
    for name, fields in expected.items():
        found = {f.name: f.number for f in messages[name].fields}
        assert found == fields, name


@pytest.mark.parametrize(
    ("module", "package"),
    [
        (dra_v1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1"),
        (dra_v1beta1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1beta1"),
        (dra_health_v1alpha1_pb2, "v1alpha1"),
        (dra_health_v1_pb2, "v1"),
        (pluginregistration_v1_pb2, "pluginregistration"),
    ],
)
def test_proto_packages_are_upstreams(module: ModuleType, package: str) -> None:
    assert module.DESCRIPTOR.package == package


def test_v1_share_id_has_presence_and_v1beta1_has_no_share_id() -> None:
    device = dra_v1_pb2.Device(pool_name="p", device_name="d")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id")
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name


def test_health_status_enum_values() -> None:
    for module in (dra_health_v1alpha1_pb2, dra_health_v1_pb2):
        enum = module.DESCRIPTOR.enum_types_by_name["HealthStatus"]
        assert {v.name: v.number for v in enum.values} == {
            "UNKNOWN": 0,
            "HEALTHY": 1,
            "UNHEALTHY": 2,
        }


def test_v1_and_v1beta1_encode_the_same_bytes_for_common_fields() -> None:
    """v1beta1 and v1 are wire compatible for everything but share_id."""
    kwargs = {"request_names": ["r"], "pool_name": "p", "device_name": "d", "cdi_device_ids": ["x"]}
    v1 = dra_v1_pb2.Device(**kwargs).SerializeToString()
    v1beta1 = dra_v1beta1_pb2.Device(**kwargs).SerializeToString()
    assert v1 == v1beta1
    decoded = dra_v1beta1_pb2.Device.FromString(
        dra_v1_pb2.Device(share_id="s", **kwargs).SerializeToString()
    )
    assert decoded.device_name == "d"
    assert list(decoded.cdi_device_ids) == ["x"]
