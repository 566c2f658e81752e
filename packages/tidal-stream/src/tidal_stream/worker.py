"""The host worker: one thread running optimizer jobs in submission order, errors surfaced to the caller.

A job's failure is re-raised on the submitting thread as the original exception (its type stays
catchable: a ``RuntimeError`` from a kernel is a ``RuntimeError`` for the caller), not wrapped.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HostWorker"]

log = logging.getLogger(__name__)


class HostWorker:
    """A FIFO of host jobs on one daemon thread.

    Jobs run in submission order (the optimizer relies on it: a parameter's gradient lands before its
    update). An exception stops further jobs; it is re-raised by :meth:`check` / :meth:`join` on the
    submitting thread, and ``on_error`` is called after it and after each job skipped because of it, so
    waiters are released.

    Args:
        device: the training device (the thread makes it current, so CUDA work it issues lands there).
        on_error: called on the worker thread after the first failure and after each skipped job.
    """

    def __init__(self, device: torch.device, on_error: Callable[[], None]) -> None:
        # (job, its arguments, its order key or None); None stops the thread
        self._q: queue.Queue[tuple[Callable[..., None], tuple[Any, ...], int | None] | None] = queue.Queue()
        if device.type == "cuda" and device.index is None:
            # "cuda" means the caller's current device; the thread's own current device is always 0
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._on_error = on_error
        self.error: BaseException | None = None
        self.busy_s = 0.0  # seconds the thread spent running jobs
        # (perf_counter when it began, seconds) of each wait for a job longer than a millisecond: when the
        # host optimizer had nothing to do (a full fine-tune's step is bound by its busy time otherwise)
        self.idle_gaps: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
        self._thread = threading.Thread(target=self._run, name="tidal-host-adam", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        fn = args = None
        while True:
            t_wait = time.perf_counter()
            item = self._q.get()
            t_got = time.perf_counter()
            if t_got - t_wait > 1e-3:
                self.idle_gaps.append((t_wait, t_got - t_wait))
            try:
                if item is None:
                    return
                if self.error is None:
                    fn, args, _ = item
                    fn(*args)
                    self.busy_s += time.perf_counter() - t_got
                else:
                    self._on_error()  # a skipped job: release what its waiters wait for (never hang)
            except BaseException as e:  # surfaced on the submitting thread by check()
                log.exception("host optimizer job failed")
                self.error = e
                self._on_error()
            finally:
                item = fn = args = None  # drop the job's references now, not at the next job
                self._q.task_done()

    def submit(self, fn: Callable[..., None], *args: Any, order: int | None = None) -> None:
        """Queue ``fn(*args)``; ``order``: see :meth:`reorder`."""
        self.check()
        self._q.put((fn, args, order))

    def put(self, fn: Callable[..., None], *args: Any, order: int | None = None) -> None:
        """Queue ``fn(*args)`` without checking for an earlier failure (skipped if there was one)."""
        self._q.put((fn, args, order))

    def reorder(self) -> int:
        """Let the pending jobs queued with an ``order`` run by that key instead of in submission order.

        Only within each run of such jobs: a job queued without one keeps its place and every job on its
        side (the optimizer reorders a step's updates, one per parameter, and nothing that must follow or
        precede them). Returns how many jobs changed place.
        """
        q = self._q
        with q.mutex:  # queue.Queue's own lock over its deque: no job is taken while they are rearranged
            pending = list(q.queue)
            out: list[Any] = []
            run: list[Any] = []
            for item in pending:
                if item is not None and item[2] is not None:
                    run.append(item)
                    continue
                out += sorted(run, key=lambda job: job[2])  # stable: equal keys keep their order
                run = []
                out.append(item)
            out += sorted(run, key=lambda job: job[2])
            q.queue.clear()
            q.queue.extend(out)
        return sum(a is not b for a, b in zip(pending, out))

    def join(self) -> None:
        """Block until every queued job has run; re-raise a job's failure."""
        self._q.join()
        self.check()

    def drain(self) -> None:
        """Block until every queued job has run or been skipped; never raises."""
        self._q.join()

    def take_error(self) -> BaseException | None:
        """The first failure of a job, once (later jobs run again afterwards), or None."""
        err, self.error = self.error, None
        return err

    def check(self) -> None:
        """Re-raise the first failure of a job, once; later jobs run again afterwards.

        Jobs queued after the failure were skipped (their parameters keep their previous values and
        state); the caller decides whether to retry the step. The original exception is raised, with
        its worker-thread traceback.
        """
        err = self.take_error()
        if err is not None:
            raise err

    def close(self) -> None:
        """Finish queued jobs and stop the thread."""
        self._q.put(None)
        self._thread.join()
