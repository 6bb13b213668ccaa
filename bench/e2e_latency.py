"""End-to-end latency: a pod with a carve claim, from create to Running, and where time goes.

Run: python -m bench.e2e_latency [--pods 100] [--rate 1] [--latency realistic|zero]
                                 [--node-kind sim|real] [--warm-ttl 30s]
                                 [--binding-conditions [--scheduler-waits]]
                                 [--carve-faults N]

Starts a private v1.37 control plane, carve-controller and GPU nodes: real carve-kubelet-plugin
processes on the NVML simulator with the chosen latency preset, driven either by nodesim's
kubelet stand-in (`sim`, the default) or by the real kubelet and containerd running real
containers from the local test image (`real`, realnode/; root on Linux), then
creates pods at a steady rate, each with a 1g slice from a ResourceClaimTemplate, running a few
seconds. Watches on pods and claims stamp every step with this machine's clock (the API's own
timestamps have one-second resolution, too coarse here), split as:

  admission   the pod's create call (the MutatingAdmissionPolicy adds carve's gate)
  claim       pod created -> kube-controller-manager created its ResourceClaim
  controller  claim created -> carve-controller wrote status.allocation
  ungate      allocation written -> carve-controller removed the scheduling gate
  scheduler   gate removed -> kube-scheduler bound the pod (reserving the claim)
  node        bound -> the node agent (or the real kubelet) posted Running; of which
              `prepare` is the NodePrepareResources call (carve the GI + CI, CDI spec,
              checkpoint), measured by the stand-in only
  carved      with --binding-conditions only: allocation written -> the plugin reported the
              device Carved in the claim's status.devices (it carves before bind, while the
              scheduler waits in PreBind; `prepare` then only finds the work done).
              By default carve-controller keeps the pod gated until then; with
              --scheduler-waits it ungates at once and kube-scheduler polls in PreBind

--carve-faults N makes the first N GPU-instance creations on GPU 0 of every node fail with an
NVML error (the simulator's injected fault), as a sick GPU would: without binding conditions a
pod placed there is bound first and its node retries the prepare until the faults are used up
(with a large N it never runs); with them the GPU is tainted carve-failed and the claim is placed
again on another GPU before the pod binds. The max column shows what such a failure costs.

`--warm-ttl` is each plugin's `--warm-slices-ttl` (sim nodes only; 0s, the default, is off):
the run then also counts warm slices kept, reused, reclaimed and expired, from the plugins'
logs. Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from driver.contract import DEFAULT_CONTRACT

_ATTRS = f'device.attributes["{DEFAULT_CONTRACT.driver}"]'

STAGES = (
    "admission",
    "claim",
    "controller",
    "ungate",
    "scheduler",
    "node",
    "prepare",
    "carved",
    "total",
)
GPUS_PER_NODE = ("A100-SXM4-80GB", "H100-SXM5-80GB")


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


class _Stamps:
    """First time each pod / claim reached each state, on this machine's clock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pod: dict[str, dict[str, float]] = {}
        self.claim_of: dict[str, str] = {}  # claim name -> pod name (owner)
        self.pod_claim: dict[str, str] = {}  # pod name -> the claim it ran with
        self.claim: dict[str, dict[str, float]] = {}

    def _mark(self, table: dict[str, dict[str, float]], key: str, what: str, now: float) -> None:
        table.setdefault(key, {}).setdefault(what, now)

    def on_pod(self, _kind: Any, _type: Any, obj: dict[str, Any]) -> None:
        now = time.time()
        name = obj["metadata"]["name"]
        spec, status = obj.get("spec", {}), obj.get("status", {})
        with self.lock:
            for st in status.get("resourceClaimStatuses") or []:
                if st.get("resourceClaimName"):
                    # The first one: kube-controller-manager re-creates (and at once deletes)
                    # claims of pods that already finished, renaming the pod's status entry.
                    self.pod_claim.setdefault(name, str(st["resourceClaimName"]))
            if not spec.get("schedulingGates"):
                self._mark(self.pod, name, "ungated", now)
            if spec.get("nodeName"):
                self._mark(self.pod, name, "bound", now)
            if status.get("phase") == "Running":
                self._mark(self.pod, name, "running", now)

    def on_claim(self, _kind: Any, _type: Any, obj: dict[str, Any]) -> None:
        now = time.time()
        meta = obj["metadata"]
        owner = next((o["name"] for o in meta.get("ownerReferences") or []), None)
        with self.lock:
            if owner:
                self.claim_of[meta["name"]] = owner
            self._mark(self.claim, meta["name"], "created", now)
            if (obj.get("status") or {}).get("allocation"):
                self._mark(self.claim, meta["name"], "allocated", now)
            for entry in (obj.get("status") or {}).get("devices") or []:
                if any(
                    c.get("type") == DEFAULT_CONTRACT.carved_condition and c.get("status") == "True"
                    for c in entry.get("conditions") or []
                ):
                    self._mark(self.claim, meta["name"], "carved", now)


