"""Prometheus metrics of the three services, named after vLLM's (prefix `pdflash_`).

Each service builds its own metrics object on its own registry (`DrafterMetrics()`, ...), so several
services in one process (tests) never collide, and each /metrics page shows only its service's
series. Labels are low-cardinality only: a bounded draft position, a finish reason.

Rates are left to queries, as in vLLM, e.g. the acceptance rate and mean accepted length:
    rate(pdflash_spec_decode_num_accepted_tokens_total[5m]) / rate(pdflash_spec_decode_num_draft_tokens_total[5m])
    1 + rate(pdflash_spec_decode_num_accepted_tokens_total[5m]) / rate(pdflash_spec_decode_num_drafts_total[5m])
"""

from __future__ import annotations

import dataclasses
import threading
import time
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

PREFIX = "pdflash_"
DEFAULT_PORTS = {"drafter": 9101, "scheduler": 9102, "verifier": 9103}
DISABLED = -1  # a metrics port below 0 turns the endpoint off; 0 picks a free port

# Draft positions beyond this share the last label value, so a huge block size cannot blow up the
# number of series.
MAX_POSITION_LABEL = 63

# Seconds. Sub-millisecond steps matter for the tiny CPU model; minutes for long generations.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
                    600.0, 1800.0)
_WAVE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # sessions in one verify wave


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry, with the process/platform/GC collectors a default registry would have."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
    return registry


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = new_registry() if registry is None else registry

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)


class DrafterMetrics(_Metrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first generated token.")
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive generated tokens (a round's tokens share its latency).")
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its final response.", _REQUEST_BUCKETS)
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Time from request arrival until it starts running (admission included).")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished and running requests.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens sent to clients.")
        self.request_success = self._counter(
            "request_success", "Requests that finished, by finish reason.", ("finish_reason",))
        self.spec_decode_num_drafts = self._counter("spec_decode_num_drafts", "Draft blocks sent for verification.")
        self.spec_decode_num_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens sent for verification.")
        self.spec_decode_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the verifier accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the block (0 = first).",
            ("position",))
        self.requests_running = self._gauge("requests_running", "Requests currently generating.")

    def record_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified block: `num_accepted` leading draft tokens out of `num_draft_tokens` accepted."""
        self.spec_decode_num_drafts.inc()
        self.spec_decode_num_draft_tokens.inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(num_accepted)
        for pos in range(num_accepted):
            self.spec_decode_num_accepted_tokens_per_pos.labels(str(min(pos, MAX_POSITION_LABEL))).inc()

    def request(self, num_prompt_tokens: int, arrival: float | None = None) -> RequestTimer:
        """Timing for one request; the caller marks start, tokens and finish on it."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, time.perf_counter() if arrival is None else arrival)


@dataclasses.dataclass
class RequestTimer:
    """The time points of one request, turned into TTFT, inter-token, queue and e2e observations."""

    metrics: DrafterMetrics
    arrival: float
    last_token_at: float | None = None
    running: bool = False

    def started(self) -> None:
        """The request leaves the queue (admitted, prefill begins)."""
        if not self.running:
            self.running = True
            self.metrics.request_queue_time.observe(time.perf_counter() - self.arrival)
            self.metrics.requests_running.inc()

    def tokens(self, n: int) -> None:
        """`n` tokens were just sent to the client (a round can emit several at once)."""
        if n <= 0:
            return
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(n)
        if self.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            n -= 1
        elif n:
            # Spread the round's wait over its tokens: what a client sees per token on average.
            gap = (now - self.last_token_at) / n
            for _ in range(n):
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_at = now

    def finished(self, finish_reason: str) -> None:
        """Call once, in a `finally`, with a small fixed vocabulary (stop, length, abort, error)."""
        if self.running:
            self.running = False
            self.metrics.requests_running.dec()
        self.metrics.e2e_request_latency.observe(time.perf_counter() - self.arrival)
        self.metrics.request_success.labels(finish_reason).inc()


