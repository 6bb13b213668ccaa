"""The reconciler with the real placement engine behind `EnginePlanner`.

ResourceSlices are built by `driver.resourceslice` exactly as the kubelet plugin publishes them,
nodes and pods are API-shaped dicts (tests/support/engine_cluster.py); only the writer is the
in-memory store of tests/support/reconciler.py. Checks that what the engine decides reaches the
claims correctly, that bad claims get specific messages while others are placed, and that no
memory slice is ever given twice across arrivals and releases.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.objects import EventType, Kind, has_gate
from controller.planner import EnginePlanner
from driver.contract import DEFAULT_CONTRACT
from tests.support.engine_cluster import (
    DRIVER,
    SCHEDULING_GATE,
    Cluster,
    Obj,
    profile_claim,
    slices,
)
from tests.support.reconciler import claim


def test_pods_are_placed_on_published_devices_with_node_selector() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"]})
    p = c.submit(profile_claim("c1", "3g.20gb"))
    c.rec.step()
    alloc = c.allocation("c1")
    assert alloc is not None
    (result,) = alloc["devices"]["results"]
    assert result["pool"] == "n1"
    assert result["device"].startswith("gpu-0-mig-3g20gb-")
    assert alloc["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]
    assert not has_gate(c.writer.objects[p], SCHEDULING_GATE)


def test_the_devices_binding_conditions_are_copied_into_the_allocation() -> None:
    """As kube-scheduler's allocator does; without them the scheduler would bind at once."""
    done, failed = DEFAULT_CONTRACT.carved_condition, DEFAULT_CONTRACT.carve_failed_condition
    with_conditions = Cluster({"n1": ["A100-SXM4-40GB"]}, binding_conditions=(done, failed))
    with_conditions.submit(profile_claim("c1", "1g.5gb"))
    with_conditions.rec.step()
    alloc = with_conditions.allocation("c1")
    assert alloc is not None
    (result,) = alloc["devices"]["results"]
    assert result["bindingConditions"] == [done]
    assert result["bindingFailureConditions"] == [failed]

    without = Cluster({"n1": ["A100-SXM4-40GB"]})
    without.submit(profile_claim("c1", "1g.5gb"))
    without.rec.step()
    alloc = without.allocation("c1")
    assert alloc is not None
    assert "bindingConditions" not in alloc["devices"]["results"][0]


def _report(c: Cluster, claim_name: str, condition: str, message: str = "m") -> None:
    """What the node's plugin writes into status.devices after carving (or failing to)."""
    claim_obj = c.writer.objects[claim_name]
    (result,) = claim_obj["status"]["allocation"]["devices"]["results"]
    claim_obj["status"]["devices"] = [
        {
            "driver": result["driver"],
            "pool": result["pool"],
            "device": result["device"],
            "conditions": [
                {"type": condition, "status": "True", "reason": "R", "message": message}
            ],
        }
    ]
    c.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, c.writer.put(claim_obj))


def _binding_cluster() -> Cluster:
    done, failed = DEFAULT_CONTRACT.carved_condition, DEFAULT_CONTRACT.carve_failed_condition
    return Cluster({"n1": ["A100-SXM4-40GB", "A100-SXM4-40GB"]}, binding_conditions=(done, failed))


def test_the_gate_stays_until_the_node_reports_the_carve() -> None:
    c = _binding_cluster()
    p = c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    assert c.allocation("c1") is not None
    assert has_gate(c.writer.objects[p], SCHEDULING_GATE)  # kube-scheduler must not see it yet
    c.rec.step()
    assert has_gate(c.writer.objects[p], SCHEDULING_GATE)
    _report(c, "c1", DEFAULT_CONTRACT.carved_condition)
    c.rec.step()
    assert not has_gate(c.writer.objects[p], SCHEDULING_GATE)


