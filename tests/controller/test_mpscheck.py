"""MPS settings are checked at placement (issue 16): claim and class config, a container's own
per-client limits, and memory floors, through the reconciler and the real placement engine."""

from __future__ import annotations

import copy
from dataclasses import replace
from decimal import Decimal
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controller.claims import parse_claim_spec
from controller.mpscheck import with_floors
from controller.objects import EventType, Kind
from driver.apiobject import Obj
from tests.support.engine_cluster import DRIVER, Cluster, device_class, profile_claim

GIB = 2**30


def _mps(**settings: Any) -> Obj:
    return {
        "driver": DRIVER,
        "parameters": {
            "apiVersion": "mig.carve.dev/v1alpha1",
            "kind": "MigDeviceConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": settings},
        },
    }


def _with_config(c: Obj, opaque: Obj, requests: list[str] | None = None) -> Obj:
    entry: Obj = {"opaque": opaque}
    if requests is not None:
        entry["requests"] = requests
    c["spec"]["devices"]["config"] = [entry]
    return c


def _containers(c: Cluster, pod_name: str, *containers: Obj) -> None:
    p = c.writer.objects[pod_name]
    p["spec"]["containers"] = list(containers)
    c.rec.enqueue(Kind.POD, EventType.MODIFIED, c.writer.put(p))


def _client(name: str, claim_entry: str | None = "c0", **env: str) -> Obj:
    out: Obj = {"name": name, "env": [{"name": k, "value": v} for k, v in env.items()]}
    if claim_entry is not None:
        out["resources"] = {"claims": [{"name": claim_entry}]}
    return out


def _warning(c: Cluster, pod_name: str) -> str:
    events = c.events_of(pod_name)
    assert events, f"no event for {pod_name}"
    assert events[-1][1] == "Warning", events
    return events[-1][3]


