"""One sick GPU must not take the node down (issue 32, point 2).

With a GPU answering GPU_IS_LOST, the node agent used to crash at start (its per-GPU calls were
unguarded), so no claim on any GPU could be prepared or released. Now the lost GPU is isolated:
claims on it are released (its instances went with it), and every other GPU keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, open_node, whole

A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
FINALIZER = f"{DRIVER}/node-{NODE}"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, [A100, A100])
    n.start()
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _restart_as_a_new_process(n: Node) -> None:
    """A new process has a new NVML session: nothing it read before the loss is cached."""
    n.p.close()
    n.backend.close()
    n.backend = NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()
    n.start()


def test_a_restart_with_one_gpu_lost_releases_its_claims_and_serves_the_other(node: Node) -> None:
    n = node
    on_lost = n.claims.add("on-lost", [mig(n.backend, 0, 19, 0)])
    on_good = n.claims.add("on-good", [mig(n.backend, 1, 19, 0)])
    assert all(r.error == "" for r in n.p.prepare([on_lost, on_good]).values())
    sim.sim_lose_gpu(0)
    _restart_as_a_new_process(n)  # used to raise: every NVML call on GPU 0 fails
    claims = n.p.checkpoint().claims
    assert on_lost.uid not in claims and n.claims.finalizers(on_lost) == []
    assert on_good.uid in claims and n.claims.finalizers(on_good) == [FINALIZER]
    assert n.backend.unusable().keys() == {0}

    assert n.p.unprepare([on_good]) == {on_good.uid: ""}
    assert [i for i in n.instances() if i[0] == 1] == []  # its slice destroyed
    again = n.claims.add("again", [mig(n.backend, 1, 14, 0)])
    assert n.p.prepare([again])[again.uid].error == ""


def test_a_gpu_lost_while_running_releases_its_claims_on_unprepare(node: Node) -> None:
    n = node
    ref = n.claims.add("c", [mig(n.backend, 1, 19, 2)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    sim.sim_inject_xid(1, 79)  # fallen off the bus
    # The kubelet unprepares the evicted pod's claim: the destroy cannot succeed, and must not
    # keep the claim's finalizer (the GPU comes back from its reset without the instance).
    assert n.p.unprepare([ref]) == {ref.uid: ""}
    assert ref.uid not in n.p.checkpoint().claims and n.claims.finalizers(ref) == []
    other = n.claims.add("other", [mig(n.backend, 0, 19, 2)])
    assert n.p.prepare([other])[other.uid].error == ""
    n.p.retry_pending()  # housekeeping on a node with a lost GPU does not raise either
    sim.sim_reset_gpu(1)
    assert [i for i in n.instances() if i[0] == 1] == []


def test_a_whole_gpu_claim_on_a_lost_gpu_is_released(tmp_path: Path) -> None:
    n = open_node(tmp_path, [H100])
    try:
        n.start()
        ref = n.claims.add("w", [whole(0)])
        assert n.p.prepare([ref])[ref.uid].error == ""
        sim.sim_lose_gpu(0)
        assert n.p.unprepare([ref]) == {ref.uid: ""}  # MIG mode cannot be restored: released
        assert n.p.checkpoint().claims == {} and n.claims.finalizers(ref) == []
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)