class SchedulerMetrics(_Metrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        self.admission_wait = self._histogram("admission_wait_seconds", "Time a request waited for admission.")
        self.budget_tokens_in_use = self._gauge("budget_tokens_in_use", "Tokens of the verify budget held by leases.")
        self.budget_bytes_in_use = self._gauge("budget_bytes_in_use", "Bytes of the memory budget held by leases.")
        self.queue_length = self._gauge("queue_length", "Requests waiting for admission.")
        self.tickets_expired = self._counter("tickets_expired", "Admission tickets that expired before use.")
        self.admitted_ahead = self._counter(
            "admitted_ahead", "Admissions ahead of drafting (next round reserved while the current one verifies).", ("outcome",)
        )
        self.prefetch_hints = self._counter(
            "prefetch_hints", "Prefetch hints sent to the verifier for admitted demands, by outcome (queued, no_expert_cache, "
            "disabled, stale, failed, dropped).", ("outcome",)
        )


class VerifierMetrics(_Metrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        self.verify_latency = self._histogram("verify_latency_seconds", "Time to verify one draft block.")
        self.prefill_latency = self._histogram("prefill_latency_seconds", "Time to prefill one prompt.", _REQUEST_BUCKETS)
        self.expert_cache_hits = self._counter("expert_cache_hits", "Expert lookups served from device memory.")
        self.expert_cache_misses = self._counter("expert_cache_misses", "Expert lookups that had to load the expert.")
        self.expert_bytes_moved = self._counter("expert_bytes_moved", "Expert weight bytes copied to the device.")
        self.expert_cache_evictions = self._counter("expert_cache_evictions", "Experts evicted from the device cache.")
        self.expert_cache_prefetched = self._counter("expert_cache_prefetched", "Experts copied ahead of need (projected union, next-layer prediction).")
        self.expert_cache_prefetch_used = self._counter("expert_cache_prefetch_used", "Prefetched experts a forward used before eviction.")
        self.expert_cache_wasted_bytes = self._counter("expert_cache_wasted_bytes", "Prefetched expert bytes evicted unused.")
        self.expert_cache_prefetch_aborted = self._counter(
            "expert_cache_prefetch_aborted", "Next-layer guesses the layer did not route to: copies stopped (on a GPU part way), slots freed.")
        self.sessions_alive = self._gauge("sessions_alive", "Verifier sessions (KV caches) currently held.")
        self.prefetch_requests = self._counter(
            "prefetch_requests", "Prefetch hints answered, by outcome (queued, no_expert_cache, disabled, stale).", ("outcome",)
        )
        self.prefetch_experts_queued = self._counter("prefetch_experts_queued", "Experts queued by Prefetch hints (at most this many copied).")
        self.verify_wave_sessions = self._histogram(
            "verify_wave_sessions", "Sessions whose verifies shared one wave (--max-wave-sessions > 1).", _WAVE_BUCKETS)
        self.prefill_wave_sessions = self._histogram(
            "prefill_wave_sessions", "Prompts whose prefill forwards (or chunks) shared one forward (--max-wave-sessions > 1).",
            _WAVE_BUCKETS)


@dataclasses.dataclass
class MetricsServer:
    """The running /metrics endpoint (a daemon thread); `port` is the bound port."""

    host: str
    port: int
    _httpd: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, host: str = "127.0.0.1", metrics: _Metrics | None = None,
                         registry: CollectorRegistry | None = None) -> MetricsServer | None:
    """Serve /metrics for `metrics` (or `registry`) on host:port; None when port < 0 (disabled).

    Port 0 binds a free port (tests); the bound one is `.port` of the result.
    """
    if port < 0:
        return None
    if registry is None:
        registry = metrics.registry if metrics is not None else new_registry()
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, httpd.server_port, httpd, thread)


def start_metrics_server_logged(port: int, host: str, metrics: _Metrics, log) -> MetricsServer | None:
    """start_metrics_server, but a port already in use is a warning, not a crash of the service."""
    try:
        server = start_metrics_server(port, host, metrics)
    except OSError as e:
        log.warning("metrics endpoint not started", port=port, error=str(e))
        return None
    if server is not None:
        log.info("metrics endpoint", url=server.url)
    return server