def run(
    pods: int,
    rate: float,
    latency: str,
    nodes: int,
    run_seconds: float,
    *,
    node_kind: str = "sim",
    binding_conditions: bool = False,
    scheduler_waits: bool = False,
    carve_faults: int = 0,
    warm_ttl: str = "0s",
) -> int:
    from kubernetes import client

    from controller.informers import Informer, InformerConfig
    from controller.objects import Kind
    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster
    from devcluster.waiting import wait_for
    from nodesim.simnode import SimNodeSpec
    from nodesim.stack import CarveStack, gates_pod
    from process.kube.jsonclient import KubeJson
    from process.kube.listwatch import JsonCollection

    root = Path(tempfile.mkdtemp(prefix="carve-e2e-bench-"))
    cluster = LocalCluster(root / "cluster")
    try:
        info = cluster.start()
    except BinariesUnavailableError as exc:
        print(f"e2e latency: control plane unavailable: {exc}", file=sys.stderr)
        return 2
    stack = CarveStack(Path(info.kubeconfig), root / "stack")
    informers: list[Informer] = []
    real: Any = None
    plugin_args = ("--binding-conditions",) if binding_conditions else ()
    try:
        stack.install()
        stack.start_controller(*(("--hold-gate-until-carved=false",) if scheduler_waits else ()))
        if node_kind == "real":
            if warm_ttl not in ("0", "0s"):
                print("warning: --warm-ttl applies to sim nodes only; real nodes run without")
            from realnode.cluster import RealNodes
            from realnode.node import RealNodeSpec

            real = RealNodes(Path(info.kubeconfig), stack.api)
            for i in range(nodes):
                real.add_node(RealNodeSpec(f"bench-{i}", GPUS_PER_NODE, latency=latency))
        else:
            for i in range(nodes):
                stack.add_node(
                    SimNodeSpec(
                        f"bench-{i}",
                        GPUS_PER_NODE,
                        latency=latency,
                        plugin_args=(*plugin_args, f"--warm-slices-ttl={warm_ttl}"),
                    )
                )
        if carve_faults:
            from driver.nvml import sim

            for node in stack.nodes.values():
                sim.configure(node.sim_config)
                try:
                    sim.sim_inject_fault(
                        "CreateGpuInstanceWithPlacement", error="UNKNOWN", times=carve_faults, gpu=0
                    )
                finally:
                    sim.configure(None)
        # Dict bodies: the generated models lag behind the 1.37 API.
        core: Any = client.CoreV1Api(stack.api)
        resource: Any = client.ResourceV1Api(stack.api)
        ns = "bench"
        core.create_namespace({"metadata": {"name": ns}})
        wait_for(
            "the namespace's default ServiceAccount",
            lambda: (
                core.list_namespaced_service_account(
                    ns, field_selector="metadata.name=default"
                ).items
            ),
        )
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-1g"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "mig",
                                "exactly": {
                                    "deviceClassName": DEFAULT_CONTRACT.mig_class,
                                    "selectors": [
                                        {
                                            "cel": {
                                                "expression": _ATTRS + '.profile.startsWith("1g.")'
                                            }
                                        }
                                    ],
                                },
                            }
                        ]
                    }
                }
            },
        }
        resource.create_namespaced_resource_claim_template(ns, template)
        json_api = KubeJson(stack.api)
        wait_for(
            "the admission policy to see the template",
            lambda: gates_pod(json_api, ns, {"resourceClaimTemplateName": "one-1g"}),
        )
        stamps = _Stamps()
        config = InformerConfig(watch_timeout_s=120, resync_period_s=3600.0)
        informers = [
            Informer(
                Kind.POD,
                JsonCollection(json_api, f"/api/v1/namespaces/{ns}/pods"),
                stamps.on_pod,
                lambda _k: None,
                config,
            ),
            Informer(
                Kind.CLAIM,
                JsonCollection(
                    json_api, f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
                ),
                stamps.on_claim,
                lambda _k: None,
                config,
            ),
        ]
        for inf in informers:
            threading.Thread(target=inf.run, args=(time.monotonic,), daemon=True).start()
        while not all(i.has_synced for i in informers):
            time.sleep(0.05)

        created: dict[str, tuple[float, float]] = {}
        begin = time.monotonic()
        for i in range(pods):
            due = begin + i / rate
            time.sleep(max(0.0, due - time.monotonic()))
            name = f"p{i:03d}"
            container: dict[str, Any] = {
                "name": "main",
                "image": "x",
                "resources": {"claims": [{"name": "mig"}]},
            }
            if real is not None:
                from realnode.images import TEST_IMAGE

                container["image"] = TEST_IMAGE
                container["imagePullPolicy"] = "IfNotPresent"
                container["command"] = ["sleep", str(run_seconds)]
            manifest = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "annotations": {"nodesim.carve.dev/run-seconds": str(run_seconds)},
                },
                "spec": {
                    "restartPolicy": "Never",
                    "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "one-1g"}],
                    "containers": [container],
                },
            }
            t0 = time.time()
            pod = core.create_namespaced_pod(ns, manifest)
            t1 = time.time()
            gates = [g.name for g in (pod.spec.scheduling_gates if pod.spec else None) or []]
            if DEFAULT_CONTRACT.scheduling_gate not in gates:
                print(f"warning: {name} was not gated by carve's admission policy")
            created[name] = (t0, t1)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with stamps.lock:
                done = sum(1 for n in created if "running" in stamps.pod.get(n, {}))
            if done == pods:
                break
            time.sleep(0.2)

        records: dict[str, Any] = {}
        for node in stack.nodes.values():
            with node.agent._lock:
                for rec in node.agent.records.values():
                    records[rec.name] = rec
        samples: dict[str, list[float]] = {s: [] for s in STAGES}
        missing = 0
        with stamps.lock:
            claim_by_pod = dict(stamps.pod_claim)
            per_pod: dict[str, int] = {}
            for owner in stamps.claim_of.values():
                per_pod[owner] = per_pod.get(owner, 0) + 1
            duplicates = sum(1 for n in per_pod.values() if n > 1)
            for name, (t0, t1) in created.items():
                p = stamps.pod.get(name, {})
                c = stamps.claim.get(claim_by_pod.get(name, ""), {})
                need = ("ungated", "bound", "running")
                if any(k not in p for k in need) or "created" not in c or "allocated" not in c:
                    missing += 1
                    continue
                agent_record = records.get(name)
                samples["admission"].append(t1 - t0)
                samples["claim"].append(c["created"] - t1)
                samples["controller"].append(c["allocated"] - c["created"])
                samples["ungate"].append(p["ungated"] - c["allocated"])
                samples["scheduler"].append(p["bound"] - p["ungated"])
                samples["node"].append(p["running"] - p["bound"])
                if agent_record is not None and "prepare_end" in agent_record.timings:
                    timings = agent_record.timings
                    samples["prepare"].append(timings["prepare_end"] - timings["prepare_start"])
                if "carved" in c:
                    samples["carved"].append(c["carved"] - c["allocated"])
                samples["total"].append(p["running"] - t0)
        print(
            f"e2e latency: {pods} pods at {rate:g}/s, 1g slices, {nodes} nodes x "
            f"{len(GPUS_PER_NODE)} GPUs ({', '.join(GPUS_PER_NODE)}), simulator latency "
            f"'{latency}', containers run {run_seconds:g}s, "
            + ("real kubelet + containerd" if real is not None else "nodesim kubelet stand-in")
            + (", binding conditions ON (carve before bind)" if binding_conditions else "")
            + (
                (", kube-scheduler waits" if scheduler_waits else ", gate held until carved")
                if binding_conditions
                else ""
            )
            + (
                f", first {carve_faults} carve(s) on GPU 0 of each node fail"
                if carve_faults
                else ""
            )
            + f", warm slices TTL {warm_ttl}"
        )
        print(f"{'stage':<12}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
        for stage in STAGES:
            values = samples[stage]
            print(
                f"{stage:<12}{_pct(values, 0.5) * 1000:>10.0f}{_pct(values, 0.99) * 1000:>10.0f}"
                f"{(max(values) if values else float('nan')) * 1000:>10.0f}"
            )
        if real is None:
            logs = "".join(
                n.plugin_log.read_text(errors="replace")
                for n in stack.nodes.values()
                if n.plugin_log.exists()
            )
            print(
                f"warm slices: {logs.count('kept MIG instance warm')} kept at unprepare, "
                f"{logs.count('reusing warm MIG instance')} reused by a prepare, "
                f"{logs.count('destroyed warm MIG instance (reclaimed)')} reclaimed for "
                f"another placement, {logs.count('destroyed warm MIG instance (expired)')} "
                "expired"
            )
            why = {
                "profile did not recur on the GPU": "no other claim of this profile was prepared",
                "processes left": "processes still run on it",
                "process query failed": "not keeping MIG instance warm: process query failed",
            }
            print(
                "not kept: "
                + ", ".join(f"{logs.count(needle)} ({label})" for label, needle in why.items())
            )
        if duplicates:
            print(
                f"note: kube-controller-manager re-created the claim of {duplicates} finished "
                "pod(s) and deleted it again (1.37 behaviour; after Running, not counted above)"
            )
        if missing:
            print(f"{missing} pod(s) did not reach Running in time (excluded):")
            with stamps.lock:
                for name in created:
                    p = stamps.pod.get(name, {})
                    c = stamps.claim.get(claim_by_pod.get(name, ""), {})
                    if "running" not in p or "allocated" not in c:
                        print(
                            f"  {name}: pod reached {sorted(p)}, claim "
                            f"{claim_by_pod.get(name)} reached {sorted(c)}"
                        )
            print(f"  controller log tail:\n{stack.controller_log_tail(15)}")
        return 0 if not missing else 1
    finally:
        for inf in informers:
            inf.stop()
        if real is not None:
            real.stop()
        stack.stop(delete_nodes=False)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1.0, help="pods created per second")
    parser.add_argument("--latency", choices=("realistic", "zero"), default="realistic")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--run-seconds", type=float, default=4.0)
    parser.add_argument("--node-kind", choices=("sim", "real"), default="sim")
    parser.add_argument(
        "--binding-conditions",
        action="store_true",
        help="plugins carve before bind (--binding-conditions); sim nodes only",
    )
    parser.add_argument(
        "--scheduler-waits",
        action="store_true",
        help="with --binding-conditions: carve-controller --hold-gate-until-carved=false",
    )
    parser.add_argument(
        "--carve-faults",
        type=int,
        default=0,
        help="the first N GPU-instance creations on GPU 0 of each sim node fail (NVML error)",
    )
    parser.add_argument(
        "--warm-ttl",
        default="0s",
        help="the plugins' --warm-slices-ttl (0s: off, as the plugin's default)",
    )
    args = parser.parse_args(argv)
    if args.scheduler_waits and not args.binding_conditions:
        parser.error("--scheduler-waits: only with --binding-conditions")
    if args.carve_faults < 0:
        parser.error("--carve-faults: must be 0 or more")
    if (args.binding_conditions or args.carve_faults) and args.node_kind != "sim":
        parser.error("--binding-conditions, --carve-faults: only with --node-kind sim")
    return run(
        args.pods,
        args.rate,
        args.latency,
        args.nodes,
        args.run_seconds,
        node_kind=args.node_kind,
        binding_conditions=args.binding_conditions,
        scheduler_waits=args.scheduler_waits,
        carve_faults=args.carve_faults,
        warm_ttl=args.warm_ttl,
    )


if __name__ == "__main__":
    sys.exit(main())
