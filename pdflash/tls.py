"""TLS and mutual TLS for every hop, and bearer-token authentication of the public API.

Servers: a certificate and key turn TLS on; a CA as well requires clients to present a certificate
signed by it (mutual TLS). Clients: a CA checks the server (empty = the system's roots); a
certificate and key identify the client to an mTLS server. Paths are PEM files.
"""

from __future__ import annotations

import hmac
import pathlib

import grpc

from pdflash.config import ConfigError

AUTH_KEY = "authorization"


def _read(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path!r}: cannot read it ({e.strerror or e})") from None


def check_server_options(cert: str, key: str, ca: str, prefix: str = "tls") -> None:
    """Option combinations that make sense for a server; raise ConfigError naming the flags otherwise."""
    flag = "--" + prefix.replace("_", "-")
    if bool(cert) != bool(key):
        raise ConfigError(f"{flag}-cert and {flag}-key go together (the server's certificate chain and its private key)")
    if ca and not cert:
        raise ConfigError(f"{flag}-ca requires client certificates (mutual TLS), which needs TLS: set {flag}-cert and {flag}-key too")
    for name, path in (("cert", cert), ("key", key), ("ca", ca)):
        if path and not pathlib.Path(path).is_file():
            raise ConfigError(f"{flag}-{name} {path!r}: no such file")


def check_client_options(ca: str, cert: str, key: str, prefix: str) -> None:
    flag = "--" + prefix.replace("_", "-")
    if bool(cert) != bool(key):
        raise ConfigError(f"{flag}-cert and {flag}-key go together (the client's certificate and its private key)")
    for name, path in (("ca", ca), ("cert", cert), ("key", key)):
        if path and not pathlib.Path(path).is_file():
            raise ConfigError(f"{flag}-{name} {path!r}: no such file")


def check_auth_token(token: str) -> None:
    if token and any(c.isspace() for c in token):
        raise ConfigError("--auth-token must not contain whitespace (it is sent as 'Bearer <token>')")


def server_credentials(cert: str, key: str, ca: str = "") -> grpc.ServerCredentials | None:
    """None = plaintext. With ca: mutual TLS (clients must present a certificate signed by ca)."""
    if not cert:
        return None
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    root = _read(ca, "TLS CA") if ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """None = plaintext (nothing set). ca empty but cert set: the system's roots check the server."""
    if not (ca or cert or key):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "TLS CA") if ca else None,
        private_key=_read(key, "TLS client key") if key else None,
        certificate_chain=_read(cert, "TLS client certificate") if cert else None,
    )


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()


def _deny_message() -> str:
    return "missing or invalid bearer token: send metadata 'authorization: Bearer <token>' (pdflash generate --token, or PDFLASH_AUTH_TOKEN)"


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on the methods of the given services; others pass.

    Health and reflection stay open on purpose: orchestrators probe health without secrets, and
    neither reveals anything beyond service names and schemas. (Under mutual TLS they still need a
    client certificate: that is the transport, not this check.)
    """

    def __init__(self, token: str, services: list[str]):
        self._expected = f"Bearer {token}".encode()
        self._prefixes = tuple(f"/{s}/" for s in services)

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == AUTH_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED (streams need their own kind)."""
    msg = _deny_message()

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover  (makes this an async generator, as a streaming handler must be)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
