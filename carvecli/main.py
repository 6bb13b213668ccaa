"""`carve`: look at a node's MIG GPUs, and a guided demo on a simulated node.

`carve gpus` uses the NVML simulator when --sim or CARVE_SIM_CONFIG names a config, else the
real NVML (pynvml). Either way it goes through the same backend the kubelet plugin uses, so
what it prints is what the plugin would see.
"""

from __future__ import annotations

import argparse
import os
import string
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import urllib3

from driver.catalog import ProfileSpec
from driver.contract import DEFAULT_DRIVER_NAME
from driver.geometry import EMPTY_STATE, Geometry, GpuState, PlacementError, geometry_for
from driver.nvml.backend import NvmlBackend
from driver.nvml.errors import NvmlError, NvmlUnavailable
from driver.nvml.types import GpuInfo, GpuInstance, MigMode
from process.kube.errors import ApiError
from process.kube.jsonclient import JsonRequests
from process.kubeconfig import KubeconfigError

_LABELS = string.ascii_uppercase + string.ascii_lowercase


# --- the per-GPU picture (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileRow:
    profile: ProfileSpec
    free_starts: tuple[int, ...] | None  # None when it cannot be computed (MIG off, odd state)
    remaining: int | None


@dataclass(frozen=True)
class GpuPicture:
    gpu: GpuInfo
    mig: MigMode | None  # None when the GPU is not MIG-capable
    memory_units: int
    instances: tuple[GpuInstance, ...]
    rows: tuple[ProfileRow, ...]


def memory_map(units: int, instances: Sequence[GpuInstance]) -> str:
    """One character per memory slice: '.' free, a letter per GPU instance."""
    cells = ["."] * units
    for label, inst in zip(_LABELS, _by_start(instances), strict=False):
        for unit in range(inst.placement.start, min(inst.placement.end, units)):
            cells[unit] = label
    return "[" + "".join(cells) + "]"


def render(picture: GpuPicture) -> str:
    g = picture.gpu
    arch = g.architecture.value if g.architecture else f"arch {g.architecture_code}"
    if picture.mig is None:
        mig = "MIG not supported"
    elif picture.mig.change_pending:
        pend = "on" if picture.mig.pending else "off"
        mig = f"MIG {'on' if picture.mig.current else 'off'} (switching {pend} after a GPU reset)"
    else:
        mig = "MIG on" if picture.mig.current else "MIG off"
    lines = [
        f"GPU {g.index}  {g.name}  ({arch}, {g.memory_mib // 1024} GiB, minor {g.minor}, "
        f"{g.pci_bus_id})",
        f"  {g.uuid}  {mig}",
    ]
    if picture.mig is None:
        return "\n".join(lines)
    scale = "".join(str(u % 10) for u in range(picture.memory_units))
    lines.append(f"  memory slices  {scale}")
    lines.append(f"                 {memory_map(picture.memory_units, picture.instances)[1:-1]}")
    for label, inst in zip(_LABELS, _by_start(picture.instances), strict=False):
        name = _profile_name(g, inst.profile_id)
        uuid = inst.mig_uuid or f"{len(inst.ci_ids)} compute instances"
        lines.append(
            f"    {label} = {name} at {inst.placement.start}:{inst.placement.size}, "
            f"GPU instance {inst.gi_id}, {uuid}"
        )
    lines.append(f"  {'profile (id)':<24}{'placements':<16}{'free starts':<16}can still create")
    for row in picture.rows:
        p = row.profile
        starts = ",".join(str(pl.start) for pl in p.placements)
        free = "-" if row.free_starts is None else (",".join(map(str, row.free_starts)) or "none")
        if row.remaining is not None:
            remaining = f"{row.remaining} of {p.max_instances}"
        else:
            remaining = "- (MIG off)" if not picture.mig.current else "-"
        lines.append(f"    {p.name + f' ({p.id})':<22}{starts:<16}{free:<16}{remaining}")
    return "\n".join(lines)


def _profile_name(gpu: GpuInfo, profile_id: int) -> str:
    p = gpu.profile(profile_id)
    return p.name if p is not None else f"profile id {profile_id}"


def _by_start(instances: Sequence[GpuInstance]) -> list[GpuInstance]:
    return sorted(instances, key=lambda i: (i.placement.start, i.gi_id))


def _rows(
    geometry: Geometry, gpu: GpuInfo, state: GpuState | None, remaining: dict[int, int]
) -> tuple[ProfileRow, ...]:
    return tuple(
        ProfileRow(
            p,
            None if state is None else geometry.feasible_starts(state, p.id),
            remaining.get(p.id),
        )
        for p in gpu.profiles
    )


