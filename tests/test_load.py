"""A small, bounded load run (the full one with latency numbers is benchmarks/load.py): many concurrent
streams, zero errors, every output equal to its greedy reference, nothing held afterwards."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.load import greedy_reference, in_use, make_jobs, run_load, summarize

pytestmark = pytest.mark.slow


def test_concurrent_streams_are_exact_and_leave_nothing_behind(stack, tiny):
    model = str(tiny.target("qwen3_moe"))
    jobs = make_jobs(clients=8, requests=2, max_tokens=16, drafters=["ngram", "none", "hybrid", "dflash"])
    references = {j: greedy_reference(model, j.prompt, j.max_tokens) for js in jobs for j in js}
    records, wall = asyncio.run(run_load(stack.drafter, jobs, request_timeout=120, time_limit=300))
    summary = summarize(records, wall, references)
    assert summary["requests"] == 16
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["mismatches"] == 0
    held = in_use(stack.scheduler, stack.verifier)
    assert not any(held.values()), held
