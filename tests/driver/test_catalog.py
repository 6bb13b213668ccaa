"""The catalog against the reference tables (mig-and-nvml.md sections 2-4)."""

from __future__ import annotations

import math

import pytest

from driver.catalog import (
    CATALOG,
    Architecture,
    Evidence,
    GpuModel,
    Placement,
    ProfileIndex,
    ProfileSpec,
    gpu_model,
)

EXPECTED_KEYS = {
    "A30-24GB",
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-SXM5-80GB",
    "H100-PCIE-80GB",
    "H100-NVL-94GB",
    "H100-96GB",
    "GH200-144GB",
    "H200-SXM5-141GB",
    "B200-180GB",
    "GB200-186GB",
    "RTX-PRO-6000-Blackwell",
}
EIGHT_UNIT = sorted(EXPECTED_KEYS - {"A30-24GB", "RTX-PRO-6000-Blackwell"})
MODELS = sorted(CATALOG)


def _by_index(model: GpuModel, index: ProfileIndex) -> ProfileSpec:
    spec = model.profile_by_index(index)
    assert spec is not None, f"{model.key} lacks profile index {index!r}"
    return spec


def test_catalog_lists_exactly_the_issue_models() -> None:
    assert set(CATALOG) == EXPECTED_KEYS
    assert all(key == model.key for key, model in CATALOG.items())


def test_unknown_key_error_names_the_valid_keys() -> None:
    with pytest.raises(KeyError) as err:
        gpu_model("A100-SXM4-41GB")
    message = str(err.value)
    assert "A100-SXM4-41GB" in message
    assert "A100-SXM4-40GB" in message and "RTX-PRO-6000-Blackwell" in message


def test_catalog_is_read_only() -> None:
    with pytest.raises(TypeError):
        CATALOG["x"] = gpu_model("A30-24GB")  # type: ignore[index]


@pytest.mark.parametrize("key", EIGHT_UNIT)
def test_eight_unit_models_share_the_nvml_id_map(key: str) -> None:
    model = gpu_model(key)
    ids = {
        ProfileIndex.SLICE_1: 19,
        ProfileIndex.SLICE_1_REV1: 20,
        ProfileIndex.SLICE_1_REV2: 15,
        ProfileIndex.SLICE_2: 14,
        ProfileIndex.SLICE_3: 9,
        ProfileIndex.SLICE_4: 5,
        ProfileIndex.SLICE_7: 0,
    }
    assert {p.index: p.id for p in model.profiles} == {int(i): v for i, v in ids.items()}
    assert (model.memory_units, model.compute_slices) == (8, 7)


@pytest.mark.parametrize("key", EIGHT_UNIT)
def test_eight_unit_placements(key: str) -> None:
    model = gpu_model(key)
    placements = {p.id: (p.starts, p.size) for p in model.profiles}
    assert placements == {
        19: ((0, 1, 2, 3, 4, 5, 6), 1),
        20: ((0, 1, 2, 3, 4, 5, 6), 1),
        15: ((0, 2, 4, 6), 2),
        14: ((0, 2, 4), 2),
        9: ((0, 4), 4),
        5: ((0,), 4),
        0: ((0,), 8),
    }


def test_a100_40gb_rows() -> None:
    m = gpu_model("A100-SXM4-40GB")
    three = m.profile_by_id(9)
    assert (three.name, three.memory_mib, three.multiprocessors) == ("3g.20gb", 19968, 42)
    assert three.placements == (Placement(0, 4), Placement(4, 4))
    assert m.profile_by_id(19).engines.jpeg == 0
    assert m.engine_totals.jpeg == 1 and m.engine_totals.ofa == 1
    assert m.product_name == "NVIDIA A100-SXM4-40GB"
    assert m.cuda_compute_capability == (8, 0)
    assert m.architecture is Architecture.AMPERE


def test_h100_rows() -> None:
    m = gpu_model("H100-SXM5-80GB")
    double = m.profile_by_id(15)
    assert double.name == "1g.20gb"
    assert double.starts == (0, 2, 4, 6) and double.size == 2
    assert double.multiprocessors == 26
    assert m.full_profile.engines.copy == 8 and m.multiprocessors == 132
    assert m.product_name == "NVIDIA H100 80GB HBM3"
    assert gpu_model("H100-PCIE-80GB").multiprocessors == 114


def test_me_profiles_are_single_instance_and_take_the_ofa() -> None:
    for model in CATALOG.values():
        for spec in model.profiles:
            if spec.name.endswith("+me") or spec.takes_all_media:
                assert spec.max_instances == 1, (model.key, spec.name)
                assert spec.engines.ofa == model.engine_totals.ofa == 1, (model.key, spec.name)


def test_unit_counts() -> None:
    assert gpu_model("RTX-PRO-6000-Blackwell").memory_units == 12
    assert gpu_model("RTX-PRO-6000-Blackwell").compute_slices == 4
    assert gpu_model("A30-24GB").memory_units == 4
    assert gpu_model("A30-24GB").compute_slices == 4