def _first_available(name: str, *profiles: str) -> Obj:
    c = profile_claim(name, profiles[0])
    c["spec"]["devices"]["requests"] = [
        {
            "name": "gpu",
            "firstAvailable": [
                {
                    "name": p.replace(".", "-"),
                    "deviceClassName": DRIVER,
                    "selectors": [
                        {"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "{p}"'}}
                    ],
                }
                for p in profiles
            ],
        }
    ]
    return c


def _whole_gpu_claim(name: str) -> Obj:
    c = profile_claim(name, "unused")
    c["spec"]["devices"]["requests"][0]["exactly"] = {"deviceClassName": "gpu.carve.dev"}
    return c


def _profile(c: Cluster, claim_name: str) -> str:
    alloc = c.allocation(claim_name)
    assert alloc is not None, c.recorder.events
    (result,) = alloc["devices"]["results"]
    return str(result["device"])


# -- MPS on whole GPUs, from the claim or from its class (issue 31, point 4) -----------------------


def test_mps_on_a_whole_gpu_from_the_claim_config_is_placed() -> None:
    """NVIDIA's driver shares a whole GPU through MPS (its gpu-test-mps examples); before,
    carve refused it with InvalidMpsSettings ('MPS sharing is supported on MIG slices only')."""
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    c.submit(_with_config(_whole_gpu_claim("whole"), _mps(defaultActiveThreadPercentage=50)))
    c.rec.step()
    assert _profile(c, "whole") == "gpu-0", c.recorder.events


def test_mps_on_a_whole_gpu_from_the_class_config_is_placed() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    cls = device_class("gpu.carve.dev", "gpu")
    cls["spec"]["config"] = [{"opaque": _mps()}]
    cls["metadata"]["resourceVersion"] = "2"
    c.rec.enqueue(Kind.CLASS, EventType.MODIFIED, cls)
    c.submit(_whole_gpu_claim("whole"))
    c.rec.step()
    assert _profile(c, "whole") == "gpu-0", c.recorder.events


def test_a_pinned_limit_above_a_whole_gpus_memory_says_so() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    claim = _with_config(_whole_gpu_claim("big"), _mps(defaultPinnedDeviceMemoryLimit="100Gi"))
    p = c.submit(claim)
    c.rec.step()
    message = _warning(c, p)
    assert "an MPS pinned device memory limit of 102400Mi" in message
    assert "but the largest device it matches has 81559Mi" in message
    assert c.allocation("big") is None
    # One that fits the GPU: placed.
    fits = _with_config(_whole_gpu_claim("fits"), _mps(defaultPinnedDeviceMemoryLimit="60Gi"))
    c.submit(fits)
    c.rec.step()
    assert _profile(c, "fits") == "gpu-0", c.recorder.events


def test_mps_for_the_slice_request_of_a_mixed_claim_is_placed() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB", "H100-SXM5-80GB"]})
    mixed = profile_claim("mixed", "1g.10gb")
    mixed["spec"]["devices"]["requests"].append(
        {"name": "whole", "exactly": {"deviceClassName": "gpu.carve.dev"}}
    )
    c.submit(_with_config(mixed, _mps(), requests=["gpu"]))
    c.rec.step()
    alloc = c.allocation("mixed")
    assert alloc is not None, c.recorder.events
    assert len(alloc["devices"]["results"]) == 2


def test_requests_of_one_claim_with_different_mps_settings_are_refused() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    two = profile_claim("two", "1g.10gb")
    two["spec"]["devices"]["requests"].append(copy.deepcopy(two["spec"]["devices"]["requests"][0]))
    two["spec"]["devices"]["requests"][1]["name"] = "other"
    two["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": _mps(defaultActiveThreadPercentage=30)},
        {"requests": ["other"], "opaque": _mps(defaultActiveThreadPercentage=60)},
    ]
    p = c.submit(two)
    c.rec.step()
    assert "requests 'gpu', 'other' ask for different MPS settings" in _warning(c, p)
    # The same settings for both: one daemon serves the two slices.
    two["spec"]["devices"]["config"][1]["opaque"] = _mps(defaultActiveThreadPercentage=30)
    two["metadata"]["name"] = "same"
    c.submit(two)
    c.rec.step()
    assert c.allocation("same") is not None


# -- rule 2: pinned memory fits the slice ---------------------------------------------------------


def test_a_pinned_limit_picks_the_first_alternative_large_enough() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    fa = _first_available("fa", "1g.10gb", "2g.20gb")
    c.submit(_with_config(fa, _mps(defaultPinnedDeviceMemoryLimit="12Gi")))
    c.rec.step()
    assert "-mig-2g20gb-" in _profile(c, "fa")
    assert c.allocation("fa")["devices"]["results"][0]["request"] == "gpu/2g-20gb"  # type: ignore[index]


def test_without_a_limit_the_first_alternative_wins() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    c.submit(_with_config(_first_available("fa", "1g.10gb", "2g.20gb"), _mps()))
    c.rec.step()
    assert "-mig-1g10gb-" in _profile(c, "fa")


def test_a_pinned_limit_above_every_matching_slice_says_so() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    p = c.submit(
        _with_config(profile_claim("big", "1g.10gb"), _mps(defaultPinnedDeviceMemoryLimit="20Gi"))
    )
    c.rec.step()
    message = _warning(c, p)
    assert "ResourceClaim ns/big, request gpu: an MPS pinned device memory limit of 20480Mi" in (
        message
    )
    assert "but the largest device it matches has 9" in message  # 1g.10gb: just under 10Gi
    assert c.allocation("big") is None


# -- per-client limits: a container's own variables ------------------------------------------------


