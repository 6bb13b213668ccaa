"""The controller keeps only what it needs (issue 30.6): carve's slices (a field selector) and
carve's claims. A gated pod that also names another driver's claim must still be placed: the
claim the store lacks is read once, found foreign, and no longer waited for.
The bench with 50,000 foreign claims and slices is bench/foreign_objects.py.
"""

from __future__ import annotations

from controller.cache import claim_view
from controller.informers import InformerConfig, standard_informers
from controller.objects import CarveClasses, Kind
from controller.status import node_selector_for
from driver.apiobject import Obj
from driver.contract import DEFAULT_CONTRACT
from tests.support.fake_lists import EmptyLists
from tests.support.reconciler import Harness, claim, pod


def _nic_claim(name: str) -> Obj:
    return claim(name, cls="nic.example.com")


def test_only_carves_claims_are_kept() -> None:
    view = claim_view(CarveClasses(), DEFAULT_CONTRACT.driver)
    assert view(claim("c")) is not None
    assert view(claim("p", cls="mig-3g-40gb.mig.carve.dev")) is not None  # a per-profile class
    assert view(_nic_claim("n")) is None
    # Another class that selects carve's devices, allocated by kube-scheduler: its devices are
    # busy, so carve must see it.
    native = claim("x", cls="my-own-mig-class")
    native["status"]["allocation"] = {
        "devices": {
            "results": [{"request": "gpu", "driver": "mig.carve.dev", "pool": "n", "device": "d"}]
        },
        "nodeSelector": node_selector_for("n"),
    }
    assert view(native) is not None
    managed = claim("m")
    managed["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    assert "managedFields" not in (view(managed) or {})["metadata"]


def test_only_carves_slices_are_listed_and_watched() -> None:
    api = EmptyLists()
    informers = standard_informers(api, lambda *_: None, lambda _: None, InformerConfig())
    slices = next(i for i in informers if i.kind is Kind.SLICE)
    slices._list()
    assert api.asked[-1][1]["fieldSelector"] == "spec.driver=mig.carve.dev"


def test_a_gated_pod_naming_another_drivers_claim_is_placed() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("gpu"))
    h.writer.put(_nic_claim("nic"))  # exists, but the informer never delivers it
    h.add(Kind.POD, pod("p", ["gpu", "nic"]))
    h.step()  # waits for "nic"; asks about it
    h.step()  # the read finds it foreign; the pod is placed
    assert h.writer.reads == ["nic"]
    assert h.allocated_devices() == [("n1", "dev-0")]
    assert not h.current("p")["spec"].get("schedulingGates")


def test_a_claim_that_does_not_exist_yet_is_looked_up_again_until_it_does() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("gpu"))
    h.add(Kind.POD, pod("p", ["gpu", "nic"]))
    h.step()
    h.step()
    assert h.writer.reads == ["nic"]  # 404: not yet
    assert h.allocated_devices() == []
    h.step()
    assert h.writer.reads == ["nic"]  # not before its wait
    h.writer.put(_nic_claim("nic"))
    h.now[0] += 1.5
    h.step()
    h.step()
    assert h.writer.reads == ["nic", "nic"]
    assert h.allocated_devices() == [("n1", "dev-0")]