def picture_of(backend: NvmlBackend, gpu: GpuInfo) -> GpuPicture:
    """Everything `carve gpus` shows about one GPU, read through the backend."""
    if not gpu.mig_capable or not gpu.profiles:
        return GpuPicture(gpu, None, 0, (), ())
    mode = backend.mig_mode(gpu.uuid)
    model = backend.gpu_model(gpu.uuid)
    geometry = geometry_for(model)
    instances = backend.instances(gpu.uuid)
    remaining: dict[int, int] = {}
    state: GpuState | None = None
    if mode.current:
        remaining = {p.id: backend.remaining_capacity(gpu.uuid, p.id) for p in gpu.profiles}
        try:
            state = geometry.state_of((i.profile_id, i.placement.start) for i in instances)
        except PlacementError:
            state = None  # instances NVML accepted but geometry cannot express: show NVML only
    else:
        state = EMPTY_STATE if not instances else None
    return GpuPicture(
        gpu, mode, model.memory_units, instances, _rows(geometry, gpu, state, remaining)
    )


# --- binding selection ----------------------------------------------------------------------------


def _binding(sim_config: str | None) -> Any:
    """The simulator when a config is named, else the real pynvml module."""
    if sim_config or os.environ.get("CARVE_SIM_CONFIG"):
        from driver.nvml import sim

        if sim_config:
            sim.configure(sim_config)
        return sim
    import pynvml

    return pynvml


def _proc_root(nvml: Any) -> Path:
    root = getattr(nvml, "sim_proc_root", None)
    return Path(root()) if callable(root) else Path("/proc")


def cmd_gpus(args: argparse.Namespace, out: TextIO) -> int:
    nvml = _binding(args.sim)
    with NvmlBackend(nvml, proc_root=_proc_root(nvml)) as backend:
        gpus = backend.gpus()
        if not gpus:
            print("no NVIDIA GPUs on this node", file=out)
        for gpu in gpus:
            print(render(picture_of(backend, gpu)), file=out)
            print(file=out)
    return 0


# --- demo -----------------------------------------------------------------------------------------

_DEMO_GPUS = [
    {"model": "A100-SXM4-40GB", "gi_id_layout": "half-swap"},
    {"model": "H100-SXM5-80GB", "mig": False},
    {"model": "RTX-PRO-6000-Blackwell"},
    {"model": "A30-24GB", "mig": False},
]

# (GPU index, profile id, placement start, why)
_DEMO_CARVES = [
    (0, 9, 4, "a 3g.20gb in the upper half of the A100"),
    (0, 14, 0, "a 2g.10gb at the bottom"),
    (0, 20, 2, "a 1g.5gb+me: it takes the A100's only OFA/JPEG engines"),
    (1, 5, 0, "a 4g.40gb on the H100, after switching MIG on (Hopper needs no reset)"),
    (1, 15, 6, "a 1g.20gb in the H100's last two slices"),
    (2, 5, 6, "a 2g.48gb on the RTX PRO 6000 (12 memory slices)"),
    (2, 67, 0, "a 1g.24gb-me beside it"),
]


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from driver.nvml import sim

    keep = Path(args.keep) if args.keep else None
    with tempfile.TemporaryDirectory(prefix="carve-demo-") as tmp:
        base = keep or Path(tmp)
        config = sim.sim_write_config(
            base / "sim.yaml", {"state": "state.json", "uuid_seed": "demo", "gpus": _DEMO_GPUS}
        )
        if (base / "state.json").exists():
            (base / "state.json").unlink()  # a kept directory starts fresh on every demo run
        sim.configure(config)
        try:
            return _demo(sim, config, keep is not None, out)
        finally:
            sim.configure(None)


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out)


def _demo(nvml: Any, config: Path, kept: bool, out: TextIO) -> int:
    _say(out, "carve demo: carving MIG slices on a simulated GPU node")
    _say(out, "=" * 56)
    _say(out, f"Simulated node: {config} (NVML simulator, same backend as the kubelet plugin)")
    with NvmlBackend(nvml, proc_root=_proc_root(nvml)) as backend:
        gpus = backend.gpus()
        for g in gpus:
            mode = backend.mig_mode(g.uuid)
            _say(
                out,
                f"  GPU {g.index}: {g.name} - {len(g.profiles)} MIG profiles discovered "
                f"from NVML, MIG {'on' if mode.current else 'off'}",
            )
        _say(out)
        _say(
            out,
            "1. Carve GPU instances at exact placements, each with a full-size compute instance:",
        )
        for index, profile_id, start, why in _DEMO_CARVES:
            gpu = gpus[index]
            if not backend.mig_enabled(gpu.uuid):
                backend.enable_mig(gpu.uuid)
            carved = backend.carve(gpu.uuid, profile_id, start)
            _say(out, f"   GPU {index}: {why}")
            _say(
                out,
                f"          -> GPU instance {carved.gi_id}, compute instance {carved.ci_id}, "
                f"{carved.mig_uuid}",
            )
            gi_dev, ci_dev = backend.cap_devices(gpu.minor, carved.gi_id, carved.ci_id)
            _say(
                out,
                f"             container devices: /dev/nvidia{gpu.minor}, {gi_dev.path}, "
                f"{ci_dev.path} (major {gi_dev.major})",
            )
        _say(out)
        _say(out, "2. Ask for things NVML must refuse:")
        for index, profile_id, start in ((0, 9, 0), (0, 20, 6)):
            try:
                backend.carve(gpus[index].uuid, profile_id, start)
            except NvmlError as exc:
                _say(out, f"   {type(exc).__name__}: {exc}")
        try:
            backend.enable_mig(gpus[3].uuid)
        except NvmlError as exc:
            _say(out, f"   {type(exc).__name__}: {exc}")
        _say(out)
        _say(out, "3. The node now (letters mark GPU instances on the memory slices):")
        _say(out)
        for gpu in gpus:
            _say(out, render(picture_of(backend, gpu)))
            _say(out)
        victim = backend.instances(gpus[0].uuid)[0]
        backend.destroy(gpus[0].uuid, victim.gi_id)
        _say(
            out,
            f"4. Destroyed the {_profile_name(gpus[0], victim.profile_id)} (GPU instance "
            f"{victim.gi_id}) on GPU 0, compute instance first; its slices are free again:",
        )
        left = backend.instances(gpus[0].uuid)
        legend = ", ".join(
            f"{label} = {_profile_name(gpus[0], i.profile_id)}"
            for label, i in zip(_LABELS, _by_start(left), strict=False)
        )
        _say(out, f"   {memory_map(8, left)}  {legend}")
    _say(out)
    _say(out, "What happened: the NVML backend discovered each GPU's profiles and placements from")
    _say(out, "NVML, carved GPU + compute instances at the placements asked for, resolved MIG")
    _say(out, "UUIDs and nvidia-caps device numbers for the container, and turned NVML's error")
    _say(out, "codes into messages. GPU instance ids come from NVML (swizzIds), not placements.")
    if kept:
        _say(out, f"The simulated node is kept: inspect it with `carve gpus --sim {config}`.")
    else:
        _say(
            out,
            "Run `carve demo --keep DIR` to keep the simulated node, then `carve gpus --sim "
            "DIR/sim.yaml`.",
        )
    return 0


