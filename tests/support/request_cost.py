"""The machinery of `python -m bench.request_cost` (see its docstring): one thread's CPU time
per apiserver request, sent three ways over one `process.kubeconfig` client (carve's)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from process.kube.rmw import MERGE_PATCH

NAMESPACE = "default"
CONFIG_MAP = "carve-request-cost"
ANNOTATION = "carve.dev/request-cost"
_PATCHES = ("client patch", "pool patch")  # the ways that write, and are checked


@dataclass(frozen=True)
class RequestCost:
    way: str
    requests: int
    cpu_s: float  # the sending thread's CPU time, all requests
    wall_s: float

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s / self.requests * 1000

    @property
    def wall_ms(self) -> float:
        return self.wall_s / self.requests * 1000


def _ways(api: Any) -> dict[str, Callable[[int], dict[str, Any]]]:
    """Each way sends request `i` and returns the object the apiserver answered with."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    cfg = api.configuration
    url = f"{cfg.host}/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIG_MAP}"
    headers = {"Accept": "application/json", "Content-Type": MERGE_PATCH}
    token = cfg.get_api_key_with_prefix("authorization")
    if token:
        headers["Authorization"] = token
    pool = api.rest_client.pool_manager

    def body(i: int) -> dict[str, Any]:
        return {"metadata": {"annotations": {ANNOTATION: str(i)}}}

    def client_patch(i: int) -> dict[str, Any]:
        # As carve's writers send a write (controller/status.py): raw answer, parsed once.
        resp = core.patch_namespaced_config_map(
            CONFIG_MAP, NAMESPACE, body(i), _content_type=MERGE_PATCH, _preload_content=False
        )
        parsed: dict[str, Any] = json.loads(resp.data)
        return parsed

    def pool_patch(i: int) -> dict[str, Any]:
        resp = pool.request("PATCH", url, body=json.dumps(body(i)), headers=headers)
        parsed: dict[str, Any] = json.loads(resp.data)
        return parsed

    def pool_get(_i: int) -> dict[str, Any]:
        resp = pool.request("GET", url, headers=headers)
        parsed: dict[str, Any] = json.loads(resp.data)
        return parsed

    return {_PATCHES[0]: client_patch, _PATCHES[1]: pool_patch, "pool get": pool_get}


def measure(api: Any, requests: int, rounds: int = 2) -> list[RequestCost]:
    """`requests` of each way, `rounds` times in turn (so a busy moment of the machine falls on
    every way alike), after a warm-up that opens the connection. Raises if an answer is not
    the ConfigMap as patched: a figure is only worth printing for requests that worked."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    try:
        core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": CONFIG_MAP}})
    except client.ApiException as exc:
        if exc.status != 409:  # left by an earlier run: patched all the same
            raise
    ways = _ways(api)
    for send in ways.values():
        for i in range(5):
            send(i)
    totals = {way: [0, 0.0, 0.0] for way in ways}
    n = 0
    for _ in range(rounds):
        for way, send in ways.items():
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(requests):
                n += 1
                answer = send(n)
                if way in _PATCHES and answer["metadata"]["annotations"][ANNOTATION] != str(n):
                    raise RuntimeError(f"{way}: the apiserver did not apply patch {n}: {answer}")
            totals[way][0] += requests
            totals[way][1] += time.thread_time() - cpu
            totals[way][2] += time.perf_counter() - wall
    return [RequestCost(way, int(r), c, w) for way, (r, c, w) in totals.items()]


def report(costs: list[RequestCost]) -> str:
    lines = [f"{'way':<14}{'requests':>9}{'cpu ms/request':>16}{'wall ms/request':>17}"]
    lines += [f"{c.way:<14}{c.requests:>9}{c.cpu_ms:>16.3f}{c.wall_ms:>17.3f}" for c in costs]
    by_way = {c.way: c for c in costs}
    if set(_PATCHES) <= by_way.keys():
        layer = by_way[_PATCHES[0]].cpu_ms - by_way[_PATCHES[1]].cpu_ms
        lines.append(f"the official client's own layer: {layer:.3f} ms of CPU per request")
    return "\n".join(lines)
