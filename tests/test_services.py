"""Every service answers health and reflection; the public API's metadata and errors behave."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from pdflash.client import Client
from pdflash.v1 import common_pb2, drafter_pb2, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow

SERVICES = {"drafter": "pdflash.v1.Drafter", "scheduler": "pdflash.v1.Scheduler", "verifier": "pdflash.v1.Verifier"}


def reflection_services(target: str) -> set[str]:
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)))
        return {s.name for s in resp.list_services_response.service}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_health_and_reflection(stack, name):
    target = getattr(stack, name)
    with grpc.insecure_channel(target) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICES[name]):
            r = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            h.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    names = reflection_services(target)
    assert {SERVICES[name], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_readiness_asks_for_the_service_by_name(stack):
    """Stack.wait_ready probes each service by name, so another server on a port (a stale process, a port
    picked twice) is never taken for the one being started; ports are picked distinct."""
    from pdflash.stack import SERVICE_NAMES, check_health, free_ports

    assert SERVICE_NAMES == SERVICES
    assert check_health(stack.verifier, SERVICE_NAMES["verifier"])
    assert not check_health(stack.verifier, SERVICE_NAMES["drafter"])
    assert len(set(free_ports(64))) == 64


def test_request_id_echoed_and_returned_in_trailing_metadata(stack):
    with Client(stack.drafter) as c:
        call = c.stub.Generate(Client.request("x = 1\n", max_tokens=4, request_id="my-req-1"), timeout=60)
        msgs = list(call)
        assert all(m.request_id == "my-req-1" for m in msgs)
        assert ("x-request-id", "my-req-1") in tuple(call.trailing_metadata())
        assert msgs[-1].HasField("final") and sum(len(m.chunk.token_ids) for m in msgs[:-1]) == 4


def test_invalid_generate_gets_field_violations(stack):
    with Client(stack.drafter) as c:
        with pytest.raises(grpc.RpcError) as e:
            # Built by hand: Client.request itself refuses the temperature (tests/test_cli_ranges.py).
            bad = drafter_pb2.GenerateRequest(prompt="", max_tokens=10**6, sampling=common_pb2.SamplingParams(temperature=-2.0))
            list(c.stream(bad, timeout=30))
    err = e.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err)
    fields = set()
    for d in status.details:
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            fields |= {v.field for v in br.field_violations}
    assert {"prompt", "max_tokens", "sampling.temperature"} <= fields


def test_model_info_and_verifier_byte_map(stack):
    with Client(stack.drafter) as c:
        info = c.model_info()
    assert info.architecture == "qwen3_moe"
    assert set(info.drafters) == {1, 2, 3, 4}
    with grpc.insecure_channel(stack.verifier) as ch:
        vi = verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10)
    assert vi.experts_per_layer == 8 and len(vi.expert_bytes) == len(vi.moe_layers)
    assert vi.total_expert_bytes == sum(sum(l.expert_bytes) for l in vi.expert_bytes)
    # the shared stack serves on the CPU (conftest.DEVICE, on a GPU host too), where the batch-invariant kernels are not
    # installed (CUDA only: tests/test_gpu_verifier.py); the verifier says which it serves
    assert not vi.batch_invariant and not vi.kernels and vi.experts_format == "native"
    assert vi.expert_cache_bytes == 0  # every expert resident: the drafter prices widths only once rounds say otherwise


def test_no_leaks_after_requests(stack):
    """After streams finish (or are cancelled), no verifier session and no scheduler budget stays held."""
    with Client(stack.drafter) as c:
        c.generate("a = 1\n", max_tokens=8)
        call = c.stream(Client.request("b = 2\n", max_tokens=200, drafter="none", ignore_eos=True), timeout=60)
        next(call)
        call.cancel()
    assert_nothing_held(stack)


def assert_nothing_held(stack) -> None:
    """No verifier session alive and no scheduler budget in use, once the clean-ups in flight have landed (5 s)."""
    import time

    with grpc.insecure_channel(stack.verifier) as vch, grpc.insecure_channel(stack.scheduler) as sch:
        for _ in range(50):
            vi = verifier_pb2_grpc.VerifierStub(vch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=5)
            st = scheduler_pb2_grpc.SchedulerStub(sch).GetStats(scheduler_pb2.StatsRequest(), timeout=5)
            if vi.sessions_alive == 0 and st.tokens_in_use == 0 and st.in_flight == 0:
                break
            time.sleep(0.1)
    assert vi.sessions_alive == 0
    assert st.tokens_in_use == 0 and st.bytes_in_use == 0 and st.in_flight == 0


def scrape(port: int) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_metrics_endpoints_count_what_happened(stack):
    d_port, s_port, v_port = stack.spec.metrics_ports
    before = metric_value(scrape(d_port), "pdflash_generation_tokens_total")
    with Client(stack.drafter) as c:
        got = c.generate("def f(x):\n", max_tokens=12, drafter="ngram", ignore_eos=True)
    d = scrape(d_port)
    assert metric_value(d, "pdflash_generation_tokens_total") - before == len(got.token_ids) == 12
    assert metric_value(d, "pdflash_time_to_first_token_seconds_count") >= 1
    assert metric_value(d, "pdflash_spec_decode_num_drafts_total") >= got.usage.rounds
    s = scrape(s_port)
    assert metric_value(s, "pdflash_admission_wait_seconds_count") >= got.usage.rounds
    assert metric_value(s, "pdflash_budget_tokens_in_use") == 0
    v = scrape(v_port)
    assert metric_value(v, "pdflash_verify_latency_seconds_count") >= got.usage.rounds
    assert metric_value(v, "pdflash_sessions_alive") == 0


def test_every_round_is_admitted_ahead_and_nothing_stays_held(stack):
    with Client(stack.drafter) as c:
        got = c.generate("def f(x):\n    return x\n" * 3, max_tokens=24, drafter="ngram", ignore_eos=True, timeout=60)
    assert got.usage.rounds >= 2
    assert got.usage.rounds_admitted_ahead == got.usage.rounds  # nothing else competes for the budget here
    with grpc.insecure_channel(stack.scheduler) as ch:
        s = scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.StatsRequest(), timeout=10)
    assert (s.in_flight, s.tokens_in_use, s.waiting) == (0, 0, 0)


def test_the_stack_shares_out_the_cores_as_pdflash_up_promises(stack):
    """On a host of 2+ cores: the drafter and the scheduler on the last core; the verifier on all, its verify
    forwards on every core but one and, with one thread, on its event loop (verifier_svc.config)."""
    import json
    import os
    import pathlib

    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("one core: nothing to share out")
    for name in ("drafter", "scheduler"):
        assert os.sched_getaffinity(stack.procs[name].pid) == {max(cores)}
    assert os.sched_getaffinity(stack.procs["verifier"].pid) == cores
    log = pathlib.Path(stack.spec.log_dir) / "verifier.log"
    ready = [json.loads(l) for l in log.read_text().splitlines() if '"verifier ready"' in l][-1]
    assert ready["torch_threads"] == len(cores) - 1
    assert ready["inline_verify"] == (len(cores) == 2)