def test_a_client_limit_raises_the_floor_of_the_claim_it_uses() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    p = c.submit(_with_config(_first_available("fa", "1g.10gb", "2g.20gb"), _mps()))
    _containers(c, p, _client("main", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=12G"))
    c.rec.step()
    assert "-mig-2g20gb-" in _profile(c, "fa")


def test_a_bad_client_thread_percentage_is_refused_naming_the_container() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    p = c.submit(_with_config(profile_claim("s", "1g.10gb"), _mps()))
    _containers(c, p, _client("trainer", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="150"))
    c.rec.step()
    message = _warning(c, p)
    assert (
        "spec.containers[0] (trainer).env: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='150': must be an "
        "integer from 1 to 100"
    ) in message
    assert c.allocation("s") is None


def test_a_bad_client_pinned_limit_is_refused() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    p = c.submit(_with_config(profile_claim("s", "1g.10gb"), _mps()))
    _containers(c, p, _client("main", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="2 gigs"))
    c.rec.step()
    assert "'2 gigs' is not <device index>=<amount> such as 0=2G" in _warning(c, p)


def test_client_variables_without_mps_on_the_claim_are_refused() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    p = c.submit(profile_claim("plain", "1g.10gb"))
    _containers(c, p, _client("main", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="30"))
    c.rec.step()
    message = _warning(c, p)
    assert "spec.containers[0] (main) sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in message
    assert "no carve claim it uses (plain) has MPS sharing" in message
    assert c.allocation("plain") is None


def test_client_variables_in_a_container_without_carve_claims_are_not_carve_business() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    p = c.submit(_with_config(profile_claim("s", "1g.10gb"), _mps()))
    _containers(
        c,
        p,
        _client("gpu-user"),
        _client("sidecar", claim_entry=None, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="30"),
    )
    c.rec.step()
    assert c.allocation("s") is not None, c.recorder.events


def test_a_client_limit_above_an_allocated_shared_slice_is_refused() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    first = c.submit(_with_config(profile_claim("shared", "1g.10gb"), _mps()))
    c.rec.step()
    assert c.allocation("shared") is not None
    # A second pod joins the shared claim and asks for more pinned memory than the slice has.
    second = c.submit(copy.deepcopy(c.writer.objects["shared"]))
    _containers(c, second, _client("main", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=16G"))
    c.rec.step()
    message = _warning(c, second)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 16384Mi is more than the" in message
    assert "device that ResourceClaim shared (request gpu) holds" in message
    assert first != second


def test_a_client_limit_within_an_allocated_shared_slice_is_fine() -> None:
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    c.submit(_with_config(profile_claim("shared", "1g.10gb"), _mps()))
    c.rec.step()
    second = c.submit(copy.deepcopy(c.writer.objects["shared"]))
    _containers(
        c,
        second,
        _client(
            "main", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=4G", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25"
        ),
    )
    c.rec.step()
    assert not [e for e in c.events_of(second) if e[1] == "Warning"], c.events_of(second)


# -- with_floors as a property ------------------------------------------------------------------


@given(
    floors=st.dictionaries(st.sampled_from(["gpu/a", "gpu/b", "other"]), st.integers(1, 2**40)),
    own=st.integers(0, 2**40),
)
def test_floors_only_ever_raise_the_memory_request_of_the_floored_alternatives(
    floors: dict[str, int], own: int
) -> None:
    spec = parse_claim_spec(
        {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "firstAvailable": [
                            {
                                "name": n,
                                "deviceClassName": DRIVER,
                                "capacity": {"requests": {"memory": str(own)}},
                            }
                            for n in ("a", "b")
                        ],
                    }
                ]
            }
        },
        DRIVER,
    )
    floored = with_floors(spec, floors, DRIVER)
    memory = f"{DRIVER}/memory"
    pairs = zip(spec.requests[0].alternatives, floored.requests[0].alternatives, strict=True)
    for before, after in pairs:
        assert before.result_name == after.result_name
        got = dict(after.spec.capacity)[memory]
        assert got == max(Decimal(own), Decimal(floors.get(before.result_name, 0)))
        assert replace(after.spec, capacity=()) == replace(before.spec, capacity=())
