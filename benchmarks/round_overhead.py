"""The work of a round outside the verify forward that the drafter and the scheduler do themselves (no transport, no
forward, no drafting model): the drafter's round loop with the real protobuf conversions of its Verify request, Verify
answer and ahead Admit (n-gram drafter, answers built in process), and the scheduler's handling of an ahead Admit
(parse, release the previous ticket, seat, sign, answer).

    python benchmarks/round_overhead.py [--unions demo qwen3-8l gptoss-24l qwen3-48l] [--rounds 3000] [--tree DIR]

Unions: routed-expert unions of the size a round of that target routes (layers x experts, ids per layer: demo 6x64 20,
qwen3-8l 8x128 70, gptoss-24l 24x32 20, qwen3-48l 48x128 70). Per round: the best of 3 runs (a shared host is
noisy). --tree DIR measures another checkout's code with this script (e.g. `git worktree add /tmp/old COMMIT`).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNIONS = {"demo": (6, 64, 20), "qwen3-8l": (8, 128, 70), "gptoss-24l": (24, 32, 20), "qwen3-48l": (48, 128, 70)}


def drafter_round_us(layers: int, experts: int, per: int, rounds: int) -> float:
    import numpy as np

    from drafter_svc import clients
    from drafter_svc.clients import PrefillOut, TicketInfo
    from drafter_svc.drafters import make_factory
    from drafter_svc.loop import Deadline, Request, run_request
    from pdflash import convert
    from pdflash.types import FinishReason, SamplingParams
    from pdflash.v1 import scheduler_pb2, verifier_pb2

    rng = random.Random(0)
    union = {l: frozenset(rng.sample(range(experts), per)) for l in range(layers)}
    byte_map = {l: [1000 + e for e in range(experts)] for l in range(layers)}
    answer = verifier_pb2.VerifyResult(accepted_tokens=[1, 2, 3, 4], num_accepted_drafts=3, routed_union=convert.union_to_pb(union),
                                       routed_bytes=4321, features=convert.array_to_pb(np.zeros((4, 768), np.float32)))
    wire = answer.SerializeToString()

    class Stream:
        sent = 0

        async def send(self, request_id, draft, ticket, return_features):
            clients._verify_request(request_id, draft, ticket, return_features).SerializeToString()
            self.sent = draft.round

        async def receive(self):
            out = clients._verify_out(verifier_pb2.VerifyResult.FromString(wire))
            if self.sent == rounds:
                out.finished = FinishReason.LENGTH
            return out

        def cancel(self):
            pass

    class Verifier:
        async def prefill(self, *args):
            return PrefillOut("s", 7, None, None, convert.union_from_pb(answer.routed_union), 4321, 0.0)

        def open_verify_stream(self, timeout):
            return Stream()

        async def end(self, session_id):
            return True

    class Scheduler:
        async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
            scheduler_pb2.AdmitRequest(request_id=request_id, draft=convert.draft_to_pb(draft), reserve_tokens=reserve_tokens,
                                       release_ticket_ids=release).SerializeToString()
            return TicketInfo("t", "", 0.0, 0.0, reserve_tokens or len(draft.tokens), draft.expert_bytes)

        async def release(self, ticket_id):
            return True

    older = ("byte_map",) if "byte_map" in inspect.signature(run_request).parameters else ()  # before it went

    async def run() -> float:
        req = Request("r", tuple(range(64)), 10**9, SamplingParams(), (), True, 16)
        t0 = time.perf_counter()
        async for _ in run_request(req, make_factory("ngram", ""), Verifier(), Scheduler(), *(byte_map for _ in older), Deadline(600.0)):
            pass
        return time.perf_counter() - t0

    return min(asyncio.run(run()) for _ in range(3)) / rounds * 1e6


def scheduler_admit_us(layers: int, experts: int, per: int, rounds: int) -> float:
    from pdflash import convert
    from pdflash.types import DraftResult
    from pdflash.v1 import scheduler_pb2
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core import SchedulerCore
    from scheduler_svc.servicer import SchedulerServicer

    rng = random.Random(0)
    union = {l: frozenset(rng.sample(range(experts), per)) for l in range(layers)}
    wires = [scheduler_pb2.AdmitRequest(request_id="r", draft=convert.draft_to_pb(DraftResult("s", r, (), union, 4321)),
                                        reserve_tokens=16).SerializeToString() for r in range(1, rounds + 1)]

    class Context:
        def time_remaining(self):
            return 10.0

    async def run() -> float:
        servicer = SchedulerServicer(SchedulerCore(SchedulerConfig()))
        previous: tuple[str, ...] = ()
        t0 = time.perf_counter()
        for w in wires:
            req = scheduler_pb2.AdmitRequest.FromString(w)
            req.release_ticket_ids.extend(previous)
            ticket = await servicer.Admit(req, Context())
            ticket.SerializeToString()
            previous = (ticket.ticket_id,)
        return time.perf_counter() - t0

    return min(asyncio.run(run()) for _ in range(3)) / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unions", nargs="+", default=list(UNIONS), choices=list(UNIONS))
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--tree", default=str(ROOT))
    args = ap.parse_args()
    sys.path.insert(0, str(pathlib.Path(args.tree).resolve()))
    from pdflash.logging import configure

    configure("warning")
    for name in args.unions:
        sizes = UNIONS[name]
        row = {"union": name, "drafter_round_us": round(drafter_round_us(*sizes, args.rounds), 1),
               "scheduler_admit_us": round(scheduler_admit_us(*sizes, args.rounds), 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
