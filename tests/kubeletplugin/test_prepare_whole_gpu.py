"""Whole-GPU devices get their GPU with MIG mode off (issue 11, point 4).

Hopper and later: prepare turns MIG mode off (recorded first, so it is restored after any
crash) and unprepare turns it back on. Ampere: carve never changes MIG mode (a GPU reset would be
needed), so a whole GPU in MIG mode is refused with what to run. While a GPU is held whole, no
MIG slice is carved on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from driver.nvml import sim
from driver.nvml.types import MigMode
from kubeletplugin.checkpoint import ClaimState
from tests.kubeletplugin.node_harness import Node, mig, open_node, whole

H100 = "H100-SXM5-80GB"
A100 = "A100-SXM4-40GB"
ON = MigMode(current=True, pending=True)
OFF = MigMode(current=False, pending=False)


MakeNode = Callable[[list[object]], Node]


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[MakeNode]:
    nodes: list[Node] = []

    def make(gpus: list[object]) -> Node:
        n = open_node(tmp_path, gpus)
        n.start()
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.p.close()
        n.backend.close()
    sim.configure(None)


def _mode(n: Node, minor: int) -> MigMode:
    return n.backend.mig_mode(n.gpu_uuid(minor))


def test_hopper_whole_gpu_turns_mig_mode_off_and_back_on(make_node: MakeNode) -> None:
    n = make_node([H100, H100])
    ref = n.claims.add("whole", [whole(1)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    assert _mode(n, 1) == OFF and _mode(n, 0) == ON
    (d,) = n.p.checkpoint().claims[ref.uid].devices
    assert d.restore_mig
    assert n.p.whole_gpus() == {n.gpu_uuid(1)}
    assert n.offers_changed == 1  # the node republishes without gpu-1's MIG devices
    # no MIG slice on a GPU held whole, even if an allocation says so
    slice_ref = n.claims.add("slice", [mig(n.backend, 1, 19, 0)])
    err = n.p.prepare([slice_ref])[slice_ref.uid].error
    assert "is allocated whole to claim default/whole" in err
    assert _mode(n, 1) == OFF  # the refused carve did not turn MIG mode on under the claim
    assert n.p.prepare([ref])[ref.uid].error == ""  # idempotent
    assert n.p.unprepare([ref]) == {ref.uid: ""}
    assert _mode(n, 1) == ON
    assert n.p.whole_gpus() == frozenset() and n.offers_changed == 2
    assert n.p.prepare([slice_ref])[slice_ref.uid].error == ""  # slices work again
    assert n.instances() == [(1, 19, 0, 1)]


def test_a_whole_gpu_is_refused_while_it_holds_mig_instances_or_another_claim(
    make_node: MakeNode,
) -> None:
    n = make_node([H100])
    busy = n.claims.add("slice", [mig(n.backend, 0, 19, 0)])
    assert n.p.prepare([busy])[busy.uid].error == ""
    ref = n.claims.add("whole", [whole(0)])
    err = n.p.prepare([ref])[ref.uid].error
    assert "is in use by claim default/slice" in err
    assert _mode(n, 0) == ON and n.instances() == [(0, 19, 0, 1)]
    assert n.p.checkpoint().claims.keys() == {busy.uid}


def test_hopper_already_out_of_mig_mode_is_left_as_it_is(make_node: MakeNode) -> None:
    n = make_node([{"model": H100, "mig": False}])
    ref = n.claims.add("whole", [whole(0)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    assert not n.p.checkpoint().claims[ref.uid].devices[0].restore_mig
    assert n.p.unprepare([ref]) == {ref.uid: ""}
    assert _mode(n, 0) == OFF  # carve restores only what it changed


def test_ampere_in_mig_mode_is_refused_with_what_to_run(make_node: MakeNode) -> None:
    n = make_node([A100, {"model": A100, "mig": False}])
    ref = n.claims.add("whole", [whole(0)])
    err = n.p.prepare([ref])[ref.uid].error
    assert "is in MIG mode" in err and "needs a GPU reset" in err
    assert f"nvidia-smi -i {n.gpu_uuid(0)} -mig 0" in err
    assert _mode(n, 0) == ON and n.p.checkpoint().claims == {}
    off = n.claims.add("whole-off", [whole(1)])
    assert n.p.prepare([off])[off.uid].error == ""
    assert n.p.unprepare([off]) == {off.uid: ""}
    assert _mode(n, 1) == OFF


def test_processes_on_the_gpu_block_the_change_and_the_change_back(
    make_node: MakeNode,
) -> None:
    n = make_node([H100])
    ref = n.claims.add("whole", [whole(0)])
    sim.sim_set_gpu_clients(0, 1)  # e.g. DCGM holds the GPU: NVML cannot toggle MIG mode
    err = n.p.prepare([ref])[ref.uid].error
    assert "turning MIG mode off" in err and "other clients" in err
    assert _mode(n, 0) == ON and n.p.checkpoint().claims == {}  # rolled back
    sim.sim_set_gpu_clients(0, 0)
    assert n.p.prepare([ref])[ref.uid].error == ""
    sim.sim_set_gpu_clients(0, 1)  # the workload still runs when the kubelet unprepares
    err = n.p.unprepare([ref])[ref.uid]
    assert "turning MIG mode back on" in err
    rec = n.p.checkpoint().claims[ref.uid]
    assert rec.state is ClaimState.UNPREPARE_STARTED and rec.devices[0].restore_mig
    assert n.p.whole_gpus() == {n.gpu_uuid(0)}  # still no MIG device offered on it
    sim.sim_set_gpu_clients(0, 0)
    n.p.retry_pending()  # housekeeping finishes the teardown
    assert n.p.checkpoint().claims == {} and _mode(n, 0) == ON


def test_a_lost_reply_of_the_change_is_rolled_back_and_retried(make_node: MakeNode) -> None:
    """NVML turned MIG mode off but the reply was lost: the rollback turns it on again, so the
    kubelet's retry starts from a clean GPU (kill points: test_crash_whole_gpu.py)."""
    n = make_node([H100])
    ref = n.claims.add("whole", [whole(0)])
    sim.sim_inject_fault("DeviceSetMigMode", when="after", error="UNKNOWN")
    assert "turning MIG mode off" in n.p.prepare([ref])[ref.uid].error
    assert _mode(n, 0) == ON and n.p.checkpoint().claims == {}
    assert n.p.prepare([ref])[ref.uid].error == ""
    assert _mode(n, 0) == OFF


