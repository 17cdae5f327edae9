"""Security: mutual TLS on every hop, a bearer token on the public API, scheduler-signed admission tickets.

Certificates are made here (a CA, a server certificate for 127.0.0.1/localhost, client certificates,
and a second "rogue" CA whose certificates must be refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import pathlib
import re
import subprocess
import sys
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.load import greedy_reference
from pdflash.client import Client
from pdflash.config import ConfigError, describe
from pdflash.server import CHANNEL_OPTIONS
from pdflash.tickets import TicketSigner
from pdflash.tls import channel_credentials
from pdflash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import DEVICE, start_stack

pytestmark = pytest.mark.slow

TOKEN = "test-token-0123456789"
SECRET = "ticket-secret-abcdef"
PROMPT = "def fibonacci(n):\n"


# -- certificates -------------------------------------------------------------------------------------


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: pathlib.Path, cert, key) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def _ca(cn: str):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(cn: str, ca_cert, ca_key, usages, sans=()):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


@dataclasses.dataclass
class Pki:
    ca: str
    server_cert: str  # serverAuth + clientAuth: the services also present it on their internal hops
    server_key: str
    client_cert: str
    client_key: str
    rogue_ca: str  # another CA, and a client certificate it signed: both must be refused
    rogue_client_cert: str
    rogue_client_key: str


def make_pki(d: pathlib.Path) -> Pki:
    import ipaddress

    d.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca("pdflash test CA")
    ca, _ = _write(d / "ca", ca_cert, ca_key)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _write(d / "server", *_leaf("pdflash service", ca_cert, ca_key,
                                          [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], sans))
    client = _write(d / "client", *_leaf("pdflash client", ca_cert, ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH]))
    rogue_cert, rogue_key = _ca("rogue CA")
    rogue_ca, _ = _write(d / "rogue-ca", rogue_cert, rogue_key)
    rogue_client = _write(d / "rogue-client", *_leaf("intruder", rogue_cert, rogue_key, [ExtendedKeyUsageOID.CLIENT_AUTH]))
    return Pki(ca, *server, *client, rogue_ca, *rogue_client)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(tiny, pki, tmp_path_factory):
    """mTLS on all three services and the drafter's upstream hops; bearer token; signed tickets."""
    s = start_stack(
        tiny.target("qwen3_moe"), None, tmp_path_factory.mktemp("secure-logs"),
        tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca,
        auth_token=TOKEN, ticket_secret=SECRET,
    )
    yield s
    s.stop()


def client_creds(pki: Pki) -> grpc.ChannelCredentials:
    return channel_credentials(pki.ca, pki.client_cert, pki.client_key)


def secure_channel(target: str, creds) -> grpc.Channel:
    return grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)


def health(target: str, creds=None) -> int:
    ch = secure_channel(target, creds) if creds is not None else grpc.insecure_channel(target)
    with ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


# -- TLS -----------------------------------------------------------------------------------------------


