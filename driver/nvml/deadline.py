"""A deadline on every NVML call, so that one hung GPU cannot stall the node.

On a sick GPU NVML calls often hang instead of failing, and a thread inside a C call cannot
be interrupted. So each GPU gets a worker thread of its own that runs its calls one at a time,
and the caller waits at most the deadline for the answer. A call that overruns makes the GPU
*unresponsive*: the caller gets `GpuUnresponsive` naming the call, and every later call on that
GPU fails at once with the same error (no thread queues behind a call that may never return),
until the hung call comes back. Then the GPU is responsive again and `on_change` is told, so
the node agent can republish and finish what the hang interrupted. Workers are daemon threads:
a process may exit with a call still hung (SIGTERM is honoured), and the kernel takes the call
with the process.

Calls made from inside a GPU's own worker (one backend method calling another) run inline,
so nesting never deadlocks on the single worker.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

from driver.nvml.errors import GpuUnresponsive

_T = TypeVar("_T")
_P = ParamSpec("_P")
_S = TypeVar("_S", bound="_OnGpu")
log = logging.getLogger(__name__)


class _OnGpu(Protocol):
    def _on_gpu(self, gpu_uuid: str, what: str, fn: Callable[[], _T]) -> _T: ...


def on_gpu_worker(
    what: str,
) -> Callable[[Callable[Concatenate[_S, str, _P], _T]], Callable[Concatenate[_S, str, _P], _T]]:
    """Run the method (whose first argument is a GPU UUID) through its object's `_on_gpu`, on
    that GPU's worker under the deadline: one hung GPU never stalls another."""

    def wrap(
        method: Callable[Concatenate[_S, str, _P], _T],
    ) -> Callable[Concatenate[_S, str, _P], _T]:
        @functools.wraps(method)
        def run(self: _S, gpu_uuid: str, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
            return self._on_gpu(gpu_uuid, what, lambda: method(self, gpu_uuid, *args, **kwargs))

        return run

    return wrap


@dataclass(frozen=True)
class Hang:
    """A call that overran its deadline and has not returned yet."""

    gpu: str  # a label for messages: the UUID when known, else "GPU index <i>"
    call: str
    since: float  # monotonic seconds when the call started

    def error(self, now: float) -> GpuUnresponsive:
        return GpuUnresponsive(
            f"{self.gpu} is unresponsive: the NVML call to {self.call} has not returned for "
            f"{now - self.since:.0f}s; carve leaves this GPU alone until it does (check the "
            "GPU with nvidia-smi and dmesg for XIDs; a GPU reset or reboot may be needed)",
            gpu=self.gpu if self.gpu.startswith("GPU-") else None,
            call=self.call,
            since=self.since,
        )


@dataclass
class _Job:
    what: str
    label: str
    fn: Callable[[], Any]
    future: Future[Any]
    started: float | None = None


class _Worker:
    def __init__(self, key: int, owner: CallDeadlines) -> None:
        self.key = key
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.running: _Job | None = None
        self._owner = owner
        self.thread = threading.Thread(target=self._loop, name=f"nvml-gpu{key}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        _local.worker = self
        while (job := self.jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            with self._owner.lock:
                job.started = self._owner.clock()
                self.running = job
            try:
                job.future.set_result(job.fn())
            except BaseException as e:
                job.future.set_exception(e)
            finally:
                with self._owner.lock:
                    self.running = None
                self._owner.returned(self.key, job)


class _Local(threading.local):
    worker: _Worker | None = None


_local = _Local()


class CallDeadlines:
    """Per-GPU workers with a deadline; `timeout` None runs every call inline (no deadline)."""

    def __init__(
        self,
        timeout: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.clock = clock
        self.lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None
        self._workers: dict[int, _Worker] = {}
        self._hung: dict[int, Hang] = {}

    def run(self, key: int, label: str, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` on GPU ``key``'s worker (its NVML index; -1 for node-wide calls), waiting at
        most the deadline. Raises `GpuUnresponsive` when it overruns or while an earlier call
        on that GPU still hangs."""
        here = _local.worker
        if self.timeout is None or (here is not None and here.key == key):
            return fn()
        with self.lock:
            hang = self._hung.get(key)
            if hang is not None:
                raise hang.error(self.clock())
            worker = self._workers.get(key)
            if worker is None:
                worker = self._workers[key] = _Worker(key, self)
            job = _Job(what, label, fn, Future())
            worker.jobs.put(job)
        try:
            return cast(_T, job.future.result(timeout=self.timeout))
        except FutureTimeout:
            pass
        never_ran = job.future.cancel()  # still queued: it never runs now
        with self.lock:
            running = worker.running
            newly = running is not None and key not in self._hung
            if running is not None and newly:
                assert running.started is not None
                self._hung[key] = Hang(running.label, running.what, running.started)
            hang = self._hung.get(key)
        if hang is None:
            if never_ran:  # the call ahead of it returned just now: try again
                return self.run(key, label, what, fn)
            return cast(_T, job.future.result(timeout=0))  # it returned just now
        if newly:
            log.warning(
                "NVML call overran its deadline; the GPU is unresponsive until it returns",
                extra={"gpu": hang.gpu, "call": hang.call, "timeout": self.timeout},
            )
            self.on_change()
        raise hang.error(self.clock())

    def returned(self, key: int, job: _Job) -> None:
        """A worker finished `job`: if it was the hung call, the GPU answers again."""
        with self.lock:
            hang = self._hung.get(key)
            back = hang is not None and hang.call == job.what and job.started == hang.since
            if back:
                del self._hung[key]
        if back:
            log.warning(
                "hung NVML call returned; the GPU is responsive again",
                extra={"gpu": job.label, "call": job.what},
            )
            self.on_change()

    def hung(self) -> Mapping[int, Hang]:
        """NVML index (-1: node-wide) -> the call that hangs there."""
        with self.lock:
            return dict(self._hung)