def test_a_failed_carve_is_cleared_and_placed_again_while_the_pod_stays_gated() -> None:
    c = _binding_cluster()
    p = c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    first = c.allocation("c1")
    assert first is not None
    _report(c, "c1", DEFAULT_CONTRACT.carve_failed_condition, "NVML error 999")
    c.rec.step()
    c.rec.step()
    again = c.allocation("c1")
    assert again is not None  # placed again (the node's taint steers it; not modelled here)
    assert "devices" not in c.writer.objects["c1"]["status"]  # the old verdict went with it
    assert has_gate(c.writer.objects[p], SCHEDULING_GATE)
    reasons = [e[2] for e in c.events_of(p)]
    assert "CarveFailed" in reasons
    (told,) = [e for e in c.events_of(p) if e[2] == "CarveFailed"]
    assert "NVML error 999" in told[3] and "placing again" in told[3]


def test_a_failed_carve_is_cleared_only_once_the_node_has_torn_it_down() -> None:
    """Invariant 4: while the node's finalizer is on the claim, the instance may still exist."""
    c = _binding_cluster()
    p = c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    node_finalizer = DEFAULT_CONTRACT.node_finalizer("n1")
    c.writer.objects["c1"]["metadata"]["finalizers"].append(node_finalizer)
    _report(c, "c1", DEFAULT_CONTRACT.carve_failed_condition, "NVML error 999")
    for _ in range(5):
        c.rec.step()
    assert c.writer.objects["c1"]["status"].get("devices")  # not cleared: the node holds it
    assert not [e for e in c.events_of(p) if e[2] == "CarveFailed"]
    claim_obj = c.writer.objects["c1"]
    claim_obj["metadata"]["finalizers"].remove(node_finalizer)
    c.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, c.writer.put(claim_obj))
    c.rec.step()
    c.rec.step()
    assert "devices" not in c.writer.objects["c1"]["status"]
    assert c.allocation("c1") is not None  # placed again
    assert len([e for e in c.events_of(p) if e[2] == "CarveFailed"]) == 1


def test_carve_failures_stop_being_retried_after_max_replans() -> None:
    c = _binding_cluster()
    p = c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    for _ in range(4):
        _report(c, "c1", DEFAULT_CONTRACT.carve_failed_condition, "NVML error 999")
        c.rec.step()
        c.rec.step()
    assert c.allocation("c1") is not None
    assert any(e[2] == "CarveFailed" and "carve failed 4 times" in e[3] for e in c.events_of(p))
    assert has_gate(c.writer.objects[p], SCHEDULING_GATE)


def test_two_3g_fill_the_a100_and_a_third_waits_with_the_engine_reason() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"]})
    for i in range(3):
        c.submit(profile_claim(f"c{i}", "3g.20gb"))
    c.rec.step()
    placed = [c.allocation(f"c{i}") for i in range(3)]
    assert sum(a is not None for a in placed) == 2
    devices = {a["devices"]["results"][0]["device"] for a in placed if a}
    assert len(devices) == 2
    waits = c.events_of("p2-c2")
    assert waits and waits[0][1] == "Warning"
    assert "3g.20gb" in waits[0][3]


def test_bad_claims_get_clear_messages_while_others_are_placed() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"]})
    cel_error = claim("cel")
    cel_error["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].nosuch == 1'}}
    ]
    bad = {
        "unknown": c.submit(claim("unknown", cls="9g.mig.carve.dev"), prio=10),
        "impossible": c.submit(profile_claim("impossible", "5g.99gb"), prio=10),
        "cel": c.submit(cel_error, prio=10),
        "too-many": c.submit(profile_claim("too-many", "1g.5gb", count=9), prio=10),
    }
    good = c.submit(profile_claim("good", "1g.5gb"))
    c.rec.step()
    assert c.allocation("good") is not None
    assert not has_gate(c.writer.objects[good], SCHEDULING_GATE)
    messages = {k: c.events_of(v) for k, v in bad.items()}
    for k, evs in messages.items():
        assert evs, f"no event for {k}"
        assert evs[0][1] == "Warning"
        assert c.allocation(k) is None
    assert "9g.mig.carve.dev" in messages["unknown"][0][3]
    assert "nosuch" in messages["cel"][0][3]