def test_generate_over_mtls_with_token_equals_greedy_reference(secure, pki, tiny):
    """The secure stack (start_stack: cpu, float32) against transformers' greedy decoding there."""
    want = greedy_reference(str(tiny.target("qwen3_moe")), PROMPT, 24, device=DEVICE)
    with Client(secure.drafter, token=TOKEN, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as c:
        got = c.generate(PROMPT, max_tokens=24, drafter="ngram")
    assert tuple(got.token_ids) == want
    assert got.usage.rounds >= 1  # admitted by the scheduler, verified with a signed ticket
    # the scheduler's Prefetch hints reach the verifier over mTLS with their signed tickets: it answers (no expert cache)
    from tests.test_services import scrape

    text = scrape(secure.spec.metrics_ports[1])
    assert 'pdflash_prefetch_hints_total{outcome="no_expert_cache"}' in text and 'outcome="failed"' not in text


@pytest.mark.parametrize("name", ["drafter", "scheduler", "verifier"])
def test_every_hop_refuses_plaintext_and_foreign_certificates(secure, pki, name):
    target = getattr(secure, name)
    assert health(target, client_creds(pki)) == health_pb2.HealthCheckResponse.SERVING
    refused = {
        "plaintext": None,
        "TLS without a client certificate": channel_credentials(pki.ca),
        "a client certificate from another CA": channel_credentials(pki.ca, pki.rogue_client_cert, pki.rogue_client_key),
        "a server checked against another CA": channel_credentials(pki.rogue_ca, pki.client_cert, pki.client_key),
    }
    for what, creds in refused.items():
        with pytest.raises(grpc.RpcError) as e:
            health(target, creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, what


def test_one_way_tls_and_option_checks(pki, tmp_path):
    """TLS without client certificates (a CA-only client connects; plaintext does not); bad option combinations."""
    from scheduler_svc import server as scheduler_server
    from scheduler_svc.config import SchedulerConfig
    from drafter_svc.config import DrafterConfig
    from verifier_svc.config import VerifierConfig

    async def main():
        sched = await scheduler_server.start(SchedulerConfig(port=0, metrics_port=-1, tls_cert=pki.server_cert, tls_key=pki.server_key))
        try:
            target = f"127.0.0.1:{sched.port}"
            async with grpc.aio.secure_channel(target, channel_credentials(pki.ca), options=CHANNEL_OPTIONS) as ch:
                st = await scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.StatsRequest(), timeout=5)
                assert st.tokens_in_use == 0
            async with grpc.aio.insecure_channel(target) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.StatsRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await sched.stop(0)

    asyncio.run(asyncio.wait_for(main(), 30))

    for bad, needle in (
        (dict(tls_cert=pki.server_cert), "--tls-cert and --tls-key go together"),
        (dict(tls_ca=pki.ca), "--tls-ca requires client certificates"),
        (dict(tls_cert=str(tmp_path / "missing.crt"), tls_key=pki.server_key), "no such file"),
    ):
        for cls in (SchedulerConfig, VerifierConfig, DrafterConfig):
            with pytest.raises(ConfigError, match=needle):
                cls(**bad).validate()
    with pytest.raises(ConfigError, match="--upstream-tls-cert and --upstream-tls-key go together"):
        DrafterConfig(upstream_tls_cert=pki.client_cert).validate()
    # Secrets never reach the start-up log line.
    assert describe(DrafterConfig(auth_token="x"))["auth_token"] == "***"
    assert describe(VerifierConfig(ticket_secret="x"))["ticket_secret"] == "***"


# -- bearer token --------------------------------------------------------------------------------------


def test_public_api_needs_the_bearer_token_health_and_reflection_do_not(secure, pki):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for token in ("", "wrong-token"):
        with Client(secure.drafter, client_creds(pki), token=token) as c:
            with pytest.raises(grpc.RpcError) as e:
                list(c.stream(Client.request(PROMPT, max_tokens=4), timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in e.value.details()
            for call in (c.model_info, lambda: c.abort("some-id")):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(secure.drafter, client_creds(pki), metadata=[("authorization", TOKEN)]) as c:  # no "Bearer " scheme
        with pytest.raises(grpc.RpcError) as e:
            c.model_info()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(secure.drafter, client_creds(pki), token=TOKEN) as c:
        assert c.model_info().architecture == "qwen3_moe"
    with secure_channel(secure.drafter, client_creds(pki)) as ch:  # an unauthenticated caller learns nothing more
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/pdflash.v1.Drafter/ModelInfo")(b"\x00", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Open without a token (a transport certificate is still needed under mTLS).
    assert health(secure.drafter, client_creds(pki)) == health_pb2.HealthCheckResponse.SERVING
    with secure_channel(secure.drafter, client_creds(pki)) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)))
        assert "pdflash.v1.Drafter" in {s.name for s in resp.list_services_response.service}