def test_a_reboot_that_empties_the_cdi_tmpfs_gets_the_spec_written_again(
    make_node: MakeNode,
) -> None:
    """Issue 32, point 4. /var/run/cdi is a tmpfs: after a reboot a whole-GPU claim's record
    survives (it has no instance to lose) but its spec is gone, and the fast path returned IDs
    of a spec that no longer existed (CreateContainerError until someone deleted the pod)."""
    n = make_node([H100])
    ref = n.claims.add("w", [whole(0)])
    first = n.p.prepare([ref])[ref.uid]
    assert first.error == ""
    spec = n.cdi_root / f"mig.carve.dev-claim_{ref.uid}.json"
    assert spec.exists()
    sim.sim_reboot()
    spec.unlink()  # the tmpfs is empty after the reboot
    n.start()  # start-up recovery writes it again
    assert spec.exists()
    assert n.p.checkpoint().claims[ref.uid].state is ClaimState.PREPARE_COMPLETED
    spec.unlink()  # and if it goes while the plugin runs, the kubelet's prepare writes it
    again = n.p.prepare([ref])[ref.uid]
    assert again.error == "" and again.devices == first.devices
    assert spec.exists()


def test_a_mig_claim_whose_spec_went_keeps_its_instance_and_gets_the_spec_back(
    make_node: MakeNode,
) -> None:
    n = make_node([H100])
    ref = n.claims.add("m", [mig(n.backend, 0, 19, 2)])
    first = n.p.prepare([ref])[ref.uid]
    spec = n.cdi_root / f"mig.carve.dev-claim_{ref.uid}.json"
    spec.unlink()
    n.start()
    assert spec.exists() and n.instances() == [(0, 19, 2, 1)]
    assert n.p.prepare([ref])[ref.uid].devices == first.devices
