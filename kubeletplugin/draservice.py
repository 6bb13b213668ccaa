"""The DRAPlugin gRPC services (v1 and v1beta1): wire messages in, typed preparer calls out.

The kubelet's rules shape this module. It ignores a whole response when the RPC fails, and it
retries every claim that has no entry in the response map, so one bad claim or one exception must
never turn into an RPC error: each requested claim always gets its own entry, with a specific
error where something went wrong. The actual work (reading the claim, carving, CDI, checkpoint)
lives behind the `ClaimPreparer` protocol so that this layer stays a thin, testable translation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from kubeletplugin._generated import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
)
from kubeletplugin.ports import ClaimPreparer, ClaimRef, PreparedDevice, PrepareResult

_log = logging.getLogger(__name__)


def _claim_problem(claim: ClaimRef) -> str:
    missing = [
        field
        for field, value in (
            ("uid", claim.uid),
            ("namespace", claim.namespace),
            ("name", claim.name),
        )
        if not value
    ]
    if missing:
        return f"claim {claim}: request lacks {', '.join(missing)}; the kubelet always sets them"
    return ""


def _split_valid(claims: Sequence[ClaimRef]) -> tuple[list[ClaimRef], dict[str, str]]:
    """Drop duplicates and claims the preparer cannot act on; return (valid, uid -> error)."""
    valid: list[ClaimRef] = []
    rejected: dict[str, str] = {}
    seen: set[str] = set()
    for claim in claims:
        if claim.uid in seen:
            continue
        seen.add(claim.uid)
        problem = _claim_problem(claim)
        if problem:
            rejected[claim.uid] = problem
        else:
            valid.append(claim)
    return valid, rejected


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def prepare_claims(preparer: ClaimPreparer, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
    """Run the preparer and guarantee one result per requested claim UID, never raising."""
    valid, rejected = _split_valid(claims)
    results: dict[str, PrepareResult] = {uid: PrepareResult(error=e) for uid, e in rejected.items()}
    if not valid:
        return results
    try:
        answered = dict(preparer.prepare(valid))
    except Exception as exc:
        _log.exception("prepare raised for %d claim(s)", len(valid))
        answered = {}
        failure = f"preparing failed unexpectedly ({_describe(exc)}); the kubelet will retry"
        for claim in valid:
            answered[claim.uid] = PrepareResult(error=failure)
    for claim in valid:
        result = answered.pop(claim.uid, None)
        if not isinstance(result, PrepareResult):
            result = PrepareResult(
                error=f"claim {claim}: the driver returned no prepare result; "
                "the kubelet will retry"
            )
        results[claim.uid] = result
    if answered:
        _log.warning("preparer answered for claims not requested: %s", sorted(answered))
    return results


def unprepare_claims(preparer: ClaimPreparer, claims: Sequence[ClaimRef]) -> dict[str, str]:
    """Run the preparer's unprepare and guarantee one entry per requested claim UID."""
    valid, results = _split_valid(claims)
    if not valid:
        return results
    try:
        answered = dict(preparer.unprepare(valid))
    except Exception as exc:
        _log.exception("unprepare raised for %d claim(s)", len(valid))
        failure = f"unpreparing failed unexpectedly ({_describe(exc)}); the kubelet will retry"
        answered = {claim.uid: failure for claim in valid}
    for claim in valid:
        error = answered.pop(claim.uid, None)
        if not isinstance(error, str):
            error = (
                f"claim {claim}: the driver returned no unprepare result; the kubelet will retry"
            )
        results[claim.uid] = error
    if answered:
        _log.warning("preparer answered for claims not requested: %s", sorted(answered))
    return results


def _log_outcome(
    verb: str, api: str, claims: Sequence[ClaimRef], errors: Mapping[str, str], started: float
) -> None:
    failed = {uid: err for uid, err in errors.items() if err}
    _log.info(
        "%s (%s): %d claim(s), %d failed, %.1f ms",
        verb,
        api,
        len(claims),
        len(failed),
        (time.monotonic() - started) * 1000,
    )
    for uid, err in failed.items():
        _log.warning("%s (%s) claim uid %s: %s", verb, api, uid, err)