def test_pod_cpu_counts_before_it_is_bound() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"], "n2": ["A100-SXM4-40GB"]})
    first = profile_claim("c0", "1g.5gb")
    second = profile_claim("c1", "1g.5gb")
    names = []
    for cl in (first, second):
        name = c.submit(cl)
        p = c.writer.objects[name]
        p["spec"]["containers"] = [{"name": "m", "resources": {"requests": {"cpu": "12"}}}]
        c.rec.enqueue(Kind.POD, EventType.MODIFIED, c.writer.put(p))
        names.append(name)
    c.rec.step()
    nodes = set()
    for n in ("c0", "c1"):
        alloc = c.allocation(n)
        assert alloc is not None
        nodes.add(alloc["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0])
    assert nodes == {"n1", "n2"}


@given(
    st.lists(
        st.tuples(st.sampled_from(["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]), st.booleans()),
        min_size=1,
        max_size=14,
    )
)
@settings(max_examples=25, deadline=None)
def test_no_memory_slice_is_ever_given_twice(ops: list[tuple[str, bool]]) -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB", "A100-SXM4-40GB"]})
    live: list[str] = []
    for i, (profile, finish) in enumerate(ops):
        live.append(c.submit(profile_claim(f"c{i}", profile)))
        if finish and live:
            c.finish(live.pop(0))
        c.rec.step()
        per_gpu: dict[str, list[tuple[int, int]]] = {}
        for o in c.writer.objects.values():
            alloc = (o.get("status") or {}).get("allocation")
            if not alloc:
                continue
            for r in alloc["devices"]["results"]:
                hit = c.planner.model.device(r["pool"], r["device"])
                assert hit is not None
                gpu, dev = hit
                per_gpu.setdefault(gpu.uuid, []).append((dev.profile_id, dev.start))
        for uuid, instances in per_gpu.items():
            # Raises PlacementError on overlapping memory slices or exhausted engine pools.
            c.planner.model.gpus[uuid].geometry.state_of(instances)


def _example_templates() -> list[Obj]:
    import pathlib

    import yaml

    path = pathlib.Path(__file__).resolve().parents[2] / "deploy/examples/10-claim-templates.yaml"
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_every_shipped_example_template_is_placeable() -> None:
    """deploy/examples must work: each template's claim is placed on an H100 + A100 node."""
    templates = _example_templates()
    assert len(templates) >= 5
    for t in templates:
        c = Cluster({"n1": ["H100-SXM5-80GB", "A100-SXM4-40GB"]})
        name = t["metadata"]["name"]
        body = claim(name)
        body["spec"] = t["spec"]["spec"]
        c.submit(body)
        c.rec.step()
        alloc = c.allocation(name)
        assert alloc is not None, f"{name}: {c.recorder.events}"
        results = alloc["devices"]["results"]
        if name == "two-1g-same-gpu":
            gpus = {c.planner.model.device(r["pool"], r["device"])[0].uuid for r in results}  # type: ignore[index]
            assert len(results) == 2 and len(gpus) == 1
        if name == "mig-4g-or-smaller":
            assert results[0]["request"] == "mig/big"
        if name == "whole-h100":
            assert results[0]["device"] == "gpu-0"


def test_a_malformed_allocation_neither_crashes_the_planner_nor_frees_devices() -> None:
    """Only a misbehaving client writes such a result (the apiserver validates results), but
    the planner must survive it and keep whatever the claim held."""
    planner = EnginePlanner(DRIVER)
    for s in slices("n1", ["A100-SXM4-40GB"]):
        planner.observe(Kind.SLICE, s)
    good = claim("c")
    good["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": "n1", "device": "gpu-0"}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                ]
            },
        }
    }
    planner.observe(Kind.CLAIM, good)
    busy = planner.model.snapshot()
    bad = {**good, "status": {"allocation": {"devices": {"results": [{"request": "gpu"}]}}}}
    planner.observe(Kind.CLAIM, bad)  # must not raise
    assert planner.model.snapshot() == busy
    assert list(planner.model.holds())
