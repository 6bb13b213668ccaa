"""The names controller and node agree on, derived from the driver name."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.contract import ATTRIBUTES, DEFAULT_CONTRACT, IDENTITY_ATTRIBUTES, Attr, Contract


def test_default_names() -> None:
    c = DEFAULT_CONTRACT
    assert c.driver == "mig.carve.dev"
    assert c.allocation_finalizer == "mig.carve.dev/allocation"
    assert c.scheduling_gate == "mig.carve.dev/placement"
    assert c.placed_condition == "mig.carve.dev/Placed"
    assert c.event_source == "mig.carve.dev/controller"
    assert c.node_finalizer("node-a") == "mig.carve.dev/node-node-a"
    assert c.mig_class == "mig.carve.dev" and c.gpu_class == "gpu.carve.dev"
    assert c.profile_class_suffix == ".mig.carve.dev"
    assert c.attribute(Attr.PARENT_UUID) == "mig.carve.dev/parentUUID"


def test_every_name_follows_a_renamed_driver() -> None:
    c = Contract("mig.example.com")
    names = [
        c.allocation_finalizer,
        c.scheduling_gate,
        c.placed_condition,
        c.event_source,
        c.node_finalizer("n"),
    ]
    assert all(n.startswith("mig.example.com/") for n in names)
    assert c.gpu_class == "gpu.example.com"
    assert Contract("carve.example.com").gpu_class == "gpu.carve.example.com"


@pytest.mark.parametrize("bad", ["", "Mig.Carve.Dev", "mig_carve.dev", "a" * 64, "-a.b", "a..b"])
def test_a_driver_name_that_is_no_dns_subdomain_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="DNS subdomain"):
        Contract(bad)


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=300))
def test_node_finalizers_fit_the_name_limit_and_stay_distinct(node: str) -> None:
    a = DEFAULT_CONTRACT.node_finalizer(node)
    b = DEFAULT_CONTRACT.node_finalizer(node + "x")
    assert a != b
    for f in (a, b):
        prefix, name = f.split("/")
        assert prefix == "mig.carve.dev" and len(name) <= 63
        assert DEFAULT_CONTRACT.is_node_finalizer(f)
        assert not Contract("mig.example.com").is_node_finalizer(f)


def test_own_finalizer_is_no_node_finalizer() -> None:
    assert not DEFAULT_CONTRACT.is_node_finalizer(DEFAULT_CONTRACT.allocation_finalizer)


def test_attribute_table() -> None:
    assert "profile" in ATTRIBUTES and "parentUUID" in ATTRIBUTES
    assert len(set(ATTRIBUTES)) == len(ATTRIBUTES)
    assert {Attr.UUID, Attr.PARENT_UUID, Attr.PLACEMENT_START} <= IDENTITY_ATTRIBUTES
    with pytest.raises(ValueError, match="not an attribute"):
        DEFAULT_CONTRACT.attribute("nope")


def test_the_chart_classes_that_ask_for_mig_devices_only() -> None:
    c = Contract("mig.carve.dev")
    assert c.asks_mig_only("mig.carve.dev") and c.asks_mig_only("mig-1g-10gb.mig.carve.dev")
    assert not c.asks_mig_only("gpu.carve.dev")
    assert not c.asks_mig_only("my-class.mig.carve.dev")  # the operator's own: either kind
    assert not c.asks_mig_only("mig-1g-10gb.other.dev")
