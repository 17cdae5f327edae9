"""pdflash.torch_thread: every torch call of a process on one thread (OpenMP keeps a team per thread)."""

import asyncio
import threading

import torch

from pdflash import torch_thread


def test_all_work_runs_on_one_named_thread():
    async def main():
        names = await asyncio.gather(*(torch_thread.run(lambda: threading.current_thread().name) for _ in range(8)))
        return set(names)

    names = asyncio.run(main())
    assert len(names) == 1 and next(iter(names)).startswith("pdflash-torch")
    assert torch_thread.call(torch_thread.in_torch_thread) is True
    assert torch_thread.in_torch_thread() is False


def test_nested_calls_run_inline_instead_of_deadlocking():
    def outer():
        return torch_thread.call(lambda: threading.current_thread().name)

    assert torch_thread.call(outer).startswith("pdflash-torch")

    async def main():
        async def inner():
            return await torch_thread.run(lambda: 41 + 1)

        return await torch_thread.run(lambda: asyncio.run(inner()))

    assert asyncio.run(main()) == 42


def test_exceptions_reach_the_caller():
    def boom():
        raise ValueError("bad shape")

    async def main():
        await torch_thread.run(boom)

    try:
        asyncio.run(main())
    except ValueError as e:
        assert "bad shape" in str(e)
    else:
        raise AssertionError("the exception was swallowed")


def test_configure_sets_torch_threads_and_zero_keeps_the_default():
    before = torch_thread.call(torch.get_num_threads)
    try:
        assert torch_thread.configure(1) == 1
        assert torch_thread.configure(0) == 1  # 0 leaves the current setting
    finally:
        torch_thread.call(torch.set_num_threads, before)
