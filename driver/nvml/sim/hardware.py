"""The simulated hardware: per-GPU MIG state, the rules NVML enforces, and its file-backed store.

The rules here are deliberately written from the reference (memory-unit overlap, counted engine
pools, the ALL_ME/NO_ME exclusion, per-profile instance caps, swizzId GI ids) and do not use
``driver.geometry``: tests that compare the backend on the simulator with the geometry module
are then two independent implementations checking each other.

State is JSON in one file, replaced atomically and guarded by an fcntl lock on a sibling lock
file, so every simulated NVML call is one read-modify-write that other processes on the node
observe, and a process killed at any point leaves either the old or the new state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from driver.bootid import BOOT_ID_PATH
from driver.catalog import Engines, GpuModel, Placement, ProfileSpec
from driver.nvml.sim import driverfiles
from driver.nvml.sim.config import SimConfig, SimConfigError

STATE_FORMAT = 1

# NVML error codes (nvml.h); kept numeric here so the rules stay free of pynvml.
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
INSUFFICIENT_RESOURCES = 23

# Profile index constants with media-engine semantics (nvml.h).
_NO_ME_INDICES = frozenset({0xD, 0xE})
_ALL_ME_INDICES = frozenset({0xF, 0x10})

# Compute-instance profile index (== id) for each CI size in compute slices (reference §7).
CI_INDEX_FOR_SIZE = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
CI_SIZE_FOR_INDEX = {v: k for k, v in CI_INDEX_FOR_SIZE.items()}
MAX_CIS_PER_GI = 8
NVIDIA_CAPS_MAJOR = 508
NVIDIA_UVM_MAJOR = 510


@dataclass
class CiRec:
    id: int
    profile_id: int
    start: int
    size: int
    serial: int
    uuid: str
    busy: bool = False
    # Host PIDs of the processes running on this compute instance (what
    # nvmlDeviceGetComputeRunningProcesses reports); any of them makes a destroy IN_USE.
    pids: list[int] = field(default_factory=list)

    @property
    def in_use(self) -> bool:
        return self.busy or bool(self.pids)


@dataclass
class GiRec:
    id: int
    profile_id: int
    start: int
    size: int
    serial: int
    cis: list[CiRec] = field(default_factory=list)


@dataclass
class GpuRec:
    uuid: str
    minor: int
    bus_id: str
    layout: str
    mig_capable: bool
    mig_current: int
    mig_pending: int
    gis: list[GiRec] = field(default_factory=list)
    # Processes holding the whole GPU (a CUDA application, DCGM, nvidia-persistenced): while
    # any exist the driver cannot unbind or reset the GPU, so a MIG-mode change is refused.
    clients: int = 0
    # Health (sim.health): the recovery action the driver asks for (NVML_GPU_RECOVERY_ACTION_*,
    # field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) and volatile ECC counts; a reset clears them.
    recovery_action: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    # Fallen off the bus (XID 79, sim_lose_gpu): every call on it answers GPU_IS_LOST until a
    # reset or a reboot, which bring it back without its instances.
    lost: bool = False

    def gi(self, gi_id: int) -> GiRec | None:
        return next((g for g in self.gis if g.id == gi_id), None)


@dataclass
class HwState:
    digest: str
    boots: int
    serial: int
    gpus: list[GpuRec]
    faults: list[dict[str, Any]]
    # The kernel's boot ID (/proc/sys/kernel/random/boot_id in the fake /proc): random, and new
    # at every simulated reboot, as the kernel's is. Empty in a state written before it existed:
    # `boot_id_of` derives a stable one from the boot count then.
    boot_id: str = ""
    # Where this node's files are (driver_root, dev_root; see driverfiles), once provisioned.
    node_roots: dict[str, str] = field(default_factory=dict)
    # Health events (sim.health), newest last, each {"serial", "gpu", "type", "data"}; an event
    # set sees those with a serial above the one current when it registered.
    events: list[dict[str, int]] = field(default_factory=list)
    event_serial: int = 0
    # Calls held by a "hang" fault (sim.faults), each {"id", "op", "gpu", "when"}: the call
    # waits, outside the state lock, until its entry is removed (sim_release_hangs).
    hangs: list[dict[str, Any]] = field(default_factory=list)

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def to_json(self) -> dict[str, Any]:
        # Hand-written rather than dataclasses.asdict: this runs on every simulated NVML call,
        # and asdict's deep copies dominated the call's cost.
        extra: dict[str, Any] = {"node_roots": dict(self.node_roots)} if self.node_roots else {}
        if self.boot_id:
            extra["boot_id"] = self.boot_id
        if self.event_serial:
            extra["events"] = [dict(e) for e in self.events]
            extra["event_serial"] = self.event_serial
        if self.hangs:
            extra["hangs"] = [dict(h) for h in self.hangs]
        return {
            **extra,
            "format": STATE_FORMAT,
            "digest": self.digest,
            "boots": self.boots,
            "serial": self.serial,
            "faults": self.faults,
            "gpus": [
                {
                    **{k: v for k, v in vars(g).items() if k != "gis"},
                    "gis": [
                        {
                            **{k: v for k, v in vars(gi).items() if k != "cis"},
                            "cis": [dict(vars(ci)) for ci in gi.cis],
                        }
                        for gi in g.gis
                    ],
                }
                for g in self.gpus
            ],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> HwState:
        gpus = []
        for g in data["gpus"]:
            gis = []
            for gi in g.pop("gis"):
                cis = [CiRec(**ci) for ci in gi.pop("cis")]
                gis.append(GiRec(**gi, cis=cis))
            gpus.append(GpuRec(**g, gis=gis))
        return HwState(
            digest=data["digest"],
            boots=data["boots"],
            serial=data["serial"],
            gpus=gpus,
            faults=list(data["faults"]),
            node_roots=dict(data.get("node_roots") or {}),
            events=[dict(e) for e in data.get("events") or ()],
            event_serial=int(data.get("event_serial", 0)),
            hangs=[dict(h) for h in data.get("hangs") or ()],
            boot_id=str(data.get("boot_id") or ""),
        )


def new_boot_id() -> str:
    """A boot ID as the kernel makes one at every boot: a random UUID, lower-case, dashed."""
    return str(uuidlib.uuid4())


def boot_id_of(config: SimConfig, state: HwState) -> str:
    """The state's boot ID; a state file from before boot IDs gets one derived from its seed
    and boot count, so that it stays the same until the next simulated reboot."""
    if state.boot_id:
        return state.boot_id
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{config.uuid_seed}/boot/{state.boots}"))


def fresh_state(config: SimConfig) -> HwState:
    gpus = []
    for i, g in enumerate(config.gpus):
        mode = 1 if (g.mig_enabled and g.mig_capable) else 0
        gpus.append(
            GpuRec(
                uuid="GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{config.uuid_seed}/{i}")),
                minor=g.minor,
                bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                layout=g.gi_id_layout,
                mig_capable=g.mig_capable,
                mig_current=mode,
                mig_pending=mode,
                recovery_action=g.recovery_action,
            )
        )
    faults = [{**f.to_json(), "remaining": f.times} for f in config.faults]
    return HwState(
        digest=config.digest(), boots=0, serial=0, gpus=gpus, faults=faults, boot_id=new_boot_id()
    )


class StateStore:
    """The state file plus its lock; ``transaction`` is one atomic read-modify-write."""

    def __init__(self, config: SimConfig) -> None:
        self._config = config
        self._digest = config.digest()
        self._path = config.state_path
        self._lock_path = self._path.with_name(self._path.name + ".lock")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[HwState]:
        """Yield the current state under an exclusive lock; save it if the body returns."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                state, before = self._load()
                yield state
                after = json.dumps(state.to_json(), sort_keys=True)
                if after != before:
                    self._save(after)
                    sync_proc(self._config, state)
                    sync_node_files(self._config, state)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def save_now(self, state: HwState) -> None:
        """Persist mid-transaction (the lock is held): used before raising or dying on a fault."""
        self._save(json.dumps(state.to_json(), sort_keys=True))
        sync_proc(self._config, state)
        sync_node_files(self._config, state)

    def _load(self) -> tuple[HwState, str | None]:
        """The state and the exact text it was read from (None for a fresh state), so that an
        unchanged state is recognised by comparing texts and never rewritten."""
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return fresh_state(self._config), None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SimConfigError(
                f"simulator state {self._path} is corrupt ({exc}); delete it to start over"
            ) from exc
        if data.get("format") != STATE_FORMAT:
            raise SimConfigError(
                f"simulator state {self._path} has format {data.get('format')!r}, "
                f"expected {STATE_FORMAT}; delete it to start over"
            )
        if data.get("digest") != self._digest:
            raise SimConfigError(
                f"simulator state {self._path} was made for a different set of GPUs than the "
                "current config; delete it or point 'state' at another file"
            )
        return HwState.from_json(data), text

    def _save(self, text: str) -> None:
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self._path)


