"""Fixtures for the NVML layer: a fresh simulated node per test, selected with configure()."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from tests.support.nvml import SimFactory


@pytest.fixture
def make_sim(tmp_path: Path) -> Iterator[SimFactory]:
    """make_sim(gpus, **top_level) -> the sim module, configured and initialised."""
    counter = iter(range(1_000_000))

    def make(gpus: Sequence[Any], *, options: dict[str, Any] | None = None, **extra: Any) -> Any:
        n = next(counter)
        data: dict[str, Any] = {
            "state": str(tmp_path / f"node{n}" / "state.json"),
            "gpus": list(gpus),
        }
        if options:
            data["options"] = options
        data.update(extra)
        sim.configure(data)
        sim.nvmlInit()
        return sim

    yield make
    while True:
        try:
            sim.nvmlShutdown()
        except sim.NVMLError:
            break
    sim.configure(None)


@pytest.fixture
def make_backend(make_sim: SimFactory) -> Iterator[Callable[..., NvmlBackend]]:
    opened: list[NvmlBackend] = []

    def make(gpus: Sequence[Any], **kwargs: Any) -> NvmlBackend:
        nv = make_sim(gpus, **kwargs)
        backend = NvmlBackend(nv, proc_root=nv.sim_proc_root()).open()
        opened.append(backend)
        return backend

    yield make
    for b in opened:
        b.close()
