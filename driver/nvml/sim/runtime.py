"""Which simulated node this process talks to, and NVML's library lifecycle.

The configuration is chosen per process (``configure`` or the file named by CARVE_SIM_CONFIG),
while the hardware it describes is shared through the state file. Keeping the choice, the
``nvmlInit`` reference count and the open state store in one process-local object means a test
can switch nodes without a stale store or init count leaking into the next one.
"""

# ruff: noqa: N802 -- nvmlInit & co. mirror pynvml's names exactly.
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from driver.nvml.sim.config import (
    ENV_CONFIG,
    SimConfig,
    SimConfigError,
    load_config_file,
    parse_config,
)
from driver.nvml.sim.hardware import HwState, StateStore, validate_model

_T = TypeVar("_T")


class _Runtime:
    """Process-local simulator state: the chosen config and nvmlInit's reference count."""

    explicit: SimConfig | None = None
    env_cache: tuple[str, float, SimConfig] | None = None
    store: tuple[SimConfig, StateStore] | None = None
    init_count = 0


_rt = _Runtime()


def state_store(cfg: SimConfig) -> StateStore:
    """The store of ``cfg``'s state file, reused while ``cfg`` stays the active config."""
    if _rt.store is None or _rt.store[0] is not cfg:
        _rt.store = (cfg, StateStore(cfg))
    return _rt.store[1]


def configure(
    source: SimConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
) -> SimConfig | None:
    """Select the simulated node for this process (sim-only).

    ``source`` is a SimConfig, a mapping in the config-file schema (relative paths resolve
    against ``base_dir``, default the current directory), or the path of a config file.
    ``None`` goes back to the file named by CARVE_SIM_CONFIG. Returns the active config.
    """
    if source is None:
        _rt.explicit = None
        return config_or_none()
    if isinstance(source, SimConfig):
        cfg = source
    elif isinstance(source, Mapping):
        cfg = parse_config(source, Path(base_dir) if base_dir else Path.cwd())
    else:
        cfg = load_config_file(source)
    _rt.explicit = _validated(cfg)
    return cfg


def _validated(cfg: SimConfig) -> SimConfig:
    """``cfg`` once every GPU model in it is one the simulator can represent."""
    for gpu in cfg.gpus:
        validate_model(gpu.model)
    return cfg


def config_or_none() -> SimConfig | None:
    """The active config, or None; a CARVE_SIM_CONFIG file is re-read when it changes."""
    if _rt.explicit is not None:
        return _rt.explicit
    path = os.environ.get(ENV_CONFIG)
    if not path:
        return None
    mtime = Path(path).stat().st_mtime if Path(path).exists() else -1.0
    if _rt.env_cache is None or _rt.env_cache[:2] != (path, mtime):
        _rt.env_cache = (path, mtime, _validated(load_config_file(path)))
    return _rt.env_cache[2]


def sim_config() -> SimConfig:
    """The active simulator configuration (sim-only); raises SimConfigError if there is none."""
    cfg = config_or_none()
    if cfg is None:
        raise SimConfigError(
            f"no simulator configured: set {ENV_CONFIG} to a config file or call configure()"
        )
    return cfg


def raise_nvml(code: int) -> Any:
    """Raise pynvml's own error class for ``code``; typed ``Any`` so bodies can return it."""
    raise pynvml.NVMLError(code)


def require_init() -> SimConfig:
    """The active config, or UNINITIALIZED as NVML gives before nvmlInit."""
    if _rt.init_count <= 0:
        raise_nvml(pynvml.NVML_ERROR_UNINITIALIZED)
    return sim_config()


def admin(body: Callable[[SimConfig, HwState], _T]) -> _T:
    """Run a sim-only administration step in one state transaction: no latency, no faults."""
    cfg = sim_config()
    with state_store(cfg).transaction() as state:
        return body(cfg, state)


# --- library lifecycle ---------------------------------------------------------------------------


def nvmlInitWithFlags(flags: int) -> None:
    if config_or_none() is None:
        raise_nvml(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    _rt.init_count += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    if _rt.init_count <= 0:
        raise_nvml(pynvml.NVML_ERROR_UNINITIALIZED)
    _rt.init_count -= 1
