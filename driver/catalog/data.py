"""The static catalogue of MIG-capable GPU models: twelve products and their profile tables.

The catalogue feeds the NVML simulator and the tests. On real hardware the kubelet plugin
discovers profiles from NVML instead, so nothing in the product may depend on a model being
listed here. Every profile keeps the evidence label of the reference it came from (VERIFIED /
INFERRED / UNVERIFIED), so a reader can tell measured facts from educated guesses.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from driver.catalog.model import (
    Architecture,
    Engines,
    Evidence,
    GpuModel,
    Placement,
    ProfileIndex,
    ProfileSpec,
)

# --------------------------------------------------------------------------------------------
# Data. Facts and labels come from carve's reference (mig-and-nvml.md sections 2-4); a value
# the reference leaves open is a documented guess labelled UNVERIFIED with a note saying how it
# was derived, so the simulator stays usable and nobody mistakes it for a measurement.
# --------------------------------------------------------------------------------------------

_V, _I, _U = Evidence.VERIFIED, Evidence.INFERRED, Evidence.UNVERIFIED
_X = ProfileIndex


def _row(  # noqa: PLR0917 -- positional on purpose: each call is one table row
    index: ProfileIndex,
    profile_id: int,
    name: str,
    memory_mib: int,
    multiprocessors: int,
    engines: tuple[int, int, int, int, int],
    max_instances: int,
    placements: tuple[tuple[int, ...], int],
    evidence: Evidence,
    note: str = "",
) -> ProfileSpec:
    """One profile row, written in the order of the reference tables.

    engines = (CE, DEC, ENC, JPEG, OFA); placements = ((starts...), size) as `-lgipp` prints them.
    The slice count is read from the name's "<g>g" prefix, which is fixed per profile family.
    """
    starts, size = placements
    return ProfileSpec(
        index=int(index),
        id=profile_id,
        name=name,
        memory_mib=memory_mib,
        slices=int(name.split("g.", 1)[0]),
        multiprocessors=multiprocessors,
        engines=Engines(*engines),
        max_instances=max_instances,
        placements=tuple(Placement(s, size) for s in starts),
        evidence=evidence,
        note=note,
    )


# Placement lists shared by every 8-unit GPU (A100, H100, H200, B200, GB200).
_P8_1 = ((0, 1, 2, 3, 4, 5, 6), 1)
_P8_1X2 = ((0, 2, 4, 6), 2)
_P8_2 = ((0, 2, 4), 2)
_P8_3 = ((0, 4), 4)
_P8_4 = ((0,), 4)
_P8_7 = ((0,), 8)

_H100_PLACEMENTS_GUESS = (
    "placements assumed equal to H100's: no `-lgipp` capture exists, and the profile "
    "memory fractions (UG-P) match H100's"
)


def _hopper_like(  # noqa: PLR0917 -- one call per model, in table order
    key: str,
    product_name: str,
    pci_ids: tuple[int, ...],
    memory_mib: int,
    names: tuple[str, str, str, str, str, str, str],
    mib: tuple[int, int, int, int],  # 1g, 1g double / 2g, 3g / 4g, 7g
    sms: tuple[int, int, int, int, int, int],  # 1g, 1g double, 2g, 3g, 4g, 7g
    evidence: tuple[Evidence, Evidence, Evidence, Evidence, Evidence, Evidence, Evidence],
    notes: tuple[str, str, str, str, str, str, str] = ("",) * 7,
    placement_evidence: Evidence = _V,
    note: str = "",
) -> GpuModel:
    """A Hopper GPU: same ids, engines and placements as H100 80GB, own sizes and SM counts.

    Engines (CE/DEC/ENC/JPEG/OFA) are H100's: every Hopper MIG table in the reference (UG-P and
    captures) shows the same media columns, and Hopper has no NVENC.
    """
    m1, m2, m3, m7 = mib
    s1, s1d, s2, s3, s4, s7 = sms
    n1, n1me, n1d, n2, n3, n4, n7 = names
    e, t = evidence, notes
    return GpuModel(
        key=key,
        product_name=product_name,
        pci_device_ids=pci_ids,
        architecture=Architecture.HOPPER,
        memory_mib=memory_mib,
        memory_units=8,
        compute_slices=7,
        cuda_compute_capability=(9, 0),
        profiles=(
            _row(_X.SLICE_1, 19, n1, m1, s1, (1, 1, 0, 1, 0), 7, _P8_1, e[0], t[0]),
            _row(_X.SLICE_1_REV1, 20, n1me, m1, s1, (1, 1, 0, 1, 1), 1, _P8_1, e[1], t[1]),
            _row(_X.SLICE_1_REV2, 15, n1d, m2, s1d, (1, 1, 0, 1, 0), 4, _P8_1X2, e[2], t[2]),
            _row(_X.SLICE_2, 14, n2, m2, s2, (2, 2, 0, 2, 0), 3, _P8_2, e[3], t[3]),
            _row(_X.SLICE_3, 9, n3, m3, s3, (3, 3, 0, 3, 0), 2, _P8_3, e[4], t[4]),
            _row(_X.SLICE_4, 5, n4, m3, s4, (4, 4, 0, 4, 0), 1, _P8_4, e[5], t[5]),
            _row(_X.SLICE_7, 0, n7, m7, s7, (8, 7, 0, 7, 1), 1, _P8_7, e[6], t[6]),
        ),
        placement_evidence=placement_evidence,
        note=note,
    )


def _blackwell_dc(  # noqa: PLR0917 -- one call per model, in table order
    key: str,
    product_name: str,
    pci_ids: tuple[int, ...],
    memory_mib: int,
    names: tuple[str, str, str, str, str, str, str],
    mib: tuple[int, int, int, int],
    sms: tuple[int, int, int, int, int, int],
    notes: tuple[str, str, str, str, str, str, str],
) -> GpuModel:
    """B200 / GB200: 8 units, 7 slices; 1g and 2g rows captured, 3g/4g/7g rows guessed.

    Engines: CE 2 per slice (captures; UG-P gives 6/8/16 for 3g/4g/7g); DEC and JPEG one per
    compute slice as on the captured 2g (UG-P's media columns contradict the captures); no NVENC.
    """
    m1, m2, m3, m7 = mib
    s1, s1d, s2, s3, s4, s7 = sms
    n1, n1me, n1d, n2, n3, n4, n7 = names
    t = notes
    return GpuModel(
        key=key,
        product_name=product_name,
        pci_device_ids=pci_ids,
        architecture=Architecture.BLACKWELL,
        memory_mib=memory_mib,
        memory_units=8,
        compute_slices=7,
        cuda_compute_capability=(10, 0),
        profiles=(
            _row(_X.SLICE_1, 19, n1, m1, s1, (2, 1, 0, 1, 0), 7, _P8_1, _V, t[0]),
            _row(_X.SLICE_1_REV1, 20, n1me, m1, s1, (2, 1, 0, 1, 1), 1, _P8_1, _V, t[1]),
            _row(_X.SLICE_1_REV2, 15, n1d, m2, s1d, (2, 1, 0, 1, 0), 4, _P8_1X2, _V, t[2]),
            _row(_X.SLICE_2, 14, n2, m2, s2, (4, 2, 0, 2, 0), 3, _P8_2, _V, t[3]),
            _row(_X.SLICE_3, 9, n3, m3, s3, (6, 3, 0, 3, 0), 2, _P8_3, _U, t[4]),
            _row(_X.SLICE_4, 5, n4, m3, s4, (8, 4, 0, 4, 0), 1, _P8_4, _U, t[5]),
            _row(_X.SLICE_7, 0, n7, m7, s7, (16, 7, 0, 7, 1), 1, _P8_7, _U, t[6]),
        ),
        placement_evidence=_U,
        note=_H100_PLACEMENTS_GUESS,
    )


_A30 = GpuModel(
    key="A30-24GB",
    product_name="NVIDIA A30",
    pci_device_ids=(0x20B7,),
    architecture=Architecture.AMPERE,
    memory_mib=24576,
    memory_units=4,
    compute_slices=4,
    cuda_compute_capability=(8, 0),
    profiles=(
        _row(_X.SLICE_1, 14, "1g.6gb", 5952, 14, (1, 1, 0, 0, 0), 4, ((0, 1, 2, 3), 1), _V,
             "DEC 1 from captures; UG-P says 0"),
        _row(_X.SLICE_1_REV1, 21, "1g.6gb+me", 5952, 14, (1, 1, 0, 1, 1), 1, ((0, 1, 2, 3), 1),
             _V),
        _row(_X.SLICE_2, 5, "2g.12gb", 11968, 28, (2, 2, 0, 0, 0), 2, ((0, 2), 2), _V),
        _row(_X.SLICE_2_REV1, 6, "2g.12gb+me", 11968, 28, (2, 2, 0, 1, 1), 1, ((0, 2), 2), _V),
        _row(_X.SLICE_4, 0, "4g.24gb", 24000, 56, (4, 4, 0, 1, 1), 1, ((0,), 4), _V,
             "another capture shows 24064 MiB (23.50 GiB)"),
    ),
    note="single JPEG and OFA: 1g+me and 2g+me exclude each other",
)  # fmt: skip

_A100_40 = GpuModel(
    key="A100-SXM4-40GB",
    product_name="NVIDIA A100-SXM4-40GB",
    pci_device_ids=(0x20B0, 0x20B1, 0x20F1, 0x20F6),
    architecture=Architecture.AMPERE,
    memory_mib=40960,
    memory_units=8,
    compute_slices=7,
    cuda_compute_capability=(8, 0),
    profiles=(
        _row(_X.SLICE_1, 19, "1g.5gb", 4864, 14, (1, 0, 0, 0, 0), 7, _P8_1, _V),
        _row(_X.SLICE_1_REV1, 20, "1g.5gb+me", 4864, 14, (1, 1, 0, 1, 1), 1, _P8_1, _V),
        _row(_X.SLICE_1_REV2, 15, "1g.10gb", 9856, 14, (1, 1, 0, 0, 0), 4, _P8_1X2, _V),
        _row(_X.SLICE_2, 14, "2g.10gb", 9856, 28, (2, 1, 0, 0, 0), 3, _P8_2, _V),
        _row(_X.SLICE_3, 9, "3g.20gb", 19968, 42, (3, 2, 0, 0, 0), 2, _P8_3, _V),
        _row(_X.SLICE_4, 5, "4g.20gb", 19968, 56, (4, 2, 0, 0, 0), 1, _P8_4, _V),
        _row(_X.SLICE_7, 0, "7g.40gb", 40192, 98, (7, 5, 0, 1, 1), 1, _P8_7, _V),
    ),
    note="PCIe 40GB (0x20B1, 0x20F1) and A800-40GB (0x20F6) share this table; "
    "single JPEG and OFA: 1g.5gb+me and 7g take them",
)

_A100_80 = GpuModel(
    key="A100-SXM4-80GB",
    product_name="NVIDIA A100-SXM4-80GB",
    pci_device_ids=(0x20B2, 0x20B5, 0x20F3, 0x20F5),
    architecture=Architecture.AMPERE,
    memory_mib=81920,
    memory_units=8,
    compute_slices=7,
    cuda_compute_capability=(8, 0),
    profiles=(
        _row(_X.SLICE_1, 19, "1g.10gb", 9728, 14, (1, 0, 0, 0, 0), 7, _P8_1, _V,
             "9728 or 9984 MiB depending on driver"),
        _row(_X.SLICE_1_REV1, 20, "1g.10gb+me", 9728, 14, (1, 1, 0, 1, 1), 1, _P8_1, _V,
             "9728 or 9984 MiB depending on driver"),
        _row(_X.SLICE_1_REV2, 15, "1g.20gb", 19968, 14, (1, 1, 0, 0, 0), 4, _P8_1X2, _V),
        _row(_X.SLICE_2, 14, "2g.20gb", 19968, 28, (2, 1, 0, 0, 0), 3, _P8_2, _V),
        _row(_X.SLICE_3, 9, "3g.40gb", 40448, 42, (3, 2, 0, 0, 0), 2, _P8_3, _V,
             "40192 or 40448 MiB depending on driver"),
        _row(_X.SLICE_4, 5, "4g.40gb", 40448, 56, (4, 2, 0, 0, 0), 1, _P8_4, _V,
             "40192 or 40448 MiB depending on driver"),
        _row(_X.SLICE_7, 0, "7g.80gb", 80896, 98, (7, 5, 0, 1, 1), 1, _P8_7, _V,
             "some drivers name it 7g.79gb"),
    ),
    placement_evidence=_I,
    note="placements per UG-P equal to A100-40GB (no 80GB `-lgipp` capture); "
    "PCIe 80GB (0x20B5) and A800-80GB share this table",
)  # fmt: skip

_H100_NAMES = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")

_H100_SXM = _hopper_like(
    "H100-SXM5-80GB",
    "NVIDIA H100 80GB HBM3",
    (0x2330, 0x2324),
    81559,
    _H100_NAMES,
    (9984, 20096, 40448, 81152),
    (16, 26, 32, 60, 64, 132),
    (_V,) * 7,
    note="H800 SXM (0x2324) shares this table",
)

_PCIE_SM_GUESS = "SM count scaled from H100 SXM5 by 114/132 (only the 7g value is captured)"
_H100_PCIE = _hopper_like(
    "H100-PCIE-80GB",
    "NVIDIA H100 PCIe",
    (0x2331, 0x2322),
    81559,
    _H100_NAMES,
    (9984, 20096, 40448, 81152),
    (14, 22, 28, 52, 56, 114),
    (_U, _U, _U, _U, _U, _U, _V),
    (_PCIE_SM_GUESS,) * 6 + ("",),
    placement_evidence=_I,
    note="placements from H100 captures (SXM5); H800 PCIe (0x2322) shares this table",
)

_H100_NVL = _hopper_like(
    "H100-NVL-94GB",
    "NVIDIA H100 NVL",
    (0x2321, 0x233A),
    95830,
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    (11008, 22144, 47488, 95360),
    (16, 26, 32, 60, 64, 132),
    (_V, _V, _V, _I, _I, _V, _V),
    ("", "", "", "SM and engines inferred from H100 (capture row cut off)",
     "SM inferred from H100", "", ""),
    note="H800 NVL (0x233A) shares this table; early drivers named 1g `1g.11gb`",
)  # fmt: skip

_H100_96_GUESS = "ids INFERRED; MiB and SM UNVERIFIED (copied from H100 NVL / H100 80GB)"
_H100_96 = _hopper_like(
    "H100-96GB",
    "NVIDIA GH200 480GB",
    (0x2342, 0x233D),
    97871,
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    (11008, 22144, 47488, 95360),
    (16, 26, 32, 60, 64, 132),
    (_U,) * 7,
    (_H100_96_GUESS,) * 7,
    placement_evidence=_U,
    note="H100 96GB, e.g. on GH200 96GB (names from UG-P); " + _H100_PLACEMENTS_GUESS,
)

_GH200_GUESS = "MiB, SM and engines UNVERIFIED: 3g/4g = 2 x 2g + 0.5 GiB, 7g = 2 x 3g; SM as H100"
_GH200_144 = _hopper_like(
    "GH200-144GB",
    "NVIDIA GH200 144G HBM3e",
    (0x2348,),
    146831,
    ("1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"),
    (17920, 36096, 72704, 145408),
    (16, 26, 32, 60, 64, 132),
    (_V, _V, _V, _V, _U, _U, _U),
    ("", "", "", "", _GH200_GUESS, _GH200_GUESS, _GH200_GUESS),
    placement_evidence=_U,
    note=_H100_PLACEMENTS_GUESS,
)

_H200 = _hopper_like(
    "H200-SXM5-141GB",
    "NVIDIA H200",
    (0x2335, 0x233B),
    143771,
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    (16384, 33024, 71168, 143360),
    (16, 26, 32, 60, 64, 132),
    (_V,) * 7,
    ("", "", "", "33024 or 33280 MiB depending on driver", "", "", "engines from UG-P"),
    placement_evidence=_U,
    note=_H100_PLACEMENTS_GUESS + "; H200 NVL (0x233B, 'NVIDIA H200 NVL') shares this table",
)

_B200_3 = "MiB = 2 x 2g + 0.5 GiB, SM = 4 x 1g - 6 (3g below 4g as on H100): UNVERIFIED guess"
_B200_4 = "MiB as 3g, SM = 4 x 1g: UNVERIFIED guess"
_B200_7 = "MiB = 2 x 3g + 0.5 GiB, SM = full B200 (148): UNVERIFIED guess; CE 16 from UG-P"
_B200 = _blackwell_dc(
    "B200-180GB",
    "NVIDIA B200",
    (0x2901,),
    183359,
    ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    (20992, 45312, 91136, 182784),
    (18, 30, 36, 66, 72, 148),
    (
        "20992 MiB (Mar 2025 driver) or 22528 MiB (Jan 2025)",
        "20992 MiB (Mar 2025 driver) or 22528 MiB (Jan 2025)",
        "",
        "",
        _B200_3,
        _B200_4,
        _B200_7,
    ),
)

_GB200_3 = "MiB = 2 x 2g + 0.5 GiB, SM = 4 x 1g minus 2: UNVERIFIED guess (names from GKE)"
_GB200_4 = "MiB as 3g, SM = 4 x 1g: UNVERIFIED guess"
_GB200_7 = "MiB = 2 x 3g + 0.5 GiB, SM 152: UNVERIFIED guess"
_GB200 = _blackwell_dc(
    "GB200-186GB",
    "NVIDIA GB200",
    (0x2941,),
    189471,
    ("1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"),
    (22528, 46592, 93696, 187904),
    (18, 32, 38, 70, 72, 152),
    (
        "22528 MiB as `1g.23gb` (mig-parted#227) or 20480 MiB as `1g.24gb` (gpu-operator#1303)",
        "22528 MiB as `1g.23gb` (mig-parted#227) or 20480 MiB as `1g.24gb` (gpu-operator#1303)",
        "",
        "",
        _GB200_3,
        _GB200_4,
        _GB200_7,
    ),
)

_RTX_INDEX = "values VERIFIED from captures; index constant pairing INFERRED (go-nvlib suffixes)"
_R1 = ((0, 3, 6, 9), 3)
_R2 = ((0, 6), 6)
_R4 = ((0,), 12)
_RTX_PRO_6000 = GpuModel(
    key="RTX-PRO-6000-Blackwell",
    product_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
    pci_device_ids=(0x2BB5, 0x2BB1, 0x2BB4),
    architecture=Architecture.BLACKWELL,
    memory_mib=97887,
    memory_units=12,
    compute_slices=4,
    cuda_compute_capability=(12, 0),
    profiles=(
        _row(_X.SLICE_1, 14, "1g.24gb", 24192, 46, (1, 1, 1, 1, 0), 4, _R1, _I, _RTX_INDEX),
        _row(_X.SLICE_1_REV1, 21, "1g.24gb+me", 24192, 46, (1, 1, 1, 1, 1), 1, _R1, _I,
             _RTX_INDEX),
        _row(_X.SLICE_1_GFX, 47, "1g.24gb+gfx", 24192, 46, (1, 1, 1, 1, 0), 4, _R1, _I,
             _RTX_INDEX),
        _row(_X.SLICE_1_ALL_ME, 65, "1g.24gb+me.all", 24192, 46, (1, 4, 4, 4, 1), 1, _R1, _I,
             _RTX_INDEX),
        _row(_X.SLICE_1_NO_ME, 67, "1g.24gb-me", 24192, 46, (1, 0, 0, 0, 0), 4, _R1, _I,
             _RTX_INDEX),
        _row(_X.SLICE_2, 5, "2g.48gb", 48512, 94, (2, 2, 2, 2, 0), 2, _R2, _I, _RTX_INDEX),
        _row(_X.SLICE_2_GFX, 35, "2g.48gb+gfx", 48512, 94, (2, 2, 2, 2, 0), 2, _R2, _I,
             _RTX_INDEX),
        _row(_X.SLICE_2_ALL_ME, 64, "2g.48gb+me.all", 48512, 94, (2, 4, 4, 4, 1), 1, _R2, _I,
             _RTX_INDEX),
        _row(_X.SLICE_2_NO_ME, 66, "2g.48gb-me", 48512, 94, (2, 0, 0, 0, 0), 2, _R2, _I,
             _RTX_INDEX),
        _row(_X.SLICE_4, 0, "4g.96gb", 97280, 188, (4, 4, 4, 4, 1), 1, _R4, _I, _RTX_INDEX),
        _row(_X.SLICE_4_GFX, 32, "4g.96gb+gfx", 97280, 188, (4, 4, 4, 4, 1), 1, _R4, _I,
             _RTX_INDEX),
    ),
    note="Workstation (0x2BB1) and Max-Q Workstation (0x2BB4) editions share this table; "
    "1g memory is 23.12 GiB on some drivers/SKUs",
)  # fmt: skip


CATALOG: Mapping[str, GpuModel] = MappingProxyType(
    {
        m.key: m
        for m in (
            _A30,
            _A100_40,
            _A100_80,
            _H100_SXM,
            _H100_PCIE,
            _H100_NVL,
            _H100_96,
            _GH200_144,
            _H200,
            _B200,
            _GB200,
            _RTX_PRO_6000,
        )
    }
)
"""Every catalogued GPU model by key. Read-only."""


def gpu_model(key: str) -> GpuModel:
    """The catalogued model for `key`; the error lists the valid keys so a config typo is
    fixed in one step."""
    try:
        return CATALOG[key]
    except KeyError:
        raise KeyError(
            f"unknown GPU model {key!r}; catalogued models: {', '.join(sorted(CATALOG))}"
        ) from None
