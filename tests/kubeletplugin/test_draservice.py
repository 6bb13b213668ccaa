"""DRAPlugin v1 and v1beta1 over real unix sockets, driven by the kubelet-side client."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeletplugin._generated import dra_v1_pb2, dra_v1_pb2_grpc
from kubeletplugin.draservice import prepare_claims, unprepare_claims
from kubeletplugin.ports import ClaimRef, PrepareResult
from nodesim.kubelet import KubeletSim, RegisteredPlugin
from tests.kubeletplugin.fake_preparer import (
    DRIVER,
    FakePreparer,
    device_for,
    running_plugin,
    short_tmpdir,
)

A = ClaimRef(namespace="team-a", name="train", uid="uid-a")
B = ClaimRef(namespace="team-b", name="infer", uid="uid-b")
C = ClaimRef(namespace="team-b", name="eval", uid="uid-c")


@pytest.fixture(params=["v1.DRAPlugin", "v1beta1.DRAPlugin"])
def service(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture
def preparer() -> FakePreparer:
    return FakePreparer()


@pytest.fixture
def plugin(preparer: FakePreparer, service: str) -> Iterator[RegisteredPlugin]:
    with short_tmpdir() as root, running_plugin(root, preparer):
        kubelet = KubeletSim(root / "plugins_registry", supported_services=(service,))
        registered = kubelet.wait_for_plugin(DRIVER, timeout=5)
        assert registered.service == service
        yield registered
        kubelet.close()


def test_prepare_and_unprepare_round_trip(plugin: RegisteredPlugin, preparer: FakePreparer) -> None:
    prepared = plugin.prepare([A, B])
    assert prepared == {
        A.uid: PrepareResult(devices=(device_for(A),)),
        B.uid: PrepareResult(devices=(device_for(B),)),
    }
    assert preparer.prepare_calls == [(A, B)]
    assert plugin.unprepare([A, B]) == {A.uid: "", B.uid: ""}
    assert preparer.unprepare_calls == [(A, B)]


def test_one_failed_claim_does_not_fail_the_others(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    preparer.prepare_errors[B.uid] = "placement 3g.40gb@4 on GPU 0 is taken"
    preparer.unprepare_errors[A.uid] = "compute instance busy"
    prepared = plugin.prepare([A, B, C])
    assert prepared[A.uid] == PrepareResult(devices=(device_for(A),))
    assert prepared[B.uid] == PrepareResult(error="placement 3g.40gb@4 on GPU 0 is taken")
    assert prepared[C.uid] == PrepareResult(devices=(device_for(C),))
    assert plugin.unprepare([A, B]) == {A.uid: "compute instance busy", B.uid: ""}


def test_every_claim_is_answered_even_when_the_preparer_forgets_one(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    preparer.omit.add(B.uid)
    prepared = plugin.prepare([A, B])
    assert set(prepared) == {A.uid, B.uid}
    assert prepared[A.uid].error == ""
    assert "no prepare result" in prepared[B.uid].error
    assert "team-b/infer" in prepared[B.uid].error
    unprepared = plugin.unprepare([A, B])
    assert unprepared[A.uid] == ""
    assert "no unprepare result" in unprepared[B.uid]


def test_an_exception_becomes_per_claim_errors_not_an_rpc_failure(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    preparer.raise_on_prepare = OSError("checkpoint disk full")
    prepared = plugin.prepare([A, B])
    assert set(prepared) == {A.uid, B.uid}
    for result in prepared.values():
        assert result.devices == ()
        assert "OSError: checkpoint disk full" in result.error
    preparer.raise_on_unprepare = RuntimeError("nvml gone")
    unprepared = plugin.unprepare([A, B])
    assert set(unprepared) == {A.uid, B.uid}
    assert all("RuntimeError: nvml gone" in e for e in unprepared.values())
    # The service is still healthy afterwards.
    preparer.raise_on_prepare = None
    assert plugin.prepare([C])[C.uid].error == ""


def test_empty_request_is_a_liveness_probe(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    assert plugin.prepare([]) == {}
    assert plugin.unprepare([]) == {}
    assert preparer.prepare_calls == []
    assert preparer.unprepare_calls == []


def test_malformed_claims_get_their_own_error_and_never_reach_the_preparer(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    nameless = ClaimRef(namespace="team-a", name="", uid="uid-x")
    prepared = plugin.prepare([A, nameless])
    assert prepared[A.uid].error == ""
    assert "lacks name" in prepared["uid-x"].error
    assert preparer.prepare_calls == [(A,)]


def test_duplicate_claims_are_prepared_once(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    prepared = plugin.prepare([A, A, B])
    assert set(prepared) == {A.uid, B.uid}
    assert preparer.prepare_calls == [(A, B)]


def test_share_id_travels_on_v1_and_is_refused_on_v1beta1(
    plugin: RegisteredPlugin, preparer: FakePreparer
) -> None:
    preparer.share_ids[A.uid] = "8a8f7c52-0000-4000-8000-000000000001"
    prepared = plugin.prepare([A, B])
    if plugin.service == "v1.DRAPlugin":
        assert prepared[A.uid].devices[0].share_id == "8a8f7c52-0000-4000-8000-000000000001"
        assert prepared[B.uid].devices[0].share_id is None
    else:
        assert prepared[A.uid].devices == ()
        assert "v1beta1" in prepared[A.uid].error
        assert "share ID" in prepared[A.uid].error
    assert prepared[B.uid].error == ""


def test_v1_unset_share_id_is_absent_on_the_wire(preparer: FakePreparer) -> None:
    """Presence matters: the kubelet distinguishes an unset share_id from an empty one."""
    preparer.share_ids[B.uid] = ""
    with (
        short_tmpdir() as root,
        running_plugin(root, preparer) as server,
        grpc.insecure_channel(f"unix://{server.paths.dra}") as channel,
    ):
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        request = dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in (A, B)]
        )
        response = stub.NodePrepareResources(request, timeout=5)
    assert not response.claims[A.uid].devices[0].HasField("share_id")
    assert response.claims[B.uid].devices[0].HasField("share_id")


class _Scripted:
    """A preparer whose answers come from hypothesis: subset, extra keys, or an exception."""

    def __init__(self, answer: Mapping[str, str], fail: bool) -> None:
        self.answer = answer
        self.fail = fail

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        if self.fail:
            raise ValueError("boom")
        return {uid: PrepareResult(error=err) for uid, err in self.answer.items()}

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        if self.fail:
            raise ValueError("boom")
        return dict(self.answer)


_UIDS = st.sampled_from(["u1", "u2", "u3", "u4", ""])
_CLAIMS = st.lists(
    st.builds(ClaimRef, namespace=st.sampled_from(["ns", ""]), name=st.just("c"), uid=_UIDS),
    max_size=6,
)


@given(
    claims=_CLAIMS,
    answer=st.dictionaries(_UIDS, st.sampled_from(["", "bad"]), max_size=5),
    fail=st.booleans(),
)
def test_every_requested_claim_gets_exactly_one_entry(
    claims: list[ClaimRef], answer: dict[str, str], fail: bool
) -> None:
    preparer = _Scripted(answer, fail)
    wanted = {c.uid for c in claims}
    prepared = prepare_claims(preparer, claims)
    unprepared = unprepare_claims(preparer, claims)
    assert set(prepared) == wanted
    assert set(unprepared) == wanted
    first = {}
    for claim in claims:  # a repeated UID is handled once, as its first occurrence
        first.setdefault(claim.uid, claim)
    for claim in first.values():
        valid = claim.uid and claim.namespace
        if not valid or fail or claim.uid not in answer:
            assert prepared[claim.uid].error
            assert unprepared[claim.uid]
        else:
            assert prepared[claim.uid].error == answer[claim.uid]
            assert unprepared[claim.uid] == answer[claim.uid]


def test_service_answers_concurrent_calls(plugin: RegisteredPlugin) -> None:
    claims = [ClaimRef(namespace="ns", name=f"c{i}", uid=f"u{i}") for i in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda c: plugin.prepare([c]), claims))
    for claim, result in zip(claims, results, strict=True):
        assert result == {claim.uid: PrepareResult(devices=(device_for(claim),))}
