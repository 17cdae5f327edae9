"""The adaptive verify width: the controller alone, and the round loop using it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drafter_svc.width import VerifyWidth


def test_first_round_drafts_the_whole_block_then_follows_what_rounds_earn():
    w = VerifyWidth(32)
    assert w.drafts() == 31
    w.observe(0)  # first draft rejected: a cheap probe next
    assert w.drafts() == 3
    w.observe(3)  # all 3 accepted: 3 x 4 emitted
    assert w.drafts() == 12
    w.observe(12)
    assert w.drafts() == 31  # capped by the block
    w.observe(1)
    assert w.drafts() == 6


def test_fixed_width_and_small_blocks():
    w = VerifyWidth(16, adaptive=False)
    for acc in (0, 5, 15):
        w.observe(acc)
        assert w.drafts() == 15 and w.bound_after(0) == 15
    one = VerifyWidth(1)
    one.observe(0)
    assert one.drafts() == 0 and one.bound_after(0) == 0  # block 1: never drafts
    two = VerifyWidth(2)
    two.observe(0)
    assert two.drafts() == 1  # the floor never exceeds the block


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        VerifyWidth(0)
    with pytest.raises(ValueError, match="growth"):
        VerifyWidth(8, growth=0)


@given(block=st.integers(1, 64), rounds=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), max_size=30),
       adaptive=st.booleans())
def test_next_width_stays_in_the_block_and_within_the_bound_reserved_for_it(block, rounds, adaptive):
    w = VerifyWidth(block, adaptive=adaptive)
    for asked, acc in rounds:
        proposed = min(asked, w.drafts())  # a drafter may propose fewer than asked
        accepted = min(acc, proposed)
        bound = w.bound_after(proposed)
        w.observe(accepted)
        assert 0 <= w.drafts() <= block - 1
        assert w.drafts() <= bound  # the admission reserved ahead always covers the next block


def _loop(accepts: list[int], block: int, fixed_width: bool = False):
    """Run the round loop with a verifier double accepting `accepts[r]` drafts in round r."""
    from drafter_svc.clients import PrefillOut, TicketInfo, VerifyOut
    from drafter_svc.drafters import make_factory
    from drafter_svc.loop import Deadline, Finished, Request, run_request
    from pdflash.types import FinishReason, SamplingParams

    drafted: list[int] = []
    reserves: list[int] = []
    max_tokens = 200

    class Verifier:
        async def prefill(self, *args):
            return PrefillOut("s", 7, None, None, {0: frozenset({0})}, 0, 0.0)

        async def verify(self, request_id, draft, ticket, return_features, timeout):
            k = len(draft.tokens) - 1
            drafted.append(k)
            acc = min(k, accepts[len(drafted) - 1])
            done = FinishReason.LENGTH if len(drafted) == len(accepts) else None
            return VerifyOut([7] * (acc + 1), acc, done, None, {0: frozenset({0})}, 0, 0.0, 0.0)

        async def end(self, session_id):
            return True

    class Scheduler:
        async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
            if reserve_tokens:
                reserves.append(reserve_tokens)
            return TicketInfo("t", "", 0.0, 0.0, reserve_tokens or len(draft.tokens), draft.expert_bytes)

        async def release(self, ticket_id):
            return True

    async def main():
        # A prompt of one repeated token: the n-gram drafter always has a full-length match to copy.
        req = Request("r", (7,) * 8, max_tokens, SamplingParams(), (), True, block, fixed_width)
        async for ev in run_request(req, make_factory("ngram", ""), Verifier(), Scheduler(), Deadline(5.0)):
            if isinstance(ev, Finished):
                return

    asyncio.run(main())
    return drafted, reserves


def test_the_round_loop_drafts_what_the_width_controller_says():
    drafted, reserves = _loop([0, 0, 3, 12, 31, 2], block=32)
    assert drafted == [31, 3, 3, 12, 31, 31]
    # Each ahead reservation covers the widest next block the round could lead to, not the whole block
    # (round 1's, made while the first token streams, the whole first block).
    assert reserves[:4] == [32, 32, 13, 13]


def test_fixed_width_drafts_the_whole_block_every_round():
    drafted, reserves = _loop([0, 0, 3, 1], block=16, fixed_width=True)
    assert drafted == [15, 15, 15, 15]
    assert set(reserves) == {16}


def test_a_rounds_tokens_reach_the_client_even_when_the_next_round_fails():
    """Every verified round's tokens reach the client, even when a later round fails (one Verify call per
    round here; tests/test_stream_order.py has the VerifyStream path, where tokens stream behind)."""
    from drafter_svc.clients import PrefillOut, TicketInfo, VerifyOut
    from drafter_svc.drafters import make_factory
    from drafter_svc.loop import Deadline, Request, Tokens, run_request
    from pdflash.errors import Unavailable
    from pdflash.types import SamplingParams

    class Verifier:
        rounds = 0

        async def prefill(self, *args):
            return PrefillOut("s", 7, None, None, {0: frozenset({0})}, 0, 0.0)

        async def verify(self, request_id, draft, ticket, return_features, timeout):
            self.rounds += 1
            if self.rounds == 3:
                raise Unavailable("verifier went away")
            return VerifyOut([100 + self.rounds], 0, None, None, {0: frozenset({0})}, 0, 0.0, 0.0)

        async def end(self, session_id):
            return True

    class Scheduler:
        async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
            return TicketInfo("t", "", 0.0, 0.0, reserve_tokens or len(draft.tokens), draft.expert_bytes)

        async def release(self, ticket_id):
            return True

    got = []

    async def main():
        req = Request("r", (7,) * 8, 50, SamplingParams(), (), True, 8)
        with pytest.raises(Unavailable):
            async for ev in run_request(req, make_factory("ngram", ""), Verifier(), Scheduler(), Deadline(5.0)):
                if isinstance(ev, Tokens):
                    got.extend(ev.token_ids)

    asyncio.run(main())
    assert got == [7, 101, 102]  # the first token, then both verified rounds


# ---- the cost cap (offloaded experts: a verify's time grows with its width) -------------------------------

from drafter_svc.width import PROBE_EVERY, PROBE_RARE, WARM_WIDTHS, RoundCost, best_drafts  # noqa: E402


def _union_ms(n: int) -> float:
    """A gpt-oss-20b-shaped offloaded round (25% cache, H200 PCIe): 3.9 ms of compute and the copy of the union of
    the experts n tokens route at random (32 experts, top-4: 4, 7.5, 10.6, ... a layer), 24 layers."""
    union = 32 * (1 - (1 - 4 / 32) ** n)
    return 3.9 + 0.1 * n + 24 * union * 0.6 * 13.2e6 / 54e9 * 1e3


def test_best_drafts():
    near_certain = [0.99**i for i in range(16)]
    assert best_drafts(near_certain, lambda n: 10.0, 15) == 15  # free width, near-certain drafts: the whole block
    assert best_drafts([0.5**i for i in range(16)], lambda n: 1.0 + 100.0 * n, 15) == 0  # no drafts pay
    # a drafter right twice, then wrong (S = 1, 1, 1, 0, ...): two drafts, never a third, whatever its price
    assert best_drafts([1, 1, 1] + [0] * 13, _union_ms, 15) == 2
    # the same mean acceptance as a geometric rate (tau 3, a = 2/3) pays for no draft at all at these prices
    assert best_drafts([(2 / 3) ** i for i in range(16)], _union_ms, 15) == 0


def test_round_cost_fits_the_concave_growth_and_prefers_measured_means():
    cost = RoundCost()
    for n in (1, 2, 3, 4, 8) * 4:
        cost.add(n, 5.0 + 10.0 * n**0.5)
    a, b, p = cost.curve()
    assert p == pytest.approx(0.5) and a == pytest.approx(5.0) and b == pytest.approx(10.0)
    t = cost.estimator()
    assert t(4) == pytest.approx(25.0) and t(16) == pytest.approx(45.0)  # extrapolated along the curve
    cost.add(16, 60.0)  # a measured width beats the curve
    assert cost.estimator()(16) == pytest.approx(60.0)
    before = cost.curve()
    cost.add(4, 5000.0)  # one stalled round (a pause, a queue) does not price a width out
    assert cost.estimator()(4) == pytest.approx(25.0)
    assert cost.curve() == pytest.approx(before, rel=0.1)  # nor bends the curve (it goes through the medians)
    assert RoundCost().curve() is None and RoundCost().estimator() is None


def _priced(width: VerifyWidth, rounds: int, accept_of, ms_of, offloaded=True) -> list[int]:
    asked = []
    for _ in range(rounds):
        k = width.drafts()
        asked.append(k)
        acc = accept_of(k)
        width.observe(acc, k, ms_of(k + 1), offloaded)
    return asked


def test_byte_bound_rounds_cap_the_width_but_probe_on_both_sides():
    w = VerifyWidth(16)
    # accepts 2 then rejects (tau ~3); a round costs 18 ms + 12 ms per verified token
    asked = _priced(w, 160, lambda k: min(k, 2), lambda n: 18.0 + 12.0 * n)
    cap = w.cost_cap()
    assert cap == 2
    tail = asked[-2 * PROBE_RARE * PROBE_EVERY:]
    assert set(tail) == {cap - 1, cap, cap + 1} and tail.count(cap) >= 0.85 * len(tail)  # probes each way, seldom
    # the side priced well below the cap (a third draft: never accepted, 66 ms for 3 tokens against 54) is probed
    # only every PROBE_RARE-th time; the near one (one draft: 2 tokens in 42 ms) every other probe
    assert tail.count(cap + 1) < tail.count(cap - 1)
    assert w.bound_after(asked[-1]) >= w.drafts()


def test_a_drafter_right_twice_verifies_three_tokens_a_round_at_union_prices():
    """The replay drafter of benchmarks/offload.py (every 3rd draft of the reference continuation wrong, at fixed
    output positions): two drafts a round then emit 3 tokens and keep the rounds aligned with the errors; the union
    of 3 tokens' experts is smaller than 3 single-token rounds' (10.6 vs 12 experts a layer)."""
    cost = RoundCost(offloaded=True)
    asked, n = [], 0
    for _ in range(3):  # three requests share the drafter kind's prices and rates
        w, out = VerifyWidth(16, cost=cost), 0
        while out < 96:
            k = w.drafts()
            run = 0
            while run < k and (out + run) % 3 != 2:
                run += 1
            w.observe(run, k, _union_ms(k + 1), True)
            asked.append(k)
            out += run + 1
    late = asked[len(asked) // 2:]
    assert late.count(2) >= 0.7 * len(late)
    assert asked[:len(WARM_WIDTHS) + 1] == [0, *WARM_WIDTHS]  # the slow start: no full block before a price exists


def test_low_acceptance_at_union_prices_drafts_nothing_but_probes():
    import random

    rng = random.Random(0)
    w = VerifyWidth(16, cost=RoundCost(offloaded=True))

    def accept(k):
        run = 0
        while run < k and rng.random() < 0.4:
            run += 1
        return run

    late = _priced(w, 96, accept, _union_ms)[48:]
    assert late.count(0) >= 0.8 * len(late) and max(late) <= 1


def test_the_model_info_says_offloaded_so_the_first_rounds_start_small():
    slow = VerifyWidth(16, cost=RoundCost(offloaded=True))
    assert slow.drafts() == 0  # no price yet: one token, not the whole block's union
    assert VerifyWidth(16, cost=RoundCost()).drafts() == 15  # resident (or not said): the whole block first
    asked = _priced(slow, len(WARM_WIDTHS) + 1, lambda k: k, _union_ms)
    assert asked == [0, *WARM_WIDTHS]  # the first round after the prefill is not priced: its copies are the prefill's


def test_flat_rounds_and_resident_experts_keep_the_growth_rule():
    flat, resident = VerifyWidth(16), VerifyWidth(16)
    a = _priced(flat, 40, lambda k: k, lambda n: 10.0 + 0.05 * n)  # every draft accepted, width nearly free
    b = _priced(resident, 40, lambda k: min(k, 2), lambda n: 18.0 + 12.0 * n, offloaded=False)
    assert flat.cost_cap() is None and a[-1] == 15
    assert resident.cost_cap() is None and b[-1] == 9  # growth x (2 + 1): as without prices
    off = VerifyWidth(16, cost_aware=False)
    _priced(off, 40, lambda k: min(k, 2), lambda n: 18.0 + 12.0 * n)
    assert off.cost_cap() is None and off.drafts() == 9


@given(block=st.integers(1, 32), rounds=st.lists(st.tuples(st.integers(0, 31), st.integers(0, 31),
                                                            st.floats(0.1, 500.0), st.booleans()), max_size=40),
       said=st.booleans())
def test_priced_width_stays_in_the_block_and_within_the_bound(block, rounds, said):
    w = VerifyWidth(block, cost=RoundCost(offloaded=said))  # said: the model info says offloaded (slow start)
    for asked, acc, ms, offloaded in rounds:
        proposed = min(asked, w.drafts())
        accepted = min(acc, proposed)
        bound = w.bound_after(proposed)
        w.observe(accepted, proposed, ms, offloaded)
        assert 0 <= w.drafts() <= block - 1
        assert w.drafts() <= bound


def test_sessions_share_the_round_cost_so_a_new_request_starts_capped():
    shared = RoundCost()
    first = VerifyWidth(16, cost=shared)
    _priced(first, 24, lambda k: min(k, 2), lambda n: 18.0 + 12.0 * n)
    second = VerifyWidth(16, cost=shared)
    assert second.drafts() <= 3  # round 1 already capped (alone it would draft the whole block)
    assert VerifyWidth(16).drafts() == 15


def test_the_front_door_prices_widths_from_the_first_round_when_the_verifier_offloads():
    from drafter_svc.clients import TargetInfo
    from drafter_svc.servicer import FrontDoor
    from pdflash.types import DrafterKind

    def door(cache_bytes: int) -> FrontDoor:
        experts = {0: [1000] * 8, 1: [1000] * 8}  # 16 experts of 1000 bytes
        info = TargetInfo("m", "qwen3_moe", 2, 8, 100, 64, experts, (), 32, expert_cache_bytes=cache_bytes)
        return FrontDoor(None, None, {DrafterKind.NGRAM: object()}, DrafterKind.NGRAM, None, None, info)

    assert door(4000).round_costs[DrafterKind.NGRAM].offloaded  # a cache of 4 of 16 experts: the slow start
    assert not door(16000).round_costs[DrafterKind.NGRAM].offloaded  # it keeps every expert: nothing streams
    assert not door(0).round_costs[DrafterKind.NGRAM].offloaded  # resident weights