def _refs(
    wire_claims: Sequence[dra_v1_pb2.Claim] | Sequence[dra_v1beta1_pb2.Claim],
) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in wire_claims]


class DRAPluginV1(dra_v1_pb2_grpc.DRAPluginServicer):
    """`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, the version the kubelet prefers."""

    def __init__(
        self, preparer: ClaimPreparer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._preparer = preparer
        self._clock = clock

    def NodePrepareResources(  # noqa: N802 (gRPC method name)
        self, request: dra_v1_pb2.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_v1_pb2.NodePrepareResourcesResponse:
        started = self._clock()
        claims = _refs(request.claims)
        results = prepare_claims(self._preparer, claims)
        response = dra_v1_pb2.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error:
                entry.error = result.error
                continue
            for device in result.devices:
                wire = entry.devices.add(
                    request_names=device.request_names,
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=device.cdi_device_ids,
                )
                if device.share_id is not None:
                    wire.share_id = device.share_id
        if claims:
            _log_outcome("prepare", "v1", claims, {u: r.error for u, r in results.items()}, started)
        return response

    def NodeUnprepareResources(  # noqa: N802 (gRPC method name)
        self, request: dra_v1_pb2.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        started = self._clock()
        claims = _refs(request.claims)
        errors = unprepare_claims(self._preparer, claims)
        response = dra_v1_pb2.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        if claims:
            _log_outcome("unprepare", "v1", claims, errors, started)
        return response


class DRAPluginV1beta1(dra_v1beta1_pb2_grpc.DRAPluginServicer):
    """`k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`, for kubelets older than v1 (1.32-1.33).

    v1beta1 cannot carry a device's share ID. Dropping it would let the kubelet mismatch the
    allocation, so a claim with a shared device fails with an explanation instead.
    """

    def __init__(
        self, preparer: ClaimPreparer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._preparer = preparer
        self._clock = clock

    def NodePrepareResources(  # noqa: N802 (gRPC method name)
        self, request: dra_v1beta1_pb2.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_v1beta1_pb2.NodePrepareResourcesResponse:
        started = self._clock()
        claims = _refs(request.claims)
        results = prepare_claims(self._preparer, claims)
        response = dra_v1beta1_pb2.NodePrepareResourcesResponse()
        errors: dict[str, str] = {}
        for uid, result in results.items():
            entry = response.claims[uid]
            error = result.error or _v1beta1_problem(result.devices)
            errors[uid] = error
            if error:
                entry.error = error
                continue
            for device in result.devices:
                entry.devices.add(
                    request_names=device.request_names,
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=device.cdi_device_ids,
                )
        if claims:
            _log_outcome("prepare", "v1beta1", claims, errors, started)
        return response

    def NodeUnprepareResources(  # noqa: N802 (gRPC method name)
        self, request: dra_v1beta1_pb2.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_v1beta1_pb2.NodeUnprepareResourcesResponse:
        started = self._clock()
        claims = _refs(request.claims)
        errors = unprepare_claims(self._preparer, claims)
        response = dra_v1beta1_pb2.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        if claims:
            _log_outcome("unprepare", "v1beta1", claims, errors, started)
        return response


def _v1beta1_problem(devices: Sequence[PreparedDevice]) -> str:
    shared = [d.device_name for d in devices if d.share_id is not None]
    if shared:
        return (
            f"device(s) {', '.join(shared)} are shared allocations (share ID), which the "
            "v1beta1 DRA API cannot report; use a kubelet that speaks v1.DRAPlugin"
        )
    return ""


def add_dra_services(server: grpc.Server, preparer: ClaimPreparer) -> None:
    """Serve both DRAPlugin versions for `preparer` on `server`."""
    # The generated registration helpers carry no annotations (grpcio-tools emits no .pyi).
    v1, v1beta1 = DRAPluginV1(preparer), DRAPluginV1beta1(preparer)
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(v1, server)  # type: ignore[no-untyped-call]
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(v1beta1, server)  # type: ignore[no-untyped-call]
