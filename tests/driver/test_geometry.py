"""MIG geometry: hand-checked cases from the reference and property tests against a naive model."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driver.catalog import CATALOG, Engines, GpuModel, Placement, gpu_model
from driver.geometry import (
    EMPTY_STATE,
    Geometry,
    GpuState,
    PlacementError,
    PlacementFailure,
    geometry_for,
)

A100 = geometry_for(gpu_model("A100-SXM4-40GB"))
H100 = geometry_for(gpu_model("H100-SXM5-80GB"))
A30 = geometry_for(gpu_model("A30-24GB"))
RTX = geometry_for(gpu_model("RTX-PRO-6000-Blackwell"))

# A100/H100 ids: 19 1g, 20 1g+me, 15 1g double memory, 14 2g, 9 3g, 5 4g, 0 7g.


def _variants() -> dict[str, GpuModel]:
    """Models where rules that catalog data makes redundant become binding, so the tests can
    tell whether the geometry enforces them on their own (a discovered model may need it)."""
    a100 = gpu_model("A100-SXM4-40GB")
    capped = tuple(
        replace(p, max_instances=min(p.max_instances, 2 if p.slices < 3 else 1))
        for p in a100.profiles
    )
    rtx = gpu_model("RTX-PRO-6000-Blackwell")
    quiet = tuple(
        replace(p, engines=Engines(p.engines.copy, 0, 0, 0, 0)) if p.id in (47, 35) else p
        for p in rtx.profiles
    )
    return {
        "A100-capped": replace(a100, key="A100-capped", profiles=capped),
        "RTX-quiet-gfx": replace(rtx, key="RTX-quiet-gfx", profiles=quiet),
    }


MODELS_UNDER_TEST = {**CATALOG, **_variants()}


def _refusal(geometry: Geometry, state: GpuState, pid: int, start: int) -> PlacementError:
    assert not geometry.fits(state, pid, start)
    with pytest.raises(PlacementError) as err:
        geometry.place(state, pid, start)
    return err.value


def test_empty_gpu_admits_every_profile_up_to_its_cap() -> None:
    assert dict(A100.admits(EMPTY_STATE)) == {19: 7, 20: 1, 15: 4, 14: 3, 9: 2, 5: 1, 0: 1}
    assert dict(A30.admits(EMPTY_STATE)) == {14: 4, 21: 1, 5: 2, 6: 1, 0: 1}


def test_after_3g_at_0_only_start_4_is_left_for_3g() -> None:
    state = A100.place(EMPTY_STATE, 9, 0)
    assert A100.feasible_starts(state, 9) == (4,)
    assert A100.feasible_starts(state, 5) == ()
    assert A100.feasible_starts(state, 0) == ()
    assert A100.feasible_starts(state, 19) == (4, 5, 6)


def test_remaining_capacity_matches_the_public_capture() -> None:
    """Reference section 5.7: after one A100 3g at 4:4 -> 1g 4, 2g 2, 3g 1."""
    state = A100.place(EMPTY_STATE, 9, 4)
    assert A100.remaining_capacity(state, 19) == 4
    assert A100.remaining_capacity(state, 14) == 2
    assert A100.remaining_capacity(state, 9) == 1


def test_double_memory_1g_at_6_occupies_unit_7() -> None:
    state = H100.place(EMPTY_STATE, 15, 6)
    assert state.occupied == 0b1100_0000
    assert _refusal(H100, state, 9, 4).reason is PlacementFailure.OVERLAP
    assert H100.fits(state, 19, 5)
    assert not H100.fits(state, 19, 6)


def test_unlisted_placement_is_refused_with_the_valid_starts() -> None:
    err = _refusal(A100, EMPTY_STATE, 9, 2)
    assert err.reason is PlacementFailure.UNLISTED_PLACEMENT
    assert "valid starts: 0, 4" in str(err)
    assert _refusal(A100, EMPTY_STATE, 19, 7).reason is PlacementFailure.UNLISTED_PLACEMENT


def test_unknown_profile_is_refused() -> None:
    err = _refusal(A100, EMPTY_STATE, 21, 0)
    assert err.reason is PlacementFailure.UNKNOWN_PROFILE
    assert "19" in str(err) and "A100-SXM4-40GB" in str(err)
    assert A100.feasible_starts(EMPTY_STATE, 21) == ()
    assert A100.remaining_capacity(EMPTY_STATE, 21) == 0


def test_me_takes_the_only_ofa() -> None:
    state = A100.place(EMPTY_STATE, 20, 6)
    assert A100.remaining_capacity(state, 0) == 0
    assert not A100.fits(state, 0, 0)
    assert A100.remaining_capacity(state, 20) == 0
    assert _refusal(A100, state, 20, 0).reason is PlacementFailure.MAX_INSTANCES


def test_me_beside_7g_is_refused_by_the_ofa_not_only_by_memory() -> None:
    """Take memory out of the picture: on a variant whose 7g leaves unit 7 free and whose +me
    may sit at 7, the two still exclude each other because both need the one OFA."""
    model = gpu_model("A100-SXM4-40GB")
    seven, me = model.profile_by_id(0), model.profile_by_id(20)
    seven = replace(seven, placements=(Placement(0, 7),))
    me = replace(me, placements=tuple(Placement(s, 1) for s in range(8)))
    others = tuple(p for p in model.profiles if p.id not in (0, 20))
    geometry = Geometry(replace(model, key="A100-variant", profiles=(*others, me, seven)))
    state = geometry.place(EMPTY_STATE, 0, 0)
    err = _refusal(geometry, state, 20, 7)
    assert err.reason is PlacementFailure.ENGINES
    assert "1 of OFA engines with 0 of 1 free" in str(err)
    assert geometry.fits(state, 19, 7) is False  # 1g lists no start 7 on this variant either
    assert geometry.remaining_capacity(state, 20) == 0


def test_a30_single_jpeg_and_ofa() -> None:
    state = A30.place(EMPTY_STATE, 21, 0)  # 1g.6gb+me
    err = _refusal(A30, state, 6, 2)  # 2g.12gb+me
    assert err.reason is PlacementFailure.ENGINES
    assert "OFA engines" in str(err) and "JPEG engines" in str(err)
    assert A30.fits(state, 5, 2)


def test_a30_me_profiles_exclude_each_other() -> None:
    state = A30.place(EMPTY_STATE, 6, 0)
    assert A30.remaining_capacity(state, 21) == 0
    assert A30.feasible_starts(state, 14) == (2, 3)


def test_all_media_lets_only_no_media_profiles_in() -> None:
    state = RTX.place(EMPTY_STATE, 65, 0)  # 1g.24gb+me.all
    admits = RTX.admits(state)
    no_media = {67, 66}
    assert {pid for pid, n in admits.items() if n} == no_media
    assert admits[67] == 3 and admits[66] == 1
    err = _refusal(RTX, state, 14, 3)
    assert err.reason is PlacementFailure.ALL_MEDIA
    assert "+me.all" in str(err)
    state = RTX.place(state, 66, 6)
    assert RTX.fits(state, 67, 3)


def test_all_media_needs_a_gpu_without_media_users() -> None:
    state = RTX.place(EMPTY_STATE, 67, 0)  # 1g.24gb-me
    assert RTX.fits(state, 65, 3)
    state = RTX.place(state, 47, 3)  # 1g.24gb+gfx uses a decoder
    assert not RTX.fits(state, 65, 6)
    assert RTX.remaining_capacity(state, 64) == 0


def test_all_media_rule_holds_without_engine_counts() -> None:
    """A +gfx variant that uses no media engine: only the explicit rule keeps it out."""
    geometry = Geometry(MODELS_UNDER_TEST["RTX-quiet-gfx"])
    state = geometry.place(EMPTY_STATE, 65, 0)
    assert _refusal(geometry, state, 47, 3).reason is PlacementFailure.ALL_MEDIA
    state = geometry.place(EMPTY_STATE, 47, 0)
    assert _refusal(geometry, state, 65, 3).reason is PlacementFailure.ALL_MEDIA
    assert geometry.fits(state, 67, 3)


def test_rtx_pro_uses_twelve_units() -> None:
    state = RTX.place(EMPTY_STATE, 5, 6)
    assert state.occupied == 0b1111_1100_0000
    assert RTX.feasible_starts(state, 14) == (0, 3)
    assert RTX.remaining_capacity(RTX.place(EMPTY_STATE, 0, 0), 14) == 0


def test_remove_restores_the_prior_state_and_rejects_absent_instances() -> None:
    one = A100.place(EMPTY_STATE, 14, 2)
    two = A100.place(one, 19, 0)
    assert A100.remove(two, 19, 0) == one
    assert hash(A100.remove(two, 19, 0)) == hash(one)
    with pytest.raises(PlacementError) as err:
        A100.remove(one, 19, 0)
    assert err.value.reason is PlacementFailure.ABSENT
    assert "2g.10gb (id 14) at 2" in str(err.value)


def test_state_of_accepts_any_listing_order_and_rejects_conflicts() -> None:
    state = A100.state_of([(19, 0), (14, 2), (9, 4), (19, 1)])
    assert state.instances == ((9, 4), (14, 2), (19, 0), (19, 1))
    assert A100.state_of(reversed(state.instances)) == state
    with pytest.raises(PlacementError):
        A100.state_of([(9, 0), (5, 0)])


def test_geometry_for_is_shared_per_model_value() -> None:
    model = gpu_model("H200-SXM5-141GB")
    assert geometry_for(model) is geometry_for(model)
    assert geometry_for(replace(model)) is geometry_for(model)
    assert geometry_for(replace(model, key="other")) is not geometry_for(model)


# ---- property tests against an independent, naive model of the rules --------------------


def _naive_fits(model: GpuModel, instances: list[tuple[int, int]], pid: int, start: int) -> bool:
    spec = next((p for p in model.profiles if p.id == pid), None)
    if spec is None or start not in spec.starts:
        return False
    specs = {p.id: p for p in model.profiles}
    units = set(range(start, start + spec.size))
    for other, s in instances:
        if units & set(range(s, s + specs[other].size)):
            return False
    if sum(1 for other, _ in instances if other == pid) >= spec.max_instances:
        return False
    total = spec.engines
    for other, _ in instances:
        total = total + specs[other].engines
    if not total.fits_within(model.engine_totals):
        return False
    kinds = [specs[other] for other, _ in instances]
    if not spec.without_media and any(k.takes_all_media for k in kinds):
        return False
    return not (spec.takes_all_media and not all(k.without_media for k in kinds))


def _naive_greedy(model: GpuModel, instances: list[tuple[int, int]], pid: int) -> int:
    spec = next(p for p in model.profiles if p.id == pid)
    placed = list(instances)
    while True:
        start = next((s for s in spec.starts if _naive_fits(model, placed, pid, s)), None)
        if start is None:
            return len(placed) - len(instances)
        placed.append((pid, start))


def _check_invariants(geometry: Geometry, state: GpuState) -> None:
    model = geometry.model
    specs = {p.id: p for p in model.profiles}
    occupied, engines = 0, Engines(0, 0, 0, 0, 0)
    for pid, start in state.instances:
        mask = ((1 << specs[pid].size) - 1) << start
        assert not occupied & mask, f"overlap in {state.instances}"
        occupied |= mask
        engines = engines + specs[pid].engines
    assert occupied == state.occupied
    assert engines == state.engines
    assert engines.fits_within(model.engine_totals)
    assert list(state.instances) == sorted(state.instances)
    for pid, spec in specs.items():
        assert state.count(pid) <= spec.max_instances


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(MODELS_UNDER_TEST)), st.data())
def test_random_sequences_keep_every_rule(key: str, data: st.DataObject) -> None:
    model = MODELS_UNDER_TEST[key]
    geometry = geometry_for(model)
    ids = [p.id for p in model.profiles]
    state = EMPTY_STATE
    for _ in range(data.draw(st.integers(1, 14), label="steps")):
        listing = list(state.instances)
        remove = data.draw(st.booleans(), label="remove?")
        if listing and remove:
            pid, start = data.draw(st.sampled_from(listing), label="victim")
            after = geometry.remove(state, pid, start)
            assert geometry.place(after, pid, start) == state
            state = after
        else:
            pid = data.draw(st.sampled_from([*ids, 99]), label="profile")
            listed = model.profile_by_id(pid).starts if pid in ids else (0,)
            start = data.draw(
                st.one_of(st.sampled_from(listed), st.integers(0, model.memory_units)),
                label="start",
            )
            expected = _naive_fits(model, listing, pid, start)
            assert geometry.fits(state, pid, start) is expected
            if expected:
                after = geometry.place(state, pid, start)
                assert geometry.remove(after, pid, start) == state
                state = after
            else:
                with pytest.raises(PlacementError):
                    geometry.place(state, pid, start)
        _check_invariants(geometry, state)
        listing = list(state.instances)
        for pid in ids:
            assert geometry.remaining_capacity(state, pid) == _naive_greedy(model, listing, pid)
            starts = geometry.feasible_starts(state, pid)
            spec = model.profile_by_id(pid)
            assert starts == tuple(s for s in spec.starts if _naive_fits(model, listing, pid, s))
        assert geometry.state_of(listing) == state


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(MODELS_UNDER_TEST)), st.data())
def test_filling_a_gpu_greedily_never_breaks_a_pool(key: str, data: st.DataObject) -> None:
    """Keep creating random feasible instances until nothing fits: the final state must still
    respect every pool, and admits must say that nothing more fits."""
    geometry = geometry_for(MODELS_UNDER_TEST[key])
    state = EMPTY_STATE
    while True:
        options = [
            (pid, s) for pid in geometry.profile_ids for s in geometry.feasible_starts(state, pid)
        ]
        if not options:
            break
        state = geometry.place(state, *data.draw(st.sampled_from(options)))
        _check_invariants(geometry, state)
    assert not any(geometry.admits(state).values())
