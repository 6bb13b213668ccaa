"""The one way carve turns a pynvml exception into its own typed error.

Every module that talks to a pynvml-shaped binding goes through these, so an error code means
the same thing whichever module met it (reference: mig-and-nvml.md §15).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from driver.nvml import errors

_T = TypeVar("_T")


def call(nv: Any, what: str, gpu: str | None, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, with an NVML failure raised as the typed error for its code."""
    with translating(nv, what, gpu):
        return fn(*args)


@contextlib.contextmanager
def translating(nv: Any, what: str, gpu: str | None) -> Iterator[None]:
    try:
        yield
    except nv.NVMLError as exc:
        raise errors.from_code(int(exc.value), what, gpu=gpu) from exc


def code_of(nv: Any, exc: BaseException) -> int | None:
    """The NVML return code an exception carries, None if it is not an NVML error."""
    if isinstance(exc, nv.NVMLError):
        return int(exc.value)
    return None
