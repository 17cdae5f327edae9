"""The /metrics endpoint serves each service's series under vLLM-style names."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdflash.metrics import (
    MAX_POSITION_LABEL,
    DrafterMetrics,
    SchedulerMetrics,
    VerifierMetrics,
    start_metrics_server,
)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def drafter():
    metrics = DrafterMetrics()
    server = start_metrics_server(0, "127.0.0.1", metrics)
    yield metrics, server
    server.close()


def test_drafter_endpoint_reports_a_request(drafter):
    metrics, server = drafter
    req = metrics.request(num_prompt_tokens=5)
    req.started()
    req.tokens(1)
    metrics.record_draft(num_draft_tokens=4, num_accepted=2)
    req.tokens(3)
    running = scrape(server.url)
    assert running[("pdflash_requests_running", ())] == 1
    req.finished("length")

    s = scrape(server.url)
    assert s[("pdflash_prompt_tokens_total", ())] == 5
    assert s[("pdflash_generation_tokens_total", ())] == 4
    assert s[("pdflash_requests_running", ())] == 0
    assert s[("pdflash_request_success_total", (("finish_reason", "length"),))] == 1
    assert s[("pdflash_time_to_first_token_seconds_count", ())] == 1
    assert s[("pdflash_inter_token_latency_seconds_count", ())] == 3
    assert s[("pdflash_e2e_request_latency_seconds_count", ())] == 1
    assert s[("pdflash_request_queue_time_seconds_count", ())] == 1
    assert s[("pdflash_spec_decode_num_drafts_total", ())] == 1
    assert s[("pdflash_spec_decode_num_draft_tokens_total", ())] == 4
    assert s[("pdflash_spec_decode_num_accepted_tokens_total", ())] == 2
    assert s[("pdflash_spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 1
    assert s[("pdflash_spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 1
    assert ("pdflash_spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),)) not in s
    # The registry is the drafter's own: no other service's series, but the process collectors.
    assert not any(name.startswith(("pdflash_verify", "pdflash_queue_length")) for name, _ in s)
    assert any(name.startswith("process_") for name, _ in s)


def test_position_label_is_bounded():
    metrics = DrafterMetrics()
    metrics.record_draft(num_draft_tokens=200, num_accepted=200)
    positions = {
        s.labels["position"]
        for f in metrics.registry.collect()
        for s in f.samples
        if s.name == "pdflash_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert len(positions) == MAX_POSITION_LABEL + 1
    assert metrics.registry.get_sample_value(
        "pdflash_spec_decode_num_accepted_tokens_per_pos_total", {"position": str(MAX_POSITION_LABEL)}
    ) == 200 - MAX_POSITION_LABEL


def test_scheduler_and_verifier_endpoints():
    sched, verif = SchedulerMetrics(), VerifierMetrics()
    sched.queue_length.set(3)
    sched.tickets_expired.inc()
    sched.admission_wait.observe(0.02)
    sched.budget_tokens_in_use.set(64)
    sched.budget_bytes_in_use.set(1 << 20)
    verif.verify_latency.observe(0.01)
    verif.prefill_latency.observe(0.1)
    verif.expert_cache_hits.inc(7)
    verif.expert_cache_misses.inc(2)
    verif.expert_bytes_moved.inc(4096)
    verif.sessions_alive.set(1)
    servers = [start_metrics_server(0, "127.0.0.1", m) for m in (sched, verif)]
    try:
        s, v = (scrape(srv.url) for srv in servers)
    finally:
        for srv in servers:
            srv.close()
    assert s[("pdflash_queue_length", ())] == 3
    assert s[("pdflash_tickets_expired_total", ())] == 1
    assert s[("pdflash_admission_wait_seconds_count", ())] == 1
    assert s[("pdflash_budget_tokens_in_use", ())] == 64
    assert s[("pdflash_budget_bytes_in_use", ())] == 1 << 20
    assert v[("pdflash_verify_latency_seconds_count", ())] == 1
    assert v[("pdflash_prefill_latency_seconds_count", ())] == 1
    assert v[("pdflash_expert_cache_hits_total", ())] == 7
    assert v[("pdflash_expert_cache_misses_total", ())] == 2
    assert v[("pdflash_expert_bytes_moved_total", ())] == 4096
    assert v[("pdflash_sessions_alive", ())] == 1
    assert not any(name.startswith("pdflash_time_to_first") for name, _ in s | v)


def test_negative_port_disables():
    assert start_metrics_server(-1, "127.0.0.1", DrafterMetrics()) is None


def test_two_services_in_one_process_do_not_collide():
    # Separate registries: building a second set of the same metrics must not raise.
    DrafterMetrics(), DrafterMetrics(), VerifierMetrics(), VerifierMetrics()


def test_the_verifier_adds_each_forwards_cache_counters_to_its_metrics():
    """A verify's expert-cache counters (CacheStats) land in the pdflash_expert_cache_* series, one to one."""
    import time
    from types import SimpleNamespace

    from verifier_svc.expert_cache import CacheStats
    from verifier_svc.servicer import VerifierServicer

    m = VerifierMetrics()
    st = CacheStats(lookups=9, hits=5, misses=4, evictions=3, prefetched=6, prefetch_used=2, bytes_moved=1000,
                    wasted_bytes=300, prefetch_aborted=2)
    VerifierServicer._observe(SimpleNamespace(metrics=m), SimpleNamespace(expert_cache=st, routed_union={}, wave_sessions=1),
                              time.perf_counter(), prefill=False)
    value = lambda name: m.registry.get_sample_value(f"pdflash_{name}_total")  # noqa: E731
    assert (value("expert_cache_hits"), value("expert_cache_misses"), value("expert_cache_evictions")) == (5, 4, 3)
    assert (value("expert_cache_prefetched"), value("expert_cache_prefetch_used"), value("expert_bytes_moved")) == (6, 2, 1000)
    assert (value("expert_cache_wasted_bytes"), value("expert_cache_prefetch_aborted")) == (300, 2)
    # an answer of a multi-session wave carries the wave's counters: the wave adds them once (observe_cache), not each answer
    VerifierServicer._observe(SimpleNamespace(metrics=m), SimpleNamespace(expert_cache=st, routed_union={}, wave_sessions=3),
                              time.perf_counter(), prefill=False)
    assert value("expert_cache_hits") == 5 and m.registry.get_sample_value("pdflash_verify_latency_seconds_count") == 2
