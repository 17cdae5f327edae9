"""The pure admission policy and the lease bookkeeping: unit tests and hypothesis properties."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.leases import TicketIds, TicketSigner
from scheduler_svc.policy import SCALE, AdmissionPolicy, Budgets, Demand, QueueFull

PROPS = settings(derandomize=True, max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(tokens=64, nbytes=None, *, lease_s=10.0, max_waiting=100, per_session=4, max_bypass=8, **kw) -> AdmissionPolicy:
    return AdmissionPolicy(
        Budgets(tokens, nbytes),
        lease_s=lease_s,
        max_waiting=max_waiting,
        max_waiting_per_session=per_session,
        max_bypass=max_bypass,
        ticket_ids=TicketIds("test"),
        **kw,
    )


def d(session: str, round: int, tokens: int, nbytes: int = 0) -> Demand:
    return Demand(session, round, tokens, nbytes, {0: frozenset({1, 2})})


def within_budget(p: AdmissionPolicy) -> bool:
    """The safety invariant: with two or more leases in flight, both budgets hold."""
    if len(p.leases) <= 1:
        return True
    tokens = sum(lease.tokens for lease in p.leases)
    nbytes = sum(lease.expert_bytes for lease in p.leases)
    b = p.budgets
    return (b.tokens is None or tokens <= b.tokens) and (b.expert_bytes is None or nbytes <= b.expert_bytes)


# -- units ------------------------------------------------------------------------------------------


def test_cost_is_the_dominant_share_clamped():
    b = Budgets(tokens=64, expert_bytes=1000)
    assert b.cost(16, 0) == SCALE // 4
    assert b.cost(16, 500) == SCALE // 2  # bytes dominate
    assert b.cost(640, 0) == SCALE  # over a budget costs one whole budget
    assert Budgets(None, None).cost(16, 10**9) == 1  # nothing limited: every demand costs the minimum
    assert Budgets(0, None).cost(1, 0) == SCALE


def test_seats_what_fits_and_waits_for_release():
    p = make(tokens=32)
    w1, w2, w3 = (p.submit(d(s, 1, 16), 0.0) for s in "abc")
    seated = p.pump(0.0)
    assert [a.waiter_id for a in seated] == [w1, w2]
    assert p.stats().tokens_in_use == 32 and p.stats().waiting == 1 and p.is_waiting(w3)
    assert p.pump(0.0) == []
    p.release(seated[0].lease.ticket_id, 1.0)
    (a3,) = p.pump(1.0)
    assert a3.waiter_id == w3 and a3.lease.waited_s == 1.0 and not a3.lease.alone


def test_both_budgets_must_fit():
    p = make(tokens=100, nbytes=1000)
    p.submit(d("a", 1, 10, 800), 0.0)
    assert len(p.pump(0.0)) == 1
    p.submit(d("b", 1, 10, 300), 0.0)
    assert p.pump(0.0) == []  # tokens fit, bytes do not
    assert p.stats().bytes_in_use == 800 and p.stats().waiting == 1


def test_cheaper_demands_are_funded_first_among_fresh_sessions():
    # Deficit round-robin: with no carried credit, a demand costing fewer quanta becomes eligible sooner.
    p = make(tokens=100, nbytes=1000)
    p.submit(d("a", 1, 10, 800), 0.0)
    p.submit(d("b", 1, 10, 300), 0.0)
    (first,) = p.pump(0.0)
    assert first.lease.session_id == "b"


def test_demand_over_a_budget_runs_alone():
    p = make(tokens=32, nbytes=1000)
    p.submit(d("a", 1, 8), 0.0)
    (a,) = p.pump(0.0)
    big = p.submit(d("big", 1, 100, 5000), 0.0)
    assert p.pump(0.0) == []  # never beside another lease
    p.release(a.lease.ticket_id, 0.0)
    (b,) = p.pump(0.0)
    assert b.waiter_id == big and b.lease.alone
    p.submit(d("c", 1, 1, 0), 0.0)
    assert p.pump(0.0) == []  # nothing joins it while it runs
    assert within_budget(p)


@pytest.mark.parametrize("tokens,nbytes", [(0, None), (1, None), (None, 0)])
def test_zero_or_tiny_budget_still_makes_progress(tokens, nbytes):
    p = make(tokens=tokens, nbytes=nbytes)
    for s in "abc":
        p.submit(d(s, 1, 4, 10), 0.0)
    order = []
    for _ in range(3):
        (a,) = p.pump(0.0)  # one at a time
        order.append(a.lease.session_id)
        p.release(a.lease.ticket_id, 0.0)
    assert sorted(order) == ["a", "b", "c"] and p.stats().waiting == 0


def test_release_is_idempotent():
    p = make()
    p.submit(d("a", 1, 8), 0.0)
    (a,) = p.pump(0.0)
    assert p.release(a.lease.ticket_id, 0.0) is a.lease
    before = p.stats()
    assert p.release(a.lease.ticket_id, 0.0) is None
    assert p.release("t-unknown", 0.0) is None
    assert p.stats() == before and before.released_total == 1 and before.tokens_in_use == 0


def test_expiry_reclaims_and_renew_extends():
    p = make(tokens=16, lease_s=5.0)
    p.submit(d("a", 1, 16), 0.0)
    p.submit(d("b", 1, 16), 0.0)
    (a,) = p.pump(0.0)
    assert p.next_expiry() == 5.0
    assert p.renew(a.lease.ticket_id, 4.0).expires_at == 9.0
    assert p.expire(8.9) == [] and p.pump(8.9) == []
    assert p.expire(9.0) == [a.lease]
    assert p.renew(a.lease.ticket_id, 9.0) is None
    assert p.release(a.lease.ticket_id, 9.0) is None  # expired already: not released twice
    (b,) = p.pump(9.0)
    assert b.lease.session_id == "b"
    s = p.stats()
    assert (s.expired_total, s.released_total, s.in_flight) == (1, 0, 1)


def test_renew_after_the_expiry_passed_is_refused():
    p = make(lease_s=1.0)
    p.submit(d("a", 1, 8), 0.0)
    (a,) = p.pump(0.0)
    assert p.renew(a.lease.ticket_id, 1.0) is None


def test_queue_limits_total_and_per_session():
    p = make(tokens=1, max_waiting=3, per_session=2)
    p.submit(d("a", 1, 4), 0.0)
    p.pump(0.0)  # a1 runs alone; the rest wait
    p.submit(d("a", 2, 4), 0.0)
    p.submit(d("a", 3, 4), 0.0)
    with pytest.raises(QueueFull) as e:
        p.submit(d("a", 4, 4), 0.0)
    assert e.value.scope == "session"
    p.submit(d("b", 1, 4), 0.0)
    with pytest.raises(QueueFull) as e:
        p.submit(d("c", 1, 4), 0.0)
    assert e.value.scope == "total"
    assert p.stats().rejected_total == 2 and p.stats().waiting == 3 and p.stats().sessions_waiting == 2


def test_same_session_and_round_takes_the_waiting_place():
    p = make(tokens=16)
    p.submit(d("x", 1, 16), 0.0)
    p.pump(0.0)
    w = p.submit(d("a", 1, 8), 0.0)
    p.submit(d("b", 1, 8), 0.0)
    assert p.submit(d("a", 1, 12), 1.0) == w
    assert p.stats().waiting == 2


def test_withdraw_frees_the_place_and_unblocks():
    p = make(tokens=16, max_bypass=0)
    p.submit(d("x", 1, 10), 0.0)
    (x,) = p.pump(0.0)
    blocked = p.submit(d("big", 1, 16), 0.0)
    assert p.pump(0.0) == []  # funded, but it does not fit beside x: it is the blocked pick
    p.submit(d("small", 1, 4), 0.0)
    assert p.pump(0.0) == []  # strict order: the small one may not pass the blocked big one
    assert p.withdraw(blocked) and not p.withdraw(blocked)
    (s,) = p.pump(0.0)
    assert s.lease.session_id == "small" and p.stats().waiting == 0


def test_big_demand_is_not_starved_by_a_stream_of_small_ones():
    k = 3
    p = make(tokens=16, max_bypass=k)
    p.submit(d("s0", 1, 8), 0.0)
    inflight = collections.deque(a.lease for a in p.pump(0.0))
    p.submit(d("big", 1, 16), 0.0)
    rounds = collections.Counter()
    bypasses = 0
    for step in range(200):
        for s in ("s1", "s2", "s3"):  # small ones keep arriving
            if not p._sessions.get(s) or not p._sessions[s].queue:
                rounds[s] += 1
                p.submit(d(s, rounds[s], 4), float(step))
        seated = p.pump(float(step))
        if any(a.lease.session_id == "big" for a in seated):
            break
        bypasses += len(seated)
        inflight.extend(a.lease for a in seated)
        p.release(inflight.popleft().ticket_id, float(step))
    else:
        pytest.fail("the big demand was never admitted")
    assert p.stats().in_flight == 1  # it needed the whole budget
    # DRR first needs ceil(SCALE / quantum) visits to fund a full-budget demand, then at most k bypasses.
    assert bypasses <= math.ceil(SCALE / p.quantum) * 3 + k


def test_sessions_take_turns():
    p = make(tokens=16)
    for s in "abc":
        for r in (1, 2):
            p.submit(d(s, r, 16), 0.0)
    order = []
    for _ in range(6):
        (a,) = p.pump(0.0)
        order.append(a.lease.session_id)
        p.release(a.lease.ticket_id, 0.0)
    assert order == ["a", "b", "c", "a", "b", "c"]


def test_demands_over_the_budget_all_cost_one_budget():
    # Over the budget, any demand costs one whole budget: sessions alternate whatever the overshoot.
    p = make(tokens=64, nbytes=None, per_session=8)
    counts = collections.Counter()
    rounds = collections.Counter()
    for _ in range(400):
        for s, tokens in (("light", 16), ("heavy", 32)):
            while len(p._sessions[s].queue if s in p._sessions else ()) < 4:
                rounds[s] += 1
                p.submit(d(s, rounds[s], tokens + 64), 0.0)  # all over budget: alone each time
        (a,) = p.pump(0.0)
        counts[a.lease.session_id] += 1
        p.release(a.lease.ticket_id, 0.0)
    assert counts["light"] == counts["heavy"]  # both clamp to one whole budget


def test_carried_credit_is_clamped_to_one_budget():
    p = make(tokens=64)
    for r in range(1, 5):
        p.submit(d("a", r, 1), 0.0)
    for a in p.pump(0.0):
        p.release(a.lease.ticket_id, 0.0)
    assert 0 <= p.credit("a") <= SCALE


def test_idle_sessions_are_forgotten():
    p = make(lease_s=1.0, forget_idle_s=10.0)
    p.submit(d("a", 1, 8), 0.0)
    (a,) = p.pump(0.0)
    p.release(a.lease.ticket_id, 1.0)
    p.expire(5.0)
    assert "a" in p._sessions
    p.expire(11.0)
    assert "a" not in p._sessions


def test_expert_union_travels_with_the_lease():
    p = make()
    p.submit(Demand("a", 1, 8, 100, {3: frozenset({1, 7})}), 0.0)
    (a,) = p.pump(0.0)
    assert a.lease.demand.expert_union == {3: frozenset({1, 7})}


def test_seat_now_takes_only_budget_nobody_waits_for():
    p = make(tokens=32)
    a = p.seat_now(d("a", 2, 16), 0.0)
    assert a is not None and a.waited_s == 0.0 and not a.alone
    assert p.seat_now(d("b", 1, 17), 0.0) is None  # does not fit beside a: no queueing, nothing held
    assert p.stats().waiting == 0 and len(p.leases) == 1
    p.submit(d("c", 1, 32), 0.0)
    assert p.pump(0.0) == []  # c waits for a
    assert p.seat_now(d("b", 1, 4), 0.0) is None  # fits, but c is waiting: the budget is c's
    p.release(a.ticket_id, 1.0)
    assert [x.lease.session_id for x in p.pump(1.0)] == ["c"]
    # Nothing in flight, a demand over the budget: an ahead admission never uses the alone rule.
    p.release(next(iter(p.leases)).ticket_id, 2.0)
    assert p.seat_now(d("big", 1, 64), 2.0) is None
    assert p.stats().admitted_total == 2


def test_ticket_signature():
    args = ("t-1", "sess", 3, 16, 1024, 1700000000.25)
    assert TicketSigner("").sign(*args) == ""
    s = TicketSigner("k")
    sig = s.sign(*args)
    assert len(sig) == 64 and s.verify(sig, *args)
    assert not s.verify(sig, "t-1", "sess", 3, 17, 1024, 1700000000.25)
    assert not TicketSigner("other").verify(sig, *args)


def test_ticket_ids_are_unique():
    ids = TicketIds()
    assert len({ids() for _ in range(100)}) == 100
    assert TicketIds().prefix != ids.prefix


# -- properties -------------------------------------------------------------------------------------

budgets = st.tuples(st.one_of(st.none(), st.integers(0, 64)), st.one_of(st.none(), st.integers(0, 400)))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 5), st.integers(1, 48), st.integers(0, 300)),
        st.tuples(st.just("release"), st.integers(0, 99)),
        st.tuples(st.just("withdraw"), st.integers(0, 99)),
        st.tuples(st.just("renew"), st.integers(0, 99)),
        st.tuples(st.just("tick"), st.floats(0.0, 4.0)),
        st.tuples(st.just("ahead"), st.integers(0, 5), st.integers(1, 48), st.integers(0, 300)),
    ),
    max_size=80,
)


class Run:
    """Drives a policy with ops, checking the invariants after every step and tracking every demand."""

    def __init__(self, budget, max_bypass=4):
        self.p = make(*budget, lease_s=5.0, max_waiting=12, per_session=3, max_bypass=max_bypass, forget_idle_s=8.0)
        self.now = 0.0
        self.rounds = collections.Counter()
        self.waiting: dict[int, Demand] = {}
        self.seated: dict[int, Demand] = {}
        self.live: list[str] = []

    def apply(self, op) -> None:
        kind = op[0]
        if kind == "submit":
            s = f"s{op[1]}"
            self.rounds[s] += 1
            demand = d(s, self.rounds[s], op[2], op[3])
            try:
                wid = self.p.submit(demand, self.now)
            except QueueFull:
                pass
            else:
                assert wid not in self.waiting
                self.waiting[wid] = demand
        elif kind == "release" and self.live:
            self.p.release(self.live[op[1] % len(self.live)], self.now)
        elif kind == "withdraw" and self.waiting:
            wid = sorted(self.waiting)[op[1] % len(self.waiting)]
            assert self.p.withdraw(wid)
            del self.waiting[wid]
        elif kind == "renew" and self.live:
            self.p.renew(self.live[op[1] % len(self.live)], self.now)
        elif kind == "tick":
            self.now += op[1]
            self.p.expire(self.now)
        elif kind == "ahead":
            s = f"s{op[1]}"
            self.rounds[s] += 1
            demand = d(s, self.rounds[s], op[2], op[3])
            had_waiters, held = bool(self.waiting), len(self.p.leases)
            lease = self.p.seat_now(demand, self.now)
            if lease is not None:
                assert not had_waiters, "an ahead admission took budget someone waits for"
                assert held == 0 or within_budget(self.p), "an ahead admission exceeded a budget"
                self.seated[-self.rounds.total()] = demand  # counted as admitted, never as waiting
            else:
                assert had_waiters or not self.p.budgets.fit(
                    sum(x.tokens for x in self.p.leases), sum(x.expert_bytes for x in self.p.leases), op[2], op[3])
        self.pump()

    def pump(self) -> None:
        before = len(self.p.leases)
        for a in self.p.pump(self.now):
            assert a.waiter_id in self.waiting and a.waiter_id not in self.seated
            self.seated[a.waiter_id] = self.waiting.pop(a.waiter_id)
            if a.lease.alone:
                assert before == 0 and len(self.p.leases) == 1
            before = len(self.p.leases)
        self.live = [lease.ticket_id for lease in self.p.leases]
        self.check()

    def check(self) -> None:
        p, s = self.p, self.p.stats()
        assert within_budget(p)
        assert s.tokens_in_use == sum(lease.tokens for lease in p.leases) >= 0
        assert s.bytes_in_use == sum(lease.expert_bytes for lease in p.leases) >= 0
        assert s.waiting == len(self.waiting) <= p.max_waiting
        assert s.sessions_waiting == len({dm.session_id for dm in self.waiting.values()})
        assert s.admitted_total == len(self.seated)
        assert s.admitted_total == s.released_total + s.expired_total + s.in_flight
        assert all(0 <= sess.credit <= SCALE for sess in p._sessions.values())
        if self.waiting and not len(p.leases):
            raise AssertionError("demands wait while nothing is in flight")


@PROPS
@given(budgets, ops)
def test_budget_is_never_exceeded_except_alone(budget, script):
    run = Run(budget)
    for op in script:
        run.apply(op)


@PROPS
@given(budgets, ops, st.integers(0, 4))
def test_every_waiting_demand_is_admitted_once_leases_end(budget, script, max_bypass):
    run = Run(budget, max_bypass)
    for op in script:
        run.apply(op)
    pending = set(run.waiting)
    for _ in range(len(pending) + 1):
        if not run.waiting:
            break
        for tid in list(run.live):  # every lease ends (released, or expired: same effect)
            run.p.release(tid, run.now)
        run.pump()
    assert not run.waiting
    assert pending <= set(run.seated)


@PROPS
@given(budgets, ops)
def test_release_twice_changes_nothing(budget, script):
    run = Run(budget)
    for op in script:
        run.apply(op)
    for tid in list(run.live):
        assert run.p.release(tid, run.now) is not None
        before = run.p.stats()
        assert run.p.release(tid, run.now) is None
        assert run.p.stats() == before


@PROPS
@given(budgets, ops)
def test_expiry_frees_every_forgotten_lease(budget, script):
    run = Run(budget)
    for op in script:
        run.apply(op)
    in_flight = len(run.p.leases)
    run.now += run.p.lease_s
    expired = run.p.expire(run.now)
    assert len(expired) == in_flight
    s = run.p.stats()
    assert (s.in_flight, s.tokens_in_use, s.bytes_in_use) == (0, 0, 0)
    run.pump()  # and the budget goes to whoever waits


@PROPS
@given(
    st.integers(1, 32),  # tokens per demand of the big one
    st.integers(1, 8),  # tokens per small demand
    st.integers(8, 40),  # token budget
    st.integers(2, 5),  # small sessions
    st.integers(0, 6),  # max_bypass
)
def test_no_starvation_under_a_stream_of_arrivals(big, small, budget, n_small, max_bypass):
    p = make(tokens=budget, max_waiting=100, per_session=2, max_bypass=max_bypass)
    rounds = collections.Counter()
    inflight = collections.deque()

    def top_up(now):
        for i in range(n_small):
            s = f"s{i}"
            while len(p._sessions[s].queue if s in p._sessions else ()) < 2:
                rounds[s] += 1
                p.submit(d(s, rounds[s], small), now)

    top_up(0.0)
    inflight.extend(a.lease for a in p.pump(0.0))
    p.submit(d("big", 1, big), 0.0)
    laps = math.ceil(SCALE / p.quantum)
    bound = laps * (n_small * 2 + 1) + max_bypass + budget + 2
    for step in range(1, bound + 1):
        top_up(float(step))
        seated = p.pump(float(step))
        assert within_budget(p)
        if any(a.lease.session_id == "big" for a in seated):
            return
        inflight.extend(a.lease for a in seated)
        if inflight:
            p.release(inflight.popleft().ticket_id, float(step))
    pytest.fail(f"big demand not admitted within {bound} releases")


@PROPS
@given(st.integers(2, 6), st.integers(1, 16), st.integers(1, 4), st.integers(0, 4))
def test_backlogged_sessions_with_equal_demands_share_evenly(n, tokens, per_budget, max_bypass):
    p = make(tokens=tokens * per_budget, max_waiting=100, per_session=2, max_bypass=max_bypass)
    rounds = collections.Counter()
    counts = collections.Counter()
    inflight = collections.deque()
    for step in range(60 * n):
        for i in range(n):
            s = f"s{i}"
            while len(p._sessions[s].queue if s in p._sessions else ()) < 2:
                rounds[s] += 1
                p.submit(d(s, rounds[s], tokens), float(step))
        for a in p.pump(float(step)):
            counts[a.lease.session_id] += 1
            inflight.append(a.lease)
        p.release(inflight.popleft().ticket_id, float(step))
    assert len(counts) == n
    assert max(counts.values()) - min(counts.values()) <= 2 * per_budget


@PROPS
@given(
    st.integers(32, 96),  # token budget
    st.integers(200, 1000),  # byte budget
    st.lists(st.tuples(st.integers(1, 16), st.integers(0, 100)), min_size=2, max_size=4),  # halves of the budgets
    st.integers(0, 8),  # max_bypass
)
def test_backlogged_sessions_get_similar_dominant_shares(token_budget, byte_budget, halves, max_bypass):
    # Every verify holds its lease for the same time; each session always has a budget's worth waiting.
    # Fair: the dominant share x time each session gets is within a small factor of the others'.
    sizes = [(max(1, t * token_budget // 32), b * byte_budget // 200) for t, b in halves]
    backlog = max(min(token_budget // t, byte_budget // max(b, 1)) for t, b in sizes) + 1
    p = make(tokens=token_budget, nbytes=byte_budget, max_waiting=10_000, per_session=backlog, max_bypass=max_bypass)
    hold, rounds, share, live = 4, collections.Counter(), collections.Counter(), []
    for now in range(200):
        for lease in [lease for lease in live if lease.admitted_at + hold <= now]:
            p.release(lease.ticket_id, now)
            live.remove(lease)
        for i, (tokens, nbytes) in enumerate(sizes):
            s = f"s{i}"
            while len(p._sessions[s].queue if s in p._sessions else ()) < backlog:
                rounds[s] += 1
                p.submit(d(s, rounds[s], tokens, nbytes), now)
        for a in p.pump(now):
            live.append(a.lease)
            share[a.lease.session_id] += max(a.lease.tokens / token_budget, a.lease.expert_bytes / byte_budget)
        assert within_budget(p)
    shares = [share[f"s{i}"] for i in range(len(sizes))]
    assert max(shares) <= 3 * min(shares), shares