# --- status ---------------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    """The cluster's carved slices per node and GPU, from ResourceSlices and ResourceClaims."""
    from carvecli.clusterview import cluster_view
    from carvecli.clusterview import render as render_view
    from process.kube.jsonclient import KubeJson
    from process.kubeconfig import load_api_client

    api = KubeJson(load_api_client(_kubeconfig_file(args.kubeconfig)))
    slices = api.request("GET", "/apis/resource.k8s.io/v1/resourceslices")["items"]
    claims = api.request("GET", "/apis/resource.k8s.io/v1/resourceclaims")["items"]
    warnings: list[str] = []
    views = cluster_view(
        slices,
        claims,
        args.driver_name,
        on_error=lambda e: warnings.append(str(e)),
        rules=_taint_rules(api, warnings),
    )
    print(render_view(views), file=out)
    for warning in warnings:
        print(f"warning: {warning}", file=out)
    return 0


def _kubeconfig_file(named: str | None) -> str | None:
    """The file `--kubeconfig`/`$KUBECONFIG` names, else kubectl's default file when there is
    one; None means the pod's in-cluster config, for `carve status` run inside the cluster."""
    if named:
        return named
    default = os.path.expanduser("~/.kube/config")
    return default if os.path.exists(default) else None


def _taint_rules(api: JsonRequests, warnings: list[str]) -> list[Any]:
    """The cluster's DeviceTaintRules (resource.k8s.io/v1, Kubernetes 1.37+); none where the
    server does not serve them or the user may not list them (said once, as a warning)."""
    from process.kube.errors import NotFoundError

    try:
        items: list[Any] = api.request("GET", "/apis/resource.k8s.io/v1/devicetaintrules")["items"]
    except NotFoundError:
        return []  # not served: no rule can taint anything, for kube-scheduler either
    except ApiError as exc:
        warnings.append(f"DeviceTaintRules not shown (HTTP {exc.status}): {exc.message}")
        return []
    return items


# --- entry point ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gpus = sub.add_parser("gpus", help="show the node's GPUs, their MIG instances and free room")
    gpus.add_argument(
        "--sim",
        metavar="CONFIG",
        help="use the NVML simulator with this config (default: $CARVE_SIM_CONFIG, else NVML)",
    )
    gpus.set_defaults(run=cmd_gpus)
    demo = sub.add_parser("demo", help="carve slices on a simulated node and explain each step")
    demo.add_argument("--keep", metavar="DIR", help="keep the simulated node in DIR")
    demo.set_defaults(run=cmd_demo)
    status = sub.add_parser(
        "status", help="show the cluster's carved MIG slices per node and GPU (from the API)"
    )
    status.add_argument(
        "--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG"
    )
    status.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help="DRA driver name")
    status.set_defaults(run=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    stream = out or sys.stdout
    try:
        code: int = args.run(args, stream)
    except NvmlUnavailable as exc:
        print(
            f"carve: {exc}. To try carve without a GPU, run `carve demo` or pass --sim.",
            file=sys.stderr,
        )
        return 2
    except (NvmlError, ValueError, KubeconfigError) as exc:
        print(f"carve: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"carve: the apiserver refused (HTTP {exc.status}): {exc.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; stop quietly instead of a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        reason = getattr(exc, "reason", None) or exc  # MaxRetryError carries the cause
        print(f"carve: cannot reach the apiserver: {reason}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