def test_a30_and_rtx_ids() -> None:
    a30 = {p.name: p.id for p in gpu_model("A30-24GB").profiles}
    assert a30 == {"1g.6gb": 14, "1g.6gb+me": 21, "2g.12gb": 5, "2g.12gb+me": 6, "4g.24gb": 0}
    rtx = {p.name: p.id for p in gpu_model("RTX-PRO-6000-Blackwell").profiles}
    assert rtx["1g.24gb+me.all"] == 65 and rtx["1g.24gb-me"] == 67
    assert rtx["2g.48gb+me.all"] == 64 and rtx["2g.48gb-me"] == 66
    assert rtx["4g.96gb+gfx"] == 32


def test_compute_capabilities() -> None:
    expected = {
        Architecture.AMPERE: {(8, 0)},
        Architecture.HOPPER: {(9, 0)},
        Architecture.BLACKWELL: {(10, 0), (12, 0)},
    }
    for model in CATALOG.values():
        assert model.cuda_compute_capability in expected[model.architecture], model.key
    assert gpu_model("RTX-PRO-6000-Blackwell").cuda_compute_capability == (12, 0)
    assert gpu_model("GB200-186GB").cuda_compute_capability == (10, 0)


@pytest.mark.parametrize("key", MODELS)
def test_placements_lie_within_the_units_and_match_sizes(key: str) -> None:
    model = gpu_model(key)
    for spec in model.profiles:
        assert spec.placements, spec.name
        assert len({p.size for p in spec.placements}) == 1, spec.name
        assert all(p.start >= 0 and p.end <= model.memory_units for p in spec.placements)
        assert spec.placements == tuple(sorted(spec.placements)), spec.name
        assert spec.max_instances <= len(spec.placements) or spec.max_instances == 1
        assert spec.slices <= model.compute_slices


@pytest.mark.parametrize("key", MODELS)
def test_profile_keys_are_unique(key: str) -> None:
    model = gpu_model(key)
    assert len({p.id for p in model.profiles}) == len(model.profiles)
    assert len({p.index for p in model.profiles}) == len(model.profiles)


@pytest.mark.parametrize("key", MODELS)
def test_full_profile_is_the_engine_pool(key: str) -> None:
    """No profile may need more of an engine than the GPU has, or it could never be created."""
    model = gpu_model(key)
    full = model.full_profile
    assert full.size == model.memory_units and full.slices == model.compute_slices
    for spec in model.profiles:
        assert spec.engines.fits_within(model.engine_totals), spec.name
        assert spec.memory_mib <= full.memory_mib <= model.memory_mib
        assert spec.multiprocessors <= full.multiprocessors


@pytest.mark.parametrize("key", MODELS)
def test_evidence_labels_present_and_guesses_explained(key: str) -> None:
    model = gpu_model(key)
    for spec in model.profiles:
        assert isinstance(spec.evidence, Evidence)
        if spec.evidence is not Evidence.VERIFIED:
            assert spec.note, f"{key} {spec.name} is {spec.evidence} without a note"
    if model.placement_evidence is not Evidence.VERIFIED:
        assert model.note, key


def test_reference_open_items_are_labelled_unverified() -> None:
    assert gpu_model("H200-SXM5-141GB").placement_evidence is Evidence.UNVERIFIED
    for key in ("B200-180GB", "GB200-186GB"):
        for pid in (9, 5, 0):
            assert gpu_model(key).profile_by_id(pid).evidence is Evidence.UNVERIFIED
    assert gpu_model("A100-SXM4-40GB").placement_evidence is Evidence.VERIFIED


def _nvlib_memory_gb(spec: ProfileSpec, model: GpuModel) -> int:
    """go-nvlib's name rule (reference section 3), written independently of the catalog."""
    total_bytes = model.memory_mib * 2**20
    frac = math.ceil(spec.memory_mib * 2**20 / total_bytes * 8) / 8
    return math.floor(frac * math.ceil(total_bytes / 2**30) + 0.5)  # Go's math.Round


@pytest.mark.parametrize("key", MODELS)
def test_names_agree_with_memory_sizes(key: str) -> None:
    """Cross-checks MiB, total memory and names: a typo in any of them breaks the rule."""
    model = gpu_model(key)
    for spec in model.profiles:
        gb = int(spec.name.split("g.", 1)[1].split("gb", 1)[0])
        assert _nvlib_memory_gb(spec, model) == gb, (key, spec.name, spec.memory_mib)
        assert spec.name.startswith(f"{spec.slices}g.")


def test_pci_ids_are_unique_across_models() -> None:
    seen: dict[int, str] = {}
    for model in CATALOG.values():
        assert model.pci_device_ids, model.key
        for pci in model.pci_device_ids:
            assert pci not in seen, f"{pci:#06x} in {seen.get(pci)} and {model.key}"
            seen[pci] = model.key
