"""The one thread of a process that runs torch work.

torch's CPU kernels parallelize with OpenMP, and OpenMP keeps a separate thread team for every OS
thread that enters a parallel region. A service that ran its forwards on asyncio's default executor
(several threads) or touched tensors on the event loop thread got several teams busy-waiting on the
same cores: measured on the 2-core CI machine, a demo-target verify forward of 16 tokens took
6.9 ms on one thread and 15 ms as soon as a second thread had run any parallel op. So every torch
call of a service (model loading included) goes through this one worker thread; on a GPU it is also
the natural owner of the device's streams. One exception: a verifier whose verify forwards run on one
CPU thread runs them on its event-loop thread (`--inline-verify`), where one thread means no OpenMP team.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's torch thread (created on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdflash-torch")
        return _executor


def in_torch_thread() -> bool:
    return threading.current_thread().name.startswith("pdflash-torch")


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the torch thread, awaited from the event loop.

    Like asyncio.to_thread, cancelling the awaiting task does not stop `fn`; callers that must know
    when it really ended keep the future (see `submit`).
    """
    return await submit(fn, *args, **kwargs)


def submit(fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future:
    """Schedule `fn` on the torch thread; an asyncio future of its result (call inside a running loop)."""
    if in_torch_thread():  # already there (a nested call): run inline rather than deadlock
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            fut.set_exception(e)
        return fut
    return asyncio.get_running_loop().run_in_executor(executor(), functools.partial(fn, *args, **kwargs))


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Blocking `fn(*args, **kwargs)` on the torch thread (for synchronous callers)."""
    if in_torch_thread():
        return fn(*args, **kwargs)
    return executor().submit(fn, *args, **kwargs).result()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure(num_threads: int) -> int:
    """Set torch's CPU thread count (0 = leave torch's default); returns the count in effect."""
    import torch

    def apply() -> int:
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        return torch.get_num_threads()

    return call(apply)