def test_cli_generate_and_health_over_mtls(secure, pki):
    env = {**os.environ, "PDFLASH_AUTH_TOKEN": TOKEN}
    tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]
    cli = [sys.executable, "-m", "pdflash.cli"]
    ok = subprocess.run([*cli, "health", secure.verifier, *tls], capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    plain = subprocess.run([*cli, "health", secure.verifier], capture_output=True, text=True, timeout=60)
    assert (plain.returncode, plain.stdout.strip()) == (1, "UNREACHABLE")  # a plaintext probe of a TLS server
    assert plain.stderr.startswith(f"pdflash health: {secure.verifier}: UNAVAILABLE: "), plain.stderr
    gen = subprocess.run([*cli, "generate", PROMPT, "--max-tokens", "6", "--stats", "--fixed-width", "--target", secure.drafter, *tls],
                         capture_output=True, text=True, timeout=120, env=env)
    assert gen.returncode == 0, gen.stderr
    assert "completion_tokens=6" in gen.stderr and re.search(r" seconds=[0-9.]+ tokens_per_second=[0-9.]+$", gen.stderr.strip()), gen.stderr
    no_token = {k: v for k, v in env.items() if k != "PDFLASH_AUTH_TOKEN"}
    denied = subprocess.run([*cli, "generate", PROMPT, "--max-tokens", "6", "--target", secure.drafter, *tls],
                            capture_output=True, text=True, timeout=120, env=no_token)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr  # (2: a value refused)


# -- signed admission tickets --------------------------------------------------------------------------


def _status(call):
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_verify_needs_a_valid_unexpired_ticket_for_exactly_this_block(secure, pki):
    creds = client_creds(pki)
    with secure_channel(secure.verifier, creds) as vch, secure_channel(secure.scheduler, creds) as sch:
        verifier = verifier_pb2_grpc.VerifierStub(vch)
        scheduler = scheduler_pb2_grpc.SchedulerStub(sch)
        pre = verifier.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7, 8], max_tokens=16, ignore_eos=True), timeout=30)
        draft = common_pb2.DraftResult(session_id=pre.session_id, round=1, tokens=[pre.first_token, 9, 10])

        def verify(**ticket):
            return verifier.Verify(verifier_pb2.VerifyRequest(draft=draft, **ticket), timeout=30)

        future, past = time.time() + 60, time.time() - 1
        sign = TicketSigner(SECRET).sign
        refused = {
            "no ticket": {},
            "unsigned": dict(ticket_id="t-1", ticket_expires_at_unix=future),
            "forged": dict(ticket_id="t-1", ticket_signature="00" * 32, ticket_expires_at_unix=future),
            "another secret": dict(ticket_id="t-1", ticket_expires_at_unix=future,
                                   ticket_signature=TicketSigner("other").sign("t-1", pre.session_id, 1, 3, 0, future)),
            "another block": dict(ticket_id="t-1", ticket_expires_at_unix=future,
                                  ticket_signature=sign("t-1", pre.session_id, 1, 2, 0, future)),
            "expired": dict(ticket_id="t-1", ticket_expires_at_unix=past,
                            ticket_signature=sign("t-1", pre.session_id, 1, 3, 0, past)),
        }
        for what, ticket in refused.items():
            code, details = _status(lambda: verify(**ticket))
            assert code == grpc.StatusCode.PERMISSION_DENIED, (what, code, details)
        assert "expired" in _status(lambda: verify(**refused["expired"]))[1]

        # A ticket for another session's block does not open this one either.
        other = scheduler.Admit(scheduler_pb2.AdmitRequest(draft=common_pb2.DraftResult(
            session_id="someone-else", round=1, tokens=[1, 2, 3])), timeout=10)
        code, _ = _status(lambda: verify(ticket_id=other.ticket_id, ticket_signature=other.signature,
                                         ticket_expires_at_unix=other.expires_at_unix))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        scheduler.Release(scheduler_pb2.ReleaseRequest(ticket_id=other.ticket_id), timeout=10)

        # A ticket admitted ahead for fewer tokens than the block does not cover it.
        short = scheduler.Admit(scheduler_pb2.AdmitRequest(draft=common_pb2.DraftResult(session_id=pre.session_id, round=1),
                                                           reserve_tokens=2), timeout=10)
        assert not short.deferred and short.tokens == 2
        code, details = _status(lambda: verify(ticket_id=short.ticket_id, ticket_signature=short.signature,
                                               ticket_expires_at_unix=short.expires_at_unix, ticket_tokens=2))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "at most 2 tokens" in details
        # Claiming the block's own size with that ticket breaks its signature.
        code, _ = _status(lambda: verify(ticket_id=short.ticket_id, ticket_signature=short.signature,
                                         ticket_expires_at_unix=short.expires_at_unix))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        scheduler.Release(scheduler_pb2.ReleaseRequest(ticket_id=short.ticket_id), timeout=10)

        # The scheduler's own ticket for this block: accepted, and the refusals changed nothing (round 1 still next).
        t = scheduler.Admit(scheduler_pb2.AdmitRequest(draft=draft), timeout=10)
        res = verify(ticket_id=t.ticket_id, ticket_signature=t.signature, ticket_expires_at_unix=t.expires_at_unix)
        assert res.round == 1 and len(res.accepted_tokens) >= 1
        assert scheduler.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id), timeout=10).released
        # A ticket admitted ahead for more tokens than the block covers round 2's shorter block.
        ahead = scheduler.Admit(scheduler_pb2.AdmitRequest(draft=common_pb2.DraftResult(session_id=pre.session_id, round=2),
                                                           reserve_tokens=8), timeout=10)
        draft = common_pb2.DraftResult(session_id=pre.session_id, round=2, tokens=[res.accepted_tokens[-1], 11])
        res2 = verify(ticket_id=ahead.ticket_id, ticket_signature=ahead.signature, ticket_expires_at_unix=ahead.expires_at_unix,
                      ticket_tokens=8)
        assert res2.round == 2
        scheduler.Release(scheduler_pb2.ReleaseRequest(ticket_id=ahead.ticket_id), timeout=10)
        assert verifier.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10).ended