# --- placement rules ---------------------------------------------------------------------------


def _span_geometry(model: GpuModel) -> tuple[int, int]:
    """(span length, memory units per span unit) of the swizzId map (reference §6)."""
    units = model.memory_units
    span_len = units if units & (units - 1) == 0 else model.compute_slices
    if units % span_len:
        raise SimConfigError(f"{model.key}: {units} memory units do not split into {span_len}")
    return span_len, units // span_len


def gi_id_for(model: GpuModel, layout: str, placement: Placement) -> int:
    """The swizzId of a placement under this GPU's logical->physical layout."""
    span_len, per = _span_geometry(model)
    start = placement.start
    if layout == "half-swap" and placement.size < model.memory_units:
        start = (start + model.memory_units // 2) % model.memory_units
    n, rem_n = divmod(placement.size, per)
    p, rem_p = divmod(start, per)
    if rem_n or rem_p or n == 0 or span_len % n or p % n:
        raise SimConfigError(f"{model.key}: placement {placement} has no swizzId")
    return (span_len // n - 1) + p // n


def validate_model(model: GpuModel) -> None:
    """Refuse models the simulator could not represent faithfully."""
    for prof in model.profiles:
        if not prof.placements:
            raise SimConfigError(f"{model.key}: profile {prof.name} has no placements")
        for pl in prof.placements:
            if pl.end > model.memory_units:
                raise SimConfigError(f"{model.key}: {prof.name} placement {pl} is off the GPU")
            gi_id_for(model, "identity", pl)
            gi_id_for(model, "half-swap", pl)


# Auto-placement preference in swizzId order for 8-span GPUs (reference §6, INFERRED from UG-G).
_AUTO_ORDER_8 = {1: (13, 11, 12, 7, 8, 9, 10), 2: (5, 3, 4, 6), 4: (2, 1), 8: (0,)}


def auto_placement_order(model: GpuModel, layout: str, prof: ProfileSpec) -> list[Placement]:
    by_id = {gi_id_for(model, layout, pl): pl for pl in prof.placements}
    span_len, per = _span_geometry(model)
    pref = _AUTO_ORDER_8.get(prof.size // per) if span_len == 8 else None
    if pref is None:
        return [by_id[i] for i in sorted(by_id)]
    ordered = [by_id[i] for i in pref if i in by_id]
    return ordered + [by_id[i] for i in sorted(by_id) if by_id[i] not in ordered]


def _profile(model: GpuModel, profile_id: int) -> ProfileSpec | None:
    return next((p for p in model.profiles if p.id == profile_id), None)


def _used(model: GpuModel, gpu: GpuRec) -> tuple[int, Engines, int, list[ProfileSpec]]:
    mask = 0
    engines = Engines(0, 0, 0, 0, 0)
    slices = 0
    profs = []
    for gi in gpu.gis:
        prof = _profile(model, gi.profile_id)
        if prof is None:  # cannot happen for a state this simulator wrote
            raise SimConfigError(f"state holds unknown profile id {gi.profile_id}")
        mask |= Placement(gi.start, gi.size).mask
        engines = engines + prof.engines
        slices += prof.slices
        profs.append(prof)
    return mask, engines, slices, profs


def gi_fit_error(model: GpuModel, gpu: GpuRec, prof: ProfileSpec, pl: Placement) -> int | None:
    """The NVML error creating ``prof`` at ``pl`` would give now, or None if it fits."""
    if pl not in prof.placements:
        return INVALID_ARGUMENT
    mask, engines, slices, profs = _used(model, gpu)
    if pl.mask & mask:
        return INSUFFICIENT_RESOURCES
    if sum(1 for p in profs if p.id == prof.id) >= prof.max_instances:
        return INSUFFICIENT_RESOURCES
    if not (engines + prof.engines).fits_within(model.engine_totals):
        return INSUFFICIENT_RESOURCES
    if slices + prof.slices > model.compute_slices:
        return INSUFFICIENT_RESOURCES
    all_me_present = any(p.index in _ALL_ME_INDICES for p in profs)
    if all_me_present and prof.index not in _NO_ME_INDICES:
        return INSUFFICIENT_RESOURCES
    if prof.index in _ALL_ME_INDICES and any(p.index not in _NO_ME_INDICES for p in profs):
        return INSUFFICIENT_RESOURCES
    return None


def remaining_capacity(model: GpuModel, gpu: GpuRec, prof: ProfileSpec) -> int:
    """How many more of ``prof`` fit together now: greedy over its aligned placements, which
    is optimal for equal-size aligned intervals, with engine pools and caps applied as it goes.
    """
    trial = replace(gpu, gis=list(gpu.gis))
    count = 0
    for pl in sorted(prof.placements):
        if gi_fit_error(model, trial, prof, pl) is None:
            trial.gis.append(GiRec(-1, prof.id, pl.start, pl.size, 0))
            count += 1
    return count


# --- compute instances -------------------------------------------------------------------------


def ci_sizes(gi_slices: int) -> list[int]:
    """CI sizes a GI of ``gi_slices`` offers (go-nvlib heuristic, matches every capture)."""
    return [
        c
        for c in range(1, gi_slices + 1)
        if c in CI_INDEX_FOR_SIZE and (c == gi_slices or 2 * c <= gi_slices + 1)
    ]


def ci_free_start(gi_slices: int, gi: GiRec, size: int) -> int | None:
    used = 0
    for ci in gi.cis:
        used |= ((1 << ci.size) - 1) << ci.start
    for start in range(0, gi_slices - size + 1, size):
        if not used & (((1 << size) - 1) << start):
            return start
    return None


def mig_uuid(config: SimConfig, gpu: GpuRec, gi_id: int, ci_id: int, serial: int) -> str:
    name = f"{config.uuid_seed}/{gpu.uuid}/{gi_id}/{ci_id}"
    if not config.mig_uuid_stable:
        name += f"/{serial}"
    return "MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, name))


# --- fake /proc --------------------------------------------------------------------------------

_FILE_MODE_READ_ALL = 0o444


def gi_cap_minor(gpu_minor: int, gi_id: int) -> int:
    return 3 + 135 * gpu_minor + 9 * gi_id


def ci_cap_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    return 4 + 135 * gpu_minor + 9 * gi_id + ci_id


def _access_text(minor: int, mode: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


# --- the node's PCI topology in a fake /sys -------------------------------------------------------

_GPUS_PER_ROOT_COMPLEX = 2  # a pair behind one PCIe switch, as in 8-GPU servers
_GPUS_PER_NUMA_NODE = 4


@dataclass(frozen=True)
class PciPlace:
    """Where GPU ``index`` sits: its sysfs address, the path of its directory under
    ``/sys/devices`` (root complex, root port, device) and its NUMA node."""

    address: str  # "0000:18:00.0", the kernel's spelling of NVML's "00000000:18:00.0"
    device_path: str  # "pci0000:17/0000:17:01.0/0000:18:00.0"
    numa_node: int


def pci_place(index: int, bus_id: str) -> PciPlace:
    """The simulated topology of GPU ``index`` whose NVML bus id is ``bus_id``.

    The root complex of a pair is named after the bus just below the pair's first GPU
    (``pci0000:17`` above ``0000:18:00.0``), and each GPU has a root port of its own on it.
    """
    domain, bus, rest = bus_id.lower().split(":", 2)
    address = f"{int(domain, 16):04x}:{bus}:{rest}"
    # GPUs are 0x10 buses apart (fresh_state): the pair's first GPU is that far below
    root_bus = int(bus, 16) - 0x10 * (index % _GPUS_PER_ROOT_COMPLEX) - 1
    root = f"{int(domain, 16):04x}:{root_bus:02x}"
    port = f"{root}:{1 + index % _GPUS_PER_ROOT_COMPLEX:02x}.0"
    return PciPlace(address, f"pci{root}/{port}/{address}", index // _GPUS_PER_NUMA_NODE)


def sync_sys(config: SimConfig, state: HwState) -> None:
    """Make the fake /sys tree for the GPUs of ``state`` (idempotent): per GPU a directory
    under ``devices/`` with its ``numa_node`` and the relative link
    ``bus/pci/devices/<address>`` -> ``../../../devices/<path>``, as the kernel lays it out."""
    root = config.effective_sys_root
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    for index, gpu in enumerate(state.gpus):
        place = pci_place(index, gpu.bus_id)
        device = root / "devices" / place.device_path
        if not (device / "numa_node").exists():
            device.mkdir(parents=True, exist_ok=True)
            (device / "numa_node").write_text(f"{place.numa_node}\n")
        link = links / place.address
        if not link.is_symlink():
            link.symlink_to(f"../../../devices/{place.device_path}")


def sync_proc(config: SimConfig, state: HwState) -> None:
    """Mirror the state into a fake /proc tree: /proc/devices (with the nvidia-caps major),
    the static mig-minors table, per-instance capability files that exist only while the
    instance does (reference §15, §18.9), and the kernel's boot ID
    (``sys/kernel/random/boot_id``), which changes with every simulated reboot."""
    root = config.effective_proc_root
    devices = root / "devices"
    if not devices.exists():
        root.mkdir(parents=True, exist_ok=True)
        devices.write_text(
            "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia-frontend\n"
            f"{NVIDIA_CAPS_MAJOR} nvidia-caps\n{NVIDIA_UVM_MAJOR} nvidia-uvm\n\n"
            "Block devices:\n  8 sd\n"
        )
        lines = ["config 1", "monitor 2"]
        for g in range(32):
            for i in range(15):
                lines.append(f"gpu{g}/gi{i}/access {gi_cap_minor(g, i)}")
                lines.extend(f"gpu{g}/gi{i}/ci{c}/access {ci_cap_minor(g, i, c)}" for c in range(8))
        minors = root / "driver" / "nvidia-caps" / "mig-minors"
        minors.parent.mkdir(parents=True, exist_ok=True)
        minors.write_text("\n".join(lines) + "\n")
    boot_file = root / BOOT_ID_PATH
    boot_text = boot_id_of(config, state) + "\n"
    if not boot_file.exists() or boot_file.read_text() != boot_text:
        boot_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = boot_file.with_name(f".boot_id.{os.getpid()}.tmp")
        tmp.write_text(boot_text)
        os.replace(tmp, boot_file)  # a reader never sees it half written
    caps = root / "driver" / "nvidia" / "capabilities"
    want = {
        "mig/config": _access_text(1, 0o400),
        "mig/monitor": _access_text(2, _FILE_MODE_READ_ALL),
    }
    for gpu in state.gpus:
        for gi in gpu.gis:
            gi_dir = f"gpu{gpu.minor}/mig/gi{gi.id}"
            want[f"{gi_dir}/access"] = _access_text(
                gi_cap_minor(gpu.minor, gi.id), _FILE_MODE_READ_ALL
            )
            for ci in gi.cis:
                want[f"{gi_dir}/ci{ci.id}/access"] = _access_text(
                    ci_cap_minor(gpu.minor, gi.id, ci.id), _FILE_MODE_READ_ALL
                )
    # Incremental: a file's content follows from its path, so only existence has to change.
    # (Rebuilding the tree on every call made file-system latency dominate simulated calls.)
    wanted_dirs = {parent.as_posix() for rel in want for parent in Path(rel).parents}
    if caps.exists():
        for path in sorted(caps.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            rel = path.relative_to(caps).as_posix()
            if path.is_dir():
                if rel not in wanted_dirs:
                    shutil.rmtree(path, ignore_errors=True)
            elif rel not in want:
                path.unlink(missing_ok=True)
    for rel, text in want.items():
        target = caps / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


# --- the node's driver root and dev root ---------------------------------------------------------


def _smi_gpus(config: SimConfig, state: HwState) -> list[driverfiles.SmiGpu]:
    gpus = []
    for sim_gpu, gpu in zip(config.gpus, state.gpus, strict=True):
        migs = []
        for gi in gpu.gis:
            prof = _profile(sim_gpu.model, gi.profile_id)
            name = prof.name if prof is not None else f"profile-{gi.profile_id}"
            for ci in gi.cis:
                small = prof is not None and ci.size != prof.slices
                migs.append(
                    driverfiles.SmiMig(
                        f"{ci.size}c.{name}" if small else name,
                        ci.uuid,
                        ci_cap_minor(gpu.minor, gi.id, ci.id),
                    )
                )
        gpus.append(
            driverfiles.SmiGpu(gpu.uuid, sim_gpu.model.product_name, tuple(migs), gpu.minor)
        )
    return gpus


def sync_node_files(config: SimConfig, state: HwState, *, provision: bool = False) -> None:
    """Mirror the state into the node's driver root and dev root, where provisioned: the
    nvidia-smi stand-in's table and the per-instance capability nodes. ``provision`` also
    (re)writes the driver root's static files (libraries, links, firmware)."""
    driver_root = state.node_roots.get("driver_root")
    dev_root = state.node_roots.get("dev_root")
    if driver_root:
        root = Path(driver_root)
        if provision:
            driverfiles.populate_driver_root(root, config.driver_version)
        script = driverfiles.nvidia_smi_script(
            config.driver_version,
            driverfiles.cuda_version_text(config.cuda_driver_version),
            _smi_gpus(config, state),
        )
        driverfiles.write_nvidia_smi(root, script)
    if dev_root:
        caps = []
        for gpu in state.gpus:
            for gi in gpu.gis:
                caps.append(gi_cap_minor(gpu.minor, gi.id))
                caps.extend(ci_cap_minor(gpu.minor, gi.id, ci.id) for ci in gi.cis)
        driverfiles.sync_dev_nodes(
            Path(dev_root),
            gpu_minors=[g.minor for g in state.gpus],
            cap_minors=caps,
            caps_major=NVIDIA_CAPS_MAJOR,
            uvm_major=NVIDIA_UVM_MAJOR,
        )
