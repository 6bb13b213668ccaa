"""Configuration of the NVML simulator: which GPUs a simulated node has and how they behave.

A configuration is a YAML or JSON file (named by ``CARVE_SIM_CONFIG`` or passed to
``configure``) or an equivalent mapping. Paths in a file are relative to the file's directory,
so a config can live next to its state. Every field is validated up front with a message that
names the field, because a simulator that silently ignores a typo produces tests that prove
nothing.

The simulated node also has a fake ``/sys`` (``sim_sys_root``, next to the state unless
``sys_root`` says where): each GPU's ``bus/pci/devices/<bus id>`` link into ``devices/`` and its
``numa_node``. GPUs sit in pairs under one PCIe root complex (GPUs 0 and 1 under the first,
2 and 3 under the next, as pairs behind one PCIe switch do in 8-GPU servers), and four GPUs per
NUMA node.

Example (every key but ``state`` and ``gpus`` is optional)::

    state: state.json            # the simulated hardware; shared by every process using it
    uuid_seed: node-a            # GPU and MIG UUIDs derive from it (distinct per node)
    gpus:
      - A100-SXM4-40GB           # a catalog key (driver.catalog.CATALOG)
      - model: H100-SXM5-80GB
        minor: 3                 # /dev/nvidia3 (default: the list position)
        mig: false               # MIG mode at first boot (default: on)
        gi_id_layout: half-swap  # identity | half-swap (default: chosen from the seed)
        recovery_action: none    # none | gpu-reset | node-reboot | drain-and-reset at boot
    options:
      latency: realistic         # zero | realistic | {DeviceCreateGpuInstanceWithPlacement: 0.3}
      driver_version: 580.105.08
      cuda_driver_version: 13000 # nvmlSystemGetCudaDriverVersion (1000 * major + 10 * minor)
      brand: NVIDIA              # nvmlDeviceGetBrand: an NVML_BRAND_* suffix (TESLA, ...)
      addressing_mode: HMM       # nvmlDeviceGetAddressingMode: HMM | ATS | NONE | unsupported
      privileged: true           # false: instance calls give NO_PERMISSION
      root: true                 # false: SetMigMode gives NO_PERMISSION
      mig_uuid_stable: false     # true: a re-created instance gets the same MIG UUID
      ampere_reset: manual       # manual: MIG mode pends until sim_reset_gpu(); auto: at once
      health_events: true        # false: no NVML events (health must be polled)
    faults:
      - after:GpuInstanceCreateComputeInstance          # SIGKILL the caller at that step
      - {op: GpuInstanceDestroy, error: IN_USE, times: 2, tag: plugin}
    models: []                   # extra GPU models in the model_to_json shape
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from driver import catalog
from driver.catalog import (
    Architecture,
    Engines,
    Evidence,
    GpuModel,
    Placement,
    ProfileSpec,
)

ENV_CONFIG = "CARVE_SIM_CONFIG"
ENV_FAULT_TAG = "CARVE_SIM_FAULT_TAG"

# Reference §17 suggestions (all UNVERIFIED). A key "<Op>.<Architecture>" overrides "<Op>" for
# GPUs of that architecture: Ampere's SetMigMode is the ~2 s "returns with the mode pending" call.
REALISTIC_LATENCY: Mapping[str, float] = {
    "DeviceSetMigMode": 1.0,
    "DeviceSetMigMode.Ampere": 2.0,
    "DeviceCreateGpuInstance": 0.3,
    "DeviceCreateGpuInstanceWithPlacement": 0.3,
    "GpuInstanceCreateComputeInstance": 0.1,
    "GpuInstanceCreateComputeInstanceWithPlacement": 0.1,
    "ComputeInstanceDestroy": 0.1,
    "GpuInstanceDestroy": 1.0,
    "DeviceGetMigDeviceHandleByIndex": 0.01,
}


class SimConfigError(ValueError):
    """The simulator configuration or state file is unusable; the message says how to fix it."""


@dataclass(frozen=True)
class Fault:
    """An injected fault: make an operation fail, hang, or kill the calling process, at a
    named step.

    ``op`` matches a pynvml function name without the "nvml" prefix, or any suffix of it
    ("CreateGpuInstanceWithPlacement" matches "DeviceCreateGpuInstanceWithPlacement").
    ``when`` is "before" (nothing changed yet) or "after" (the change is committed, so the
    caller loses the reply). ``tag`` limits the fault to processes whose CARVE_SIM_FAULT_TAG
    equals it, so a test process can inspect the simulator while a plugin process crashes.
    """

    op: str
    when: str = "before"
    action: str = "error"  # "error", "kill", or "hang" (until sim_release_hangs)
    code: int = 999  # NVML_ERROR_UNKNOWN
    times: int = 1
    gpu: int | None = None
    tag: str | None = None

    def matches(self, op: str, gpu: int | None, tag: str | None) -> bool:
        if not (op == self.op or op.endswith(self.op)):
            return False
        if self.gpu is not None and gpu is not None and gpu != self.gpu:
            return False
        return self.tag is None or self.tag == tag

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "when": self.when,
            "action": self.action,
            "code": self.code,
            "times": self.times,
            "gpu": self.gpu,
            "tag": self.tag,
        }


@dataclass(frozen=True)
class SimGpu:
    """One simulated GPU of the node."""

    model: GpuModel
    minor: int
    mig_enabled: bool = True
    mig_capable: bool = True
    # "identity" or "half-swap": the logical->physical map behind GI ids (reference §6).
    gi_id_layout: str = "identity"
    # NVML_GPU_RECOVERY_ACTION_* at first boot (a GPU that comes up sick, e.g. after XID 79);
    # config key `recovery_action`: none | gpu-reset | node-reboot | drain-and-reset.
    recovery_action: int = 0


@dataclass(frozen=True)
class SimConfig:
    state_path: Path
    gpus: tuple[SimGpu, ...]
    uuid_seed: str = "carve-sim"
    driver_version: str = "580.105.08"
    cuda_driver_version: int = 13000
    latency: Mapping[str, float] = field(default_factory=dict)
    privileged: bool = True
    root: bool = True
    mig_uuid_stable: bool = False
    ampere_reset: str = "manual"  # "manual": pending until sim_reset_gpu; "auto": applied now
    # False: the GPUs support no NVML events (as in some VMs), so health can only be polled.
    health_events: bool = True
    faults: tuple[Fault, ...] = ()
    proc_root: Path | None = None
    sys_root: Path | None = None
    # NVML_BRAND_NVIDIA and NVML_DEVICE_ADDRESSING_MODE_HMM: what an A100 on a 580 driver on
    # x86 reports (kubernetes-sigs/dra-driver-nvidia-gpu#717); addressing mode None gives
    # NOT_SUPPORTED, as on platforms with neither HMM nor ATS
    brand: int = 14
    addressing_mode: int | None = 1

    @property
    def effective_proc_root(self) -> Path:
        """Where the fake /proc tree lives (devices, nvidia-caps, capabilities)."""
        if self.proc_root is not None:
            return self.proc_root
        return self.state_path.with_name(self.state_path.name + ".proc")

    @property
    def effective_sys_root(self) -> Path:
        """Where the fake /sys tree lives (the GPUs' PCI links and NUMA nodes)."""
        if self.sys_root is not None:
            return self.sys_root
        return self.state_path.with_name(self.state_path.name + ".sys")

    def digest(self) -> str:
        """Identity of the simulated hardware; a state file made for other GPUs is refused."""
        desc = [
            (g.model.key, g.minor, g.mig_capable, g.gi_id_layout, _model_fingerprint(g.model))
            for g in self.gpus
        ]
        return hashlib.sha256(json.dumps([self.uuid_seed, desc]).encode()).hexdigest()[:16]


def _model_fingerprint(model: GpuModel) -> str:
    return hashlib.sha256(json.dumps(model_to_json(model), sort_keys=True).encode()).hexdigest()[
        :12
    ]


# --- model (de)serialisation: lets a config carry models the catalog does not have -----------


def model_to_json(model: GpuModel) -> dict[str, Any]:
    return {
        "key": model.key,
        "product_name": model.product_name,
        "pci_device_ids": list(model.pci_device_ids),
        "architecture": model.architecture.value,
        "memory_mib": model.memory_mib,
        "memory_units": model.memory_units,
        "compute_slices": model.compute_slices,
        "cuda_compute_capability": list(model.cuda_compute_capability),
        "profiles": [
            {
                "index": p.index,
                "id": p.id,
                "name": p.name,
                "memory_mib": p.memory_mib,
                "slices": p.slices,
                "multiprocessors": p.multiprocessors,
                "engines": [
                    p.engines.copy,
                    p.engines.decoders,
                    p.engines.encoders,
                    p.engines.jpeg,
                    p.engines.ofa,
                ],
                "max_instances": p.max_instances,
                "placements": [[pl.start, pl.size] for pl in p.placements],
                "evidence": p.evidence.value,
            }
            for p in model.profiles
        ],
    }


def model_from_json(data: Mapping[str, Any]) -> GpuModel:
    try:
        profiles = tuple(
            ProfileSpec(
                index=int(p["index"]),
                id=int(p["id"]),
                name=str(p["name"]),
                memory_mib=int(p["memory_mib"]),
                slices=int(p["slices"]),
                multiprocessors=int(p["multiprocessors"]),
                engines=Engines(*(int(x) for x in p["engines"])),
                max_instances=int(p["max_instances"]),
                placements=tuple(Placement(int(s), int(z)) for s, z in p["placements"]),
                evidence=Evidence(p.get("evidence", "UNVERIFIED")),
            )
            for p in data["profiles"]
        )
        return GpuModel(
            key=str(data["key"]),
            product_name=str(data["product_name"]),
            pci_device_ids=tuple(int(x) for x in data["pci_device_ids"]),
            architecture=Architecture(data["architecture"]),
            memory_mib=int(data["memory_mib"]),
            memory_units=int(data["memory_units"]),
            compute_slices=int(data["compute_slices"]),
            cuda_compute_capability=(
                int(data["cuda_compute_capability"][0]),
                int(data["cuda_compute_capability"][1]),
            ),
            profiles=profiles,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SimConfigError(f"custom GPU model definition is malformed: {exc!r}") from exc


def _lookup_model(key: str, custom: Mapping[str, GpuModel]) -> GpuModel:
    if key in custom:
        return custom[key]
    if key in catalog.CATALOG:
        return catalog.gpu_model(key)
    known = sorted(custom) + sorted(catalog.CATALOG)
    raise SimConfigError(
        f"unknown GPU model {key!r}; use a catalog key ({', '.join(known)}) "
        "or define it under 'models' in the simulator config"
    )


# --- parsing ---------------------------------------------------------------------------------


def parse_fault(raw: object) -> Fault:
    """A fault from its config-file form (a kill point string or a mapping), validated."""
    import pynvml

    if isinstance(raw, str):
        when, sep, op = raw.partition(":")
        if not sep or when not in ("before", "after") or not op:
            raise SimConfigError(
                f"fault {raw!r}: write a kill point as 'before:<Op>' or 'after:<Op>'"
            )
        fault = Fault(op=op, when=when, action="kill")
    elif isinstance(raw, Mapping):
        unknown = set(raw) - {"op", "when", "action", "error", "code", "times", "gpu", "tag"}
        if unknown:
            raise SimConfigError(f"fault {dict(raw)!r}: unknown fields {sorted(unknown)}")
        code_raw = raw.get("error", raw.get("code", pynvml.NVML_ERROR_UNKNOWN))
        if isinstance(code_raw, str):
            name = code_raw if code_raw.startswith("NVML_ERROR_") else "NVML_ERROR_" + code_raw
            if not hasattr(pynvml, name):
                raise SimConfigError(f"fault {dict(raw)!r}: no NVML error named {name}")
            code = int(getattr(pynvml, name))
        else:
            code = int(code_raw)
        gpu = raw.get("gpu")
        tag = raw.get("tag")
        fault = Fault(
            op=str(raw.get("op", "")),
            when=str(raw.get("when", "before")),
            action=str(raw.get("action", "error")),
            code=code,
            times=int(raw.get("times", 1)),
            gpu=None if gpu is None else int(gpu),
            tag=None if tag is None else str(tag),
        )
    else:
        raise SimConfigError(f"fault {raw!r}: expected a string or a mapping")
    validate_fault(fault)
    return fault


KNOWN_OPS: tuple[str, ...] = ()  # filled by the package with every simulated function name


def validate_fault(fault: Fault) -> None:
    if fault.when not in ("before", "after"):
        raise SimConfigError(f"fault on {fault.op!r}: 'when' must be 'before' or 'after'")
    if fault.action not in ("error", "kill", "hang"):
        raise SimConfigError(f"fault on {fault.op!r}: 'action' must be 'error', 'kill' or 'hang'")
    if fault.times < 1:
        raise SimConfigError(f"fault on {fault.op!r}: 'times' must be at least 1")
    if KNOWN_OPS and not any(op == fault.op or op.endswith(fault.op) for op in KNOWN_OPS):
        raise SimConfigError(
            f"fault names unknown operation {fault.op!r}; known: {', '.join(KNOWN_OPS)}"
        )


def _parse_latency(raw: object) -> dict[str, float]:
    if raw is None or raw == "zero":
        return {}
    if raw == "realistic":
        return dict(REALISTIC_LATENCY)
    if isinstance(raw, Mapping):
        out: dict[str, float] = {}
        for key, value in raw.items():
            if key == "preset":
                out.update(_parse_latency(value))
                continue
            seconds = float(value)
            if seconds < 0:
                raise SimConfigError(f"latency for {key!r} must not be negative")
            out[str(key)] = seconds
        return out
    raise SimConfigError(
        f"latency {raw!r}: use 'zero', 'realistic' or a mapping of operation -> seconds"
    )


_TOP_KEYS = {"state", "gpus", "uuid_seed", "options", "faults", "models", "proc_root", "sys_root"}
_OPTION_KEYS = {
    "latency",
    "driver_version",
    "cuda_driver_version",
    "brand",
    "addressing_mode",
    "privileged",
    "root",
    "mig_uuid_stable",
    "ampere_reset",
    "health_events",
}
_GPU_KEYS = {"model", "minor", "mig", "mig_capable", "gi_id_layout", "recovery_action"}
RECOVERY_ACTIONS: Mapping[str, int] = {
    "none": 0,
    "gpu-reset": 1,
    "node-reboot": 2,
    "drain-and-reset": 4,
}


def parse_config(data: Mapping[str, Any], base_dir: Path) -> SimConfig:
    """Build a SimConfig from a mapping (a parsed file, or a dict given to ``configure``)."""
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise SimConfigError(f"simulator config: unknown keys {sorted(unknown)}")
    if "state" not in data:
        raise SimConfigError("simulator config: 'state' (path of the state file) is required")
    state_path = Path(str(data["state"]))
    if not state_path.is_absolute():
        state_path = base_dir / state_path
    custom = {}
    for raw_model in data.get("models") or ():
        m = model_from_json(raw_model)
        custom[m.key] = m
    raw_gpus = data.get("gpus")
    if not isinstance(raw_gpus, Sequence) or isinstance(raw_gpus, str) or not raw_gpus:
        raise SimConfigError("simulator config: 'gpus' must be a non-empty list")
    seed = str(data.get("uuid_seed", "carve-sim"))
    gpus = [_parse_gpu(i, raw, seed, custom) for i, raw in enumerate(raw_gpus)]
    minors = [g.minor for g in gpus]
    if len(set(minors)) != len(minors) or any(not 0 <= m <= 31 for m in minors):
        raise SimConfigError("simulator config: GPU minors must be distinct and within 0..31")
    options: Mapping[str, Any] = data.get("options") or {}
    bad = set(options) - _OPTION_KEYS
    if bad:
        raise SimConfigError(f"simulator config: unknown options {sorted(bad)}")
    ampere_reset = str(options.get("ampere_reset", "manual"))
    if ampere_reset not in ("manual", "auto"):
        raise SimConfigError("simulator config: options.ampere_reset must be 'manual' or 'auto'")
    proc_path = _optional_path(data.get("proc_root"), base_dir)
    sys_path = _optional_path(data.get("sys_root"), base_dir)
    return SimConfig(
        state_path=state_path,
        gpus=tuple(gpus),
        uuid_seed=seed,
        driver_version=str(options.get("driver_version", "580.105.08")),
        cuda_driver_version=int(options.get("cuda_driver_version", 13000)),
        latency=_parse_latency(options.get("latency")),
        privileged=bool(options.get("privileged", True)),
        root=bool(options.get("root", True)),
        mig_uuid_stable=bool(options.get("mig_uuid_stable", False)),
        ampere_reset=ampere_reset,
        health_events=bool(options.get("health_events", True)),
        faults=tuple(parse_fault(f) for f in data.get("faults") or ()),
        proc_root=proc_path,
        sys_root=sys_path,
        brand=_parse_brand(options.get("brand", "NVIDIA")),
        addressing_mode=_parse_addressing_mode(options.get("addressing_mode", "HMM")),
    )


def _parse_gpu(i: int, raw: object, seed: str, custom: Mapping[str, GpuModel]) -> SimGpu:
    """``gpus[i]``: a model key, or a mapping with the model and per-GPU options."""
    if isinstance(raw, str):
        raw = {"model": raw}
    if not isinstance(raw, Mapping):
        raise SimConfigError(f"simulator config: gpus[{i}] must be a model name or a mapping")
    entry: Mapping[str, Any] = raw
    bad = set(entry) - _GPU_KEYS
    if bad:
        raise SimConfigError(f"simulator config: gpus[{i}] has unknown keys {sorted(bad)}")
    if "model" not in entry:
        raise SimConfigError(f"simulator config: gpus[{i}] needs a 'model'")
    layout = entry.get("gi_id_layout")
    if layout is None:
        # Deterministic per GPU, so a node mixes both layouts and nothing can rely on one.
        digest = hashlib.sha256(f"{seed}/{i}".encode()).digest()
        layout = "half-swap" if digest[0] & 1 else "identity"
    if layout not in ("identity", "half-swap"):
        raise SimConfigError(
            f"simulator config: gpus[{i}].gi_id_layout must be 'identity' or 'half-swap'"
        )
    action = str(entry.get("recovery_action", "none"))
    if action not in RECOVERY_ACTIONS:
        raise SimConfigError(
            f"simulator config: gpus[{i}].recovery_action must be one of "
            f"{', '.join(RECOVERY_ACTIONS)}, not {action!r}"
        )
    return SimGpu(
        model=_lookup_model(str(entry["model"]), custom),
        recovery_action=RECOVERY_ACTIONS[action],
        minor=int(entry.get("minor", i)),
        mig_enabled=bool(entry.get("mig", True)),
        mig_capable=bool(entry.get("mig_capable", True)),
        gi_id_layout=str(layout),
    )


def _optional_path(raw: object, base_dir: Path) -> Path | None:
    if raw is None:
        return None
    path = Path(str(raw))
    return path if path.is_absolute() else base_dir / path


def _parse_brand(raw: object) -> int:
    """An NVML_BRAND_* name (with or without the prefix) as its nvmlBrandType_t value."""
    import pynvml

    name = str(raw).upper()
    name = name if name.startswith("NVML_BRAND_") else "NVML_BRAND_" + name
    if name == "NVML_BRAND_COUNT" or not isinstance(getattr(pynvml, name, None), int):
        raise SimConfigError(f"simulator config: options.brand {raw!r} is no NVML_BRAND_* name")
    return int(getattr(pynvml, name))


_ADDRESSING_MODES = {"NONE": 0, "HMM": 1, "ATS": 2, "UNSUPPORTED": None}


def _parse_addressing_mode(raw: object) -> int | None:
    key = str(raw).upper()
    if key not in _ADDRESSING_MODES:
        raise SimConfigError(
            f"simulator config: options.addressing_mode must be HMM, ATS, NONE or "
            f"unsupported, not {raw!r}"
        )
    return _ADDRESSING_MODES[key]


def load_config_file(path: str | os.PathLike[str]) -> SimConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SimConfigError(f"cannot read simulator config {p}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    except yaml.YAMLError as exc:
        raise SimConfigError(f"simulator config {p} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(data, Mapping):
        raise SimConfigError(f"simulator config {p} must be a mapping at the top level")
    return parse_config(data, p.resolve().parent)
